#!/usr/bin/env bash
# The main job on one CPU machine: NPROC processes over gloo (the default config simulates
# 2 nodes x 2), wandb offline. Extra arguments are key=value config overrides, e.g.
#   bash launch/local.sh eval.context_lengths=[512,2048] output_dir=outputs/mine
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NPROC=${NPROC:-4}
CONFIG=${CONFIG:-configs/cpu_tiny.yaml}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m megatron_tree.eval --config "$CONFIG" "$@"
