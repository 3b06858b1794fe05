#!/usr/bin/env bash
# GPU check for the Triton kernels, a run of at most 5 + 9 minutes on one GPU (an H200 with
# torch + triton, no network). Run from the repository root:
#
#   bash benchmarks/gpu_check.sh            # results in $OUT (default ./gpu_out)
#   OUT=/some/dir PY=python3 bash benchmarks/gpu_check.sh
#
# Steps (benchmarks/gpu_check.py; each configuration isolated, gpu_check.json rewritten after
# each): environment -> kernel benchmark (eager, CUDA-graph replay, split vs merge device
# time, GB/s vs the 4.8 TB/s peak and a measured copy, torch SDPA and its backend) ->
# BLOCK_N x warps x stages sweep -> merge micro-benchmark -> a small model's decode step
# captured in a CUDA graph. Then benchmarks/precision.py on the GPU kernels, then the CUDA tests,
# with tests/ops/test_prefill_kernel.py's, then the prefill section (benchmarks/prefill_gpu.py),
# then the captured transformers step's CUDA test (tests/integrations/hf/test_compile_step.py -k cuda). Each part has its own time limit and a
# failing part does not stop the others. Needs python3 with torch + triton + pytest, and
# transformers for the model step (no deepspeed, megatron-core, wandb or flash-attn). Ahead-of-time compilation checks stay
# on the CPU (tests/ops/test_aot.py, benchmarks/aot_triton36.sh).
set -uo pipefail

OUT=${OUT:-./gpu_out}
PY=${PY:-python3}
mkdir -p "$OUT"

# tests/conftest.py defaults TRITON_INTERPRET to 1 (for CPU machines); here the kernels must
# be compiled for the GPU, so set it to 0 explicitly. Backend choice: by device (triton).
export TRITON_INTERPRET=0
unset MEGATRON_TREE_BACKEND
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,clocks.max.sm --format=csv || true
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.version.cuda, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1

# End to end first (benchmarks/gpu_e2e.py, at most 5 minutes): transformers eager and compiled
# against tree attention eager and compiled, Llama-3.1-8B's layer dims x 8, 32K and 128K.
# E2E=0 skips it; E2E_ONLY=1 runs only it (the rest needs 9 more minutes: two device calls).
if [ "${E2E:-1}" = 1 ]; then
  timeout 300 "$PY" -m benchmarks.gpu_e2e --contexts 32768 131072 --layers 8 --new-tokens 32 --out "$OUT" \
    > "$OUT/gpu_e2e.log" 2>&1
  echo "gpu_e2e=$? (0 = ok, 124 = timed out)" | tee "$OUT/status_e2e.txt"
  tail -n 30 "$OUT/gpu_e2e.log"
  [ "${E2E_ONLY:-0}" = 1 ] && exit 0
fi

# 210 s for the measurements (the script keeps per-step budgets inside this), 2 min for tests,
# 60 s for the prefill kernels, 120 s for the captured steps' test: 9 minutes in all.
timeout 210 "$PY" -m benchmarks.gpu_check --out "$OUT" --budget-s 190 > "$OUT/gpu_check.log" 2>&1
check_rc=$?

# Exactness at large logits: fp32 vs fp64 partial lse through the kernels.
timeout 30 "$PY" -m benchmarks.precision --backend triton --device cuda --tokens 4096 --out "$OUT" \
  > "$OUT/precision.md" 2>&1
prec_rc=$?

timeout 120 "$PY" -m pytest tests/ops/test_kernels.py tests/ops/test_prefill_kernel.py tests/ops/test_launch.py -k cuda -q -rA -p no:cacheprovider \
  --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
cuda_rc=$?

# Prefill: the fused CUDA prefill kernels (which one each piece of a ring step launches, error
# against fp64 vs same-dtype SDPA, time vs one causal SDPA over the whole prompt); their tests
# ran with the CUDA tests above (tests/ops/test_prefill_kernel.py -k cuda).
timeout 60 "$PY" -m benchmarks.prefill_gpu --tokens 16384 --cp 2 --out "$OUT" > "$OUT/prefill_gpu.log" 2>&1
prefill_rc=$?

# The captured transformers step (Inductor's CUDA graphs, mode='reduce-overhead') against the eager one,
# in the package's loop, asked for and by default (compile_step='auto'), and transformers' generate on the
# default: its own call and limit, since its compilation time is not known yet.
timeout 120 "$PY" -m pytest tests/integrations/hf/test_compile_step.py -k cuda -q -rA -p no:cacheprovider \
  > "$OUT/captured_step_test.log" 2>&1
captured_rc=$?

echo "gpu_check=$check_rc precision=$prec_rc cuda_tests=$cuda_rc prefill=$prefill_rc captured_step=$captured_rc (0 = ok, 124 = timed out)" \
  | tee "$OUT/status.txt"
tail -n 40 "$OUT/gpu_check.log"
tail -n 15 "$OUT/cuda_tests.log"
tail -n 8 "$OUT/prefill_gpu.log"
tail -n 5 "$OUT/captured_step_test.log"
[ "$check_rc" -eq 0 ] && [ "$prec_rc" -eq 0 ] && [ "$cuda_rc" -eq 0 ] && [ "$prefill_rc" -eq 0 ] && [ "$captured_rc" -eq 0 ]
