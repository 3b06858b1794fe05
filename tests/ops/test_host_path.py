"""The host path of a decode step stays thin: what it must not redo per call, it does not.

Issue 31's host-time bound (benchmarks/host_path.py holds the measured ratios) is not asserted
here -- wall-clock ratios on a shared machine are noise. What is asserted are the mechanisms
that make the path thin, each by counting or by a guard, so a change that undoes one fails:

* the shape-only checks of ``flash_decode`` / ``merge_states`` and the backend resolution run
  once per signature (shapes, dtypes, devices, variant arguments, backend settings), not per
  call; a new signature is checked afresh and raises the same clear errors;
* the value checks (``cache_seqlens`` in [0, N], block ids) still run on every CPU call;
* the CPU fused-kernel path decides per signature only what the signature holds (strides, scale, dtypes),
  and per call what the values decide (the longest row);
* ``tree_decode`` at world 1 resolves the backend once and runs no merge;
* merging one state returns a copy of it without entering the merge op;
* one CPU merge is a fixed, small number of torch calls, whatever the number of states;
* no device-to-host read happens around the ops (``sync_guard.no_host_sync``), and the ops'
  direct eager path gives the op's own bits.
"""

from __future__ import annotations

import pytest
import torch

import megatron_tree as mt
from megatron_tree.ops import contract, dispatch as ops
from megatron_tree.utils.sync_guard import no_host_sync

from tests.helpers.ranks import run_ranks


def _inputs(b=2, hq=4, hkv=2, d=16, n=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, hq, d, generator=g).to(dtype)
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype)
    v = torch.randn(b, n, hkv, d, generator=g).to(dtype)
    return q, k, v


class _Counted:
    """Wraps ``module.name`` and counts its calls (a real call: the wrapped check still runs)."""

    def __init__(self, monkeypatch, module, name):
        self.calls, fn = 0, getattr(module, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


@pytest.fixture
def fresh(monkeypatch):
    """An empty signature memory, restored afterwards."""
    monkeypatch.setattr(ops, "_signatures", {})
    monkeypatch.delenv(ops.ENV_BACKEND, raising=False)


def test_decode_checks_and_resolves_once_per_signature(fresh, monkeypatch):
    checks = _Counted(monkeypatch, contract, "check_decode_inputs")
    resolves = _Counted(monkeypatch, ops, "resolve_backend")
    q, k, v = _inputs()
    for step in range(6):  # a decode loop: same shapes, new lengths every step
        lens = torch.tensor([step + 1, 24 - step], dtype=torch.int32)
        out, lse = mt.flash_decode(q, k, v, cache_seqlens=lens)
        want, want_lse = mt.flash_decode(q[:1], k[:1, :step + 1], v[:1, :step + 1])
        assert torch.equal(out[:1], want) and torch.equal(lse[:1], want_lse)
    # the 6 loop calls share one signature; the 6 reference calls (N = 1..6, no lengths) are 6 more
    assert checks.calls == 7 and resolves.calls == 7
    mt.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64)  # a new argument value: checked
    mt.flash_decode(q.double(), k.double(), v.double(), cache_seqlens=lens)  # a new dtype: checked
    mt.flash_decode(q, k, v, cache_seqlens=lens, backend="torch")  # a new backend argument: resolved
    assert checks.calls == 10 and resolves.calls == 10
    monkeypatch.setenv(ops.ENV_BACKEND, "torch")  # the environment is part of the signature
    mt.flash_decode(q, k, v, cache_seqlens=lens)
    assert checks.calls == 11 and resolves.calls == 11


