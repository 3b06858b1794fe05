"""Which peer is gone: a liveness record per rank in torch.distributed's default store.

Invariant: when a collective or a store wait cannot complete because a peer's process has
exited, the survivors name that rank (and its host and pid) as soon as they can tell, instead
of a backend's text that names an address, or a timeout that names no one.

Every rank writes one record, ``megatron_tree/alive/<rank>`` = (rank, host, pid, the process's
start time, the machine's boot id and pid namespace), into the default store when it builds
``TreeGroups`` (:func:`register`; idempotent, a few hundred bytes, no collective). A waiting
rank reads the records of the ranks it waits for (:func:`exited`): a rank on the same machine
(same boot id and pid namespace) whose process is gone -- no ``/proc/<pid>``, a zombie, or
another process under a reused pid -- is gone for certain. A rank that never wrote its record
"never checked in" (:func:`gone` with a grace: a slow rank gets that long to arrive). A rank on
another machine cannot be probed from here: its process is reported as unknown, and the
caller's own timeout stands.

:func:`watched` runs a blocking call (``dist.new_group``, an object exchange) in a helper thread
while the calling thread probes the peers every :data:`POLL_S` seconds, so a peer that died
while the others wait inside torch's own code is named at once rather than after the group's
timeout. (The abandoned call ends with its own timeout; after a peer is gone the groups are out
of step and must be rebuilt.)

Why it lives here, beside ``collectives``: it uses only torch.distributed's default store and
the operating system, imports nothing from the package, and ``collectives``, ``agreement`` and
``topology`` all name the dead through it. The module state is a cache of records already read
(a record never changes for a given store) and the store a record was written to.
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import threading
import time
from typing import Callable, Sequence

import torch.distributed as dist

__all__ = ["register", "remember", "store_lost", "lose_store", "exited", "gone", "note_failure", "describe", "who", "watched", "PeerGone", "POLL_S", "HOST_ENV"]

HOST_ENV = "MEGATRON_TREE_HOSTNAME"
"""Overrides the host name shown (as ``topology`` does, to test multi-host layouts)."""
POLL_S = 0.1
"""How often a waiting rank probes its peers."""
_PREFIX = "megatron_tree/alive/"
_records: dict = {}
"""(id of the store, rank) -> record, for records already read."""
_registered: set = set()
_lost_stores: dict = {}
"""id -> store, for the stores an operation on which failed (held, so that a new store cannot take a lost one's
id): their server is gone (under a ``MASTER_ADDR`` rendezvous, rank 0's process serves the store, so it dies with
rank 0). They are not asked again: every failed store operation prints
torch's warning with a C++ stack trace on stderr, and a waiting rank probes every :data:`POLL_S` -- hundreds of
lines around the one error that names the dead rank. Records read before (:func:`remember`) still name it."""


class PeerGone(RuntimeError):
    """Peers whose process is gone; ``gone`` maps each rank to why (:func:`describe` words it)."""

    def __init__(self, gone: dict):
        super().__init__(describe(gone))
        self.gone = gone


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _stat_fields(pid: int) -> list | None:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, ...]; None when there is no such process."""
    text = _read(f"/proc/{pid}/stat")
    if not text or ")" not in text:
        return None
    return text[text.rindex(")") + 2:].split()


@functools.lru_cache(maxsize=1)
def _machine() -> str | None:
    """This machine and pid namespace (pids are comparable only inside one), or None off Linux."""
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    return f"{boot}/{ns}" if boot and ns else None


def _host() -> str:
    return os.environ.get(HOST_ENV) or socket.gethostname()


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 -- no default group, or a torch without the helper
        return None


def _usable(store) -> bool:
    """Whether ``store`` may be asked (no earlier operation on it failed)."""
    return _lost_stores.get(id(store)) is not store


def store_lost(store) -> bool:
    """Whether an operation on ``store`` (the default store) failed here before: its server is gone."""
    return store is not None and not _usable(store)


