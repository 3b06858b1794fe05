"""One set of collective helpers: every collective the library issues, its failures and its traffic.

Invariant: every collective the library issues goes through a helper here. A helper that
fails -- a peer died, is stuck past the group's timeout, or is waiting in a different call
-- raises :class:`CommError` naming the operation, the level, the number of ranks, the
timeout and what most likely happened, never a raw backend error; and its traffic is
recorded into a :class:`CommStats` when one is given, so counts and bytes are read, not
assumed.

Why it lives here, below ``topology``: building ``TreeGroups`` exchanges topology facts
(host names, launcher variables) before any CP group exists, and ``comm``'s merges need the
same helpers. So this module imports nothing from the package, takes every process group
as an argument (no module global ever *supplies* a group; docs/design.md, "How the code is written") and keeps no
state. The cross-rank agreement check that guards the calls built on these helpers is
:mod:`megatron_tree.distributed.agreement`, one step above.

Helpers (``group`` is a process group, ranks are global ranks, ``level`` names the level in
stats and messages, ``what`` says what the caller was doing)::

    all_reduce(t, group, op="sum"|"max"|"min")      # in place, returns t
    all_gather(t, group, out=None)                  # (P, *t.shape), group-rank order
    broadcast(t, src, group)                        # in place from global rank src
    p2p(sends, recvs, group).wait()                 # one batch of isend/irecv (NCCL-safe ring)
    all_reduce_async(t, group, op=...).wait()       # all_reduce started now, finished (and recorded) at wait
    all_gather_async(t, group, out=...).wait()      # all_gather likewise
    exchange_objects(obj, group)                    # every rank's picklable obj, in rank order

Traffic model (the one the paper's formula uses, from this rank's point of view): an
all-reduce of n bytes over P ranks sends 2(P-1)/P * n, an all-gather of n bytes per rank
sends (P-1) * n, a point-to-point message of n bytes sends n, a broadcast sends n from its
root (0 elsewhere). Object exchanges are bookkeeping and are not recorded.
"""

from __future__ import annotations

import datetime
import itertools
import math
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from . import liveness, shm

