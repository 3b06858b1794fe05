"""Triton kernels (interpreter on CPU; compiled on CUDA when present) against the torch reference.

Interpreter tests need TRITON_INTERPRET=1 before the kernels are imported (conftest.py sets
it). Shapes are tiny and KV tiles large: the interpreter costs ~10-25 ms per loop iteration.
Low precision follows flash-attention's rule: the kernel's error against a float64 oracle is at
most 2x that of a plain same-dtype torch implementation.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_tree.ops import dispatch as ops, reference

ROOT = Path(__file__).resolve().parents[2]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET=1 not set before import")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

if INTERPRET:
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk


def _oracle(q, k, v, **kw):
    """float64 reference partial state."""
    kw = {key: val for key, val in kw.items() if key not in ("num_splits", "block_n")}
    return reference.partial_attention(q.double(), k.double(), v.double(), **kw)


def _naive_same_dtype(q, k, v, *, cache_seqlens=None, q_positions=None, k_positions=None, softmax_scale=None):
    """Attention computed entirely in q.dtype (no upcast): flash-attention's baseline for low precision."""
    b, sq, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qt = q.transpose(1, 2)  # (b, hq, sq, d)
    kt = k.repeat_interleave(g, dim=2).transpose(1, 2)
    vt = v.repeat_interleave(g, dim=2).transpose(1, 2)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale  # (b, hq, sq, n), in q.dtype
    mask = torch.ones(b, 1, sq, n, dtype=torch.bool)
    if cache_seqlens is not None:
        mask &= (torch.arange(n)[None, :] < cache_seqlens[:, None].long())[:, None, None, :]
    if q_positions is not None:
        kp = k_positions if k_positions.dim() == 2 else k_positions[None].expand(b, n)
        mask &= (kp[:, None, :] <= q_positions[:, :, None])[:, None]
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vt).transpose(1, 2), lse