@pytest.mark.parametrize("backend", [None, "triton"])  # triton: the direct path's planned launches
def test_a_remembered_signature_still_checks_values_on_every_call(fresh, backend):
    q, k, v = _inputs()
    good = torch.tensor([3, 24], dtype=torch.int32)
    mt.flash_decode(q, k, v, cache_seqlens=good, backend=backend)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 24\] \(the KV length\), got values in "
                                         r"\[-1, 3\]"):
        mt.flash_decode(q, k, v, cache_seqlens=torch.tensor([3, -1], dtype=torch.int32), backend=backend)
    mt.flash_decode(q, k, v, cache_seqlens=good, cache_starts=torch.tensor([0, 24], dtype=torch.int32),
                    backend=backend)
    with pytest.raises(ValueError, match=r"cache_starts must lie in \[0, 24\]"):
        mt.flash_decode(q, k, v, cache_seqlens=good, cache_starts=torch.tensor([0, 25], dtype=torch.int32),
                        backend=backend)
    # a paged cache: block ids are values too
    pool, table = k.reshape(12, 4, 2, 16), torch.arange(12, dtype=torch.int32).reshape(2, 6)
    mt.flash_decode(q, pool, pool, block_table=table, cache_seqlens=good, backend=backend)
    with pytest.raises(ValueError, match=r"block_table\[1, 5\] = 12 is not a block of the cache"):
        mt.flash_decode(q, pool, pool, block_table=table + 1, cache_seqlens=good, backend=backend)


