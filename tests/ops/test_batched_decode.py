"""The batched CPU decode path (``torch_decode._batched``): all rows in one set of torch calls, padded to one
key span, against the float64 reference and the per-row loop; and the rule (``use_batched``) that picks it.

Every variant of the loop's contract is run with the batched path forced (``use_batched`` patched to say yes,
``_batched`` counted so that a test cannot pass on the loop): ragged rows, an empty row, rows that start
past key 0, GQA and MHA, per-row positions with a window, soft-cap, several query tokens, a value head dim of
its own, fp16/bf16 and float64 input, a float64 lse, head-major, sequence-major and paged caches; the cache
outside each row's keys holds NaN, inf or huge finite values (never read by the loop: the batched path reads
them and must not let them through), and a NaN key inside one row gives NaN in that row's KV head only.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_tree.ops import reference, torch_decode

D = 16
LENS = [20, 0, 13, 17]
STARTS = [2, 0, 0, 17]  # row 3: start at its length, no key; row 0: its first two keys are not read
N = 20


class _Spy:
    """Counts calls of ``torch_decode.<name>`` (the real function still runs)."""

    def __init__(self, monkeypatch, name):
        self.calls = 0
        real = getattr(torch_decode, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch_decode, name, counted)


def _case(dtype, layout, hq, hkv, sq, dv, garbage, starts, seed=0):
    """q, k, v (or the paged k, v and a block table in kw), kw, and the contiguous k, v they hold: LENS rows
    from ``starts``, the keys outside them set to ``garbage``, a visible NaN key in row 2's last KV head."""
    g = torch.Generator().manual_seed(seed)
    b = len(LENS)
    q = torch.randn(b, sq, hq, D, generator=g)
    if layout == "head":  # ShardedKVCache's CPU layout: (b, hkv, N, D) storage seen as (b, N, hkv, D)
        k = torch.randn(b, hkv, N, D, generator=g).transpose(1, 2)
        v = torch.randn(b, hkv, N, dv, generator=g).transpose(1, 2)
    else:
        k, v = torch.randn(b, N, hkv, D, generator=g), torch.randn(b, N, hkv, dv, generator=g)
    firsts = starts or [0] * b
    for i, (first, length) in enumerate(zip(firsts, LENS)):
        for t in (k, v):
            t[i, length:] = garbage
            t[i, :first] = garbage
    k[2, 5, hkv - 1, 0] = float("nan")  # a visible NaN key: row 2's last KV head is NaN, the others not
    kw = {"cache_seqlens": torch.tensor(LENS, dtype=torch.int32)}
    if starts is not None:
        kw["cache_starts"] = torch.tensor(starts, dtype=torch.int32)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    kc, vc = k, v
    if layout == "paged":  # blocks of 4 in shuffled order, spare blocks of garbage, unused entries -1
        page, nb = 4, N // 4
        order = torch.randperm(b * nb + 3, generator=g).tolist()
        k = torch.full((b * nb + 3, page, hkv, D), garbage, dtype=dtype)
        v = torch.full((b * nb + 3, page, hkv, dv), garbage, dtype=dtype)
        table = torch.full((b, nb), -1, dtype=torch.int32)
        for i in range(b):
            for j in range(nb):
                if j * page < LENS[i] and (j + 1) * page > firsts[i]:
                    table[i, j] = blk = order[i * nb + j]
                    k[blk], v[blk] = kc[i, j * page:(j + 1) * page], vc[i, j * page:(j + 1) * page]
        kw["block_table"] = table
    return q, k, v, kw, kc, vc


def _want(q, kc, vc, kw):
    """The float64 reference on the contiguous cache."""
    kw = {n: x for n, x in kw.items() if n != "block_table"}
    return reference.partial_attention(q.double(), kc.double(), vc.double(), **kw)


def _check(got, want, tol):
    for x, w in zip(got, want):
        assert x.is_contiguous()
        assert torch.equal(torch.isnan(x), torch.isnan(w)), (torch.isnan(x).nonzero(), torch.isnan(w).nonzero())
        assert torch.equal(torch.isneginf(x), torch.isneginf(w))
        ok = torch.isfinite(w)
        assert (x.double()[ok] - w[ok]).abs().max() <= tol


