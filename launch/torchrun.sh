#!/usr/bin/env bash
# torchrun on one or more nodes (run this same line on every node). Single node:
#   NPROC_PER_NODE=8 CONFIG=configs/llama31_8b_1node.yaml bash launch/torchrun.sh model.path=/ckpt/Llama-3.1-8B
# Multi-node: NNODES=2 MASTER_ADDR=<node 0> on every node (c10d rendezvous, any node rank order).
# Extra arguments are key=value config overrides; MODULE=megatron_tree.eval.generate generates instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-megatron_tree}
CONFIG=${CONFIG:-configs/llama31_8b_1node.yaml}
MODULE=${MODULE:-megatron_tree.eval}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
    --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$RDZV_ID" \
    -m "$MODULE" --config "$CONFIG" "$@"
