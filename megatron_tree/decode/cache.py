"""The sequence-sharded KV cache: this CP rank's keys/values, their global positions, the plan.

Invariant: where every token of every row lives is a pure function of the prompt lengths,
the CP size, the layout and the block size, so every CP rank computes the same placement
without communicating, and this module never communicates. A rank stores only its own
tokens, in a buffer of ``ceil(max_seq_len / cp_size)`` slots per row (plus the one spare slot
that takes the tokens other ranks keep): memory per rank is 1/CP of an unsharded cache
(rounded up to a whole token, plus one).

Placement (docs/design.md §6) is decided by :mod:`.placement`, the rule every
sequence-sharded cache shares: the prompt in Megatron-Core's load-balanced 2·CP chunks (or
contiguous chunks), decoded tokens in blocks of ``block_size`` that open on the least-loaded
rank, round-robin on ties; a decode step is planned and written by :mod:`.plan`, the one step
planner (one copy to the device, no host read, the spare slot). This module stores what they
decide.

Within a rank a row's tokens are stored in the order they arrived; their global positions
are kept beside them (``positions``) for RoPE and causal masking.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Literal

import torch

from .metadata import StepMetadata
from .placement import LAYOUTS, RowPlacement, prefill_ranges
from .plan import StepPlanner, place_prompts

# A compiled step's key/value write as one op that mutates the storage in place. Written as indexing on
# a view of the (layers, ...) storage, it is functionalised: Inductor copies the whole storage, scatters
# the token and copies it back, every layer of every step (two passes over every layer's cache). Declared
# as mutating its inputs, the op runs in place on the graph's static storage.
torch.library.define("megatron_tree::kv_append",
                     "(Tensor(a!) k, Tensor(b!) v, int layer, Tensor rows, Tensor at, Tensor new_k, Tensor new_v) -> ()")


def _kv_append_impl(k, v, layer, rows, at, new_k, new_v):
    """k, v: (layers, batch, capacity, heads, d) storage; rows, at: (batch,) int64; new_k, new_v:
    (batch, 1, heads, d) -> writes ``k[layer][rows, at] = new_k[:, 0]`` (and v)."""
    # (select and index_put_: the same write as ``k[layer][rows, at] = ...``, without Python's indexing)
    k.select(0, layer).index_put_((rows, at), new_k.select(1, 0).to(k.dtype))
    v.select(0, layer).index_put_((rows, at), new_v.select(1, 0).to(v.dtype))


@torch.library.register_fake("megatron_tree::kv_append")
def _kv_append_fake(k, v, layer, rows, at, new_k, new_v):
    return None


torch.library.impl("megatron_tree::kv_append", "CompositeExplicitAutograd", _kv_append_impl)

__all__ = ["CacheConfig", "CacheOverflowError", "ShardedKVCache", "prefill_ranges", "LAYOUTS", "static_length"]

Layout = Literal["load_balanced", "contiguous"]


STATIC_MIN_LENGTH = 64
"""The smallest length :func:`static_length` sizes a static cache for."""
STATIC_LENGTHS_PER_OCTAVE = 4
"""How many lengths :func:`static_length` has between two powers of two."""


def static_length(tokens: int) -> int:
    """The length a static cache (fixed shapes: a compiled or graph-captured step) is sized for, to hold ``tokens``.

    The smallest of 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, ... (four per octave, evenly spaced) that
    is at least ``tokens``. A compiled step is traced once per cache shape, so caches made for nearby lengths
    (an eval's batches, each sized for its longest prompt) share one trace: a sweep of lengths from 1K to 4K
    takes at most 8 shapes, not one per batch. The price: at most 1.25x the slots, paid in storage, in a CPU
    step's masked reads, and on a GPU in kernel programs that find no key of the row and stop at once
    (the kernel's split count follows the cache's length, which a captured launch cannot change).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"static_length: expected a token count (an int >= 0), got {tokens!r}")
    n = STATIC_MIN_LENGTH
    while n < tokens:
        n += (1 << (n.bit_length() - 1)) // STATIC_LENGTHS_PER_OCTAVE  # a quarter of the octave n is in
    return n


