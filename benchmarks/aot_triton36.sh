#!/usr/bin/env bash
# Compile every kernel configuration with Triton 3.6.0 -- the GPU machine's version -- for
# sm_80 and sm_90, and hold its machine code to the checks of tests/ops/test_aot.py (no 16-bit
# scalar loads, 128-bit cp.async K/V copies, fp16/bf16 MMAs, <= 168 registers, no spills), and
# hold the fast launch (megatron_tree/ops/triton/launch.py) to its binder (tests/ops/test_launch.py).
# No GPU needed. Not part of CI (.ci/run): it installs a second Triton and takes minutes.
#
#   bash benchmarks/aot_triton36.sh              # report in ./aot_triton36
#   OUT=/some/dir VENV=/some/venv bash benchmarks/aot_triton36.sh
#
# The virtual environment sees this machine's packages (torch CPU, numpy, pytest) and holds
# only its own triton==3.6.0, which shadows the pinned 3.7.
set -euo pipefail

OUT=${OUT:-./aot_triton36}
VENV=${VENV:-${TMPDIR:-/tmp}/megatron_tree_triton36}
PY=${PY:-python3}
mkdir -p "$OUT"

[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q "triton==3.6.0"
"$VENV/bin/python" -c "import triton, torch; assert triton.__version__ == '3.6.0', triton.__version__; \
print('triton', triton.__version__, 'torch', torch.__version__)" | tee "$OUT/env.txt"

set +e
MEGATRON_TREE_AOT_MATRIX=full MEGATRON_TREE_AOT_REPORT="$OUT/rows.json" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
  "$VENV/bin/python" -m pytest tests/ops/test_aot.py -q -p no:cacheprovider -p no:timeout 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
# The fast launch's CPU checks against this Triton's own binder (argument order, one compiled kernel per plan);
# the file's interpreter tests are left out: Triton 3.6's interpreter fails with numpy 2.
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest tests/ops/test_launch.py -q -p no:cacheprovider \
  -k "binds or fix_the_compiled or constexpr" 2>&1 | tee "$OUT/launch_pytest.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
set -e

# One table row per compiled kernel (the numbers docs/kernels.md quotes).
"$VENV/bin/python" - "$OUT/rows.json" > "$OUT/summary.md" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
cols = ("kernel", "variant", "dtype", "out", "d", "heads", "p", "arch", "regs", "stack", "shared",
        "ldg_u16", "ldg_128", "ldgsts_128", "mma")
print("| " + " | ".join(cols) + " |")
print("|" + "---|" * len(cols))
for r in sorted(rows, key=lambda r: tuple(str(r.get(c, "")) for c in cols[:8])):
    cells = [", ".join(f"{k} x{v}" for k, v in r[c].items()) if c == "mma" else str(r.get(c, "")) for c in cols]
    print("| " + " | ".join(cells) + " |")
EOF
echo "pytest rc=$rc; $(grep -c '^| ' "$OUT/summary.md") table lines in $OUT/summary.md"
exit "$rc"
