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


# The longest test files first (their wall time in .ci/run's log, slowest first; refresh from a run's
# --durations when the order changes). Under `-n 2 --dist loadfile` a worker takes the next file when it
# finishes one, so a long file started last leaves the other worker with nothing to do at the end: starting
# the long ones first lets the short ones fill in beside them. The order within a file is unchanged.
LONGEST_FIRST = (
    "tests/integrations/hf/test_compile_step.py",
    "tests/eval/test_launch.py",
    "tests/test_examples.py",
    "tests/integrations/test_lm_eval.py",
    "tests/ops/test_aot.py",
    "tests/integrations/test_lm_eval_ruler.py",
    "tests/integrations/megatron/test_megatron.py",
    "tests/integrations/megatron/test_megatron_slots.py",
    "tests/integrations/megatron/test_megatron_dynamic.py",
    "tests/integrations/hf/test_hf.py",
    "tests/decode/test_speculative.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = str(config.rootpath)

    def key(item):
        path = os.path.relpath(str(item.path), root).replace(os.sep, "/")
        return rank.get(path, len(LONGEST_FIRST))

    items[:] = sorted(items, key=key)  # stable: every other file keeps its place
