"""Merge collectives: partial states of every CP rank into the exact result on every rank.

Invariant: every strategy computes docs/design.md §1 with the two halves of the one
merge formula in ``reference.py`` (``lse_weights`` and ``normalize``), with collectives in
between; partial outputs and weights travel in float32 (float64 for float64 input) and are
cast once, by the caller. A partial lse arrives in float64 from ``tree_decode`` and stays
float64 through every level (a float32 lse of magnitude 1e4 is known only
to ~5e-4, which a merge turns into output errors of 3e-5 to 3e-4); on the wire it costs
nothing extra except in ``allgather`` (8 bytes per row instead of 4): the MAX of
``packed``/``two_level``/``allreduce3`` only needs a shared shift near the maximum, so it
runs on the lse rounded to float32, and the weights ``exp(lse_u - m)`` are formed from the
whole lse. Every collective issued is recorded in a :class:`CommStats` when one is given,
so tests and benchmarks read counts and bytes instead of assuming them.

Strategies (docs/design.md §4):

==============  ===========================================================  ===========
name            collectives per call                                         levels
==============  ===========================================================  ===========
``allreduce3``  MAX(lse), SUM(den), SUM(num) -- the paper's Algorithm 3      ``cp``
``packed``      MAX(lse), SUM(cat[w*o, w])                                   ``cp``
``two_level``   ``packed`` inside each node, then across nodes               intra, inter
``allgather``   one all-gather of cat[o, lse], then a local merge            ``cp``
``shifted``     SUM(cat[w*o, w, nonempty, digests]), w = exp(lse - shift);   ``cp``
                MAX + SUM again only when the check after the SUM fails
``auto``        chosen by :func:`cost.choose_strategy`, once per shape
==============  ===========================================================  ===========

Bytes "sent" per rank are those of the bandwidth-optimal ring algorithms (an all-reduce of
n bytes over p ranks sends 2(p-1)/p * n; an all-gather of n bytes per rank sends
(p-1) * n), the model the paper's traffic formula uses.

Collectives go through ``collectives.py`` (a failure is a :class:`CommError`), inside the CP
group's :class:`agreement.Agreement` on :data:`MERGE_SIGNATURE`, so ranks that disagree on
a call get a :class:`DisagreementError` instead of a backend abort or a wrong answer.

Each strategy is written once, as a generator of stages (its collectives, with the local work
between them); :func:`merge` runs it on synchronous collectives and :func:`merge_overlapped` on
asynchronous ones for a batch split in parts, so that one part's collectives travel while the
next part's local attention computes (``tree_decode(..., overlap=True)``; every strategy,
:data:`STRATEGIES`).

``shifted``: one SUM suffices when every rank weights its partial by
``w_u = exp(lse_u - r)`` for a shift ``r`` that every rank holds bit-identically without
communicating -- in a decode loop, the previous step's merged lse of the same layer.
Any ``r`` gives the exact result ``o = sum w_u o_u / sum w_u``, ``lse = r + log sum w_u``
(the max in ``packed`` is only one choice of shift), *provided* the weights are
representable. Both failure modes are visible in the all-reduced denominator
``den = sum_u w_u``, which is bit-identical on every rank, so every rank takes the same
decision: overflow (some ``lse_u - r > 88``) makes ``den`` infinite or NaN, and too small a
``den`` means the weights underflowed into subnormals. We accept a row when
``SHIFT_MIN_DEN <= den <= SHIFT_MAX_DEN`` (``2^-64 .. 2^64``, i.e. ``lse`` within about 44
nats of ``r``):

* upper bound: every ``w_u <= den <= 2^64`` (weights are >= 0), so every ``w_u o_u`` and
  every partial sum of the reduction is at most ``2^64 max|v|``, far below fp32's 2^128;
* lower bound: a weight below fp32's normal range (2^-126) carries an absolute error of at
  most 2^-150, and so does each element of ``w_u o_u``; divided by ``den >= 2^-64`` that is
  at most ``P 2^-86`` of the result -- nothing next to fp32's own 2^-24. Above 2^-126 every
  weight is a normal float rounded once (``lse_u - r`` is formed in float64, where the
  difference of two float32 values is exact, then ``exp`` is rounded once to fp32).

A NaN partial lse (a NaN score on some rank) makes ``den`` NaN: that row's exact answer is NaN
at any shift, so it is answered NaN (out and lse) and not redone.

A row that no rank has keys for (padding, finished requests) has ``den = 0`` too; the third
part of the buffer, the all-reduced count of ranks with a key in the row, tells the two
apart, so such rows are answered (out 0, lse -inf) without a fallback. Rows that fail are
redone for the whole call with ``packed``: at once (a host read of the decision, one flag per
call), or -- in a decode loop -- later, when the caller passes ``deferred=`` (a list that
receives the call's flag on the device; the loop reads every layer's flag once per step
and redoes the step with ``packed``).

Why ranks cannot disagree on ``r``: the shift a decode loop passes is the merged lse of the
same layer one step earlier, i.e. ``normalize`` applied to the outputs of an all-reduce.
An all-reduce leaves the same bytes in every rank's buffer: gloo's and NCCL's algorithms
(ring, tree, halving-doubling) compute each reduced chunk once, on one rank or along one
fixed chain, and then *copy* it to the others (the all-gather phase / the broadcast down
the tree); no rank re-adds the chunk in its own order. ``normalize`` and ``lse_weights`` are
elementwise torch ops with the same inputs, dtypes and device type on every rank, so they
produce the same bits; by induction over the steps every rank's ``r`` is identical. (A run
mixing CPU and GPU ranks in one group would break the last step: not a supported setup.)
The first step has no shift and uses ``packed``, whose result starts the induction. A shift
that does differ (a caller's own, or a bug) is never a silent wrong answer: the agreement check
covers the shift's presence, and every rank's :func:`shift_digest` of its values rides on the
one SUM (two words per rank, zeros in the other ranks' slots, so the SUM hands every rank every
rank's words): words that differ are a :class:`DisagreementError` on every rank, or, under
``deferred=``, the call's flag, so a decode loop redoes the step with ``packed``.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..distributed import collectives
from ..ops import dispatch as ops
from ..distributed.agreement import disagreement
from ..distributed.collectives import CommError, CommStats, DisagreementError, LevelStats
from .cost import choose_strategy  # the policy of auto, resolved once per (groups, shape, dtype)
from ..ops.contract import acc_dtype, no_backward
from ..ops.reference import lse_weights, normalize, weighted
from .strategies import STRATEGIES
from ..distributed.topology import TreeGroups

__all__ = ["CommStats", "LevelStats", "STRATEGIES", "merge", "choose_strategy", "CommError",
           "DisagreementError", "MERGE_SIGNATURE", "SHIFT_MIN_DEN", "SHIFT_MAX_DEN", "check_shift",
           "SPLIT_SIGNATURE", "merge_overlapped", "shift_digest", "CompileError"]

Strategy = Literal[STRATEGIES]  # the names are listed once, in strategies.py

SHIFT_MIN_DEN = 2.0 ** -64
"""Smallest all-reduced ``sum exp(lse_u - r)`` that ``shifted`` accepts (see the module docstring)."""
SHIFT_MAX_DEN = 2.0 ** 64
"""Largest all-reduced ``sum exp(lse_u - r)`` that ``shifted`` accepts (see the module docstring)."""


MERGE_SIGNATURE = ("batch", "seqlen_q", "heads_q", "headdim_v", "dtype", "strategy", "backend", "shift",
                   "softmax_scale", "window", "softcap")
"""What every rank of a merge must agree on (:class:`agreement.Agreement` checks it when it changes).
``headdim_v`` is the merged outputs' head dim, V's (q and k may have another, as in MLA: the merge
never sees it). A new argument that changes the collectives (e.g. a shift) is one more name here and
one more value in :func:`merge`.