def test_a_new_signature_raises_the_same_clear_errors(fresh):
    q, k, v = _inputs()
    lens = torch.tensor([3, 24], dtype=torch.int32)
    mt.flash_decode(q, k, v, cache_seqlens=lens, q_positions=torch.zeros(2, 1, dtype=torch.int64),
                    k_positions=torch.arange(24), window=1)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        mt.flash_decode(q[:, :, :3], k, v, cache_seqlens=lens)
    with pytest.raises(TypeError, match="cache_seqlens must be int32, got torch.int64"):
        mt.flash_decode(q, k, v, cache_seqlens=lens.long())
    with pytest.raises(ValueError, match=r"cache_seqlens must have shape \(2,\)"):
        mt.flash_decode(q, k, v, cache_seqlens=lens[:1])
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        mt.flash_decode(q, k.double(), v, cache_seqlens=lens)
    # under torch.autocast the mismatch comes from autocast's casts (these functions are no autocast op): said so
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=r"torch.autocast\('cpu', "
                                                                        r"dtype=torch.bfloat16\) is on"):
        mt.flash_decode(q.bfloat16(), k, v, cache_seqlens=lens)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="torch.autocast"):
        mt.tree_decode(q.bfloat16(), k, v, None, cache_seqlens=lens)
    # True == 1 and hash(True) == hash(1): the remembered window=1 must not let window=True through
    with pytest.raises(TypeError, match="window must be an int"):
        mt.flash_decode(q, k, v, cache_seqlens=lens, q_positions=torch.zeros(2, 1, dtype=torch.int64),
                        k_positions=torch.arange(24), window=True)
    with pytest.raises(ValueError, match="softcap must be finite and > 0"):
        mt.flash_decode(q, k, v, cache_seqlens=lens, softcap=float("nan"))
    with pytest.raises(TypeError, match="cache_seqlens must be an int32 tensor of shape \\(2,\\), got list"):
        mt.flash_decode(q, k, v, cache_seqlens=[3, 24])
    with pytest.raises(TypeError, match="out_dtype must be a floating-point torch.dtype"):  # unhashable: checked
        mt.flash_decode(q, k, v, cache_seqlens=lens, out_dtype=[torch.float32])
    with pytest.raises(TypeError, match="lse_dtype must be one of"):
        mt.flash_decode(q, k, v, lse_dtype=torch.float16)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape whose head dim has stride 2 (a view into a wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def test_the_fused_cpu_path_decides_per_signature_only_what_the_signature_holds(fresh, monkeypatch):
    """The unmasked float32 CPU call (ATen's fused kernel) decides once per signature what only shapes, strides,
    dtypes and arguments fix (torch_decode.fused_plan: whether the fused kernel applies, the scale, whether a head
    dim without unit stride must be copied) and per call what the values fix (the value checks, use_fused on the
    longest row). Each case below shares every signature part but one with the call before it, so a signature
    that left that part out would reuse a stale decision: a strided head dim read as if contiguous (the kernel
    reads the wrong elements), another scale, a float32 lse where float64 was asked, a long GQA-8 row on the
    fused kernel or a short one on the loop."""
    from megatron_tree.ops import reference, torch_decode

    plans = _Counted(monkeypatch, torch_decode, "fused_plan")
    fused_calls = []
    real = torch_decode._FUSED

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_decode, "_FUSED", counted)

    def check(q, k, v, fused, **kw):
        fused_calls.clear()
        out, lse = mt.flash_decode(q, k, v, **kw)
        assert bool(fused_calls) == fused, kw
        ref_kw = {name: kw[name] for name in ("cache_seqlens", "cache_starts", "softmax_scale") if name in kw}
        want, want_lse = reference.partial_attention(q.double(), k.double(), v.double(), **ref_kw)
        assert out.dtype == torch.float32 and lse.dtype == kw.get("lse_dtype", torch.float32)
        assert (out.double() - want).abs().max() < 2e-6
        fin = torch.isfinite(want_lse)
        assert torch.equal(fin, torch.isfinite(lse)) and (lse.double()[fin] - want_lse[fin]).abs().max() < 2e-6
        return out, lse

    q, k, v = _inputs(b=2, n=24, seed=11)
    lens = torch.tensor([24, 24], dtype=torch.int32)
    check(q, k, v, True, cache_seqlens=lens)
    check(q, k, v, True, cache_seqlens=lens)  # the same signature: planned once
    assert plans.calls == 1
    # strides: each of q, k, v with a head dim of stride 2, same shapes and dtypes
    check(_strided(q), k, v, True, cache_seqlens=lens)
    check(q, _strided(k), v, True, cache_seqlens=lens)
    check(q, k, _strided(v), True, cache_seqlens=lens)
    assert plans.calls == 4
    # the scale, the lse dtype, the ragged rows and a first key (values: the same signature as above)
    check(q, k, v, True, cache_seqlens=lens, softmax_scale=0.5)
    check(q, k, v, True, cache_seqlens=lens, softmax_scale=0.125)
    check(q, k, v, False, cache_seqlens=lens, lse_dtype=torch.float64)
    check(q, k, v, True, cache_seqlens=torch.tensor([5, 0], dtype=torch.int32),
          cache_starts=torch.tensor([2, 0], dtype=torch.int32))
    check(q, k, v, True)  # no lengths: every row whole
    assert plans.calls == 9  # 5 more signatures: two scales, the lse dtype, cache_starts, no cache_seqlens
    # the longest row decides per call: a GQA group of 8 takes the fused kernel up to 128 keys
    q, k, v = _inputs(b=2, hq=16, hkv=2, n=140, seed=12)
    check(q, k, v, True, cache_seqlens=torch.tensor([128, 3], dtype=torch.int32))
    check(q, k, v, False, cache_seqlens=torch.tensor([129, 3], dtype=torch.int32))
    check(q, k, v, True, cache_seqlens=torch.tensor([100, 128], dtype=torch.int32))
    assert plans.calls == 10
    # a bad length is still refused on a remembered fused signature, and so is a bad first key
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 140\]"):
        mt.flash_decode(q, k, v, cache_seqlens=torch.tensor([141, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_starts must lie in \[0, 140\]"):
        mt.flash_decode(q, k, v, cache_seqlens=torch.tensor([5, 3], dtype=torch.int32),
                        cache_starts=torch.tensor([0, -1], dtype=torch.int32))


def test_the_fused_cpu_direct_path_gives_the_ops_bits(fresh):
    """The direct call of the unmasked float32 case gives the op's own bits, whole rows, ragged rows and first
    keys, strided inputs among them, and the same again under the host-sync guard (through the op)."""
    q, k, v = _inputs(b=3, seed=13)
    for args in ((q, k, v), (_strided(q), _strided(k), _strided(v))):
        for lens, starts in ((torch.tensor([24, 24, 24], dtype=torch.int32), None),
                             (torch.tensor([0, 7, 24], dtype=torch.int32), torch.tensor([0, 3, 0], dtype=torch.int32))):
            direct = mt.flash_decode(*args, cache_seqlens=lens, cache_starts=starts)
            via_op = torch.ops.megatron_tree.flash_decode(*args, lens, None, None, None, "torch", None, None, None,
                                                          starts)
            with no_host_sync("the fused CPU path"):
                guarded = mt.flash_decode(*args, cache_seqlens=lens, cache_starts=starts)
            assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(direct, via_op, guarded))


def test_signature_memory_is_bounded(fresh):
    for n in range(1, ops.SIGNATURE_CACHE_SIZE + 40):
        q, k, v = _inputs(b=1, n=n, d=4)
        mt.flash_decode(q, k, v)
    assert 0 < len(ops._signatures) <= ops.SIGNATURE_CACHE_SIZE


def test_merge_checks_once_and_one_state_is_a_copy(fresh, monkeypatch):
    checks = _Counted(monkeypatch, contract, "check_merge_inputs")
    entered = _Counted(monkeypatch, ops, "_merge_states_impl")
    outs, lses = torch.randn(3, 2, 1, 4, 16), torch.randn(3, 2, 4, 1)
    for _ in range(5):
        out, lse = mt.merge_states(outs, lses)
    assert checks.calls == 1 and entered.calls == 5
    one, one_lse = mt.merge_states(outs[:1].bfloat16(), lses[:1])  # a new signature, P = 1
    assert checks.calls == 2 and entered.calls == 5  # checked; no merge ran
    assert torch.equal(one, outs[0].bfloat16()) and one.dtype == torch.bfloat16 and one.is_contiguous()
    assert torch.equal(one_lse, lses[0]) and one_lse.dtype == torch.float32
    one, one_lse = mt.merge_states(outs[:1], lses[:1])
    # copies: writing into them leaves the caller's states alone
    assert one.data_ptr() != outs.data_ptr() and one_lse.data_ptr() != lses.data_ptr()
    _, lse64 = mt.merge_states(outs[:1], lses[:1].double())
    assert lse64.dtype == torch.float64 and entered.calls == 5
    with pytest.raises(ValueError, match=r"lses must have shape \(3, 2, 4, 1\)"):
        mt.merge_states(outs, lses[:, :1])
    with pytest.raises(TypeError, match="merge_states: lses must be float32 or float64, got torch.float16"):
        mt.merge_states(outs, lses.half())


def test_direct_eager_path_gives_the_ops_bits_and_no_host_sync_around_them(fresh):
    """The plain-eager CPU call runs the op's body without the op boundary; under the host-sync
    guard (a dispatch mode) the call goes through the op, which the guard treats as opaque: the
    code around the op reads no tensor value, for each of the three entry points."""
    q, k, v = _inputs(b=3)
    lens = torch.tensor([0, 7, 24], dtype=torch.int32)
    direct = mt.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64)
    via_op = torch.ops.megatron_tree.flash_decode(q, k, v, lens, None, None, None, "torch", None, None,
                                                  torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op))
    outs, lses = torch.randn(2, 3, 1, 4, 16), torch.randn(2, 3, 4, 1)
    merged = mt.merge_states(outs, lses)
    assert all(torch.equal(a, b) for a, b in zip(merged, torch.ops.megatron_tree.merge_states(outs, lses, "torch")))
    with no_host_sync("the thin host path"):
        guarded = mt.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64)
        guarded_merge = mt.merge_states(outs, lses)
        mt.merge_states(outs[:1], lses[:1])
        out = mt.tree_decode(q, k, v, None, cache_seqlens=lens)
    assert all(torch.equal(a, b) for a, b in zip(direct, guarded))
    assert all(torch.equal(a, b) for a, b in zip(merged, guarded_merge))
    assert torch.equal(out, mt.flash_decode(q, k, v, cache_seqlens=lens)[0])


