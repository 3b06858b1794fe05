"""``tree_decode``: exact attention of a few query tokens over a sequence-sharded KV cache.

Invariant: the local half (``ops.flash_decode`` on this rank's shard) and the global half
(``comm.merge`` over the CP group's levels) are the only two steps; everything else here
is checking the contract of DESIGN.md section 3 so that bad input fails before any rank
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

from .. import comm, ops
from ..comm import CommStats
from ..reference import acc_dtype, add_sink, check_decode_inputs, check_variants, lse_acc_dtype
from ..topology import TreeGroups

__all__ = ["tree_decode", "ShiftState"]


def tree_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: TreeGroups | None,
    *,
    cache_seqlens: torch.Tensor | None = None,
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
        may differ from headdim (MLA)
    cache_seqlens: (batch,) int32 -- valid keys of this shard per batch row (rows may differ)
    cache_starts: (batch,) int32 -- this shard's first valid key per row (``ops.flash_decode``)
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
        ``packed`` (a decode loop reads all its layers' flags once per step; :class:`ShiftState`)
    lse_dtype: dtype of the returned lse: float32 by default (float64 for float64 input);
        ``torch.float64`` returns it whole, for merging the result again (e.g. with a chunk of
        keys held elsewhere) exactly at large score magnitudes -- partials and every merge level
        carry float64 either way
    window, softcap: the local attention's sliding window (with positions: a query at global
        position p sees keys p - window < j <= p; a rank with none is an empty shard) and score
        soft-capping, as for ``ops.flash_decode``; the same on every rank
    sinks: (nheads_q,) float, the same on every rank: one logit per query head joining the
        softmax once, with a zero value -- applied after the merge (``reference.add_sink``),
        never to a rank's partial (which would count it once per rank)
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in q.dtype, identical on every CP rank,
            and with ``return_lse`` also lse: (batch, nheads_q, seqlen_q) in lse_dtype, natural
            log (over the keys and the sink); NaN in the rows where some rank's visible score is NaN

    Every CP rank must pass the same batch, seqlen_q, nheads_q, headdim, dtype, strategy and
    backend; ranks that do not raise :class:`~megatron_tree.comm.DisagreementError` on every
    rank (see ``comm.merge``). A peer that dies or hangs is a ``CommError`` within the groups'
    timeout.
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
                                      k_positions, stats, backend, shift, deferred, variants)
    else:
        # fp32 partials (DESIGN.md section 1): a bf16/fp16 result is rounded once, below. The
        # partial lse is float64 so the merge is exact at large score magnitudes (comm's docstring).
        out, lse = ops.flash_decode(
            q, k, v, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
            q_positions=q_positions, k_positions=k_positions, out_dtype=acc_dtype(q.dtype), backend=backend,
            lse_dtype=torch.float64, **variants,
        )
        comm.check_shift(shift, tuple(lse.shape))
        if groups is not None:
            out, lse = comm.merge(out, lse, groups, strategy, stats, dtype=q.dtype,
                                  backend=ops.resolve_backend(q.device, backend), shift=shift, deferred=deferred)
    if sinks is not None:  # once, on the merged state (every rank holds the same)
        out, lse = add_sink(out, lse, sinks)
    out = out.to(q.dtype)
    return (out, lse.to(ld)) if return_lse else out


def _decode_overlapped(q, k, v, groups, cache_seqlens, softmax_scale, strategy, q_positions, k_positions, stats,
                       backend, shift=None, deferred=None, variants=None):
    """``tree_decode`` with the batch in two halves, each half's merge overlapping the next half's local attention.

    Shapes as in :func:`tree_decode`. The whole batch is checked before the first collective
    starts, so bad input fails on every rank before any rank waits in one.
    """
    variants = variants or {}
    check_decode_inputs(q, k, v, cache_seqlens, q_positions, k_positions,
                        by_value=q.device.type == "cpu" and not torch.compiler.is_compiling(), **variants)
    b = q.shape[0]
    halves = [slice(0, (b + 1) // 2), slice((b + 1) // 2, b)]
    shared_kpos = k_positions is not None and k_positions.dim() == 1  # (N,): the same for every row

    def local(rows):
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return ops.flash_decode(
            q[rows], k[rows], v[rows], cache_seqlens=pick(cache_seqlens), softmax_scale=softmax_scale,
            q_positions=pick(q_positions), k_positions=k_positions if shared_kpos else pick(k_positions),
            out_dtype=acc_dtype(q.dtype), backend=backend, lse_dtype=torch.float64,
            window=variants.get("window"), softcap=variants.get("softcap"),
            cache_starts=pick(variants.get("cache_starts")),
        )

    out_shape = (*q.shape[:3], v.shape[3])  # the merged outputs have V's head dim
    return comm.merge_overlapped(local, halves, out_shape, groups, strategy, stats, dtype=q.dtype,
                                 backend=ops.resolve_backend(q.device, backend), shift=shift, deferred=deferred)


class ShiftState:
    """What ``strategy="shifted"`` carries from one decode step to the next, for one decode loop.

    * ``shifts``: each layer's merged lse of the previous step (layer key -> (B, Hq, Sq)),
      the next step's shift; bit-identical on every CP rank (``comm``'s module docstring).
    * ``flags``: this step's device flags, one per layer's merge (``tree_decode(deferred=)``);
      no host read while the step runs.
    * ``redo`` / ``placement``: after :meth:`needs_redo` says so, the loop runs the step again
      with ``packed`` merges (:meth:`decode` switches by itself) and the model reuses the
      placement it stored in ``placement`` on the first try, so the cache does not advance twice
      (keys/values are written to the same slots again, which is idempotent).

    A decode loop (``generate``) makes one per generation, passes it to ``model.decode_step``
    and runs each step through :meth:`run_step` (one host read of the flags per step, where it
    reads the logits anyway).
    """

    def __init__(self):
        self.shifts: dict = {}
        self.flags: list = []
        self.redo = False
        self.placement = None

    def decode(self, key, q, k, v, groups, *, strategy: str = "shifted", **kwargs) -> torch.Tensor:
        """``tree_decode`` of one layer (``key``) with its previous lse as the shift; returns out.

        q, k, v and kwargs as for :func:`tree_decode` (not ``return_lse``/``shift``/``deferred``).
        """
        r = self.shifts.get(key)
        if r is not None and tuple(r.shape) != (q.shape[0], q.shape[2], q.shape[1]):
            r = None  # another batch shape: start again from packed (every rank sees the same shapes)
        if self.redo or strategy != "shifted":
            out, lse = tree_decode(q, k, v, groups, strategy="packed" if self.redo else strategy,
                                   return_lse=True, **kwargs)
        else:
            out, lse = tree_decode(q, k, v, groups, strategy="shifted", shift=r, return_lse=True,
                                   deferred=self.flags, **kwargs)
        self.shifts[key] = lse
        return out

    def needs_redo(self, stats: CommStats | None = None) -> bool:
        """Whether a merge of the step just run needs the MAX + SUM redo (one host read).

        Clears the flags; when True, sets ``redo`` (the caller runs the step again and then
        calls :meth:`step_done`) and adds the number of failed merges to ``stats.fallbacks``.
        """
        flags, self.flags = self.flags, []
        if not flags:
            return False
        failed = int(torch.stack(flags).sum())  # identical on every rank: from all-reduced values
        if failed and stats is not None:
            stats.fallbacks += failed
        self.redo = failed > 0
        return self.redo

    def step_done(self) -> None:
        """End of a step (after a redo): the next step tries ``shifted`` again."""
        self.redo = False
        self.flags = []

    def run_step(self, step, stats: CommStats | None = None):
        """One decode step: ``step()`` (a model's ``decode_step`` given this state), run again with
        ``packed`` merges when a merge's check failed; returns ``(its result, redone)``."""
        out = step()
        redone = self.needs_redo(stats)
        if redone:
            out = step()
        self.step_done()
        return out, redone