``softmax_scale``, ``window`` and ``softcap`` are the local attention's settings that made each
rank's partial (:func:`merge`'s arguments of those names): they change no collective, but partials
of different settings combine into an answer that is no attention at all, so ranks that differ
raise instead. The scale is compared resolved (``tree_decode`` passes the one the kernel used:
``None`` is ``1/sqrt(headdim)``, so ``None`` on one rank and that value on another are one
setting) and exactly, as the Python float handed to the kernel (``headdim ** -0.5`` can differ
from ``1/sqrt(headdim)`` in its last bit, and is then another setting, as it is in a float64
kernel); a caller that merges partials of its own making passes ``None`` for all three, and
they are then compared as ``None``. The attention sinks are not here: ``tree_decode`` adds them
to the merged state on each rank, after the merge, so no partial depends on them."""

_WHAT = "tree merge"


class _Done:
    """The handle of a collective that completed when it was issued."""

    def wait(self) -> None:
        pass


class _Start:
    """How a merge's collectives are issued: at once (``sync``: each has completed when its
    handle is yielded) or asynchronously (:class:`collectives.Pending`, waited for by whoever
    drives the stages -- :func:`merge_overlapped`). Every merge below is written once, as stages,
    and runs either way."""

    def __init__(self, sync: bool):
        self.sync = sync

    def all_reduce(self, buf: torch.Tensor, op: str, group, level: str, stats):
        if self.sync:
            collectives.all_reduce(buf, group, op=op, level=level, stats=stats, what=_WHAT)
            return _Done()
        return collectives.all_reduce_async(buf, group, op=op, level=level, stats=stats, what=_WHAT)

    def all_gather(self, buf: torch.Tensor, group, out: torch.Tensor, level: str, stats):
        if self.sync:
            collectives.all_gather(buf, group, out=out, level=level, stats=stats, what=_WHAT)
            return _Done()
        return collectives.all_gather_async(buf, group, out=out, level=level, stats=stats, what=_WHAT)


_SYNC, _ASYNC = _Start(True), _Start(False)


def _run(stages):
    """The result of a stage generator started with :data:`_SYNC` (its collectives are complete)."""
    while True:
        try:
            next(stages)
        except StopIteration as stop:
            return stop.value


# --------------------------------------------------------------------------- the merges, as stages
#
# Each merge is a generator: it yields the handle(s) of the collective(s) it has just started
# and resumes, once they are complete, with the local work up to the next one; its return value
# is the merged (out, lse) -- (out, lse, bad) for shifted. ``merge`` runs them with _SYNC,
# ``merge_overlapped`` with _ASYNC.


def _packed_stages(start, o, lse, group, level, stats):
    """MAX(lse) | SUM(cat[w*o, w]) | normalise. o: (B, Sq, Hq, D) fp32; lse: (B, Hq, Sq) fp64 or fp32.

    The MAX runs over the lse rounded to o's dtype: any m that every rank holds and that is
    within a rounding of the largest lse works (the weights ``exp(lse_u - m)`` are formed from
    the whole lse and stay <= exp(2^-24 |m|): 1.006 at |m| = 1e5; they could overflow fp32 only
    past |m| ~ 2^31), so a float64 lse crosses the wire in 4 bytes. Rounding is monotonic: m is
    the rounded maximum.
    """
    m = lse.to(o.dtype, copy=True)
    yield start.all_reduce(m, "max", group, level, stats)
    w = lse_weights(lse, m, o.dtype)
    buf = torch.cat([weighted(o, w).reshape(-1), w.reshape(-1)])
    yield start.all_reduce(buf, "sum", group, level, stats)
    num, den = buf[: o.numel()].view(o.shape), buf[o.numel():].view(lse.shape)
    return normalize(num, den, m, lse.dtype)


def _allreduce3_stages(start, o, lse, group, level, stats):
    """The paper's Algorithm 3: MAX(lse) | SUM(den), SUM(num) | normalise (the two SUMs do not
    depend on each other and are started together). The MAX as in :func:`_packed_stages`."""
    m = lse.to(o.dtype, copy=True)
    yield start.all_reduce(m, "max", group, level, stats)
    den = lse_weights(lse, m, o.dtype)
    num = weighted(o, den)
    yield start.all_reduce(den, "sum", group, level, stats), start.all_reduce(num, "sum", group, level, stats)
    return normalize(num, den, m, lse.dtype)


def _allgather_stages(start, o, lse, group, size, level, stats):
    """ALL_GATHER(cat[o, lse]) | local merge of the P states."""
    buf = _gather_buffer(o, lse)
    parts = buf.new_empty((size, buf.numel()))
    yield start.all_gather(buf, group, parts, level, stats)
    return ops.merge_states(*_gathered_states(parts, o, lse, size))


def _shifted_stages(start, o, lse, shift, group, index, size, level, stats):
    """One SUM over cat([w*o, w, nonempty, digests]) with w = exp(lse - shift) | normalise.

    o: (B, Sq, Hq, D) fp32; lse: (B, Hq, Sq) fp64 or fp32; shift: (B, Hq, Sq); index, size: this
    rank's index in ``group`` and the group's size. Returns (out, lse, bad, digests) where bad:
    (B, Hq, Sq) bool, identical on every rank, marks rows whose weights overflowed or all
    underflowed (their out/lse are not usable; :func:`_settle_shifted` redoes the merge with
    ``packed`` or leaves the flag to the caller) and digests: (size, 2) every rank's
    :func:`shift_digest` words, identical on every rank.
    """
    buf, r = _shifted_buffer(o, lse, shift, index, size)
    yield start.all_reduce(buf, "sum", group, level, stats)
    return _shifted_finish(buf, r, o, lse, size)


def _two_level_stages(start, o, lse, groups, stats):
    """``two_level``: ``packed`` inside each node, then across nodes; each level needs the previous
    level's result (4 dependent collectives; split, the other part's stages interleave)."""
    for lvl in groups.levels:  # innermost first
        o, lse = yield from _packed_stages(start, o, lse, lvl.group, lvl.name, stats)
    return o, lse


def _stage_count(strategy: str, groups: TreeGroups) -> int:
    """Dependent collective stages of one merge (:func:`_stages`)."""
    return {"packed": 2, "allreduce3": 2, "allgather": 1, "shifted": 1}.get(strategy, 2 * len(groups.levels))


def _stages(start, strategy: str, o, lse, groups: TreeGroups, stats, shift=None):
    if strategy == "shifted":
        return _shifted_stages(start, o, lse, shift, groups.cp_group, groups.rank, groups.size, "cp", stats)
    if strategy == "two_level":
        return _two_level_stages(start, o, lse, groups, stats)
    if strategy == "allgather":
        return _allgather_stages(start, o, lse, groups.cp_group, groups.size, "cp", stats)
    fn = {"packed": _packed_stages, "allreduce3": _allreduce3_stages}[strategy]
    return fn(start, o, lse, groups.cp_group, "cp", stats)


_MIX1, _MIX2 = -7046029254386353131, -4658895280553007687  # splitmix64's odd constants, as int64


def shift_digest(shift: torch.Tensor) -> torch.Tensor:
    """Two 24-bit words (int64, on shift's device) that differ for shifts of different values.

    shift: any shape, floating. Equal values give equal words whatever the dtype they are held in
    (each value is widened to float64, -0.0 read as 0.0, every NaN as one NaN); a value that
    differs in any bit, or values in another order, change the words except with probability
    about 2^-48. Elementwise integer ops and one integer sum (exact, wrapping, so the result does
    not depend on the reduction order): a few small kernels, no host read.
    """
    x = shift.detach().to(torch.float64).reshape(-1)
    x = x.masked_fill(torch.isnan(x), float("nan")) + 0.0
    h = x.view(torch.int64)
    h = (h ^ (h >> 31)) * _MIX1
    h = (h ^ (h >> 29)) * (torch.arange(h.numel(), device=h.device, dtype=torch.int64) * 2 + 1)
    h = h.sum()
    h = (h ^ (h >> 32)) * _MIX2
    return torch.stack([h & 0xFFFFFF, (h >> 24) & 0xFFFFFF])


def _shifted_buffer(o, lse, shift, index, size):
    """cat([w*o, w, nonempty, digests]) with w = exp(lse - r), and the shift r used (-inf -> 0).

    digests: (size, 2) zeros but this rank's row, its :func:`shift_digest` (integers below 2^24,
    exact in any float dtype): after the SUM every rank holds every rank's words, which tell
    whether the ranks' shifts are equal -- an r that differs between ranks gives a wrong result."""
    r = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # an all-empty row's -inf: any r works
    w = lse_weights(lse, r, o.dtype)
    nonempty = torch.isfinite(lse).to(o.dtype)
    digests = torch.zeros((size, 2), dtype=o.dtype, device=o.device)
    digests[index] = shift_digest(shift).to(o.dtype)
    return torch.cat([weighted(o, w).reshape(-1), w.reshape(-1), nonempty.reshape(-1), digests.reshape(-1)]), r


