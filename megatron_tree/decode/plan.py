"""The one step planner: where a step's new tokens go on this CP rank, on the device, with no host read.

Invariant: a step's placement is computed on the host from the rows'
:class:`~megatron_tree.decode.placement.RowPlacement` bookkeeping (the same on every rank, and
never read back from the device), reaches the device in one copy (pinned memory and a
non-blocking copy on CUDA) into buffers whose addresses do not change from step to step, and
is written into storage by plain scatters: a token another rank keeps is written to the
storage's *spare* slot -- one slot past the last real one, written and never read -- so
neither the host nor a kernel ever needs to know which of the step's tokens are this rank's.
That is the one trick every sequence-sharded cache uses: the contiguous cache
(:class:`~megatron_tree.decode.cache.ShardedKVCache`, and through it the transformers
``TreeCache``), Megatron's static ``TreeInferenceContext`` and the paged cache (and through
it Megatron's dynamic context).

Running a step again on the same slots -- the redo of a ``shifted`` step whose merge check
failed -- is a feature of the planner, not of each model adapter: :meth:`StepPlanner.rewind`
takes the last step's tokens back out of the rows' bookkeeping, and the next
:meth:`StepPlanner.step` over the same rows and token count puts them back and returns the
stored plan (same slots, no new copy), so an adapter runs its decode step again unchanged.

Shapes (``rows`` rows of the batch, ``n`` new tokens per row)::

    positions: (rows, n) int64   global position of each new token
    slots:     (rows, n) int64   its slot on this rank, -1 where another rank keeps it
    store:     (rows, n) int64   where this rank writes it: the storage index of its slot, or the spare
    counts:    (rows,)   int64   this rank's tokens of each row after the step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .placement import RowPlacement

__all__ = ["StepPlan", "HostPlan", "place", "place_prompts", "to_device", "StepPlanner"]


@dataclass(frozen=True)
class HostPlan:
    """A step's placement on the host (plain lists, for bookkeeping that must not read the device)."""

    positions: list
    """``[row][i]`` global position of each new token."""
    owners: list
    """``[row][i]`` the (planner's) rank that keeps it."""
    owner_slots: list
    """``[row][i]`` its slot on its owner (a rank stores a row's tokens in arrival order)."""
    slots: list
    """``[row][i]`` its slot on this rank, -1 where another rank keeps it."""
    counts: list
    """``[row]`` this rank's tokens of the row after the step."""

    @property
    def same_positions(self) -> bool:
        """Every row's new tokens sit at the same positions (a fact the host knows without a device read)."""
        return all(p == self.positions[0] for p in self.positions)


def place(rows: Sequence[RowPlacement], n: int | Sequence[int], rank: int | Sequence[int]) -> HostPlan:
    """Append ``n`` tokens to each of ``rows`` (their bookkeeping advances) and say where each went.

    n: tokens per row (one count for all rows, or one per row); rank: the planner rank whose
    slots to report -- this CP rank, or per row where a cache rotates ranks per row (the paged
    cache). Pure host bookkeeping, identical on every CP rank.
    """
    counts_n = [n] * len(rows) if isinstance(n, int) else list(n)
    ranks = [rank] * len(rows) if isinstance(rank, int) else list(rank)
    positions, owners, owner_slots, slots, counts = [], [], [], [], []
    for row, k, r in zip(rows, counts_n, ranks):
        before = list(row.counts)
        first = row.total
        who = row.append(k)
        at = []
        for o in who:  # a token's slot on its owner is the owner's count before it
            at.append(before[o])
            before[o] += 1
        positions.append(list(range(first, first + k)))
        owners.append(who)
        owner_slots.append(at)
        slots.append([s if o == r else -1 for s, o in zip(at, who)])
        counts.append(row.counts[r])
    return HostPlan(positions, owners, owner_slots, slots, counts)


def place_prompts(rows: Sequence[RowPlacement], lengths: Sequence[int], rank: int,
                  chunk: int | None = None) -> torch.Tensor:
    """Place each row's prompt by the placement rule and return the positions this rank keeps.

    rows: the rows' bookkeeping, each empty (``RowPlacement.place_prompt`` records the prompt in it);
    lengths: prompt tokens per row; chunk: the most prompt tokens per forward (chunked prefill).
    returns (len(rows), width) int64 on the CPU: row b's global positions this rank keeps, in storage
    order, padded with -1. ``width`` is the largest share of any rank and row, so it is the same on
    every CP rank (the width of the prefill forward every rank runs). Every sharded cache's prefill
    goes through here: the contiguous cache (and transformers' ``TreeCache``) and Megatron's static
    context.
    """
    plans = [row.place_prompt(n, chunk) for row, n in zip(rows, lengths)]
    width = max(sum(e - s for s, e in ranges) for plan in plans for ranges in plan)
    local = torch.full((len(plans), width), -1, dtype=torch.int64)
    for b, plan in enumerate(plans):
        mine = [t for s, e in plan[rank] for t in range(s, e)]
        local[b, :len(mine)] = torch.tensor(mine, dtype=torch.int64)
    return local