class CacheOverflowError(ValueError):
    """A row would hold more tokens than the cache was sized for."""


@dataclass(frozen=True)
class CacheConfig:
    """How prompt and generated tokens are spread over the CP ranks."""

    layout: Layout = "load_balanced"
    """``"load_balanced"`` (Megatron-Core's 2*CP chunks) or ``"contiguous"`` (CP chunks) for the prompt."""
    block_size: int = 16
    """Generated tokens go to one rank in blocks of this many tokens, then the next block moves on."""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown cache layout {self.layout!r}; expected one of {LAYOUTS}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")


class StoragePool:
    """The storage of one model's last static cache that ended, kept for the model's next cache of the same shape.

    A captured decode step (a CUDA graph) reads and writes the cache's storage at the addresses it was recorded
    with. A new cache's storage lives at other addresses, so without the pool the first step of every new cache
    records the graph again -- each ``generate`` call of an eval or of lm-eval's requests -- and Inductor's
    CUDA-graph trees keep every recording, checking each new call against them in turn. (transformers keeps
    one static cache per model for the same reason.) A cache made with a pool hands its storage back when it
    ends -- it is garbage, or ``reset`` -- and the model's next cache of the same :meth:`key` takes it over
    (``start_prefill`` resets it): the steps replay what was recorded for it.

    One storage is kept, the last one handed back. A cache of another shape drops it before its own storage is
    allocated, so the pool never adds a storage to the peak memory of a new one; between calls it holds what
    one cache held (:meth:`clear` lets it go).
    """

    def __init__(self):
        self._kept: tuple[tuple, ShardedKVCache] | None = None
        """(key, storage): one object, swapped whole -- a cache's finalizer may give a storage back in the middle
        of a :meth:`take` (a gc pass there, or in another thread), and a storage must never be handed out under
        another storage's key."""
        self.reused = 0
        """How many caches took over a storage handed back (rather than allocating their own)."""
        self.layer_shapes: dict[tuple, tuple] = {}
        """``{(heads, head_dim, head_dim_v) the config describes: what the layers store}``, where they differ: a
        cache learns it at its first write and re-makes its storage (``TreeCache._reshape``); the model's later
        caches start with the layers' shapes, so their first storage is of the key kept here (else each one
        dropped the kept storage for one of the config's shapes, then allocated anew at its first write)."""

    @staticmethod
    def key(**kwargs) -> tuple:
        """What makes two storages interchangeable: every :class:`ShardedKVCache` constructor argument
        (``torch.device`` normalised: ``"cuda"`` and ``"cuda:0"`` name one device only once it is resolved)."""
        dev = torch.device(kwargs["device"])
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return tuple(sorted({**kwargs, "device": dev}.items(), key=lambda kv: kv[0]))

    def take(self, key: tuple) -> ShardedKVCache | None:
        """The storage handed back under ``key`` (now the caller's), else None: a storage of another key is
        dropped first (the caller allocates next)."""
        kept, self._kept = self._kept, None
        if kept is not None and kept[0] == key:
            self.reused += 1
            return kept[1]
        return None

    def give(self, key: tuple, storage: ShardedKVCache) -> None:
        """Keep ``storage`` (its cache ended) for the next :meth:`take` of ``key``; drops the one kept before."""
        self._kept = (key, storage)

    def clear(self) -> None:
        """Let the kept storage go (its memory returns to torch's allocator)."""
        self._kept = None

    @property
    def holds(self) -> int:
        """Bytes of keys and values kept (0 when empty)."""
        kept = self._kept
        return 0 if kept is None else kept[1].kv_nbytes


def _zeros(shape: tuple, dtype, device, head_major: bool) -> torch.Tensor:
    """Zeros of (layers, batch, slots, heads, dim), stored (layers, batch, heads, slots, dim) if ``head_major``."""
    if not head_major:
        return torch.zeros(shape, dtype=dtype, device=device)
    nl, b, c, h, d = shape
    return torch.zeros((nl, b, h, c, d), dtype=dtype, device=device).permute(0, 1, 3, 2, 4)