def test_only_plain_tensors_take_the_direct_path(fresh):
    """Which calls skip the op boundary, seen in a CPU profile (an op call is a ``megatron_tree::`` event): a plain
    eager call does; a tensor subclass in any input, a device other than CPU or CUDA, or a call under a dispatch
    mode goes through the op."""
    import collections

    class Sub(torch.Tensor):
        pass

    def op_calls(call):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call()
        return collections.Counter(e.name for e in prof.events() if e.name.startswith("megatron_tree::"))

    def guarded(call):
        with no_host_sync("the op boundary"):
            return call()

    q, k, v = _inputs(b=3)
    outs, lses = torch.randn(2, 3, 1, 4, 16), torch.randn(2, 3, 4, 1)
    decode, merge = {"megatron_tree::flash_decode": 1}, {"megatron_tree::merge_states": 1}
    assert op_calls(lambda: mt.flash_decode(q, k, v)) == {}
    assert op_calls(lambda: mt.merge_states(outs, lses)) == {}
    assert op_calls(lambda: mt.flash_decode(q.as_subclass(Sub), k, v)) == decode
    assert op_calls(lambda: mt.merge_states(outs.as_subclass(Sub), lses)) == merge
    assert op_calls(lambda: mt.merge_states(outs, lses.as_subclass(Sub))) == merge
    assert op_calls(lambda: mt.merge_states(outs.to("meta"), lses.to("meta"))) == merge  # nor another device
    # under the mode the op is recorded as called and again as the mode runs it
    assert set(op_calls(lambda: guarded(lambda: mt.flash_decode(q, k, v)))) == set(decode)
    assert set(op_calls(lambda: guarded(lambda: mt.merge_states(outs, lses)))) == set(merge)