def to_device(host: Sequence, device, *, out: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Integer host bookkeeping onto ``device`` in one copy; returns device views in the given shapes.

    host: int64 tensors or (nested) lists of ints; out: a device int64 buffer to copy into
    (reused from step to step so the views keep their addresses; grown when too small).
    returns (views, the buffer). On CUDA the copy is non-blocking from freshly pinned memory
    (the caching host allocator keeps it alive until the copy has read it), so the host never
    waits for the device here.
    """
    device = torch.device(device)
    parts = [t if isinstance(t, torch.Tensor) else torch.tensor(t, dtype=torch.int64) for t in host]
    parts = [t.to(torch.int64).reshape(t.shape) for t in parts]
    total = sum(t.numel() for t in parts)
    cuda = device.type == "cuda"
    flat = torch.empty(total, dtype=torch.int64, pin_memory=cuda)
    i = 0
    for t in parts:
        flat[i:i + t.numel()] = t.reshape(-1)
        i += t.numel()
    if out is None or out.numel() < total or out.device != device:
        out = torch.empty(max(total, 1), dtype=torch.int64, device=device)
    out[:total].copy_(flat, non_blocking=cuda)
    views, i = [], 0
    for t in parts:
        views.append(out[i:i + t.numel()].view(t.shape))
        i += t.numel()
    return views, out


@dataclass(frozen=True)
class StepPlan:
    """One step's new tokens on this rank, on the storage's device (module docstring: shapes)."""

    positions: torch.Tensor
    slots: torch.Tensor
    store: torch.Tensor
    counts: torch.Tensor
    host: HostPlan
    """The same plan on the host."""
    rows: tuple[int, int]
    """The rows ``[start, end)`` of the planner's batch the step covers."""


class StepPlanner:
    """Plans the decode steps of one batch of rows on one CP rank; runs the last one again on request.

    rows: the batch's :class:`RowPlacement` (the planner appends to them); rank: this CP rank;
    spare: the storage index of the spare slot (tokens other ranks keep are written there);
    device: where plans go; index: maps ``(row, slot)`` to the storage index a write uses
    (default: the slot itself, for storage laid out ``[row, slot]``); reserve: int64 entries of
    the device buffer to allocate now (a cache allocates its step buffer with its storage, so a
    decode step allocates nothing that persists: ``4 * batch`` holds a one-token step).
    """

    def __init__(self, rows: list[RowPlacement], rank: int, *, spare: int, device,
                 index: Callable[[int, int], int] | None = None, reserve: int = 0):
        self.rows = rows
        self.rank = rank
        self.spare = spare
        self.device = torch.device(device)
        self.index = index
        self.last: StepPlan | None = None
        """The last step planned (what :meth:`rewind` takes back and the next step reuses)."""
        self._rewound = False
        self._buffer = torch.empty(reserve, dtype=torch.int64, device=self.device) if reserve else None

    def step(self, start: int = 0, end: int | None = None, n: int = 1) -> StepPlan:
        """Place ``n`` new tokens at the end of each row in ``[start, end)``; returns the plan on the device.

        After :meth:`rewind`, the same rows and ``n`` get the stored plan back (its tokens are
        placed again, on the same slots): no new placement, no device copy.
        """
        end = len(self.rows) if end is None else end
        last, rewound, self._rewound = self.last, self._rewound, False
        if rewound and last is not None and last.rows == (start, end) and all(len(p) == n for p in last.host.positions):
            place(self.rows[start:end], n, self.rank)
            return last
        host = place(self.rows[start:end], n, self.rank)
        store = [[self._store(start + b, s) for s in row] for b, row in enumerate(host.slots)]
        (positions, slots, stored, counts), self._buffer = to_device(
            [host.positions, host.slots, store, host.counts], self.device, out=self._buffer)
        self.last = StepPlan(positions, slots, stored, counts, host, (start, end))
        return self.last

    def _store(self, row: int, slot: int) -> int:
        if slot < 0:
            return self.spare
        return slot if self.index is None else self.index(row, slot)

    def rewind(self) -> None:
        """Take the last step's tokens back out of the rows' bookkeeping, to run that step again.

        The storage is not touched: running the step again writes the same keys to the same
        slots (idempotent). The next :meth:`step` over the same rows and ``n`` reuses the plan.
        """
        if self.last is None:
            raise RuntimeError("rewind() without a step to take back")
        if self._rewound:
            raise RuntimeError("rewind() twice: the last step was already taken back")
        start, end = self.last.rows
        for row, positions in zip(self.rows[start:end], self.last.host.positions):
            row.undo_append(len(positions))
        self._rewound = True

    def reset(self, rows: list[RowPlacement]) -> None:
        """Plan for new rows (the cache was reset); the device buffer is kept."""
        self.rows = rows
        self.last = None
        self._rewound = False
