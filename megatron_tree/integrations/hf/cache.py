"""The KV cache transformers sees: :class:`TreeCache`, a ``transformers.Cache`` holding only this CP
rank's share of every layer (through the decode tier's ``ShardedKVCache``)."""

from __future__ import annotations

import copy
import weakref

import torch

from .common import UnsupportedModelError, _text_config
from transformers.cache_utils import Cache, CacheLayerMixin

from ...decode.cache import CacheConfig, CacheOverflowError, ShardedKVCache, StoragePool, static_length
from ...decode.metadata import PrefillMetadata, VerifyMetadata
from ...distributed.topology import TreeGroups

_HEADROOM = 256  # tokens per row an unsized cache makes room for beyond the prompt before it first grows


def _kv_shape(cfg) -> tuple[int, int, int]:
    """(heads, key head dim, value head dim) a layer stores, as the config describes it.

    Multi-head latent attention (DeepSeek-V2/V3: ``kv_lora_rank``) stores one latent "head": the
    compressed KV (``kv_lora_rank``) as the keys and the shared RoPE key (``qk_rope_head_dim``)
    as the values; every other layer its KV heads. A layer that stores other shapes corrects
    this at its first write (:meth:`TreeCache.update`).
    """
    heads = int(cfg.num_attention_heads)
    if getattr(cfg, "kv_lora_rank", None):
        return 1, int(cfg.kv_lora_rank), int(cfg.qk_rope_head_dim)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return int(getattr(cfg, "num_key_value_heads", None) or heads), d, d