def _positions(kw, sq, window):
    lens = kw["cache_seqlens"]
    kw["q_positions"] = (lens[:, None] - sq - 1 + torch.arange(sq)[None, :]).long()  # the last key(s) hidden
    kw["k_positions"] = torch.arange(N)
    if window is not None:
        kw["window"] = window


VARIANTS = {  # (hq, hkv, sq, dv, positions, window, softcap)
    "gqa_sq1": (8, 2, 1, D, False, None, None),
    "mha_sq3_positions_window": (4, 4, 3, D, True, 6, None),
    "mqa_softcap_dv8": (4, 1, 1, 8, False, None, 2.5),
    "gqa_sq2_positions_softcap": (6, 2, 2, D, True, None, 3.0),
}


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), 1e30])
@pytest.mark.parametrize("layout", ["head", "seq", "paged"])
@pytest.mark.parametrize("dtype,lse_dtype", [(torch.float32, torch.float64), (torch.float32, None),
                                             (torch.bfloat16, None), (torch.float64, None)])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_path_matches_the_reference(variant, dtype, lse_dtype, layout, garbage, monkeypatch):
    hq, hkv, sq, dv, positions, window, softcap = VARIANTS[variant]
    starts = STARTS if positions or softcap else None  # both with and without cache_starts
    q, k, v, kw, kc, vc = _case(dtype, layout, hq, hkv, sq, dv, garbage, starts)
    if positions:
        _positions(kw, sq, window)
    if softcap is not None:
        kw["softcap"] = softcap
    if lse_dtype is not None:
        kw["lse_dtype"] = lse_dtype
    want = _want(q, kc, vc, kw)
    monkeypatch.setattr(torch_decode, "use_batched", lambda *a: True)
    batched = _Spy(monkeypatch, "_batched")
    got = torch_decode.flash_decode(q, k, v, **kw)
    fused = dtype == torch.float32 and lse_dtype is None and dv == D and layout != "paged" and not (
        positions or softcap)
    assert batched.calls == (0 if fused else 1)  # the fused kernel takes the plain float32 case first
    assert got[0].dtype == dtype and got[1].dtype == (lse_dtype or torch.promote_types(dtype, torch.float32))
    tol = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float64: 1e-12}[dtype]
    _check(got, want, tol)
    # no key: row 1 (length 0) and, with starts, row 3 (start at its length)
    assert (got[0][1] == 0).all() and torch.isneginf(got[1][1]).all()
    if starts is not None:
        assert (got[0][3] == 0).all() and torch.isneginf(got[1][3]).all()
    # the visible NaN key: row 2's last KV head, only where a query sees key 5
    assert torch.isnan(got[1][2, -(hq // hkv):]).any() and not torch.isnan(got[1][2, :hq - hq // hkv]).any()
    monkeypatch.setattr(torch_decode, "BATCHED", False)
    loop = torch_decode.flash_decode(q, k, v, **kw)
    _check(got, [x.double() for x in loop], 2 * tol)  # and the loop, on the same inputs


def test_rows_with_garbage_outside_their_keys_are_redone_only_where_it_shows(monkeypatch):
    """The batched path does not mask V (a copy): a NaN or inf outside a row's keys makes that row's output
    NaN (0 * inf), and exactly the rows with a NaN are computed again by the loop; finite garbage (0 * 1e30 =
    0) redoes none but the row whose NaN is a visible key's (NaN in both paths)."""
    monkeypatch.setattr(torch_decode, "use_batched", lambda *a: True)
    for garbage, redone in ((1e30, 1), (float("nan"), 4), (float("inf"), 4)):
        q, k, v, kw, kc, vc = _case(torch.float32, "head", 8, 2, 1, D, garbage, STARTS, seed=5)
        kw["lse_dtype"] = torch.float64
        want = _want(q, kc, vc, kw)
        with monkeypatch.context() as m:
            calls = _Spy(m, "decode")
            got = torch_decode.flash_decode(q, k, v, **kw)
        # one call of decode, plus one per row redone: row 2's own NaN key redoes it in every case; with NaN
        # or inf garbage also rows 0 and 2 (garbage in the span outside their keys) and rows 1 and 3 (no
        # key: every value they multiply by 0 is garbage; the loop gives them 0 at once)
        assert calls.calls == 1 + redone, (garbage, calls.calls)
        _check(got, want, 2e-6)


def test_use_batched_takes_uniform_batches_and_short_ragged_ones():
    """The rule as benchmarks/cpu_batched.py measured it: uniform batches of two rows or more; ragged ones
    from BATCHED_RAGGED_MIN_ROWS rows while the span is at most BATCHED_RAGGED_MAX_SPAN keys and padding at
    most BATCHED_MAX_PADDING x the keys; never past BATCHED_MAX_ELEMENTS of buffers, never one row."""
    td = torch_decode
    assert not td.use_batched(1, 16, 16, 8, 0)
    assert td.use_batched(2, 4096, 8192, 8, 0) and td.use_batched(1500, 16, 1500 * 16, 16, 0)
    span = td.BATCHED_RAGGED_MAX_SPAN
    rows = td.BATCHED_RAGGED_MIN_ROWS
    assert td.use_batched(rows, span, rows * span - 1, 8, 0)  # one key short: ragged
    assert not td.use_batched(rows - 1, span, (rows - 1) * span - 1, 8, 0)
    assert not td.use_batched(rows, span + 1, rows * (span + 1) - 1, 8, 0)
    assert not td.use_batched(rows, span, rows * span // 2 - 1, 8, 0)  # more than 2x padded
    assert td.use_batched(rows, span, rows * span // 2, 8, 0)
    cap = td.BATCHED_MAX_ELEMENTS
    assert td.use_batched(2, cap // 16, cap // 8, 8, 0) and not td.use_batched(2, cap // 16, cap // 8, 8, 1)


def test_decode_takes_the_batched_path_where_the_rule_says(monkeypatch):
    """Through flash_decode (the real rule): a uniform batch of 4 with a float64 lse and a ragged batch of 8
    with positions are batched; one row, a ragged batch of 2 and a ragged batch of 8 past the span bound take
    the loop. Every one gives the reference's result."""
    batched = _Spy(monkeypatch, "_batched")
    g = torch.Generator().manual_seed(3)
    cases = [([30] * 4, True), ([30], False), ([30, 20], False), ([16, 9, 0, 12, 16, 5, 13, 11], True),
             ([300, 250, 160, 299, 270, 200, 280, 290], False)]
    for lens, want_batched in cases:
        b, n = len(lens), max(lens)
        q, k, v = torch.randn(b, 2, 8, D, generator=g), torch.randn(b, n, 2, D, generator=g), \
            torch.randn(b, n, 2, D, generator=g)
        kw = {"cache_seqlens": torch.tensor(lens, dtype=torch.int32), "lse_dtype": torch.float64,
              "q_positions": torch.tensor(lens)[:, None] - 2 + torch.arange(2)[None, :], "k_positions": torch.arange(n)}
        batched.calls = 0
        got = torch_decode.flash_decode(q, k, v, **kw)
        assert batched.calls == int(want_batched), lens
        _check(got, reference.partial_attention(q.double(), k.double(), v.double(), **kw), 2e-6)


def test_use_batched_is_the_rule_the_recorded_cpu_batched_table_measured():
    """benchmarks/results/cpu_batched.json (one thread) records per shape the batched/loop time ratio and the
    path use_batched took. The rule today takes the same path at every recorded shape (a changed rule needs the
    table measured again), and it never takes the batched path where that was slower by a wide margin."""
    table = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/cpu_batched.json").read_text())
    assert table["threads"] == 1 and {r["b"] for r in table["rows"]} >= {1, 2, 8, 64, 1500}
    for r in table["rows"]:
        b, n, hq = r["b"], r["n"], r["group"] * table["hkv"]
        lens = [n - (n // 2) * i // (b - 1) for i in range(b)] if r["ragged"] and b > 1 else [n] * b
        rule = torch_decode.use_batched(b, max(lens), sum(lens), hq * r["sq"], 0)
        assert rule == (r["rule"] == "batched"), r
        if rule:
            assert r["batched_over_loop"] < 1.25, r
