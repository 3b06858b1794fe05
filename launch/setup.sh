#!/usr/bin/env bash
# Install megatron_tree and everything its runs and tests need, into the current Python.
# TORCH_SPEC pins the torch build first (the CPU build on CPU machines) so that the
# package's own "torch>=2.4" does not pull a CUDA build; set it to "torch" on GPU machines.
# TRITON_SPEC pins the Triton the CUDA build of that torch pins (3.7.1 for 2.13), the one the
# interpreter and ahead-of-time compile tests were run with; otherwise pip takes the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TRITON_SPEC=${TRITON_SPEC:-triton==3.7.1}
$PYTHON -m pip install -q --disable-pip-version-check "$TORCH_SPEC" "$TRITON_SPEC" numpy
$PYTHON -m pip install -q --disable-pip-version-check -e ".[all,test]"
