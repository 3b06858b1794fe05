"""Single-process checks of the torch reference, the merge formula and input validation."""

import math

import pytest
import torch

import megatron_tree as mt
from megatron_tree.ops import reference


def naive_attention(q, k, v, seqlens=None, q_pos=None, k_pos=None, scale=None):
    """Loop-by-loop fp64 attention: the independent oracle for reference.partial_attention."""
    b, sq, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(b, sq, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hkv)
            for i in range(sq):
                keys = [
                    j for j in range(n)
                    if (seqlens is None or j < int(seqlens[bi]))
                    and (q_pos is None or int(k_pos[j]) <= int(q_pos[bi, i]))
                ]
                if not keys:
                    continue
                s = torch.stack([q[bi, i, h].double() @ k[bi, j, kh].double() * scale for j in keys])
                p = torch.softmax(s, 0)
                out[bi, i, h] = sum(p[t] * v[bi, j, kh].double() for t, j in enumerate(keys))
                lse[bi, h, i] = torch.logsumexp(s, 0)
    return out, lse


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1), (4, 4)])
@pytest.mark.parametrize("sq", [1, 3])
def test_partial_attention_matches_naive(hq, hkv, sq):
    g = torch.Generator().manual_seed(hq * 10 + sq)
    b, n, d = 3, 11, 8
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([11, 0, 6], dtype=torch.int32)
    q_pos = torch.tensor([[10 - sq + 1 + i for i in range(sq)]] * b)
    k_pos = torch.arange(n)
    for kwargs, args in (
        ({}, ()),
        ({"cache_seqlens": seqlens}, (seqlens,)),
        ({"cache_seqlens": seqlens, "q_positions": q_pos, "k_positions": k_pos}, (seqlens, q_pos, k_pos)),
    ):
        out, lse = reference.partial_attention(q, k, v, **kwargs)
        want_out, want_lse = naive_attention(q, k, v, *args)
        torch.testing.assert_close(out, want_out, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, want_lse, atol=1e-12, rtol=0)
    # a row with no keys: zero output, -inf lse, no NaN
    out, lse = reference.partial_attention(q, k, v, cache_seqlens=seqlens)
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))
    assert not torch.isnan(out).any()


def test_lse_dtype_and_output_dtype():
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 9, 2, 16, dtype=torch.bfloat16)
    out, lse = mt.flash_decode(q, k, k.clone())
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.shape == (2, 1, 4, 16) and lse.shape == (2, 4, 1)


def test_merge_states_of_any_split_equals_whole():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 20, 3, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 20, 3, 8, generator=g, dtype=torch.float64)
    whole_out, whole_lse = mt.flash_decode(q, k, v)
    cuts = [0, 0, 7, 7, 13, 20]  # empty shards in the middle and at the front
    parts = [mt.flash_decode(q, k[:, a:b], v[:, a:b]) for a, b in zip(cuts, cuts[1:])]
    out, lse = mt.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out, whole_out, atol=1e-13, rtol=0)
    torch.testing.assert_close(lse, whole_lse, atol=1e-13, rtol=0)


def test_merge_all_empty_gives_zero_not_nan():
    outs = torch.zeros(3, 1, 1, 2, 4)
    lses = torch.full((3, 1, 2, 1), float("-inf"))
    out, lse = mt.merge_states(outs, lses)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))


def test_empty_shard_and_nan_lse_in_the_reference_and_torch_path():
    # A shard with no keys at all (N = 0): zeros and -inf, from the oracle and the torch path.
    q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 0, 2, 16)
    for out, lse in (reference.partial_attention(q, k, k), mt.flash_decode(q, k, k, lse_dtype=torch.float64)):
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse)) and out.shape == (2, 1, 4, 16)
    # A NaN partial lse is garbage in: it comes out NaN, never as a row with "no keys" (0, -inf).
    outs = torch.randn(2, 1, 1, 1, 4)
    out, lse = mt.merge_states(outs, torch.tensor([float("nan"), 0.0]).view(2, 1, 1, 1))
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    with pytest.raises(TypeError, match="lses must be float32 or float64, got torch.float16"):
        mt.merge_states(outs, torch.tensor([7e4, 6.9e4]).half().view(2, 1, 1, 1))


