"""ops.prefill_attention (fused_prefill) against float64 attention, its plan, its kernel dispatch and its precision.

Every case is checked against ``reference.partial_attention`` in float64 on the same inputs
(padded keys hidden, padded queries seeing nothing), per row and per head, out and lse; the
kernel calls are counted through the module's launcher table, so "a fully masked block is
skipped" and "a diagonal block is one causal call" are asserted, not assumed.
"""

import math
import warnings

import pytest
import torch

from megatron_tree.ops import contract, fused_prefill, dispatch as ops, reference
from benchmarks import precision

_HIDDEN = torch.iinfo(torch.int64).max


def _inputs(b, sq, n, hq, hkv, d=16, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _want(q, k, v, qpos, kpos, softmax_scale=None):
    """float64 attention by the contract: negative keys never visible, negative queries see nothing."""
    b, n = k.shape[:2]
    kpos = kpos if kpos.dim() == 2 else kpos[None].expand(b, n)
    kpos = torch.where(kpos < 0, torch.full_like(kpos, _HIDDEN), kpos.to(torch.int64))
    return reference.partial_attention(q.double(), k.double(), v.double(), q_positions=qpos.to(torch.int64),
                                       k_positions=kpos, softmax_scale=softmax_scale)


def _check(q, k, v, qpos, kpos, tol=1e-5, **kw):
    out, lse = fused_prefill.prefill_attention(q, k, v, q_positions=qpos, k_positions=kpos,
                                               exact_attention=ops.flash_decode, **kw)
    want_o, want_l = _want(q, k, v, qpos, kpos, kw.get("softmax_scale"))
    assert out.shape == q.shape and out.dtype == contract.acc_dtype(q.dtype)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float64
    seen = torch.isfinite(want_l)
    assert torch.equal(torch.isfinite(lse), seen), "rows with no visible key must get lse -inf (and only they)"
    assert torch.all(out.transpose(1, 2)[~seen] == 0), "rows with no visible key must get out 0"
    err_o = float((out.double() - want_o).abs().max()) if out.numel() else 0.0
    err_l = float((lse[seen] - want_l[seen]).abs().max()) if seen.any() else 0.0
    assert err_o <= tol and err_l <= tol, (err_o, err_l)
    return out, lse


class _Calls:
    """Counts the fused kernel's launches (and the masks it got) without changing them."""

    def __init__(self, monkeypatch, name="cpu_flash"):
        self.causal, self.full, self.masked, self.mask_shapes = 0, 0, 0, []
        real = fused_prefill._LAUNCH[name]

        def counted(q, k, v, scale, causal, mask):
            if mask is not None and mask.shape[-1] > 1:
                self.masked += 1
                self.mask_shapes.append(tuple(mask.shape))
            elif causal:
                self.causal += 1
            else:
                self.full += 1
            return real(q, k, v, scale, causal, mask)

        monkeypatch.setitem(fused_prefill._LAUNCH, name, counted)

    @property
    def total(self):
        return self.causal + self.full + self.masked


def _ar(lo, hi):
    return torch.arange(lo, hi)


# (name, q positions, k positions, expected (causal, full, masked) calls with the default planner)
BLOCKS = [
    ("diagonal", _ar(0, 37), _ar(0, 37), (1, 0, 0)),
    ("queries ahead (chunked prefill over a longer cache)", _ar(20, 57), _ar(0, 57), (1, 1, 0)),
    ("keys ahead of some queries", _ar(0, 37), _ar(15, 52), (1, 0, 0)),
    ("block in the past", _ar(40, 77), _ar(0, 29), (0, 1, 0)),
    ("block in the future: skipped", _ar(0, 37), _ar(37, 70), (0, 0, 0)),
    ("head/tail pair, own block", torch.cat([_ar(0, 12), _ar(36, 48)]), torch.cat([_ar(0, 12), _ar(36, 48)]),
     (1, 0, 0)),
    ("head/tail pair over the middle chunks", torch.cat([_ar(0, 12), _ar(36, 48)]), _ar(12, 36), (0, 1, 0)),
]


@pytest.mark.parametrize("name,qp,kp,calls", BLOCKS, ids=[b[0] for b in BLOCKS])
@pytest.mark.parametrize("heads", [(6, 2), (4, 1), (3, 3)], ids=["gqa", "mqa", "mha"])
def test_structured_blocks_match_fp64_with_the_fewest_kernel_calls(monkeypatch, name, qp, kp, calls, heads):
    hq, hkv = heads
    q, k, v = _inputs(2, qp.numel(), kp.numel(), hq, hkv, dtype=torch.float32)
    counted = _Calls(monkeypatch)
    _check(q, k, v, qp[None].expand(2, -1), kp)  # k positions 1-D: one row of positions shared
    assert (counted.causal, counted.full, counted.masked) == calls, name


def test_random_position_sets_padding_and_ragged_rows(monkeypatch):
    """Rows of different lengths and position sets (each row planned alone), padding on both
    sides, queries and keys in no order, Sq and N prime."""
    g = torch.Generator().manual_seed(3)
    b, sq, n = 3, 41, 53
    q, k, v = _inputs(b, sq, n, 6, 2, dtype=torch.float32, seed=1)
    qp = torch.stack([torch.randperm(120, generator=g)[:sq] for _ in range(b)])
    kp = torch.stack([torch.randperm(120, generator=g)[:n] for _ in range(b)])
    qp[0, :5] = -1  # padded queries
    kp[0, -7:] = -1  # padded keys
    qp[1, 10:] = -3
    kp[2, :] = kp[2].sort().values  # keys sorted, queries not
    counted = _Calls(monkeypatch)
    for kw in ({}, {"min_run": 1, "tile": 5}, {"min_run": 2, "tile": 1}):
        _check(q, k, v, qp, kp, **kw)
    assert counted.masked > 0  # the ragged tiles ran with explicit masks ...
    assert max(s[-2] for s in counted.mask_shapes) <= 256  # ... of at most TILE rows (never Sq x N at once)


def test_ragged_tiles_bound_the_mask(monkeypatch):
    g = torch.Generator().manual_seed(5)
    qp = torch.randperm(400, generator=g)[:150]
    kp = torch.randperm(400, generator=g)[:170]
    q, k, v = _inputs(1, 150, 170, 2, 1, dtype=torch.float32)
    counted = _Calls(monkeypatch)
    _check(q, k, v, qp[None], kp, tile=16)
    assert counted.masked > 1
    # a tile of ~tile rows (a short run may finish it) and only the keys between its first and last row
    assert all(s[-2] <= 16 + fused_prefill.MIN_RUN and s[-1] < 170 for s in counted.mask_shapes), counted.mask_shapes


def test_every_row_padded_or_no_key_visible():
    q, k, v = _inputs(2, 9, 7, 4, 2, dtype=torch.float32)
    for qp, kp in ((torch.full((2, 9), -1), _ar(0, 7)), (_ar(0, 9)[None].expand(2, -1), torch.full((7,), -1)),
                   (_ar(0, 9)[None].expand(2, -1), _ar(100, 107))):
        out, lse = ops.prefill_attention(q, k, v, q_positions=qp, k_positions=kp)
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    for sq, n in ((0, 7), (9, 0)):  # empty axes (the CPU kernel itself would die on them)
        q0, k0, v0 = _inputs(1, sq, n, 4, 2, dtype=torch.float32)
        out, lse = ops.prefill_attention(q0, k0, v0, q_positions=_ar(0, sq)[None], k_positions=_ar(0, n))
        assert out.shape == (1, sq, 4, 16) and lse.shape == (1, 4, sq) and torch.all(lse == float("-inf"))


def test_float64_is_tight_and_bf16_is_computed_unrounded():
    qp = torch.cat([_ar(3, 20), _ar(40, 51)])[None]
    kp = torch.cat([_ar(0, 25), _ar(45, 60)])
    q, k, v = _inputs(1, qp.shape[1], kp.numel(), 6, 3)
    _check(q, k, v, qp, kp, tol=1e-12)
    _check(q, k, v, qp, kp, tol=1e-12, min_run=1, tile=3)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = ops.prefill_attention(qb, kb, vb, q_positions=qp, k_positions=kp)
    once = ops.prefill_attention(qb.float(), kb.float(), vb.float(), q_positions=qp, k_positions=kp)
    assert got[0].dtype == torch.float32  # a partial stays float32 until the last merge
    assert torch.equal(got[0], once[0]) and torch.equal(got[1], once[1])


def test_softmax_scale_and_the_decode_kernel_agree():
    qp, kp = _ar(5, 30)[None], _ar(0, 30)
    q, k, v = _inputs(1, 25, 30, 4, 2, dtype=torch.float32)
    a = _check(q, k, v, qp, kp, softmax_scale=0.3)
    b = _check(q, k, v, qp, kp, softmax_scale=0.3, kernel="decode")
    assert float((a[0] - b[0]).abs().max()) < 1e-6


def _merged(q, k, v, pos, cuts, **kw):
    parts = [fused_prefill.prefill_attention(q, k[:, a:b], v[:, a:b], q_positions=pos, k_positions=pos[0, a:b],
                                             exact_attention=ops.flash_decode, **kw) for a, b in zip(cuts, cuts[1:])]
    return ops.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


@pytest.mark.parametrize("magnitude", [1e4, 1e5, -1e5])
def test_merge_stays_exact_at_large_scores(magnitude):
    """Rows whose scores are ``magnitude + small integer`` (exact in fp32), a causal prompt cut
    into 4 uneven KV blocks (one empty), each block's partial from prefill_attention, merged:
    within 1e-5 of fp64 attention on the whole prompt. Without the shifted pass
    (lse_bound = inf) the float32 lse alone is off by far more: the pass is what makes it exact."""
    n = 48
    q, k, v, _ = precision.large_score_inputs([magnitude], [n], sq=n, hq=4, hkv=2)
    pos = _ar(0, n)[None]
    want, want_lse = reference.partial_attention(q, k, v, q_positions=pos, k_positions=pos)
    qf, kf, vf = q.float(), k.float(), v.float()
    cuts = precision.uneven_cuts(n, 4, empty=1)
    out, lse = _merged(qf, kf, vf, pos, cuts, min_run=4)
    assert float((out.double() - want).abs().max()) <= 1e-5
    assert float((lse - want_lse).abs().max()) <= 1e-5
    raw, _ = _merged(qf, kf, vf, pos, cuts, min_run=4, lse_bound=math.inf)
    assert float((raw.double() - want).abs().max()) > 1e-5


def test_plan_segments():
    plan = fused_prefill.plan
    assert [(s.kind, s.start, s.stop, s.full) for s in plan(torch.arange(1, 11))] == [("unit", 0, 10, 0)]
    assert [(s.kind, s.full) for s in plan(torch.full((9,), 4))] == [("flat", 4)]
    assert [(s.kind, s.full) for s in plan(torch.zeros(9, dtype=torch.int64))] == [("empty", 0)]
    # a diagonal that starts before the keys: its first row sees none
    assert [(s.kind, s.start, s.stop) for s in plan(torch.arange(0, 12))] == [("empty", 0, 1), ("unit", 1, 12)]
    # an offset diagonal followed by rows that see everything
    assert [(s.kind, s.start, s.stop, s.full) for s in plan(torch.tensor(list(range(6, 16)) + [15] * 9))] \
        == [("unit", 0, 10, 5), ("flat", 10, 19, 15)]
    # short runs become ragged tiles covering [full, last)
    segs = plan(torch.tensor([0, 2, 2, 5, 9, 9, 9, 9, 9, 9, 9, 9, 9]), min_run=8)
    assert [(s.kind, s.start, s.stop, s.full, s.last) for s in segs] == [("ragged", 0, 4, 0, 5), ("flat", 4, 13, 9, 0)]
    assert plan(torch.zeros(0, dtype=torch.int64)) == []


def test_kernel_dispatch_by_device_dtype_and_head_dim():
    sel = fused_prefill.select_kernel
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        assert sel("cpu", dtype, 64) == "cpu_flash"
    for ampere in ((8, 0), (8, 9)):  # not in the measured table: flash
        assert sel("cuda", torch.bfloat16, 64, flash_attn_importable=False, capability=ampere) == "cuda_flash"
        assert sel("cuda", torch.float16, 128, flash_attn_importable=False, capability=ampere) == "cuda_flash"
        assert sel("cuda", torch.bfloat16, 128, flash_attn_importable=True, capability=ampere) == "flash_attn"
    # Hopper, measured: cuDNN for 16-bit head dims it takes, flash-attn installed or not
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for importable in (False, True):
                assert sel("cuda", dtype, d, flash_attn_importable=importable, capability=(9, 0)) == "cuda_cudnn"
    assert fused_prefill.CUDNN_ARCHS == (9,) and 10 not in fused_prefill.CUDNN_ARCHS
    assert sel("cuda", torch.bfloat16, 192, flash_attn_importable=False, capability=(9, 0)) == "cuda_flash"
    assert sel("cuda", torch.bfloat16, 128, flash_attn_importable=False, capability=(10, 0)) == "cuda_flash"
    for cap in ((8, 0), (9, 0)):
        assert sel("cuda", torch.bfloat16, 100, flash_attn_importable=True, capability=cap) == "cuda_efficient"
        assert sel("cuda", torch.float32, 64, capability=cap) == "cuda_efficient"  # flash and cuDNN: 16-bit only
        assert sel("cuda", torch.float64, 64, capability=cap) == "decode"
        assert sel("cuda", torch.bfloat16, 512, capability=cap) == "decode"
    assert set(fused_prefill.KERNELS) >= {"cpu_flash", "cuda_flash", "cuda_efficient", "flash_attn", "cuda_cudnn",
                                          "decode"}


def test_bad_input_names_the_problem():
    q, k, v = _inputs(1, 5, 6, 4, 2, dtype=torch.float32)
    pos = _ar(0, 5)[None]
    with pytest.raises(TypeError, match="q_positions and k_positions"):
        ops.prefill_attention(q, k, v, q_positions=pos, k_positions=None)
    with pytest.raises(ValueError, match="k_positions must be an integer tensor of shape"):
        ops.prefill_attention(q, k, v, q_positions=pos, k_positions=_ar(0, 5))
    with pytest.raises(ValueError, match="q_positions must be an integer tensor of shape"):
        ops.prefill_attention(q, k, v, q_positions=pos.float(), k_positions=_ar(0, 6))
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        ops.prefill_attention(q[:, :, :3], k, v, q_positions=pos, k_positions=_ar(0, 6))
    with pytest.raises(ValueError, match="unknown prefill kernel"):
        ops.prefill_attention(q, k, v, q_positions=pos, k_positions=_ar(0, 6), kernel="fast")


def test_bench_runs_and_writes_json(tmp_path):
    import json

    from benchmarks import prefill_kernel

    out = tmp_path / "pk.json"
    assert prefill_kernel.main(["--sizes", "64", "--threads", "1", "--repeats", "1", "--shifted", "--no-precision",
                                "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    cases = {r["case"]: r for r in rows}
    assert {"diagonal", "full"} <= set(cases)
    for case in ("diagonal", "full"):
        r = cases[case]
        assert set(r["seconds"]) == {"old", "new", "sdpa", "new_shifted"} and all(t > 0 for t in r["seconds"].values())
        assert r["max_abs_diff_vs_new"]["old"] < 1e-5 and r["kernel"] == "cpu_flash"
    assert any("whole prompt" in r["case"] and r["tokens"] == 128 for r in rows)
    (row,) = prefill_kernel.precision_rows(magnitudes=(1e5,), tokens=32)
    assert row["new"] <= 1e-5 and row["old"] <= 1e-5 < row["new_no_shift"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA kernels' numerics)")
@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "cuda_flash"), (torch.float16, "cuda_flash"),
                                          (torch.float32, "cuda_efficient"), (torch.bfloat16, "cuda_efficient"),
                                          (torch.bfloat16, "cuda_cudnn"), (torch.float16, "cuda_cudnn")])
def test_cuda_kernels_match_fp64(dtype, kernel):
    g = torch.Generator().manual_seed(7)
    qp = torch.cat([_ar(0, 200), _ar(600, 800)])[None].expand(2, -1)
    for kp in (qp[0], _ar(200, 600), torch.randperm(900, generator=g)[:333]):
        q, k, v = _inputs(2, qp.shape[1], kp.numel(), 8, 2, d=64)
        want, _ = _want(q, k, v, qp, kp)
        dev = [t.to("cuda", dtype) for t in (q, k, v)]
        calls = {}
        out, lse = ops.prefill_attention(*dev, q_positions=qp.cuda(), k_positions=kp.cuda(), kernel=kernel,
                                         cudnn_min_flop=0, calls=calls)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert float((out.double().cpu() - want).abs().max()) < tol
        assert kernel in calls, calls


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] not in fused_prefill.CUDNN_ARCHS,
                    reason="needs a CUDA GPU of the measured table's architectures (fused_prefill.CUDNN_ARCHS)")
