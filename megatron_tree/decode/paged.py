"""A paged KV cache sharded over the CP ranks: per-rank block pools, one placement rule.

Invariant: every CP rank holds an identical copy of the bookkeeping (which request owns
which blocks on which rank) and changes it with the same calls in the same order, so every
rank knows every other rank's pool without communicating; a rank stores only the keys and
values of its own blocks. This module never communicates: attention over the pages is
``tree_decode(..., block_table=...)``.

Where a token goes is decided by the library's one placement rule,
:class:`~megatron_tree.decode.placement.RowPlacement`, and planned by its one step planner
(:func:`~megatron_tree.decode.plan.place`), with *every* token of a request appended
block by block (a block fills on one rank, the next opens on the least-loaded rank, ties
round-robin), so each rank holds about 1/CP of every long request and any prefix of a
request is balanced to within one block. The training CP layout (2·CP prompt chunks) is
deliberately not used here: with chunked prefill a request arrives prefix by prefix, and
the first chunk of that layout lands on one rank, so page pools could not be sized against
the engine's admission control. A request's first block goes to the rank with the most
free blocks (the planner's ranks are rotated by that offset), so short requests do not pile
up on rank 0.

Pages and slots: a rank stores a request's tokens in position order; the token in slot
``s`` on that rank lives in that rank's block ``block_ids[s // block_size]`` at offset
``s % block_size``. Because slots follow positions, the keys a query at position ``p`` may
see on a rank are a prefix of that rank's slots, so causal masking over a paged shard is
just ``cache_seqlens`` per query row (see :meth:`PagedKVCache.rows`).

Storage on this rank (one block = one page):

    k, v: (num_layers, blocks_per_rank, block_size, num_kv_heads, head_dim)

``k`` and ``v`` are views of per-layer buffers of ``blocks_per_rank * block_size + 1`` token
slots: the last is the spare slot where a write puts the tokens other ranks keep (never read,
never in a block table), so a write is one scatter and needs no host read of which tokens are
this rank's (:mod:`.plan`'s one trick). A step's write indices reach the device in one copy.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from .cache import CacheOverflowError
from .placement import RowPlacement
from .plan import place, to_device

__all__ = ["PagedKVCache", "PoolExhaustedError", "CacheOverflowError", "BlockPool", "TokenSlots"]


class PoolExhaustedError(RuntimeError):
    """A request needs more blocks on some CP rank than that rank's pool has free.

    Nothing was allocated: the cache is exactly as it was before the call.
    """

    def __init__(self, request, rank: int, needed: int, free: int, total: int, message: str):
        super().__init__(message)
        self.request = request
        self.rank = rank
        self.needed = needed
        self.free = free
        self.total = total


class BlockPool:
    """One CP rank's free blocks, a stack: the block freed last is handed out first."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):  # callers check every rank first; this is a bookkeeping bug
            raise RuntimeError(f"BlockPool.take({n}) with {len(self._free)} free blocks")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, ids: Sequence[int]) -> None:
        self._free.extend(reversed(list(ids)))

    def reset(self) -> None:
        self._free = list(range(self.num_blocks - 1, -1, -1))


@dataclass
class _Request:
    row: RowPlacement
    """The planner's view of the request, on ranks rotated by ``shift``."""
    shift: int | None = None
    """Physical rank of the planner's rank 0 (chosen when the first block is taken)."""
    blocks: list = field(default_factory=list)
    """Per physical rank, that rank's block ids of this request in slot order."""


@dataclass(frozen=True)
class TokenSlots:
    """Where the tokens added by one :meth:`PagedKVCache.extend` (or one engine step) live."""

    positions: torch.Tensor
    """(n,) int64 global positions of the new tokens (host)."""
    owners: torch.Tensor
    """(n,) int64 CP rank holding each token (host)."""
    slots: torch.Tensor
    """(n,) int64 index into the owner's flattened ``[blocks_per_rank * block_size]`` storage (host)."""
    store: torch.Tensor
    """(n,) int64 on the cache's device: where this rank writes each token -- its slot where this
    rank holds it, else the spare slot ``blocks_per_rank * block_size``."""