def _merge_by_rows(outs, lses):
    """The merge formula transcribed row by row (one (batch, head, token) at a time, plain Python over
    the P states): the weights exp(lse_u - m) -- formed in float32 where the lse and the accumulation
    are both float32 (m is the lses' own maximum: reference._weights' own_max), else in float64 from
    the lse in its merge dtype and rounded once to the accumulation dtype -- their products with the states and the two sums in that
    dtype in state order, out = num / den (0 where den == 0), lse = log(den) + m in the lse dtype --
    the oracle the stacked torch merge must equal bit for bit."""
    p, b, sq, hq, d = outs.shape
    acc = torch.float64 if outs.dtype == torch.float64 else torch.float32
    ld = torch.float64 if torch.float64 in (lses.dtype, acc) else torch.float32
    out = torch.zeros(b, sq, hq, d, dtype=acc)
    lse = torch.zeros(b, hq, sq, dtype=ld)
    for bi in range(b):
        for h in range(hq):
            for s in range(sq):
                ls = [lses[u, bi, h, s].to(ld) for u in range(p)]
                m = torch.stack(ls).max()  # NaN if any is
                m = m if torch.isfinite(m) else torch.zeros((), dtype=ld)  # every state empty, or a NaN
                if ld == acc == torch.float32:  # against its own maximum: the float32 difference
                    ws = [torch.exp(x - m) for x in ls]
                else:
                    ws = [torch.exp(x.double() - m.double()).to(acc) for x in ls]
                num, den = torch.zeros(d, dtype=acc), torch.zeros((), dtype=acc)
                for u in range(p):
                    num = num + outs[u, bi, s, h].to(acc) * ws[u]
                    den = den + ws[u]
                out[bi, s, h] = torch.zeros(d, dtype=acc) if den == 0 else num / den
                lse[bi, h, s] = torch.log(den.to(ld)) + m
    return out.to(outs.dtype), lse


def _same_bits(a, b):
    """Equal bit for bit (NaN where NaN; a zero's sign counts)."""
    ints = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(torch.isnan(a), torch.isnan(b)) and \
        torch.equal(a.masked_fill(torch.isnan(a), 0).view(ints[a.dtype]),
                    b.masked_fill(torch.isnan(b), 0).view(ints[b.dtype]))


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.float64])
def test_merge_equals_the_formula_row_by_row_bit_for_bit(out_dtype, lse_dtype):
    """The stacked merge (ops.merge_states, CPU) against the formula row by row: P = 2..5 states, one
    and two query tokens, score magnitudes up to 1e5, empty states (out 0, lse -inf) in some rows
    and every state empty in others, a NaN lse -- the same bits, zero signs included."""
    g = torch.Generator().manual_seed(5)
    for trial, (p, sq, scale) in enumerate([(2, 1, 1.0), (3, 2, 30.0), (5, 1, 1e4), (4, 2, 1e5), (2, 2, 1.0)]):
        outs = torch.randn(p, 2, sq, 3, 4, generator=g, dtype=torch.float64).to(out_dtype)
        lses = (torch.randn(p, 2, 3, sq, generator=g, dtype=torch.float64) * scale).to(lse_dtype)
        empty = torch.rand(p, 2, 3, sq, generator=g) < 0.3
        empty[:, 1, 2, 0] = True  # a row with no key in any state
        lses[empty] = float("-inf")
        outs.masked_fill_(empty.transpose(-1, -2).unsqueeze(-1), 0)  # a state with no key: out 0
        if trial == 1:
            lses[1, 0, 1, 0] = float("nan")
        out, lse = mt.merge_states(outs, lses)
        want, want_lse = _merge_by_rows(outs, lses)
        assert _same_bits(out, want) and _same_bits(lse, want_lse), (p, sq, scale)
        assert torch.all(out[1, 0, 2] == 0) and torch.isneginf(lse[1, 2, 0])
        if trial == 1:
            assert torch.isnan(out[0, 0, 1]).all() and torch.isnan(lse[0, 1, 0])