def _err(a, b):
    """max |a - b| over finite entries, after checking both have -inf in the same places."""
    a, b = a.double(), b.double()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "-inf (empty) entries differ"
    fin = torch.isfinite(b)
    assert not torch.isnan(a).any(), "NaN in kernel output"
    return (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0


def _case(name, dtype=torch.float32, seed=0):
    """Inputs of one named case: (q, k, v, kwargs)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "gqa_ragged":  # GQA 4:1, ragged rows including an empty one, D=80 (padded)
        q, k, v = rnd(3, 1, 8, 80), rnd(3, 70, 2, 80), rnd(3, 70, 2, 80)
        return q, k, v, {"cache_seqlens": torch.tensor([0, 70, 23], dtype=torch.int32)}
    if name == "mqa":  # one KV head for every query head
        q, k, v = rnd(2, 1, 4, 64), rnd(2, 50, 1, 64), rnd(2, 50, 1, 64)
        return q, k, v, {}
    if name == "causal_sq4":  # 4 query tokens, causal by global position; row 1 sees nothing
        q, k, v = rnd(2, 4, 4, 64), rnd(2, 40, 2, 64), rnd(2, 40, 2, 64)
        qpos = torch.tensor([[36, 37, 38, 39], [-4, -3, -2, -1]])
        kpos = torch.arange(40)
        return q, k, v, {"cache_seqlens": torch.tensor([40, 31], dtype=torch.int32),
                         "q_positions": qpos, "k_positions": kpos}
    if name == "strided_cache":  # a slice of a larger preallocated cache, per-row positions
        big_k, big_v = rnd(2, 64, 4, 64), rnd(2, 64, 4, 64)
        k, v = big_k[:, :45, 1:3], big_v[:, :45, 1:3]
        assert not k.is_contiguous()
        q = rnd(2, 4, 8, 64).transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous q
        kpos = torch.stack([torch.arange(45), torch.arange(45) + 100])
        qpos = torch.tensor([[10, 20, 30, 44], [120, 130, 140, 144]])
        return q, k, v, {"cache_seqlens": torch.tensor([45, 44], dtype=torch.int32),
                         "q_positions": qpos, "k_positions": kpos, "softmax_scale": 0.3}
    if name == "mqa_many_rows":  # 8 query heads x 4 tokens on one KV head: 32 query rows, so
        # fp32 tiles them over 2 programs of 16 rows and fp16/bf16 uses one 64-row tile
        q, k, v = rnd(1, 4, 8, 64), rnd(1, 40, 1, 64), rnd(1, 40, 1, 64)
        return q, k, v, {"q_positions": torch.tensor([[20, 25, 30, 39]]), "k_positions": torch.arange(40)}
    raise KeyError(name)


CASES = ("gqa_ragged", "mqa", "causal_sq4", "strided_cache", "mqa_many_rows")


@needs_interpreter
@pytest.mark.parametrize("name", CASES)
def test_flash_decode_kernel_fp32_matches_reference(name):
    q, k, v, kw = _case(name)
    ref_o, ref_l = _oracle(q, k, v, **kw)
    torch_o, torch_l = reference.partial_attention(q, k, v, **kw)  # same-dtype (fp32) torch
    # One split and several splits (the combine pass merges partial states, some empty).
    for num_splits in (1, 3):
        out, lse = fd.flash_decode(q, k, v, num_splits=num_splits, block_n=32, **kw)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.dtype == torch.float32
        # fp32: within 2x of torch's own fp32 error, plus 1e-6 for cases where torch's error
        # is ~0 by luck (a single fp32 rounding of values of order 1 is 6e-8).
        assert _err(out, ref_o) <= 2 * _err(torch_o, ref_o) + 1e-6, (name, num_splits)
        assert _err(lse, ref_l) <= 2 * _err(torch_l, ref_l) + 1e-6, (name, num_splits)
    if "cache_seqlens" in kw and int(kw["cache_seqlens"].min()) == 0:
        row = int(torch.argmin(kw["cache_seqlens"]))
        assert torch.all(out[row] == 0) and torch.all(torch.isneginf(lse[row]))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["gqa_ragged", "causal_sq4", "mqa_many_rows"])
def test_flash_decode_kernel_low_precision_within_2x_of_same_dtype_torch(name, dtype):
    q, k, v, kw = _case(name, dtype, seed=1)
    ref_o, ref_l = _oracle(q, k, v, **kw)
    base_o, base_l = _naive_same_dtype(q, k, v, **kw)
    out, lse = fd.flash_decode(q, k, v, num_splits=2, block_n=32, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert _err(out, ref_o) <= 2 * _err(base_o, ref_o)
    assert _err(lse, ref_l) <= 2 * _err(base_l, ref_l)


@needs_interpreter
def test_flash_decode_kernel_degenerate_shapes():
    q = torch.randn(2, 1, 4, 64)
    empty = torch.randn(2, 0, 2, 64)  # a rank whose shard holds no keys at all
    out, lse = fd.flash_decode(q, empty, empty)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    none = torch.randn(0, 1, 4, 64)
    out, lse = fd.flash_decode(none, torch.randn(0, 8, 2, 64), torch.randn(0, 8, 2, 64))
    assert out.shape == (0, 1, 4, 64) and lse.shape == (0, 4, 1)


def test_split_count_fills_whole_waves():
    from megatron_tree.ops.triton.flash_decode import MAX_SPLITS, MIN_TILES_PER_SPLIT, blocks_per_sm, choose_num_splits

    h100 = {"sms": 132, "regs": 65536, "threads": 2048, "smem": 228 * 1024, "blocks": 32}
    # 4 warps: 96 registers allow 5 blocks, 168 allow 3 (per-warp allocation in units of 256).
    assert blocks_per_sm(96, 0, 4, h100) == 5 and blocks_per_sm(168, 0, 4, h100) == 3
    assert blocks_per_sm(64, 71680, 4, h100) == 3  # 70 KB (+1 KB reserved) of shared memory
    assert blocks_per_sm(32, 0, 8, h100) == 8  # 2048 threads
    wave = 132 * 3
    for programs, tiles in ((8, 8192), (64, 8192), (8, 64), (1, 4096), (300, 512)):
        s = choose_num_splits(tiles, programs, wave)
        assert 1 <= s <= MAX_SPLITS and (s == 1 or tiles // s >= MIN_TILES_PER_SPLIT), (programs, tiles, s)
        if min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT) * programs >= wave:  # work enough to fill the GPU:
            n = programs * s / wave  # ... whole waves, at least 90 % full
            assert n / math.ceil(n) >= 0.9, (programs, tiles, s, n)
    # B=1, Hkv=8 at N=512K (8192 tiles): one wave of 396 programs, nearly full, not two.
    s = choose_num_splits(8192, 8, wave)
    assert 0.9 * wave <= 8 * s <= wave, s
    # A grid that already fills the GPU is not split; a short cache gets at most tiles / 2 splits.
    assert choose_num_splits(8192, 1024, wave) == 1
    assert choose_num_splits(64, 8, wave) == 32 and choose_num_splits(1, 1, wave) == 1


def test_launches_are_built_with_host_integers_not_tritons_constexpr_functions(monkeypatch):
    """Building a launch is host time on every eager call: ``triton.cdiv`` / ``triton.next_power_of_2`` unwrap
    their arguments per call (several microseconds each, seven calls a decode launch), so the launchers use the
    kernel tier's plain ``cdiv`` / ``next_pow2``, which agree with Triton's."""
    import triton

    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    for n in range(1, 1100):
        assert mk.next_pow2(n) == triton.next_power_of_2(n), n
        for b in (1, 3, 16, 64, 257):
            assert mk.cdiv(n, b) == triton.cdiv(n, b), (n, b)

    def refused(*args, **kwargs):
        raise AssertionError("a launcher called one of Triton's constexpr functions on the host")

    monkeypatch.setattr(triton, "cdiv", refused)
    monkeypatch.setattr(triton, "next_power_of_2", refused)
    # the configs are cached per shape: built afresh here, or an earlier test's call would hide a Triton call in them
    fd._decode_config.cache_clear()
    mk._merge_config.cache_clear()
    fd.clear_plans()  # so are the launches (per signature): an earlier test's plan would build nothing here
    q, k = torch.zeros(1, 1, 32, 80, dtype=torch.bfloat16), torch.zeros(1, 4096, 8, 80, dtype=torch.bfloat16)
    _, _, launches = fd.decode_launches(q, k, k, cache_seqlens=torch.tensor([4000], dtype=torch.int32), num_splits=4)
    assert len(launches) == 2 and launches[0].kwargs["BLOCK_D"] == 128  # split, then merged; 80 padded to 128
    # 32 query rows per KV head: a row block of their next power of two
    _, _, launches = fd.decode_launches(q, k[:, :, :1], k[:, :, :1], num_splits=1)
    assert launches[0].kwargs["BLOCK_M"] == 32
    outs, lses = torch.zeros(130, 1, 1, 8, 80), torch.zeros(130, 1, 8, 1)
    assert mk.merge_launch(outs, lses, outs[0], lses[0]).kwargs["BLOCK_P"] == mk.MAX_BLOCK_P


def test_cached_launch_configs_are_copies_a_caller_may_change():
    """decode_config / merge_config are built once per shape and cached; a caller's change to what they return (as
    decode_launches makes for ``block_n=`` and ``config=``) must not reach the next call of the same shape."""
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    fd.clear_plans()  # the launches below are built here, not taken from an earlier test's plans
    default = dict(fd.decode_config(64, 4, torch.bfloat16))  # a snapshot, whatever decode_config returns
    assert default["BLOCK_N"] != 16 and default["num_warps"] != 8
    q, k = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16), torch.zeros(1, 512, 2, 64, dtype=torch.bfloat16)
    _, _, [launch] = fd.decode_launches(q, k, k, num_splits=1, block_n=16, config={"num_warps": 8})
    assert (launch.kwargs["BLOCK_N"], launch.kwargs["num_warps"]) == (16, 8)
    assert fd.decode_config(64, 4, torch.bfloat16) == default
    _, _, [launch] = fd.decode_launches(q, k, k, num_splits=1)
    assert (launch.kwargs["BLOCK_N"], launch.kwargs["num_warps"]) == (default["BLOCK_N"], default["num_warps"])
    # the cache tells shapes apart by every argument: a narrower V head dim (MLA) has its own, narrower V tile
    assert (fd.decode_config(128, 4, torch.bfloat16)["BLOCK_DV"],
            fd.decode_config(128, 4, torch.bfloat16, headdim_v=64)["BLOCK_DV"]) == (128, 64)
    cfg = mk.merge_config(64, 4)
    cfg["BLOCK_P"] = 1
    assert mk.merge_config(64, 4)["BLOCK_P"] == 4


def _described(launches, inputs):
    """A launch list with every tensor named: the input it is (the first of ``inputs`` that it is), else its
    layout -- two builds of one call describe alike exactly when they launch alike."""
    def name(a):
        if not isinstance(a, torch.Tensor):
            return a
        role = next((key for key, x in inputs.items() if x is a), None)
        return role or ("new", tuple(a.shape), a.stride(), a.dtype)

    return [(launch.kernel, launch.grid, tuple(name(a) for a in launch.args), sorted(launch.kwargs.items()))
            for launch in launches]


def test_a_launch_planned_once_per_call_signature_is_what_each_call_would_build_afresh():
    """decode_launches plans a signature once and fills in each call's tensors: a call that differs from an
    earlier one in any one argument (shape, stride, dtype, a tensor present or not, a scalar) gets its own plan,
    identical to the one it builds with no plan kept; a repeated call reuses its plan with its own tensors."""
    from megatron_tree.ops.triton import flash_decode as fd

    from tests.helpers.launches import decode_launch_calls

    calls = decode_launch_calls()
    fd.clear_plans()
    planned = {}
    for name, (q, k, v, kw) in calls.items():  # in order: each after the call it differs from
        planned[name] = _described(fd.decode_launches(q, k, v, **kw)[2], {"q": q, "k": k, "v": v, **kw})
    assert len(fd._PLANS) == len(calls) - 1  # one plan per signature: "own v" is base's, with its own v
    for name, (q, k, v, kw) in calls.items():
        fd.clear_plans()
        afresh = _described(fd.decode_launches(q, k, v, **kw)[2], {"q": q, "k": k, "v": v, **kw})
        assert planned[name] == afresh, name
    assert any(len(d) == 2 for d in planned.values()) and any(len(d) == 1 for d in planned.values())
    # a repeated signature: no new plan, this call's tensors (and fresh outputs) in the launches
    q, k, v, kw = calls["own v"]
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    fd.clear_plans()
    out1, lse1, _ = fd.decode_launches(q, k, v, **kw)
    out2, lse2, launches = fd.decode_launches(q2, k2, v2, **kw)
    assert len(fd._PLANS) == 1 and len(launches) == 1
    assert all(a is b for a, b in zip(launches[0].args[:3], (q2, k2, v2)))
    assert out2 is not out1 and launches[0].args[7] is out2 and launches[0].args[8] is lse2
    # a scalar given as a tensor is planned for that call only (a tensor's hash is its identity, not its value)
    _, _, [launch] = fd.decode_launches(q, k, v, cache_seqlens=kw["cache_seqlens"], num_splits=1,
                                        softmax_scale=torch.tensor(0.25))
    assert len(fd._PLANS) == 1 and launch.args[10] == 0.25


@needs_interpreter
def test_one_split_writes_the_output_and_allocates_nothing_else():
    """No placeholder fill for absent cache_seqlens/positions and no partials for one split:
    the only tensors a call creates are its outputs (and, with splits, the partials: on CPU their own two buffers,
    on a CUDA device's default stream views of one reused workspace)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q, k, v = torch.randn(2, 1, 8, 64), torch.randn(2, 96, 2, 64), torch.randn(2, 96, 2, 64)
    with Ops() as mode:
        out, lse, launches = fd.decode_launches(q, k, v, num_splits=1)
    assert sorted(mode.seen) == ["empty_strided", "empty_strided"] and len(launches) == 1, mode.seen
    assert launches[0].args[7] is out and launches[0].args[8] is lse  # written in place, no merge
    with Ops() as mode:
        _, _, launches = fd.decode_launches(q, k, v, num_splits=3, block_n=32)
    assert mode.seen.count("empty_strided") == 4 and not {"fill", "full", "copy_", "zero_", "_to_copy"} & set(mode.seen)
    assert len(launches) == 2 and launches[0].grid == (2 * 2, 3)
    ref_o, ref_l = reference.partial_attention(q, k, v)
    for launch in launches:
        launch.run()
    out, lse = launches[1].args[2], launches[1].args[3]
    assert (out - ref_o).abs().max() < 1e-5 and (lse - ref_l).abs().max() < 1e-5


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page,num_splits", [(16, 2), (64, 1)])
def test_paged_kernel_equals_contiguous_kernel_and_reference(page, num_splits, dtype):
    """Random block table, blocks shared by no row, spare blocks and tails of NaN, ragged rows
    (one empty), GQA 8/2, Sq 2 causal by per-row positions. Page 16 < BLOCK_N 32 reads block
    ids per key; page 64 reads one per tile."""
    from tests.helpers.paged import to_paged

    g = torch.Generator().manual_seed(page)
    q = torch.randn(3, 2, 8, 80, generator=g).to(dtype)  # D 80: the padded head dim too
    k, v = (torch.randn(3, 70, 2, 80, generator=g).to(dtype) for _ in range(2))
    sl = torch.tensor([70, 0, 33], dtype=torch.int32)
    k_pool, v_pool, table = to_paged(k, v, sl, page, seed=page)
    n_paged = table.shape[1] * page
    k_pos = torch.stack([torch.arange(n_paged) + off for off in (0, 3, 50)])
    kw = dict(cache_seqlens=sl, q_positions=torch.tensor([[68, 69], [5, 6], [60, 90]]), num_splits=num_splits,
              block_n=32)
    out, lse = fd.flash_decode(q, k_pool, v_pool, block_table=table, k_positions=k_pos, **kw)
    want_o, want_l = fd.flash_decode(q, k, v, k_positions=k_pos[:, :70], **kw)
    # Same tiles, same splits, same arithmetic: only the addresses differ.
    assert torch.equal(out, want_o) and torch.equal(lse, want_l)
    ref_o, ref_l = _oracle(q, k, v, k_positions=k_pos[:, :70], **kw)
    base_o, base_l = (reference.partial_attention(q, k, v, k_positions=k_pos[:, :70], **{
        a: b for a, b in kw.items() if a not in ("num_splits", "block_n")}) if dtype == torch.float32 else
        _naive_same_dtype(q, k, v, k_positions=k_pos[:, :70], **{a: b for a, b in kw.items()
                                                                    if a not in ("num_splits", "block_n")}))
    assert _err(out, ref_o) <= 2 * _err(base_o, ref_o) + 1e-6
    assert _err(lse, ref_l) <= 2 * _err(base_l, ref_l) + 1e-6
    assert torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_out_dtype_float32_gives_the_unrounded_partial(num_splits):
    q, k, v, kw = _case("gqa_ragged", torch.bfloat16, seed=2)
    out32, lse32 = fd.flash_decode(q, k, v, out_dtype=torch.float32, num_splits=num_splits, block_n=32, **kw)
    out16, lse16 = fd.flash_decode(q, k, v, num_splits=num_splits, block_n=32, **kw)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16 and torch.equal(lse32, lse16)
    assert torch.equal(out32.bfloat16(), out16) and not torch.equal(out32, out16.float())


def test_interpreter_rounds_probabilities_like_the_gpu():
    """Under the interpreter fp16/bf16 inputs are widened after loading and P is rounded to the
    input dtype by integer arithmetic (the interpreter's own bf16 cast truncates): check that
    rounding against torch's round-to-nearest-even, ties and all."""
    import triton
    import triton.language as tl

    if not INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 not set before import")

    @triton.jit
    def round_kernel(X, Y, BF16: tl.constexpr, N: tl.constexpr):
        x = tl.load(X + tl.arange(0, N))
        tl.store(Y + tl.arange(0, N), mk.round_like_gpu(x, tl.bfloat16 if BF16 else tl.float16))

    g = torch.Generator().manual_seed(0)
    x = torch.rand(4096, generator=g)
    x[:4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 0.0, 1.0])  # halfway cases round to even
    for bf16, dtype in ((True, torch.bfloat16), (False, torch.float16)):
        y = torch.empty_like(x)
        round_kernel[(1,)](x, y, BF16=bf16, N=4096)
        assert torch.equal(y, x.to(dtype).float()), dtype