__all__ = [
    "CommError", "DisagreementError", "CommStats", "LevelStats", "DEFAULT_TIMEOUT", "group_timeout",
    "as_timedelta", "new_group", "barrier", "all_reduce", "all_gather", "broadcast", "p2p", "Pending",
    "all_reduce_async", "all_gather_async",
    "exchange_objects", "peer_gone",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""Collective timeout used when a group's own cannot be read (a backend that does not expose it)."""


class CommError(RuntimeError):
    """A collective failed: a peer died, timed out, or is waiting in a different collective.

    ``cause``: ``"closed"`` (a peer's connection closed: it died), ``"timeout"``, or ``"other"``.
    """

    cause = "other"


class DisagreementError(CommError):
    """Ranks of one group made the same call with different arguments (shapes, dtype, strategy, ...).

    Raised by :mod:`megatron_tree.distributed.agreement` (defined here, beside :class:`CommError`, so that the
    helpers' callers see one family of errors).

    ``site`` names the call, ``table`` maps each global rank to its ``{field: value}``. The
    message lists every rank's value of every field that differs and is the same on every rank.
    """

    def __init__(self, message: str, site: str = "", table: dict | None = None):
        super().__init__(message)
        self.site = site
        self.table = table or {}


# --------------------------------------------------------------------------- accounting


_OP_NAMES = itertools.count()
_BY_OP_NAME: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def give_op_name(obj) -> str:
    """Name ``obj`` (a :class:`TreeGroups` or :class:`CommStats`) for custom ops, which take strings,
    not Python objects: a compiled step passes the name, the op's eager body finds the object again
    with :func:`by_op_name`. Given once, at construction, so that tracing a step only reads an
    attribute (no marker from ``torch._dynamo``, whose import costs a second in every process)."""
    name = f"{type(obj).__name__}-{next(_OP_NAMES)}"
    object.__setattr__(obj, "op_name", name)  # (TreeGroups is frozen)
    _BY_OP_NAME[name] = obj
    return name


def by_op_name(name: str):
    """The live object :func:`give_op_name` named ``name``, or ``None`` once it was freed."""
    return _BY_OP_NAME.get(name)


class StatsSlot:
    """A stand-in for the :class:`CommStats` of a compiled step: the same object at every step, so a traced
    step holds its name as a constant, while ``target`` -- the step's own ``CommStats`` -- changes from step
    to step (a new ``CommStats`` per eval run would otherwise be a new constant: a new trace every time).
    Whoever calls the compiled step sets ``target`` around the call; the traced merge op's eager body
    records into it (``comm.merge``)."""

    def __init__(self):
        self.target: "CommStats | None" = None
        give_op_name(self)


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
    """Collectives issued, by name (``all_reduce_max``, ``all_reduce_sum``, ``all_gather``, ``send``, ...)."""


@dataclass
class CommStats:
    """Per-level accounting of traffic; pass one to ``tree_decode``/``merge``/prefill to fill it."""

    calls: int = 0
    """Merge calls recorded."""
    fallbacks: int = 0
    """``shifted`` merges whose check failed and that were redone with MAX + SUM (deferred ones
    are counted when the decode loop reads the step's flags)."""
    levels: dict = field(default_factory=dict)
    """Level name (``cp``, ``intra``, ``inter``) -> :class:`LevelStats`."""

    def __post_init__(self):
        give_op_name(self)

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
        self.fallbacks = 0
        self.levels.clear()

    def add(self, other: CommStats) -> None:
        """Add ``other``'s counts to these (a captured step's traffic, replayed: ``forward.CompiledSteps``)."""
        self.calls += other.calls
        self.fallbacks += other.fallbacks
        for level, theirs in other.levels.items():
            mine = self.levels.setdefault(level, LevelStats())
            mine.collectives += theirs.collectives
            mine.payload_bytes += theirs.payload_bytes
            mine.sent_bytes += theirs.sent_bytes
            for op, n in theirs.ops.items():
                mine.ops[op] = mine.ops.get(op, 0) + n

    def as_dict(self) -> dict:
        return {
            "calls": self.calls,
            "fallbacks": self.fallbacks,
            "levels": {
                k: {"collectives": v.collectives, "payload_bytes": v.payload_bytes,
                    "sent_bytes": v.sent_bytes, "ops": dict(v.ops)}
                for k, v in self.levels.items()
            },
        }


# --------------------------------------------------------------------------- groups and timeouts


def as_timedelta(timeout) -> datetime.timedelta | None:
    """``None``, seconds (int/float) or a ``timedelta`` -> ``timedelta`` (or ``None``); > 0 required.

    Anything else -- a bool, NaN, an infinity, text that is not a number -- is a ``ValueError`` or
    ``TypeError`` naming the timeout (never ``OverflowError``: :meth:`TreeGroups.build` turns these two
    into the same error on every rank, so one rank's bad timeout cannot leave the others waiting)."""
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        td = timeout
    else:
        if isinstance(timeout, bool):
            raise TypeError(f"a collective timeout must be a number of seconds or a timedelta, got the bool "
                            f"{timeout!r}")
        try:
            seconds = float(timeout)
        except (TypeError, ValueError):
            raise TypeError(f"a collective timeout must be a number of seconds or a timedelta, got "
                            f"{type(timeout).__name__} {timeout!r}") from None
        if not math.isfinite(seconds):
            raise ValueError(f"a collective timeout must be a finite positive number of seconds, got {timeout!r}")
        try:
            td = datetime.timedelta(seconds=seconds)
        except OverflowError:
            raise ValueError(f"a collective timeout must be at most {datetime.timedelta.max.total_seconds():g} "
                             f"seconds (timedelta's range), got {timeout!r}") from None
    if td.total_seconds() <= 0:
        raise ValueError(f"a collective timeout must be positive, got {timeout!r}")
    return td


def group_timeout(group=None) -> datetime.timedelta:
    """The collective timeout ``group`` (default: the default group) was created with.

    torch exposes it only on the backend's options; when those cannot be read (another
    backend, another torch) this returns :data:`DEFAULT_TIMEOUT`, never "no timeout".
    """
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            value = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 -- no backend for that device, or no options exposed
            continue
        if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
            return value
    return DEFAULT_TIMEOUT


def new_group(ranks: Sequence[int], *, timeout, backend: str | None = None, local: bool = False):
    """``dist.new_group`` that always has a finite timeout (torch's default for ``None`` is 30 minutes).

    local: only the members call it (``use_local_synchronization``; torch then names the group
    from each rank's count of groups it knows, so the members must have made equally many);
    otherwise every rank of the default group must call it, in the same order.
    """
    td = as_timedelta(timeout)
    if td is None:
        raise ValueError("new_group needs a timeout; pass group_timeout() to inherit the default group's")
    kwargs = {"timeout": td, "backend": backend}
    if local:
        kwargs["use_local_synchronization"] = True
    return dist.new_group(list(ranks), **kwargs)


def _seconds(td: datetime.timedelta) -> str:
    s = td.total_seconds()
    return f"{s:g} s" if s < 120 else f"{s / 60:g} min"


def _failure(what: str, op: str, level: str, group, err: BaseException) -> CommError:
    """The CommError for a failed collective: what, where, how many ranks, the timeout, the likely cause."""
    try:
        size = dist.get_world_size(group)
        timeout = _seconds(group_timeout(group))
    except Exception:  # noqa: BLE001 -- a group torn down under us: still report the failure
        size, timeout = "?", "?"
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    low = str(err).lower()
    closed = any(s in low for s in ("closed", "reset by peer", "broken pipe", "crash"))
    dead = _exited_in(group, settle=1.0 if closed else 0.0)
    if dead:  # the liveness records say who: name the rank, whatever the backend's words
        kind, cause = "closed", liveness.describe(dead)
        liveness.note_failure(dead)
    elif "timed out" in low or "timeout" in low:
        kind, cause = "timeout", (f"no answer within the group's timeout of {timeout}: a peer is stuck, died, or "
                                  "is waiting in a different collective (ranks that disagree on what to call)")
    elif closed:
        # a peer that gave up on its own timeout closes its connections too: under load the
        # slowest ranks see "closed" from the first rank to time out rather than their own timeout
        kind, cause = "closed", (f"a peer's connection closed: it most likely died, or gave up first on its own "
                                 f"timeout of {timeout} (see that rank's log)")
    else:
        kind, cause = "other", f"the backend reported an error (the group's timeout is {timeout})"
    error = CommError(
        f"{what}: {op} over the {level!r} level ({size} ranks) failed; a peer rank may have died or "
        f"timed out -- {cause}. Backend error: {text}"
    )
    error.cause = kind
    return error


def _exited_in(group, settle: float = 0.0) -> dict:
    """The ranks of ``group`` whose process has certainly exited (:func:`liveness.exited`), or {}.

    settle: seconds to keep probing when none is found yet (a peer's connection closes while its
    process is still tearing down, a few milliseconds before the system shows it gone).
    """
    try:
        ranks = list(dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size()))
        deadline = time.monotonic() + settle
        while True:
            dead = liveness.exited(ranks)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(liveness.POLL_S)
    except Exception:  # noqa: BLE001 -- a group torn down under us: the backend's words alone
        return {}


