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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from . import ops
from .cost import choose_strategy  # the policy of auto, resolved once per (groups, shape, dtype)
from .reference import acc_dtype, lse_weights, normalize, weighted
from .topology import TreeGroups

__all__ = ["CommStats", "LevelStats", "STRATEGIES", "merge", "choose_strategy", "CommError"]

Strategy = Literal["allreduce3", "packed", "two_level", "allgather", "auto"]
STRATEGIES = ("allreduce3", "packed", "two_level", "allgather", "auto")


class CommError(RuntimeError):
    """A merge collective failed: a peer died, timed out or disagreed on shapes."""


@dataclass
class LevelStats:
    """Traffic of one level, summed over calls, from this rank's point of view."""

    collectives: int = 0
    """Collectives issued."""
    payload_bytes: int = 0
    """Bytes of the buffers handed to the collectives (this rank's contribution)."""
    sent_bytes: int = 0
    """Bytes this rank sends under the ring algorithms' model (see module docstring)."""
    ops: dict = field(default_factory=dict)
    """Collectives issued, by name (``all_reduce_max``, ``all_reduce_sum``, ``all_gather``)."""


@dataclass
class CommStats:
    """Per-level accounting of merge traffic; pass one to ``tree_decode``/``merge`` to fill it."""

    calls: int = 0
    """Merge calls recorded."""
    levels: dict = field(default_factory=dict)
    """Level name (``cp``, ``intra``, ``inter``) -> :class:`LevelStats`."""

    def record(self, level: str, op: str, payload: int, sent: int) -> None:
        s = self.levels.setdefault(level, LevelStats())
        s.collectives += 1
        s.payload_bytes += payload
        s.sent_bytes += sent
        s.ops[op] = s.ops.get(op, 0) + 1

    def record_all_reduce(self, level: str, op: str, nbytes: int, size: int) -> None:
        """An all-reduce of ``nbytes`` over ``size`` ranks: the ring algorithm sends 2(P-1)/P of it."""
        self.record(level, op, nbytes, 2 * (size - 1) * nbytes // size)

    @property
    def collectives(self) -> int:
        return sum(s.collectives for s in self.levels.values())

    @property
    def sent_bytes(self) -> int:
        return sum(s.sent_bytes for s in self.levels.values())

    def reset(self) -> None:
        self.calls = 0
        self.levels.clear()

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "levels": {
                k: {"collectives": v.collectives, "payload_bytes": v.payload_bytes,
                    "sent_bytes": v.sent_bytes, "ops": dict(v.ops)}
                for k, v in self.levels.items()
            },
        }


def _all_reduce(buf: torch.Tensor, op, group, size: int, level: str, name: str, stats):
    try:
        dist.all_reduce(buf, op=op, group=group)
    except RuntimeError as e:  # gloo/NCCL report a dead peer or a timeout this way
        raise CommError(
            f"tree merge: {name} over the {level!r} level ({size} ranks) failed; a peer rank may "
            f"have died or timed out: {e}"
        ) from e
    if stats is not None:
        stats.record_all_reduce(level, name, buf.numel() * buf.element_size(), size)


def _all_gather(buf: torch.Tensor, group, size: int, level: str, stats) -> torch.Tensor:
    parts = [torch.empty_like(buf) for _ in range(size)]
    try:
        dist.all_gather(parts, buf, group=group)
    except RuntimeError as e:
        raise CommError(
            f"tree merge: all_gather over the {level!r} level ({size} ranks) failed; a peer rank "
            f"may have died or timed out: {e}"
        ) from e
    if stats is not None:
        n = buf.numel() * buf.element_size()
        stats.record(level, "all_gather", n, (size - 1) * n)
    return torch.stack(parts)


def _merge_packed(o, lse, group, size, level, stats):
    """MAX(lse), then one SUM over cat([w*o, w]). o: (B, Sq, Hq, D) fp32; lse: (B, Hq, Sq)."""
    m = lse.clone()
    _all_reduce(m, dist.ReduceOp.MAX, group, size, level, "all_reduce_max", stats)
    w = lse_weights(lse, m)
    buf = torch.cat([weighted(o, w).reshape(-1), w.reshape(-1)])
    _all_reduce(buf, dist.ReduceOp.SUM, group, size, level, "all_reduce_sum", stats)
    num, den = buf[: o.numel()].view(o.shape), buf[o.numel():].view(lse.shape)
    return normalize(num, den, m)


def _merge_allreduce3(o, lse, group, size, level, stats):
    """The paper's Algorithm 3: MAX(lse), SUM(den), SUM(num) as three collectives."""
    m = lse.clone()
    _all_reduce(m, dist.ReduceOp.MAX, group, size, level, "all_reduce_max", stats)
    den = lse_weights(lse, m)
    num = weighted(o, den)
    _all_reduce(den, dist.ReduceOp.SUM, group, size, level, "all_reduce_sum", stats)
    _all_reduce(num, dist.ReduceOp.SUM, group, size, level, "all_reduce_sum", stats)
    return normalize(num, den, m)


def _merge_allgather(o, lse, group, size, level, stats):
    """One all-gather of cat([o, lse]) and a local merge of the P states."""
    buf = torch.cat([o.reshape(-1), lse.reshape(-1)])
    parts = _all_gather(buf, group, size, level, stats)
    outs = parts[:, : o.numel()].reshape(size, *o.shape)
    lses = parts[:, o.numel():].reshape(size, *lse.shape)
    return ops.merge_states(outs, lses)


def merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    groups: TreeGroups,
    strategy: str = "auto",
    stats: CommStats | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's partial state with every other rank's of ``groups``; result on all ranks.

    out: (batch, seqlen_q, nheads_q, headdim), any float dtype (this rank's normalised partial)
    lse: (batch, nheads_q, seqlen_q) natural log, -inf for an empty shard
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input),
            lse: (batch, nheads_q, seqlen_q) same dtype; every rank of the CP group gets the same.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    acc = acc_dtype(out.dtype)
    o = out.to(acc)
    lse = lse.to(acc)
    if stats is not None:
        stats.calls += 1
    if groups.size == 1:
        return o, lse
    if strategy == "auto":
        strategy = choose_strategy(groups, tuple(out.shape), o.element_size())
    if strategy == "two_level":
        for lvl in groups.levels:  # innermost first
            o, lse = _merge_packed(o, lse, lvl.group, lvl.size, lvl.name, stats)
        return o, lse
    fn = {"packed": _merge_packed, "allreduce3": _merge_allreduce3, "allgather": _merge_allgather}[strategy]
    return fn(o, lse, groups.cp_group, groups.size, "cp", stats)
