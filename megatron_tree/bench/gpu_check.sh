#!/usr/bin/env bash
# GPU check for the Triton kernels: the CUDA tests, the AOT/API tests under the GPU machine's
# Triton (3.6), and the kernel benchmark. Run from the repository root on a GPU machine:
#
#   bash megatron_tree/bench/gpu_check.sh            # results in ./gpu_out
#   OUT=/some/dir PEAK_TBPS=4.8 bash megatron_tree/bench/gpu_check.sh
#
# Needs only python3 with torch + triton + pytest (no deepspeed, megatron-core or wandb).
# Worst case ~5 minutes: each step has its own time limit and a failing step does not stop
# the others. Everything (logs, JUnit XML, benchmark JSON, status) is written under $OUT.
set -uo pipefail

OUT=${OUT:-./gpu_out}
PY=${PY:-python3}
PEAK_TBPS=${PEAK_TBPS:-4.8}
mkdir -p "$OUT"

# tests/conftest.py defaults TRITON_INTERPRET to 1 (for CPU machines); here the kernels must
# be compiled for the GPU, so set it to 0 explicitly. Backend choice: by device (triton).
export TRITON_INTERPRET=0
unset MEGATRON_TREE_BACKEND
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
  "$PY" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__, torch.cuda.get_device_name())"
} > "$OUT/env.txt" 2>&1

timeout 100 "$PY" -m pytest tests/test_kernels.py -k cuda -q -rA -p no:cacheprovider \
  --junitxml="$OUT/cuda_tests.xml" > "$OUT/cuda_tests.log" 2>&1
cuda_rc=$?

timeout 60 "$PY" -m pytest tests/test_aot.py -q -rA -p no:cacheprovider \
  --junitxml="$OUT/aot_tests.xml" > "$OUT/aot_tests.log" 2>&1
aot_rc=$?

timeout 140 "$PY" -m megatron_tree.bench.kernel --device cuda --peak-tbps "$PEAK_TBPS" --out "$OUT" \
  > "$OUT/kernel_bench.log" 2>&1
bench_rc=$?

echo "cuda_tests=$cuda_rc aot_tests=$aot_rc kernel_bench=$bench_rc (0 = ok, 124 = timed out)" | tee "$OUT/status.txt"
tail -n 5 "$OUT/cuda_tests.log" "$OUT/aot_tests.log"
cat "$OUT/kernel_bench.log"
[ "$cuda_rc" -eq 0 ] && [ "$aot_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
