#!/usr/bin/env bash
# The Megatron tests on Python 3.12 + megatron-core 0.19.2 (the main suite runs 0.16.1 on Python 3.11).
#
# Builds a virtual environment the first time (MEGATRON312_VENV, default
# $HOME/.cache/megatron_tree/venv312) with the
# Python 3.12 build of torch 2.13.0 from the package index (a CUDA build; it imports and runs on
# CPU), then runs the repo's Megatron tests from this checkout (PYTHONPATH, no editable install,
# so the shared Python 3.11 install is never re-pointed).
#   MEGATRON312_PYTHON  interpreter to build the venv with (default: python3.12, else pyenv's 3.12.1)
#   MEGATRON312_TESTS   test files to run (default below)
#   MEGATRON312_SETUP_ONLY=1  build/check the environment and stop (.ci/run builds it beside the main suite)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MEGATRON312_VENV:-$HOME/.cache/megatron_tree/venv312}
TESTS=${MEGATRON312_TESTS:-tests/integrations/megatron/test_megatron_slots.py tests/integrations/megatron/test_megatron_rollout.py tests/eval/test_megatron_eval.py tests/integrations/megatron/test_megatron_scoring.py tests/integrations/megatron/test_megatron_dynamic_stall.py tests/integrations/megatron/test_megatron_step_raises.py}
if [ ! -x "$VENV/bin/python" ]; then
    PY=${MEGATRON312_PYTHON:-python3.12}
    if ! $PY -V >/dev/null 2>&1; then
        PY="env PYENV_VERSION=3.12.1 python"  # this machine kind: Python 3.12 through pyenv
    fi
    mkdir -p "$(dirname "$VENV")"
    $PY -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import megatron.core, torch, pytest_timeout, tqdm, einops, matplotlib, psutil" 2>/dev/null; then
    "$VENV/bin/pip" install -q torch==2.13.0 numpy pyyaml pytest pytest-timeout packaging tqdm einops matplotlib psutil megatron-core==0.19.2
fi
"$VENV/bin/python" - <<'PY'
import sys
from megatron.core import package_info
assert sys.version_info[:2] >= (3, 12), sys.version
assert package_info.__version__.startswith("0.19."), package_info.__version__
print(f"python {sys.version.split()[0]}, megatron-core {package_info.__version__}")
PY
if [ "${MEGATRON312_SETUP_ONLY:-0}" = 1 ]; then
    exit 0
fi
PYTHONPATH=$PWD "$VENV/bin/python" -m pytest $TESTS -q -W ignore::UserWarning
