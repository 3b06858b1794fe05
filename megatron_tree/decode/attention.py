"""``tree_decode``: exact attention of a few query tokens over a sequence-sharded KV cache.

Invariant: the local half (``ops.flash_decode`` on this rank's shard) and the global half
(``comm.merge`` over the CP group's levels) are the only two steps; everything else here
is checking the contract of docs/design.md §3 so that bad input fails before any rank
enters a collective. The algorithm, like the paper's JAX ``tree_decode``::

    out, lse = flash_decode(q, k_shard, v_shard)        # local partial state
    out, lse = merge(out, lse, groups, strategy)         # m = max lse; sum w*o / sum w
    return out.to(q.dtype)

With ``overlap=True`` the batch is split in two halves and the two steps interleave
(``comm.merge_overlapped``): the first half's merge collectives travel while the second
half's local attention computes.
"""

from __future__ import annotations

import torch

from ..comm import merge as comm
from ..ops import dispatch as ops
from ..comm.merge import CommStats
from ..ops.contract import acc_dtype, check_decode_inputs, check_variants, lse_acc_dtype, softmax_scale_of
from ..ops.reference import add_sink
from ..distributed.topology import TreeGroups

__all__ = ["tree_decode"]


def tree_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: TreeGroups | None,
    *,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    strategy: str = "auto",
    return_lse: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    stats: CommStats | None = None,
    backend: str | None = None,
    overlap: bool = False,
    shift: torch.Tensor | None = None,
    deferred: list | None = None,
    lse_dtype: torch.dtype | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    cache_starts: torch.Tensor | None = None,
):
    """Exact attention of ``q`` over the union of every CP rank's ``(k, v)`` shard.

    Per rank (every rank passes the same q, its own shard of the sequence):

    q: (batch, seqlen_q, nheads_q, headdim) -- replicated on every CP rank
    k: (batch, shard_len, nheads_kv, headdim), v: (batch, shard_len, nheads_kv, headdim_v) --
        this rank's keys/values; shard_len may differ between ranks and may be 0; headdim_v
        may differ from headdim (MLA); or, with ``block_table``, this rank's paged pools
        (num_blocks, block_size, nheads_kv, headdim[_v]) of one layer
    cache_seqlens: (batch,) int32 -- valid keys of this shard per batch row (rows may differ)
    cache_starts: (batch,) int32 -- this shard's first valid key per row (``ops.flash_decode``;
        on a paged shard, the first slot a sliding window still shows)
    block_table: (batch, width) int32 -- this rank's blocks of each row, in slot order (a paged
        shard: row b's key j is in block ``block_table[b, j // block_size]``); every strategy,
        ``overlap`` and ``shifted`` included, runs on paged shards alike
    q_positions: (batch, seqlen_q), k_positions: (batch, shard_len) or (shard_len,) -- global
        token positions for causal masking when seqlen_q > 1; without them every query sees
        every valid key
    strategy: one of ``comm.STRATEGIES``; stats: a :class:`CommStats` to record traffic into
    overlap: split the batch in halves of ceil(B/2) and floor(B/2) rows and merge the first
        while the second's local attention computes (same result; every strategy, ``shifted``
        with its one SUM per half included); B = 1 or no CP group runs unsplit
    shift: (batch, nheads_q, seqlen_q) float32, the same on every CP rank, for
        ``strategy="shifted"`` (one all-reduce SUM; exact whatever it holds, redone with
        MAX + SUM when the weights overflow or underflow); ``None`` runs ``packed``. The
        returned lse (``return_lse=True``) is the next decode step's shift.
    deferred: with ``shifted``, a list that receives the call's device flag instead of a host
        check: when it is True the result is unusable and the caller redoes the call with
        ``packed`` (a decode loop reads all its layers' flags once per step:
        ``decode.generate.StepRunner``)
    lse_dtype: dtype of the returned lse: float32 by default (float64 for float64 input);
        ``torch.float64`` returns it whole, for merging the result again (e.g. with a chunk of
        keys held elsewhere) exactly at large score magnitudes -- partials and every merge level
        carry float64 either way (a partial no merge follows -- one rank, no stats -- is formed
        in lse_dtype directly)
    softmax_scale: the factor the scores are multiplied by (``None``: 1/sqrt(headdim)); the same
        on every rank, compared resolved and exactly (``None`` on one rank and 1/sqrt(headdim) on
        another agree; ``headdim ** -0.5``, one bit off it for some head dims, does not)
    window, softcap: the local attention's sliding window (with positions: a query at global
        position p sees keys p - window < j <= p; a rank with none is an empty shard) and score
        soft-capping, as for ``ops.flash_decode``; the same on every rank (compared, as the scale)
    sinks: (nheads_q,) float, the same on every rank: one logit per query head joining the
        softmax once, with a zero value -- applied after the merge (``reference.add_sink``),
        never to a rank's partial (which would count it once per rank); not compared: it joins
        each rank's merged state on that rank, so the merge's partials never depend on it
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in q.dtype, identical on every CP rank,
            and with ``return_lse`` also lse: (batch, nheads_q, seqlen_q) in lse_dtype, natural
            log (over the keys and the sink); NaN in the rows where some rank's visible score is NaN

    Every CP rank must pass the same batch, seqlen_q, nheads_q, headdim, dtype, strategy,
    backend, softmax_scale, window and softcap (and a shift or none); ranks that do not raise
    :class:`~megatron_tree.comm.DisagreementError` on every rank, naming each rank's values
    (``comm.merge``'s ``MERGE_SIGNATURE``; checked when a rank's values change, no extra
    collective or host sync in steady state). A peer that dies or hangs is a ``CommError``
    within the groups' timeout.
    """
    if strategy not in comm.STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {comm.STRATEGIES}")
    # a bad lse_dtype fails here, before any collective (a q that is no tensor: in the checks below)
    ld = lse_acc_dtype(lse_dtype, q.dtype if isinstance(q, torch.Tensor) else torch.float32)
    variants = dict(window=window, softcap=softcap, cache_starts=cache_starts)
    if sinks is not None and isinstance(q, torch.Tensor):
        check_variants(q, sinks=sinks)  # before any collective: the sink joins after the merge
    if overlap and groups is not None and groups.size > 1 and q.shape[0] >= 2:
        out, lse = _decode_overlapped(q, k, v, groups, cache_seqlens, softmax_scale, strategy, q_positions,
                                      k_positions, stats, backend, shift, deferred, block_table, variants)
    else:
        # fp32 partials (docs/design.md §1): a bf16/fp16 result is rounded once, below. The
        # partial lse is float64 so the merge is exact at large score magnitudes (comm's docstring).
        # One rank without stats: the partial state is the result, nothing merges it again, so its
        # lse is formed in the dtype returned (a float64 partial lse is for exact merges).
        alone = groups is None or (groups.size == 1 and stats is None)
        try:
            # the backend is resolved once, with the checks (ops remembers both per signature)
            out, lse, resolved = ops.flash_decode_resolved(
                q, k, v, cache_seqlens=cache_seqlens, block_table=block_table, softmax_scale=softmax_scale,
                q_positions=q_positions, k_positions=k_positions, out_dtype=acc_dtype(q.dtype), backend=backend,
                lse_dtype=ld if alone and sinks is None else torch.float64, **variants,
            )
            if shift is not None:
                comm.check_shift(shift, tuple(lse.shape), q.device)
            if not alone:  # the scale the kernel used: what the ranks compare (None and 1/sqrt(d) are one)
                scale = softmax_scale_of(softmax_scale, q.shape[-1])
        except Exception as e:  # noqa: BLE001 -- this rank's own checks: every rank raises it (_tell)
            _tell(groups, e)
            raise
        if not alone:  # (alone, comm.merge would check again what was checked above and widen nothing)
            out, lse = comm.merge(out, lse, groups, strategy, stats, dtype=q.dtype, backend=resolved, shift=shift,
                                  deferred=deferred, softmax_scale=scale, window=window, softcap=softcap)
    if sinks is not None:  # once, on the merged state (every rank holds the same)
        out, lse = add_sink(out, lse, sinks)
    # the casts only where they change a dtype: .to's argument parsing alone is ~2 us of a tiny call
    out = out if out.dtype == q.dtype else out.to(q.dtype)
    return (out, lse if lse.dtype == ld else lse.to(ld)) if return_lse else out