def lose_store(store) -> None:
    """An operation on ``store`` failed: its server is gone; ask it nothing more (see :data:`_lost_stores`)."""
    _lost_stores[id(store)] = store


def register() -> None:
    """Write this rank's liveness record into the default store (once per store; no collective)."""
    store = _store()
    if store is None:
        return
    rank = dist.get_rank()
    if (id(store), rank) in _registered:
        return
    mine = os.getpid()
    stat = _stat_fields(mine)
    record = {"rank": rank, "host": _host(), "pid": mine, "start": stat[19] if stat and len(stat) > 19 else None,
              "machine": _machine()}
    try:
        store.set(f"{_PREFIX}{rank}", pickle.dumps(record))
    except Exception:  # noqa: BLE001 -- best effort: without it a dead peer is still a CommError, unnamed
        lose_store(store)
        return
    _registered.add((id(store), rank))
    _records[(id(store), rank)] = record


def _record(store, rank: int) -> dict | None:
    key = (id(store), rank)
    if key not in _records:
        if not _usable(store):
            return None
        try:
            if not store.check([f"{_PREFIX}{rank}"]):
                return None
            _records[key] = pickle.loads(store.get(f"{_PREFIX}{rank}"))
        except Exception:  # noqa: BLE001 -- the store itself failed (its host died): nothing to tell
            lose_store(store)
            return None
    return _records[key]


def remember(ranks: Sequence[int]) -> None:
    """Read and keep the liveness records of ``ranks`` now, while the store is up: a peer that hosts the
    store (rank 0 outside torchrun) and dies takes the store with it, and a record read only then is lost."""
    store = _store()
    if store is None:
        return
    for r in ranks:
        _record(store, r)


def _process_gone(record: dict) -> bool:
    """True when ``record``'s process has certainly exited (it ran on this machine and is not there)."""
    here = _machine()
    if here is None or record.get("machine") != here:
        return False
    stat = _stat_fields(int(record["pid"]))
    if stat is None or stat[0] in ("Z", "X"):
        return True
    return record.get("start") is not None and len(stat) > 19 and stat[19] != record["start"]


def _reported(store, rank: int) -> bool:
    """Whether ``rank`` wrote a notice (:func:`note_failure`) that it stopped because a peer was gone."""
    if not _usable(store):
        return False
    try:
        return bool(store.check([f"{_PREFIX}{rank}/saw"]))
    except Exception:  # noqa: BLE001 -- the store's server is gone
        lose_store(store)
        return False


def _saw(store, rank: int) -> list:
    """The ranks ``rank``'s notice (:func:`note_failure`) named as gone ([] without one)."""
    if not _usable(store):
        return []
    try:
        return list(pickle.loads(store.get(f"{_PREFIX}{rank}/saw")))
    except Exception:  # noqa: BLE001 -- the store's server is gone
        lose_store(store)
        return []


def exited(ranks: Sequence[int]) -> dict:
    """The ranks of ``ranks`` (other than this one) whose process has certainly exited: {rank: reason}.

    Ranks that exited after reporting a gone peer themselves (:func:`note_failure`) are left out
    while a rank that exited without such a notice remains: the first to go is the one to name.
    When every exited rank left such a notice, the ranks their notices name are the ones named
    (a peer that never checked in has no record to find exited: before, the ranks that reported
    it were named instead, once they had exited on their own error).
    """
    store = _store()
    if store is None:
        return {}
    me = dist.get_rank()
    out = {}
    for r in ranks:
        if r == me:
            continue
        record = _record(store, r)
        if record is not None and _process_gone(record):
            out[r] = ("exited", record)
    first = {r: v for r, v in out.items() if not _reported(store, r)}
    if not _usable(store):
        # the store is gone (it went with rank 0's process): a notice that an exited rank stopped on another
        # rank's failure can no longer be read, so an exited rank may be a reporter, not the cause -- say so
        return {r: ("exited_unread", record) for r, (_, record) in first.items()}
    if first or not out:
        return first
    blamed = {}
    for r in sorted(out):
        for b in _saw(store, r):
            if b == me or b in out or b in blamed:
                continue
            record = _record(store, b)
            if record is None:
                blamed[b] = ("absent", None)
            elif _process_gone(record):
                blamed[b] = ("exited", record)
            else:
                blamed[b] = ("reported", record)
    return blamed or out