class PagedKVCache:
    """Paged KV storage of this CP rank and the block bookkeeping of every rank.

    Requests are added and finished between steps in any order; a finished request's
    blocks go back to their ranks' pools and are reused. Every CP rank must make the same
    calls (``extend``, ``free``) in the same order, as it does when each rank runs the
    same scheduler on the same requests.

    num_layers, num_kv_heads, head_dim: shape of one token's keys/values per layer
    block_size: tokens per block (one page)
    blocks_per_rank: blocks in each rank's pool (this rank allocates them)
    max_seq_len: the context window: most tokens one request may hold over all ranks
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        blocks_per_rank: int,
        max_seq_len: int,
        cp_size: int = 1,
        cp_rank: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("block_size", block_size), ("blocks_per_rank", blocks_per_rank),
                            ("max_seq_len", max_seq_len), ("cp_size", cp_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must lie in [0, {cp_size}), got {cp_rank!r}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.blocks_per_rank = blocks_per_rank
        self.max_seq_len = max_seq_len
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.spare = blocks_per_rank * block_size
        """The spare slot of the flattened storage (takes the tokens other ranks keep; never read)."""
        flat = (num_layers, self.spare + 1, num_kv_heads, head_dim)
        self._k = torch.zeros(flat, dtype=dtype, device=device)
        self._v = torch.zeros(flat, dtype=dtype, device=device)
        shape = (num_layers, blocks_per_rank, block_size, num_kv_heads, head_dim)
        self.k = self._k[:, : self.spare].view(shape)
        self.v = self._v[:, : self.spare].view(shape)
        self.pools = [BlockPool(blocks_per_rank) for _ in range(cp_size)]
        self._requests: dict[Hashable, _Request] = {}

    # ------------------------------------------------------------------ bookkeeping

    @property
    def requests(self) -> list:
        """Ids of the requests that hold (or may hold) blocks, in the order they were added."""
        return list(self._requests)

    def __contains__(self, request) -> bool:
        return request in self._requests

    def length(self, request) -> int:
        """Tokens the request holds over all ranks (its next token's position)."""
        return self._get(request).row.total

    def blocks_used(self) -> list[int]:
        """Blocks in use on each CP rank."""
        return [p.used for p in self.pools]

    def blocks_free(self) -> list[int]:
        """Free blocks on each CP rank."""
        return [p.free for p in self.pools]

    def request_blocks(self, request) -> list[int]:
        """Blocks the request holds on each CP rank."""
        req = self._get(request)
        return [len(b) for b in req.blocks]

    def shard_lengths(self, request) -> list[int]:
        """Tokens of the request held by each CP rank."""
        req = self._get(request)
        if req.shift is None:
            return [0] * self.cp_size
        return [req.row.counts[self._virtual(req, r)] for r in range(self.cp_size)]

    def positions(self, request, rank: int | None = None) -> list[int]:
        """Global positions of the request's tokens on ``rank`` (default this one), in slot order."""
        req = self._get(request)
        rank = self.cp_rank if rank is None else rank
        if req.shift is None:
            return []
        return req.row.positions(self._virtual(req, rank))

    @property
    def nbytes(self) -> int:
        """Bytes of key/value storage this rank allocated (the spare slot included)."""
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    def reset(self) -> None:
        """Forget every request; every block is free again (storage is kept)."""
        self._requests.clear()
        for p in self.pools:
            p.reset()

    def _get(self, request) -> _Request:
        try:
            return self._requests[request]
        except KeyError:
            raise KeyError(f"request {request!r} is not in the paged cache (known: {self.requests})") from None

    def _virtual(self, req: _Request, rank: int) -> int:
        return (rank - req.shift) % self.cp_size

    def add(self, request) -> None:
        """Register an empty request (``extend`` also does this for an unknown id)."""
        if request in self._requests:
            raise ValueError(f"request {request!r} is already in the paged cache; free it before adding it again")
        self._requests[request] = _Request(RowPlacement(self.cp_size, block_size=self.block_size),
                                           blocks=[[] for _ in range(self.cp_size)])

    def extend(self, request, num_tokens: int) -> TokenSlots:
        """Place ``num_tokens`` more tokens of ``request`` and take the blocks they need.

        The new tokens get positions ``length .. length + num_tokens - 1`` (a prompt chunk
        or decoded tokens: the rule is the same). All or nothing: raises
        :class:`CacheOverflowError` past ``max_seq_len`` and :class:`PoolExhaustedError`
        when some rank lacks blocks, in both cases changing nothing. The write indices reach
        the device in one copy (:meth:`extend_host` places without that copy).
        """
        return self.token_slots(*self.extend_host(request, num_tokens))[0]

    def extend_host(self, request, num_tokens: int) -> tuple[list, list, list]:
        """:meth:`extend` on the host: the new tokens' positions, owner ranks and slots on their owners
        (an engine step places several requests, then sends their write indices in one copy)."""
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        created = request not in self._requests
        if created:
            self.add(request)
        try:
            return self._extend(request, self._requests[request], num_tokens)
        except (CacheOverflowError, PoolExhaustedError):
            if created:
                del self._requests[request]
            raise

    def _extend(self, request, req: _Request, num_tokens: int) -> tuple[list, list, list]:
        start = req.row.total
        if start + num_tokens > self.max_seq_len:
            raise CacheOverflowError(
                f"request {request!r} would hold {start + num_tokens} tokens ({start} cached + {num_tokens} new), "
                f"more than the cache's context window of {self.max_seq_len} tokens (max_seq_len); "
                "the other requests are unaffected"
            )
        shift = req.shift
        if shift is None:  # first blocks: start on the rank with the most free blocks
            shift = max(range(self.cp_size), key=lambda r: (self.pools[r].free, -r))
        plan = req.row.copy()  # a trial placement: nothing changes unless every rank has the blocks
        plan.append(num_tokens)
        need = []
        for rank in range(self.cp_size):
            have = len(req.blocks[rank])
            want = math.ceil(plan.counts[(rank - shift) % self.cp_size] / self.block_size)
            need.append(max(0, want - have))
        for rank, n in enumerate(need):
            pool = self.pools[rank]
            if n > pool.free:
                others = sum(1 for rid, r in self._requests.items() if rid != request and r.blocks[rank])
                raise PoolExhaustedError(
                    request, rank, n, pool.free, pool.num_blocks,
                    f"KV pool of CP rank {rank} is exhausted: request {request!r} needs {n} more block(s) of "
                    f"{self.block_size} tokens there to grow from {start} to {start + num_tokens} tokens, but "
                    f"only {pool.free} of {pool.num_blocks} blocks are free ({pool.used} held by {others} other "
                    "request(s)); nothing was allocated. Finish or free requests, or give each rank a larger pool",
                )
        if plan.total:
            req.shift = shift
        for rank, n in enumerate(need):
            req.blocks[rank].extend(self.pools[rank].take(n))
        host = place([req.row], num_tokens, (self.cp_rank - shift) % self.cp_size)  # the step planner's rule
        owners = [(v + shift) % self.cp_size for v in host.owners[0]]
        slots = [req.blocks[o][s // self.block_size] * self.block_size + s % self.block_size
                 for o, s in zip(owners, host.owner_slots[0])]
        return host.positions[0], owners, slots

    def token_slots(self, positions, owners, slots, extra=()) -> tuple[TokenSlots, list[torch.Tensor]]:
        """A :class:`TokenSlots` for tokens at ``positions`` held by ``owners`` in their ``slots``
        (host lists or int64 tensors, one entry per token), with this rank's write index of each
        (its slot, or the spare) on the cache's device; ``extra`` host int64 tensors travel in the
        same one copy and come back as device views (e.g. an engine step's block table)."""
        positions, owners, slots = (torch.as_tensor(x, dtype=torch.int64) for x in (positions, owners, slots))
        store = torch.where(owners == self.cp_rank, slots, torch.full_like(slots, self.spare))
        views, _ = to_device([store, *extra], self.k.device)
        return TokenSlots(positions, owners, slots, views[0]), views[1:]

    def truncate(self, request, length: int) -> None:
        """Keep only the request's first ``length`` tokens (a rewind: the engine will place the rest again).

        The kept tokens stay in their slots; blocks no rank needs any more go back to their pools,
        alike on every rank (every rank makes the same call). Raises ``ValueError`` -- changing
        nothing -- if ``length`` exceeds what the request holds, or if a row of ``length`` tokens
        would not lie where the kept tokens already are (the placement is a function of the
        length alone for rows grown by ``extend``; this checks it rather than assumes it).
        """
        req = self._get(request)
        if not isinstance(length, int) or isinstance(length, bool) or not 0 <= length <= req.row.total:
            raise ValueError(f"request {request!r}: cannot truncate to {length!r} tokens; it holds {req.row.total}")
        if length == req.row.total:
            return
        row = RowPlacement(self.cp_size, block_size=self.block_size)
        if length:
            row.append(length)
        keep = []
        for rank in range(self.cp_size):
            v = self._virtual(req, rank) if req.shift is not None else rank
            old, new = req.row.positions(v), row.positions(v)
            if old[:len(new)] != new:
                raise ValueError(
                    f"request {request!r}: its first {length} tokens do not lie where a {length}-token row "
                    f"would on CP rank {rank}; it cannot be truncated in place"
                )
            keep.append(math.ceil(len(new) / self.block_size))
        for rank, n in enumerate(keep):
            self.pools[rank].give_back(req.blocks[rank][n:])
            del req.blocks[rank][n:]
        req.row = row
        if not length:
            req.shift = None

    def free(self, request) -> None:
        """Return the request's blocks to every rank's pool and forget it."""
        req = self._requests.pop(request, None)
        if req is None:
            raise KeyError(f"request {request!r} is not in the paged cache (known: {self.requests})")
        for rank, ids in enumerate(req.blocks):
            self.pools[rank].give_back(ids)

    # ------------------------------------------------------------------ storage

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, placed: TokenSlots) -> None:
        """Store this rank's share of new tokens' keys/values of one layer.

        layer: an ``int`` in ``[0, num_layers)`` (not a ``bool``, not negative)
        k, v: (n, num_kv_heads, head_dim) floats, exactly one row per token of ``placed`` (from
        :meth:`extend`); rows owned by other ranks go to the spare slot. One scatter per tensor,
        no host read. A bad argument is a ``TypeError``/``ValueError`` naming it, the expected and
        the given value, and nothing is written (shapes are checked, so no broadcast of one KV head
        to several, no row silently dropped).
        """
        layer = self._layer(layer)
        self._check_rows(k, v, placed)
        self._k[layer][placed.store] = k.to(self._k.dtype)
        self._v[layer][placed.store] = v.to(self._v.dtype)

    def _layer(self, layer) -> int:
        """``layer`` as an index into the cache's layers, or an error naming the valid range."""
        try:
            if isinstance(layer, bool):  # operator.index(True) is 1: another layer, written by mistake
                raise TypeError
            layer = operator.index(layer)
        except TypeError:
            raise TypeError(f"write: layer must be an integer index in [0, {self.num_layers}), got "
                            f"{type(layer).__name__} {layer!r}") from None
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"write: layer index {layer} is outside [0, {self.num_layers}) (the cache has "
                             f"{self.num_layers} layers)")
        return layer

    def _check_rows(self, k, v, placed) -> None:
        """k, v: (len(placed.store), num_kv_heads, head_dim) floating tensors on the cache's device."""
        if not isinstance(placed, TokenSlots):
            raise TypeError(f"write: placed must be the TokenSlots of extend(), got {type(placed).__name__}")
        expected = (int(placed.store.numel()), *self._k.shape[2:])
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"write: {name} must be a floating-point tensor, got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
            if tuple(t.shape) != expected:
                raise ValueError(f"write: {name} must have shape {expected} (tokens placed, num_kv_heads, "
                                 f"head_dim), got {tuple(t.shape)}")
            if t.device != self._k.device:
                raise ValueError(f"write: {name} is on {t.device}, the cache on {self._k.device}")

    def rows(self, requests: Sequence, positions: torch.Tensor, *, rank: int | None = None):
        """Block table and visible key count of this rank for query rows ``(request, position)``.

        requests: one request id per query row; positions: (rows,) global positions.
        returns block_table: (rows, width) int32 -- the row's request's blocks on ``rank``
                    (default this rank) in slot order, padded with block 0;
                cache_seqlens: (rows,) int32 -- keys of that request on ``rank`` at positions
                    <= the query's position (causal), 0 for an empty shard.
        A row whose request is ``None`` (padding) sees nothing. Both reach the device in one copy.
        """
        table, seqlens = self.rows_host(requests, positions, rank=rank)
        (table, seqlens), _ = to_device([table, seqlens], self.k.device)
        return table.to(torch.int32), seqlens.to(torch.int32)

    def rows_host(self, requests: Sequence, positions: torch.Tensor, *, rank: int | None = None):
        """:meth:`rows` on the host: ``(block_table, cache_seqlens)`` int32 CPU tensors."""
        rank = self.cp_rank if rank is None else rank
        positions = positions.to(torch.int64).cpu()
        n = len(requests)
        if positions.shape != (n,):
            raise ValueError(f"positions must have shape ({n},) (one per request), got {tuple(positions.shape)}")
        seqlens = torch.zeros(n, dtype=torch.int32)
        groups: dict = {}
        for i, rid in enumerate(requests):
            if rid is not None:
                groups.setdefault(rid, []).append(i)
        width = max([1] + [len(self._get(rid).blocks[rank]) for rid in groups])
        table = torch.zeros((n, width), dtype=torch.int32)
        for rid, idx in groups.items():
            req = self._get(rid)
            ids = req.blocks[rank]
            index = torch.tensor(idx, dtype=torch.int64)
            if ids:
                table[index, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
            if req.shift is None:
                continue
            v = self._virtual(req, rank)
            mine = [b for b in req.row.blocks if b.rank == v]
            if not mine:
                continue
            starts = torch.tensor([b.start for b in mine], dtype=torch.int64)
            slot0 = torch.tensor([b.slot for b in mine], dtype=torch.int64)
            lens = torch.tensor([b.length for b in mine], dtype=torch.int64)
            pos = positions[index]
            j = torch.searchsorted(starts, pos, right=True) - 1
            jc = j.clamp(min=0)
            count = slot0[jc] + torch.minimum(lens[jc], pos - starts[jc] + 1)
            seqlens[index] = torch.where(j >= 0, count, torch.zeros_like(count)).to(torch.int32)
        return table, seqlens