def test_cuda_cudnn_is_the_default_where_measured_and_passes_its_check():
    """On a GPU of the measured table a 16-bit prefill defaults to cuDNN; its first-call check against
    flash passes (no warning), and a prompt whose diagonal piece reaches the bound runs it on cuDNN, exact."""
    import warnings
    fused_prefill._cudnn_agrees.cache_clear()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="prefill: cuDNN")
        for dtype in (torch.bfloat16, torch.float16):
            for d in (64, 128):
                assert fused_prefill.select_kernel("cuda", dtype, d) == "cuda_cudnn"
                assert fused_prefill._cudnn_agrees(str(torch.device("cuda")), dtype, d)
        n, hq, hkv, d = 1024, 8, 2, 128
        q, k, v = _inputs(1, n, n, hq, hkv, d=d)
        pos = _ar(0, n)[None]
        want, _ = _want(q, k, v, pos, pos)
        calls = {}
        out, _ = ops.prefill_attention(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), q_positions=pos.cuda(),
                                       k_positions=pos.cuda(), calls=calls,
                                       cudnn_min_flop=4 * hq * d * n * n / 2)
    assert calls == {"cuda_cudnn": 1}
    assert float((out.double().cpu() - want).abs().max()) < 2e-2


def _efficient_contract(q, k, v, bias, causal, scale):
    """A CPU stand-in with the documented contract of ``aten._efficient_attention_forward`` (equal
    heads, (B, S, H, D), bias last dim contiguous with 16-aligned rows, top-left causal, lse
    padded to a multiple of 32 queries with garbage), for checking the glue around it on CPU."""
    assert q.shape[2] == k.shape[2] == v.shape[2], "the memory-efficient kernel takes equal heads only"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    b, length, h, d = q.shape
    w = k.shape[1]
    s = torch.einsum("blhd,bwhd->bhlw", q.double(), k.double()) * scale
    if bias is not None:
        assert bias.shape == (b, h, length, w) and bias.dtype == q.dtype
        assert bias.stride(-1) == 1 and bias.stride(2) % 16 == 0 and bias.stride(1) % 16 == 0
        s = s + bias.double()
    if causal:
        s = s.masked_fill(torch.ones(length, w, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhlw,bwhd->blhd", torch.softmax(s, -1).nan_to_num(0.0), v.double())
    padded = torch.full((b, h, -(-length // 32) * 32), float("nan"))
    padded[..., :length] = lse
    return out.to(q.dtype), padded.float()


def test_cuda_efficient_head_folding_and_bias_on_cpu(monkeypatch):
    """The GQA fold (query heads into the batch axis over stride-0 KV) and the padded bias around
    the memory-efficient kernel, run on CPU against a stand-in with the op's contract."""
    monkeypatch.setitem(fused_prefill._LAUNCH, "cuda_efficient",
                        lambda q, k, v, scale, causal, mask: fused_prefill._cuda_efficient(
                            q, k, v, scale, causal, mask, op=_efficient_contract))
    g = torch.Generator().manual_seed(11)
    qp = torch.cat([_ar(0, 20), _ar(50, 70)])[None].expand(2, -1)
    for kp in (qp[0], _ar(20, 50), torch.randperm(90, generator=g)[:37]):
        q, k, v = _inputs(2, qp.shape[1], kp.numel(), 6, 2, dtype=torch.float32)
        _check(q, k, v, qp, kp, kernel="cuda_efficient", min_run=4, tile=8)


def _cudnn_contract(q, k, v, causal, scale):
    """A CPU stand-in with the contract of ``aten._scaled_dot_product_cudnn_attention`` as the launcher
    calls it: (B, H, S, D) tensors, GQA heads (Hq a multiple of Hkv), causal from the top left, lse
    returned as (B, H, L, 1) float32 (the shape some releases give). It also asserts what the
    launcher relies on: a causal piece is square (top-left equals bottom-right only then)."""
    hq, length = q.shape[1:3]
    hkv, w = k.shape[1], k.shape[2]
    assert hq % hkv == 0 and v.shape[:3] == k.shape[:3], (q.shape, k.shape, v.shape)
    assert not causal or length == w, f"a causal piece of {length} queries over {w} keys is not square"
    kk, vv = (t.double().repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    s = torch.einsum("bhld,bhwd->bhlw", q.double(), kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(length, w, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bhlw,bhwd->bhld", torch.softmax(s, -1), vv)
    return out.to(q.dtype), lse.float()[..., None]


def test_cuda_cudnn_glue_on_cpu(monkeypatch):
    """The cuDNN launcher (layout in and out, lse reshape) and its routing run on CPU against a
    stand-in with the op's contract: causal pieces square, ragged pieces on the memory-efficient
    kernel (cuDNN takes no mask), the result exact against float64 attention; GQA, two batch rows."""
    launched = []

    def cudnn(q, k, v, scale, causal, mask):
        launched.append(("cuda_cudnn", causal))
        return fused_prefill._cuda_cudnn(q, k, v, scale, causal, mask, op=_cudnn_contract)

    def efficient(q, k, v, scale, causal, mask):
        launched.append(("cuda_efficient", causal))
        return fused_prefill._cuda_efficient(q, k, v, scale, causal, mask, op=_efficient_contract)

    monkeypatch.setitem(fused_prefill._LAUNCH, "cuda_cudnn", cudnn)
    monkeypatch.setitem(fused_prefill._LAUNCH, "cuda_efficient", efficient)
    monkeypatch.setattr(fused_prefill, "_cudnn_agrees", lambda device, dtype, head_dim: True)  # (its own tests below)
    assert "cuda_cudnn" in fused_prefill.KERNELS and ops.prefill_kernel(torch.zeros(1, 1, 2, 8, device="meta"),
                                                                        torch.zeros(1, 1, 1, 8, device="meta"),
                                                                        "cuda_cudnn") == "cuda_cudnn"
    g = torch.Generator().manual_seed(13)
    qp = torch.cat([_ar(0, 20), _ar(50, 70)])[None].expand(2, -1)
    cases = ((qp[0], False, True),  # the queries' own keys: causal diagonal pieces
             (_ar(20, 50), False, False),  # keys between the query runs: unmasked past/future pieces only
             (torch.randperm(90, generator=g)[:37], True, None))  # scattered keys: masked pieces too
    for kp, ragged, diagonal in cases:
        launched.clear()
        q, k, v = _inputs(2, qp.shape[1], kp.numel(), 6, 2, dtype=torch.float32)
        _check(q, k, v, qp, kp, kernel="cuda_cudnn", min_run=4, tile=8, cudnn_min_flop=0)
        kinds = {name for name, _ in launched}
        assert "cuda_cudnn" in kinds and kinds <= {"cuda_cudnn", "cuda_efficient"}, launched
        assert ("cuda_efficient" in kinds) == ragged, launched
        if diagonal is not None:
            assert any(causal for name, causal in launched if name == "cuda_cudnn") == diagonal, launched


class _Launched(list):
    """(kernel, causal, queries, keys) of each launch; ``cudnn_op`` is the stand-in cuDNN op."""
    cudnn_op = staticmethod(_cudnn_contract)


@pytest.fixture
def cudnn_on_cpu(monkeypatch):
    """The cuDNN and flash launchers as recorders over CPU stand-ins with their contracts, cuDNN's
    first-call check forgotten before and after (it is cached per process)."""
    launched = _Launched()

    def cudnn(q, k, v, scale, causal, mask):
        launched.append(("cuda_cudnn", causal, q.shape[1], k.shape[1]))
        return fused_prefill._cuda_cudnn(q, k, v, scale, causal, mask, op=launched.cudnn_op)

    def flash(q, k, v, scale, causal, mask):  # square causal pieces only, like aten's flash
        assert not causal or q.shape[1] == k.shape[1]
        launched.append(("cuda_flash", causal, q.shape[1], k.shape[1]))
        return fused_prefill._cpu_flash(q, k, v, scale, causal, mask)

    monkeypatch.setitem(fused_prefill._LAUNCH, "cuda_cudnn", cudnn)
    monkeypatch.setitem(fused_prefill._LAUNCH, "cuda_flash", flash)
    monkeypatch.setattr(fused_prefill, "_flash_kernel", lambda importable=None: "cuda_flash")
    fused_prefill._cudnn_agrees.cache_clear()
    yield launched
    fused_prefill._cudnn_agrees.cache_clear()


def _diagonal_case():
    """40 queries at positions 60..99 over keys 0..99: one unmasked piece of 40 x 60 (2400 scores)
    and one causal diagonal piece of 40 x 40 (800 visible scores); 4 query heads of 16 over 2 KV heads."""
    q, k, v = _inputs(1, 40, 100, 4, 2, dtype=torch.float32)
    return q, k, v, _ar(60, 100)[None], _ar(0, 100)


def test_cudnn_runs_the_pieces_worth_a_plan_and_flash_the_rest(cudnn_on_cpu):
    """cuDNN builds a plan for each new shape, so a ``cuda_cudnn`` prefill runs a piece on cuDNN only when
    its FLOPs (4 * batch * heads * head dim * visible scores) reach ``cudnn_min_flop``, on flash below:
    with the bound between the two pieces' sizes the unmasked piece runs on cuDNN and the diagonal one on
    flash; the default bound (a 64 K-query model's sizes) sends this small prompt to flash; 0 sends both
    to cuDNN. Exact every time."""
    q, k, v, qp, kp = _diagonal_case()
    per_score = 4 * 4 * 16
    assert fused_prefill.CUDNN_MIN_FLOP > per_score * 2400
    for bound, want in ((per_score * 2000, {("cuda_cudnn", False, 40, 60), ("cuda_flash", True, 40, 40)}),
                        (fused_prefill.CUDNN_MIN_FLOP, {("cuda_flash", False, 40, 60), ("cuda_flash", True, 40, 40)}),
                        (0, {("cuda_cudnn", False, 40, 60), ("cuda_cudnn", True, 40, 40)}),
                        (per_score * 800, {("cuda_cudnn", False, 40, 60), ("cuda_cudnn", True, 40, 40)}),
                        (per_score * 800 + 1, {("cuda_cudnn", False, 40, 60), ("cuda_flash", True, 40, 40)})):
        cudnn_on_cpu.clear()
        calls = {}
        _check(q, k, v, qp, kp, kernel="cuda_cudnn", cudnn_min_flop=bound, calls=calls)
        pieces = [entry for entry in cudnn_on_cpu if entry[2:] != (64, 64)]  # not cuDNN's first-call check
        assert set(pieces) == want and len(pieces) == 2, (bound, cudnn_on_cpu)
        assert sum(calls.values()) == 2 and set(calls) == {name for name, *_ in want}
    # through ops (the validated entry) the bound is the same knob
    cudnn_on_cpu.clear()
    ops.prefill_attention(q, k, v, q_positions=qp, k_positions=kp, kernel="cuda_cudnn", cudnn_min_flop=0)
    assert {name for name, *_ in cudnn_on_cpu} == {"cuda_cudnn"}


@pytest.mark.parametrize("fault", ["raises", "lse_layout", "no_causal_mask"])
def test_a_cudnn_that_disagrees_with_flash_on_its_first_call_is_not_used(cudnn_on_cpu, fault):
    """cuDNN as the default rests on one GPU's measurement: where the op raises, returns its lse in another
    layout, or ignores the causal flag, its check piece (64 queries, causal, GQA) disagrees with flash, a
    RuntimeWarning names it once, and every piece runs on flash: exact, never a wrong answer."""
    def broken(q, k, v, causal, scale):
        if fault == "raises":
            raise RuntimeError("cuDNN Frontend error: no valid execution plan")
        out, lse = _cudnn_contract(q, k, v, causal and fault != "no_causal_mask", scale)
        if fault == "lse_layout":  # (B, L, H) read as (B, H, L)
            lse = lse[..., 0].transpose(1, 2).contiguous()
        return out, lse

    cudnn_on_cpu.cudnn_op = broken
    q, k, v, qp, kp = _diagonal_case()
    with pytest.warns(RuntimeWarning, match=r"cuDNN attention on cpu \(torch.float32, head dim 16\) .*"
                                            r"prefill pieces run on cuda_flash instead"):
        _check(q, k, v, qp, kp, kernel="cuda_cudnn", cudnn_min_flop=0)
    assert {name for name, *_ in cudnn_on_cpu} <= {"cuda_cudnn", "cuda_flash"}
    pieces = [entry for entry in cudnn_on_cpu if entry[2:] != (64, 64)]  # not the check piece
    assert pieces and {name for name, *_ in pieces} == {"cuda_flash"}, cudnn_on_cpu
    cudnn_on_cpu.clear()
    with warnings.catch_warnings():
        # the check is made once per (device, dtype, head dim)
        warnings.filterwarnings("error", message="prefill: cuDNN")
        _check(q, k, v, qp, kp, kernel="cuda_cudnn", cudnn_min_flop=0)
    assert {name for name, *_ in cudnn_on_cpu} == {"cuda_flash"}


def test_a_cudnn_that_agrees_is_checked_once_and_used(cudnn_on_cpu):
    q, k, v, qp, kp = _diagonal_case()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="prefill: cuDNN")
        _check(q, k, v, qp, kp, kernel="cuda_cudnn", cudnn_min_flop=0)
        checks = [e for e in cudnn_on_cpu if e[2:] == (64, 64)]
        assert len(checks) == 2 and {e[0] for e in checks} == {"cuda_cudnn", "cuda_flash"}  # both sides once
        cudnn_on_cpu.clear()
        _check(q, k, v, qp, kp, kernel="cuda_cudnn", cudnn_min_flop=0)
    assert sorted(cudnn_on_cpu) == [("cuda_cudnn", False, 40, 60), ("cuda_cudnn", True, 40, 40)]


def test_the_kernel_choice_is_made_once_and_refuses_a_fused_kernel_with_variants():
    """ops.prefill_kernel is the one choice: the variants the fused kernels cannot take route to the exact
    path when no kernel is forced, and a forced fused kernel with one of them is refused by name (not run
    without the window, which would be a silent wrong answer)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 6, h, 8, generator=g) for h in (2, 1, 1))
    pos = _ar(0, 6)[None]
    assert ops.prefill_kernel(q, v) == "cpu_flash"
    assert ops.prefill_kernel(q, v, window=3) == ops.prefill_kernel(q, v, softcap=5.0) == "decode"
    for kw, what in ((dict(window=3), "a sliding window"), (dict(softcap=5.0), "soft-capping")):
        with pytest.raises(ValueError, match=f"prefill kernel 'cpu_flash' takes no {what}"):
            ops.prefill_attention(q, k, v, q_positions=pos, k_positions=pos, kernel="cpu_flash", **kw)
    calls = {}
    out, lse = ops.prefill_attention(q, k, v, q_positions=pos, k_positions=pos, window=3, calls=calls)
    ref_o, ref_l = reference.partial_attention(q.double(), k.double(), v.double(), q_positions=pos,
                                               k_positions=pos, window=3)
    assert calls == {"decode": 1}
    assert torch.allclose(out.double(), ref_o, atol=1e-5) and torch.allclose(lse, ref_l, atol=1e-5)