def _random_states(p, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(p, 2, 2, 3, 80, generator=g).to(dtype)
    lses = torch.randn(p, 2, 3, 2, generator=g) * 4
    lses[:, 0, 0, 0] = float("-inf")  # every state empty for this row
    lses[1:, 1, 1, 1] = float("-inf")  # only state 0 holds keys
    lses[0, 1, 2, :] = float("-inf")  # one empty state among others ...
    outs[0, 1, :, 2] = float("nan")  # ... whose output is garbage: must not leak
    outs[0, 0, 0, 0] = float("nan")  # garbage in the all-empty row too
    return outs, lses


@needs_interpreter
# 21: one load of all partials; 130 > 128: the lse pass and the output pass both loop.
@pytest.mark.parametrize("p", [2, 21, 130])
def test_merge_kernel_matches_reference_and_empty_shard_rules(p):
    outs, lses = _random_states(p, torch.float32, seed=p)
    out, lse = mk.merge_states(outs, lses)
    clean = torch.where(torch.isneginf(lses).transpose(-1, -2)[..., None], torch.zeros_like(outs), outs)
    ref_o, ref_l = reference.merge_states(clean.double(), lses.double())
    ref32_o, ref32_l = reference.merge_states(clean, lses)
    assert _err(out, ref_o) <= 2 * _err(ref32_o, ref_o) + 1e-6
    assert _err(lse, ref_l) <= 2 * _err(ref32_l, ref_l) + 1e-6
    assert torch.all(out[0, 0, 0] == 0) and torch.isneginf(lse[0, 0, 0])


def _large_scores_check(kernel, merge, device):
    """Large scores on the kernels: scores ~ +-1e5 / 1e4 exact in fp32, near ties across splits.
    One call split 3 ways (its splits are partial states merged in float64) and two shards'
    float64-lse partials merged by the merge kernel both stay within 1e-5 of float64."""
    from benchmarks import precision

    q, k, v, lens = precision.large_score_inputs([1e5, -1e5, 1e4], [96, 80, 0])
    want, want_lse = reference.partial_attention(q, k, v, cache_seqlens=lens)
    qf, kf, vf = (t.float().to(device) for t in (q, k, v))
    sl = lens.to(device)
    fin = torch.isfinite(want_lse)
    out, lse = kernel.flash_decode(qf, kf, vf, cache_seqlens=sl, num_splits=3, block_n=16)
    assert lse.dtype == torch.float32 and (out.cpu().double() - want).abs().max() <= 1e-5
    tol = precision.lse_tolerance(want_lse[fin])
    assert ((lse.cpu().double()[fin] - want_lse[fin]).abs() <= tol).all()
    parts = [kernel.flash_decode(qf, kf[:, a:b], vf[:, a:b], cache_seqlens=(sl - a).clamp(0, b - a).int(),
                                 lse_dtype=torch.float64, out_dtype=torch.float32, num_splits=2, block_n=16)
             for a, b in ((0, 35), (35, 96))]
    assert all(p[1].dtype == torch.float64 for p in parts)
    out, lse = merge.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert lse.dtype == torch.float64 and (out.cpu().double() - want).abs().max() <= 1e-5
    assert (lse.cpu()[fin] - want_lse[fin]).abs().max() <= 1e-6
    assert torch.isneginf(lse.cpu()[2]).all() and (out.cpu()[2] == 0).all()  # the empty row
    # A NaN partial lse comes out NaN (as reference.normalize), never as a row with no keys.
    nan_lses = torch.stack([p[1] for p in parts]).clone()
    nan_lses[0, 0] = float("nan")
    out, lse = merge.merge_states(torch.stack([p[0] for p in parts]), nan_lses)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all() and not torch.isnan(out[1]).any()


@needs_interpreter
def test_kernels_exact_at_large_scores():
    _large_scores_check(fd, mk, "cpu")


_BIG_OFFSETS = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from megatron_tree.ops import reference
    from megatron_tree.ops.triton import flash_decode as fd, merge as mk

    g = torch.Generator().manual_seed(0)
    # Merge: s * s_os = 2 * (2^30 + 64) > 2^31 elements. The storage is 4 GiB of untouched
    # virtual memory; only the elements written below are ever paged in.
    p, b, sq, hq, d = 2, 1, 3, 1, 64
    s_os = 2**30 + 64
    storage = torch.empty(2 * s_os + p * 64 + 64, dtype=torch.float16)
    outs = storage.as_strided((p, b, sq, hq, d), (64, 0, s_os, 64, 1))
    vals = torch.randn(p, b, sq, hq, d, generator=g).half()
    outs.copy_(vals)
    lses = torch.randn(p, b, hq, sq, generator=g)
    out, lse = mk.merge_states(outs, lses)
    want, want_lse = reference.merge_states(vals.double(), lses.double())
    assert (out.double() - want).abs().max() <= 2**-10 and (lse.double() - want_lse).abs().max() <= 1e-6
    # Paged decode: block 2^21 + 3 of 1024-element blocks starts past 2^31 elements (K = V here).
    blocks, page = 2**21 + 4, 16
    pool = torch.empty(blocks * page * 64, dtype=torch.float16).view(blocks, page, 1, 64)
    q, k = torch.randn(1, 1, 2, 64, generator=g).half(), torch.randn(1, 16, 1, 64, generator=g).half()
    pool[2**21 + 3] = k[0]
    table = torch.tensor([[2**21 + 3]], dtype=torch.int32)
    out, lse = fd.flash_decode(q, pool, pool, block_table=table, block_n=16, num_splits=1)
    want_o, want_l = reference.partial_attention(q.double(), k.double(), k.double())
    assert (out.double() - want_o).abs().max() <= 2**-10 and (lse.double() - want_l).abs().max() <= 1e-5
    print("ok")
""")


@needs_interpreter
def test_offsets_past_2_31_elements_are_computed_in_int64():
    """The merge's ``s * stride`` and the paged kernel's ``block * block_stride`` pass 2^31
    elements here; computed in int32 they wrap to a negative address (the old merge kernel
    crashed on this input). In a subprocess, so a regression fails this test alone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _BIG_OFFSETS], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-4000:])


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_merge_kernel_low_precision(dtype):
    outs, lses = _random_states(3, dtype, seed=3)
    outs = torch.nan_to_num(outs)
    out, lse = mk.merge_states(outs, lses)
    ref_o, ref_l = reference.merge_states(outs.double(), lses.double())
    # Same-dtype baseline: the merge arithmetic done in the low-precision dtype.
    m = lses.max(0).values
    w = reference.lse_weights(lses, m).to(dtype)
    base = (reference.weighted(outs, w).sum(0) / w.sum(0).transpose(-1, -2)[..., None]).nan_to_num(0.0)
    assert out.dtype == dtype
    assert _err(out, ref_o) <= 2 * _err(base, ref_o)
    assert _err(lse, ref_l) <= 1e-5