class ShardedKVCache:
    """This CP rank's share of a batch's KV cache, for every layer.

    Storage on this rank (``C = ceil(max_seq_len / cp_size)`` slots per row):

    k: (num_layers, batch, C, num_kv_heads, head_dim), v: (..., head_dim_v) in ``dtype``
        (``head_dim_v`` defaults to ``head_dim``; MLA's values are narrower than its keys)
    positions: (batch, C) int64 -- global position of every stored token, -1 in free slots
    seqlens: (batch,) int32 -- tokens of each row held by this rank (``cache_seqlens`` of
        ``tree_decode``)

    ``k``, ``v`` and ``positions`` are views of buffers with one more slot per row, the spare
    slot ``C``, where a step writes the tokens another rank keeps (never read; :mod:`.plan`).

    head_major: where ``k`` and ``v`` keep each head's keys together in memory (strides
    ``(B*H*C*D, H*C*D, D, C*D, 1)`` under the same (layer, batch, slot, head, dim) indexing):
    default on CPU, where the decode's two matmuls per head then read one contiguous (n, d)
    matrix instead of rows strided by ``H*D`` -- on one core of the 2-core development machine
    that reads the keys at about twice the rate (fp32, 3 KV heads of 64, 2K keys: 375 vs 670 us a
    layer). Token-major (contiguous ``(..., C, H, D)``) on other devices, where the kernels were
    measured with it.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        cp_size: int = 1,
        head_dim_v: int | None = None,
        cp_rank: int = 0,
        config: CacheConfig = CacheConfig(),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        head_major: bool | None = None,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("max_seq_len", max_seq_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("head_dim_v", head_dim_v),
                            ("cp_size", cp_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0 <= cp_rank < cp_size:
            raise ValueError(f"cp_rank must lie in [0, {cp_size}), got {cp_rank}")
        self.num_layers = num_layers
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.config = config
        self.capacity = math.ceil(max_seq_len / cp_size)
        if head_major is None:
            head_major = torch.device(device).type == "cpu"
        shape = (num_layers, batch_size, self.capacity + 1, num_kv_heads, head_dim)  # + the spare slot
        self._k, self._v = (_zeros(shape[:-1] + (d,), dtype, device, head_major) for d in (head_dim, head_dim_v))
        self._positions = torch.full((batch_size, self.capacity + 1), -1, dtype=torch.int64, device=device)
        self.k, self.v = self._k[:, :, : self.capacity], self._v[:, :, : self.capacity]
        self.positions = self._positions[:, : self.capacity]
        self.seqlens = torch.zeros(batch_size, dtype=torch.int32, device=device)
        self._batch_index = torch.arange(batch_size, device=device)
        # the decode step's metadata buffers (StepMetadata): filled in place by begin_decode_step
        self._step_q = torch.zeros((batch_size, 1), dtype=torch.int64, device=device)
        self._step_store = torch.full((batch_size,), self.capacity, dtype=torch.int64, device=device)
        self._metadata: StepMetadata | None = None
        self._rows: list[RowPlacement] = []
        self._planner = StepPlanner([], cp_rank, spare=self.capacity, device=self.k.device, reserve=4 * batch_size)
        self.reset()

    # ------------------------------------------------------------------ bookkeeping

    def reset(self) -> None:
        """Forget every token (storage is kept)."""
        self._positions.fill_(-1)
        self.seqlens.zero_()
        self._rows = [RowPlacement(self.cp_size, layout=self.config.layout, block_size=self.config.block_size,
                                   capacity=self.capacity) for _ in range(self.batch_size)]
        self._planner.reset(self._rows)

    @property
    def lengths(self) -> list[int]:
        """Global number of tokens in each row."""
        return [row.total for row in self._rows]

    @property
    def shard_lengths(self) -> list[list[int]]:
        """``[row][rank]``: tokens of each row held by each CP rank (the same on every rank)."""
        return [list(row.counts) for row in self._rows]

    @property
    def local_max(self) -> int:
        """Most tokens of any row held by this rank (host-side: no device sync)."""
        return max((row.counts[self.cp_rank] for row in self._rows), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes this rank allocated for keys, values and positions (the spare slot included)."""
        return sum(t.numel() * t.element_size() for t in (self._k, self._v, self._positions, self.seqlens))

    @property
    def kv_nbytes(self) -> int:
        """Bytes this rank allocated for keys and values (the spare slot included)."""
        return sum(t.numel() * t.element_size() for t in (self._k, self._v))

    def unsharded_kv_nbytes(self) -> int:
        """Bytes keys and values of the whole cache would take on one device."""
        per_token = sum(t[:, :, :1].numel() * t.element_size() for t in (self.k, self.v)) // self.batch_size
        return per_token * self.batch_size * self.max_seq_len

    # ------------------------------------------------------------------ prefill

    def start_prefill(self, lengths: list[int], chunk: int | None = None) -> torch.Tensor:
        """Place prompts of ``lengths`` tokens (one per row) and return this rank's positions.

        chunk: the most prompt tokens per forward (chunked prefill; ``placement.prefill_ranges``), or None.
        Resets the cache. returns local_positions: (batch, S) int64 -- global positions of the
        prompt tokens this rank keeps, in storage order, -1 as padding; ``S`` is the largest
        share of any rank and row, so it is the same on every CP rank.
        """
        if len(lengths) != self.batch_size:
            raise ValueError(f"got {len(lengths)} prompt lengths for a cache of batch size {self.batch_size}")
        for b, n in enumerate(lengths):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"prompt {b} must have at least one token, got length {n!r}")
            if n > self.max_seq_len:
                raise CacheOverflowError(
                    f"prompt {b} has {n} tokens but the cache holds at most {self.max_seq_len} per row; "
                    "create the cache with a larger max_seq_len"
                )
        self.reset()
        local = place_prompts(self._rows, lengths, self.cp_rank, chunk).to(self.positions.device)
        width = local.shape[1]
        n_local = min(width, self.capacity)
        self.positions[:, :n_local] = local[:, :n_local]
        self._count_rows()
        return local

    def _layer(self, layer, what: str) -> int:
        """``layer`` as an index into the cache's layers, or a ValueError naming the valid range."""
        try:
            if isinstance(layer, bool):  # operator.index(True) is 1: a flag passed by mistake
                raise TypeError
            index = operator.index(layer)
        except TypeError:
            raise TypeError(f"{what}: layer must be an integer index, got {type(layer).__name__} {layer!r}") from None
        if not 0 <= index < self.num_layers:
            raise ValueError(f"{what}: layer index {index} is outside [0, {self.num_layers}) (the cache has "
                             f"{self.num_layers} layers)")
        return index

    def _check_kv(self, what: str, k, v, tokens: int | None) -> None:
        """k, v must be (batch, tokens, num_kv_heads, head_dim[_v]) floats; ``tokens=None`` allows any length."""
        _, b, _, hkv, _ = self.k.shape
        for name, t, d in (("k", k, self.k.shape[-1]), ("v", v, self.v.shape[-1])):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise TypeError(f"{what}: {name} must be a floating-point tensor, got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
            shape = tuple(t.shape)
            if len(shape) != 4 or shape[0] != b or shape[2:] != (hkv, d) or (tokens is not None and shape[1] != tokens):
                expected = f"({b}, {'S' if tokens is None else tokens}, {hkv}, {d})"
                raise ValueError(f"{what}: {name} must have shape {expected} (batch, tokens, num_kv_heads, "
                                 f"head_dim), got {shape}")

    def write_prefill(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this rank's prompt keys/values of one layer.

        k, v: (batch, S, num_kv_heads, head_dim) in the order of :meth:`start_prefill`'s
        positions (S at least this rank's largest share); padding entries are ignored.
        """
        layer = self._layer(layer, "write_prefill")
        self._check_kv("write_prefill", k, v, None)
        s = k.shape[1]
        n = self.local_max
        if s < n or v.shape[1] != s:
            raise ValueError(f"write_prefill: k and v must cover the same S >= {n} tokens per row (this rank "
                             f"keeps up to {n}), got k {tuple(k.shape)} and v {tuple(v.shape)}")
        self.k[layer, :, :n] = k[:, :n].to(self.k.dtype)
        self.v[layer, :, :n] = v[:, :n].to(self.v.dtype)

    def write_prefill_slots(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store part of this rank's prompt keys/values of one layer at the given slots (chunked prefill).

        k, v: (batch, S, num_kv_heads, head_dim); slots: (batch, S) integer slots in [0, capacity),
        or -1 for a filler entry (written to the spare slot, never read).
        """
        layer = self._layer(layer, "write_prefill_slots")
        self._check_kv("write_prefill_slots", k, v, None)
        if (not isinstance(slots, torch.Tensor) or slots.dtype.is_floating_point
                or tuple(slots.shape) != tuple(k.shape[:2]) or v.shape[1] != k.shape[1]):
            raise ValueError(f"write_prefill_slots: slots must be an integer {tuple(k.shape[:2])} tensor (batch, "
                             f"tokens) matching k and v, got {tuple(getattr(slots, 'shape', ()))}")
        at = torch.where(slots >= 0, slots, self.capacity).to(self._k.device)
        rows = self._batch_index[:, None].expand_as(at)
        for buf, new in ((self._k, k), (self._v, v)):
            buf[layer][rows, at] = new.to(buf.dtype)

    # ------------------------------------------------------------------ decode

    def begin_decode_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Place one new token at the end of every row.

        returns positions: (batch,) int64 -- the new tokens' global positions;
                slots: (batch,) int64 -- storage index on this rank, -1 where another rank
                holds the row's new token. ``seqlens`` already counts the new tokens.

        The step planner (:mod:`.plan`): the plan comes from the rows' placement bookkeeping
        (no device tensor is read) and reaches the device in one copy (on CUDA non-blocking,
        from pinned memory) into a buffer the planner keeps. The returned tensors are views of
        it, overwritten by the next step. After :meth:`rewind_step` this places the same tokens
        on the same slots again and returns the same plan.
        """
        for b, row in enumerate(self._rows):
            if row.total == 0:
                raise ValueError(f"row {b} is empty: prefill a prompt before decoding")
            if row.total + 1 > self.max_seq_len:
                raise CacheOverflowError(
                    f"row {b} already holds {row.total} tokens, the cache's max_seq_len; "
                    "cannot append another (create the cache with a larger max_seq_len)"
                )
        plan = self._planner.step(0, self.batch_size, 1)
        pos, slot = plan.positions[:, 0], plan.slots[:, 0]
        self.seqlens.copy_(plan.counts)  # int64 -> int32 on the device
        # positions[b, slot] = pos where this rank keeps the token, the spare slot elsewhere
        self._positions[self._batch_index, plan.store[:, 0]] = pos
        self._step_q[:, 0].copy_(pos)
        self._step_store.copy_(plan.store[:, 0])
        return pos, slot

    def step_metadata(self, static: bool = False) -> StepMetadata:
        """The metadata of the step :meth:`begin_decode_step` placed (its buffers are this cache's, updated
        in place each step). static: the step reads every storage slot (``kv_len = capacity``: the same
        shapes at every step, for a compiled or graph-captured step); else only up to the longest row this
        rank holds (less work per step, a shape that grows)."""
        kv_len = self.capacity if static else self.local_max
        meta = self._metadata
        if meta is None or meta.kv_len != kv_len:
            meta = self._metadata = StepMetadata(self.seqlens, self._step_q, self.positions[:, :kv_len],
                                                 self._step_store, kv_len)
        return meta

    def step_buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor a decode step reads or writes (storage and the step's metadata): their addresses
        never change, so a compiled or graph-captured step may hold them."""
        return self._k, self._v, self._positions, self.seqlens, self._step_q, self._step_store, self._batch_index

    def append_step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """:meth:`append` at the slots of the step :meth:`begin_decode_step` placed, read from the step's
        metadata buffer (no check of a caller's slots: a compiled step calls this)."""
        if torch.compiler.is_compiling():  # in place on the static storage (see kv_append above)
            torch.ops.megatron_tree.kv_append(self._k, self._v, layer, self._batch_index, self._step_store, k, v)
            return
        _kv_append_impl(self._k, self._v, layer, self._batch_index, self._step_store, k, v)

    def reorder_rows(self, order: list[int]) -> None:
        """Row ``i`` takes row ``order[i]``'s keys, values and positions (beam search's reorder: a beam may
        be taken by several rows), in place.

        Only rows placed alike may trade contents -- the same prompt length and tokens per rank, as the
        beams of one prompt are -- since a row's placement (which rank holds which of its tokens) stays
        with the row; every CP rank applies the same ``order`` to its own shard, so each row's shards
        still make up one sequence. Anything else is a ``ValueError`` naming the rows.
        """
        if len(order) != self.batch_size or any(not isinstance(i, int) or not 0 <= i < self.batch_size for i in order):
            raise ValueError(f"reorder_rows: expected {self.batch_size} row indices in [0, {self.batch_size}), "
                             f"got {order}")
        bad = [(i, j) for i, j in enumerate(order) if vars(self._rows[i]) != vars(self._rows[j])]
        if bad:
            i, j = bad[0]
            raise ValueError(
                f"reorder_rows: row {i} would take row {j}'s tokens, but the two are placed differently over the "
                f"CP ranks (lengths {self._rows[i].total} and {self._rows[j].total}, tokens per rank "
                f"{self._rows[i].counts} and {self._rows[j].counts}); only rows of the same prompt and length "
                "(beams of one request) can trade contents")
        if order == list(range(self.batch_size)):
            return
        idx = torch.tensor(order, device=self._k.device)
        for buf, dim in ((self._k, 1), (self._v, 1), (self._positions, 0), (self.seqlens, 0)):
            buf.copy_(buf.index_select(dim, idx))  # in place: a compiled step keeps the storage's address

    def _count_rows(self) -> None:
        """``seqlens`` from the rows' placement (host bookkeeping): each row's tokens on this rank."""
        self.seqlens.copy_(torch.tensor([row.counts[self.cp_rank] for row in self._rows], dtype=torch.int32))

    def rewind_step(self) -> None:
        """Take the last decode step back so that it can run again on the same slots (``generate``'s
        redo of a ``shifted`` step): lengths are as before it; the next :meth:`begin_decode_step`
        returns its plan again. The stored keys are left as they are (rewriting them is idempotent).
        ``seqlens`` is as before the step too: a forward other than the step's redo (new tokens kept
        aside, a verification) reads the shard as it stands, without the taken-back token."""
        self._planner.rewind()
        self._count_rows()

    def truncate(self, lengths: list[int]) -> None:
        """Keep each row's first ``lengths[b]`` tokens (positions ``[0, lengths[b])``), dropping its later
        ones wherever they were placed (by the prefill or by decode steps): assisted decoding's rollback of
        rejected candidates.

        Every CP rank truncates alike: a rank keeps the prefix of its slots whose positions are below the
        new length (``RowPlacement.truncate``), ``seqlens`` shrinks to it and the dropped slots' positions
        become -1 (their keys stay, unread). The next step is placed from the truncated rows, so it
        writes over the dropped slots; the last step can no longer be rewound.
        """
        if (not isinstance(lengths, (list, tuple)) or len(lengths) != self.batch_size
                or any(isinstance(n, bool) or not isinstance(n, int) for n in lengths)):
            raise ValueError(f"truncate: expected {self.batch_size} integer row lengths, got {lengths!r}")
        bad = [b for b, (n, row) in enumerate(zip(lengths, self._rows)) if not 1 <= n <= row.total]
        if bad:
            b = bad[0]
            raise ValueError(f"truncate: row {b} holds {self._rows[b].total} tokens and cannot be cut to "
                             f"{lengths[b]} (expected 1 <= length <= {self._rows[b].total}: a row keeps at least one "
                             "token and cannot grow)")
        for row, n in zip(self._rows, lengths):
            row.truncate(n)
        self._count_rows()
        slots = torch.arange(self.capacity, device=self.positions.device)
        self.positions.masked_fill_(slots[None, :] >= self.seqlens[:, None], -1)
        self._planner.reset(self._rows)

    def continue_from(self, other: "ShardedKVCache") -> None:
        """Take over ``other``'s rows: their placement and this rank's keys, values and positions (a cache
        outgrown by its rows continues in this larger one, which must be empty and alike but for its
        capacity). The placement is copied, not replayed, so rows cut by :meth:`truncate` continue too."""
        same = ("num_layers", "batch_size", "cp_size", "cp_rank", "config")
        diff = [n for n in same if getattr(self, n) != getattr(other, n)]
        if diff or self.capacity < other.capacity or self.k.shape[3:] != other.k.shape[3:] \
                or self.v.shape[3:] != other.v.shape[3:]:
            raise ValueError(f"continue_from: the caches differ in {diff or 'their shapes'} (or this one is "
                             f"smaller: {self.capacity} < {other.capacity} slots per row)")
        self._rows = [row.copy() for row in other._rows]
        for row in self._rows:
            row.capacity = self.capacity
        self._planner.reset(self._rows)
        n = other.capacity
        self.k[:, :, :n].copy_(other.k)
        self.v[:, :, :n].copy_(other.v)
        self.positions[:, :n].copy_(other.positions)
        self.seqlens.copy_(other.seqlens)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store the new token's key/value of one layer in the rows this rank holds.

        k, v: (batch, 1, num_kv_heads, head_dim); slots: (batch,) from :meth:`begin_decode_step`.
        Rows another rank holds (slot -1) write the spare slot (never read), so the write is one
        scatter per tensor and no host read of which rows are this rank's.
        """
        layer = self._layer(layer, "append")
        self._check_kv("append", k, v, 1)
        if not isinstance(slots, torch.Tensor) or slots.dtype.is_floating_point or tuple(slots.shape) != (self.batch_size,):
            raise ValueError(f"append: slots must be the integer ({self.batch_size},) tensor begin_decode_step returned, "
                             f"got {slots.dtype if isinstance(slots, torch.Tensor) else type(slots).__name__} "
                             f"{tuple(getattr(slots, 'shape', ()))}")
        at = torch.where(slots >= 0, slots, self.capacity)  # the spare slot takes other ranks' tokens
        rows = self._batch_index
        try:  # the values are not read here (no host sync): a slot beyond the storage is torch's IndexError
            for buf, new in ((self._k, k), (self._v, v)):
                buf[layer][rows, at] = new[:, 0].to(buf.dtype)
        except IndexError as e:
            raise IndexError(f"append: a slot is beyond this rank's {self.capacity} storage slots per row; slots "
                             f"must be the tensor begin_decode_step returned (each in [-1, {self.capacity})): "
                             f"{e}") from None

    def layer_kv(self, layer: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's keys and values of one layer, trimmed to the longest local row (or to ``n`` slots:
        a step's ``StepMetadata.kv_len``).

        returns k, v: (batch, n, num_kv_heads, head_dim) with ``n = max(seqlens)`` by default; rows
        shorter than n are masked by ``seqlens``.
        """
        layer = self._layer(layer, "layer_kv")
        n = min(self.local_max if n is None else n, self.capacity)
        # Sliced from the storage itself, not from ``k``/``v`` (views of it): a compiled step that wrote the
        # storage (``append_step``) and read a view of it would take two aliased inputs, which AOTAutograd merges
        # into one base that Inductor no longer sees as static, and CUDA graphs skip a step with mutated inputs
        return self._k.select(0, layer).narrow(1, 0, n), self._v.select(0, layer).narrow(1, 0, n)