def peer_gone(what: str, found: dict, err: BaseException | None = None) -> CommError:
    """The CommError for peers known to be gone (``found``: :func:`liveness.gone`), naming each rank.

    Leaves a notice in the store (:func:`liveness.note_failure`), so a rank that probes later names
    the peer that went first, not this rank once it has exited on this error."""
    liveness.note_failure(found)
    text = ""
    if err is not None:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        text = f" Error seen: {first}"
    error = CommError(f"{what}: {liveness.describe(found)}; the others cannot go on without it (restart, or build "
                      f"new groups without it).{text}")
    error.cause = "closed"
    return error


# --------------------------------------------------------------------------- collectives

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _channel_for(group, tensor: torch.Tensor):
    """The shared-memory channel that carries ``tensor``'s collective on ``group`` (``shm.attach`` gave the
    group one and the tensor fits a slot), else None: the backend carries it."""
    channel = shm.channel_of(group)
    return channel if channel is not None and channel.fits(tensor) else None


def _on_channel(run, args: tuple, what: str, op: str, level: str, group) -> None:
    """A collective on a group's shared-memory channel (``shm``), its failures worded as the backend's are
    (:func:`_failure`'s form: the operation, the level, the ranks, what most likely happened)."""
    try:
        run(*args)
        return
    except shm.ChannelMismatch as e:
        raise DisagreementError(str(e)) from None
    except liveness.PeerGone as e:
        liveness.note_failure(e.gone)
        cause, kind, text = liveness.describe(e.gone), "closed", "a peer's process exited (shared memory)"
    except shm.ChannelTimeout as e:
        cause = (f"no answer within the group's timeout of {_seconds(group_timeout(group))}: a peer is stuck, died, "
                 "or is waiting in a different collective (ranks that disagree on what to call)")
        kind, text = "timeout", str(e)
    error = CommError(f"{what}: {op} over the {level!r} level ({dist.get_world_size(group)} ranks) failed; a peer "
                      f"rank may have died or timed out -- {cause}. Backend error: {text}")
    error.cause = kind
    raise error


