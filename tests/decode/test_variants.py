"""Attention variants and NaN, from the local kernels to the distributed merge.

Sliding windows, soft-capping, attention sinks and K/V of different head dims (MLA) against the
float64 reference on the unsharded tensors: the Triton kernel under the interpreter and the torch
path, contiguous and paged, ragged rows (one shorter than the window, one empty), GQA and MQA,
Sq 1 and Sq > 1 (causal by position); then ``tree_decode`` at CP 3 and 2 x 2 with every merge
strategy, and a NaN in q (or in one rank's keys) that must come back NaN in its rows, never 0.

The window's convention is checked against transformers' own mask function, so the reference
cannot drift from what the models it serves compute. Shapes are tiny and KV tiles large: the
interpreter costs ~10-25 ms per loop iteration.
"""

from __future__ import annotations

import os

import pytest
import torch

import megatron_tree as mt
from megatron_tree.comm import merge as comm
from megatron_tree.ops import contract, dispatch as ops, reference
from benchmarks import precision
from tests.helpers.ranks import run_ranks

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="TRITON_INTERPRET=1 not set before import")

if INTERPRET:
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

NAN = float("nan")
# The interpreter's tl.max is numpy's nanmax, which warns on a row of NaN scores (the GPU's
# max.f32 drops NaN silently); the kernel's result is NaN either way (kernels/flash_decode.py).
ALL_NAN_ROW = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

# name: batch lengths, Sq, Hq, Hkv, D, Dv and the variant's arguments. Causal by position when
# Sq > 1 or a window is given; the query tokens are each row's last Sq positions.
CASES = {
    # rows 0 and 3 longer than the window, row 1 shorter, row 2 empty
    "window_gqa_sq1": dict(lens=[37, 5, 0, 20], sq=1, hq=4, hkv=2, d=16, dv=16, window=9),
    "window_mqa_sq3": dict(lens=[30, 12], sq=3, hq=4, hkv=1, d=16, dv=16, window=5),
    "softcap_gqa_sq2": dict(lens=[33, 0, 20], sq=2, hq=4, hkv=2, d=16, dv=16, softcap=1.5, scale=1.0),
    "mla_mqa_sq1": dict(lens=[29, 0, 17], sq=1, hq=4, hkv=1, d=40, dv=24),  # both head dims padded
    "starts_gqa_sq1": dict(lens=[40, 25, 9], sq=1, hq=4, hkv=2, d=16, dv=16, starts=[13, 0, 9]),
    "everything_sq2": dict(lens=[35, 18], sq=2, hq=4, hkv=2, d=32, dv=16, window=11, softcap=3.0, starts=[4, 0],
                           scale=0.5),
}


def make_case(name: str, seed: int = 0, dtype=torch.float64):
    """(q, k, v, kwargs) of a named case: contiguous fp64 tensors and the flash_decode arguments."""
    c = CASES[name]
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(c["lens"], dtype=torch.int32)
    b, n = len(c["lens"]), max(c["lens"])
    q = torch.randn(b, c["sq"], c["hq"], c["d"], generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, n, c["hkv"], c["d"], generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, n, c["hkv"], c["dv"], generator=g, dtype=torch.float64).to(dtype)
    kw = {"cache_seqlens": lens}
    if c["sq"] > 1 or "window" in c:
        kw["q_positions"] = (lens[:, None] - c["sq"] + torch.arange(c["sq"])[None, :]).long()
        kw["k_positions"] = torch.arange(n)
    for key, arg in (("window", "window"), ("softcap", "softcap"), ("scale", "softmax_scale")):
        if key in c:
            kw[arg] = c[key]
    if "starts" in c:
        kw["cache_starts"] = torch.tensor(c["starts"], dtype=torch.int32)
    return q, k, v, kw


