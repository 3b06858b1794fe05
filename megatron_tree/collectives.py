"""One set of collective helpers, and the cross-rank agreement check that guards them.

Invariant: every collective the library issues goes through a helper here. A helper that
fails -- a peer died, is stuck past the group's timeout, or is waiting in a different call
-- raises :class:`CommError` naming the operation, the level, the number of ranks, the
timeout and what most likely happened, never a raw backend error; and its traffic is
recorded into a :class:`CommStats` when one is given, so counts and bytes are read, not
assumed.

Why it lives here, below ``topology``: building ``TreeGroups`` exchanges topology facts
(host names, launcher variables) before any CP group exists, and ``comm``'s merges need the
same helpers. So this module imports nothing from the package and takes every process group
as an argument (no module global ever *supplies* a group; STYLE.md rule 4). The one module
state is :func:`agreement_for`'s cache, keyed by the CP group the caller passes: every
``TreeGroups`` that wraps one CP group (Megatron builds one per layer) shares one
:class:`Agreement`.

Helpers (``group`` is a process group, ranks are global ranks, ``level`` names the level in
stats and messages, ``what`` says what the caller was doing)::

    all_reduce(t, group, op="sum"|"max"|"min")      # in place, returns t
    all_gather(t, group, out=None)                  # (P, *t.shape), group-rank order
    broadcast(t, src, group)                        # in place from global rank src
    p2p(sends, recvs, group).wait()                 # one batch of isend/irecv (NCCL-safe ring)
    all_reduce_async(t, group, op=...).wait()       # all_reduce started now, finished (and recorded) at wait
    all_gather_async(t, group, out=...).wait()      # all_gather likewise
    exchange_objects(obj, group)                    # every rank's picklable obj, in rank order
    agree_values(site, names, values, group, ranks) # equal values on every rank, or a DisagreementError

Traffic model (the one the paper's formula uses, from this rank's point of view): an
all-reduce of n bytes over P ranks sends 2(P-1)/P * n, an all-gather of n bytes per rank
sends (P-1) * n, a point-to-point message of n bytes sends n, a broadcast sends n from its
root (0 elsewhere). Object exchanges are bookkeeping and are not recorded.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "CommError", "DisagreementError", "CommStats", "LevelStats", "DEFAULT_TIMEOUT", "group_timeout",
    "as_timedelta", "new_group", "all_reduce", "all_gather", "broadcast", "p2p", "Pending",
    "all_reduce_async", "all_gather_async",
    "exchange_objects", "Agreement", "agreement_for", "disagreement", "agree_values",
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

    ``site`` names the call, ``table`` maps each global rank to its ``{field: value}``. The
    message lists every rank's value of every field that differs and is the same on every rank.
    """

    def __init__(self, message: str, site: str = "", table: dict | None = None):
        super().__init__(message)
        self.site = site
        self.table = table or {}


# --------------------------------------------------------------------------- accounting


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
    """``None``, seconds (int/float) or a ``timedelta`` -> ``timedelta`` (or ``None``); > 0 required."""
    if timeout is None:
        return None
    td = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=float(timeout))
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
    if "timed out" in low or "timeout" in low:
        kind, cause = "timeout", (f"no answer within the group's timeout of {timeout}: a peer is stuck, died, or "
                                  "is waiting in a different collective (ranks that disagree on what to call)")
    elif any(s in low for s in ("closed", "reset by peer", "broken pipe", "crash")):
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


# --------------------------------------------------------------------------- collectives

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group, *, op: str = "sum", level: str = "cp",
               stats: CommStats | None = None, what: str = "all_reduce") -> torch.Tensor:
    """Element-wise ``op`` over every rank of ``group``, in place; returns ``tensor``.

    tensor: any shape and dtype, the same on every rank (contiguous). Recorded as
    ``all_reduce_<op>``.
    """
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
    """``tensor`` of global rank ``src`` on every rank of ``group``, in place; returns ``tensor``."""
    try:
        dist.broadcast(tensor, src=src, group=group)
    except RuntimeError as e:
        raise _failure(what, f"broadcast from rank {src}", level, group, e) from e
    if stats is not None:
        n = _nbytes(tensor)
        stats.record(level, "broadcast", n, n if dist.get_rank() == src else 0)
    return tensor


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


