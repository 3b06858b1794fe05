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
``auto``        chosen per call by :func:`choose_strategy`
==============  ===========================================================  ===========

Bytes "sent" per rank are those of the bandwidth-optimal ring algorithms (an all-reduce of
n bytes over p ranks sends 2(p-1)/p * n; an all-gather of n bytes per rank sends
(p-1) * n), the model the paper's traffic formula uses. Collectives go through
``collectives.py``, so a failure is a :class:`CommError` naming the level and likely cause.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import collectives, ops
from .collectives import CommError, CommStats, LevelStats
from .reference import acc_dtype, lse_weights, normalize, weighted
from .topology import TreeGroups

__all__ = ["CommStats", "LevelStats", "STRATEGIES", "merge", "choose_strategy", "CommError"]

Strategy = Literal["allreduce3", "packed", "two_level", "allgather", "auto"]
STRATEGIES = ("allreduce3", "packed", "two_level", "allgather", "auto")


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


def choose_strategy(groups: TreeGroups, out_shape, dtype_bytes: int = 4) -> str:
    """The strategy ``auto`` resolves to for a state of ``out_shape`` (B, Sq, Hq, D) on ``groups``.

    Uses the α-β cost model (``bench/cost_model.py``) when it is importable; without it,
    ``two_level`` on hierarchical groups and ``packed`` elsewhere.
    """
    try:
        from .bench.cost_model import choose_strategy as model_choice
    except ImportError:
        model_choice = None
    if model_choice is not None:
        return model_choice(groups, out_shape, dtype_bytes)
    return "two_level" if groups.is_hierarchical else "packed"


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
