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


def test_many_models_compiled_in_one_process_each_pass_the_fullgraph_count():
    """Ten tree-enabled models, each with ``model.forward = torch.compile(..., fullgraph=True)`` and a backend of
    its own, each running a prefill forward (which traces nothing but the empty frame the fullgraph count
    needs) in one process: past Dynamo's recompile limit of 8 traces per code object, each compile's frame
    is a code object of its own -- one shared frame failed at the ninth model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    torch._dynamo.reset()
    ids = torch.tensor([[5, 17, 99, 3, 42]])
    base = enable_tree_attention(hf_model("llama"), None)
    with torch.no_grad():
        want = base(ids).logits
        for _ in range(10):
            model = enable_tree_attention(hf_model("llama"), None)
            counter = CompileCounterWithBackend("eager")
            model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
            assert torch.equal(model(ids).logits, want)
            assert counter.frame_count == 1  # the empty frame; the prefill itself ran eagerly
    torch._dynamo.reset()