# --------------------------------------------------------------------------- cross-rank agreement


def _plain(value):
    """A value as it travels and prints: torch dtypes as their names, tuples kept."""
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def disagreement(site: str, table: dict[int, dict], waiting: Sequence[int] = ()) -> DisagreementError | None:
    """The :class:`DisagreementError` for per-rank fields ``table`` (rank -> {field: value}), or ``None``.

    The message names, for every field that differs, each value and the ranks that hold it;
    it depends only on ``table`` (and ``waiting``), so every rank that sees the same table
    raises the same text. waiting: ranks that were still in the call's collectives with
    their previous arguments (they kept them; the others changed).
    """
    ranks = sorted(table)
    names: list[str] = []
    for r in ranks:
        names += [n for n in table[r] if n not in names]
    parts = []
    for name in names:
        groups: dict = {}
        for r in ranks:
            groups.setdefault(repr(table[r].get(name, "<absent>")), []).append(r)
        if len(groups) > 1:
            values = "; ".join(f"{v} on {_ranks_text(rs)}" for v, rs in groups.items())
            parts.append(f"{name}: {values}")
    if not parts:
        return None
    msg = f"ranks disagree on {site}: " + " | ".join(parts)
    if waiting:
        msg += (f" ({_ranks_text(sorted(waiting))} kept the previous call's arguments and waited in its "
                "collectives until their timeout; the others changed them)")
    msg += ". Every rank of the group must make this call with the same " + ", ".join(n for n in names if n != "call")
    return DisagreementError(msg, site, {r: dict(table[r]) for r in ranks})


