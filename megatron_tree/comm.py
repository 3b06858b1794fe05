"""Merge collectives: partial states of every CP rank into the exact result on every rank.

Invariant: every strategy computes DESIGN.md section 1 with the two halves of the one
merge formula in ``reference.py`` (``lse_weights`` and ``normalize``), with collectives in
between; partials travel in float32 (float64 for float64 input) and are cast once, by
the caller. Every collective issued is recorded in a :class:`CommStats` when one is given,
so tests and benchmarks read counts and bytes instead of assuming them.

Strategies (DESIGN.md section 4):

==============  ===========================================================  ===========
name            collectives per call                                         levels
==============  ===========================================================  ===========
``allreduce3``  MAX(lse), SUM(den), SUM(num) -- the paper's Algorithm 3      ``cp``
``packed``      MAX(lse), SUM(cat[w*o, w])                                   ``cp``
``two_level``   ``packed`` inside each node, then across nodes               intra, inter
``allgather``   one all-gather of cat[o, lse], then a local merge            ``cp``
``auto``        chosen by :func:`cost.choose_strategy`, once per shape
==============  ===========================================================  ===========

Bytes "sent" per rank are those of the bandwidth-optimal ring algorithms (an all-reduce of
n bytes over p ranks sends 2(p-1)/p * n; an all-gather of n bytes per rank sends
(p-1) * n), the model the paper's traffic formula uses.

Collectives go through ``collectives.py`` (a failure is a :class:`CommError`), inside the CP
group's :class:`collectives.Agreement` on :data:`MERGE_SIGNATURE`, so ranks that disagree on
a call get a :class:`DisagreementError` instead of a backend abort or a wrong answer.

:func:`merge_overlapped` runs the same merges in stages on asynchronous collectives for a
batch split in parts, so that one part's collectives travel while the next part's local
attention computes (``tree_decode(..., overlap=True)``); :data:`SPLIT_STRATEGIES` lists the
strategies it stages.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import collectives, ops
from .collectives import CommError, CommStats, DisagreementError, LevelStats
from .cost import choose_strategy  # the policy of auto, resolved once per (groups, shape, dtype)
from .reference import acc_dtype, lse_weights, normalize, weighted
from .topology import TreeGroups

__all__ = ["CommStats", "LevelStats", "STRATEGIES", "merge", "choose_strategy", "CommError",
           "DisagreementError", "MERGE_SIGNATURE", "SPLIT_STRATEGIES", "SPLIT_SIGNATURE", "merge_overlapped"]

Strategy = Literal["allreduce3", "packed", "two_level", "allgather", "auto"]
STRATEGIES = ("allreduce3", "packed", "two_level", "allgather", "auto")


MERGE_SIGNATURE = ("batch", "seqlen_q", "heads_q", "headdim", "dtype", "strategy", "backend")
"""What every rank of a merge must agree on (:class:`collectives.Agreement` checks it when it changes).
A new argument that changes the collectives (e.g. a shift) is one more name here and one more value in
:func:`merge`."""

_WHAT = "tree merge"


def _all_reduce(buf: torch.Tensor, op: str, group, level: str, stats) -> None:
    collectives.all_reduce(buf, group, op=op, level=level, stats=stats, what=_WHAT)


def _merge_packed(o, lse, group, size, level, stats):
    """MAX(lse), then one SUM over cat([w*o, w]). o: (B, Sq, Hq, D) fp32; lse: (B, Hq, Sq)."""
    m = lse.clone()
    _all_reduce(m, "max", group, level, stats)
    w = lse_weights(lse, m)
    buf = torch.cat([weighted(o, w).reshape(-1), w.reshape(-1)])
    _all_reduce(buf, "sum", group, level, stats)
    num, den = buf[: o.numel()].view(o.shape), buf[o.numel():].view(lse.shape)
    return normalize(num, den, m)


def _merge_allreduce3(o, lse, group, size, level, stats):
    """The paper's Algorithm 3: MAX(lse), SUM(den), SUM(num) as three collectives."""
    m = lse.clone()
    _all_reduce(m, "max", group, level, stats)
    den = lse_weights(lse, m)
    num = weighted(o, den)
    _all_reduce(den, "sum", group, level, stats)
    _all_reduce(num, "sum", group, level, stats)
    return normalize(num, den, m)


def _merge_allgather(o, lse, group, size, level, stats):
    """One all-gather of cat([o, lse]) and a local merge of the P states."""
    buf = torch.cat([o.reshape(-1), lse.reshape(-1)])
    parts = collectives.all_gather(buf, group, level=level, stats=stats, what=_WHAT)
    outs = parts[:, : o.numel()].reshape(size, *o.shape)
    lses = parts[:, o.numel():].reshape(size, *lse.shape)
    return ops.merge_states(outs, lses)


def merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    groups: TreeGroups,
    strategy: str = "auto",
    stats: CommStats | None = None,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's partial state with every other rank's of ``groups``; result on all ranks.

    out: (batch, seqlen_q, nheads_q, headdim), any float dtype (this rank's normalised partial)
    lse: (batch, nheads_q, seqlen_q) natural log, -inf for an empty shard
    dtype, backend: the caller's input dtype and kernel backend (default: out's dtype, none),
        part of what every rank must agree on (:data:`MERGE_SIGNATURE`)
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input),
            lse: (batch, nheads_q, seqlen_q) same dtype; every rank of the CP group gets the same.

    Ranks that disagree on the signature raise :class:`DisagreementError` on every rank
    (checked when this rank's signature differs from its previous merge on ``groups``: no
    extra collective or host sync in steady state; see :class:`collectives.Agreement`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    if out.dim() != 4 or tuple(lse.shape) != (out.shape[0], out.shape[2], out.shape[1]):
        raise ValueError(
            f"merge expects out (batch, seqlen_q, heads_q, headdim) and lse (batch, heads_q, seqlen_q), "
            f"got {tuple(out.shape)} and {tuple(lse.shape)}"
        )
    acc = acc_dtype(out.dtype)
    o = out.to(acc)
    lse = lse.to(acc)
    if stats is not None:
        stats.calls += 1
    if groups.size == 1:
        return o, lse
    if strategy == "auto":
        strategy = choose_strategy(groups, tuple(out.shape), o.element_size())
    b, sq, hq, d = out.shape
    signature = (b, sq, hq, d, out.dtype if dtype is None else dtype, strategy, backend)
    with groups.agreement.call("merge", MERGE_SIGNATURE, signature):
        if strategy == "two_level":
            for lvl in groups.levels:  # innermost first
                o, lse = _merge_packed(o, lse, lvl.group, lvl.size, lvl.name, stats)
            return o, lse
        fn = {"packed": _merge_packed, "allreduce3": _merge_allreduce3, "allgather": _merge_allgather}[strategy]
        return fn(o, lse, groups.cp_group, groups.size, "cp", stats)


# --------------------------------------------------------------------------- overlapped merge
#
# The merges above as stage generators: each yields the handle(s) of the collective(s) it has
# just started and resumes, once they are waited for, with the local work up to the next one.
# Row for row these are the same operations as the synchronous merges.

SPLIT_STRATEGIES = ("allreduce3", "packed", "two_level", "allgather", "auto")
"""Strategies :func:`merge_overlapped` runs in stages (every collective asynchronous)."""

SPLIT_SIGNATURE = ("batch", "seqlen_q", "heads_q", "headdim", "dtype", "strategy", "backend", "split")
"""An overlapped merge's signature at the ``merge`` site: :data:`MERGE_SIGNATURE`'s shape, dtype, strategy and
backend plus the parts' batch sizes, so a rank that splits and one that does not (or splits differently) get a
:class:`DisagreementError`. Spelled out rather than derived, so a name added to ``MERGE_SIGNATURE`` for
another strategy cannot shift the labels of these values."""


def _start_all_reduce(buf: torch.Tensor, op: str, group, level: str, stats) -> collectives.Pending:
    return collectives.all_reduce_async(buf, group, op=op, level=level, stats=stats, what=_WHAT)


def _packed_stages(o, lse, group, level, stats):
    """:func:`_merge_packed` in stages: MAX(lse) | SUM(cat[w*o, w]) | normalise."""
    m = lse.clone()
    yield _start_all_reduce(m, "max", group, level, stats)
    w = lse_weights(lse, m)
    buf = torch.cat([weighted(o, w).reshape(-1), w.reshape(-1)])
    yield _start_all_reduce(buf, "sum", group, level, stats)
    num, den = buf[: o.numel()].view(o.shape), buf[o.numel():].view(lse.shape)
    return normalize(num, den, m)


def _allreduce3_stages(o, lse, group, level, stats):
    """:func:`_merge_allreduce3` in stages; its two SUMs do not depend on each other and travel together."""
    m = lse.clone()
    yield _start_all_reduce(m, "max", group, level, stats)
    den = lse_weights(lse, m)
    num = weighted(o, den)
    yield _start_all_reduce(den, "sum", group, level, stats), _start_all_reduce(num, "sum", group, level, stats)
    return normalize(num, den, m)


def _allgather_stages(o, lse, group, size, level, stats):
    """:func:`_merge_allgather` in stages: ALL_GATHER(cat[o, lse]) | local merge."""
    buf = torch.cat([o.reshape(-1), lse.reshape(-1)])
    parts = buf.new_empty((size, buf.numel()))
    yield collectives.all_gather_async(buf, group, out=parts, level=level, stats=stats, what=_WHAT)
    outs = parts[:, : o.numel()].reshape(size, *o.shape)
    lses = parts[:, o.numel():].reshape(size, *lse.shape)
    return ops.merge_states(outs, lses)


def _two_level_stages(o, lse, groups, stats):
    """``two_level`` in stages: each level's packed merge needs the previous level's result, so the
    levels chain inside one part (4 dependent collectives) while the other part's stages interleave."""
    for lvl in groups.levels:  # innermost first
        o, lse = yield from _packed_stages(o, lse, lvl.group, lvl.name, stats)
    return o, lse


def _stage_count(strategy: str, groups: TreeGroups) -> int:
    """Dependent collective stages of one merge (:func:`_stages`)."""
    return {"packed": 2, "allreduce3": 2, "allgather": 1}.get(strategy, 2 * len(groups.levels))


def _stages(strategy: str, o, lse, groups: TreeGroups, stats):
    if strategy == "two_level":
        return _two_level_stages(o, lse, groups, stats)
    if strategy == "allgather":
        return _allgather_stages(o, lse, groups.cp_group, groups.size, "cp", stats)
    return {"packed": _packed_stages, "allreduce3": _allreduce3_stages}[strategy](o, lse, groups.cp_group, "cp", stats)


class _InFlight:
    """One part's merge: its stage generator and the collectives it has in flight."""

    def __init__(self, stages):
        self._stages, self.result, self.started = stages, None, 0
        self._waiting = self._resume()  # runs up to its first collective and starts it

    def _resume(self) -> tuple:
        try:
            handles = next(self._stages)
        except StopIteration as stop:
            self.result = stop.value
            return ()
        self.started += 1
        return handles if isinstance(handles, tuple) else (handles,)

    def advance(self) -> None:
        """Wait for the collectives in flight, then run the local work after them up to (and
        starting) the next stage's collectives, or to the end (``result`` set)."""
        for handle in self._waiting:
            handle.wait()
        if self.result is None:
            self._waiting = self._resume()


def merge_overlapped(
    local,
    parts: list,
    out_shape: tuple,
    groups: TreeGroups,
    strategy: str = "auto",
    stats: CommStats | None = None,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention and merge of a batch in parts, each part's merge in flight while the next part's local runs.

    local: ``local(part) -> (out, lse)``, this rank's partial state of the batch rows ``part``
        (a slice), computed when called: out (rows, seqlen_q, nheads_q, headdim), lse
        (rows, nheads_q, seqlen_q) natural log, -inf for an empty shard
    parts: slices that tile ``range(batch)`` in order (e.g. two halves)
    out_shape: (batch, seqlen_q, nheads_q, headdim) of the whole batch
    strategy: one of :data:`SPLIT_STRATEGIES`; dtype: the caller's input dtype (default float32);
        backend: the kernel backend (both part of what every rank must agree on)
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input),
            lse: (batch, nheads_q, seqlen_q) same dtype -- what :func:`merge` returns for the
            whole batch: every row goes through the same operations (the sums' rounding can
            differ where the backend's reduction order depends on the buffer's length).

    Schedule (the same on every rank, so each group sees its collectives in one order)::

        for each part, in order:
            local attention            -- while the previous part's last collective travels
            its stages but the last: start, wait, local work (two_level's levels chain here)
            start its last collective  -- the SUM of cat[w*o, w] (the bulk of the bytes;
                                          for two_level the inter-node one), or the all-gather
        for each part: wait its last collective, normalise

    Only a part's last stage is hidden behind the next part's local attention: its earlier
    stages (the MAX of lse, a few bytes) are waited for first, so the last stage's inputs
    are ready before the next local attention occupies the device (an in-order stream).

    One merge call in ``stats`` (``calls``), every part's collectives in its levels; one
    agreement check on :data:`SPLIT_SIGNATURE`.
    """
    if strategy not in SPLIT_STRATEGIES:
        raise ValueError(f"an overlapped merge supports the strategies {SPLIT_STRATEGIES}, got {strategy!r}")
    b, sq, hq, d = (int(x) for x in out_shape)
    rows = [range(b)[p] for p in parts]
    if [i for r in rows for i in r] != list(range(b)) or any(len(r) == 0 for r in rows):
        raise ValueError(f"parts must tile range({b}) in order with no empty part, got {parts}")
    sizes = tuple(len(r) for r in rows)
    dtype = torch.float32 if dtype is None else dtype
    acc = acc_dtype(dtype)
    if stats is not None:
        stats.calls += 1
    if groups.size == 1:
        states = [local(p) for p in parts]
        return torch.cat([o.to(acc) for o, _ in states]), torch.cat([l.to(acc) for _, l in states])
    if strategy == "auto":  # every part is priced as the largest one, so all parts run one strategy
        strategy = choose_strategy(groups, (max(sizes), sq, hq, d), torch.tensor([], dtype=acc).element_size())
    signature = (b, sq, hq, d, dtype, strategy, backend, sizes)
    with groups.agreement.call("merge", SPLIT_SIGNATURE, signature):
        n = _stage_count(strategy, groups)
        flights = []
        for p in parts:
            o, lse = local(p)
            flight = _InFlight(_stages(strategy, o.to(acc), lse.to(acc), groups, stats))
            while flight.started < n:
                flight.advance()
            flights.append(flight)
        for flight in flights:
            flight.advance()
    return torch.cat([f.result[0] for f in flights]), torch.cat([f.result[1] for f in flights])