def _shifted_finish(buf, r, o, lse, size):
    """(out, lse, bad, digests) from the all-reduced :func:`_shifted_buffer` (see :func:`_shifted_stages`)."""
    n, k = o.numel(), lse.numel()
    num, den = buf[:n].view(o.shape), buf[n: n + k].view(lse.shape)
    count, digests = buf[n + k: n + 2 * k].view(lse.shape), buf[n + 2 * k:].view(size, 2)
    # Out of range only: a NaN den fails both comparisons and is not flagged -- it comes from a
    # NaN partial lse (exp of a finite or -inf difference is never NaN), so the row's answer is
    # NaN whatever the shift, and normalize gives NaN; redoing it with packed would change
    # nothing. A row with no key anywhere (count 0) is fine.
    bad = (count > 0) & ((den < SHIFT_MIN_DEN) | (den > SHIFT_MAX_DEN))
    out, lse = normalize(num, den, r, lse.dtype)
    return out, lse, bad, digests


def _gather_buffer(o, lse) -> torch.Tensor:
    """cat([o, lse]) in o's dtype; a float64 lse travels as its raw bytes (two fp32 words each)."""
    return torch.cat([o.reshape(-1), lse.reshape(-1).view(o.dtype)])


def _gathered_states(parts, o, lse, size):
    """The P states of an all-gathered :func:`_gather_buffer`: outs (P, *o.shape), lses (P, *lse.shape)."""
    outs = parts[:, : o.numel()].reshape(size, *o.shape)
    lses = parts[:, o.numel():].contiguous().view(lse.dtype).reshape(size, *lse.shape)
    return outs, lses


