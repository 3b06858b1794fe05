"""``one_thread``: a module fixture that runs the module's in-process torch work on one intra-op thread.

The tests' tensors are tiny (a 64-wide Llama, a handful of keys per row), and the CPU decode path runs one
small bmm per batch row: with torch's default pool (one thread per core), every such op wakes the other
threads, which spin for work there is none of. On this 2-core CI machine that spinning is most of the CPU
time these modules spend in-process (speculative sampling's 1,500-row generate: 11.7 cpu-s on 2 threads,
2.0 cpu-s on 1, the same tokens). Ranks started by ``run_ranks`` already run on one thread; this gives the
single-process side (references, world-1 runs) the same setting. The thread count is the subject of none of
these tests; the previous count is restored when the module ends, so other modules in the same worker
run as before.
"""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