def all_reduce(tensor: torch.Tensor, group, *, op: str = "sum", level: str = "cp",
               stats: CommStats | None = None, what: str = "all_reduce") -> torch.Tensor:
    """Element-wise ``op`` over every rank of ``group``, in place; returns ``tensor``.

    tensor: any shape and dtype, the same on every rank (contiguous). Recorded as
    ``all_reduce_<op>``.
    """
    channel = _channel_for(group, tensor)
    if channel is not None:
        _on_channel(channel.all_reduce, (tensor, op, what), what, f"all_reduce({op.upper()})", level, group)
    else:
        try:
            dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group)
        except RuntimeError as e:  # DistBackendError, DistError and gloo's errors are RuntimeErrors
            raise _failure(what, f"all_reduce({op.upper()})", level, group, e) from e
    if stats is not None:
        stats.record_all_reduce(level, f"all_reduce_{op}", _nbytes(tensor), dist.get_world_size(group))
    return tensor


def all_gather(tensor: torch.Tensor, group, *, out: torch.Tensor | None = None, level: str = "cp",
               stats: CommStats | None = None, what: str = "all_gather") -> torch.Tensor:
    """Every rank's ``tensor`` in group-rank order.

    tensor: any shape, the same on every rank. out: optional (P, *tensor.shape) buffer to
    fill (reused workspaces). returns out: (P, *tensor.shape).
    """
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    if out is None:
        out = tensor.new_empty((size, *tensor.shape))
    channel = _channel_for(group, tensor)
    if channel is not None:
        _on_channel(channel.all_gather, (tensor, out, what), what, "all_gather", level, group)
    else:
        try:
            dist.all_gather(list(out.unbind(0)), tensor, group=group)
        except RuntimeError as e:
            raise _failure(what, "all_gather", level, group, e) from e
    if stats is not None:
        n = _nbytes(tensor)
        stats.record(level, "all_gather", n, (size - 1) * n)
    return out


def broadcast(tensor: torch.Tensor, src: int, group, *, level: str = "cp", stats: CommStats | None = None,
              what: str = "broadcast") -> torch.Tensor:
    """``tensor`` of global rank ``src`` on every rank of ``group``, in place; returns ``tensor``.

    On a group with a shared-memory channel (and a tensor that fits its slot) the channel carries it:
    a token choice or a random state each decode step, where gloo's broadcast waits ~1-2 ms for thread
    wake-ups."""
    channel = _channel_for(group, tensor)
    if channel is not None:
        _on_channel(channel.broadcast, (tensor, channel.ranks.index(src), what), what, f"broadcast from rank {src}",
                    level, group)
    else:
        try:
            dist.broadcast(tensor, src=src, group=group)
        except RuntimeError as e:
            raise _failure(what, f"broadcast from rank {src}", level, group, e) from e
    if stats is not None:
        n = _nbytes(tensor)
        stats.record(level, "broadcast", n, n if dist.get_rank() == src else 0)
    return tensor


def barrier(group, *, level: str = "cp", what: str = "barrier") -> None:
    """``torch.distributed.barrier`` on ``group`` (through the backend, not recorded), its failure a
    :class:`CommError` worded as every collective's here: a peer that exited is named, not gloo's
    "Connection reset by peer" or "Timed out waiting ... for recv" alone."""
    try:
        dist.barrier(group=group)
    except RuntimeError as e:
        raise _failure(what, "barrier", level, group, e) from e


class Pending:
    """Posted collectives or point-to-point messages; :meth:`wait` completes them or raises :class:`CommError`.

    op: the operation's name in a failure's message; on_done: called once, after the first
    successful :meth:`wait` (an asynchronous collective records its traffic there).
    """

    def __init__(self, works, what: str, level: str, group, *, op: str = "send/recv", on_done=None):
        self._works, self._what, self._level, self._group = works, what, level, group
        self._op, self._on_done = op, on_done

    def wait(self) -> None:
        try:
            for w in self._works:
                w.wait()
        except RuntimeError as e:
            raise _failure(self._what, self._op, self._level, self._group, e) from e
        self._works = []
        done, self._on_done = self._on_done, None
        if done is not None:
            done()