def test_merge_states_shape_errors():
    with pytest.raises(ValueError, match="lses must have shape"):
        mt.merge_states(torch.zeros(2, 1, 1, 2, 4), torch.zeros(2, 1, 1, 2))
    with pytest.raises(ValueError, match=r"outs \(P, B, Sq, Hq, D\)"):
        mt.merge_states(torch.zeros(2, 1, 2, 4), torch.zeros(2, 1, 2, 1))


def _qkv(dtype=torch.float32):
    return torch.randn(2, 1, 8, 16, dtype=dtype), torch.randn(2, 5, 2, 16, dtype=dtype), torch.randn(2, 5, 2, 16, dtype=dtype)


@pytest.mark.parametrize(
    "mutate,exc,pattern",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q, k.double(), v), TypeError, "share one dtype"),
        (lambda q, k, v: (q, k, v[:, :4]), ValueError, "same shape"),
        (lambda q, k, v: (q, k[:1], v[:1]), ValueError, "batch size of k/v"),
        (lambda q, k, v: (q, k[..., :8], v[..., :8]), ValueError, "head dim"),
        (lambda q, k, v: (q[:, :, :7], k, v), ValueError, r"multiple of the number of KV heads \(2\)"),
        (lambda q, k, v: (q, k.to("meta"), v.to("meta")), ValueError, "one device"),
        (lambda q, k, v: (q.long(), k, v), TypeError, "floating-point"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, exc, pattern):
    q, k, v = mutate(*_qkv())
    with pytest.raises(exc, match=pattern):
        mt.flash_decode(q, k, v)
    with pytest.raises(exc, match=pattern):
        mt.tree_decode(q, k, v, None)


@pytest.mark.parametrize(
    "seqlens,exc,pattern",
    [
        (torch.tensor([1, 2], dtype=torch.int64), TypeError, "must be int32"),
        (torch.tensor([1, 2, 3], dtype=torch.int32), ValueError, r"shape \(2,\)"),
        (torch.tensor([1, 6], dtype=torch.int32), ValueError, r"\[0, 5\]"),
        (torch.tensor([-1, 2], dtype=torch.int32), ValueError, r"\[0, 5\]"),
        ([1, 2], TypeError, "int32 tensor"),
    ],
)
def test_bad_cache_seqlens(seqlens, exc, pattern):
    q, k, v = _qkv()
    with pytest.raises(exc, match=pattern):
        mt.tree_decode(q, k, v, None, cache_seqlens=seqlens)


def test_positions_must_come_in_pairs_and_shapes():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="both q_positions and k_positions"):
        mt.flash_decode(q, k, v, q_positions=torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"k_positions must be .* shape \(2, 5\) or \(5,\)"):
        mt.flash_decode(q, k, v, q_positions=torch.zeros(2, 1, dtype=torch.long), k_positions=torch.arange(4))


@pytest.mark.parametrize("scale, exc, pattern", [
    (float("nan"), ValueError, "softmax_scale must be finite, got nan"),
    (float("inf"), ValueError, "softmax_scale must be finite, got inf"),
    ("0.25", TypeError, "softmax_scale must be a float .* got str '0.25'"),
    (True, TypeError, "softmax_scale must be a float .* got bool True"),
])
def test_a_softmax_scale_that_is_not_a_finite_number_is_refused(scale, exc, pattern):
    """A NaN or infinite scale made every score NaN or infinite, answered silently (and a NaN one, never equal to
    itself, could never be found agreed between ranks); a string failed deep in the kernel's arithmetic. Every
    entry point refuses it, and a scale of another numeric type (an int) is a scale."""
    q, k, v = _qkv()
    for call in (lambda: mt.flash_decode(q, k, v, softmax_scale=scale),
                 lambda: mt.tree_decode(q, k, v, None, softmax_scale=scale),
                 lambda: reference.partial_attention(q, k, v, softmax_scale=scale)):
        with pytest.raises(exc, match=pattern):
            call()
    out, _ = mt.flash_decode(q, k, v, softmax_scale=1)
    want, _ = reference.partial_attention(q.double(), k.double(), v.double(), softmax_scale=1.0)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_unknown_strategy_and_backend():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown merge strategy 'ring'"):
        mt.tree_decode(q, k, v, None, strategy="ring")
    with pytest.raises(ValueError, match="unknown backend argument 'cuda'"):
        mt.flash_decode(q, k, v, backend="cuda")


