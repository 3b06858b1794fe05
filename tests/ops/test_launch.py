"""A planned launch's fast path hands the compiled kernel what Triton's JIT would (``ops/triton/launch.py``).

On CPU the claim is held to Triton's own binder for the GPU (sm_90): the arguments in the order and number the
JIT binds them, and a compiled kernel fixed by the plan and the tensors' alignment. The CUDA tests compare the
two paths' bits and check the JIT is skipped after the first call.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.launches import decode_launch_calls, merge_calls

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
    from megatron_tree.ops.triton import merge as mk
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
    g = torch.Generator().manual_seed(6)
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)
    launch = mk.planned_launch(outs, lses)[2]  # merge_states' own plan: its slot counts its tensors too
    n = launch.fast.tensors
    assert all(isinstance(a, torch.Tensor) for a in launch.args[:n])
    assert not any(isinstance(a, torch.Tensor) for a in launch.args[n:])


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
    # _aligned is Triton's own alignment specialisation, offset by offset: the fast path runs exactly where the
    # kept kernel is the JIT's pick (2 to 32 bytes past a 64-byte boundary)
    buf = torch.empty(k.numel() + 64, dtype=k.dtype)
    assert buf.data_ptr() % 64 == 0
    for shift in (1, 2, 4, 8, 16):
        moved = buf[shift:shift + k.numel()].view(k.shape)
        [launch] = fd.decode_launches(q, moved, moved, **kw)[2]
        assert launch.fast is first[0].fast  # one plan: only the alignment differs
        assert _aligned(launch.args, n) == (_key(launch) == _key(first[0])) == (shift % 8 == 0), shift


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

    calls = merge_calls()
    mk._PLANS.clear()
    for name, (o, lse) in calls.items():
        got_o, got_l = mk.merge_states(o, lse)
        ref_o, ref_l = reference.merge_states(o.double(), lse.double())
        tol = 1e-2 if o.dtype == torch.bfloat16 else 1e-5
        assert (got_o.double() - ref_o).abs().max() < tol and (got_l.double() - ref_l).abs().max() < 1e-5, name
    assert len(mk._PLANS) == len(calls)
    outs, lses = calls["base"]
    mk.merge_states(outs.clone(), lses.clone())  # a repeated signature: its plan
    assert len(mk._PLANS) == len(calls)


def test_a_callers_change_to_a_planned_launchs_kwargs_stays_with_that_launch():
    """A planned launch's kwargs are its own, as decode_config's and merge_config's copies are
    (tests/ops/test_kernels.py): a caller that changes them (a sweep of num_warps, say) must not change the launch
    of the next call of the same signature -- for decode's split and merge launches and for merge_states'."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    calls = decode_launch_calls()
    g = torch.Generator().manual_seed(4)
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)

    def build():  # one split (its launch writes out), three (split and merge), and merge_states' own
        return [launch for name in ("base", "3 splits")
                for launch in fd.decode_launches(*calls[name][:3], **calls[name][3])[2]] + \
            [mk.planned_launch(outs, lses)[2]]

    fd.clear_plans()
    mk._PLANS.clear()
    first = build()
    want = [dict(launch.kwargs) for launch in first]
    assert len(first) == 4
    for launch in first:
        launch.kwargs["num_warps"] = 2 * launch.kwargs["num_warps"]
        launch.kwargs["HEAD_DIM"] = 8
    assert [launch.kwargs for launch in build()] == want


def test_plans_stay_bounded_and_a_dropped_plan_is_built_again_alike(monkeypatch):
    """A server's shapes come and go (a paged pool's block count is part of a decode signature): past their bound
    the plans start afresh, decode's and merge_states' alike, and a signature whose plan was dropped gets the same
    launches again."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    monkeypatch.setattr(fd, "_MAX_PLANS", 3)
    monkeypatch.setattr(mk, "_MAX_PLANS", 3)
    fd.clear_plans()
    mk._PLANS.clear()
    q, k, v, kw = decode_launch_calls()["base"]
    g = torch.Generator().manual_seed(7)
    outs, lses = torch.randn(2, 1, 1, 2, 8, generator=g), torch.randn(2, 1, 2, 1, generator=g)
    first = fd.decode_launches(q, k[:, :8], v[:, :8], **kw)[2][0]
    first_merge = mk.planned_launch(outs[..., :1], lses)[2]
    for n in range(8, 20):
        fd.decode_launches(q, k[:, :n], v[:, :n], **kw)
        mk.planned_launch(outs[..., :n - 7], lses)
        assert 1 <= len(fd._PLANS) <= 3 and 1 <= len(mk._PLANS) <= 3, n
    again = fd.decode_launches(q, k[:, :8], v[:, :8], **kw)[2][0]
    again_merge = mk.planned_launch(outs[..., :1], lses)[2]
    assert again.fast is not first.fast and again_merge.fast is not first_merge.fast  # planned afresh ...
    for new, old in ((again, first), (again_merge, first_merge)):  # ... to the same launch
        assert (new.grid, new.kwargs, len(new.args)) == (old.grid, old.kwargs, len(old.args))
        assert [a for a in new.args if not isinstance(a, torch.Tensor)] == \
            [a for a in old.args if not isinstance(a, torch.Tensor)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors run through the interpreter")
def test_cpu_calls_of_one_signature_in_flight_together_write_partials_of_their_own():
    """On CPU a call's split partials are its own buffers (threads of one process may decode at once; only a CUDA
    device's default stream, which orders every call's kernels, shares one workspace): two calls of one signature
    built before either runs, their launches interleaved as two threads' would be, each give their own result."""
    from megatron_tree.ops import reference
    from megatron_tree.ops.triton import flash_decode as fd

    q, k, v, kw = decode_launch_calls()["3 splits"]
    q, k, v = q.float(), k.float(), v.float()
    q2 = torch.flip(q, dims=(2,))  # other query heads: another result
    fd.clear_plans()
    a = fd.decode_launches(q, k, v, **kw)
    b = fd.decode_launches(q2, k, v, **kw)
    assert len(a[2]) == len(b[2]) == 2 and a[2][0].fast is b[2][0].fast  # one plan, split and merge
    for launch in (a[2][0], b[2][0], a[2][1], b[2][1]):  # both splits before either merge
        launch.run()
    for (out, lse, _), query in ((a, q), (b, q2)):
        ref_o, ref_l = reference.partial_attention(query.double(), k.double(), v.double(),
                                                   cache_seqlens=kw["cache_seqlens"])
        assert (out - ref_o).abs().max() < 1e-5 and (lse - ref_l).abs().max() < 1e-5


