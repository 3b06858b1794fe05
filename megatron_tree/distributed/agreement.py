"""Cross-rank agreement: every rank of a group makes a call alike, or every rank raises the same error.

Invariant: ranks that were handed different arguments never enter a collective with them --
not with mismatched buffer sizes (gloo's SIGABRT "Received data size doesn't match") and not
with matching sizes and different meanings (a silent wrong answer) -- and every rank of the
group raises the same text, built by :func:`disagreement` from every rank's values. This is
the one module that checks it; every entry point that needs ranks to agree calls one of its
two mechanisms:

* **per call** (:func:`agree`): one all-gather of a fixed-size int64 record per rank on the
  call's own group -- a status word (did this rank's own argument checks pass?), the values
  that may differ between ranks (a shard's length), and one digest per value that must be
  equal. A rank whose own checks failed makes every rank raise that rank's error at once
  (naming the rank), instead of the others waiting in the call's collectives for their
  timeout; ranks whose values differ raise :class:`DisagreementError` naming each rank's
  value. Costs one small collective and one host read: for calls made once (``generate``, a
  prefill, a baseline's plan), not per decode step.
* **per step** (:class:`Agreement`, reached as ``TreeGroups.agreement``): a signature check
  through torch.distributed's rendezvous store that costs nothing while a rank's signature
  equals its previous one at that site (the merges, the Megatron integration's gathers).

Why it lives here, above ``collectives`` and below ``topology``: it is built only from the
collective helpers (and the store), and ``TreeGroups`` hands every CP group's
:class:`Agreement` to the layers above. The one module state is :func:`agreement_for`'s cache,
keyed by the CP group the caller passes: every ``TreeGroups`` that wraps one CP group
(Megatron builds one per layer) shares one :class:`Agreement`.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import pickle
import time
import weakref
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from . import collectives, liveness
from .collectives import CommError, CommStats, DisagreementError
from .collectives import _seconds as _seconds_text

__all__ = ["agree", "disagreement", "Agreement", "agreement_for", "DisagreementError"]


# --------------------------------------------------------------------------- the message format


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


# --------------------------------------------------------------------------- per call: one all-gather


def agree(site: str, names: tuple, values: tuple | Callable[[], tuple], group, ranks: Sequence[int], *,
          local: Sequence[int] = (), device=None, stats: CommStats | None = None) -> list[tuple[int, ...]]:
    """Every rank of ``group`` passes its own checks and equal ``values``, else every rank raises the same error.

    site: the call's name in messages; names: one name per value
    values: the values every rank must pass alike, or a callable that runs this rank's own
        argument checks and returns them -- an exception it raises is this rank's failure,
        sent to every rank with the record (so all raise it at once, naming this rank)
    local: integers that may differ between ranks (e.g. a shard's length), returned for every rank
    ranks: the group's global ranks; device: where the exchanged tensor lives (NCCL needs the GPU)
    returns every rank's ``local``, in group-rank order

    Collectives: one all-gather of ``1 + len(local) + len(names)`` int64 per rank (a fixed size
    whatever the values: lists, strings and floats travel as 8-byte digests) and a host read of
    it. Only when a rank failed or the values differ, one object exchange of the readable
    failure or values, so the error names what each rank had. Without a group (or a group of
    one) this is the local check alone: its exception is raised as it is.
    """
    error = None
    if callable(values):
        try:
            values = values()
        except Exception as e:  # noqa: BLE001 -- any failure of the rank's own checks travels
            error, values = e, None
    local = tuple(int(x) for x in local)
    if group is None or len(ranks) <= 1:
        if error is not None:
            raise error
        return [local]
    if error is None:
        record = [0, *(_as_int64(x) for x in local), *(_as_int64(v) for v in values)]
    else:
        record = [1] + [0] * (len(local) + len(names))
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    rows = collectives.all_gather(mine, group, stats=stats, what=f"{site}: comparing the ranks' arguments").cpu()
    if bool(rows[:, 0].any()):
        told = collectives.exchange_objects(None if error is None else _portable(error), group,
                                            what=f"{site}: telling every rank a rank's argument error")
        failed = _local_failure(list(ranks), told)
        if error is not None:
            raise failed from error
        raise failed
    signature = rows[:, 1 + len(local):]
    if not bool((signature == signature[0]).all()):
        readable = collectives.exchange_objects(tuple(_plain(v) for v in values), group,
                                                what=f"{site}: explaining a disagreement")
        raise disagreement(site, {r: dict(zip(names, row)) for r, row in zip(ranks, readable)})
    return [tuple(row) for row in rows[:, 1:1 + len(local)].tolist()]


def _portable(error: BaseException) -> tuple[str, str, str]:
    """An exception as it travels: its class's module and qualified name, and its message."""
    return type(error).__module__, type(error).__qualname__, str(error)


def _local_failure(ranks: list[int], told: list) -> Exception:
    """The error every rank raises when some ranks' own checks failed: the first failing rank's
    exception class, each failing rank named with its message (the same text on every rank)."""
    failing = [(r, t) for r, t in zip(ranks, told) if t is not None]
    by_message: dict = {}
    for r, (_, _, message) in failing:
        by_message.setdefault(message, []).append(r)
    text = "; ".join(f"{_ranks_text(rs)}: {message}" for message, rs in by_message.items())
    module, qualname, _ = failing[0][1]
    cls = _exception_class(module, qualname)
    try:
        err = cls(text)
    except Exception:  # noqa: BLE001 -- a class whose constructor takes more than a message
        err = cls.__new__(cls)
        BaseException.__init__(err, text)
    return err


def _exception_class(module: str, qualname: str) -> type:
    """The exception class named by ``module`` and ``qualname``, or ``ValueError`` where it cannot be imported."""
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return ValueError
    return obj if isinstance(obj, type) and issubclass(obj, Exception) else ValueError


# --------------------------------------------------------------------------- per step: the store-based check


class Agreement:
    """Cross-rank check that every rank of one group makes each call with the same signature.

    A *site* is a named call (``"merge"``, ``"Llama.prefill"``, ...) whose collectives need
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
      built from; a rank waits at most :data:`CHECK_WAIT` ``T`` for the others'), so ranks that disagree never
      enter one collective with different buffer sizes (the SIGABRT that gloo gives for
      "Received data size doesn't match") and never combine garbage.
    * Steady state (a rank's signature equals its previous one at that site): no extra
      collective, no store access and no host-device synchronisation -- the signature is
      host metadata (shapes, dtypes, strings) compared as a tuple (about 1 us). A change
      costs one store write of a < 1 KiB record and P reads per rank; :attr:`checks`
      counts the exchanges.
    * A rank whose own argument checks fail at a guarded site (:meth:`fail`, e.g. ``tree_decode``'s
      checks of ``cache_seqlens``) does not enter the call's collectives: it writes its error
      as its record, and every rank raises that error, naming the rank, the same text everywhere
      -- at once where every rank compares at that call (its first at the site, or a change on
      every rank), else once the others' collectives time out (within ``(1 + EXPLAIN_WAIT) T``).
    * A dead or stuck peer (not a disagreement): the survivors raise :class:`CommError`
      within ``1.4 T`` (``T`` in the collective, at most :data:`EXPLAIN_WAIT` ``T`` more comparing
      notes with the ranks that timed out beside them; :data:`CHECK_WAIT` ``T`` for a rank that
      was comparing a changed signature); a survivor that sees the dead peer's connection close
      raises at once, without comparing.

    On NCCL the call's collectives are asynchronous: a rank that kept its signature does not
    block in them, so when only some ranks change, those ranks raise :class:`CommError`
    after :data:`CHECK_WAIT` ``T`` saying what changed, and the others are stopped by NCCL's watchdog at
    ``T``; telling them too would need a host read every call. The store is reached through
    ``torch.distributed.distributed_c10d._get_default_store()`` (what DeviceMesh and torch's
    own helpers use); a torch without it makes the first check a :class:`CommError` saying so.

    After any of these errors the group's collectives are out of step: build new groups.
    """

    def __init__(self, ranks: Sequence[int], timeout: datetime.timedelta, key: str):
        self.ranks = tuple(ranks)
        self.timeout = timeout
        """``T``: the timeout of the guarded collectives (a check waits at most :data:`CHECK_WAIT` T)."""
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
        table, status = self._exchange("check", site, names, values, self.timeout * CHECK_WAIT, last)
        _raise_local_failures(table, status)
        err = disagreement(site, table, [r for r, s in status.items() if s == "failed"])
        if err is not None:
            raise err
        if any(s != "check" for s in status.values()):
            # Everyone agrees, yet a rank came from a failed collective: not a disagreement.
            raise CommError(f"{site}: a collective failed on {_ranks_text(sorted(r for r, s in status.items() if s != 'check'))} "
                            "although every rank passed the same arguments; see that rank's error")
        self._last[site] = values

    def explain(self, site: str, names: tuple, values: tuple, error: CommError) -> None:
        """After ``error`` inside ``site``: raise :class:`DisagreementError` if ranks disagree, or the
        error of a rank whose own checks failed (:meth:`fail`), else return.

        A collective that failed because a peer's connection closed waits for no one (the peer most
        likely died): it only reads the records already there.
        """
        if self._epoch == 0:
            return  # no check was ever made here: the peers are not in step with this record
        wait = 0.0 if getattr(error, "cause", "other") == "closed" else EXPLAIN_WAIT
        try:
            # partial: a rank whose own checks failed wrote its record before the others entered their
            # collectives, so it is there whoever else has answered (their skew may exceed the wait)
            table, status = self._exchange("failed", site, names, values, self.timeout * wait,
                                           self._last.get(site), partial=True)
        except CommError:
            return  # the store itself failed: the original error stands
        try:
            _raise_local_failures(table, status)
        except Exception as failed:  # noqa: BLE001 -- another rank's own checks failed: its error
            raise failed from error
        if "missing" in status.values():
            return  # peers did not answer either: the original error stands
        err = disagreement(site, table, [r for r, s in status.items() if s == "failed"])
        if err is not None:
            raise err from error

    def fail(self, site: str, error: Exception) -> None:
        """This rank's own checks of a call at ``site`` raised ``error``: tell every rank, then raise.

        Called instead of entering the call's collectives. Writes ``error`` as this rank's record
        of the next exchange and waits (at most :data:`CHECK_WAIT` ``T``) for the others': ranks
        that compare at this call answer at once, ranks already in the call's collectives answer
        when those time out (:meth:`explain`). Raises, on every rank alike, the failing ranks'
        errors (:func:`_local_failure`: the first failing rank's exception class, each failing
        rank named with its message), the same text whether or not the others answered in time.
        """
        try:
            table, status = self._exchange("error", site, (), (), self.timeout * CHECK_WAIT, self._last.get(site),
                                           error=_portable(error), partial=True)
        except CommError:
            raise error from None
        try:
            _raise_local_failures(table, status)
        except Exception as failed:  # noqa: BLE001 -- the same error the other ranks raise
            raise failed from error
        raise error  # not reached: this rank's own record is an error

    # -- the exchange ----------------------------------------------------------------------

    def _exchange(self, status: str, site: str, names: tuple, values: tuple, wait: datetime.timedelta, last,
                  error: tuple | None = None, partial: bool = False):
        """Every member's (site, {name: value}, status) through the rendezvous store, in rank order.

        Exchange k (counted on every member: checks and explanations happen at the same points
        on every rank) writes this rank's record under ``<prefix>/<k>/<rank>`` and waits at most
        ``wait`` for the others' (polling the store: a store's own ``wait`` rounds its timeout up
        to whole seconds). Records of exchange k-2 are deleted: every member has read them.
        ``status`` ``"error"`` carries this rank's own failed check (``error``: :func:`_portable`).
        Returns ({rank: {"call": site, **fields}}, {rank: status}); an error record's table entry
        holds ``"error"`` instead of fields. ``partial``: after ``wait``, the records that are there,
        the other ranks with status ``"missing"`` (else a :class:`CommError`).
        """
        me = dist.get_rank()
        record = {"site": site, "fields": dict(zip(names, (_plain(v) for v in values))), "status": status,
                  "error": error}
        store = self._store()
        k, self._epoch = self._epoch, self._epoch + 1
        self.checks += 1
        keys = [f"{self._prefix}/{k}/{r}" for r in self.ranks]
        try:
            if liveness.store_lost(store):  # (asking it again would only print torch's warning and trace)
                raise RuntimeError("the rendezvous store's server is gone (an earlier operation on it failed)")
            store.set(f"{self._prefix}/{k}/{me}", pickle.dumps(record))
            if k >= 2:
                store.delete_key(f"{self._prefix}/{k - 2}/{me}")
            try:
                _wait_for(store, keys, wait, self.ranks)
                blobs = [store.get(key) for key in keys]
            except _NoAnswer as e:
                if not partial:
                    if isinstance(e, _Gone):  # a peer's process is gone: name it now, not after the wait
                        raise collectives.peer_gone(
                            f"{site}: rank {me} compared its arguments with the other {len(self.ranks) - 1} rank(s)",
                            e.gone) from None
                    raise
                blobs = [store.get(key) if store.check([key]) else None for key in keys]
        except RuntimeError as e:  # DistStoreError: "Wait timeout", or the store's server is gone
            if isinstance(e, CommError):  # a peer named gone (liveness)
                raise
            if not isinstance(e, _NoAnswer):  # the store itself failed: its server is gone
                liveness.lose_store(store)  # ask it nothing more
                dead = liveness.exited(self.ranks)  # it died with its rank? (records read at build name it)
                if dead:
                    raise collectives.peer_gone(
                        f"{site}: rank {me} compared its arguments with the other {len(self.ranks) - 1} rank(s)",
                        dead, e) from e
            mine = ", ".join(f"{n}={_plain(v)!r}" for n, v in zip(names, values))
            before = ("this is its first call there" if last is None else
                      "previous call: " + ", ".join(f"{n}={_plain(v)!r}" for n, v in zip(names, last)))
            raise CommError(
                f"{site}: rank {me} called it with {mine} ({before}); comparing arguments with the other "
                f"{len(self.ranks) - 1} rank(s) got no answer within {_seconds_text(wait)}{_silent(store, keys, self.ranks)}: "
                "they most likely are still in the call's collectives with other (e.g. the previous) arguments, or "
                f"died. Store error: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
            ) from e
        table, status_of = {}, {}
        for rank, blob in zip(self.ranks, blobs):
            if blob is None:
                table[rank], status_of[rank] = {"call": "<no answer>"}, "missing"
                continue
            rec = pickle.loads(blob)
            if rec["status"] == "error":
                table[rank] = {"call": rec["site"], "error": rec["error"]}
            else:
                table[rank] = {"call": rec["site"], **rec["fields"]}  # ranks in different calls differ here
            status_of[rank] = rec["status"]
        return table, status_of

    @staticmethod
    def _store():
        try:
            return dist.distributed_c10d._get_default_store()
        except Exception as e:  # noqa: BLE001 -- an unusual torch or backend: say so, do not guess
            raise CommError(f"the cross-rank agreement check needs torch.distributed's rendezvous store: {e}") from e


CHECK_WAIT = 1.35
"""How long (in ``T``) a rank comparing a changed signature, or telling its own failed check, waits
for the others' records: ranks that kept their signature answer once the call's collectives time
out (after ``T``), so the wait covers ``T`` and the ranks' skew, and stays below ``1.5 T``."""
EXPLAIN_WAIT = 0.4
"""How long (in ``T``) a rank whose collective failed waits for the others' records: the ranks that
timed out beside it answer within their skew; a dead or stuck rank never does."""


def _silent(store, keys: list[str], ranks: Sequence[int]) -> str:
    """`` from rank 2 (host h, pid 7)``: the ranks whose record is not in the store, or ``""``."""
    if liveness.store_lost(store):
        return ""
    try:
        missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
    except Exception:  # noqa: BLE001 -- the store itself failed
        return ""
    return f" from {liveness.who(missing)}" if missing else ""


class _NoAnswer(RuntimeError):
    """Some records were not in the store within the wait."""


class _Gone(_NoAnswer):
    """A rank whose record is missing has exited (``gone``: :func:`liveness.exited`)."""

    def __init__(self, gone: dict):
        super().__init__(liveness.describe(gone))
        self.gone = gone


def _wait_for(store, keys: list[str], wait: datetime.timedelta, ranks: Sequence[int] = ()) -> None:
    """Return once every key of ``keys`` is in ``store``; :class:`_NoAnswer` after ``wait``.

    ranks: the rank of each key; every :data:`liveness.POLL_S` the ranks whose record is missing are
    probed, and one whose process has exited ends the wait at once (:class:`_Gone`).
    """
    start = time.monotonic()
    deadline = start + wait.total_seconds()
    pause, probed = 0.005, start
    while not store.check(keys):
        now = time.monotonic()
        if ranks and now - probed >= liveness.POLL_S:
            probed = now
            missing = [r for r, key in zip(ranks, keys) if not store.check([key])]
            dead = liveness.exited(missing)
            if dead:
                raise _Gone(dead)
        if now >= deadline:
            raise _NoAnswer(f"Wait timeout after {_seconds_text(wait)} for {len(keys)} record(s)")
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _raise_local_failures(table: dict, status: dict) -> None:
    """Raise the failing ranks' own errors (the same on every rank) if some record is an error."""
    failing = [r for r in sorted(table) if status[r] == "error"]
    if not failing:
        return
    told = [table[r]["error"] if status[r] == "error" else None for r in sorted(table)]
    failed = _local_failure(sorted(table), told)
    if any(s in ("failed", "missing") for s in status.values()):
        # the same words whichever of the waiting ranks had answered by now
        note = (" (the other ranks had entered the call's collectives and waited until their timeout: those "
                "collectives are out of step, build new groups)")
        failed.args = (str(failed) + note,) + failed.args[1:]
    raise failed


class _Call:
    __slots__ = ("agreement", "site", "names", "values")

    def __init__(self, agreement: Agreement, site: str, names: tuple, values: tuple):
        self.agreement, self.site, self.names, self.values = agreement, site, names, values

    def __enter__(self):
        self.agreement.agree(self.site, self.names, self.values)
        return self

    def __exit__(self, exc_type, exc, tb):
        # (a peer whose connection closed is most likely dead: explain then reads what is there, waiting for no one)
        if exc_type is not None and issubclass(exc_type, CommError) and not issubclass(exc_type, DisagreementError):
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
        ag = Agreement(ranks, collectives.as_timedelta(timeout) or collectives.group_timeout(group), str(name))
        _AGREEMENTS[group] = ag
        liveness.register()  # (idempotent) so that a peer gone while the others wait is named
    return ag