# ---- paged KV cache (block_table) ---------------------------------------------------------

def test_paged_reference_equals_naive_on_the_rows_it_names():
    from tests.helpers.paged import to_paged

    g = torch.Generator().manual_seed(7)
    b, n, hq, hkv, d, page = 3, 13, 6, 2, 8, 4
    q = torch.randn(b, 2, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([13, 0, 6], dtype=torch.int32)
    kp, vp, table = to_paged(k, v, seqlens, page)
    assert table.shape == (3, 4) and table[1].eq(-1).all() and torch.isnan(kp).any()
    # Causal by per-row positions over the table's 16 logical slots (rows start at different offsets).
    k_pos = torch.stack([torch.arange(16) + off for off in (0, 5, 100)])
    q_pos = torch.tensor([[11, 12], [3, 4], [103, 104]])
    out, lse = reference.partial_attention(q, kp, vp, block_table=table, cache_seqlens=seqlens,
                                           q_positions=q_pos, k_positions=k_pos)
    for bi in range(b):
        want_o, want_l = naive_attention(q[bi:bi + 1], k[bi:bi + 1], v[bi:bi + 1], seqlens[bi:bi + 1],
                                         q_pos[bi:bi + 1], k_pos[bi, :n])
        torch.testing.assert_close(out[bi:bi + 1], want_o, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse[bi:bi + 1], want_l, atol=1e-12, rtol=0)
    assert torch.all(out[1] == 0) and torch.isneginf(lse[1]).all()


def test_gather_pages_reads_only_used_blocks_and_zeroes_the_tail():
    pool = torch.arange(5 * 2, dtype=torch.float32).reshape(5, 2, 1, 1)  # 5 blocks of 2 slots
    table = torch.tensor([[4, 0, -1], [2, 3, 1]], dtype=torch.int32)
    got = reference.gather_pages(pool, table, torch.tensor([3, 5], dtype=torch.int32))
    assert got[..., 0, 0].tolist() == [[8, 9, 0, 0, 0, 0], [4, 5, 6, 7, 2, 0]]


@pytest.mark.parametrize(
    "mutate,exc,pattern",
    [
        (lambda t, s: (t.long(), s), TypeError, "block_table must be int32"),
        (lambda t, s: (t[:1], s), ValueError, r"block_table must have shape \(2, max_blocks\)"),
        (lambda t, s: (t.clone().fill_(9), s), ValueError, r"block_table\[0, 0\] = 9 is not a block .* num_blocks = 4"),
        (lambda t, s: (t, torch.tensor([3, 7], dtype=torch.int32)), ValueError, r"cache_seqlens must lie in \[0, 6\]"),
    ],
)
def test_bad_block_table_raises_clear_errors(mutate, exc, pattern):
    q = torch.randn(2, 1, 4, 8)
    pool = torch.randn(4, 2, 2, 8)  # 4 blocks of 2 slots
    table = torch.tensor([[0, 1, -1], [2, 3, 3]], dtype=torch.int32)  # -1 past row 0's 3 keys: fine
    seqlens = torch.tensor([3, 6], dtype=torch.int32)
    mt.flash_decode(q, pool, pool, block_table=table, cache_seqlens=seqlens)
    t, s = mutate(table, seqlens)
    with pytest.raises(exc, match=pattern):
        mt.flash_decode(q, pool, pool, block_table=t, cache_seqlens=s)
    with pytest.raises(ValueError, match=r"k_positions must be .* shape \(2, 6\) or \(6,\) \(max_blocks \* block_size\)"):
        mt.flash_decode(q, pool, pool, block_table=table, cache_seqlens=seqlens,
                        q_positions=torch.zeros(2, 1, dtype=torch.long), k_positions=torch.arange(4))


def test_out_dtype_keeps_the_partial_unrounded():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 9, 2, 16, generator=g).bfloat16() for _ in range(2))
    full, lse = reference.partial_attention(q, k, v, out_dtype=torch.float32)
    rounded, lse2 = reference.partial_attention(q, k, v)
    assert full.dtype == torch.float32 and rounded.dtype == torch.bfloat16 and torch.equal(lse, lse2)
    assert torch.equal(full.bfloat16(), rounded) and not torch.equal(full, rounded.float())
    with pytest.raises(TypeError, match="out_dtype must be a floating-point torch.dtype"):
        mt.flash_decode(q, k, v, out_dtype=torch.int32)


