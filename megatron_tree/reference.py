"""Pure-torch partial attention and the exact merge of partial states.

This module is the CPU path of :func:`megatron_tree.flash_decode` and the oracle every
kernel and every distributed strategy is tested against. It holds the project's single
merge formula (DESIGN.md section 1), split into two halves so that the distributed merges
in ``comm.py`` can put collectives between them:

* :func:`lse_weights` -- ``w_u = exp(lse_u - m)`` with empty shards and an all-empty
  group neutralised (no NaN), and
* :func:`normalize` -- ``o = num / den``, ``lse = m + log(den)``.

:func:`merge_states` is those two halves around a local max/sum. Derivation: with
``lse_u = log sum_{j in u} exp(s_j)`` and ``o_u = sum_{j in u} exp(s_j - lse_u) v_j``,
``sum_u exp(lse_u) o_u = sum_j exp(s_j) v_j``; dividing numerator and denominator by
``exp(m)`` keeps every exponent <= 0 (the same rescaling as flash-attention's online
softmax, ring-flash-attention's ``_update_out_and_lse`` and flashinfer's ``merge_state``).

Everything here accumulates in float32 (or float64 when given float64) and uses natural
logarithms.

Log-sum-exps that are merged again are carried in float64 (``lse_dtype=torch.float64``;
issue 12 item 6). A float32 lse of magnitude 1e4 is only known to ~5e-4 (half a unit in the
last place), and a partial's weight ``exp(lse_u - m)`` inherits that as a relative error:
merging shards of a sequence whose scores are ~1e4 would be off by ~1e-4 where one call
over all keys is off by 1e-7 (3e-5 to 3e-4 measured at 1e4, 5e-4 to 1.5e-3 at 1e5, depending
on how near-ties fall across shards). In float64 ``m + log(l)`` keeps both the score-sized ``m``
(an exact float32 value) and the small ``log(l)`` to full precision, so the weights are
right to one float32 rounding at any magnitude.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "partial_attention", "merge_states", "lse_weights", "normalize", "weighted", "acc_dtype",
    "check_decode_inputs", "check_cache_seqlens", "check_block_table", "check_merge_inputs", "gather_pages",
    "kv_length", "lse_acc_dtype", "LSE_DTYPES",
]

LSE_DTYPES = (torch.float32, torch.float64)
"""Dtypes a partial state's lse may be asked in (``lse_dtype=``)."""


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype partial states accumulate and travel in: float64 for float64 input, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_acc_dtype(lse_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The lse dtype of a partial state: ``lse_dtype`` when given, else :func:`acc_dtype` of ``dtype``;
    never narrower than the accumulation dtype (float64 input keeps a float64 lse)."""
    acc = acc_dtype(dtype)
    if lse_dtype is None:
        return acc
    if lse_dtype not in LSE_DTYPES:
        raise TypeError(f"lse_dtype must be one of {LSE_DTYPES} or None, got {lse_dtype!r}")
    return torch.promote_types(lse_dtype, acc)


def _rowwise_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for (batch, ...) operands, one matmul per batch row when batch > 1."""
    if a.shape[0] <= 1:
        return torch.matmul(a, b)
    return torch.stack([torch.matmul(a[i], b[i]) for i in range(a.shape[0])])


def kv_length(k: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
    """Keys per batch row that ``cache_seqlens`` and ``k_positions`` count: ``seqlen_k`` of a
    contiguous cache, ``max_blocks * block_size`` of a paged one."""
    return k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]


def check_decode_inputs(q, k, v, cache_seqlens=None, q_positions=None, k_positions=None, block_table=None,
                        out_dtype=None, *, by_value: bool = True, lse_dtype=None) -> None:
    """Validate the flash-decode contract and raise ``ValueError``/``TypeError`` naming the problem.

    q: (batch, seqlen_q, nheads_q, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), or with
    ``block_table`` (batch, max_blocks) int32 a paged cache (num_blocks, block_size, nheads_kv,
    headdim); cache_seqlens: (batch,) int32 in [0, N]; q_positions: (batch, seqlen_q) integer;
    k_positions: (batch, N) or (N,) integer, where N = :func:`kv_length`; out_dtype: a
    floating-point dtype or None; lse_dtype: float32, float64 or None. ``by_value=False`` skips the checks that read tensor values
    (on CUDA or while tracing they would synchronise with the host every step).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(batch, seqlen, heads, headdim)" if name == "q" or block_table is None else \
                "(num_blocks, block_size, heads, headdim) with a block_table"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    b, _, hq, d = q.shape
    bk, _, hkv, dk = k.shape
    if block_table is None and bk != b:
        raise ValueError(f"batch size of k/v ({bk}) differs from q's ({b})")
    if dk != d:
        raise ValueError(f"head dim of k/v ({dk}) differs from q's ({d})")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv})"
        )
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")
    lse_acc_dtype(lse_dtype, q.dtype)  # raises for anything but float32 / float64 / None
    n = kv_length(k, block_table)
    if cache_seqlens is not None:
        check_cache_seqlens(cache_seqlens, b, n, q.device, by_value=by_value)
    if block_table is not None:
        check_block_table(block_table, b, k.shape[0], k.shape[1], cache_seqlens, q.device, by_value=by_value)
    if (q_positions is None) != (k_positions is None):
        raise ValueError("causal masking needs both q_positions and k_positions (or neither)")
    if q_positions is not None:
        if q_positions.dtype.is_floating_point or tuple(q_positions.shape) != (b, q.shape[1]):
            raise ValueError(
                f"q_positions must be an integer tensor of shape ({b}, {q.shape[1]}), "
                f"got {q_positions.dtype} {tuple(q_positions.shape)}"
            )
        if k_positions.dtype.is_floating_point or tuple(k_positions.shape) not in ((b, n), (n,)):
            what = " (max_blocks * block_size)" if block_table is not None else ""
            raise ValueError(
                f"k_positions must be an integer tensor of shape ({b}, {n}) or ({n},){what}, "
                f"got {k_positions.dtype} {tuple(k_positions.shape)}"
            )
        for name, t in (("q_positions", q_positions), ("k_positions", k_positions)):
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_block_table(block_table, batch: int, num_blocks: int, block_size: int, cache_seqlens, device, *,
                      by_value: bool = True) -> None:
    """block_table: (batch, max_blocks) int32 on ``device``; with ``by_value`` also every entry a
    row uses (the first ``ceil(cache_seqlens[b] / block_size)``) in ``[0, num_blocks)``.

    Entries past a row's length are never read (engines pad them with -1 or 0).
    """
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 tensor of shape ({batch}, max_blocks), "
                        f"got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks) (one row per batch row), "
                         f"got {tuple(block_table.shape)}")
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
    if block_size < 1:
        raise ValueError(f"a paged cache needs blocks of at least one token, got block_size {block_size}")
    if not by_value or batch == 0 or block_table.shape[1] == 0:
        return
    lens = (cache_seqlens.to(torch.int64) if cache_seqlens is not None
            else torch.full((batch,), block_table.shape[1] * block_size, device=device))
    used = torch.arange(block_table.shape[1], device=device)[None, :] < (lens + block_size - 1)[:, None] // block_size
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {col}] = {int(block_table[row, col])} is not a block of the cache "
            f"(expected 0 <= id < num_blocks = {num_blocks} for every block a row uses)"
        )


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor | None = None):
    """A paged cache's keys (or values) in each row's logical order: (batch, N, heads, headdim).

    cache: (num_blocks, block_size, heads, headdim); block_table: (batch, max_blocks) int32;
    cache_seqlens: (batch,) int32 or None (every block of the table used). Slots past a
    row's length are zero, and the blocks they would name are not read.
    """
    b, max_blocks = block_table.shape
    page = cache.shape[1]
    n = max_blocks * page
    lens = (cache_seqlens.to(torch.int64) if cache_seqlens is not None
            else torch.full((b,), n, dtype=torch.int64, device=cache.device))
    used = torch.arange(max_blocks, device=cache.device)[None, :] < (lens + page - 1)[:, None] // page
    ids = torch.where(used, block_table.to(torch.int64), torch.zeros_like(block_table, dtype=torch.int64))
    out = cache[ids.reshape(-1)].reshape(b, n, *cache.shape[2:]) if cache.shape[0] else \
        cache.new_zeros((b, n, *cache.shape[2:]))
    valid = torch.arange(n, device=cache.device)[None, :] < lens[:, None]
    return torch.where(valid[:, :, None, None], out, torch.zeros((), dtype=cache.dtype, device=cache.device))


def check_cache_seqlens(cache_seqlens, batch: int, seqlen_k: int, device, *, by_value: bool = True) -> None:
    """cache_seqlens: (batch,) int32 on ``device``; with ``by_value`` also every value in [0, seqlen_k].

    ``by_value=False`` skips reading the values (on CUDA or while tracing that would force a
    host-device synchronisation every step and break CUDA-graph capture).
    """
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int32 tensor of shape ({batch},), got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens must have shape ({batch},) (one per batch row), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
    if by_value and batch and (int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > seqlen_k):
        raise ValueError(
            f"cache_seqlens must lie in [0, {seqlen_k}] (the KV length), got values in "
            f"[{int(cache_seqlens.min())}, {int(cache_seqlens.max())}]"
        )


def check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """outs: (P, batch, seqlen_q, nheads_q, headdim); lses: (P, batch, nheads_q, seqlen_q) float32 or
    float64; P >= 1."""
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"merge_states: {name} must be a stacked tensor (torch.stack the partial states), "
                            f"got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"merge_states: {name} must be floating point, got {t.dtype}")
    if lses.dtype not in LSE_DTYPES:
        raise TypeError(f"merge_states: lses must be float32 or float64, got {lses.dtype} (an lse rounded to 16 "
                        "bits is off by up to 0.5 % of its value, and fp16 overflows past 65504: keep partial "
                        "lse in float32, or float64 for large scores)")
    if outs.dim() != 5 or lses.dim() != 4:
        raise ValueError(
            f"merge_states expects outs (P, B, Sq, Hq, D) and lses (P, B, Hq, Sq), "
            f"got {tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    p, b, sq, hq, _ = outs.shape
    if p == 0:
        raise ValueError(f"merge_states needs at least one partial state (P >= 1), got outs {tuple(outs.shape)} "
                         "with P = 0")
    if tuple(lses.shape) != (p, b, hq, sq):
        raise ValueError(f"lses must have shape {(p, b, hq, sq)} to match outs {tuple(outs.shape)}, got {tuple(lses.shape)}")


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    lse_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one shard of keys/values, returning the partial state.

    q: (batch, seqlen_q, nheads_q, headdim)
    k, v: (batch, seqlen_k, nheads_kv, headdim), nheads_q % nheads_kv == 0 (GQA/MQA; KV is
        never repeated: query heads are grouped onto their KV head instead)
    block_table: (batch, max_blocks) int32 -- k, v are then a paged cache (num_blocks,
        block_size, nheads_kv, headdim) and row b's key j is slot ``j % block_size`` of block
        ``block_table[b, j // block_size]``; seqlen_k below means max_blocks * block_size
    cache_seqlens: (batch,) int32 -- keys ``[0, cache_seqlens[b])`` of row b are valid
    q_positions: (batch, seqlen_q), k_positions: (batch, seqlen_k) or (seqlen_k,) -- global
        token positions (with a block table: of each row's keys in that logical order); when
        given, key j is visible to query i iff k_pos[j] <= q_pos[i]
    out_dtype: dtype of ``out`` (default q.dtype)
    lse_dtype: float64 forms ``lse = m + log(l)`` in float64 (for merging again; module docstring)
    returns out: (batch, seqlen_q, nheads_q, headdim) in out_dtype, zero where no key is visible
            lse: (batch, nheads_q, seqlen_q) in lse_dtype (default float32; float64 for float64
                 input), natural log, -inf where no key is visible
    """
    check_decode_inputs(q, k, v, cache_seqlens, q_positions, k_positions, block_table, out_dtype,
                        lse_dtype=lse_dtype)
    if block_table is not None:
        k, v = gather_pages(k, block_table, cache_seqlens), gather_pages(v, block_table, cache_seqlens)
    b, sq, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    acc = acc_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    # (b, hkv, g*sq, d): query heads of one KV group side by side; k as (b, hkv, n, d).
    qg = q.to(acc).reshape(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * sq, d)
    kt = k.to(acc).permute(0, 2, 1, 3)
    vt = v.to(acc).permute(0, 2, 1, 3)
    # One matmul per batch row: a (b, hkv) batch of the permuted (b, n, hkv, d) cache cannot be
    # flattened into one bmm without copying the whole cache (measured ~25x slower at b=4 on CPU).
    scores = _rowwise_matmul(qg, kt.transpose(-1, -2)) * scale  # (b, hkv, g*sq, n)

    mask = None
    if cache_seqlens is not None:
        mask = torch.arange(n, device=q.device)[None, :] < cache_seqlens[:, None].to(torch.int64)
        mask = mask[:, None, None, :]  # (b, 1, 1, n)
    if q_positions is not None:
        kp = k_positions if k_positions.dim() == 2 else k_positions[None, :].expand(b, n)
        causal = kp[:, None, :].to(torch.int64) <= q_positions[:, :, None].to(torch.int64)  # (b, sq, n)
        causal = causal[:, None, None, :, :].expand(b, 1, g, sq, n).reshape(b, 1, g * sq, n)
        mask = causal if mask is None else mask & causal
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))

    if n:
        m = scores.amax(dim=-1)  # (b, hkv, g*sq); -inf where nothing is visible
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    else:  # an empty shard: no key, so no maximum (den below is 0)
        m = scores.new_zeros(scores.shape[:-1])
    probs = torch.exp(scores - m[..., None])  # exp(-inf) = 0 on masked keys
    den = probs.sum(dim=-1)
    has = den > 0
    out = _rowwise_matmul(probs / torch.where(has, den, torch.ones_like(den))[..., None], vt)  # (b, hkv, g*sq, d)
    # m is a score (exact in acc); m + log(den) formed in the lse dtype (float64 keeps it whole)
    ld = lse_acc_dtype(lse_dtype, q.dtype)
    lse = torch.where(has, m.to(ld) + torch.log(torch.where(has, den, torch.ones_like(den)).to(ld)),
                      torch.full_like(den, float("-inf"), dtype=ld))

    out = out.reshape(b, hkv, g, sq, d).permute(0, 3, 1, 2, 4).reshape(b, sq, hq, d)
    lse = lse.reshape(b, hkv, g, sq).reshape(b, hq, sq)
    return out.to(q.dtype if out_dtype is None else out_dtype), lse


