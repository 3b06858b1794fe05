"""Fast pure-torch decode: the CPU hot path behind ``ops.flash_decode(backend="torch")``.

Invariant: reads each row's valid K and V exactly once, in place -- no copy, no GQA
expansion, no mask tensor over the padded cache -- and returns the same partial state
``(out, lse)`` as ``reference.partial_attention`` (the oracle it is tested against; that
one stays simple and obviously right, this one is fast). Decode is memory-bound: one query
token reads the whole cache, so the only thing that matters on CPU is streaming K and V at
full bandwidth. The layout ``(batch, seqlen, heads, headdim)`` lets every KV head be a
BLAS-compatible strided matrix (row stride ``Hkv * D``), so per batch row two batched
matmuls over the KV heads do all the work:

    scores = (q grouped by KV head) @ K_h^T     # (Hkv, G*Sq, L): G query heads share K_h
    out    = softmax(scores) @ V_h

torch SDPA on the same input reads the cache at about half the bandwidth on this CPU
(docs/design.md, platform facts), and with ``enable_gqa`` or expanded KV it materialises more. Slicing each row to
its ``cache_seqlens`` also skips the padded tail entirely instead of masking it.

A paged cache (``block_table``) is the exception to "no copy": a row's blocks are gathered
(only the blocks it uses) into one contiguous (L, Hkv, D) buffer first, then the same two
matmuls run on it.

The unmasked float32 case (no positions, no soft-cap, float32 out and lse, one head dim) is one
call per row of ATen's fused CPU flash-attention kernel, which returns the lse too (``_fused``),
where :func:`use_fused` says it is faster (short rows; long ones only for GQA groups of at most 3):
on decode-sized inputs the host time of the twenty-odd small calls of the loop, not the
arithmetic, is the cost.

Batches of several rows that the fused kernel does not take (positions, soft-cap, fp16/bf16, a float64
lse, a paged cache) run all rows in one set of torch calls (``_batched``) where :func:`use_batched` says it
is faster (``benchmarks/cpu_batched.py``): every row padded to one key span, the keys outside a row hidden
by -inf scores, the same two matmuls over all rows and KV heads at once. The loop's dozen small calls per
row are what a large batch of short rows pays for (speculative verification of 1,500 rows, an eval batch
at every layer and step); the padding is what a ragged batch pays, so those are batched only while short.

Variants: ``cache_starts`` slices a row from its first valid key (what a sliding window has
passed is never read), ``window`` masks by position beside the causal mask, ``softcap`` caps
the scores in place; V may have its own head dim (MLA). A NaN score gives NaN, never "empty".
"""

from __future__ import annotations

import torch

from . import contract

__all__ = ["decode", "flash_decode"]


_FUSED = getattr(torch, "_scaled_dot_product_flash_attention_for_cpu", None)
"""ATen's fused CPU flash-attention kernel, which returns the log-sum-exp: one call per row instead
of about twenty small torch calls (on tiny decode shapes the host time of those calls, not the
arithmetic, is the cost). Called through torch's generated binding (``torch.<op>``), not the
``torch.ops.aten`` packet: the same kernel, without the packet's Python ``__call__`` (about 3 us
of a tiny call's host time, benchmarks/host_path.py). Used for float32 only -- everything in
float32, as the two matmuls below (for bf16/fp16 it rounds the probabilities to the input dtype
before P @ V) -- and only where no per-key mask is needed (no positions, no soft-cap): a row
sliced to its valid keys always has one."""


FUSED_MAX_KEYS = 8192
"""Rows of at most this many keys may take ``_FUSED`` (:func:`use_fused`)."""

FUSED_MAX_GROUP_KEYS = 1024
"""With a GQA group of more than 3 query heads per KV head, a row takes ``_FUSED`` only while
group size x keys is at most this."""