def _world1_rank(rank, world):
    import torch

    import megatron_tree as mt
    from megatron_tree.comm import merge as comm
    from megatron_tree.ops import contract, dispatch as ops
    from megatron_tree.utils.sync_guard import no_host_sync

    counts = {"check": 0, "resolve": 0, "merge": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    contract.check_decode_inputs = counting("check", contract.check_decode_inputs)
    ops.resolve_backend = counting("resolve", ops.resolve_backend)
    comm.merge = counting("merge", comm.merge)
    groups = mt.TreeGroups.build()
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 20, 2, 16, generator=g), \
        torch.randn(2, 20, 2, 16, generator=g)
    exact = True
    for step in range(8):
        lens = torch.tensor([step, 20 - step], dtype=torch.int32)
        with no_host_sync("tree_decode at world 1"):
            out, lse = mt.tree_decode(q, k, v, groups, cache_seqlens=lens, return_lse=True)
        # the local call tree_decode makes alone: float32 partial, lse in the dtype returned (one
        # signature with it)
        want, want_lse = mt.flash_decode(q, k, v, cache_seqlens=lens, out_dtype=torch.float32,
                                         lse_dtype=torch.float32)
        exact &= torch.equal(out, want) and torch.equal(lse, want_lse)
    stats = mt.CommStats()
    mt.tree_decode(q, k, v, groups, cache_seqlens=lens, stats=stats)  # with stats: merge counts the call
    return counts, exact, stats.calls


def test_tree_decode_at_world_1_is_the_local_kernel():
    """One real gloo rank: 8 steps of tree_decode check the signature and resolve the backend once
    (the flash_decode call beside each step is the same signature), never enter comm.merge (only
    a call that asks for stats does), read no value on the host, and equal flash_decode bit for bit."""
    [(counts, exact, calls)] = run_ranks(_world1_rank, 1)
    assert exact
    # the 8 steps and their flash_decode calls: one signature; the call with stats merges (at
    # world 1 the merge only counts it), so its partial lse is float64: a second one
    assert counts["check"] == 2 and counts["resolve"] == 2, counts
    assert counts["merge"] == 1 and calls == 1, counts  # only the call that asked for stats