def to_paged(t: torch.Tensor, page: int, seed: int = 1):
    """A contiguous (B, N, H, D) cache as a paged pool (blocks in a random order, one spare) and its table."""
    b, n = t.shape[:2]
    per_row = -(-n // page)
    padded = torch.zeros(b, per_row * page, *t.shape[2:], dtype=t.dtype)
    padded[:, :n] = t
    order = torch.randperm(b * per_row + 1, generator=torch.Generator().manual_seed(seed))
    pool = torch.zeros(b * per_row + 1, page, *t.shape[2:], dtype=t.dtype)
    table = order[: b * per_row].view(b, per_row).to(torch.int32)
    pool[table.reshape(-1).long()] = padded.reshape(b * per_row, page, *t.shape[2:])
    return pool, table


def paged_kwargs(kw: dict, table: torch.Tensor, page: int) -> dict:
    """The kwargs of a contiguous call for its paged twin: k_positions padded to max_blocks * page
    slots (the padding lies past every row's length: never visible)."""
    out = {**kw, "block_table": table}
    if "k_positions" in kw:
        kpos = kw["k_positions"]
        out["k_positions"] = torch.cat([kpos, kpos.new_zeros(table.shape[1] * page - kpos.shape[0])])
    return out


def oracle(q, k, v, **kw):
    """The float64 reference on the given tensors (kernel-only overrides dropped)."""
    kw = {key: val for key, val in kw.items() if key not in ("num_splits", "block_n")}
    return reference.partial_attention(q.double(), k.double(), v.double(), **kw)


def err(got, want):
    """max |got - want| after checking -inf (empty) and NaN lie in the same places."""
    got, want = got.double(), want.double()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf (empty) entries differ"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN entries differ"
    fin = torch.isfinite(want)
    return float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0


def transformers_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """transformers 5.x's sliding-window causal mask on global positions: (B, Sq, N) bool."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(window)
    return fn(0, 0, q_pos[:, :, None], k_pos[None, None, :])


def naive(q, k, v, *, lens, mask=None, scale=None, softcap=None, sinks=None):
    """Attention spelled out in float64 with expanded KV: the variants' definitions, independently."""
    b, sq, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    kk = k.double().repeat_interleave(hq // hkv, dim=2)
    vv = v.double().repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bnhd->bhqn", q.double(), kk) * (scale if scale is not None else d ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    valid = (torch.arange(n)[None, :] < lens[:, None])[:, None, None, :].expand(b, hq, sq, n)
    if mask is not None:
        valid = valid & mask[:, None]
    s = s.masked_fill(~valid, float("-inf"))
    if sinks is not None:  # the sink as one more logit, with a zero value vector
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, hq, sq, 1)], dim=-1)
        vv = torch.cat([vv, vv.new_zeros(b, 1, hq, vv.shape[-1])], dim=1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqn,bnhd->bqhd", p, vv), lse


# ---- the reference: conventions ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["window_gqa_sq1", "window_mqa_sq3", "softcap_gqa_sq2", "mla_mqa_sq1"])
def test_reference_variants_follow_their_definitions(name):
    """Window as transformers masks it (``sliding_window_causal_mask_function``), soft-capping as
    Gemma 2 computes it, V's own head dim: the reference equals attention spelled out naively."""
    q, k, v, kw = make_case(name)
    mask = None
    if "q_positions" in kw:
        mask = (kw["k_positions"][None, None, :] <= kw["q_positions"][:, :, None])
        if "window" in kw:
            mask = transformers_mask(kw["q_positions"], kw["k_positions"], kw["window"])
    want_o, want_l = naive(q, k, v, lens=kw["cache_seqlens"], mask=mask, scale=kw.get("softmax_scale"),
                           softcap=kw.get("softcap"))
    out, lse = reference.partial_attention(q, k, v, **kw)
    assert out.shape == (*q.shape[:3], v.shape[-1])
    assert err(out, want_o) < 1e-12 and err(lse, want_l) < 1e-12
    if "window" in kw or "softcap" in kw:  # the variant changes the answer: this case can fail
        plain = {key: val for key, val in kw.items() if key not in ("window", "softcap")}
        assert (reference.partial_attention(q, k, v, **plain)[0] - out).abs().max() > 1e-2


def test_window_convention_matches_transformers_and_flash_attn():
    """p - W < j <= p: W = 1 sees only its own position, and flash-attn's window_size=(W - 1, 0)
    (keys p - left <= j <= p + right, with causal) is the same set."""
    q_pos, k_pos = torch.tensor([[9, 3]]), torch.arange(12)
    for w in (1, 3, 20):
        ours = (k_pos[None, None] <= q_pos[..., None]) & (k_pos[None, None] > q_pos[..., None] - w)
        assert torch.equal(ours, transformers_mask(q_pos, k_pos, w))
        left = w - 1
        fa = (k_pos[None, None] >= q_pos[..., None] - left) & (k_pos[None, None] <= q_pos[..., None])
        assert torch.equal(ours, fa)
    assert transformers_mask(q_pos, k_pos, 1)[0, 0].nonzero().flatten().tolist() == [9]


def test_add_sink_is_one_more_partial_state():
    """out * sigmoid(lse - sink), logaddexp(lse, sink): the merge with the state (0, sink), exact with
    empty rows (-inf), a sink of -inf, float64 lse and NaN."""
    g = torch.Generator().manual_seed(3)
    out = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64)
    lse = torch.randn(2, 4, 3, generator=g, dtype=torch.float64) * 5
    lse[1, :, 2] = float("-inf")
    out[1, 2] = 0.0
    sinks = torch.tensor([0.5, -3.0, 8.0, float("-inf")], dtype=torch.float64)
    got_o, got_l = reference.add_sink(out, lse, sinks)
    state_o = torch.stack([out, torch.zeros_like(out)])
    state_l = torch.stack([lse, sinks[None, :, None].expand_as(lse)])
    want_o, want_l = reference.merge_states(state_o, state_l)
    assert (got_o - want_o).abs().max() < 1e-14 and err(got_l, want_l) < 1e-12
    assert torch.all(got_o[1, 2] == 0) and torch.equal(got_l[1, :3, 2], sinks[:3])  # empty row: lse = sink
    assert torch.equal(got_o[..., 3, :], out[..., 3, :]) and torch.equal(got_l[:, 3], lse[:, 3])  # -inf sink
    assert torch.isneginf(got_l[1, 3, 2])  # no key and no sink: still empty, not NaN
    lse[0, 1, 0] = NAN
    o2, l2 = reference.add_sink(out, lse, sinks)
    assert torch.isnan(o2[0, 0, 1]).all() and torch.isnan(l2[0, 1, 0])
    assert torch.isfinite(o2[0, 0, 0]).all() and torch.isfinite(o2[0, 1, 1]).all()
    o3, l3 = reference.add_sink(out.float(), lse.float(), sinks.float())
    assert o3.dtype == torch.float32 and l3.dtype == torch.float32