def note_failure(found: dict) -> None:
    """Tell the others (through the store) that this rank stopped because the ranks of ``found`` were gone."""
    store = _store()
    if store is None or not found or not _usable(store):
        return
    try:
        store.set(f"{_PREFIX}{dist.get_rank()}/saw", pickle.dumps(sorted(found)))
    except Exception:  # noqa: BLE001 -- best effort: the store's server is gone
        lose_store(store)


def gone(ranks: Sequence[int], grace: float = 0.0) -> dict:
    """:func:`exited` now, plus the ranks that never wrote a record within ``grace`` seconds: {rank: reason}.

    The exited ranks are read first, so a peer that fails on the same event and exits during the
    grace is not named in place of the one that caused it.
    """
    store = _store()
    if store is None:
        return {}
    me = dist.get_rank()
    others = [r for r in ranks if r != me]
    out = exited(others)
    deadline = time.monotonic() + grace
    while True:
        absent = [r for r in others if r not in out and _record(store, r) is None]
        if not absent or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    for r in absent:
        out[r] = ("absent", None)
    return dict(sorted(out.items()))


def describe(found: dict) -> str:
    """``found`` (from :func:`exited`/:func:`gone`) in words: each rank, its host and pid, and why."""
    parts = []
    for r, (why, record) in sorted(found.items()):
        if why == "exited":
            parts.append(f"rank {r} (host {record['host']}, pid {record['pid']}) is gone: its process has exited")
        elif why == "exited_unread":
            parts.append(f"rank {r} (host {record['host']}, pid {record['pid']}) is gone: its process has exited "
                         "(the rendezvous store is gone too, so whether it stopped on its own error about another "
                         f"rank cannot be read here: see rank {r}'s log)")
        elif why == "reported":
            parts.append(f"rank {r} (host {record['host']}, pid {record['pid']}) is gone: the ranks that saw it go "
                         "reported it, then exited")
        else:
            parts.append(f"rank {r} (host unknown) never checked in: it wrote no liveness record to the default "
                         "store (it exited or failed before building TreeGroups, or has not reached it)")
    return "; ".join(parts)


def who(ranks: Sequence[int]) -> str:
    """``ranks`` with the host and pid of their liveness records: ``rank 2 (host h, pid 7)``."""
    store = _store()
    parts = []
    for r in ranks:
        record = None if store is None else _record(store, r)
        parts.append(f"rank {r} (host {record['host']}, pid {record['pid']})" if record else f"rank {r} (host unknown)")
    return ", ".join(parts)


def watched(fn: Callable, ranks: Sequence[int], poll: float = POLL_S):
    """``fn()``, run in a helper thread while this thread probes ``ranks`` every ``poll`` seconds.

    Returns ``fn``'s result or raises its exception; raises :class:`PeerGone` as soon as a rank of
    ``ranks`` has exited (``fn`` is then left to end on its own timeout). Without peers, ``fn()``.
    """
    if len(ranks) <= 1 or _store() is None:
        return fn()
    result: dict = {}
    device = None
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()  # the CUDA device is per thread: carry it over
    except Exception:  # noqa: BLE001
        device = None

    def run():
        try:
            if device is not None:
                import torch

                torch.cuda.set_device(device)
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=run, name="megatron_tree-watched", daemon=True)
    thread.start()
    while True:
        thread.join(poll)
        if not thread.is_alive():
            break
        dead = exited(ranks)
        if dead:
            raise PeerGone(dead)
    if "error" in result:
        raise result["error"]
    return result["value"]