def p2p(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]], group, *,
        level: str = "cp", stats: CommStats | None = None, what: str = "send/recv", op: str = "send") -> Pending:
    """Post ``sends`` [(tensor, dst global rank)] and ``recvs`` [(buffer, src global rank)] as one batch.

    One ``batch_isend_irecv`` (a ring of separate blocking pairs deadlocks on NCCL). Messages
    between one pair of ranks match in order, so receive buffers must be listed in the order
    the peer sends. Each send is recorded as one ``op`` of its bytes. Returns a
    :class:`Pending`; call its ``wait()`` before reading the receive buffers.
    """
    p2p_ops = [dist.P2POp(dist.isend, t.contiguous(), dst, group) for t, dst in sends]
    p2p_ops += [dist.P2POp(dist.irecv, t, src, group) for t, src in recvs]
    try:
        works = dist.batch_isend_irecv(p2p_ops) if p2p_ops else []
    except RuntimeError as e:
        raise _failure(what, "posting send/recv", level, group, e) from e
    if stats is not None:
        for t, _ in sends:
            stats.record(level, op, _nbytes(t), _nbytes(t))
    return Pending(works, what, level, group)


def all_reduce_async(tensor: torch.Tensor, group, *, op: str = "sum", level: str = "cp",
                     stats: CommStats | None = None, what: str = "all_reduce") -> Pending:
    """Start :func:`all_reduce` of ``tensor`` and return at once; read ``tensor`` after ``wait()``.

    tensor: any shape and dtype, the same on every rank (contiguous), reduced in place.
    Ranks must start their asynchronous collectives on one group in the same order. The
    :class:`Pending`'s ``wait()`` raises :class:`CommError` on failure and records
    ``all_reduce_<op>`` into ``stats`` once it succeeds. On NCCL ``wait()`` makes the current
    stream wait for the collective (no host block); on gloo a worker thread runs it meanwhile.
    """
    name = f"all_reduce({op.upper()})"
    if _channel_for(group, tensor) is not None:  # completes here (no thread)
        all_reduce(tensor, group, op=op, level=level, stats=stats, what=what)
        return Pending([], what, level, group, op=name)
    try:
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=True)
    except RuntimeError as e:
        raise _failure(what, name, level, group, e) from e
    done = None
    if stats is not None:
        nbytes, size = _nbytes(tensor), dist.get_world_size(group)
        done = lambda: stats.record_all_reduce(level, f"all_reduce_{op}", nbytes, size)  # noqa: E731
    return Pending([work], what, level, group, op=name, on_done=done)


def all_gather_async(tensor: torch.Tensor, group, *, out: torch.Tensor, level: str = "cp",
                     stats: CommStats | None = None, what: str = "all_gather") -> Pending:
    """Start :func:`all_gather` of ``tensor`` into ``out`` and return at once; read ``out`` after ``wait()``.

    tensor: any shape, the same on every rank (contiguous); out: (P, *tensor.shape), filled in
    group-rank order. Failures and recording as in :func:`all_reduce_async`.
    """
    size = dist.get_world_size(group)
    tensor = tensor.contiguous()
    if _channel_for(group, tensor) is not None:  # completes here (no thread)
        all_gather(tensor, group, out=out, level=level, stats=stats, what=what)
        return Pending([], what, level, group, op="all_gather")
    try:
        work = dist.all_gather(list(out.unbind(0)), tensor, group=group, async_op=True)
    except RuntimeError as e:
        raise _failure(what, "all_gather", level, group, e) from e
    done = None
    if stats is not None:
        n = _nbytes(tensor)
        done = lambda: stats.record(level, "all_gather", n, (size - 1) * n)  # noqa: E731
    return Pending([work], what, level, group, op="all_gather", on_done=done)


def exchange_objects(obj, group=None, *, what: str = "exchange") -> list:
    """Every rank's picklable ``obj``, in group-rank order (``all_gather_object``; once-off bookkeeping)."""
    size = dist.get_world_size(group)
    out: list = [None] * size
    try:
        dist.all_gather_object(out, obj, group=group)
    except RuntimeError as e:
        raise _failure(what, "all_gather_object", "world" if group is None else "group", group, e) from e
    return out