def check_shift(shift, lse_shape: tuple, device=None) -> None:
    """shift: a floating tensor of shape ``lse_shape`` (batch, nheads_q, seqlen_q) on ``device``
    (when given: the partial state's), or None."""
    if shift is None:
        return
    if not isinstance(shift, torch.Tensor) or not shift.is_floating_point():
        raise TypeError(f"shift must be a float32 tensor of shape {tuple(lse_shape)} (batch, heads_q, seqlen_q) "
                        f"or None, got {shift.dtype if isinstance(shift, torch.Tensor) else type(shift).__name__}")
    if tuple(shift.shape) != tuple(lse_shape):
        raise ValueError(f"shift must have the lse's shape {tuple(lse_shape)} (batch, heads_q, seqlen_q), "
                         f"got {tuple(shift.shape)}")
    if device is not None and shift.device != torch.device(device):
        raise ValueError(f"shift is on {shift.device}, the attention's state on {device}: pass the shift on "
                         "the device of q (the previous step's merged lse is there)")


def merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    groups: TreeGroups,
    strategy: str = "auto",
    stats: CommStats | None = None,
    *,
    dtype: torch.dtype | None = None,
    backend: str | None = None,
    shift: torch.Tensor | None = None,
    deferred: list | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge this rank's partial state with every other rank's of ``groups``; result on all ranks.

    out: (batch, seqlen_q, nheads_q, headdim_v), any float dtype (this rank's normalised partial;
        headdim_v is V's head dim, which may differ from q's and k's, as in MLA)
    lse: (batch, nheads_q, seqlen_q) natural log, -inf for an empty shard; float64 (what
        ``tree_decode`` passes) keeps the merge exact at large score magnitudes
    dtype, backend: the caller's input dtype and kernel backend (default: out's dtype, none),
        part of what every rank must agree on (:data:`MERGE_SIGNATURE`)
    shift: (batch, nheads_q, seqlen_q) float, bit-identical on every rank (``shifted``; ``None``
        makes ``shifted`` run ``packed``, and every rank must pass one or none)
    deferred: ``shifted`` only: a list that receives this call's device flag (a 0-d bool tensor,
        True when the result must be redone) instead of a host check and an immediate redo
    softmax_scale, window, softcap: the local attention's settings that made this partial (the
        scale resolved: the factor the scores were multiplied by, never ``None`` for "the
        default"; ``tree_decode`` passes them), part of what every rank must agree on; ``None``
        (the default) where the caller does not say
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input),
            lse: (batch, nheads_q, seqlen_q) in the wider of lse's dtype and out's; every rank of
            the CP group gets the same.

    Ranks that disagree on the signature (:data:`MERGE_SIGNATURE`: batch, seqlen_q, heads_q,
    headdim_v, dtype, strategy, backend, whether a shift is given, softmax_scale, window and
    softcap) raise :class:`DisagreementError` on every rank, naming each rank's values
    (checked when this rank's signature differs from its previous merge on ``groups``: no
    extra collective or host sync in steady state; see :class:`agreement.Agreement`).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    if out.dim() != 4 or tuple(lse.shape) != (out.shape[0], out.shape[2], out.shape[1]):
        raise ValueError(
            f"merge expects out (batch, seqlen_q, heads_q, headdim) and lse (batch, heads_q, seqlen_q), "
            f"got {tuple(out.shape)} and {tuple(lse.shape)}"
        )
    if torch.compiler.is_compiling() and groups.size > 1:  # traced: the collectives as one opaque op
        return _traced_merge(out, lse, groups, strategy, stats, dtype, backend, shift, deferred,
                             softmax_scale, window, softcap)
    o, lse = _widened(out, lse, acc_dtype(out.dtype))
    check_shift(shift, tuple(lse.shape), o.device)
    if isinstance(stats, collectives.StatsSlot):  # a compiled step's slot (one rank: nothing traced to record)
        stats = None if torch.compiler.is_compiling() else stats.target
    if stats is not None:
        stats.calls += 1
    if groups.size == 1:
        return o, lse
    strategy = _resolve(strategy, groups, tuple(out.shape), o.element_size(), shift)
    b, sq, hq, d = out.shape
    signature = (b, sq, hq, d, out.dtype if dtype is None else dtype, strategy, backend,
                 shift is not None and strategy == "shifted", *_settings(softmax_scale, window, softcap))
    with groups.agreement.call("merge", MERGE_SIGNATURE, signature):
        if o.numel() == 0 or lse.numel() == 0:  # no rows (B = 0), heads or queries: nothing to merge
            return o, lse
        result = _run(_stages(_SYNC, strategy, o, lse, groups, stats, shift))
        if strategy == "shifted":
            result = _settle_shifted(result, o, lse, groups, stats, deferred)
        # the collectives record no gradient: a backward through the merge raises rather than drop the peers' part
        return no_backward("the CP merge", result, (out, lse))