def _decode_overlapped(q, k, v, groups, cache_seqlens, softmax_scale, strategy, q_positions, k_positions, stats,
                       backend, shift=None, deferred=None, block_table=None, variants=None):
    """``tree_decode`` with the batch in two halves, each half's merge overlapping the next half's local attention.

    Shapes as in :func:`tree_decode` (a paged pool is shared by both halves; each takes its
    rows of the block table). The whole batch is checked before the first collective starts,
    so bad input fails on every rank before any rank waits in one.
    """
    variants = variants or {}
    try:
        check_decode_inputs(q, k, v, cache_seqlens, q_positions, k_positions, block_table,
                            by_value=q.device.type == "cpu" and not torch.compiler.is_compiling(), **variants)
        comm.check_shift(shift, (q.shape[0], q.shape[2], q.shape[1]), q.device)
        resolved = ops.resolve_backend(q.device, backend)
        scale = softmax_scale_of(softmax_scale, q.shape[-1])
    except Exception as e:  # noqa: BLE001 -- as in tree_decode
        _tell(groups, e)
        raise
    b = q.shape[0]
    halves = [slice(0, (b + 1) // 2), slice((b + 1) // 2, b)]
    shared_kpos = k_positions is not None and k_positions.dim() == 1  # (N,): the same for every row

    paged = block_table is not None

    def local(rows):
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return ops.flash_decode(
            q[rows], k if paged else k[rows], v if paged else v[rows], cache_seqlens=pick(cache_seqlens),
            block_table=pick(block_table), softmax_scale=softmax_scale,
            q_positions=pick(q_positions), k_positions=k_positions if shared_kpos else pick(k_positions),
            out_dtype=acc_dtype(q.dtype), backend=backend, lse_dtype=torch.float64,
            window=variants.get("window"), softcap=variants.get("softcap"),
            cache_starts=pick(variants.get("cache_starts")),
        )

    out_shape = (*q.shape[:3], v.shape[3])  # the merged outputs have V's head dim
    return comm.merge_overlapped(local, halves, out_shape, groups, strategy, stats, dtype=q.dtype,
                                 backend=resolved, shift=shift, deferred=deferred, softmax_scale=scale,
                                 window=variants.get("window"), softcap=variants.get("softcap"))


def _tell(groups: TreeGroups | None, error: Exception) -> None:
    """This rank's local attention or its checks raised ``error`` before the merge: instead of
    leaving the other ranks in the merge's collectives until their timeout with no word of what
    was wrong, every rank raises this rank's error, naming it (``Agreement.fail``)."""
    if groups is not None and groups.size > 1 and not isinstance(error, comm.CommError):
        groups.agreement.fail("merge", error)