def _as_int64(value) -> int:
    """A value as one int64 for a fixed-size comparison: ints as themselves (wrapped), anything else
    by an 8-byte BLAKE2b digest of its type and repr (floats' repr round-trips exactly)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value + 2 ** 63) % 2 ** 64 - 2 ** 63
    digest = hashlib.blake2b(f"{type(value).__name__}:{value!r}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def agree_values(site: str, names: tuple, values: tuple, group, ranks: Sequence[int], *, device=None,
                 stats: CommStats | None = None) -> None:
    """Every rank of ``group`` passes equal ``values`` (one per name), else all raise the same DisagreementError.

    One all-gather of ``len(names)`` int64 (a fixed size whatever the values -- lists, strings,
    floats travel as digests -- so ranks that disagree never enter a collective with different
    buffer sizes), then a host read of the result: a per-call check (``generate``), not a
    per-step one. Only when the rows differ, one object exchange of the readable values, so the
    error names each rank's value of every differing field. ranks: the group's global ranks;
    device: where the exchanged tensor lives (NCCL needs the GPU).
    """
    mine = torch.tensor([_as_int64(v) for v in values], dtype=torch.int64, device=device)
    rows = all_gather(mine, group, stats=stats, what=f"{site}: comparing the ranks' arguments").cpu()
    if bool((rows == rows[0]).all()):
        return
    readable = exchange_objects(tuple(_plain(v) for v in values), group, what=f"{site}: explaining a disagreement")
    raise disagreement(site, {r: dict(zip(names, row)) for r, row in zip(ranks, readable)})


class Agreement:
    """Cross-rank check that every rank of one group makes each call with the same signature.

    A *site* is a named call (``"merge"``, ``"MegatronLM.prefill"``, ...) whose collectives need
    every rank to agree on a few host-side values, its *signature* (shapes, dtype, strategy,
    backend, ...): :meth:`call` wraps the call's collectives::

        with groups.agreement.call("merge", ("batch", "heads_q", ...), (b, hq, ...)):
            ...collectives...

    Guarantee (ranks of the group run the same sequence of guarded calls, i.e. the same
    program; each rank compares a site's signature with the one it last agreed on there):

    * If at some call the ranks' signatures are not all equal, no rank returns from that
      call: every rank raises :class:`DisagreementError` listing each rank's value of every
      differing field (the same text on every rank) -- at once when every rank's signature
      changed at that call; when only some changed, after the group's timeout ``T`` (the
      unchanged ranks first wait it out in the call's collectives, then compare notes).
    * The check never runs on the call's own process groups: records travel through
      torch.distributed's rendezvous store (the key-value store every process group was
      built from; a rank waits at most ``2T`` for the others'), so ranks that disagree never
      enter one collective with different buffer sizes (the SIGABRT that gloo gives for
      "Received data size doesn't match") and never combine garbage.
    * Steady state (a rank's signature equals its previous one at that site): no extra
      collective, no store access and no host-device synchronisation -- the signature is
      host metadata (shapes, dtypes, strings) compared as a tuple (about 1 us). A change
      costs one store write of a < 1 KiB record and P reads per rank; :attr:`checks`
      counts the exchanges.
    * A dead or stuck peer (not a disagreement): the survivors raise :class:`CommError`
      within ``2T`` (``T`` in the collective, at most ``T`` more comparing notes); a survivor
      that sees the dead peer's connection close raises at once, without comparing.

    On NCCL the call's collectives are asynchronous: a rank that kept its signature does not
    block in them, so when only some ranks change, those ranks raise :class:`CommError`
    after ``2T`` saying what changed, and the others are stopped by NCCL's watchdog at
    ``T``; telling them too would need a host read every call. The store is reached through
    ``torch.distributed.distributed_c10d._get_default_store()`` (what DeviceMesh and torch's
    own helpers use); a torch without it makes the first check a :class:`CommError` saying so.

    After any of these errors the group's collectives are out of step: build new groups.
    """

    def __init__(self, ranks: Sequence[int], timeout: datetime.timedelta, key: str):
        self.ranks = tuple(ranks)
        self.timeout = timeout
        """``T``: the timeout of the guarded collectives (a check waits at most 2T)."""
        self.checks = 0
        """Exchanges made (signature changes seen plus failures diagnosed)."""
        self._prefix = f"megatron_tree/agreement/{key}"
        self._epoch = 0
        self._last: dict = {}

    # -- the guarded call ----------------------------------------------------------------

    def call(self, site: str, names: tuple, values: tuple) -> "_Call":
        """Context manager: check ``values`` (one per name) if they changed; explain a failure inside."""
        return _Call(self, site, names, values)

    def agree(self, site: str, names: tuple, values: tuple) -> None:
        """Check ``values`` against every rank's if they differ from this rank's last agreed ones at ``site``."""
        last = self._last.get(site)
        if last is not None and last == values:
            return
        table, status = self._exchange("check", site, names, values, self.timeout * 2, last)
        err = disagreement(site, table, [r for r, s in status.items() if s == "failed"])
        if err is not None:
            raise err
        if any(s != "check" for s in status.values()):
            # Everyone agrees, yet a rank came from a failed collective: not a disagreement.
            raise CommError(f"{site}: a collective failed on {_ranks_text(sorted(r for r, s in status.items() if s != 'check'))} "
                            "although every rank passed the same arguments; see that rank's error")
        self._last[site] = values

    def explain(self, site: str, names: tuple, values: tuple, error: CommError) -> None:
        """After ``error`` inside ``site``: raise :class:`DisagreementError` if ranks disagree, else return."""
        if self._epoch == 0:
            return  # no check was ever made here: the peers are not in step with this record
        try:
            table, status = self._exchange("failed", site, names, values, self.timeout, self._last.get(site))
        except CommError:
            return  # peers did not answer either: the original error stands
        err = disagreement(site, table, [r for r, s in status.items() if s == "failed"])
        if err is not None:
            raise err from error

    # -- the exchange ----------------------------------------------------------------------

    def _exchange(self, status: str, site: str, names: tuple, values: tuple, wait: datetime.timedelta, last):
        """Every member's (site, {name: value}, status) through the rendezvous store, in rank order.

        Exchange k (counted on every member: checks and explanations happen at the same points
        on every rank) writes this rank's record under ``<prefix>/<k>/<rank>`` and waits at most
        ``wait`` for the others'. Records of exchange k-2 are deleted: every member has read them.
        """
        me = dist.get_rank()
        record = {"site": site, "fields": dict(zip(names, (_plain(v) for v in values))), "status": status}
        store = self._store()
        k, self._epoch = self._epoch, self._epoch + 1
        self.checks += 1
        keys = [f"{self._prefix}/{k}/{r}" for r in self.ranks]
        try:
            store.set(f"{self._prefix}/{k}/{me}", pickle.dumps(record))
            if k >= 2:
                store.delete_key(f"{self._prefix}/{k - 2}/{me}")
            store.wait(keys, wait)
            blobs = [store.get(key) for key in keys]
        except RuntimeError as e:  # DistStoreError: "Wait timeout", or the store's server is gone
            mine = ", ".join(f"{n}={_plain(v)!r}" for n, v in zip(names, values))
            before = ("this is its first call there" if last is None else
                      "previous call: " + ", ".join(f"{n}={_plain(v)!r}" for n, v in zip(names, last)))
            raise CommError(
                f"{site}: rank {me} called it with {mine} ({before}); comparing arguments with the other "
                f"{len(self.ranks) - 1} rank(s) got no answer within {_seconds(wait)}: they most likely are "
                "still in the call's collectives with other (e.g. the previous) arguments, or died. "
                f"Store error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            ) from e
        table, status_of = {}, {}
        for rank, blob in zip(self.ranks, blobs):
            rec = pickle.loads(blob)
            table[rank] = {"call": rec["site"], **rec["fields"]}  # ranks in different calls differ here
            status_of[rank] = rec["status"]
        return table, status_of

    @staticmethod
    def _store():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception as e:  # noqa: BLE001 -- an unusual torch or backend: say so, do not guess
            raise CommError(f"the cross-rank agreement check needs torch.distributed's rendezvous store: {e}") from e


class _Call:
    __slots__ = ("agreement", "site", "names", "values")

    def __init__(self, agreement: Agreement, site: str, names: tuple, values: tuple):
        self.agreement, self.site, self.names, self.values = agreement, site, names, values

    def __enter__(self):
        self.agreement.agree(self.site, self.names, self.values)
        return self

    def __exit__(self, exc_type, exc, tb):
        # A peer whose connection closed is dead: nobody would answer, so no comparison.
        if (exc_type is not None and issubclass(exc_type, CommError) and not issubclass(exc_type, DisagreementError)
                and getattr(exc, "cause", "other") != "closed"):
            self.agreement.explain(self.site, self.names, self.values, exc)
        return False


_AGREEMENTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def agreement_for(group, ranks: Sequence[int], timeout) -> Agreement:
    """The :class:`Agreement` of ``group`` (one per process group and process; created on first use).

    ranks: the group's global ranks; timeout: its collective timeout ``T`` (seconds or a
    ``timedelta``). Records are keyed by the group's name, which every member knows alike.
    """
    ag = _AGREEMENTS.get(group)
    if ag is None:
        try:
            name = group.group_name
        except Exception:  # noqa: BLE001 -- older torch: the registry's name
            name = dist.distributed_c10d._get_process_group_name(group)
        ag = Agreement(ranks, as_timedelta(timeout) or group_timeout(group), str(name))
        _AGREEMENTS[group] = ag
    return ag