# --------------------------------------------------------------------------- the merge in a traced step
#
# A step compiled with torch.compile (fullgraph) or captured in a CUDA graph holds each layer's
# merge as one node of ``megatron_tree::cp_merge``: Dynamo does not trace the collectives, the
# agreement check or the error handling inside it (host Python a graph cannot hold), and the
# op's eager body is :func:`merge` itself, so a compiled step issues exactly the collectives of
# an eager one. The op names its groups (and the CommStats it records into) by a string, looked up
# in a table of weak references (``collectives.by_op_name``) that every TreeGroups and CommStats
# joins when it is made.


class CompileError(ValueError):
    """A merge setting that a compiled or graph-captured step cannot hold (it names the setting)."""


def _op_names(groups: TreeGroups, stats) -> str:
    """``"<groups>|<stats>"``: the names the traced op finds its groups and stats by (given to both
    at construction: read here, they are constants of the traced step)."""
    return f"{groups.op_name}|{'' if stats is None else stats.op_name}"


def _traced_merge(out, lse, groups, strategy, stats, dtype, backend, shift, deferred, softmax_scale, window,
                  softcap):
    if shift is not None or deferred is not None or strategy == "shifted":
        raise CompileError(
            "strategy='shifted' carries every layer's merged lse from one step to the next in host state and "
            "is redone from the host when a flag is raised: a compiled or graph-captured step cannot hold it; "
            "use strategy='packed', 'two_level', 'allgather', 'allreduce3' or 'auto'"
        )
    merged = torch.ops.megatron_tree.cp_merge(out, lse, _op_names(groups, stats), strategy,
                                              out.dtype if dtype is None else dtype, backend or "",
                                              softmax_scale, window, softcap)
    return no_backward("the CP merge", merged, (out, lse))