def use_fused(group: int, keys: int) -> bool:
    """Whether a row of ``keys`` keys, ``group`` query heads per KV head, is faster on ``_FUSED`` than
    on the loop. The fused call saves the loop's twenty-odd small calls (tens of microseconds of host
    time), but it reads each KV head once per query head of its group where the loop's matmuls read
    it once; measured on one CPU thread (``benchmarks/cpu_fused.py``, ``results/cpu_fused.md``):
    fused/loop time 0.5-1.0 up to 8K keys for groups of 1 and 3 (1.05-1.3 past it), but 1.0-2.1 at
    512-2K keys and up to 2.8 at 8K for groups of 4 to 8, where only rows of about a hundred keys gain.
    On two threads (``results/cpu_fused_2threads.md``) the same rule picks the faster path but at 512
    keys for groups of 4 to 8, where the fused call would have been 0.8-0.9 of the loop's time. A whole
    decode step of a GQA-4 model gains 3-18 % at 1-2K keys over the length-only rule (``model_step``
    there). Only float32-lse calls reach this choice: at CP > 1 ``tree_decode`` asks for float64 partial
    lses (the merge stays exact at large scores), which the fused kernel does not give, so every row
    takes the loop (or, in a batch that :func:`use_batched` picks, :func:`_batched`)."""
    return keys <= FUSED_MAX_KEYS and (group <= 3 or group * keys <= FUSED_MAX_GROUP_KEYS)


def fused_plan(q, k, v, block_table, softmax_scale, q_positions, out_dtype, lse_dtype, softcap):
    """What :func:`decode`'s choice of :func:`_fused` and the call itself read of shapes, strides, dtypes and
    variant arguments only, decided once per signature by ``ops`` (its signature holds all of them):
    ``None`` where the fused kernel never applies (a mask, a dtype other than float32, V's own head dim, a
    paged cache, no query row), else ``(group, scale, copy)``: the GQA group, the softmax scale, and whether
    q, k or v has a head dim without unit stride (:func:`_fused` copies such inputs). What depends on the
    values -- :func:`use_fused` on the longest row, ``_FUSED`` being there -- :func:`fused_planned` decides
    per call."""
    b, sq, hq, d = q.shape
    if (block_table is not None or q_positions is not None or softcap is not None or q.dtype != _F32
            or d != v.shape[3] or (out_dtype is not None and out_dtype != _F32)
            or (lse_dtype is not None and lse_dtype != _F32) or b * sq * hq == 0):
        return None
    return (hq // k.shape[2], contract.softmax_scale_of(softmax_scale, d),
            q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1)


def fused_planned(q, k, v, lens: list, starts: list | None, plan: tuple):
    """:func:`decode` for a call whose signature has a :func:`fused_plan` ``plan`` and whose lengths ``lens``
    (``cache_seqlens`` as read, ``starts`` likewise or None) the caller has checked: ``(out, lse)`` from
    :func:`_fused` where :func:`use_fused` takes the longest row, else None (the caller runs :func:`decode`)."""
    group, scale, copy = plan
    if _FUSED is None or not use_fused(group, max(lens)):
        return None
    if copy:  # as _fused copies them
        q, k, v = (q if q.stride(3) == 1 else q.contiguous(), k if k.stride(3) == 1 else k.contiguous(),
                   v if v.stride(3) == 1 else v.contiguous())
    return _fused_unit(q, k, v, lens, starts, scale)


def _fused(q, k, v, lens: list, starts: list | None, scale: float):
    """The unmasked float32 case on ``_FUSED``: per row the keys ``[starts[i], lens[i])`` (from 0 where
    ``starts`` is None); a row with none is out 0, lse -inf. GQA without repeating KV (the kernel groups
    the query heads). The kernel computes ``m + log(l)`` and the normalised output in float32, like
    the loop below."""
    # the kernel does not check that the head dim has unit stride and silently reads the wrong elements of a
    # view like k[..., ::2]: such inputs are copied (the loop's matmuls take any strides)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _fused_unit(q, k, v, lens, starts, scale)


