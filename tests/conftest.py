"""Test session setup: environment that must exist before any project module is imported."""

import os
import sys

# The Triton interpreter is read when @triton.jit decorates a kernel, so it must be set
# before megatron_tree.ops.triton is imported (docs/design.md, platform facts). It does not change the default backend.
os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests hold real offline wandb runs: a shell's WANDB_MODE=disabled (or WANDB_DISABLED), which the eval
# honours, would turn them off
os.environ["WANDB_MODE"] = "offline"
os.environ.pop("WANDB_DISABLED", None)
os.environ.setdefault("WANDB_SILENT", "true")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.helpers, benchmarks
