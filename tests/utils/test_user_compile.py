"""``utils.user_compile`` in one process, with a real ``torch.compile(fullgraph=True)`` around a host frame:
only the function handed to ``with_callback`` is traced; the host work after it runs eagerly."""

import torch
from torch._dynamo.testing import CompileCounter

from megatron_tree.utils import user_compile


def test_with_callback_takes_the_callback_aside_again_for_the_host_work_after_it():
    """A host frame (skipped by Dynamo) runs a device half under the compile's callback, then reads a
    value on the host (a graph break, so an error under fullgraph=True were it traced): it runs, the
    device half is one compiled frame, and no callback is in place after ``with_callback`` returns."""
    after = []

    def device_half(x):
        return x * 2 + 1

    def host_read(y):
        return float(y.sum())

    def host(x):
        prior = user_compile.set_eval_frame(None)
        try:
            assert user_compile.compiling(prior)
            y = user_compile.with_callback(prior, device_half, x)
            total = host_read(y)  # eager: a traced frame would break the fullgraph compile here
            after.append(user_compile.set_eval_frame(None))  # what is in place now (None: nothing)
            return y, total
        finally:
            user_compile.set_eval_frame(prior)

    user_compile.host_frame(host, "a traced frame called a host frame")
    torch._dynamo.reset()
    frames = CompileCounter()
    y, total = torch.compile(host, fullgraph=True, backend=frames)(torch.arange(4.0))
    assert torch.equal(y, torch.arange(4.0) * 2 + 1) and total == 16.0
    assert after == [None] and frames.frame_count == 1
    torch._dynamo.reset()