# The attention settings the partials were made with travel as the op's own typed arguments, at the end
# with defaults (calls that name the first six stay valid), typed as ``megatron_tree::flash_decode`` takes the
# same three from the same call: a graph shows each setting as it is, opcheck's schema test covers them, and
# the eager body hands them to merge's agreement check with no parsing (one string encoding all three would
# be formatted while tracing and parsed back on every call). Dynamo specializes a float or int argument of an
# op to its value (a literal in the graph, guarded like the flash_decode op's same values beside it), and a
# step's settings are constants (a module's attribute, a config value, 1/sqrt(d) of a static head dim): the
# same literal every step, so no step's guard fails on them and no recompilation follows.
torch.library.define("megatron_tree::cp_merge",
                     "(Tensor out, Tensor lse, str names, str strategy, ScalarType dtype, str backend, "
                     "float? softmax_scale=None, SymInt? window=None, float? softcap=None) -> (Tensor, Tensor)")


def _cp_merge_impl(out, lse, names, strategy, dtype, backend, softmax_scale=None, window=None, softcap=None):
    group_name, stats_name = names.split("|")
    groups = collectives.by_op_name(group_name)
    if groups is None:
        raise RuntimeError(f"the compiled step's CP group {group_name!r} no longer exists (its TreeGroups was "
                           "freed): compile the step again for the groups it runs on")
    stats = collectives.by_op_name(stats_name) if stats_name else None
    if isinstance(stats, collectives.StatsSlot):  # a compiled step's: this step's CommStats, or none
        stats = stats.target
    o, l = merge(out, lse, groups, strategy, stats, dtype=dtype, backend=backend or None,
                 softmax_scale=softmax_scale, window=window, softcap=softcap)
    # (an op may not return its inputs: a merge with nothing to merge hands back the widened partials)
    return (o.clone() if o.data_ptr() == out.data_ptr() else o), (l.clone() if l.data_ptr() == lse.data_ptr() else l)