def _count_kernel_calls(monkeypatch):
    """Wrap the kernel launchers' entry points so a test can see which backend ops actually ran
    (the torch path gives the same numbers, so agreement alone cannot tell them apart): every decode
    runs its plan (``fd.run_plan``); a merge runs its signature's plan (``mk.run_plan``, the direct
    eager path) or ``mk.merge_states`` (through the op), never both."""
    calls = {"flash_decode": 0, "merge_states": 0}
    for module, name, op in ((fd, "run_plan", "flash_decode"), (mk, "run_plan", "merge_states"),
                             (mk, "merge_states", "merge_states")):
        real = getattr(module, name)

        def counted(*args, _real=real, _op=op, **kwargs):
            calls[_op] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_lengths_given_as_strided_views_are_read_row_by_row(num_splits):
    """cache_seqlens and cache_starts may be any (batch,) int32 tensor, e.g. a column of a larger table: the kernel,
    which reads row b's value at offset b, gets a contiguous copy of a strided one, so the lengths are the rows' own
    (before, row 1 read row 0's second column) -- the same bits as contiguous lengths, and the reference's result."""
    g = torch.Generator().manual_seed(12)
    q, k, v = torch.randn(3, 1, 4, 16, generator=g), torch.randn(3, 40, 2, 16, generator=g), \
        torch.randn(3, 40, 2, 16, generator=g)
    table = torch.tensor([[31, 2, 40], [5, 0, 1], [40, 17, 9]], dtype=torch.int32)  # rows: lengths, starts, other
    lens, starts = table[:, 0], table[:, 1]
    assert lens.stride() == (3,) and lens.tolist() == [31, 5, 40]
    for kw in ({"cache_seqlens": lens}, {"cache_seqlens": lens, "cache_starts": starts}):
        copies = {name: t.contiguous() for name, t in kw.items()}
        got = fd.flash_decode(q, k, v, num_splits=num_splits, **kw)
        want = fd.flash_decode(q, k, v, num_splits=num_splits, **copies)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        ref_o, ref_l = reference.partial_attention(q.double(), k.double(), v.double(), **kw)
        assert _err(got[0], ref_o) < 1e-5 and _err(got[1], ref_l) < 1e-5
        # the direct eager path's plan (its own split count) does the same
        through, want = ops.flash_decode(q, k, v, backend="triton", **kw), fd.flash_decode(q, k, v, **copies)
        assert torch.equal(through[0], want[0]) and torch.equal(through[1], want[1])