class _TreeLayer(CacheLayerMixin):
    """A per-layer view transformers' ``Cache`` machinery can query; the data lives in :class:`TreeCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = True  # TreeCache.crop cuts every rank's shard alike (assisted decoding's rollback)

    def __init__(self, owner: "TreeCache"):
        super().__init__()
        self._ref = weakref.ref(owner)  # (not the cache itself: a cycle would keep an ended cache until a gc pass)

    @property
    def _owner(self) -> "TreeCache":
        return self._ref()

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):  # pragma: no cover -- TreeCache.update is used
        raise RuntimeError("TreeCache layers are updated through TreeCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._owner.get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        return None


class TreeCache(Cache):
    """A ``transformers.Cache`` holding only this CP rank's share of every layer's KV.

    Storage (through :class:`~megatron_tree.cache.ShardedKVCache`, ``C`` slots per row):

    k: (num_layers, batch, C, num_kv_heads, head_dim), v: (..., head_dim_v),
    ``C = ceil(max_seq_len / cp) + block_size + 2``
    (and the storage's one spare slot per row, where other ranks' tokens are written)

    ``get_seq_length()`` is the global length transformers counts (the padded prompt plus the
    tokens appended since), the same on every rank; :attr:`lengths` are the real tokens of
    each row (pads are never stored). The cache is bound to the CP group it was made for:
    using it with a model enabled on another group is an error.

    config: the model (or its config): layers, KV heads and head size are read from it
    dtype, device: the storage's; default the model's parameters', or, for a cache made from a config, the
        layers' own (their keys' at the prompt's first write, as transformers' caches take them); a dtype
        other than the layers' computing dtype is refused at the first decode step (as sdpa refuses a query
        and keys of two dtypes), unless ``torch.autocast`` casts them to one
    groups: the CP group (``None``: one process)
    max_seq_len: real tokens per row to make room for (overflow is a ``CacheOverflowError``)
    new_tokens: with ``max_seq_len=None``, size the storage at prefill for the prompt plus
        this many tokens (``generate`` passes its ``max_new_tokens``); with neither, the
        storage makes room for 256 more tokens. Without ``max_seq_len`` the storage doubles
        whenever a row would overflow (a later ``generate`` continuing the cache, assisted rounds)
    static: every decode step reads all of the storage's slots (masked by the rows' lengths), so
        its shapes never change: what a compiled (``torch.compile``) or graph-captured step needs to
        be traced once; default: only up to the longest row this rank holds (less work, a shape
        that grows). A static cache's storage is sized for ``decode.cache.static_length`` of the
        length it needs (four sizes per octave), so caches of nearby lengths share one trace; the
        length it accepts (``max_seq_len``, or what it was sized for) is unchanged. Either way a
        decode step's metadata (:attr:`metadata`, a ``decode.metadata.StepMetadata``) lives in
        buffers updated in place. A static cache keeps its storage for a new prompt of the same shape.
    pool: a static cache's storage comes from, and returns to, this ``decode.cache.StoragePool`` (the
        model's, when the model makes the cache): the model's next cache of the same shape then reads and
        writes the same addresses, which a captured step replays on; default None (a pool of the cache's own)
    """

    def __init__(self, config, groups: TreeGroups | None, *, max_seq_len: int | None = None,
                 layout: str = "load_balanced", block_size: int = 16, new_tokens: int | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, static: bool = False, pool: StoragePool | None = None):
        model = config if isinstance(config, torch.nn.Module) else None
        cfg = _text_config(model.config if model is not None else config)
        self.num_layers = int(cfg.num_hidden_layers)
        self._config_shape = _kv_shape(cfg)
        shape = self._config_shape if pool is None else pool.layer_shapes.get(self._config_shape, self._config_shape)
        self.num_kv_heads, self.head_dim, self.head_dim_v = shape  # (what the model's layers stored, if learned)
        self._expands = bool(getattr(cfg, "kv_lora_rank", None))
        """The layers expand what :meth:`update` returns (MLA's latent into keys and values): in a forward of
        several new tokens their keys travel with the shard (see :meth:`update`)."""
        super().__init__(layers=[_TreeLayer(self) for _ in range(self.num_layers)])
        if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
            raise ValueError(f"max_seq_len must be a positive integer or None, got {max_seq_len!r}")
        if new_tokens is not None and (not isinstance(new_tokens, int) or new_tokens < 0):
            raise ValueError(f"new_tokens must be a non-negative integer or None, got {new_tokens!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}")
        self.groups = groups
        self._batch = batch_size
        self.cache_config = CacheConfig(layout=layout, block_size=block_size)
        self.max_seq_len = max_seq_len
        self.new_tokens = new_tokens
        # Made from a config with no dtype / device, the storage takes the layers' own (their keys' at the first
        # write, as transformers' own caches do): until then the prompt is placed in a storage holding no keys
        self._follow_dtype = model is None and dtype is None
        self._follow_device = model is None and device is None
        self._learned = False
        """The layers' dtype and device were taken (at a prompt's first write): until then a prompt's placement is
        made in a storage that holds no keys (see :meth:`_placement_only`)."""
        if model is not None:
            p = next(model.parameters())
            dtype = dtype or p.dtype
            device = device if device is not None else p.device
        self.dtype = dtype or torch.float32
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.storage: ShardedKVCache | None = None
        self._padded = 0
        self._padded_next = 0
        self._nominal = 0
        self._prompt_lengths: list[int] = []
        self._steps = 0
        self._local_positions: torch.Tensor | None = None
        self._prefill_chunk: int | None = None
        self._slots: torch.Tensor | None = None
        self._decode_positions: torch.Tensor | None = None
        self._written: set[int] = set()
        self.static = bool(static)
        self._pool = pool if pool is not None or not self.static else StoragePool()
        """Where a static cache's storage returns at :meth:`reset` (or when the cache ends) and comes from at the next
        prompt: the model's, else one of the cache's own (its storage then kept across ``reset`` for a new prompt)."""
        self._storage_key: tuple | None = None
        self._hand_back: weakref.finalize | None = None
        """Gives a pooled storage back to :attr:`_pool` when this cache is garbage (or, called, at :meth:`reset`)."""
        self.metadata = None
        """The running forward's attention metadata, built once when it starts (``decode.metadata``): a
        ``PrefillMetadata`` (the prompt, or a window of it), a ``StepMetadata`` (a decode step: buffers
        updated in place) or a ``VerifyMetadata`` (drafts verified, not stored); ``None`` between forwards.
        Its ``mode`` says which; every layer's attention reads it."""

    # ------------------------------------------------------------------ what transformers asks

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._padded

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._padded + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        """Rows: the storage's, else the one the cache was made for (-1: not known before the prompt)."""
        if self.storage is not None:
            return self.storage.batch_size
        return -1 if self._batch is None else self._batch

    def __copy__(self) -> "TreeCache":
        """Another handle on the same storage (and layers of its own, see :meth:`__deepcopy__`). Shared, the
        storage no longer returns to the model's pool when this cache ends: the copy may still decode on it, and
        the model's next cache would take it over (two caches writing one storage)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.layers = [_TreeLayer(new) for _ in self.layers]
        if self._hand_back is not None:
            self._hand_back.detach()
        self._hand_back = new._hand_back = None
        return new

    def __deepcopy__(self, memo) -> "TreeCache":
        """A cache of its own (transformers' prefix reuse: ``copy.deepcopy(prompt_cache)`` per continuation): its
        tokens and storage copied, its layers its own (they hold their cache weakly, and a weak reference is
        copied as is: it would name the cache copied), the model's pool and the CP group shared, not copied; a
        pooled copy hands its own storage back when it ends."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        shared = {"_pool": self._pool, "groups": self.groups, "_hand_back": None,
                  "layers": [_TreeLayer(new) for _ in self.layers]}
        for name, value in self.__dict__.items():
            setattr(new, name, shared[name] if name in shared else copy.deepcopy(value, memo))
        if self._hand_back is not None and new.storage is not None:
            new._hand_back = weakref.finalize(new, new._pool.give, new._storage_key, new.storage)
            new._hand_back.atexit = False
        return new

    def reset(self) -> None:
        if self._hand_back is not None:  # the storage goes back to the model's pool (for its next cache)
            self._hand_back()
            self._hand_back = self._storage_key = None
        self.storage = None
        self._padded = 0
        self._prompt_lengths = []
        self._steps = 0

    def _refuse(self, what: str):
        raise NotImplementedError(
            f"TreeCache does not support {what}: each CP rank holds a different shard of every row, "
            "so rows cannot be repeated or selected locally (contrastive search is not supported; use greedy, "
            "sampling, beam search or assisted decoding)"
        )

    def reorder_cache(self, beam_idx) -> None:
        """Beam search's reorder: row ``i`` continues beam ``beam_idx[i]``. Each CP rank reorders its own
        shard of every row alike (beams of one prompt are placed alike: ``ShardedKVCache.reorder_rows``).

        beam_idx: (batch,) integer tensor (one host read per call)."""
        if self.storage is None:
            return
        order = [int(i) for i in torch.as_tensor(beam_idx).reshape(-1).tolist()]
        self.storage.reorder_rows(order)
        if self._local_positions is not None:
            idx = torch.tensor(order, device=self._local_positions.device)
            self._local_positions = self._local_positions.index_select(0, idx)

    def crop(self, max_length: int) -> None:
        """Drop every row's tokens past ``max_length`` of the global (padded) length, on every CP rank alike:
        assisted decoding's rollback of rejected candidates (transformers calls ``crop(-n)`` after each
        verification forward).

        max_length: negative -- remove that many tokens from the end (transformers' ``DynamicCache.crop``
        of 5.x, which refuses positive values); positive -- the length to keep (the meaning of earlier
        transformers releases); 0 -- nothing is removed (what transformers 5.x means by it). The tokens
        dropped may have been placed by decode steps or by the prefill (the first assisted round prefills
        the prompt with the first candidates): each rank keeps the prefix of its shard of each row below
        the new length and the rows' placement is cut alike (``ShardedKVCache.truncate``), so later steps
        are placed identically on every rank. A length above the cache's (growing), or one that would
        leave a row no token, is a ``ValueError``. Host-side only: no collective.
        """
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"TreeCache.crop takes an integer (negative: tokens to remove; positive: the length to "
                            f"keep), got {type(max_length).__name__} {max_length!r}")
        if self.metadata is not None:
            raise RuntimeError("TreeCache.crop was called during a forward; crop between forwards")
        if max_length == 0:
            return
        keep = self._padded + max_length if max_length < 0 else max_length
        if keep > self._padded:
            raise ValueError(f"TreeCache.crop({max_length}): the cache holds {self._padded} tokens per row (with the "
                             "prompts' padding), so it cannot be cropped to a larger length")
        cut = self._padded - keep
        if cut == 0:
            return
        if self.storage is None or keep < 0:
            raise ValueError(f"TreeCache.crop({max_length}) would remove {cut} tokens from a cache holding "
                             f"{self._padded} per row")
        lengths = [n - cut for n in self.storage.lengths]
        short = [b for b, n in enumerate(lengths) if n < 1]
        if short:
            raise ValueError(
                f"TreeCache.crop({max_length}) would leave rows {short} without a token (they hold "
                f"{[self.storage.lengths[b] for b in short]} real tokens, {cut} would go: the rest of the cut falls in "
                "their prompt's padding); start a new cache for a new prompt")
        self.storage.truncate(lengths)
        self._padded = keep
        self._steps = 0  # (the truncated placement cannot be replayed step by step, nor its last step rewound)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            self._refuse("batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        self._refuse("batch_select_indices")

    # ------------------------------------------------------------------ what tests and users read

    @property
    def lengths(self) -> list[int]:
        """Real (unpadded) tokens of each row."""
        return [] if self.storage is None else self.storage.lengths

    @property
    def shard_lengths(self) -> list[list[int]]:
        """``[row][rank]``: tokens of each row held by each CP rank (the same on every rank)."""
        return [] if self.storage is None else self.storage.shard_lengths

    @property
    def kv_nbytes(self) -> int:
        """Bytes of keys and values this rank allocated (with the storage's spare slot per row)."""
        return 0 if self.storage is None else self.storage.kv_nbytes

    @property
    def local_tokens(self) -> int:
        """Tokens (summed over rows) this rank stores."""
        return 0 if self.storage is None else int(self.storage.seqlens.sum())

    # ------------------------------------------------------------------ driven by the forward wrapper

    @property
    def growable(self) -> bool:
        """Whether the storage doubles on overflow rather than raising: unless ``max_seq_len`` was given
        (``new_tokens`` only sizes the first storage: a cache that generate sized for one call and that a
        later call continues grows as it needs)."""
        return self.max_seq_len is None

    def _shape(self, batch: int, max_seq_len: int) -> dict:
        """The ``ShardedKVCache`` arguments of a storage of ``batch`` rows for ``max_seq_len`` tokens."""
        cp = 1 if self.groups is None else self.groups.size
        rank = 0 if self.groups is None else self.groups.rank
        # A growable cache keeps one block (+2 for the load-balanced prompt's uneven chunks) of
        # headroom per rank: no rank is ever full while placement decides, so its placement is
        # the unbounded rule's and a larger cache replays it exactly (see _grow).
        slack = cp * (self.cache_config.block_size + 2) if cp > 1 and self.growable and self.new_tokens is None else 0
        if self.static:  # room for a bucket's length: caches made for nearby lengths share one compiled step
            max_seq_len = static_length(max_seq_len)
        return dict(num_layers=self.num_layers, batch_size=batch, max_seq_len=max_seq_len + slack,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, head_dim_v=self.head_dim_v, cp_size=cp,
                    cp_rank=rank, config=self.cache_config, dtype=self.dtype, device=self.device)

    def _allocate(self, batch: int, max_seq_len: int) -> ShardedKVCache:
        shape = self._shape(batch, max_seq_len)
        if not self.static:
            return ShardedKVCache(**shape)
        # A static storage keeps its addresses for as long as it can (a captured step replays on them): the
        # same storage for a new prompt of the same shape, else the one the model's last cache handed back.
        key = StoragePool.key(**shape)
        if self.storage is not None and key == self._storage_key:
            return self.storage  # (start_prefill resets it)
        storage = self._pool.take(key) if self._pool is not None else None
        if storage is None:
            storage = ShardedKVCache(**shape)
            # A compiled step writes these in place and a CUDA graph replays on their addresses: tell
            # Dynamo they are static (else Inductor copies them into its graph's inputs, or skips the graph).
            for t in storage.step_buffers():
                torch._dynamo.mark_static_address(t)
        if self._hand_back is not None:  # the storage this one replaces (a larger one, other head shapes) is dropped
            self._hand_back.detach()
            self._hand_back = None
        self._storage_key = key
        if self._pool is not None:
            self._hand_back = weakref.finalize(self, self._pool.give, key, storage)
            self._hand_back.atexit = False
        return storage

    def _placement_only(self, batch: int, max_seq_len: int) -> ShardedKVCache:
        """A storage of ``batch`` rows for ``max_seq_len`` tokens that places the prompt as :meth:`_allocate`'s
        would (placement reads no keys) but holds one layer of one 1-wide head: a cache made from a config learns
        the dtype and device of its keys and values at the layers' first write (:meth:`update` then makes the
        storage). Allocating the whole storage in float32 on the CPU first took 3x the storage's host memory at
        the peak for a bfloat16 model, and all of it on the host for a CUDA one."""
        return ShardedKVCache(**{**self._shape(batch, max_seq_len), "num_layers": 1, "num_kv_heads": 1, "head_dim": 1,
                                 "head_dim_v": 1})

    def _check_prefill(self, lengths: list[int]) -> int:
        """Raise unless prompts of ``lengths`` fit this cache (nothing changes); returns the tokens per row to size for."""
        if self._batch is not None and len(lengths) != self._batch:
            raise ValueError(f"got {len(lengths)} prompts for a TreeCache made for batch_size={self._batch}")
        if self.max_seq_len is not None:
            need = self.max_seq_len
        elif self.new_tokens is not None:
            need = max(lengths) + self.new_tokens
        else:
            need = max(lengths) + _HEADROOM
        if max(lengths) > need:
            raise CacheOverflowError(
                f"a prompt has {max(lengths)} tokens but this TreeCache was made for {need} per row; "
                "create it with a larger max_seq_len"
            )
        return need

    def _begin_prefill(self, lengths: list[int], padded: int, chunk: int | None = None) -> torch.Tensor:
        """Place the prompts; returns (batch, W) global (unpadded) positions of this rank's tokens, -1 = filler.

        chunk: the most prompt tokens per forward (chunked prefill: :meth:`_begin_window` then runs
        each window's forward), or None (one forward over every token)."""
        need = self._check_prefill(lengths)
        if (self._follow_dtype or self._follow_device) and not self._learned:
            self.storage = self._placement_only(len(lengths), need)  # the layers' first write makes the storage
        else:
            self.storage = self._allocate(len(lengths), need)
        self._nominal = need
        local = self.storage.start_prefill(lengths, chunk)
        self._prompt_lengths = list(lengths)
        self._prefill_chunk = chunk
        self._steps = 0
        self._padded_next = padded
        self._local_positions = local
        self.metadata = PrefillMetadata(local, local)
        self._written = set()
        return local

    def _begin_window(self, q_slots: torch.Tensor, kv_end: int, last: bool, padded: int) -> torch.Tensor:
        """Start the forward of one window of a chunked prefill; returns its queries' global positions.

        q_slots: (batch, S) this rank's storage slots of the window's tokens, -1 = filler; the
        window's keys/values are written there, and its attention reads slots ``[0, kv_end)`` (every
        earlier window's tokens; the later windows' slots in that range hold positions after every
        query of this window, so the causal mask hides them). ``last``: the window ends the prompt
        (the global length transformers sees becomes ``padded`` only then).
        """
        local = self._local_positions
        # on the placement's device: a cache made from a config keeps it on the CPU until the layers' first write
        # tells the device, while the forward's slots are on the model's (the attention moves positions to q's)
        slots = q_slots.to(local.device)
        q_positions = torch.where(slots >= 0, local.gather(1, slots.clamp(min=0)), -1)
        self.metadata = PrefillMetadata(q_positions, self.storage.positions[:, :kv_end], q_slots, kv_end)
        self._padded_next = padded if last else 0
        self._written = set()
        return q_positions.to(q_slots.device)

    def _reshape(self, heads: int, head_dim: int, head_dim_v: int, dtype: torch.dtype | None = None,
                 device: torch.device | None = None) -> None:
        """Re-make the (still empty) storage for the shapes (and, for a cache made from a config, the dtype and
        device) the layers store; the placement is replayed."""
        self.num_kv_heads, self.head_dim, self.head_dim_v = heads, head_dim, head_dim_v
        self.dtype = self.dtype if dtype is None else dtype
        self.device = self.device if device is None else device
        self._learned = True
        if self._pool is not None:  # the model's next caches start with these shapes (and the storage kept of them)
            self._pool.layer_shapes[self._config_shape] = (heads, head_dim, head_dim_v)
        old = self.storage
        self.storage = self._allocate(old.batch_size, self._nominal)
        local = self.storage.start_prefill(self._prompt_lengths, self._prefill_chunk)
        if not torch.equal(local.to(self._local_positions.device), self._local_positions):
            raise RuntimeError("TreeCache: replaying the prompt's placement gave other positions")  # a bug
        self._local_positions = local  # on the storage's device now, as the next windows' placement

    def _grow(self) -> None:
        """Double the storage: the rows' placement and this rank's tokens continue in a larger cache.

        A static cache whose storage (sized by length bucket) already holds twice its length only
        takes the larger length: a new storage of the same shape would copy every token for nothing,
        and move the step's buffers (a captured step re-records on new addresses)."""
        old = self.storage
        if self.static and static_length(2 * self._nominal) == static_length(self._nominal):
            self._nominal *= 2
            return
        new = self._allocate(old.batch_size, 2 * self._nominal)
        new.continue_from(old)
        self.storage = new
        self._nominal *= 2

    def _make_room(self, tokens: int) -> None:
        """Grow (an unsized cache) until every row has room for ``tokens`` more, else a CacheOverflowError."""
        while max(self.storage.lengths) + tokens > self._nominal:
            if not self.growable:
                raise CacheOverflowError(
                    f"a row already holds {max(self.storage.lengths)} tokens and {tokens} more do not fit in the "
                    f"max_seq_len={self.max_seq_len} this TreeCache was made with; create it with a larger "
                    "max_seq_len (or none: it then grows as rows need)"
                )
            self._grow()

    def _check_filled(self, batch: int) -> None:
        """A forward of new tokens needs the prompt's forward first, and the cache's batch."""
        if self.storage is None:
            raise ValueError("TreeCache is empty: run a forward over the prompt before decoding")
        if batch != self.storage.batch_size:
            raise ValueError(f"decode step has batch {batch}, the cache holds {self.storage.batch_size} rows")

    def _begin_decode(self, batch: int, windows=()) -> None:
        """Place one new token per row (host bookkeeping) and fill the step's :attr:`metadata`
        (``windows``: the model's sliding windows, whose first slots it computes once for every layer)."""
        self._check_filled(batch)
        self._make_room(1)
        pos, self._slots = self.storage.begin_decode_step()
        self._decode_positions = pos[:, None]
        self.metadata = self.storage.step_metadata(self.static)
        self.metadata.update_starts(windows)
        if self.static:  # the metadata's own views and the windows' starts, made after the storage (once each)
            for t in self.metadata.buffers():
                if getattr(t, "_dynamo_static_input_type", None) is None:
                    torch._dynamo.mark_static_address(t)
        self._steps += 1
        self._padded_next = self._padded + 1
        self._written = set()

    def _begin_chain(self, batch: int, q_len: int) -> None:
        """Start a forward of ``q_len`` new tokens per row on the filled cache (assisted decoding's
        verification): the tokens are not stored while it runs -- each layer's keys/values are kept aside
        (``_drafts``, the speculative verification's phase) and the attention sees the cache plus the
        earlier new tokens (``decode.speculative.verify_attention`` with a chain mask) -- then
        :meth:`_commit_chain` appends them all. Room for them is made (or refused) first."""
        self._check_filled(batch)
        self._make_room(q_len)
        self._begin_verify(torch.tensor(self.storage.lengths, dtype=torch.int64)[:, None]
                           + torch.arange(q_len, dtype=torch.int64)[None, :])  # (batch, q_len), unpadded

    def _begin_verify(self, positions: torch.Tensor) -> None:
        """Start a forward of draft tokens at global ``positions`` (batch, T) over the filled cache: their
        keys/values are kept aside (``_drafts``), never stored, and the global length stays."""
        self.metadata = VerifyMetadata(positions.to(self.storage.positions.device))
        self._drafts = {}
        self._padded_next = self._padded
        self._written = set()

    def _commit_chain(self, q_len: int) -> None:
        """Append the ``q_len`` tokens of the chain forward just run, each through an ordinary decode step
        (placed by the rule, every rank alike); the global length grows by ``q_len``."""
        from ...decode.speculative import commit

        b = self.storage.batch_size
        commit(self, torch.arange(q_len).expand(b, q_len))

    def rewind_step(self) -> None:
        """Take the last decode step back so that it runs again on the same slots (``generate``'s redo of
        a ``shifted`` step): the global length and the rows' lengths are as before it; the next decode
        forward places the same token on the same slots (the step planner's redo)."""
        if self.storage is None or self._steps == 0:
            raise RuntimeError("TreeCache.rewind_step() without a decode step to take back")
        self.storage.rewind_step()
        self._steps -= 1
        self._padded -= 1

    def _abandon_decode(self) -> None:
        """Take back a decode step that :meth:`_begin_decode` placed but whose forward raised (in a layer, in
        a check before the layers ran, or in :meth:`_finish`): the global length never grew, and the rows'
        placement is put back as before the step, so the cache is as it was and the next decode forward
        places its token on the same slots (overwriting the keys the layers that ran had stored there)."""
        self.metadata = None
        self._written = set()
        self.storage.rewind_step()
        self._steps -= 1

    def _finish(self) -> None:
        if self._written is None:  # a compiled step: its layers are not counted (see update)
            self._written = set()
            self.metadata = None
            self._padded = self._padded_next
            return
        missing = sorted(set(range(self.num_layers)) - self._written)
        self.metadata = None
        if missing:
            raise UnsupportedModelError(
                f"layers {missing} of {self.num_layers} never stored keys/values in the TreeCache during this "
                "forward: their attention does not go through transformers' cache and attention interface, so "
                "tree attention cannot replace it"
            )
        self._padded = self._padded_next

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this rank's new keys/values of one layer; return what the attention function reads.

        key_states, value_states: (batch, num_kv_heads, q_len, head_dim[_v]), transformers' layout.
        Prefill returns them unchanged (this rank's chunk), a window of a chunked prefill this
        rank's stored keys up to the window's end; decode returns this rank's whole
        shard of the layer, (batch, num_kv_heads, n, head_dim) views, valid up to
        ``storage.seqlens`` per row.
        """
        meta = self.metadata
        if meta is None or self.storage is None:
            raise RuntimeError(
                "TreeCache.update was called outside a forward of a model enabled with enable_tree_attention; "
                "pass the cache to that model's forward or generate"
            )
        if meta.mode == "decode" and torch.compiler.is_compiling():
            # A traced decode step: shapes were checked when it was traced (they cannot change without a
            # new trace), and the layers that stored are counted in the eager steps only.
            self._written = None
            self.storage.append_step(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))
            ks, vs = self.storage.layer_kv(layer_idx, meta.kv_len)
            return ks.transpose(1, 2), vs.transpose(1, 2)
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx {layer_idx} is outside the cache's {self.num_layers} layers")
        b, h, s, d = key_states.shape
        hv, dv = value_states.shape[1], value_states.shape[-1]
        if meta.mode == "prefill" and not self._written:  # the first write of the sequence: the layer's own shapes
            # (not the config's), and for a cache made from a config without them its dtype and device
            dtype = key_states.dtype if self._follow_dtype else self.dtype
            device = key_states.device if self._follow_device else self.device
            shape = (h, d, dv) if hv == h else (self.num_kv_heads, self.head_dim, self.head_dim_v)
            if shape != (self.num_kv_heads, self.head_dim, self.head_dim_v) or dtype != self.dtype \
                    or device != self.device or self.storage.num_layers != self.num_layers:
                self._reshape(*shape, dtype=dtype, device=device)  # (a placement-only storage is made whole)
        if (h, hv, d, dv) != (self.num_kv_heads, self.num_kv_heads, self.head_dim, self.head_dim_v):
            raise UnsupportedModelError(
                f"layer {layer_idx} stores keys of {h} heads of size {d} and values of {hv} heads of size {dv}; "
                f"this cache holds {self.num_kv_heads} heads of size {self.head_dim} (keys) and {self.head_dim_v} "
                "(values) for every layer (layers storing different shapes are not supported)"
            )
        self._written.add(layer_idx)
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # (b, s, h, d)
        if meta.mode == "prefill" and meta.slots is not None:  # one window of a chunked prefill
            self.storage.write_prefill_slots(layer_idx, k, v, meta.slots)
            end = meta.kv_end
            ks, vs = self.storage.k[layer_idx, :, :end], self.storage.v[layer_idx, :, :end]
            return ks.transpose(1, 2), vs.transpose(1, 2)
        if meta.mode == "prefill":
            self.storage.write_prefill(layer_idx, k, v)
            return key_states, value_states
        if meta.mode == "verify":  # speculative verification: drafts are kept aside, never stored
            self._drafts[layer_idx] = (k, v)  # (decode.speculative.commit appends the accepted ones)
            ks, vs = self.storage.layer_kv(layer_idx)
            if self._expands:  # the module expands what it gets: the drafts go along, split off again after
                ks, vs = torch.cat([ks, k.to(ks.dtype)], dim=1), torch.cat([vs, v.to(vs.dtype)], dim=1)
            return ks.transpose(1, 2), vs.transpose(1, 2)
        self.storage.append_step(layer_idx, k, v)
        ks, vs = self.storage.layer_kv(layer_idx, meta.kv_len)
        return ks.transpose(1, 2), vs.transpose(1, 2)