@torch.library.register_fake("megatron_tree::cp_merge")
def _cp_merge_fake(out, lse, names, strategy, dtype, backend, softmax_scale=None, window=None, softcap=None):
    acc = acc_dtype(out.dtype)
    return out.new_empty(out.shape, dtype=acc), lse.new_empty(lse.shape, dtype=torch.promote_types(lse.dtype, acc))


torch.library.impl("megatron_tree::cp_merge", "CompositeExplicitAutograd", _cp_merge_impl)


def _settings(softmax_scale, window, softcap) -> tuple:
    """The attention settings as the signature holds them: floats as floats and the window as an int
    (``1`` and ``1.0``, or a numpy scalar and its Python twin, are one setting and print alike), ``None``
    kept."""
    return (None if softmax_scale is None else float(softmax_scale), None if window is None else int(window),
            None if softcap is None else float(softcap))


def _widened(o, lse, acc: torch.dtype):
    """A partial state as the merges take it: o in ``acc``, lse in the wider of its dtype and ``acc``."""
    return o.to(acc), lse.to(torch.promote_types(lse.dtype, acc))


def _resolve(strategy: str, groups: TreeGroups, out_shape: tuple, element_size: int, shift) -> str:
    """The strategy a merge runs: ``auto`` priced by :func:`cost.choose_strategy` (``shifted`` a
    candidate only with a shift), and ``shifted`` without a shift -- a first call, nothing to
    shift by yet -- as ``packed``."""
    if strategy == "auto":
        strategy = choose_strategy(groups, out_shape, element_size, shifted=shift is not None)
    return "packed" if strategy == "shifted" and shift is None else strategy


def _settle_shifted(result, o, lse, groups: TreeGroups, stats, deferred):
    """A ``shifted`` merge's (out, lse), or ``packed``'s when its check failed.

    result: (out, lse, bad, digests) of :func:`_shifted_finish`; o, lse: the partial state it
    merged. With ``deferred`` (a list) the call's flag -- raised also when the ranks' shifts
    differ -- is appended to it on the device and the result returned as it is (the caller
    redoes the step with ``packed``, which needs no shift: exact again); else the flags are read
    on the host -- the same bits on every rank, so all ranks redo with MAX + SUM or none does,
    and shifts that differ are a :class:`DisagreementError` on every rank, naming each rank's
    digest (the same text everywhere: every rank holds every rank's words).
    """
    res_o, res_lse, bad, digests = result
    differ = (digests != digests[0]).any()
    if deferred is not None:
        deferred.append(bad.any() | differ)
        return res_o, res_lse
    redo, differ = torch.stack([bad.any(), differ]).tolist()
    if differ:
        words = digests.to(torch.int64).tolist()
        table = {r: {"shift (a digest of its values)": "".join(f"{w:06x}" for w in row)}
                 for r, row in zip(groups.cp_ranks, words)}
        raise disagreement("merge", table)
    if not redo:
        return res_o, res_lse
    if stats is not None:
        stats.fallbacks += 1
    return _run(_packed_stages(_SYNC, o, lse, groups.cp_group, "cp", stats))


