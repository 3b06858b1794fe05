"""Pure-torch partial attention and the exact merge of partial states.

This module is the CPU path of :func:`megatron_tree.flash_decode` and the oracle every
kernel and every distributed strategy is tested against. It holds the project's single
merge formula (docs/design.md §1), split into two halves so that the distributed merges
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

Attention variants are features of the partial state, so the merge never changes:

* a sliding window (``window=W``, transformers' ``sliding_window``): query at global position
  ``p`` sees keys ``j`` with ``p - W < j <= p``; a shard with no key inside is an empty partial;
* soft-capping (``softcap=c``, Gemma 2's ``attn_logit_softcapping``): scores become
  ``c * tanh(s / c)`` before the softmax, and the lse is over the capped scores;
* attention sinks (GPT-OSS): one logit per query head that joins the softmax once, with a zero
  value vector -- :func:`add_sink`, applied once after the merge, never to a shard's partial;
* K and V of different head dims (MLA): the output has V's head dim.

NaN is never mistaken for "no key": a NaN anywhere in a row's visible scores gives a NaN
output and a NaN lse for that row (only a row with no visible key is ``out 0, lse -inf``).

Log-sum-exps that are merged again are carried in float64 (``lse_dtype=torch.float64``).
A float32 lse of magnitude 1e4 is only known to ~5e-4 (half a unit in the
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

from .contract import _used_blocks, acc_dtype, check_decode_inputs, check_merge_inputs, lse_acc_dtype

__all__ = [
    "partial_attention", "merge_states", "merge_stacked", "lse_weights", "normalize", "weighted", "add_sink",
    "gather_pages", "soft_cap",
]

def _rowwise_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for (batch, ...) operands, one matmul per batch row when batch > 1."""
    if a.shape[0] <= 1:
        return torch.matmul(a, b)
    return torch.stack([torch.matmul(a[i], b[i]) for i in range(a.shape[0])])


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor | None = None,
                 cache_starts: torch.Tensor | None = None):
    """A paged cache's keys (or values) in each row's logical order: (batch, N, heads, headdim).

    cache: (num_blocks, block_size, heads, headdim); block_table: (batch, max_blocks) int32;
    cache_seqlens, cache_starts: (batch,) int32 or None (every block of the table used). Slots
    outside a row's ``[start, length)`` are zero, and blocks holding none of that range are not read.
    """
    b, max_blocks = block_table.shape
    page = cache.shape[1]
    n = max_blocks * page
    used = _used_blocks(block_table, page, cache_seqlens, cache_starts)
    ids = torch.where(used, block_table.to(torch.int64), torch.zeros_like(block_table, dtype=torch.int64))
    out = cache[ids.reshape(-1)].reshape(b, n, *cache.shape[2:]) if cache.shape[0] else \
        cache.new_zeros((b, n, *cache.shape[2:]))
    valid = used.repeat_interleave(page, dim=1)
    slot = torch.arange(n, device=cache.device)[None, :]
    if cache_seqlens is not None:
        valid &= slot < cache_seqlens[:, None].to(torch.int64)
    if cache_starts is not None:
        valid &= slot >= cache_starts[:, None].to(torch.int64)
    return torch.where(valid[:, :, None, None], out, torch.zeros((), dtype=cache.dtype, device=cache.device))


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's attention-logit soft-capping); unchanged for None."""
    if softcap is None:
        return scores
    return torch.tanh(scores / softcap) * softcap


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
    window: int | None = None,
    softcap: float | None = None,
    cache_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one shard of keys/values, returning the partial state.

    q: (batch, seqlen_q, nheads_q, headdim)
    k: (batch, seqlen_k, nheads_kv, headdim), v: (batch, seqlen_k, nheads_kv, headdim_v) --
        nheads_q % nheads_kv == 0 (GQA/MQA; KV is never repeated: query heads are grouped onto
        their KV head instead); headdim_v may differ from headdim (MLA)
    block_table: (batch, max_blocks) int32 -- k, v are then a paged cache (num_blocks,
        block_size, nheads_kv, headdim[_v]) and row b's key j is slot ``j % block_size`` of block
        ``block_table[b, j // block_size]``; seqlen_k below means max_blocks * block_size
    cache_seqlens: (batch,) int32 -- keys ``[0, cache_seqlens[b])`` of row b are valid
    cache_starts: (batch,) int32 -- keys before ``cache_starts[b]`` of row b are not (left
        padding, or the slots a sliding window has passed); valid keys are
        ``[cache_starts[b], cache_seqlens[b])``, and what other slots hold never counts (NaN
        included; keys hidden by position are keys of weight 0, as in the kernels)
    q_positions: (batch, seqlen_q), k_positions: (batch, seqlen_k) or (seqlen_k,) -- global
        token positions (with a block table: of each row's keys in that logical order); when
        given, key j is visible to query i iff k_pos[j] <= q_pos[i]
    window: with positions, key j is visible to query i only if also
        ``q_pos[i] - window < k_pos[j]`` (transformers' ``sliding_window``; flash-attn's and
        Megatron's ``window_size=(window - 1, 0)``)
    softcap: scores -> ``softcap * tanh(scores / softcap)`` before the softmax (the lse too)
    out_dtype: dtype of ``out`` (default q.dtype)
    lse_dtype: float64 forms ``lse = m + log(l)`` in float64 (for merging again; module docstring)
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in out_dtype, zero where no key is visible
            lse: (batch, nheads_q, seqlen_q) in lse_dtype (default float32; float64 for float64
                 input), natural log, -inf where no key is visible, NaN where a visible score is NaN
    """
    check_decode_inputs(q, k, v, cache_seqlens, q_positions, k_positions, block_table, out_dtype,
                        lse_dtype=lse_dtype, window=window, softcap=softcap, cache_starts=cache_starts,
                        softmax_scale=softmax_scale)
    if block_table is not None:
        k, v = (gather_pages(t, block_table, cache_seqlens, cache_starts) for t in (k, v))
    b, sq, hq, d = q.shape
    n, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    acc = acc_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)

    # (b, hkv, g*sq, d): query heads of one KV group side by side; k as (b, hkv, n, d).
    qg = q.to(acc).reshape(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * sq, d)
    kt = k.to(acc).permute(0, 2, 1, 3)
    vt = v.to(acc).permute(0, 2, 1, 3)
    # One matmul per batch row: a (b, hkv) batch of the permuted (b, n, hkv, d) cache cannot be
    # flattened into one bmm without copying the whole cache (measured ~25x slower at b=4 on CPU).
    scores = soft_cap(_rowwise_matmul(qg, kt.transpose(-1, -2)) * scale, softcap)  # (b, hkv, g*sq, n)

    mask = None
    slot = torch.arange(n, device=q.device)[None, :]
    if cache_seqlens is not None:
        mask = (slot < cache_seqlens[:, None].to(torch.int64))[:, None, None, :]  # (b, 1, 1, n)
    if cache_starts is not None:
        after = (slot >= cache_starts[:, None].to(torch.int64))[:, None, None, :]
        mask = after if mask is None else mask & after
    if mask is not None:  # slots outside [start, length) are no keys: whatever they hold never counts
        vt = torch.where(mask[:, 0, 0, :, None].unsqueeze(1), vt, torch.zeros((), dtype=vt.dtype))
    if q_positions is not None:
        kp = (k_positions if k_positions.dim() == 2 else k_positions[None, :].expand(b, n)).to(torch.int64)
        qp = q_positions.to(torch.int64)
        visible = kp[:, None, :] <= qp[:, :, None]  # (b, sq, n)
        if window is not None:
            visible = visible & (kp[:, None, :] > qp[:, :, None] - int(window))
        visible = visible[:, None, None, :, :].expand(b, 1, g, sq, n).reshape(b, 1, g * sq, n)
        mask = visible if mask is None else mask & visible
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))

    if n:
        m = scores.amax(dim=-1)  # (b, hkv, g*sq); -inf where nothing is visible, NaN with a NaN score
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    else:  # an empty shard: no key, so no maximum (den below is 0)
        m = scores.new_zeros(scores.shape[:-1])
    probs = torch.exp(scores - m[..., None])  # exp(-inf) = 0 on masked keys
    den = probs.sum(dim=-1)
    # Only den == 0 is "no visible key": a NaN score makes den NaN, and out and lse NaN with it.
    empty = den == 0
    out = _rowwise_matmul(probs / torch.where(empty, torch.ones_like(den), den)[..., None], vt)  # (b, hkv, g*sq, dv)
    # m is a score (exact in acc); m + log(den) formed in the lse dtype (float64 keeps it whole)
    ld = lse_acc_dtype(lse_dtype, q.dtype)
    lse = torch.where(empty, torch.full_like(den, float("-inf"), dtype=ld),
                      m.to(ld) + torch.log(torch.where(empty, torch.ones_like(den), den).to(ld)))

    out = out.reshape(b, hkv, g, sq, dv).permute(0, 3, 1, 2, 4).reshape(b, sq, hq, dv)
    lse = lse.reshape(b, hkv, g, sq).reshape(b, hq, sq)
    return out.to(q.dtype if out_dtype is None else out_dtype), lse


def add_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Join an attention sink to a *merged* state: one logit per query head, with a zero value vector.

    out: (batch, seqlen_q, nheads_q, headdim_v); lse: (batch, nheads_q, seqlen_q) natural log;
    sinks: (nheads_q,) (GPT-OSS ``sinks``). The softmax over the keys and the sink gives
    ``out * sigmoid(lse - sink)`` and ``lse' = logaddexp(lse, sink)`` -- exactly the merge of
    (out, lse) with the partial state (0, sink), so the result can itself be merged again (a sink
    is one more partial state, and must join once: after the CP merge, never on each rank).
    A row with no key (lse = -inf) gives out 0 and lse = sink; a NaN lse or sink gives NaN.
    Formed in float64, so out is rounded once, to its own dtype (float32 from a merge); lse keeps
    its dtype.
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in out.dtype, lse in lse.dtype
    """
    if tuple(sinks.shape) != (lse.shape[1],):
        raise ValueError(f"sinks must have shape ({lse.shape[1]},) (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    s = sinks.to(device=lse.device, dtype=torch.float64)[None, :, None]  # (1, hq, 1)
    l64 = lse.to(torch.float64)
    # lse = -inf: no key, weight 0 (also for a sink of -inf, where lse - sink would be NaN)
    w = torch.where(l64 == float("-inf"), torch.zeros_like(l64), torch.sigmoid(l64 - s))
    out = (out.to(torch.float64) * w.transpose(1, 2).unsqueeze(-1)).to(out.dtype)
    return out, torch.logaddexp(l64, s).to(lse.dtype)


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
    return _weights(lse, _finite(m), lse.dtype if dtype is None else dtype)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """The shift as the formula uses it: a non-finite ``m`` (every shard empty, a NaN) counts as 0."""
    return torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)


def _finite_(m: torch.Tensor) -> torch.Tensor:
    """:func:`_finite` in place, on a tensor the caller owns (no allocation)."""
    return m.nan_to_num_(0.0, 0.0, 0.0)  # nan, posinf, neginf: positional (keywords cost host time)


def _beside_out(x: torch.Tensor) -> torch.Tensor:
    """(..., batch, nheads_q, seqlen_q) -> the view (..., batch, seqlen_q, nheads_q, 1) that broadcasts
    onto an out (..., batch, seqlen_q, nheads_q, headdim); one torch call for one query token."""
    return x.unsqueeze(-3) if x.shape[-1] == 1 else x.mT.unsqueeze(-1)


def _weights(lse: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype, own_max: bool = False) -> torch.Tensor:
    """:func:`lse_weights` against a finite ``shift`` (:func:`_finite`'s).

    own_max: ``shift`` is the maximum of these same values (:func:`merge_stacked`'s), so every
    difference is <= 0 and every weight <= 1. Then a float32 lse's difference is formed in float32:
    its one rounding (a relative eps/2 of ``d = lse - m``) moves the weight ``e^d`` by a relative
    ``|d| eps/2``, which is at most ``e^-1 eps/2`` (0.18 eps) of the largest weight, 1 -- below the
    roundings of the products and sums that follow. (Against a shift that is not the maximum, as
    ``comm``'s ``shifted`` passes, ``d`` may be large and positive: the float64 difference stays.)
    On a tiny merge the widening and narrowing were a quarter of its host time.
    """
    if own_max and lse.dtype == dtype == torch.float32:
        return (lse - shift).exp_()
    # float64 - float32 widens the float32 operand exactly: the same difference as two .double().
    # (Out of place: ``m`` may broadcast to a larger shape than ``lse``.)
    w = (lse.double() - shift).exp_()
    if w.dtype == dtype:
        return w
    # .float() is .to(torch.float32) with less argument parsing (half the host time on a tiny merge)
    return w.float() if dtype == torch.float32 else w.to(dtype)


def normalize(num: torch.Tensor, den: torch.Tensor, m: torch.Tensor,
              lse_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Finish a merge: ``o = num / den`` and ``lse = m + log(den)``.

    num: (batch, seqlen_q, nheads_q, headdim) = sum_u w_u * o_u
    den: (batch, nheads_q, seqlen_q) = sum_u w_u; m: (batch, nheads_q, seqlen_q), the shift
        the weights were taken against (the maximum of the lse, or any shared value)
    lse_dtype: dtype the lse is formed and returned in (default: the wider of m's and den's);
        float64 keeps a score-sized lse to full precision for a merge that follows
    returns (out, lse) with out = 0 and lse = -inf where den == 0 (no key anywhere: num is 0 there,
    each state's out times its weight 0, so a state with no key must hold a finite out -- the 0
    every partial without a key has); a NaN den gives NaN (never hidden as an empty row).
    """
    ld = torch.promote_types(m.dtype, den.dtype) if lse_dtype is None else lse_dtype
    return _normalize(num, den, _finite(m), ld)


_TINY = {dtype: torch.finfo(dtype).tiny for dtype in (torch.float32, torch.float64)}
"""The smallest normal number of each accumulation dtype (what :func:`_normalize` divides an empty
row's num by): normal, so a flush-denormals mode leaves it as it is."""


def _normalize(num: torch.Tensor, den: torch.Tensor, shift: torch.Tensor, ld: torch.dtype,
               owned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`normalize` against a finite ``shift`` (:func:`_finite`'s), the lse in ``ld``.
    owned: num and den are the caller's own temporaries (:func:`merge_stacked`'s sums), which the
    quotient and the log may overwrite in place -- the same bits, two allocations less."""
    den_o = _beside_out(den)
    # den == 0 only where no state has a key: every weight is 0, and so is num (a partial with no
    # key has out 0). Dividing by den raised to the smallest normal number gives that row out 0
    # (the sign of 0 * o) in one torch call where a mask took two; every other den divides as
    # itself -- a den below the smallest normal number would be weights that underflowed, which no
    # caller forms (merge_stacked's den is >= 1, comm's >= 2**-64 or the merge is redone). clamp_min
    # passes NaN on: a NaN den (a NaN partial lse upstream) stays NaN, visibly.
    safe = den_o.clamp_min(_TINY.get(den.dtype) or torch.finfo(den.dtype).tiny)
    out = num.div_(safe) if owned else num / safe
    # log(0) = -inf and -inf + a finite shift = -inf: an empty row's lse needs no mask
    if den.dtype != ld:
        lse = (den.double() if ld == torch.float64 else den.to(ld)).log_()
    else:
        lse = den.log_() if owned else torch.log(den)
    return out, lse.add_(shift if shift.dtype == ld else shift.to(ld))


def weighted(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``w * o`` with w: (..., batch, nheads_q, seqlen_q) broadcast onto o: (..., batch, seqlen_q, nheads_q, headdim)."""
    return out * _beside_out(w)


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial states exactly.

    outs: (P, batch, seqlen_q, nheads_q, headdim); lses: (P, batch, nheads_q, seqlen_q) natural log,
        float32 or float64 (a float64 lse is used whole: the weights are exact at any magnitude)
    returns out: (batch, seqlen_q, nheads_q, headdim) in outs.dtype, lse: (batch, nheads_q, seqlen_q)
    in float32, or float64 for float64 outs or lses.
    """
    check_merge_inputs(outs, lses)
    return merge_stacked(outs, lses)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_states` on inputs the caller has checked (``ops.merge_states`` checks once per
    signature): the one merge formula, :func:`lse_weights` and :func:`normalize` around a local
    max and sum. P = 1 returns views of the inputs (lse widened)."""
    acc = acc_dtype(outs.dtype)
    # the wider of the lses' and the accumulation's dtype (both float32 or float64: a lookup, not
    # a torch.promote_types call per merge)
    ld = torch.float64 if torch.float64 in (lses.dtype, acc) else torch.float32
    if outs.shape[0] == 1:
        return outs[0], lses[0].to(ld)
    lses = lses if lses.dtype == ld else lses.to(ld)
    # the maximum, once for the weights and the lse; a new tensor, made finite in place
    shift = _finite_(lses.amax(0))
    w = _weights(lses, shift, acc, own_max=True)
    num = weighted(outs if outs.dtype == acc else outs.to(acc), w).sum(0)  # dims positional: less host time
    out, lse = _normalize(num, w.sum(0), shift, ld, True)
    return (out if out.dtype == outs.dtype else out.to(outs.dtype)), lse