@needs_cuda
def test_cuda_workspace_partials_start_aligned_and_apart():
    """The split partials of the default stream's workspace are contiguous views starting 64-byte aligned (so their
    launches keep the fast path and the kernels' vector stores), the lse after the outputs, for any partial count."""
    from megatron_tree.ops.triton import flash_decode as fd

    dev = torch.device("cuda", torch.cuda.current_device())
    for p, b, sq, hq, dv in [(3, 1, 1, 3, 33), (5, 2, 1, 7, 17), (2, 1, 3, 1, 1), (7, 3, 2, 5, 96)]:
        o, lse = fd._partials((p, b, sq, hq, dv), (p, b, hq, sq), dev)
        assert (o.shape, lse.shape, o.dtype, lse.dtype) == ((p, b, sq, hq, dv), (p, b, hq, sq), torch.float32,
                                                            torch.float64)
        assert o.is_contiguous() and lse.is_contiguous()
        assert o.data_ptr() % 64 == 0 and lse.data_ptr() % 64 == 0, (p, b, sq, hq, dv)
        assert lse.data_ptr() >= o.data_ptr() + 4 * o.numel()


@needs_cuda
def test_cuda_a_misaligned_first_call_keeps_no_kernel_and_an_aligned_one_keeps_the_jits():
    """The kernel a plan keeps is the one the JIT picks for aligned tensors: a first call with a misaligned tensor
    (same plan: same shape and strides) runs through the JIT and keeps nothing; the next, aligned call keeps the
    very kernel the JIT's cache holds for it."""
    from megatron_tree.ops.triton import flash_decode as fd

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 1, 32, 128, generator=g).bfloat16().to(dev)
    k = torch.randn(2, 1024, 8, 128, generator=g).bfloat16().to(dev)
    lens = torch.tensor([1000, 5], dtype=torch.int32, device=dev)
    buf = torch.empty(k.numel() + 8, dtype=k.dtype, device=dev)
    shifted = buf[1:1 + k.numel()].view(k.shape)  # 2 bytes past a 16-byte boundary
    shifted.copy_(k)
    fd.clear_plans()
    fd.flash_decode(q, shifted, shifted, cache_seqlens=lens, num_splits=1)
    [launch] = fd.decode_launches(q, shifted, shifted, cache_seqlens=lens, num_splits=1)[2]
    assert launch.fast.compiled is None
    [launch] = fd.decode_launches(q, k, k, cache_seqlens=lens, num_splits=1)[2]
    launch.run()
    assert launch.fast.compiled is not None
    assert launch.fast.compiled is launch.kernel[launch.grid](*launch.args, **launch.kwargs)


@needs_cuda
def test_cuda_a_pre_run_hook_on_the_kernel_is_called_as_the_jit_calls_it():
    """``JITFunction.run`` calls a kernel's pre-run hooks on every launch; a kernel kept by a plan has them called
    too (its launch goes through the JIT while it has any)."""
    from megatron_tree.ops.triton import flash_decode as fd

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(10)
    q = torch.randn(1, 1, 8, 64, generator=g).bfloat16().to(dev)
    k = torch.randn(1, 256, 2, 64, generator=g).bfloat16().to(dev)
    fd.clear_plans()
    want = fd.flash_decode(q, k, k, num_splits=1)  # through the JIT: kept
    seen = []

    def hook(*args, **kwargs):
        seen.append(len(args))

    fd._split_kv_kernel.add_pre_run_hook(hook)
    try:
        got = fd.flash_decode(q, k, k, num_splits=1)
    finally:
        fd._split_kv_kernel.pre_run_hooks.remove(hook)
    [launch] = fd.decode_launches(q, k, k, num_splits=1)[2]
    assert seen == [len(launch.args)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