def lse_weights(lse: torch.Tensor, m: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``w = exp(lse - m)``: weight of a partial state relative to the running maximum ``m``.

    lse, m: broadcastable float tensors (natural log; float32 or float64, each). An empty
    shard (``lse = -inf``) gets weight 0, also when every shard is empty (``m = -inf``), so no
    NaN is ever produced. ``m`` need not be the maximum (``comm``'s ``shifted`` passes a
    shared shift, ``packed`` the maximum of the lse rounded to float32).
    dtype: the weights' dtype (default lse's).

    The difference is formed in float64, where ``lse - m`` of two float32 values is exact,
    and ``exp`` rounded once to ``dtype``: the weight's relative error is one rounding
    whatever ``|lse - m|`` is (in float32, ``lse - m = 40`` alone would be off by 2e-6).
    """
    dtype = lse.dtype if dtype is None else dtype
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(lse.double() - m_safe.double()).to(dtype)


def normalize(num: torch.Tensor, den: torch.Tensor, m: torch.Tensor,
              lse_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish a merge: ``o = num / den`` and ``lse = m + log(den)``.

    num: (batch, seqlen_q, nheads_q, headdim) = sum_u w_u * o_u
    den: (batch, nheads_q, seqlen_q) = sum_u w_u; m: (batch, nheads_q, seqlen_q), the shift
        the weights were taken against (the maximum of the lse, or any shared value)
    lse_dtype: dtype the lse is formed and returned in (default: the wider of m's and den's);
        float64 keeps a score-sized lse to full precision for a merge that follows
    returns (out, lse) with out = 0 and lse = -inf where den == 0 (no key anywhere); a NaN den
    gives NaN (never hidden as an empty row).
    """
    ld = torch.promote_types(m.dtype, den.dtype) if lse_dtype is None else lse_dtype
    # Only den == 0 means "no key": a NaN den (a NaN partial lse upstream) stays NaN, visibly.
    den_o = den.transpose(1, 2).unsqueeze(-1)  # (b, sq, hq, 1)
    out = torch.where(den_o == 0, torch.zeros_like(num), num / torch.where(den_o == 0, torch.ones_like(den_o), den_o))
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).to(ld)
    empty = den == 0
    lse = torch.where(empty, torch.full_like(den, float("-inf"), dtype=ld),
                      m_safe + torch.log(torch.where(empty, torch.ones_like(den), den).to(ld)))
    return out, lse


def weighted(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * o`` with w: (..., batch, nheads_q, seqlen_q) broadcast onto o: (..., batch, seqlen_q, nheads_q, headdim)."""
    return out * w.transpose(-1, -2).unsqueeze(-1)


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial states exactly.

    outs: (P, batch, seqlen_q, nheads_q, headdim); lses: (P, batch, nheads_q, seqlen_q) natural log,
        float32 or float64 (a float64 lse is used whole: the weights are exact at any magnitude)
    returns out: (batch, seqlen_q, nheads_q, headdim) in outs.dtype, lse: (batch, nheads_q, seqlen_q)
    in float32, or float64 for float64 outs or lses.
    """
    check_merge_inputs(outs, lses)
    p = outs.shape[0]
    acc = acc_dtype(outs.dtype)
    ld = torch.promote_types(lses.dtype, acc)
    if p == 1:
        return outs[0], lses[0].to(ld)
    lses = lses.to(ld)
    m = lses.max(dim=0).values
    w = lse_weights(lses, m, acc)
    num = weighted(outs.to(acc), w).sum(dim=0)
    out, lse = normalize(num, w.sum(dim=0), m, ld)
    return out.to(outs.dtype), lse