def test_fused_cpu_kernel_equals_the_loop_and_the_reference(monkeypatch):
    """The unmasked float32 rows on ATen's fused kernel: the contract of the loop it stands in for
    -- ragged and empty rows, a first valid key (cache_starts), GQA, several queries, a NaN key
    (NaN in its KV head's rows only, never taken for "no key") -- against the loop and the oracle."""
    from megatron_tree.ops import reference, torch_decode

    q, k, v = _inputs(b=4, hq=6, hkv=2, n=20, seed=3)
    q = torch.cat([q, q.flip(0)], dim=1)  # two queries per row
    k[2, 4, 1, 0] = float("nan")
    lens = torch.tensor([20, 0, 11, 7], dtype=torch.int32)
    starts = torch.tensor([0, 0, 3, 7], dtype=torch.int32)  # row 3: empty, its start at its length
    for kw in ({}, {"cache_seqlens": lens}, {"cache_seqlens": lens, "cache_starts": starts}):
        fused = torch_decode.flash_decode(q, k, v, **kw)
        with monkeypatch.context() as m:
            m.setattr(torch_decode, "_FUSED", None)
            loop = torch_decode.flash_decode(q, k, v, **kw)
        want = reference.partial_attention(q.double(), k.double(), v.double(), **kw)
        for got in (fused, loop):
            assert got[0].dtype == torch.float32 and got[0].is_contiguous() and got[1].is_contiguous()
            assert torch.equal(torch.isnan(got[0]), torch.isnan(want[0]))
            assert torch.equal(torch.isnan(got[1]), torch.isnan(want[1]))
            assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
            ok = ~torch.isnan(want[0])
            assert (got[0].double()[ok] - want[0][ok]).abs().max() < 2e-6
            fin = torch.isfinite(want[1])
            assert (got[1].double()[fin] - want[1][fin]).abs().max() < 2e-6
        if kw:
            assert torch.isneginf(fused[1][1]).all() and (fused[0][1] == 0).all()  # no key: out 0, lse -inf
            assert torch.isnan(fused[1][2, 3:]).all() and not torch.isnan(fused[1][2, :3]).any()  # KV head 1
    # past FUSED_MAX_KEYS a row takes the loop: same contract
    n = torch_decode.FUSED_MAX_KEYS + 5
    q, k, v = _inputs(b=1, n=n, seed=4)
    got = torch_decode.flash_decode(q, k, v)
    want = reference.partial_attention(q.double(), k.double(), v.double())
    assert (got[0].double() - want[0]).abs().max() < 2e-6 and (got[1].double() - want[1]).abs().max() < 2e-6


def test_rows_take_the_fused_kernel_only_where_it_is_the_faster_path(monkeypatch):
    """torch_decode.use_fused routes a row by its GQA group and length (benchmarks/cpu_fused.py): groups of
    up to 3 query heads per KV head take ATen's fused kernel up to FUSED_MAX_KEYS keys, larger groups only
    for a few hundred keys (the fused kernel reads a KV head once per query head); the batch's longest row
    decides for every row. Either path gives the oracle's result."""
    from megatron_tree.ops import reference, torch_decode

    calls = []
    real = torch_decode._FUSED

    def counted(*args, **kwargs):
        calls.append(args[1].shape[-2])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_decode, "_FUSED", counted)
    cases = [  # (hq, hkv, keys of each row, fused?)
        (6, 2, [300, 0], True), (6, 6, [2000, 17], True), (8, 2, [256, 40], True),
        (8, 2, [257, 40], False), (16, 2, [129], False), (16, 2, [128], True), (6, 2, [3000], True),
        # the longest row last or in the middle: it decides, not the first one
        (8, 2, [40, 257], False), (16, 2, [5, 129, 0], False), (8, 2, [300, 256], False),
    ]
    for hq, hkv, rows, fused in cases:
        q, k, v = _inputs(b=len(rows), hq=hq, hkv=hkv, n=max(rows), seed=len(calls))
        lens = torch.tensor(rows, dtype=torch.int32)
        calls.clear()
        got = torch_decode.flash_decode(q, k, v, cache_seqlens=lens)
        assert bool(calls) == fused, (hq, hkv, rows, calls)
        want = reference.partial_attention(q.double(), k.double(), v.double(), cache_seqlens=lens)
        assert (got[0].double() - want[0]).abs().max() < 2e-6
        fin = torch.isfinite(want[1])
        assert torch.equal(fin, torch.isfinite(got[1])) and (got[1].double()[fin] - want[1][fin]).abs().max() < 2e-6
    assert torch_decode.use_fused(3, torch_decode.FUSED_MAX_KEYS) and not torch_decode.use_fused(
        1, torch_decode.FUSED_MAX_KEYS + 1)