# ---- the local kernels against the reference ---------------------------------------------------

def _backends():
    yield "torch", {}
    if INTERPRET:
        yield "triton", {"num_splits": 1}
        yield "triton", {"num_splits": 3, "block_n": 16}


def _local(backend, q, k, v, kw, extra):
    if backend == "torch":
        return ops.flash_decode(q, k, v, backend="torch", **kw)
    return fd.flash_decode(q, k, v, **kw, **extra)


@pytest.mark.parametrize("layout", ["contiguous", "paged8"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_local_variants_match_the_fp64_reference(name, layout):
    """fp32 Triton (one split, and three with some empty) and torch path within 2x of the fp32
    reference's own error (+1e-6), -inf exactly where no key is visible."""
    q, k, v, kw = make_case(name)
    if layout.startswith("paged"):
        page = int(layout[5:])
        (kp, table), (vp, _) = to_paged(k, page), to_paged(v, page)
        k, v, kw = kp, vp, paged_kwargs(kw, table, page)
    want_o, want_l = oracle(q, k, v, **kw)
    qf, kf, vf = q.float(), k.float(), v.float()
    base_o, base_l = reference.partial_attention(qf, kf, vf, **kw)
    tol_o, tol_l = 2 * err(base_o, want_o) + 1e-6, 2 * err(base_l, want_l) + 1e-6
    lens = kw["cache_seqlens"]
    for backend, extra in _backends():
        out, lse = _local(backend, qf, kf, vf, kw, extra)
        assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == torch.float32
        assert err(out, want_o) <= tol_o, (backend, extra)
        assert err(lse, want_l) <= tol_l, (backend, extra)
        for row in (lens == 0).nonzero().flatten().tolist():
            assert torch.all(out[row] == 0) and torch.all(torch.isneginf(lse[row]))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_variants_low_precision_within_2x_of_same_dtype_torch(dtype):
    """Window, soft-capping, cache_starts and Dk != Dv together in bf16/fp16: the kernel's error
    against fp64 is at most 2x that of attention computed entirely in the input dtype."""
    q, k, v, kw = make_case("everything_sq2", seed=2, dtype=dtype)
    want_o, _ = oracle(q, k, v, **kw)
    qp, kp = kw["q_positions"], kw["k_positions"]
    mask = transformers_mask(qp, kp, kw["window"]) & (kp[None, None] >= kw["cache_starts"][:, None, None])
    b, sq, hq, d = q.shape
    kk, vv = (t.repeat_interleave(hq // k.shape[2], dim=2) for t in (k, v))
    s = torch.einsum("bqhd,bnhd->bhqn", q, kk) * kw["softmax_scale"]  # every op in dtype
    s = torch.tanh(s / kw["softcap"]) * kw["softcap"]
    valid = (torch.arange(k.shape[1])[None, :] < kw["cache_seqlens"][:, None])[:, None, None, :] & mask[:, None]
    yard = torch.einsum("bhqn,bnhd->bqhd", torch.softmax(s.masked_fill(~valid, float("-inf")), -1), vv)
    for splits in (1, 2):
        out, _ = fd.flash_decode(q, k, v, num_splits=splits, block_n=16, **kw)
        assert out.dtype == dtype
        assert err(out, want_o) <= 2 * err(yard, want_o), splits


@pytest.mark.parametrize("page", [4, 16])
def test_paged_window_as_a_slot_range(page):
    """Decode on a paged cache without positions: the window's first visible slot per row as
    cache_starts equals the positional window; the blocks wholly before it may be freed (-1 in the
    table) and are never read."""
    q, k, v, kw = make_case("window_gqa_sq1")
    want_o, want_l = oracle(q, k, v, **kw)
    lens, w = kw["cache_seqlens"], kw["window"]
    starts = (lens - w).clamp(min=0).to(torch.int32)  # query at lens - 1 sees slots (lens - 1 - w, lens - 1]
    (kp, table), (vp, _) = to_paged(k, page), to_paged(v, page)
    freed = table.clone()
    freed[torch.arange(table.shape[1])[None, :] < (starts[:, None] // page)] = -1
    assert (freed == -1).any()
    pkw = {"cache_seqlens": lens, "cache_starts": starts, "block_table": freed}
    assert err(reference.partial_attention(q, kp, vp, **pkw)[0], want_o) < 1e-12
    for backend, extra in _backends():
        out, lse = _local(backend, q.float(), kp.float(), vp.float(), pkw, extra)
        assert err(out, want_o) <= 1e-6 and err(lse, want_l) <= 1e-5, (backend, extra)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_flash_decode_sinks_match_the_naive_softmax(backend):
    """flash_decode(sinks=) for one process: the sink joins the softmax once (naive fp64
    concatenation), bf16 output rounded once, an empty row gives out 0 and lse = sink."""
    if backend == "triton" and not INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 not set before import")
    q, k, v, kw = make_case("window_gqa_sq1")
    sinks = torch.tensor([0.3, 2.5, -1.0, 4.0])
    mask = transformers_mask(kw["q_positions"], kw["k_positions"], kw["window"])
    want_o, want_l = naive(q, k, v, lens=kw["cache_seqlens"], mask=mask, sinks=sinks)
    out, lse = ops.flash_decode(q.float(), k.float(), v.float(), sinks=sinks, backend=backend, **kw)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert err(out, want_o) < 1e-6 and err(lse, want_l) < 1e-5
    assert torch.all(out[2] == 0) and torch.equal(lse[2, :, 0], sinks)  # row 2 has no key
    assert (out.double() - oracle(q, k, v, **kw)[0]).abs().max() > 1e-2  # the sink matters here
    # bf16: the sink joins the unrounded partial, and the output is rounded once, at the end
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ob, lb = ops.flash_decode(qb, kb, vb, sinks=sinks, backend=backend, lse_dtype=torch.float64, **kw)
    o32, l64 = ops.flash_decode(qb, kb, vb, backend=backend, out_dtype=torch.float32, lse_dtype=torch.float64, **kw)
    once_o, once_l = reference.add_sink(o32, l64, sinks)
    assert ob.dtype == torch.bfloat16 and lb.dtype == torch.float64
    assert torch.equal(ob, once_o.bfloat16()) and torch.equal(lb, once_l)


# ---- bad input ---------------------------------------------------------------------------------

def _small():
    q, k, v = torch.randn(2, 1, 4, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    pos = {"q_positions": torch.tensor([[5], [3]]), "k_positions": torch.arange(6)}
    return q, k, v, pos


@pytest.mark.parametrize("kwargs,exc,pattern", [
    ({"window": 0}, ValueError, r"window must lie in \[1, 2147483647\].*got 0"),
    ({"window": -3}, ValueError, "window must lie in"),
    ({"window": 2 ** 31}, ValueError, "window must lie in"),
    ({"window": True}, TypeError, "window must be an int"),
    ({"window": 2.5}, TypeError, "window must be an int"),
    ({"softcap": 0.0}, ValueError, r"softcap must be finite and > 0, got 0.0"),
    ({"softcap": -1}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": float("inf")}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": NAN}, ValueError, "softcap must be finite and > 0"),
    ({"softcap": "50"}, TypeError, "softcap must be a positive float"),
    ({"sinks": torch.zeros(2)}, ValueError, r"sinks must have shape \(4,\) \(one logit per query head\), got \(2,\)"),
    ({"sinks": torch.zeros(1, 4)}, ValueError, r"sinks must have shape \(4,\)"),
    ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, "sinks must be a floating-point tensor"),
    ({"sinks": [0.0] * 4}, TypeError, "sinks must be a floating-point tensor of shape"),
    ({"sinks": torch.zeros(4, device="meta")}, ValueError, "sinks is on meta but q is on cpu"),
    ({"cache_starts": torch.zeros(2, dtype=torch.int64)}, TypeError, "cache_starts must be int32"),
    ({"cache_starts": torch.zeros(3, dtype=torch.int32)}, ValueError, r"cache_starts must have shape \(2,\)"),
    ({"cache_starts": torch.tensor([0, 7], dtype=torch.int32)}, ValueError, r"cache_starts must lie in \[0, 6\]"),
])
def test_bad_variant_arguments_raise_clear_errors(kwargs, exc, pattern):
    q, k, v, pos = _small()
    with pytest.raises(exc, match=pattern):
        mt.flash_decode(q, k, v, **pos, **kwargs)
    with pytest.raises(exc, match=pattern):
        mt.tree_decode(q, k, v, None, **pos, **kwargs)
    with pytest.raises(exc, match=pattern):  # the overlapped path checks before its first collective too
        contract.check_decode_inputs(q, k, v, **pos, **kwargs)


def test_window_needs_positions_and_k_v_must_agree_but_for_the_head_dim():
    q, k, v, _ = _small()
    with pytest.raises(ValueError, match="window needs q_positions and k_positions.*cache_starts"):
        mt.flash_decode(q, k, v, window=4)
    with pytest.raises(ValueError, match="window needs q_positions"):
        mt.tree_decode(q, k, v, None, window=4)
    with pytest.raises(ValueError, match="same shape but for the head dim"):
        mt.flash_decode(q, k, v[:, :5])
    with pytest.raises(ValueError, match="same shape but for the head dim"):
        mt.flash_decode(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="head dim of k \\(4\\) differs from q's \\(8\\)"):
        mt.flash_decode(q, k[..., :4], v)
    out, lse = mt.flash_decode(q, k, v[..., :3])  # V's own head dim is fine
    assert out.shape == (2, 1, 4, 3) and lse.shape == (2, 4, 1)


def test_custom_op_fake_gives_v_head_dim_and_opcheck_passes_with_variants():
    q, k, v, pos = _small()
    v = v[..., :5].contiguous()
    args = (q, k, v, None, None, pos["q_positions"], pos["k_positions"], "torch", None, None, None,
            torch.tensor([1, 0], dtype=torch.int32), 3, 2.0)
    torch.library.opcheck(torch.ops.megatron_tree.flash_decode.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out, lse = torch.ops.megatron_tree.flash_decode(*fake)
    assert tuple(out.shape) == (2, 1, 4, 5) and tuple(lse.shape) == (2, 4, 1)


# ---- NaN: single process -----------------------------------------------------------------------

def _nan_inputs(seed=0):
    """A ragged GQA batch (one empty row) with one NaN in q, at (row 0, token 1, head 2)."""
    q, k, v, kw = make_case("softcap_gqa_sq2", seed=seed)
    kw = {key: val for key, val in kw.items() if key not in ("softcap", "softmax_scale")}
    q[0, 1, 2, 5] = NAN
    return q, k, v, kw


def _check_nan_rows(out, lse, want_o, want_l, tol):
    """NaN exactly in the rows of the NaN (out and lse), every other row within tol, no row 0."""
    nan_rows = torch.isnan(want_l)  # (B, Hq, Sq)
    assert nan_rows.any()
    assert torch.equal(torch.isnan(lse), nan_rows), "lse: NaN rows differ"
    assert torch.equal(torch.isnan(out).any(-1), nan_rows.transpose(1, 2)), "out: NaN rows differ"
    assert torch.isnan(out[nan_rows.transpose(1, 2)]).all(), "a NaN row is only partly NaN"
    assert err(out, want_o) <= tol and err(lse, want_l) <= tol
    has_keys = torch.isfinite(want_l) | nan_rows
    assert not (out.transpose(1, 2)[has_keys] == 0).all(-1).any(), "a row with keys came back as 0"


@ALL_NAN_ROW
def test_nan_in_q_propagates_through_the_local_kernels_and_the_reference():
    q, k, v, kw = _nan_inputs()
    want_o, want_l = oracle(q, k, v, **kw)
    assert torch.isnan(want_l[0, 2, 1]) and torch.isnan(want_l).sum() == 1  # one query row
    for backend, extra in _backends():
        for lse_dtype in (torch.float32, torch.float64):
            out, lse = _local(backend, q.float(), k.float(), v.float(), {**kw, "lse_dtype": lse_dtype}, extra)
            _check_nan_rows(out, lse, want_o, want_l, 1e-5)
    # CP 1 (no group): tree_decode with the sink too -- NaN stays NaN through add_sink
    for backend in ("torch", "triton") if INTERPRET else ("torch",):
        out, lse = mt.tree_decode(q.float(), k.float(), v.float(), None, backend=backend, return_lse=True, **kw)
        _check_nan_rows(out, lse, want_o, want_l, 1e-5)
        out, lse = mt.tree_decode(q.float(), k.float(), v.float(), None, backend=backend, return_lse=True,
                                  sinks=torch.zeros(4), **kw)
        assert torch.equal(torch.isnan(lse), torch.isnan(want_l))


@ALL_NAN_ROW
def test_nan_in_a_hidden_key_is_never_read_and_in_a_visible_key_is_nan():
    """K and V before a row's cache_starts (in its first tile) may hold anything, NaN included, and
    change nothing; a NaN key that one query sees makes that query's rows NaN, and only those."""
    q, k, v, kw = make_case("everything_sq2")
    want_o, want_l = oracle(q, k, v, **kw)
    hidden_k, hidden_v = k.clone(), v.clone()
    hidden_k[0, 2] = hidden_v[0, 2] = NAN  # before row 0's cache_starts (4)
    for backend, extra in _backends():
        out, lse = _local(backend, q.float(), hidden_k.float(), hidden_v.float(), kw, extra)
        assert err(out, want_o) < 1e-5 and err(lse, want_l) < 1e-5, (backend, extra)
    hidden_k[0, 34, 1] = NAN  # row 0's last key: visible to its last query only (causal)
    vis_o, vis_l = oracle(q, hidden_k, hidden_v, **kw)
    assert torch.isnan(vis_l[0, 2:, 1]).all() and not torch.isnan(vis_l[0, :, 0]).any()
    assert not torch.isnan(vis_l[1]).any()
    for backend, extra in _backends():
        out, lse = _local(backend, q.float(), hidden_k.float(), hidden_v.float(), kw, extra)
        _check_nan_rows(out, lse, vis_o, vis_l, 1e-5)


@needs_interpreter
def test_merge_kernel_keeps_a_nan_partial_nan():
    outs = torch.randn(3, 1, 1, 2, 16)
    lses = torch.tensor([[0.5, 1.0], [NAN, 2.0], [float("-inf"), float("-inf")]]).view(3, 1, 2, 1)
    for l in (lses, lses.double()):
        out, lse = mk.merge_states(outs, l)
        assert torch.isnan(out[0, 0, 0]).all() and torch.isnan(lse[0, 0, 0])
        want_o, want_l = reference.merge_states(outs, l)
        assert err(out[0, 0, 1], want_o[0, 0, 1]) < 1e-6 and err(lse[0, 1], want_l[0, 1]) < 1e-6


# ---- distributed: every variant and NaN at CP 3 and 2 x 2 ---------------------------------------

STRATEGIES = ("allreduce3", "packed", "two_level", "allgather", "shifted", "auto")


def shard(k, v, kw, rank, world):
    """This rank's contiguous share of the sequence (uneven; rank 1 holds none) and its kwargs."""
    cuts = precision.uneven_cuts(k.shape[1], world, empty=1)
    lo, hi = cuts[rank], cuts[rank + 1]
    local = dict(kw)
    local["cache_seqlens"] = (kw["cache_seqlens"] - lo).clamp(0, hi - lo).to(torch.int32)
    if "k_positions" in kw:
        local["k_positions"] = kw["k_positions"][lo:hi]
    if "cache_starts" in kw:
        local["cache_starts"] = (kw["cache_starts"] - lo).clamp(0, hi - lo).to(torch.int32)
    return k[:, lo:hi], v[:, lo:hi], local


def _calls(strategies, backends):
    for backend in backends:
        for strategy in strategies:
            yield backend, strategy, False
        yield backend, "packed", True
        yield backend, "shifted", True


def _nan_calls():
    """(backend, strategy, overlap) of the NaN checks: every strategy (and the overlapped halves) on the torch
    kernel; the Triton kernel (interpreter, ~0.1 s a call) whole-batch and in overlapped halves, merged by
    packed. The merges never read the backend (only the ranks' agreement compares it; ``comm.merge``
    combines the partials with the same ops on either kernel's output), so Triton's NaN partials through
    the other strategies repeated the torch kernel's merges of the same NaN rows."""
    yield from _calls(STRATEGIES, ("torch",))
    yield "triton", "packed", False
    yield "triton", "packed", True


NAN_CALLS = len(list(_nan_calls()))


def variants_body(rank, world, intra):
    groups = mt.TreeGroups.build(intra_size=intra)
    report = {"exact": {}, "empty_by_window": {}, "sinks_per_rank": None, "nan": {}, "nan_k": {}, "fallbacks": 0}
    sinks = torch.tensor([1.5, -0.5, 3.0, 0.0])
    for name in CASES:
        q, k, v, kw = make_case(name)
        for with_sinks in (False, True):
            want_o, want_l = oracle(q, k, v, **kw)
            if with_sinks:
                want_o, want_l = reference.add_sink(want_o, want_l, sinks.double())
            kl, vl, lkw = shard(k, v, kw, rank, world)
            shift = want_l.float()  # any shift every rank shares
            for _, strategy, overlap in _calls(STRATEGIES, ("torch",)):
                out, lse = mt.tree_decode(q.float(), kl.float(), vl.float(), groups, strategy=strategy,
                                          overlap=overlap, return_lse=True, backend="torch",
                                          sinks=sinks if with_sinks else None,
                                          shift=shift if strategy == "shifted" else None, **lkw)
                report["exact"][(name, with_sinks, "torch", strategy, overlap)] = (err(out, want_o), err(lse, want_l))
            if not with_sinks:  # the Triton kernel (interpreter) once per case: the merges do not depend on it
                out, lse = mt.tree_decode(q.float(), kl.float(), vl.float(), groups, strategy="packed",
                                          backend="triton", return_lse=True, **lkw)
                report["exact"][(name, False, "triton", "packed", False)] = (err(out, want_o), err(lse, want_l))
            # each rank's shard as a paged pool (8-slot blocks in a random order)
            (kp, table), (vp, _) = to_paged(kl.float(), 8, seed=rank), to_paged(vl.float(), 8, seed=rank)
            for strategy, overlap in (("two_level", False), ("shifted", True)):
                out, lse = mt.tree_decode(q.float(), kp, vp, groups, strategy=strategy, overlap=overlap,
                                          return_lse=True, backend="torch", sinks=sinks if with_sinks else None,
                                          shift=shift if strategy == "shifted" else None,
                                          **paged_kwargs(lkw, table, 8))
                report["exact"][(name, with_sinks, "torch", f"paged {strategy}", overlap)] = (
                    err(out, want_o), err(lse, want_l))
        if name == "window_gqa_sq1":  # which ranks the window left without a key (an empty shard)
            kl, vl, lkw = shard(k, v, kw, rank, world)
            _, lse = mt.flash_decode(q.float(), kl.float(), vl.float(), **lkw)
            report["empty_by_window"] = torch.isneginf(lse).all(-1).all(-1).tolist()
    # A sink added on each rank's partial before the merge (the mistake) is far from the answer:
    # the exactness above would catch it.
    q, k, v, kw = make_case("window_gqa_sq1")
    kl, vl, lkw = shard(k, v, kw, rank, world)
    o, l = mt.flash_decode(q.float(), kl.float(), vl.float(), out_dtype=torch.float32, lse_dtype=torch.float64,
                           sinks=sinks, **lkw)
    wrong, _ = comm.merge(o, l, groups, "packed")
    right = reference.add_sink(*oracle(q, k, v, **kw), sinks.double())[0]
    report["sinks_per_rank"] = float((wrong.double() - right).abs().max())

    # NaN in q (every rank's scores of that row) and in one key of the last rank only
    q, k, v, kw = _nan_inputs()
    k_nan = k.clone()
    k_nan[2, 19, 0] = NAN  # row 2's last key, KV head 0 (query heads 0, 1), held by the last rank
    for label, kk, where in (("q", k, report["nan"]), ("k", k_nan, report["nan_k"])):
        want_o, want_l = oracle(q if label == "q" else torch.nan_to_num(q), kk, v, **kw)
        kl, vl, lkw = shard(kk, v, kw, rank, world)
        qq = q if label == "q" else torch.nan_to_num(q)
        shift = torch.nan_to_num(want_l.float(), nan=0.0)  # any shift every rank shares
        for backend, strategy, overlap in _nan_calls():
            stats = mt.CommStats()
            out, lse = mt.tree_decode(qq.float(), kl.float(), vl.float(), groups, strategy=strategy, overlap=overlap,
                                      return_lse=True, backend=backend, stats=stats,
                                      shift=shift if strategy == "shifted" else None, **lkw)
            try:
                _check_nan_rows(out, lse, want_o, want_l, 1e-5)
                where[(backend, strategy, overlap)] = "ok"
            except AssertionError as e:
                where[(backend, strategy, overlap)] = str(e)
            report["fallbacks"] += stats.fallbacks
    return report


@pytest.mark.parametrize("world,intra", [(3, None), (4, 2)])
def test_tree_decode_variants_and_nan_at_cp3_and_2x2(world, intra):
    reports = run_ranks(variants_body, world, intra, timeout=540)
    for rank, rep in enumerate(reports):
        assert len(rep["exact"]) == len(CASES) * (2 * (len(STRATEGIES) + 4) + 1)
        for key, (e_out, e_lse) in rep["exact"].items():
            assert e_out <= 1e-5 and e_lse <= 1e-5, f"rank {rank} {key}: errors {e_out:.2e}, {e_lse:.2e}"
        # the window (9 keys before position 36 of row 0) lies on the last rank: the others are empty
        assert rep["empty_by_window"][0] == (rank != world - 1), rep["empty_by_window"]
        assert rep["sinks_per_rank"] > 1e-2, "a sink per rank would not have been caught"
        for where in ("nan", "nan_k"):
            assert len(rep[where]) == NAN_CALLS == len(STRATEGIES) + 2 + 2
            bad = {key: msg for key, msg in rep[where].items() if msg != "ok"}
            assert not bad, f"rank {rank} NaN in {where[4:] or 'q'}: {bad}"
        assert rep["fallbacks"] == 0, "a NaN row made shifted redo its merge"
    for rep in reports[1:]:
        assert rep["exact"] == reports[0]["exact"]
