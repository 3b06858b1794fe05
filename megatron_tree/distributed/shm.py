"""A shared-memory transport for the small collectives of CPU ranks on one host.

Invariant: a group with a channel gets, from ``collectives.all_gather`` and ``all_reduce``,
bit-for-bit what every rank would compute from every rank's tensor in group-rank order -- the
same on every rank -- or a ``CommError`` within the group's timeout; never a torn read.

Why: a decode step issues one small merge collective per layer. Through gloo each one crosses
the calling thread, gloo's worker and its socket loop in both processes; on a machine whose
cores are all busy computing (one CP rank per core, the case CPU decoding is in) each of those
wake-ups waits for a time slice, about 1.5 ms per collective measured on a 2-core machine --
longer than the layer's whole attention. Here a rank copies its tensor into its own slot of a
memory-mapped file, publishes a sequence number, and spins (then yields, then sleeps) until
every peer's number has arrived: no thread hand-off, no socket.

Layout of the mapped file (created by the group's first rank in ``/dev/shm``, mapped by every
member, unlinked once all have mapped it, so nothing is left behind by a crash)::

    header:  P lines of 64 bytes; line r = (seq, nbytes and dtype code of parity 0, the same of
             parity 1) of rank r, int64
    data:    2 parities x P slots of ``slot_bytes``; collective number s uses parity s % 2

Reuse is safe with two parities: a rank writes parity s % 2 for collective s only after it saw
every peer publish s - 1, and a peer publishes s - 1 only after it finished reading s - 2 (the
same parity; the size and dtype words are kept per parity alike). A rank writes its slot, then
its header line (sequence number last); a reader
reads the sequence number, then the slot. x86-64 keeps stores in order and loads in order (and
each header word is one aligned 8-byte access), which is what this relies on: the channel is
only made on x86-64 (:func:`supported`); elsewhere the group keeps its backend.

A tensor larger than a slot goes through the group's backend (the choice depends only on the
size, which the merge's callers check alike on every rank before any collective). A peer whose
header shows another size or dtype for the same collective is a ``DisagreementError`` naming
every rank's, on every rank; a peer whose process has exited is a ``CommError`` naming it (its
liveness record, ``liveness.exited``, checked every :data:`PROBE_S` while waiting); no answer within the
group's timeout is a ``CommError`` naming the ranks that did not arrive.
"""

from __future__ import annotations

import os
import platform
import time
import uuid

import torch
import torch.distributed as dist

from . import liveness

__all__ = ["Channel", "supported", "channel_of", "attach", "ChannelTimeout", "ChannelMismatch",
           "DEFAULT_SLOT_BYTES", "PROBE_S"]

DEFAULT_SLOT_BYTES = 1 << 20
"""Bytes per rank per parity: a decode merge's buffer of a batch of 64 rows x 64 heads x 65 floats fits."""
PROBE_S = 0.05
"""How often a waiting rank checks that its peers' processes are still there."""
_SPINS = 2000
"""Checks of the peers' sequence numbers before the waiting rank starts yielding its core (about 3 ms),
when the host has a core for every member; with more members than cores a spinning rank holds the core
a peer it waits for needs, so it yields after :data:`_SPINS_OVERSUBSCRIBED`."""
_SPINS_OVERSUBSCRIBED = 20
_YIELDS = 200
"""Then ``sched_yield`` calls before it starts sleeping (ranks outnumbering cores: let the others run)."""

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
           torch.uint8, torch.bool, torch.int16]
_LINE = 8  # int64 words per header line (64 bytes: one cache line per rank)

_CHANNELS: dict = {}
"""id(process group) -> (group, Channel): the groups :func:`attach` gave a channel (see ``collectives``)."""


class ChannelTimeout(RuntimeError):
    """No answer from ``late`` (global ranks) within the channel's timeout (``collectives`` words it)."""

    def __init__(self, late: list, timeout: float):
        super().__init__(f"no answer from rank(s) {late} over shared memory within the group's timeout of "
                         f"{timeout:g} s")
        self.late = late


