#!/usr/bin/env bash
# The main job on one CPU machine: NPROC processes over gloo; the default config is a tiny
# Megatron-Core GPTModel at CP 4 = 2 simulated nodes x 2, wandb offline. Extra arguments are
# key=value config overrides, e.g.
#   bash launch/local.sh eval.context_lengths=[512,2048] output_dir=outputs/mine
#   CONFIG=configs/cpu_tiny_llama.yaml bash launch/local.sh          # a random transformers Llama instead
#   MODULE=megatron_tree.eval.generate bash launch/local.sh --prompt "5 17 3"   # generation
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-4}
CONFIG=${CONFIG:-configs/cpu_tiny.yaml}
MODULE=${MODULE:-megatron_tree.eval}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m "$MODULE" --config "$CONFIG" "$@"
