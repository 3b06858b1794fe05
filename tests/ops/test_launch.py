"""A planned launch's fast path hands the compiled kernel what Triton's JIT would (``ops/triton/launch.py``).

On CPU the claim is held to Triton's own binder for the GPU (sm_90): the arguments in the order and number the
JIT binds them, and a compiled kernel fixed by the plan and the tensors' alignment. The CUDA tests compare the
two paths' bits and check the JIT is skipped after the first call.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.launches import decode_launch_calls

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                                reason="needs a CUDA device and compiled kernels (TRITON_INTERPRET unset)")


def _gpu_binder(kernel):
    """The JIT function behind ``kernel`` and its binder for an sm_90 GPU, as ``JITFunction.run`` builds it."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import jit

    from megatron_tree.ops.triton.aot import _as_jit

    fn = _as_jit(kernel)
    return fn, jit.create_function_from_signature(fn.signature, fn.params, CUDABackend(GPUTarget("cuda", 90, 32)))


def _key(launch):
    """The key Triton's kernel cache looks the compiled kernel up by, for ``launch`` on an sm_90 GPU."""
    from triton.runtime import jit

    fn, binder = _gpu_binder(launch.kernel)
    _, specialization, options = binder(*launch.args, **launch.kwargs, debug=False)
    return jit.compute_cache_key({}, specialization, options)


def _planned(name):
    from megatron_tree.ops.triton import flash_decode as fd

    q, k, v, kw = decode_launch_calls()[name]
    return fd.decode_launches(q, k, v, **kw)[2], (q, k, v, kw)


def test_the_fast_path_hands_the_compiled_kernel_the_arguments_the_jit_binds():
    """Every planned launch (split and merge, every argument variant): its args then the constexprs, in signature
    order with defaults, are what the JIT's binder binds -- the same objects, the same number; and the slot's
    tensor count is exactly the launch's leading tensors."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton.launch import constexpr_values

    fd.clear_plans()
    seen = set()
    for name, (q, k, v, kw) in decode_launch_calls().items():
        for launch in fd.decode_launches(q, k, v, **kw)[2]:
            fn, binder = _gpu_binder(launch.kernel)
            bound, _, _ = binder(*launch.args, **launch.kwargs, debug=False)
            ours = launch.args + constexpr_values(fn, len(launch.args), launch.kwargs)
            assert len(ours) == len(bound), name
            for mine, theirs in zip(ours, bound.values()):
                assert mine is theirs or (not isinstance(mine, torch.Tensor) and mine == theirs), name
            n = launch.fast.tensors
            assert all(isinstance(a, torch.Tensor) for a in launch.args[:n]), name
            assert not any(isinstance(a, torch.Tensor) for a in launch.args[n:]), name
            seen.add((fn.__name__, n))
    assert len(seen) == 2  # the split kernel (10 tensors) and the merge (4) were both checked


def test_a_plan_and_aligned_tensors_fix_the_compiled_kernel_and_a_misaligned_tensor_leaves_the_fast_path():
    """Every call that shares a plan (its fast slot) with other, aligned tensors looks up one compiled kernel in
    Triton's cache -- over every argument variant of decode and merge, so a plan key that missed a dtype or a
    constant would put two compiled kernels behind one slot; a tensor 2 bytes off 16-byte alignment needs another
    kernel, and the fast path's own test sends it to the JIT."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk
    from megatron_tree.ops.triton.launch import _aligned

    fd.clear_plans()
    mk._PLANS.clear()
    by_slot: dict = {}
    for name, (q, k, v, kw) in decode_launch_calls().items():
        for tensors in ((q, k, v), (q.clone(), k.clone(), v.clone())):
            for launch in fd.decode_launches(*tensors, **kw)[2]:
                assert _aligned(launch.args, launch.fast.tensors), name
                by_slot.setdefault(id(launch.fast), (launch.fast, set()))[1].add(_key(launch))
    g = torch.Generator().manual_seed(1)
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)
    for o, lse in [(outs, lses), (outs.bfloat16(), lses), (outs.half(), lses), (outs, lses.double()),
                   (outs[:2], lses[:2]), (outs.clone(), lses.clone())]:
        launch = mk.planned_launch(o, lse)[2]
        by_slot.setdefault(id(launch.fast), (launch.fast, set()))[1].add(_key(launch))
    assert len(by_slot) == len(fd._PLANS) + sum(p.merge is not None for p in fd._PLANS.values()) + len(mk._PLANS)
    assert all(len(keys) == 1 for _, keys in by_slot.values())
    assert len(mk._PLANS) == 5  # the clone shared a plan; nothing else did
    first, (q, k, v, kw) = _planned("base")
    buf = torch.empty(k.numel() + 8, dtype=k.dtype)
    shifted = buf[1:1 + k.numel()].view(k.shape)  # 2 bytes past a 16-byte boundary
    shifted.copy_(k)
    [launch] = fd.decode_launches(q, shifted, shifted, **kw)[2]
    assert shifted.data_ptr() % 16 == 2 and _key(launch) != _key(first[0])
    n = launch.fast.tensors
    for i in range(n):  # whichever tensor it is
        assert not _aligned(first[0].args[:i] + (shifted,) + first[0].args[i + 1:], n), i
    assert _aligned(first[0].args, n)