def _fused_unit(q, k, v, lens: list, starts: list | None, scale: float):
    """:func:`_fused` for q, k, v whose head dims have unit stride."""
    b, sq, hq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    n = k.shape[1]
    if n > 0 and lens == [n] * b and not (starts and any(starts)):  # every row whole: one call for all rows
        out, lse = _FUSED(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        # out (b, sq, hq, dv): the kernel's own layout; lse (b, hq, sq), contiguous already for one token
        return out.transpose(1, 2), (lse if lse.is_contiguous() else lse.contiguous())
    if starts is None:
        starts = [0] * b
    rows = []
    for i in range(b):
        first, length = starts[i], lens[i]
        if length <= first:
            rows.append(None)
            continue
        k_i = k.select(0, i).narrow(0, first, length - first).transpose(0, 1).unsqueeze(0)  # (1, hkv, L, d)
        v_i = v.select(0, i).narrow(0, first, length - first).transpose(0, 1).unsqueeze(0)
        rows.append(_FUSED(q.narrow(0, i, 1).transpose(1, 2), k_i, v_i, scale=scale))
    if b == 1 and rows[0] is not None:
        return rows[0][0].transpose(1, 2), rows[0][1]
    out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    for i, row in enumerate(rows):
        if row is None:
            out.select(0, i).zero_()
            lse.select(0, i).fill_(float("-inf"))
        else:
            out.select(0, i).copy_(row[0][0].transpose(0, 1))
            lse.select(0, i).copy_(row[1][0])
    return out, lse


def flash_decode(
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
    """Attention of q over one KV shard (inputs already validated by ``ops``).

    q: (batch, seqlen_q, nheads_q, headdim); k: (batch, seqlen_k, nheads_kv, headdim) and
        v: (batch, seqlen_k, nheads_kv, headdim_v), any strides, or with block_table a paged
        cache (num_blocks, block_size, nheads_kv, headdim[_v]); nheads_q % nheads_kv == 0
    block_table: (batch, max_blocks) int32: row b's key j is in block block_table[b, j // block_size]
    cache_seqlens: (batch,) int32, valid keys per row (0 allowed)
    cache_starts: (batch,) int32, the first valid key per row (keys before it are not read)
    q_positions: (batch, seqlen_q), k_positions: (batch, N) or (N,) integers (N = seqlen_k or
        max_blocks * block_size); key j is visible to query i iff k_pos[j] <= q_pos[i], and with
        ``window`` also q_pos[i] - window < k_pos[j]
    softcap: scores -> softcap * tanh(scores / softcap) before the softmax
    out_dtype: dtype of out (default q.dtype)
    lse_dtype: float64 forms ``lse = m + log(l)`` in float64 (see ``reference``)
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in out_dtype, zero where no key is visible
            lse: (batch, nheads_q, seqlen_q) in lse_dtype (default float32; float64 for float64
                 input), natural log, -inf where no key is visible, NaN where a visible score is NaN
    """
    return decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, lse_dtype,
                  window, softcap, cache_starts)


_F32 = torch.float32


BATCHED = True
"""Whether :func:`decode` may take :func:`_batched` at all (where :func:`use_batched` says so); tests switch it
off to compare against the loop."""

BATCHED_MAX_ELEMENTS = 1 << 23
"""Batches take :func:`_batched` only while the buffers it adds -- the scores of all rows and query heads over
the padded key span, and the copies of K and V it makes for a paged or fp16/bf16 cache -- hold at most this
many elements in all (32 MiB of float32): a memory bound, not a speed one."""

BATCHED_MAX_PADDING = 2.0
"""Ragged batches take :func:`_batched` only while the padded key span of all rows is at most this many times
the keys the rows have."""

BATCHED_RAGGED_MIN_ROWS = 8
"""Ragged batches take :func:`_batched` only from this many batch rows ..."""

BATCHED_RAGGED_MAX_SPAN = 256
"""... and only while the padded key span is at most this many keys."""


def use_batched(b: int, span: int, keys: int, rows: int, copied: int) -> bool:
    """Whether ``b`` batch rows with ``keys`` valid keys in all, padded to one key span of ``span`` keys, are
    faster in one set of torch calls (:func:`_batched`) than in the per-row loop; ``rows`` is query heads x
    query tokens (score elements per key and batch row), ``copied`` the elements per key and batch row that
    the batched path copies (K and V of a paged or fp16/bf16 cache).

    Measured on one CPU thread (``benchmarks/cpu_batched.py``, ``results/cpu_batched.md``: thread CPU time,
    head-major fp32 cache, float64 lse, 4 KV heads of 64, GQA groups 1 and 4, 1 and 4 query tokens). Rows of
    one length (nothing padded): batched/loop time 0.6-0.85 at B = 2 up to 1K keys (0.93-0.97 at 4K), and
    0.06-0.62 from B = 8 up to 256 keys (the loop's dozen small calls per row are the cost), 0.67-0.96 at 1K-4K
    keys, where the matmuls are: every uniform batch of two rows or more is batched. Ragged rows (lengths
    spread over [N/2, N], a third more keys padded) also pay for the padding and the mask: 1.0-1.45 at B = 2
    whatever N, 0.78-1.45 at 1K-4K keys whatever B, but 0.06-0.94 from B = 8 up to 256 keys: a ragged batch is
    batched from ``BATCHED_RAGGED_MIN_ROWS`` rows while its span is at most ``BATCHED_RAGGED_MAX_SPAN`` keys
    and its padding at most ``BATCHED_MAX_PADDING`` x its keys. ``BATCHED_MAX_ELEMENTS`` bounds the memory
    whatever the speed (in the table it sends B = 64 at 4K keys and B = 1500 at 256 keys with 16 query heads
    of 4 tokens to the loop, where batched/loop was 1.19 and 0.77)."""
    padded = b * span
    if b < 2 or padded * (rows + copied) > BATCHED_MAX_ELEMENTS:
        return False
    if padded == keys:  # every row has the span's keys: nothing padded
        return True
    return b >= BATCHED_RAGGED_MIN_ROWS and span <= BATCHED_RAGGED_MAX_SPAN and padded <= BATCHED_MAX_PADDING * keys


def _span(lens: list, starts: list):
    """(lo, hi, keys): the key span ``[lo, hi)`` that holds every row's keys ``[starts[i], lens[i])``, and
    the number of keys of all rows; None where no row has a key."""
    lo, hi, keys = None, 0, 0
    for first, length in zip(starts, lens):
        if length > first:
            keys += length - first
            lo = first if lo is None or first < lo else lo
            hi = length if length > hi else hi
    return None if lo is None else (lo, hi, keys)


def _by_head(t: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(b, L, hkv, D) keys or values -> (b, hkv, L, D) in ``acc``: a view where no conversion is needed, else a
    head-major copy (which :func:`_folds`)."""
    t = t.permute(0, 2, 1, 3)
    if t.dtype == acc:
        return t
    buf = torch.empty(t.shape, dtype=acc, device=t.device)
    return buf.copy_(t)


def _folds(t: torch.Tensor) -> bool:
    """Whether (b, hkv, L, D) ``t`` views as (b * hkv, L, D): one bmm for all rows and heads."""
    return t.shape[0] == 1 or t.shape[1] == 1 or t.stride(0) == t.shape[1] * t.stride(1)


def _batched(q, k, v, block_table, cache_seqlens, scale, q_positions, k_positions, out_dtype, lse_dtype, window,
             softcap, cache_starts, lens, starts, span, acc, od, ld):
    """The loop's contract for all rows at once: every row's scores over one key span ``[lo, hi)`` (``span``,
    from :func:`_span`), the keys outside a row's ``[starts[i], lens[i])`` hidden by -inf scores, so that
    their probabilities are exactly 0 and add exact zeros to every sum (k_positions (b, N) here).

    The values there are not masked (that would copy V): the cache may hold anything past a row's keys, and
    a NaN or infinite value times probability 0 makes that row's output NaN, where the loop never reads it.
    So a row whose output has a NaN is computed again by the loop (which gives NaN again where a visible
    score is NaN): a pass over the small output instead of a copy of V."""
    b, sq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    g = hq // hkv
    lo, hi, keys = span
    L = hi - lo
    dev = q.device
    ragged = keys < b * L  # some row has fewer keys than the span
    if ragged:
        ar = torch.arange(lo, hi, device=dev)
        valid = (ar >= torch.tensor(starts, device=dev)[:, None]) & (ar < torch.tensor(lens, device=dev)[:, None])
    if block_table is None:
        ks, vs = k.narrow(1, lo, L), v.narrow(1, lo, L)
    else:  # gather the blocks of the span; an entry no row uses (-1, 0, a freed block: anything) reads block 0
        page = k.shape[1]
        blo, bhi = lo // page, -(-hi // page)
        ids = block_table[:, blo:bhi]
        if ragged:
            first = torch.arange(blo, bhi, device=dev) * page  # each block's first key
            used = (first < torch.tensor(lens, device=dev)[:, None]) & (
                first + page > torch.tensor(starts, device=dev)[:, None])
            ids = ids.masked_fill(~used, 0)
        ids = ids.reshape(-1).to(torch.int64)
        off = lo - blo * page
        ks = k.index_select(0, ids).view(b, -1, hkv, d).narrow(1, off, L)
        vs = v.index_select(0, ids).view(b, -1, hkv, dv).narrow(1, off, L)
    kh, vh = _by_head(ks, acc), _by_head(vs, acc)  # (b, hkv, L, D)
    # query rows r = g_idx * sq + s of KV head h, as in the loop
    qg = ((q if q.dtype == acc else q.to(acc)) * scale).view(b, sq, hkv, g, d).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(b, hkv, g * sq, d)
    fold = _folds(kh) and _folds(vh)
    if fold:
        s = torch.bmm(qg.reshape(b * hkv, g * sq, d), kh.reshape(b * hkv, L, d).transpose(1, 2))
        s5 = s.view(b, hkv, g, sq, L)
    else:  # one bmm per KV head on the strided views (a sequence-major cache): no copy of it
        s = torch.empty((hkv, b, g * sq, L), dtype=acc, device=dev)
        for h in range(hkv):
            torch.bmm(qg.select(1, h), kh.select(1, h).transpose(1, 2), out=s[h])
        s5 = s.view(hkv, b, g, sq, L).transpose(0, 1)
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    hidden = None  # (b, sq or 1, L)
    if q_positions is not None:
        kp, qp = k_positions[:, lo:hi][:, None, :], q_positions.to(torch.int64)[:, :, None]
        visible = kp <= qp  # (b, sq, L)
        if window is not None:
            visible &= kp > qp - window
        if ragged:
            visible &= valid[:, None, :]
        hidden = ~visible
    elif ragged:
        hidden = ~valid[:, None, :]
    if hidden is not None:
        s5.masked_fill_(hidden[:, None, None], float("-inf"))
    m = s5.amax(dim=-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # non-finite max -> 0
    s5.sub_(m).exp_()  # exp(-inf) = 0 for hidden keys
    den = s5.sum(dim=-1, keepdim=True)  # (b, hkv, g, sq, 1)
    # Only den == 0 is "no visible key": a NaN score makes den NaN, and out and lse NaN with it.
    empty = den == 0
    den.masked_fill_(empty, 1)
    if fold:
        o = torch.bmm(s, vh.reshape(b * hkv, L, dv)).view(b, hkv, g, sq, dv)
    else:
        o = torch.empty((hkv, b, g * sq, dv), dtype=acc, device=dev)
        for h in range(hkv):
            torch.bmm(s[h], vh.select(1, h), out=o[h])
        o = o.view(hkv, b, g, sq, dv).transpose(0, 1)
    o.div_(den)
    # m is one of the scores (exact); m + log(den) is formed in the lse's dtype, as in the loop
    lse = den.to(ld).log_().add_(m).masked_fill_(empty, float("-inf")).reshape(b, hq, sq)
    if not lse.is_contiguous():
        lse = lse.contiguous()
    if fold and sq == 1 and od == acc:  # (b, hkv, g, 1, dv) is (b, 1, hq, dv) in memory order
        out = o.view(b, 1, hq, dv)
    else:
        out = torch.empty((b, sq, hq, dv), dtype=od, device=dev)
        out.view(b, sq, hkv, g, dv).copy_(o.permute(0, 3, 1, 2, 4))
    redo = torch.isnan(o).flatten(1).any(1)  # (b,): o is (b, hkv, g, sq, dv) in either layout
    if bool(redo.any()):
        for i in redo.nonzero().flatten().tolist():  # the loop for this row alone (b = 1: never batched)
            one = lambda t: None if t is None else t.narrow(0, i, 1)  # noqa: E731
            row_out, row_lse = decode(one(q), one(k) if block_table is None else k,
                                      one(v) if block_table is None else v, one(block_table), one(cache_seqlens),
                                      scale, one(q_positions), one(k_positions), out_dtype, lse_dtype, window, softcap,
                                      one(cache_starts), [lens[i]])
            out.select(0, i).copy_(row_out[0])
            lse.select(0, i).copy_(row_lse[0])
    return out, lse


def decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, lse_dtype, window,
           softcap, cache_starts, lens=None):
    """:func:`flash_decode` with positional arguments, and ``lens``: ``cache_seqlens.tolist()`` where
    the caller has read it already (``ops``' value check); shapes as there. Keyword passing and a
    second read of the lengths are measurable parts of a tiny call's host time."""
    b, sq, hq, d = q.shape
    dv = v.shape[3]
    if b * sq * hq == 0:  # no query row: nothing to attend (ATen's fused kernel traps on seqlen_q 0)
        return (q.new_empty((b, sq, hq, dv), dtype=q.dtype if out_dtype is None else out_dtype),
                q.new_empty((b, hq, sq), dtype=contract.lse_acc_dtype(lse_dtype, q.dtype)))
    if lens is None:
        lens = cache_seqlens.tolist() if cache_seqlens is not None else [contract.kv_length(k, block_table)] * b
    scale = contract.softmax_scale_of(softmax_scale, d)
    # the unmasked float32 case (out and lse float32 too), tested first with the fewest reads
    if (block_table is None and q_positions is None and softcap is None and q.dtype == _F32 and d == dv
            and (out_dtype is None or out_dtype == _F32) and (lse_dtype is None or lse_dtype == _F32)
            and _FUSED is not None and use_fused(hq // k.shape[2], max(lens, default=0))):
        return _fused(q, k, v, lens, cache_starts.tolist() if cache_starts is not None else None, scale)
    hkv = k.shape[2]
    n = contract.kv_length(k, block_table)
    page = k.shape[1]
    g = hq // hkv
    acc = contract.acc_dtype(q.dtype)
    od = q.dtype if out_dtype is None else out_dtype
    ld = contract.lse_acc_dtype(lse_dtype, q.dtype)
    starts = cache_starts.tolist() if cache_starts is not None else [0] * b
    if k_positions is not None and k_positions.dim() == 1:
        k_positions = k_positions[None, :].expand(b, n)
    if b > 1 and BATCHED:
        span = _span(lens, starts)
        if span is not None:
            lo, hi, keys = span
            # what _batched copies per key and row: a paged or fp16/bf16 cache's K and V
            copied = hkv * (d + dv) if block_table is not None or k.dtype != acc else 0
        if span is not None and use_batched(b, hi - lo, keys, hq * sq, copied):
            return _batched(q, k, v, block_table, cache_seqlens, scale, q_positions, k_positions, out_dtype, lse_dtype,
                            window, softcap, cache_starts, lens, starts, span, acc, od, ld)

    rows = []
    for i in range(b):
        first, length = starts[i], lens[i]
        if length <= first:
            rows.append(None)
            continue
        # Query rows r = g_idx * sq + s of KV head h: query head h * g + g_idx, token s.
        # select/narrow/copy_ rather than indexing: the same views, a fraction of the host time.
        q_i = q.select(0, i) if q.dtype == acc else q.select(0, i).to(acc)
        if sq == 1:  # (1, hq, d) is already (hkv, g, d) in memory order
            qg = (q_i * scale).reshape(hkv, g, d)
        else:
            qg = (q_i * scale).reshape(sq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * sq, d)
        if block_table is None:
            k_i, v_i = k.select(0, i), v.select(0, i)  # strided views, no copy
            if first > 0 or length < k_i.shape[0]:
                k_i, v_i = k_i.narrow(0, first, length - first), v_i.narrow(0, first, length - first)
        else:  # gather the blocks this row uses, then drop the slots outside [first, length)
            lo = first // page
            ids = block_table[i, lo:-(-length // page)].to(torch.int64)
            k_i = k.index_select(0, ids).reshape(-1, hkv, d)[first - lo * page:length - lo * page]
            v_i = v.index_select(0, ids).reshape(-1, hkv, dv)[first - lo * page:length - lo * page]
        kt = k_i.permute(1, 2, 0)  # (hkv, d, L)
        vt = v_i.transpose(0, 1)  # (hkv, L, dv)
        if kt.dtype != acc:  # fp16/bf16 on CPU: accumulate in fp32 (costs a conversion)
            kt, vt = kt.to(acc), vt.to(acc)
        s = torch.bmm(qg, kt)  # (hkv, g*sq, L)
        if softcap is not None:  # in place: no second score buffer
            s.div_(softcap).tanh_().mul_(softcap)
        if q_positions is not None:
            kp, qp = k_positions[i, first:length][None, :], q_positions[i][:, None].to(torch.int64)
            visible = kp <= qp  # (sq, L)
            if window is not None:
                visible &= kp > qp - window
            s.masked_fill_(~visible.repeat(g, 1), float("-inf"))
        m = s.amax(dim=-1, keepdim=True).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)  # non-finite max -> 0
        s.sub_(m).exp_()  # exp(-inf) = 0 for hidden keys
        den = s.sum(dim=-1, keepdim=True)
        # Only den == 0 is "no visible key": a NaN score makes den NaN, and out and lse NaN with it.
        empty = den == 0
        den.masked_fill_(empty, 1)  # the divisor: 1 where no key is visible (s is all 0 there)
        o = torch.bmm(s, vt).div_(den)  # (hkv, g*sq, dv)
        # m is one of the scores (exact); m + log(den) is formed in the lse's dtype (den is not
        # used after this: when ld is acc, log_ may overwrite it)
        row_lse = den.to(ld).log_().add_(m).masked_fill_(empty, float("-inf"))
        if b == 1 and sq == 1:  # the row's results are the outputs: no buffer, no copy
            o = o.view(1, 1, hq, dv)  # (hkv, g, dv) in memory order is (hq, dv)
            return o if o.dtype == od else o.to(od), row_lse.view(1, hq, 1)
        if sq == 1:
            rows.append((o.view(1, hq, dv), row_lse.view(hq, 1)))
        else:
            rows.append((o.reshape(hkv, g, sq, dv).permute(2, 0, 1, 3).reshape(sq, hq, dv), row_lse.reshape(hq, sq)))

    out = torch.empty((b, sq, hq, dv), dtype=od, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=ld, device=q.device)
    for i, row in enumerate(rows):
        if row is None:
            out.select(0, i).zero_()
            lse.select(0, i).fill_(float("-inf"))
        else:
            out.select(0, i).copy_(row[0])
            lse.select(0, i).copy_(row[1])
    return out, lse
