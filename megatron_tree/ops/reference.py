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
import numbers

import torch

__all__ = [
    "partial_attention", "merge_states", "lse_weights", "normalize", "weighted", "acc_dtype", "add_sink",
    "check_decode_inputs", "check_cache_seqlens", "check_block_table", "check_merge_inputs", "check_sinks",
    "check_variants", "gather_pages", "kv_length", "lse_acc_dtype", "soft_cap", "LSE_DTYPES", "MAX_WINDOW",
]

LSE_DTYPES = (torch.float32, torch.float64)
"""Dtypes a partial state's lse may be asked in (``lse_dtype=``)."""
MAX_WINDOW = 2 ** 31 - 1
"""Largest sliding window (positions are compared as int32 in the kernel)."""


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
                        out_dtype=None, *, by_value: bool = True, lse_dtype=None, window=None, softcap=None,
                        cache_starts=None, sinks=None) -> None:
    """Validate the flash-decode contract and raise ``ValueError``/``TypeError`` naming the problem.

    q: (batch, seqlen_q, nheads_q, headdim); k: (batch, seqlen_k, nheads_kv, headdim), v: the
    same but for its own head dim (``headdim_v``; MLA), or with ``block_table`` (batch,
    max_blocks) int32 a paged cache (num_blocks, block_size, nheads_kv, headdim[_v]);
    cache_seqlens, cache_starts: (batch,) int32 in [0, N]; q_positions: (batch, seqlen_q) integer;
    k_positions: (batch, N) or (N,) integer, where N = :func:`kv_length`; out_dtype: a
    floating-point dtype or None; lse_dtype: float32, float64 or None; window, softcap, sinks:
    :func:`check_variants`. ``by_value=False`` skips the checks that read tensor values (on CUDA
    or while tracing they would synchronise with the host every step).
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
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head dim (V's may differ, as in MLA), "
                         f"got k={tuple(k.shape)}, v={tuple(v.shape)}")
    b, _, hq, d = q.shape
    bk, _, hkv, dk = k.shape
    if block_table is None and bk != b:
        raise ValueError(f"batch size of k/v ({bk}) differs from q's ({b})")
    if dk != d:
        raise ValueError(f"head dim of k ({dk}) differs from q's ({d}): q and k share one head dim (v may have "
                         "its own)")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv})"
        )
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")
    lse_acc_dtype(lse_dtype, q.dtype)  # raises for anything but float32 / float64 / None
    if block_table is not None:
        _check_block_table_shape(block_table, b)  # before its width is read (a 1-D table has none)
    n = kv_length(k, block_table)
    if cache_seqlens is not None:
        check_cache_seqlens(cache_seqlens, b, n, q.device, by_value=by_value)
    if cache_starts is not None:
        check_cache_seqlens(cache_starts, b, n, q.device, by_value=by_value, name="cache_starts")
    if block_table is not None:
        check_block_table(block_table, b, k.shape[0], k.shape[1], cache_seqlens, q.device, by_value=by_value,
                          cache_starts=cache_starts)
    check_variants(q, window=window, softcap=softcap, sinks=sinks, positions=q_positions is not None)
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


def _used_blocks(block_table, block_size: int, cache_seqlens, cache_starts) -> torch.Tensor:
    """(batch, max_blocks) bool: the table entries a row reads -- those holding a key in
    ``[cache_starts[b], cache_seqlens[b])`` (from 0 / to the table's end when absent)."""
    batch, width = block_table.shape
    device = block_table.device
    lens = (cache_seqlens.to(torch.int64) if cache_seqlens is not None
            else torch.full((batch,), width * block_size, dtype=torch.int64, device=device))
    col = torch.arange(width, device=device)[None, :]
    used = col < (lens + block_size - 1)[:, None] // block_size
    if cache_starts is not None:
        starts = cache_starts.to(torch.int64)
        used &= (col >= (starts // block_size)[:, None]) & (starts < lens)[:, None]
    return used


def _check_block_table_shape(block_table, batch: int) -> None:
    """block_table: an int32 tensor of shape (batch, max_blocks)."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 tensor of shape ({batch}, max_blocks), "
                        f"got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks) (one row per batch row), "
                         f"got {tuple(block_table.shape)}")


def check_block_table(block_table, batch: int, num_blocks: int, block_size: int, cache_seqlens, device, *,
                      by_value: bool = True, cache_starts=None) -> None:
    """block_table: (batch, max_blocks) int32 on ``device``; with ``by_value`` also every entry a
    row uses (those holding a key in ``[cache_starts[b], cache_seqlens[b])``) in ``[0, num_blocks)``.

    Entries past a row's length, and wholly before its start, are never read (engines pad them
    with -1 or 0, and a sliding window may free the blocks it has passed).
    """
    _check_block_table_shape(block_table, batch)
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
    if block_size < 1:
        raise ValueError(f"a paged cache needs blocks of at least one token, got block_size {block_size}")
    if not by_value or batch == 0 or block_table.shape[1] == 0:
        return
    used = _used_blocks(block_table, block_size, cache_seqlens, cache_starts)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {col}] = {int(block_table[row, col])} is not a block of the cache "
            f"(expected 0 <= id < num_blocks = {num_blocks} for every block a row uses)"
        )


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


def check_cache_seqlens(cache_seqlens, batch: int, seqlen_k: int, device, *, by_value: bool = True,
                        name: str = "cache_seqlens") -> None:
    """cache_seqlens (or cache_starts, ``name``): (batch,) int32 on ``device``; with ``by_value``
    also every value in [0, seqlen_k].

    ``by_value=False`` skips reading the values (on CUDA or while tracing that would force a
    host-device synchronisation every step and break CUDA-graph capture).
    """
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape ({batch},), got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per batch row), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"{name} is on {cache_seqlens.device} but q is on {device}")
    if by_value and batch and (int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > seqlen_k):
        raise ValueError(
            f"{name} must lie in [0, {seqlen_k}] (the KV length), got values in "
            f"[{int(cache_seqlens.min())}, {int(cache_seqlens.max())}]"
        )


def check_variants(q, *, window=None, softcap=None, sinks=None, positions: bool = True) -> None:
    """The attention variants' arguments, checked before any work or collective.

    window: an int >= 1 (at most :data:`MAX_WINDOW`), only with positions (q_positions and
        k_positions: a window is a lower bound on global key positions); softcap: a finite real
        number > 0; sinks: a floating-point tensor of shape (nheads_q,) on q's device.
    """
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int (keys j with p - window < j <= p are visible) or None, "
                            f"got {type(window).__name__} {window!r}")
        if not 1 <= int(window) <= MAX_WINDOW:
            raise ValueError(f"window must lie in [1, {MAX_WINDOW}] (1: a query sees only its own position), "
                             f"got {int(window)}")
        if not positions:
            raise ValueError("window needs q_positions and k_positions (a sliding window bounds global key "
                             "positions); without stored positions pass the first visible slot per row as "
                             "cache_starts instead")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a positive float (scores -> softcap * tanh(scores / softcap)) or "
                            f"None, got {type(softcap).__name__} {softcap!r}")
        if not (math.isfinite(float(softcap)) and float(softcap) > 0):
            raise ValueError(f"softcap must be finite and > 0, got {float(softcap)}")
    if sinks is not None:
        check_sinks(sinks, q)


def check_sinks(sinks, q) -> None:
    """sinks: a floating-point tensor of shape (nheads_q,) on q's device (one logit per query head)."""
    hq = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a floating-point tensor of shape ({hq},) (one logit per query head), "
                        f"got {got}")
    if tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


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
                        lse_dtype=lse_dtype, window=window, softcap=softcap, cache_starts=cache_starts)
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