# --------------------------------------------------------------------------- overlapped merge

"""Strategies :func:`merge_overlapped` runs in stages (every collective asynchronous)."""

SPLIT_SIGNATURE = ("batch", "seqlen_q", "heads_q", "headdim_v", "dtype", "strategy", "backend", "shift",
                   "softmax_scale", "window", "softcap", "split")
"""An overlapped merge's signature at the ``merge`` site: :data:`MERGE_SIGNATURE`'s names plus the parts'
batch sizes, so a rank that splits and one that does not (or splits differently) get a
:class:`DisagreementError`. Spelled out rather than derived, so a name added to ``MERGE_SIGNATURE`` for
another strategy cannot shift the labels of these values."""


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
    shift: torch.Tensor | None = None,
    deferred: list | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention and merge of a batch in parts, each part's merge in flight while the next part's local runs.

    local: ``local(part) -> (out, lse)``, this rank's partial state of the batch rows ``part``
        (a slice), computed when called: out (rows, seqlen_q, nheads_q, headdim), lse
        (rows, nheads_q, seqlen_q) natural log, -inf for an empty shard
    parts: slices that tile ``range(batch)`` in order (e.g. two halves)
    out_shape: (batch, seqlen_q, nheads_q, headdim) of the whole batch
    strategy: one of :data:`STRATEGIES`; dtype: the caller's input dtype (default float32);
        backend: the kernel backend (both part of what every rank must agree on)
    shift, deferred: as for :func:`merge` (``shifted``): shift (batch, nheads_q, seqlen_q) for the
        whole batch, each part weighted by its rows; when any part's check fails the whole
        call is redone with ``packed`` (at once, or by the caller with ``deferred``)
    softmax_scale, window, softcap: the settings ``local`` computes with, as for :func:`merge`
        (part of what every rank must agree on)
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input),
            lse: (batch, nheads_q, seqlen_q) in the wider of the partial lse's dtype and out's
            (float64 from ``tree_decode``) -- what :func:`merge` returns for the whole batch: every row goes through the same operations (the sums' rounding can
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
    if strategy not in STRATEGIES:
        raise ValueError(f"an overlapped merge supports the strategies {STRATEGIES}, got {strategy!r}")
    b, sq, hq, d = (int(x) for x in out_shape)
    check_shift(shift, (b, hq, sq))
    rows = [range(b)[p] for p in parts]
    if [i for r in rows for i in r] != list(range(b)) or any(len(r) == 0 for r in rows):
        raise ValueError(f"parts must tile range({b}) in order with no empty part, got {parts}")
    sizes = tuple(len(r) for r in rows)
    dtype = torch.float32 if dtype is None else dtype
    acc = acc_dtype(dtype)
    if stats is not None:
        stats.calls += 1
    if groups.size == 1:
        states = [_widened(*local(p), acc) for p in parts]
        return torch.cat([o for o, _ in states]), torch.cat([l for _, l in states])
    # auto prices every part as the largest one, so all parts run one strategy
    strategy = _resolve(strategy, groups, (max(sizes), sq, hq, d), acc.itemsize, shift)
    signature = (b, sq, hq, d, dtype, strategy, backend, shift is not None and strategy == "shifted",
                 *_settings(softmax_scale, window, softcap), sizes)
    with groups.agreement.call("merge", SPLIT_SIGNATURE, signature):
        n = _stage_count(strategy, groups)
        flights, states = [], []
        for p in parts:
            o, lse = _widened(*local(p), acc)
            states.append((o, lse))
            flight = _InFlight(_stages(_ASYNC, strategy, o, lse, groups, stats, None if shift is None else shift[p]))
            while flight.started < n:
                flight.advance()
            flights.append(flight)
        for flight in flights:
            flight.advance()
        out, lse = torch.cat([f.result[0] for f in flights]), torch.cat([f.result[1] for f in flights])
        if strategy != "shifted":
            return out, lse
        bad = torch.cat([f.result[2] for f in flights])
        digests = torch.cat([f.result[3] for f in flights], dim=1)  # each part's words, side by side
        # the redo, when one is needed, merges the whole batch at once (not overlapped: it is rare)
        whole = torch.cat([o for o, _ in states]), torch.cat([l for _, l in states])
        return _settle_shifted((out, lse, bad, digests), *whole, groups, stats, deferred)