def test_constexpr_values_follow_the_signature_and_fill_defaults():
    """A kernel with a defaulted constexpr the launch does not pass: the binder binds its default, in order."""
    import triton
    import triton.language as tl

    from megatron_tree.ops.triton.launch import constexpr_values

    @triton.jit
    def toy(X, n, A: tl.constexpr, B: tl.constexpr = 3, C: tl.constexpr = 5):
        tl.store(X + tl.arange(0, A), n + B + C)

    fn, binder = _gpu_binder(toy)
    x = torch.zeros(4)
    kwargs = {"C": 7, "A": 4, "num_warps": 1}
    bound, _, _ = binder(x, 2, **kwargs, debug=False)
    assert constexpr_values(fn, 2, kwargs) == (4, 3, 7) == tuple(bound.values())[2:]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's path")
def test_the_interpreter_keeps_no_compiled_kernel():
    """Under TRITON_INTERPRET=1 a planned launch runs through the interpreter every time and keeps nothing."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops import reference

    fd.clear_plans()
    q, k, v, kw = decode_launch_calls()["3 splits"]
    q, k, v = q.float(), k.float(), v.float()
    for _ in range(2):
        out, lse = fd.flash_decode(q, k, v, **kw)
    launches = fd.decode_launches(q, k, v, **kw)[2]
    assert len(launches) == 2 and all(launch.fast.compiled is None for launch in launches)
    ref_o, ref_l = reference.partial_attention(q.double(), k.double(), v.double(), cache_seqlens=kw["cache_seqlens"])
    assert (out - ref_o).abs().max() < 1e-5 and (lse - ref_l).abs().max() < 1e-5


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_fast_launches_give_the_jits_bits_and_skip_the_jit(monkeypatch, num_splits):
    from triton.runtime.jit import JITFunction

    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import launch as launch_mod

    g = torch.Generator().manual_seed(8)
    dev = torch.device("cuda")
    q = torch.randn(2, 1, 32, 128, generator=g).bfloat16().to(dev)
    k, v = (torch.randn(2, 4096, 8, 128, generator=g).bfloat16().to(dev) for _ in range(2))
    lens = torch.tensor([4000, 3], dtype=torch.int32, device=dev)
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", False)
    fd.clear_plans()
    want = fd.flash_decode(q, k, v, cache_seqlens=lens, num_splits=num_splits)
    monkeypatch.setattr(launch_mod, "FAST_LAUNCH", True)
    fd.clear_plans()
    first = fd.flash_decode(q, k, v, cache_seqlens=lens, num_splits=num_splits)  # through the JIT: kept
    runs = []
    jit_run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **kw: runs.append(self) or jit_run(self, *a, **kw))
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    second = fd.flash_decode(q2, k2, v2, cache_seqlens=lens, num_splits=num_splits)
    torch.cuda.synchronize()
    assert not runs  # every launch of the second call skipped the JIT
    for got in (first, second):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_merge_states_plans_each_signature_apart():
    """merge_states plans its launch once per signature: calls that differ in one part of it each (the number
    of states with the same strides, the dtype, a strided outs or lses, float64 lses), one after another, each
    give the reference merge -- a plan of another signature would read the wrong strides or states."""
    from megatron_tree.ops import reference
    from megatron_tree.ops.triton import merge as mk

    g = torch.Generator().manual_seed(2)
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)
    calls = {
        "base": (outs, lses),
        "2 states, same strides": (outs[:2], lses[:2]),
        "bf16": (outs.bfloat16(), lses),
        "outs strided": (torch.randn(3, 2, 1, 4, 32, generator=g)[..., ::2], lses),
        "lses strided": (outs, torch.randn(3, 2, 4, 2, generator=g)[..., 1:]),
        "lses float64": (outs, lses.double()),
    }
    mk._PLANS.clear()
    for name, (o, lse) in calls.items():
        got_o, got_l = mk.merge_states(o, lse)
        ref_o, ref_l = reference.merge_states(o.double(), lse.double())
        tol = 1e-2 if o.dtype == torch.bfloat16 else 1e-5
        assert (got_o.double() - ref_o).abs().max() < tol and (got_l.double() - ref_l).abs().max() < 1e-5, name
    assert len(mk._PLANS) == len(calls)
    mk.merge_states(outs.clone(), lses.clone())  # a repeated signature: its plan
    assert len(mk._PLANS) == len(calls)


def test_a_callers_change_to_a_planned_launchs_kwargs_stays_with_that_launch():
    """A planned launch's kwargs are its own, as decode_config's and merge_config's copies are
    (tests/ops/test_kernels.py): a caller that changes them (a sweep of num_warps, say) must not change the launch
    of the next call of the same signature -- for decode's split and merge launches and for merge_states'."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    q, k, v, kw = decode_launch_calls()["3 splits"]
    g = torch.Generator().manual_seed(4)
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)

    def build():
        return fd.decode_launches(q, k, v, **kw)[2] + [mk.planned_launch(outs, lses)[2]]

    fd.clear_plans()
    mk._PLANS.clear()
    first = build()
    want = [dict(launch.kwargs) for launch in first]
    assert len(first) == 3
    for launch in first:
        launch.kwargs["num_warps"] = 2 * launch.kwargs["num_warps"]
        launch.kwargs["HEAD_DIM"] = 8
    assert [launch.kwargs for launch in build()] == want