def test_use_fused_is_the_rule_the_recorded_cpu_fused_table_measured():
    """benchmarks/results/cpu_fused.json (one thread) records, per shape, the fused/loop time ratio and the path
    use_fused took when it was measured. The rule today takes the same path at every recorded shape (a changed
    rule or threshold needs the table measured again), and where the table shows a wide margin (fused/loop
    below 0.9 or above 1.1) that path is the faster one."""
    import json
    from pathlib import Path

    from megatron_tree.ops import torch_decode

    table = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/cpu_fused.json").read_text())
    assert table["threads"] == 1 and len(table["rows"]) >= 28
    for r in table["rows"]:
        fused = torch_decode.use_fused(r["hq"] // r["hkv"], r["n"])
        assert fused == (r["rule"] == "fused"), r
        if not 0.9 <= r["fused_over_loop"] <= 1.1:
            assert fused == (r["fused_over_loop"] < 1), r
    assert {r["n"] for r in table["rows"]} >= {128, 512, 2048, torch_decode.FUSED_MAX_KEYS}


def _torch_calls(fn) -> list[str]:
    """The torch operators ``fn()`` calls from Python, in order: the profiler's top-level ``aten::`` events
    (nested ones, such as the copy inside a ``to``, are parts of one call). The profiler is no dispatch
    mode, so ``mt.merge_states`` takes its plain-eager path, the one timed by benchmarks/host_path.py."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # the signature's checks run once, before counting
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]


MERGE_CALLS_ONE_TOKEN = 13
"""Torch calls of one CPU merge of float32 states of one query token (amax, nan_to_num_, the
difference and exp -- in float32 against the lses' own maximum, no widening and narrowing casts --,
one product, two sums, two broadcast views, the divisor raised off 0, the quotient, log, add); the
merge before (commit 21f18f7) made 24, 964cbbe 17, 70d0b97 15 (the difference in float64), each
~1-2 us of host time on a tiny merge."""


def test_merge_is_a_fixed_handful_of_torch_calls_whatever_the_number_of_states(fresh):
    """One CPU merge_states call makes at most MERGE_CALLS_ONE_TOKEN torch calls for P = 2 and P = 7
    alike (one pass over the stacked states, no loop over them), two more with several query tokens
    (the broadcast views), and none of them a check once the signature is known. A change that goes
    back to per-state or per-piece small calls raises the count and fails here."""
    g = torch.Generator().manual_seed(4)
    counts = {}
    for p, sq in ((2, 1), (7, 1), (3, 2)):
        outs, lses = torch.randn(p, 2, sq, 4, 16, generator=g), torch.randn(p, 2, 4, sq, generator=g)
        lses[0, 1] = float("-inf")  # an empty state: no extra work either
        calls = _torch_calls(lambda: mt.merge_states(outs, lses))
        counts[p, sq] = len(calls)
        assert "aten::eq" not in calls and "aten::masked_fill" not in calls, calls  # no mask built twice
    assert counts[2, 1] == counts[7, 1] <= MERGE_CALLS_ONE_TOKEN, counts
    assert counts[3, 2] <= MERGE_CALLS_ONE_TOKEN + 2, counts


def _dispatch_calls():
    """``tests.helpers.launches.decode_launch_calls`` as ``mt.flash_decode`` takes them (``name -> (q, k, v,
    kwargs)``), each differing from an earlier one in one part of a launch plan's signature. Left out: the
    launcher's own overrides (num_splits, block_n, config: no flash_decode arguments) and int64 lengths (the
    contract refuses them); adapted to the contract: a dtype changes for q, k and v together, K's length for k and
    v, and the lengths stay within the keys (the contract reads them on CPU)."""
    from tests.helpers.launches import decode_launch_calls

    calls = {}
    for name, (q, k, v, kw) in decode_launch_calls().items():
        if {"num_splits", "block_n", "config"} & set(kw) or name == "seqlens int64":
            continue
        if name in ("q fp16", "k fp16", "v fp16"):  # "fp16"'s signature, with tensors of their own
            q, k, v = q.half().clone(), k.half().clone(), v.half().clone()
        if name == "k N 80":
            v = k
        n = contract.kv_length(k, kw.get("block_table"))
        if "cache_seqlens" in kw and int(kw["cache_seqlens"].max()) > n:  # (a strided one, within, keeps its stride)
            kw = {**kw, "cache_seqlens": kw["cache_seqlens"].clamp(max=n)}
        calls[name] = (q, k, v, kw)
    return calls


def test_a_remembered_signature_runs_the_launches_of_its_own_plan(fresh):
    """``mt.flash_decode`` keeps a signature's launch plan with its checks (one lookup a call): the launch-plan
    tests' calls, each after one it differs from in one part of the signature (a stride, a shape, a dtype, a
    tensor present or not, a scalar), through the direct eager path, each give the bits of the Triton launcher's
    own plan for that call -- a signature that missed a part of the plan would run an earlier call's launches."""
    from megatron_tree.ops.triton import flash_decode as fd

    calls = _dispatch_calls()
    assert len(calls) == 31, sorted(calls)
    for name, (q, k, v, kw) in calls.items():
        got = mt.flash_decode(q, k, v, backend="triton", **kw)
        want = fd.flash_decode(q, k, v, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    # one signature each, but "own v" (base's, with a v of its own) and the three fp16 calls ("fp16"'s)
    assert len(ops._signatures) == len(calls) - 4


def test_cleared_plans_are_not_run_again_from_a_remembered_signature(fresh, monkeypatch):
    """``ops.triton.flash_decode.clear_plans`` / ``merge.clear_plans`` reach the plans that remembered signatures
    keep: after a new wave (what benchmarks/launch_overhead.py sets for an H200's split counts) and a clear, a
    repeated signature launches the new plan's splits."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import launch as launch_mod
    from megatron_tree.ops.triton import merge as mk

    grids, run = [], launch_mod.Launch.run

    def recorded(self):  # the real launch, its grid noted
        grids.append(self.grid)
        return run(self)

    monkeypatch.setattr(launch_mod.Launch, "run", recorded)
    q, k, v = _inputs(b=2, hq=4, hkv=2, d=16, n=256)
    outs, lses = torch.randn(2, 1, 1, 4, 16), torch.randn(2, 1, 4, 1)
    fd.clear_plans()
    mk.clear_plans()
    mt.flash_decode(q, k, v, backend="triton")
    mt.merge_states(outs, lses, backend="triton")
    assert grids == [(4, 1), (4,)]  # the interpreter's stand-in wave: one split (B x Hkv programs fill it)
    [(_, _, _, _, merge_slot)] = mk._PLANS.values()
    monkeypatch.setattr(fd, "waves", lambda launch, device: 64)  # a wider wave: more splits
    fd.clear_plans()
    mk.clear_plans()
    want = fd.flash_decode(q, k, v)
    grids.clear()
    got = mt.flash_decode(q, k, v, backend="triton")
    assert grids == [(4, 4), (8,)]  # 4 splits of the 256 keys, then their merge
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    grids.clear()
    mt.merge_states(outs, lses, backend="triton")
    [(_, _, _, _, slot)] = mk._PLANS.values()  # planned again, with a slot of its own
    assert grids == [(4,)] and slot is not merge_slot


def test_a_remembered_merge_signature_runs_the_launch_of_its_own_plan(fresh):
    """``mt.merge_states`` keeps a signature's launch plan too: merges that differ one after another in one part of
    it (the number of states with the same strides, the dtype, a strided outs or lses, float64 lses), through the
    direct eager path, each give the bits of the Triton launcher's own merge; a signature the launcher refuses
    raises its error on every call, not only the first."""
    from megatron_tree.ops.triton import merge as mk
    from tests.helpers.launches import merge_calls

    calls = merge_calls()
    outs, lses = calls["base"]
    calls["base again"] = (outs.clone(), lses.clone())
    for name, (o, lse) in calls.items():
        got, want = mt.merge_states(o, lse, backend="triton"), mk.merge_states(o, lse)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), name
    assert len(ops._signatures) == len(calls) - 1
    for _ in range(2):  # float64 states: the contract takes them, the kernel does not
        with pytest.raises(TypeError, match="Triton merge_states supports"):
            mt.merge_states(outs.double(), lses, backend="triton")
