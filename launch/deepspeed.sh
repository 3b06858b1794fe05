#!/usr/bin/env bash
# The DeepSpeed launcher. One node: NUM_GPUS processes (on a CPU machine, NUM_GPUS CPU
# processes over gloo). Several nodes: HOSTFILE=<MPI-style hostfile> ("node-0 slots=8"
# per line); the launcher reaches the nodes over pdsh/ssh.
#   NUM_GPUS=8 CONFIG=configs/llama31_8b_1node.yaml bash launch/deepspeed.sh model.path=/ckpt/Llama-3.1-8B
# Extra arguments are key=value config overrides. The eval ignores the --local_rank the
# launcher appends and reads LOCAL_RANK/LOCAL_SIZE from the environment. MODULE=megatron_tree.eval.generate
# generates instead of evaluating.
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_GPUS=${NUM_GPUS:-8}
HOSTFILE=${HOSTFILE:-}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}   # with a multi-node hostfile: an address of its first host
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:-configs/llama31_8b_1node.yaml}
MODULE=${MODULE:-megatron_tree.eval}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Without a hostfile: this node only; with one: its hosts (no ssh probe, so localhost works).
if [ -n "$HOSTFILE" ]; then WHERE=(--hostfile "$HOSTFILE" --no_ssh_check); else WHERE=(--num_gpus "$NUM_GPUS"); fi
exec deepspeed "${WHERE[@]}" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --module "$MODULE" --config "$CONFIG" "$@"