@needs_interpreter
def test_ops_dispatch_to_the_kernels_with_backend_triton(monkeypatch):
    monkeypatch.delenv(ops.ENV_BACKEND, raising=False)
    calls = _count_kernel_calls(monkeypatch)
    q, k, v, kw = _case("causal_sq4")
    out, lse = ops.flash_decode(q, k, v, backend="triton", **kw)
    ref_o, ref_l = reference.partial_attention(q, k, v, **kw)
    assert _err(out, ref_o) < 1e-5 and _err(lse, ref_l) < 1e-5
    outs, lses = _random_states(2, torch.float32)
    outs = torch.nan_to_num(outs)
    mo, ml = ops.merge_states(outs, lses, backend="triton")
    ro, rl = reference.merge_states(outs, lses)
    assert _err(mo, ro) < 1e-5 and _err(ml, rl) < 1e-5
    assert calls == {"flash_decode": 1, "merge_states": 1}, calls
    # CPU tensors with no backend named take the torch path ...
    ops.flash_decode(q, k, v, **kw)
    ops.merge_states(outs, lses)
    assert calls == {"flash_decode": 1, "merge_states": 1}, calls
    # ... unless the environment variable forces the kernels, and the argument beats it.
    monkeypatch.setenv(ops.ENV_BACKEND, "triton")
    o2, _ = ops.flash_decode(q, k, v, **kw)
    ops.merge_states(outs, lses)
    assert calls == {"flash_decode": 2, "merge_states": 2}, calls
    assert _err(o2, ref_o) < 1e-5
    ops.flash_decode(q, k, v, backend="torch", **kw)
    assert calls["flash_decode"] == 2, calls