class ChannelMismatch(RuntimeError):
    """The ranks passed different sizes or dtypes to one collective (the message names each rank's)."""


def supported() -> bool:
    """Whether this machine can run a channel (x86-64's store and load ordering, a ``/dev/shm``)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class Channel:
    """The mapped file of one group, as this member sees it (made collectively by :func:`attach`)."""

    def __init__(self, path: str, rank: int, ranks: tuple[int, ...], slot_bytes: int, timeout: float):
        self.rank, self.ranks, self.slot_bytes, self.timeout = rank, ranks, slot_bytes, timeout
        self.path = path  # (unlinked once every member has mapped it)
        self.size = len(ranks)
        head = self.size * _LINE * 8
        total = head + 2 * self.size * slot_bytes
        with torch.inference_mode(False):  # made under inference mode it would refuse every write outside it
            self._mem = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
            self._head = self._mem[:head].view(torch.int64).numpy().reshape(self.size, _LINE)
            self._data = self._mem[head:].view(2, self.size, slot_bytes)
        self._seq = 0
        self._views: dict = {}
        """(parity, dtype, shape) -> (this rank's slot, every rank's slots) as tensors of that dtype and shape:
        a decode step's merges repeat a few shapes, and making the views anew cost ~1.5 us a view."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._spins = _SPINS if self.size <= cores else _SPINS_OVERSUBSCRIBED

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.numel() * tensor.element_size() <= self.slot_bytes

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor, what: str) -> torch.Tensor:
        """out[r] = rank r's ``tensor`` (out: (P, *tensor.shape); CPU, any strides)."""
        parity, n = self._publish(tensor)
        self._wait(n, what)
        if n:  # every rank's slot in one view and one copy (any strides in out: copy_ follows them)
            out.copy_(self._slots(parity, tensor))
        return out

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> torch.Tensor:
        """``tensor`` = group rank ``src``'s, in place. Every rank publishes its own as in any collective (the
        size and dtype check and the sequence numbers are per call) and reads the source's slot alone."""
        parity, n = self._publish(tensor)
        self._wait(n, what)
        if n and src != self.rank:
            tensor.copy_(self._slot(parity, src, tensor))
        return tensor

    def all_reduce(self, tensor: torch.Tensor, op: str, what: str) -> torch.Tensor:
        """``tensor`` = the ``op`` of every rank's, taken in group-rank order (the same bits on every rank)."""
        parity, n = self._publish(tensor)
        self._wait(n, what)
        if n:
            parts = self._slots(parity, tensor)
            if op == "sum":
                acc = parts[0].clone()
                for r in range(1, self.size):
                    acc.add_(parts[r])
            elif op == "max":
                acc = parts.amax(dim=0)
            else:
                acc = parts.amin(dim=0)
            tensor.copy_(acc)
        return tensor

    def _slots(self, parity: int, like: torch.Tensor) -> torch.Tensor:
        """Every rank's slot of ``parity`` as one (P, *like.shape) tensor of ``like``'s dtype."""
        return self._views_of(parity, like)[1]

    def _views_of(self, parity: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's slot, every rank's slots) of ``parity`` shaped as ``like`` (kept per shape and dtype)."""
        key = (parity, like.dtype, like.shape)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 64:  # (a step repeats a few shapes; a run of many keeps only the latest)
                self._views.clear()
            n = like.numel() * like.element_size()
            with torch.inference_mode(False):  # (a view made in inference mode may not be written outside it)
                views = self._views[key] = (self._slot(parity, self.rank, like),
                                            self._data[parity, :, :n].view(like.dtype).view(self.size, *like.shape))
        return views

    def _slot(self, parity: int, r: int, like: torch.Tensor) -> torch.Tensor:
        """Rank ``r``'s slot of ``parity`` as a contiguous tensor of ``like``'s dtype and shape."""
        n = like.numel() * like.element_size()
        return self._data[parity, r, :n].view(like.dtype).view(like.shape)

    def _publish(self, tensor: torch.Tensor) -> tuple[int, int]:
        self._seq += 1
        parity = self._seq % 2
        n = tensor.numel() * tensor.element_size()
        if n:
            self._views_of(parity, tensor)[0].copy_(tensor)
        line = self._head[self.rank]
        line[1 + 2 * parity] = n
        line[2 + 2 * parity] = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -1
        line[0] = self._seq  # last: a peer that sees this number sees the slot and the words above
        return parity, n

    def _wait(self, n: int, what: str) -> None:
        seqs = self._head[:, 0]
        want = self._seq
        spins = 0
        start = probe = None
        while seqs.min() < want:
            spins += 1
            if spins < self._spins:
                continue
            now = time.monotonic()
            if start is None:
                start = probe = now
            if spins < self._spins + _YIELDS:
                os.sched_yield()
            else:
                time.sleep(0.0002)
            if now - probe >= PROBE_S:
                probe = now
                self._check_peers(want)
                if now - start >= self.timeout:
                    raise ChannelTimeout([self.ranks[r] for r in range(self.size) if seqs[r] < want], self.timeout)
        parity = want % 2
        sizes = self._head[:, 1 + 2 * parity]
        codes = self._head[:, 2 + 2 * parity]
        if (sizes != n).any() or (codes != codes[self.rank]).any():
            seen = ", ".join(f"rank {self.ranks[r]}: {int(sizes[r])} bytes of "
                             f"{_DTYPES[int(codes[r])] if 0 <= codes[r] < len(_DTYPES) else 'another dtype'}"
                             for r in range(self.size))
            raise ChannelMismatch(f"{what}: the ranks passed tensors of different sizes or dtypes to one "
                                    f"collective ({seen}); every rank must pass the same")

    def _check_peers(self, want: int) -> None:
        late = [self.ranks[r] for r in range(self.size) if self._head[r, 0] < want]
        dead = liveness.exited(late)
        if dead:
            raise liveness.PeerGone(dead)


def attach(group, ranks, exchange, *, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout: float) -> Channel | None:
    """Give ``group`` (whose members are ``ranks``, global, in group order, all on this host) a channel.

    Every member calls it, in the same order as its other collectives on ``group``; ``exchange``:
    ``collectives.exchange_objects``. Returns this member's :class:`Channel`, or None -- every member
    alike -- where a member's machine cannot run one (:func:`supported`) or cannot create or map the
    file (a ``/dev/shm`` that is full, or not the same one: processes in separate containers that
    report one host name); the group then keeps its backend. Two object exchanges over ``group``.
    """
    me = dist.get_rank()
    ok, path = supported(), None
    if ok and me == ranks[0]:
        path = f"/dev/shm/megatron_tree-{uuid.uuid4().hex}"
        try:
            with open(path, "wb") as f:
                f.truncate(len(ranks) * _LINE * 8 + 2 * len(ranks) * slot_bytes)
        except OSError:
            ok = False
    facts = exchange((ok, path), group, what="shared-memory channel")
    channel = None
    if all(f[0] for f in facts):
        try:
            channel = Channel(facts[0][1], list(ranks).index(me), tuple(ranks), slot_bytes, timeout)
        except (OSError, RuntimeError):  # torch.from_file raises RuntimeError for a file it cannot map
            channel = None
    mapped = exchange(channel is not None, group, what="shared-memory channel")  # every member has mapped it
    if path is not None and os.path.exists(path):
        os.unlink(path)  # the mapping stays; the name goes, so no crash leaves a file behind
    if not all(mapped):
        return None
    liveness.remember(ranks)  # the peers' pids, kept: a dead peer is still named if it took the store down
    _CHANNELS[id(group)] = (group, channel)
    return channel


def channel_of(group) -> Channel | None:
    """The channel :func:`attach` gave ``group``, or None."""
    entry = _CHANNELS.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None
