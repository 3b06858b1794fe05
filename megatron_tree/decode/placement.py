"""One placement rule for every sequence-sharded KV cache: which CP rank holds each token.

Invariant: where a token lives is a pure function of the row's prompt length, the CP size,
the prompt layout, the block size, the per-rank capacity and how many tokens were appended
since -- so every CP rank computes the same answer without communicating. This module
imports neither torch nor torch.distributed; the one step planner (``plan.py``) turns its
answers into a step's device tensors for every cache that stores tokens (``cache.py`` and
through it the transformers ``Cache``, Megatron's static context in
``integrations/megatron/static.py``, ``paged.py`` and through it Megatron's dynamic context).
Having one rule and one planner is what keeps them in agreement (docs/design.md §6).

The rule:

* prompt, ``layout="load_balanced"`` -- the prompt is cut into ``2 * cp_size`` chunks and
  rank ``r`` keeps chunks ``r`` and ``2 * cp_size - 1 - r``, as Megatron-Core's training CP
  does (``get_batch_on_this_cp_rank``), so causal work is balanced and a trained layout
  needs no reshard. Megatron requires the length to be a multiple of ``2 * cp_size``; here
  the first ``length % (2 * cp_size)`` chunks are one token longer instead.
* prompt, ``layout="contiguous"`` -- ``cp_size`` consecutive chunks, rank ``r`` keeps chunk ``r``.
* appended (decoded) tokens -- in blocks of ``block_size``: a block fills up on one rank,
  the next block opens on the least-loaded rank that has room, ties broken round-robin
  after the previous block's rank. Shards never differ by more than one block (plus the
  at most two tokens of a load-balanced prompt), and appends never pile onto one rank.

A rank stores a row's tokens in the order they arrive; a token's *slot* is its index in
that order (prompt tokens in ascending position, then appended tokens). A paged cache
maps a slot to ``(page, offset) = divmod(slot, page_size)`` in that rank's own pages.

Example (4 ranks, a 10-token prompt, blocks of 4)::

    row = RowPlacement(4, block_size=4)
    row.place_prompt(10)   # [[(0, 2), (9, 10)], [(2, 4), (8, 9)], [(4, 5), (7, 8)], [(5, 6), (6, 7)]]
    row.append(6)          # [2, 2, 2, 2, 3, 3]: ranks 2 and 3 held the fewest (2), rank 2 first
    row.locate(12)         # (2, 4): token 12 is rank 2's fifth stored token
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["LAYOUTS", "Block", "RowPlacement", "PlacementError", "split_range", "prefill_ranges"]

LAYOUTS = ("load_balanced", "contiguous")


class PlacementError(ValueError):
    """A placement that cannot be made: bad arguments, or every rank is full."""


def split_range(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges covering ``[0, length)``, the first ``length % parts`` one longer."""
    base, extra = divmod(length, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise PlacementError(f"unknown cache layout {layout!r}; expected one of {LAYOUTS}")


def prefill_ranges(length: int, cp_size: int, layout: str, chunk: int | None = None) -> list[list[tuple[int, int]]]:
    """Global position ranges ``[start, end)`` of a prompt of ``length`` tokens kept by each CP rank.

    chunk: the most prompt tokens one forward computes (chunked prefill), or None (one forward).
        With a chunk shorter than the prompt, the prompt is cut into windows ``[w * chunk,
        (w + 1) * chunk)`` that run one after the other (a window's queries need every earlier
        key), and each window is laid out by ``layout`` on its own, so every forward's work is
        balanced; a rank keeps the union of its ranges over the windows (empty ranges dropped).

    Returns one list of ranges per rank, in ascending position order (the order in which
    the rank stores them).
    """
    _check_layout(layout)
    if not isinstance(cp_size, int) or cp_size < 1:
        raise PlacementError(f"cp_size must be a positive integer, got {cp_size!r}")
    if not isinstance(length, int) or length < 0:
        raise PlacementError(f"prompt length must be a non-negative integer, got {length!r}")
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
        raise PlacementError(f"chunk (most prompt tokens per forward) must be a positive integer or None, "
                             f"got {chunk!r}")
    if chunk is not None and chunk < length:
        out: list[list[tuple[int, int]]] = [[] for _ in range(cp_size)]
        for start in range(0, length, chunk):
            window = prefill_ranges(min(chunk, length - start), cp_size, layout)
            for rank, ranges in enumerate(window):
                out[rank].extend((start + s, start + e) for s, e in ranges if e > s)
        return out
    if layout == "contiguous":
        return [[r] for r in split_range(length, cp_size)]
    chunks = split_range(length, 2 * cp_size)
    return [[chunks[r], chunks[2 * cp_size - 1 - r]] for r in range(cp_size)]


@dataclass(frozen=True)
class Block:
    """A run of appended tokens held by one rank: global positions ``[start, start + length)``."""

    rank: int
    """CP rank that stores the block."""
    start: int
    """Global position of the block's first token."""
    length: int
    """Tokens in the block (``block_size``, or fewer for the open block or where a rank filled up)."""
    slot: int
    """Slot of the block's first token on ``rank``."""


class RowPlacement:
    """Where the tokens of one row (one request) live over ``cp_size`` ranks.

    Every CP rank keeps an identical copy and drives it with the same calls: one
    :meth:`place_prompt`, then :meth:`append` as tokens are generated (one step at a time
    or several at once). Rows of a batch are independent objects, so rows of different
    lengths need no padding.

    capacity: most tokens one rank may hold for this row (``None``: unbounded). A block
    that would overflow its rank is closed early and the next token opens a block on the
    least-loaded rank with room.
    """

    def __init__(self, cp_size: int, *, layout: str = "load_balanced", block_size: int = 16,
                 capacity: int | None = None):
        if not isinstance(cp_size, int) or cp_size < 1:
            raise PlacementError(f"cp_size must be a positive integer, got {cp_size!r}")
        _check_layout(layout)
        if not isinstance(block_size, int) or block_size < 1:
            raise PlacementError(f"block_size must be a positive integer, got {block_size!r}")
        if capacity is not None and (not isinstance(capacity, int) or capacity < 1):
            raise PlacementError(f"capacity must be a positive integer or None, got {capacity!r}")
        self.cp_size = cp_size
        self.layout = layout
        self.block_size = block_size
        self.capacity = capacity
        self.counts = [0] * cp_size
        """Tokens held by each rank."""
        self.prompt_len = 0
        """Tokens placed by :meth:`place_prompt`."""
        self.total = 0
        """Tokens in the row (the next token's global position)."""
        self.blocks: list[Block] = []
        """Appended tokens, block by block, in position order."""
        self._ranges: list[list[tuple[int, int]]] = [[] for _ in range(cp_size)]
        self._starts: list[int] = []  # blocks' start positions, for bisect

    # ------------------------------------------------------------------ building the plan

    def place_prompt(self, length: int, chunk: int | None = None) -> list[list[tuple[int, int]]]:
        """Place a prompt of ``length`` tokens at positions ``[0, length)``; the row must be empty.

        chunk: the most prompt tokens per forward (chunked prefill: each window laid out on its own)
        Returns the position ranges each rank keeps (see :func:`prefill_ranges`).
        """
        if self.total:
            raise PlacementError(f"the row already holds {self.total} tokens; place_prompt starts an empty row")
        ranges = prefill_ranges(length, self.cp_size, self.layout, chunk)
        counts = [sum(e - s for s, e in rr) for rr in ranges]
        if self.capacity is not None and max(counts) > self.capacity:
            raise PlacementError(
                f"a {length}-token prompt puts {max(counts)} tokens on one rank, beyond its capacity of "
                f"{self.capacity}; size the cache for at least {length} tokens per row"
            )
        self._ranges = ranges
        self.counts = counts
        self.prompt_len = self.total = length
        return [list(rr) for rr in ranges]

    def _open_block(self) -> int:
        free = [r for r in range(self.cp_size) if self.capacity is None or self.counts[r] < self.capacity]
        if not free:
            raise PlacementError(
                f"every rank holds its capacity of {self.capacity} tokens ({self.total} in the row); "
                "size the cache for more tokens"
            )
        least = min(self.counts[r] for r in free)
        last = self.blocks[-1].rank if self.blocks else -1
        order = [(last + 1 + i) % self.cp_size for i in range(self.cp_size)]
        owner = next(r for r in order if r in free and self.counts[r] == least)
        self.blocks.append(Block(owner, self.total, 0, self.counts[owner]))
        self._starts.append(self.total)
        return owner

    def append(self, n: int = 1) -> list[int]:
        """Place the next ``n`` tokens (positions ``total .. total + n - 1``); returns their owner ranks."""
        if not isinstance(n, int) or n < 0:
            raise PlacementError(f"append needs a non-negative token count, got {n!r}")
        owners = []
        for _ in range(n):
            blk = self.blocks[-1] if self.blocks else None
            if (blk is None or blk.length >= self.block_size
                    or (self.capacity is not None and self.counts[blk.rank] >= self.capacity)):
                self._open_block()
                blk = self.blocks[-1]
            self.blocks[-1] = Block(blk.rank, blk.start, blk.length + 1, blk.slot)
            self.counts[blk.rank] += 1
            self.total += 1
            owners.append(blk.rank)
        return owners

    def undo_append(self, n: int) -> None:
        """Take back the last ``n`` appended tokens: the row is as it was before they were appended,
        so appending ``n`` again places them on the same ranks and slots (a step run again)."""
        appended = sum(b.length for b in self.blocks)
        if not isinstance(n, int) or not 0 <= n <= appended:
            raise PlacementError(f"undo_append needs 0 <= n <= {appended} (the appended tokens), got {n!r}")
        for _ in range(n):
            blk = self.blocks[-1]
            self.counts[blk.rank] -= 1
            self.total -= 1
            if blk.length == 1:
                self.blocks.pop()
                self._starts.pop()
            else:
                self.blocks[-1] = Block(blk.rank, blk.start, blk.length - 1, blk.slot)

    def truncate(self, length: int) -> None:
        """Keep only the row's first ``length`` tokens (positions ``[0, length)``), dropping the rest on every rank.

        A rank stores a row's tokens in ascending position order (the prompt's ranges, then its
        blocks), so what each rank keeps is a prefix of its slots: ``counts`` says how long. Cut
        inside the appended tokens this is :meth:`undo_append`; cut inside the prompt, the prompt
        becomes the kept part of it (each rank's ranges end at ``length``) and the blocks go.
        Later appends are placed by the rule from the row as it now stands, so every CP rank that
        truncates alike keeps placing alike.
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.total:
            raise PlacementError(f"truncate needs 0 <= length <= {self.total} (the row's tokens), got {length!r}")
        if length >= self.prompt_len:
            self.undo_append(self.total - length)
            return
        self.blocks, self._starts = [], []
        self._ranges = [[(s, min(e, length)) for s, e in rr if s < length] for rr in self._ranges]
        self.counts = [sum(e - s for s, e in rr) for rr in self._ranges]
        self.prompt_len = self.total = length

    def copy(self) -> "RowPlacement":
        """An independent copy (plan ahead without committing)."""
        other = RowPlacement(self.cp_size, layout=self.layout, block_size=self.block_size, capacity=self.capacity)
        other.counts = list(self.counts)
        other.prompt_len, other.total = self.prompt_len, self.total
        other.blocks = list(self.blocks)
        other._ranges = [list(rr) for rr in self._ranges]
        other._starts = list(self._starts)
        return other

    # ------------------------------------------------------------------ questions

    def locate(self, t: int) -> tuple[int, int]:
        """``(rank, slot)`` of global token ``t``: the rank that holds it and its index in that rank's storage."""
        if not 0 <= t < self.total:
            raise PlacementError(f"token {t} is outside the row's {self.total} tokens")
        if t < self.prompt_len:
            for rank, ranges in enumerate(self._ranges):
                before = 0
                for s, e in ranges:
                    if s <= t < e:
                        return rank, before + t - s
                    before += e - s
        blk = self.blocks[bisect.bisect_right(self._starts, t) - 1]
        return blk.rank, blk.slot + t - blk.start

    def owner(self, t: int) -> int:
        """CP rank that holds global token ``t``."""
        return self.locate(t)[0]

    def block_owner(self, j: int) -> int:
        """CP rank that holds appended block ``j`` (0 = the first block after the prompt)."""
        if not 0 <= j < len(self.blocks):
            raise PlacementError(f"block {j} does not exist; the row has {len(self.blocks)} appended blocks")
        return self.blocks[j].rank

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def positions(self, rank: int) -> list[int]:
        """Global positions held by ``rank``, in storage (slot) order."""
        out = [t for s, e in self._ranges[rank] for t in range(s, e)]
        for blk in self.blocks:
            if blk.rank == rank:
                out.extend(range(blk.start, blk.start + blk.length))
        return out

    def __repr__(self) -> str:
        return (f"RowPlacement(cp_size={self.cp_size}, layout={self.layout!r}, block_size={self.block_size}, "
                f"total={self.total}, counts={self.counts})")