# ---- CUDA: the compiled kernels on a real GPU (skipped without one) -------------------------

def _cuda_cases():
    for name in CASES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            yield name, dtype


@needs_cuda
@pytest.mark.parametrize("name,dtype", list(_cuda_cases()))
def test_cuda_flash_decode_matches_reference(name, dtype):
    q, k, v, kw = _case(name, dtype, seed=5)
    dev = torch.device("cuda")
    q, k, v = q.to(dev), k.to(dev), v.to(dev)
    kw = {key: (val.to(dev) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}
    ref_o, ref_l = _oracle(q.cpu(), k.cpu(), v.cpu(), **{a: (b.cpu() if isinstance(b, torch.Tensor) else b)
                                                          for a, b in kw.items()})
    if dtype == torch.float32:
        base_o, base_l = reference.partial_attention(q.cpu(), k.cpu(), v.cpu(), **{
            a: (b.cpu() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()})
        # tf32x3 (the fp32 dot on tensor cores) drops the lo*lo product: ~2^-21 relative per
        # product, a few 1e-7 after the sums; 1e-5 leaves margin without hiding real bugs (O(1)).
        floor = 1e-5
    else:
        base_o, base_l = _naive_same_dtype(q.cpu(), k.cpu(), v.cpu(), **{
            a: (b.cpu() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()})
        floor = 0.0
    for num_splits in (None, 1, 3):
        out, lse = fd_cuda().flash_decode(q, k, v, num_splits=num_splits, **kw)
        assert _err(out.cpu(), ref_o) <= 2 * _err(base_o, ref_o) + floor, num_splits
        assert _err(lse.cpu(), ref_l) <= 2 * _err(base_l, ref_l) + floor, num_splits


def fd_cuda():
    from megatron_tree.ops.triton import flash_decode

    return flash_decode


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
def test_cuda_flash_decode_long_cache_every_head_dim(dtype, d):
    g = torch.Generator().manual_seed(d)
    b, n, hq, hkv = 2, 5000, 32, 8
    q = torch.randn(b, 1, hq, d, generator=g).to(dtype).cuda()
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype).cuda()
    v = torch.randn(b, n, hkv, d, generator=g).to(dtype).cuda()
    sl = torch.tensor([n, 1234], dtype=torch.int32).cuda()
    ref_o, ref_l = _oracle(q.cpu(), k.cpu(), v.cpu(), cache_seqlens=sl.cpu())
    base_o, base_l = _naive_same_dtype(q.cpu(), k.cpu(), v.cpu(), cache_seqlens=sl.cpu())
    out, lse = ops.flash_decode(q, k, v, cache_seqlens=sl)
    assert _err(out.cpu(), ref_o) <= 2 * _err(base_o, ref_o)
    assert _err(lse.cpu(), ref_l) <= 2 * _err(base_l, ref_l)


@needs_cuda
def test_cuda_merge_matches_reference():
    for p in (2, 21, 130):
        outs, lses = _random_states(p, torch.float32, seed=p)
        out, lse = ops.merge_states(outs.cuda(), lses.cuda())
        clean = torch.where(torch.isneginf(lses).transpose(-1, -2)[..., None], torch.zeros_like(outs), outs)
        ref_o, ref_l = reference.merge_states(clean.double(), lses.double())
        assert _err(out.cpu(), ref_o) < 1e-5 and _err(lse.cpu(), ref_l) < 1e-5


@needs_cuda
def test_cuda_decode_step_is_cuda_graph_capturable():
    q = torch.randn(2, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    sl = torch.tensor([4096, 100], dtype=torch.int32, device="cuda")
    ops.flash_decode(q, k, v, cache_seqlens=sl)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if anything synchronises with the host
        out, lse = ops.flash_decode(q, k, v, cache_seqlens=sl)
    stale, _ = ops.flash_decode(q, k, v, cache_seqlens=sl.clone())  # what ignoring the update gives
    sl.copy_(torch.tensor([2048, 4096], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    ref_o, _ = ops.flash_decode(q, k, v, cache_seqlens=sl)
    # The replay runs the same kernels on the same data as the eager call: equal to ~1 bf16 ulp
    # (outputs are below 1). Row 1 went from 100 to 4096 keys, so reading the old cache_seqlens
    # would be off by far more than that tolerance.
    assert (stale.float() - ref_o.float()).abs().max() > 0.05
    assert torch.allclose(out.float(), ref_o.float(), atol=4e-3, rtol=0)


def _to_cuda(kw):
    return {key: (val.cuda() if isinstance(val, torch.Tensor) else val) for key, val in kw.items()}


@needs_cuda
@pytest.mark.parametrize("page", [16, 256])
def test_cuda_paged_matches_contiguous_and_reference(page):
    """bf16 GQA 32/8, D 128, ragged rows (one empty), Sq 2 causal by per-row positions, a
    random block table with spare blocks and NaN tails; one split and the occupancy's choice."""
    from tests.helpers.paged import to_paged

    g = torch.Generator().manual_seed(page)
    b, n, hq, hkv, d = 3, 3000, 32, 8, 128
    q = torch.randn(b, 2, hq, d, generator=g).bfloat16()
    k, v = (torch.randn(b, n, hkv, d, generator=g).bfloat16() for _ in range(2))
    sl = torch.tensor([n, 0, 1234], dtype=torch.int32)
    k_pool, v_pool, table = to_paged(k, v, sl, page, seed=page)
    n_paged = table.shape[1] * page
    k_pos = torch.stack([torch.arange(n_paged) + off for off in (0, 5, 700)])
    kw = dict(cache_seqlens=sl, q_positions=torch.tensor([[n - 2, n - 1], [3, 4], [1500, 1933]]))
    ref_o, ref_l = _oracle(q, k, v, k_positions=k_pos[:, :n], **kw)
    base_o, base_l = _naive_same_dtype(q, k, v, k_positions=k_pos[:, :n], **kw)
    for num_splits in (1, None):
        out, lse = fd_cuda().flash_decode(q.cuda(), k_pool.cuda(), v_pool.cuda(), block_table=table.cuda(),
                                          k_positions=k_pos.cuda(), num_splits=num_splits, **_to_cuda(kw))
        flat, flat_l = fd_cuda().flash_decode(q.cuda(), k.cuda(), v.cuda(), k_positions=k_pos[:, :n].cuda(),
                                              num_splits=num_splits, **_to_cuda(kw))
        out, lse, flat, flat_l = out.cpu(), lse.cpu(), flat.cpu(), flat_l.cpu()
        assert not torch.isnan(out).any() and torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()
        assert _err(out, ref_o) <= 2 * _err(base_o, ref_o) and _err(lse, ref_l) <= 2 * _err(base_l, ref_l)
        # Same tiles and arithmetic as the contiguous kernel (only addresses and pipelining differ).
        assert _err(out, flat) <= 2**-8 and _err(lse, flat_l) <= 1e-5, num_splits


@needs_cuda
def test_cuda_split_count_fills_whole_waves_of_this_gpu():
    from megatron_tree.ops.triton.flash_decode import choose_num_splits, waves

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device=dev)
    k = torch.randn(1, 65536, 8, 128, dtype=torch.bfloat16, device=dev)
    _, _, launches = fd_cuda().decode_launches(q, k, k)
    wave = waves(launches[0], dev)
    assert wave % sms == 0 and sms <= wave <= 32 * sms, (wave, sms)
    splits = launches[0].grid[1]
    assert splits == choose_num_splits(65536 // launches[0].kwargs["BLOCK_N"], 8, wave) and splits > 1
    assert 8 * splits / (wave * math.ceil(8 * splits / wave)) >= 0.9  # whole waves, 90 % full
    out, lse = fd_cuda().flash_decode(q, k, k)
    one, one_l = fd_cuda().flash_decode(q, k, k, num_splits=1)
    assert (out.float() - one.float()).abs().max() <= 2**-7 and (lse - one_l).abs().max() <= 1e-4


@needs_cuda
def test_cuda_direct_eager_path_gives_the_ops_bits():
    """A plain CUDA tensor's eager call runs the op's body directly (no op boundary: host time); it must give the
    op's own bits, split or not, and a call under the host-sync guard (a dispatch mode) still goes through the op."""
    from megatron_tree.utils.sync_guard import no_host_sync

    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 1, 32, 128, generator=g).bfloat16().cuda()
    k, v = (torch.randn(3, 4096, 8, 128, generator=g).bfloat16().cuda() for _ in range(2))
    lens = torch.tensor([0, 1000, 4096], dtype=torch.int32, device="cuda")
    direct = ops.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64)
    via_op = torch.ops.megatron_tree.flash_decode(q, k, v, lens, None, None, None, "triton", None, None, torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(direct, via_op))
    outs, lses = torch.randn(2, 3, 1, 32, 128, generator=g).cuda(), torch.randn(2, 3, 32, 1, generator=g).cuda()
    merged = ops.merge_states(outs, lses)
    assert all(torch.equal(a, b) for a, b in zip(merged, torch.ops.megatron_tree.merge_states(outs, lses, "triton")))
    # and they did skip the op: no megatron_tree:: op in a CPU profile of the same calls (equal bits alone would hold
    # for a CUDA tensor sent through the op)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ops.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64)
        ops.merge_states(outs, lses)
    assert not [e.name for e in prof.events() if e.name.startswith("megatron_tree::")]
    with no_host_sync("the direct path's dispatch"):
        guarded = ops.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(direct, guarded))


@needs_cuda
def test_cuda_out_dtype_float32_one_rounding():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 1, 32, 128, generator=g).bfloat16().cuda()
    k, v = (torch.randn(2, 2048, 8, 128, generator=g).bfloat16().cuda() for _ in range(2))
    for num_splits in (1, 4):
        o32, l32 = fd_cuda().flash_decode(q, k, v, out_dtype=torch.float32, num_splits=num_splits)
        o16, l16 = fd_cuda().flash_decode(q, k, v, num_splits=num_splits)
        # Rounded once: o16 is o32 to within half a bf16 ulp (outputs are below 1: ulp <= 2^-8).
        assert o32.dtype == torch.float32 and (o32 - o16.float()).abs().max() <= 2**-9
        assert not torch.equal(o32, o16.float()) and (l32 - l16).abs().max() <= 1e-6


@needs_cuda
def test_cuda_kernels_exact_at_large_scores():
    from megatron_tree.ops.triton import merge

    _large_scores_check(fd_cuda(), merge, "cuda")


@needs_cuda
def test_cuda_graph_keeps_its_own_workspace():
    """A graph captured with split partials keeps its buffers: an eager call that needs a larger
    workspace afterwards (the reused one is then replaced and freed) must not corrupt the replay."""
    dev = torch.device("cuda")
    q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16, device=dev)
    k = torch.randn(1, 32768, 8, 128, dtype=torch.bfloat16, device=dev)
    want, _ = fd_cuda().flash_decode(q, k, k)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = fd_cuda().flash_decode(q, k, k)
    qb = torch.randn(64, 1, 32, 128, dtype=torch.bfloat16, device=dev)
    kb = torch.randn(64, 8192, 8, 128, dtype=torch.bfloat16, device=dev)
    fd_cuda().flash_decode(qb, kb, kb, num_splits=64)  # needs a far larger workspace
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@needs_cuda
def test_cuda_split_calls_of_one_signature_share_the_workspace_views_and_give_fresh_calls_bits():
    """On the default stream a planned split call's partials are the same views of the one workspace every time
    (no view built per call), and its results are those of the same call built with no plan kept."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 32, 128, generator=g).bfloat16().to(dev)
    k, v = (torch.randn(2, 8192, 8, 128, generator=g).bfloat16().to(dev) for _ in range(2))
    lens = torch.tensor([8000, 17], dtype=torch.int32, device=dev)
    fd_cuda().clear_plans()
    first = fd_cuda().decode_launches(q, k, v, cache_seqlens=lens, num_splits=4)
    second = fd_cuda().decode_launches(q, k, v, cache_seqlens=lens, num_splits=4)
    assert len(second[2]) == 2 and all(a is b for a, b in zip(first[2][0].args[7:9], second[2][0].args[7:9]))
    for launch in second[2]:
        launch.run()
    fd_cuda().clear_plans()
    fresh = fd_cuda().flash_decode(q, k, v, cache_seqlens=lens, num_splits=4)
    assert torch.equal(second[0], fresh[0]) and torch.equal(second[1], fresh[1])
