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

# The in-process torch work of the tests (references, world-1 runs, checkpoints trained) on one intra-op thread,
# as every rank of run_ranks runs: the tensors are tiny, and on the 2-core CI machine, shared by two pytest workers
# and their ranks, torch's second thread spins for a core at every small op (speculative sampling's 1,500-row
# generate: 11.7 CPU-s on two threads, 2.0 on one; the tiny checkpoint's training 77 and 16, the same bytes).
# No test is about the thread count; one that needs others sets them itself.
import torch  # noqa: E402 -- after the environment above

torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: tests.helpers, benchmarks
