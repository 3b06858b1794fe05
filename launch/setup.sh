#!/usr/bin/env bash
# Install megatron_tree and everything its runs and tests need, into the current Python.
# TORCH_SPEC pins the torch build first (the CPU build on CPU machines) so that the
# package's own "torch>=2.4" does not pull a CUDA build; set it to "torch" on GPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
$PYTHON -m pip install -q --disable-pip-version-check "$TORCH_SPEC" numpy
$PYTHON -m pip install -q --disable-pip-version-check -e ".[test]"