def test_float32_merge_is_within_roundings_of_the_float64_merge():
    """The float32 merge forms each weight's difference in float32 (against the lses' own maximum):
    its out stays within a few float32 roundings of the float64 merge of the same values, the lse
    within a few roundings of its own magnitude -- lse differences from 1e-3 to 30 and magnitudes
    up to 1e4, P = 2..6."""
    g = torch.Generator().manual_seed(11)
    eps = torch.finfo(torch.float32).eps
    for p, spread, offset in [(2, 1e-3, 0.0), (3, 1.0, 5.0), (6, 30.0, -40.0), (4, 5.0, 1e4), (5, 20.0, -1e4)]:
        outs = torch.randn(p, 3, 2, 4, 8, generator=g)
        lses = (torch.randn(p, 3, 4, 2, generator=g, dtype=torch.float64) * spread + offset).float()
        out, lse = mt.merge_states(outs, lses)
        want, want_lse = mt.merge_states(outs.double(), lses.double())
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert (out.double() - want).abs().max() <= 4 * eps * outs.abs().max(), (p, spread, offset)
        assert ((lse.double() - want_lse).abs() <= 4 * eps * (want_lse.abs() + 1)).all(), (p, spread, offset)


def test_lse_weights_against_a_shift_that_is_not_the_maximum_keep_the_float64_difference():
    """``lse_weights`` of float32 lses against a shared shift that is not their maximum (``comm``'s
    ``shifted``, ``packed``): differences up to +-60, each formed in float64 and exp rounded once to
    float32 -- bit for bit; only ``merge_stacked``'s own maximum (own_max) may form it in float32."""
    g = torch.Generator().manual_seed(3)
    lse = (torch.rand(257, generator=g, dtype=torch.float64) * 120 - 60).float()
    for m in (torch.tensor(0.3337), torch.tensor(-1.7e1), (torch.rand(257, generator=g) * 8 - 4).float()):
        want = torch.exp(lse.double() - m.double()).float()
        assert torch.equal(reference.lse_weights(lse, m), want), m
        assert torch.equal(reference.lse_weights(lse, m, torch.float32), want), m


def test_lse_weights_take_a_shift_that_broadcasts_to_a_larger_shape():
    """``lse_weights(lse, m)`` with ``m`` broadcasting ``lse`` to a larger shape (as its docstring allows):
    the weights of every pairing, each exp(float64 difference) rounded once -- an in-place difference on the
    widened lse raised a shape error here."""
    g = torch.Generator().manual_seed(12)
    lse = torch.randn(257, generator=g) * 10
    m = torch.randn(3, 1, generator=g) * 10
    w = reference.lse_weights(lse, m)
    assert w.shape == (3, 257) and w.dtype == torch.float32
    assert torch.equal(w, torch.exp(lse.double()[None, :] - m.double()).float())

