"""transformers integration: any decoder with transformers' attention interface, CP-sharded.

Invariant: on every rank of a CP group, ``model.generate(...)`` (or a plain forward) of a
model passed through :func:`enable_tree_attention` returns what the unmodified model returns
in one process, while each rank holds 1/CP of every layer's KV cache and runs the layers on
1/CP of the prompt. Nothing in transformers' modelling code is rewritten; three of its own
extension points are filled:

* **attention** -- :func:`tree_attention_forward` is registered with ``AttentionInterface``
  under ``"megatron_tree"`` and set as the model's ``attn_implementation``. At prefill it is
  exact CP attention over every rank's chunk (``prefill.cp_prefill``: ring or all-gather of
  KV); at decode it is :func:`~megatron_tree.tree_decode` over the rank's KV shard.
* **cache** -- :class:`TreeCache` is a ``transformers.Cache`` that stores only this rank's
  tokens of every layer, through :class:`~megatron_tree.cache.ShardedKVCache` (one placement
  rule for the library's caches: the prompt in Megatron's load-balanced CP chunks, decoded
  tokens in blocks round-robin), and reports the global (padded) length transformers expects.
* **forward and generate** -- the model's ``forward`` is wrapped (instance attribute,
  ``__wrapped__`` kept, undone by :func:`disable_tree_attention`): a forward that starts a
  sequence gives each rank its own chunk of the prompt, with the global positions
  transformers would use, so every layer (attention, MLP, norms) processes ~1/CP of the
  tokens; the logits transformers asked for are assembled on every rank with one all-reduce.
  Before it, the ranks compare the call's arguments and the model's widths (one small
  all-gather): a rank handed another prompt, or another model, fails with the others instead
  of computing a chunk of the wrong one. The
  empty cache ``generate`` makes is swapped for a ``TreeCache`` (sized for the request while
  ``generate`` runs), which ``generate`` then carries from step to step. ``generate`` is
  wrapped to add a logits processor that hands every rank CP rank 0's random state before
  each token is drawn (so rank 0's draw decides for all, whatever the ranks were seeded
  with), and a stopping criterion that checks every step that all ranks hold rank 0's
  tokens and fails loudly otherwise.

Padding: prompts must be left-padded (transformers' convention for generation). Pad tokens
are dropped before the layers run -- they are never computed, stored or attended to -- and
each row's real tokens keep the RoPE positions transformers gives them (from ``position_ids``
as ``generate`` derives them from the attention mask, or ``arange`` without them). Logits at
pad positions (only returned when more than the last position is asked for) are 0.

Why it lives here: transformers is an integration, like Megatron-Core and DeepSpeed; the
library's layers below do not import it. The module imports transformers (>= 5.17) when it
is itself imported and says so clearly when it is missing or older.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

try:
    import transformers
    from transformers import (AttentionInterface, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                              StoppingCriteriaList)
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as e:  # pragma: no cover -- exercised only where transformers is absent
    raise ImportError(
        "megatron_tree.integrations.hf needs transformers >= 5.17 (pip install 'transformers>=5.17'); "
        f"importing it failed: {e}"
    ) from e

from ... import agreement, collectives
from ...decode.generate import DecodeStep
from ...decode.cache import LAYOUTS, CacheConfig, CacheOverflowError, ShardedKVCache
from ...collectives import CommStats
from ...comm import STRATEGIES
from ...decode.prefill import PREFILL_METHODS, assemble_logits, cp_prefill
from ...topology import TreeGroups

__all__ = [
    "ATTN_IMPLEMENTATION", "MIN_TRANSFORMERS", "UnsupportedModelError", "TreeCache", "tree_attention_forward",
    "check_model",
    "enable_tree_attention", "disable_tree_attention", "HFTreeModel", "load_hf_model",
]

ATTN_IMPLEMENTATION = "megatron_tree"
"""The name registered with transformers' ``AttentionInterface``."""
MIN_TRANSFORMERS = (5, 17)
"""Oldest transformers release this module was tested against (5.17, the GPU machine's, and 5.24)."""
_MARK = "_megatron_tree"  # attribute on the model and on each attention module: the binding
_REFUSED_ATTENTION_KWARGS = ("sliding_window", "softcap", "s_aux", "attention_chunk_size")
_HEADROOM = 256  # tokens per row an unsized cache makes room for beyond the prompt before it first grows


class UnsupportedModelError(ValueError):
    """A model or config this backend cannot run exactly (it says what, and what would work)."""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:  # pragma: no cover
    raise ImportError(
        f"megatron_tree.integrations.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} "
        f"(the releases its Cache, AttentionInterface and generate hooks were written against), but "
        f"{transformers.__version__} is installed"
    )


# --------------------------------------------------------------------------- per-model state


@dataclass
class _Binding:
    """What :func:`enable_tree_attention` attached to one model (shared by its attention modules)."""

    groups: TreeGroups | None
    strategy: str
    prefill: str
    layout: str
    block_size: int
    stats: CommStats | None
    num_layers: int
    cache_kwarg: str
    """Name of the cache argument of this transformers release's ``forward``: ``cache`` (5.2x) or ``past_key_values``."""
    accepts_logits_to_keep: bool
    previous_attn: str | None
    attention_modules: list = field(default_factory=list)
    active: "TreeCache | None" = None
    """The cache of the forward in progress (set by the forward wrapper, read by the attention function)."""
    new_tokens_hint: int | None = None
    """Tokens ``generate`` may append (sizes a cache it creates); set only while ``generate`` runs."""
    settings_hint: tuple | None = None
    """``generate``'s sampling and stop settings (:func:`_generation_settings`), compared across CP ranks
    at the prefill; set only while ``generate`` runs."""
    step: object = None
    """The decode loop's ``decode.generate.DecodeStep`` while ``HFTreeModel.decode_step`` runs (its
    ``attend`` is every layer's decode attention); ``None``: a plain step of ``strategy``/``stats``."""

    @property
    def cp_size(self) -> int:
        return 1 if self.groups is None else self.groups.size


def _same_groups(a: TreeGroups | None, b: TreeGroups | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.cp_ranks == b.cp_ranks and a.cp_group is b.cp_group


def _describe(groups: TreeGroups | None, named: bool = False) -> str:
    """``groups`` in a message; ``named``: with its process group's name, which tells apart two groups
    over the same ranks (``TreeGroups`` built twice)."""
    if groups is None:
        return "no CP group (one process)"
    text = f"the CP group of ranks {list(groups.cp_ranks)}"
    if named:
        text += f" (process group {getattr(groups.cp_group, 'group_name', None) or id(groups.cp_group)!r})"
    return text


def _comm_device(groups: TreeGroups, like: torch.device) -> torch.device:
    """Where a tensor must live for a collective on ``groups`` (NCCL: CUDA; gloo: CPU)."""
    backend = str(dist.get_backend(groups.cp_group)).lower()
    if "nccl" in backend:
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --------------------------------------------------------------------------- cache


class _TreeLayer(CacheLayerMixin):
    """A per-layer view transformers' ``Cache`` machinery can query; the data lives in :class:`TreeCache`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: "TreeCache"):
        super().__init__()
        self._owner = owner

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

    k, v: (num_layers, batch, C, num_kv_heads, head_dim), ``C = ceil(max_seq_len / cp) + block_size + 2``
    (and the storage's one spare slot per row, where other ranks' tokens are written)

    ``get_seq_length()`` is the global length transformers counts (the padded prompt plus the
    tokens appended since), the same on every rank; :attr:`lengths` are the real tokens of
    each row (pads are never stored). The cache is bound to the CP group it was made for:
    using it with a model enabled on another group is an error.

    config: the model (or its config): layers, KV heads and head size are read from it
    groups: the CP group (``None``: one process)
    max_seq_len: real tokens per row to make room for (overflow is a ``CacheOverflowError``)
    new_tokens: with ``max_seq_len=None``, size the storage at prefill for the prompt plus
        this many tokens (``generate`` passes its ``max_new_tokens``); with neither, the
        storage makes room for 256 more tokens and doubles whenever a row would overflow
    """

    def __init__(self, config, groups: TreeGroups | None, *, max_seq_len: int | None = None,
                 layout: str = "load_balanced", block_size: int = 16, new_tokens: int | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        model = config if isinstance(config, torch.nn.Module) else None
        cfg = _text_config(model.config if model is not None else config)
        self.num_layers = int(cfg.num_hidden_layers)
        heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
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
        self._phase: str | None = None
        self._local_positions: torch.Tensor | None = None
        self._slots: torch.Tensor | None = None
        self._written: set[int] = set()

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

    def reset(self) -> None:
        self.storage = None
        self._padded = 0
        self._prompt_lengths = []
        self._steps = 0

    def _refuse(self, what: str):
        raise NotImplementedError(
            f"TreeCache does not support {what}: each CP rank holds a different shard of every row, "
            "so rows cannot be reordered, repeated or cut locally (beam search, assisted decoding and "
            "contrastive search are not supported; use greedy or sampling)"
        )

    def reorder_cache(self, beam_idx) -> None:
        self._refuse("reorder_cache (beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            self._refuse(f"crop({tokens_to_remove})")

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
        """Whether the storage doubles on overflow (no size was given) rather than raising."""
        return self.max_seq_len is None and self.new_tokens is None

    def _allocate(self, batch: int, max_seq_len: int) -> ShardedKVCache:
        cp = 1 if self.groups is None else self.groups.size
        rank = 0 if self.groups is None else self.groups.rank
        # A growable cache keeps one block (+2 for the load-balanced prompt's uneven chunks) of
        # headroom per rank: no rank is ever full while placement decides, so its placement is
        # the unbounded rule's and a larger cache replays it exactly (see _grow).
        slack = cp * (self.cache_config.block_size + 2) if cp > 1 and self.growable else 0
        return ShardedKVCache(
            num_layers=self.num_layers, batch_size=batch, max_seq_len=max_seq_len + slack,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, cp_size=cp, cp_rank=rank,
            config=self.cache_config, dtype=self.dtype, device=self.device,
        )

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

    def _begin_prefill(self, lengths: list[int], padded: int) -> torch.Tensor:
        """Place the prompts; returns (batch, W) global (unpadded) positions of this rank's tokens, -1 = filler."""
        need = self._check_prefill(lengths)
        self.storage = self._allocate(len(lengths), need)
        self._nominal = need
        local = self.storage.start_prefill(lengths)
        self._prompt_lengths = list(lengths)
        self._steps = 0
        self._padded_next = padded
        self._phase = "prefill"
        self._local_positions = local
        self._written = set()
        return local

    def _grow(self) -> None:
        """Double the storage: replay the placement in a larger cache and copy this rank's tokens."""
        old = self.storage
        new = self._allocate(old.batch_size, 2 * self._nominal)
        new.start_prefill(self._prompt_lengths)
        for _ in range(self._steps):
            new.begin_decode_step()
        if new.shard_lengths != old.shard_lengths or not torch.equal(new.seqlens, old.seqlens):
            raise RuntimeError(  # the placement is a pure function of lengths and steps; this is a bug
                f"TreeCache: replaying the placement gave shards {new.shard_lengths}, expected {old.shard_lengths}"
            )
        n = old.capacity
        new.k[:, :, :n].copy_(old.k)
        new.v[:, :, :n].copy_(old.v)
        new.positions[:, :n].copy_(old.positions)
        self.storage = new
        self._nominal *= 2

    def _begin_decode(self, batch: int) -> None:
        if self.storage is None:
            raise ValueError("TreeCache is empty: run a forward over the prompt before decoding")
        if batch != self.storage.batch_size:
            raise ValueError(f"decode step has batch {batch}, the cache holds {self.storage.batch_size} rows")
        while max(self.storage.lengths) + 1 > self._nominal:
            if not self.growable:
                raise CacheOverflowError(
                    f"a row already holds {max(self.storage.lengths)} tokens, all this TreeCache was sized for "
                    f"(max_seq_len={self.max_seq_len}, new_tokens={self.new_tokens}); create it with a larger "
                    "max_seq_len or pass max_new_tokens to generate"
                )
            self._grow()
        _, self._slots = self.storage.begin_decode_step()
        self._steps += 1
        self._padded_next = self._padded + 1
        self._phase = "decode"
        self._written = set()

    def rewind_step(self) -> None:
        """Take the last decode step back so that it runs again on the same slots (``generate``'s redo of
        a ``shifted`` step): the global length and the rows' lengths are as before it; the next decode
        forward places the same token on the same slots (the step planner's redo)."""
        if self.storage is None or self._steps == 0:
            raise RuntimeError("TreeCache.rewind_step() without a decode step to take back")
        self.storage.rewind_step()
        self._steps -= 1
        self._padded -= 1

    def _finish(self) -> None:
        missing = sorted(set(range(self.num_layers)) - self._written)
        self._phase = None
        if missing:
            raise UnsupportedModelError(
                f"layers {missing} of {self.num_layers} never stored keys/values in the TreeCache during this "
                "forward: their attention does not go through transformers' cache and attention interface, so "
                "tree attention cannot replace it"
            )
        self._padded = self._padded_next

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store this rank's new keys/values of one layer; return what the attention function reads.

        key_states, value_states: (batch, num_kv_heads, q_len, head_dim), transformers' layout.
        Prefill returns them unchanged (this rank's chunk); decode returns this rank's whole
        shard of the layer, (batch, num_kv_heads, n, head_dim) views, valid up to
        ``storage.seqlens`` per row.
        """
        if self._phase is None or self.storage is None:
            raise RuntimeError(
                "TreeCache.update was called outside a forward of a model enabled with enable_tree_attention; "
                "pass the cache to that model's forward or generate"
            )
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx {layer_idx} is outside the cache's {self.num_layers} layers")
        b, h, s, d = key_states.shape
        if (h, d) != (self.num_kv_heads, self.head_dim):
            raise UnsupportedModelError(
                f"layer {layer_idx} produced keys with {h} heads of size {d}; the cache was sized from the config "
                f"for {self.num_kv_heads} heads of size {self.head_dim}"
            )
        self._written.add(layer_idx)
        k, v = key_states.transpose(1, 2), value_states.transpose(1, 2)  # (b, s, h, d)
        if self._phase == "prefill":
            self.storage.write_prefill(layer_idx, k, v)
            return key_states, value_states
        self.storage.append(layer_idx, k, v, self._slots)
        ks, vs = self.storage.layer_kv(layer_idx)
        return ks.transpose(1, 2), vs.transpose(1, 2)


def _text_config(cfg):
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if callable(get) else cfg


# --------------------------------------------------------------------------- attention function


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract, computed across the CP group.

    query: (batch, nheads_q, q_len, head_dim); key, value: what :meth:`TreeCache.update`
    returned; attention_mask: ignored (padding and causality come from the cache's global
    positions: transformers builds no mask for this implementation).
    returns (attn_output (batch, q_len, nheads_q, head_dim), None)
    """
    binding = getattr(module, _MARK, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but was not prepared by "
            "megatron_tree.integrations.hf.enable_tree_attention"
        )
    cache = binding.active
    if cache is None or cache._phase is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION!r} attention ran outside the sharded forward enable_tree_attention installed "
            "(was model.forward replaced after enabling?)"
        )
    for name in _REFUSED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} asks for {name}={kwargs[name]!r}; tree attention computes full causal "
                "softmax attention only"
            )
    if dropout:
        raise UnsupportedModelError(f"attention dropout {dropout} (training mode?) is not supported; call model.eval()")
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{type(module).__name__} is not causal; tree attention is causal decoding")
    q = query.transpose(1, 2)  # (b, q_len, hq, d)
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    if cache._phase == "prefill":
        pos = cache._local_positions.to(q.device)
        out = cp_prefill(q, k, v, pos, pos, binding.groups, method=binding.prefill, softmax_scale=scaling,
                         stats=binding.stats)
    else:  # the one attention call of every integration: the decode loop's step (or a plain one)
        step = binding.step if binding.step is not None else DecodeStep(binding.strategy, binding.stats)
        out = step.attend(module.layer_idx, q, k, v, binding.groups, cache_seqlens=cache.storage.seqlens,
                          softmax_scale=scaling)
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)


# --------------------------------------------------------------------------- the sharded forward


def _mask_lengths(mask: torch.Tensor, batch: int, seq: int) -> list[int]:
    """Real tokens per row of a left-padded 2-D mask; anything else is an error."""
    if mask.dim() != 2 or tuple(mask.shape) != (batch, seq):
        raise ValueError(
            f"attention_mask must be a 2-D (batch, seq) = {(batch, seq)} padding mask at the start of a sequence, "
            f"got shape {tuple(mask.shape)}"
        )
    m = mask.to(torch.bool)
    n = m.sum(dim=1)
    want = torch.arange(seq, device=m.device)[None, :] >= (seq - n)[:, None]
    bad = (m != want).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"attention_mask rows {bad} are not left-padded (zeros, then ones); tree attention drops padding by "
            "position and needs left padding, as generate does (tokenizer.padding_side = 'left')"
        )
    empty = (n == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask rows {empty} have no tokens; every row needs at least one")
    return n.tolist()


def _normalise_call(orig, args, kwargs) -> dict:
    sig = inspect.signature(orig)
    bound = sig.bind_partial(*args, **kwargs)
    call = dict(bound.arguments)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in call:
            call.update(call.pop(name))
    return call


def _pop_cache(call: dict):
    caches = [call.pop(n) for n in ("cache", "past_key_values") if n in call]
    caches = [c for c in caches if c is not None]
    if len(caches) > 1:
        raise ValueError("pass the cache once, as `cache` or `past_key_values`, not both")
    return caches[0] if caches else None


def _sharded_forward(model, orig, binding: _Binding, args, kwargs):
    call = _normalise_call(orig, args, kwargs)
    cache = _pop_cache(call)
    for name in ("labels", "output_attentions", "output_hidden_states"):
        if call.get(name) is not None and call.get(name) is not False:
            raise NotImplementedError(
                f"{name} is not supported with tree attention (inference only: outputs are assembled for the "
                "requested logits, not for per-layer states or a loss)"
            )
    return_dict = call.pop("return_dict", None)
    use_cache = call.pop("use_cache", None)
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    src = ids if ids is not None else embeds
    if src is None:
        raise ValueError("pass input_ids or inputs_embeds")
    batch, q_len = src.shape[0], src.shape[1]

    returned = not (use_cache is False and cache is None)  # else a one-off cache, dropped after this forward
    if cache is None or (not isinstance(cache, TreeCache) and cache.get_seq_length() == 0):
        cache = TreeCache(model, binding.groups, layout=binding.layout, block_size=binding.block_size,
                          new_tokens=binding.new_tokens_hint)
    elif not isinstance(cache, TreeCache):
        raise ValueError(
            f"got a {type(cache).__name__} holding {cache.get_seq_length()} tokens; tree attention continues only "
            "a TreeCache (the other cache's keys were computed without sharding)"
        )
    if not _same_groups(cache.groups, binding.groups):
        alike = (cache.groups is not None and binding.groups is not None
                 and cache.groups.cp_ranks == binding.groups.cp_ranks)
        why = ("; the same ranks, but another process group: the cache's TreeGroups and the model's were built "
               "separately" if alike else "")
        raise ValueError(
            f"this TreeCache was made for {_describe(cache.groups, alike)}, but the model runs tree attention over "
            f"{_describe(binding.groups, alike)}{why}; create the cache with the model's groups"
        )
    if cache.num_layers != binding.num_layers:
        raise ValueError(f"TreeCache has {cache.num_layers} layers, the model {binding.num_layers}")

    if cache.get_seq_length() == 0:
        out = _prefill(model, orig, binding, cache, call, batch, q_len)
    else:
        out = _decode(orig, binding, cache, call, batch, q_len)
    out[binding.cache_kwarg] = cache if returned else None
    return out if return_dict is not False else out.to_tuple()


def _run(orig, binding, cache, call):
    binding.active = cache
    call[binding.cache_kwarg] = cache
    try:
        out = orig(**call, use_cache=True, return_dict=True)
        cache._finish()
    finally:
        binding.active = None
        cache._phase = None
    return out


def _checksum(t: torch.Tensor | None):
    """A position-weighted sum of ``t``'s values (host int or float): equal inputs give equal sums."""
    if t is None:
        return None
    flat = t.detach().reshape(-1)
    w = torch.arange(1, flat.numel() + 1, device=flat.device)
    if flat.is_floating_point():
        return float((flat.double() * w).sum())
    return int(((flat.long() + 1) * w).sum())


_WIDTHS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
"""Model widths every CP rank's replica must share (compared at prefill)."""

_SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
             "eos_token_id", "min_new_tokens", "generation_config", "generate_arguments")
"""``generate``'s settings every CP rank must pass alike (compared at the prefill): the sampling and stop
fields by name, then a digest of the whole effective generation config and of the call's other arguments.
Sampling settings that differ give ranks different token choices from the same logits; stop settings
that differ leave one rank stopping while the others wait for it."""


def _setting(value):
    """A generation setting as it is compared and printed: plain values as they are, tensors as lists,
    processors and other objects by their class (their state cannot be compared)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.detach().reshape(-1).tolist())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_setting(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _setting(v)) for k, v in value.items()))
    return f"<{type(value).__name__}>"


def _generation_settings(model, kwargs: dict) -> tuple:
    """The values of :data:`_SETTINGS` for one ``generate(**kwargs)`` call (the prompt's tensors are
    compared on their own): a field passed to ``generate`` wins over the generation config's."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    fields = tuple(_setting(kwargs[n] if n in kwargs else getattr(gc, n, None)) for n in _SETTINGS[:-2])
    config = None
    if gc is not None:
        config = hashlib.blake2b(repr(_setting(gc.to_dict())).encode(), digest_size=6).hexdigest()
    skip = {"input_ids", "inputs", "attention_mask", "generation_config", *_SETTINGS}
    rest = _setting({k: v for k, v in kwargs.items() if k not in skip})
    return (*fields, config, hashlib.blake2b(repr(rest).encode(), digest_size=6).hexdigest())


def _prefill(model, orig, binding: _Binding, cache: TreeCache, call: dict, batch: int, seq: int):
    """The forward that starts a sequence, each CP rank on its chunk.

    Per rank (every rank passes the same call):

    input_ids: (batch, seq) or inputs_embeds: (batch, seq, hidden) -- the left-padded prompt
    attention_mask: (batch, seq) 2-D padding mask or None; position_ids: (batch|1, seq) or None
    runs the model on (batch, W) tokens, W = this rank's largest share of a row (pads dropped)
    returns the model's output with logits: (batch, K, vocab) for the K positions asked for
        (``logits_to_keep``), identical on every rank; 0 at pad positions

    Collectives (CP > 1): an all-gather of the call's arguments and of whether this rank's checks of
    them passed (``agreement.agree``), the prefill method's per layer
    (``prefill.cp_prefill``), one all-reduce SUM of (batch, K, vocab) float32.
    """
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    device = (ids if ids is not None else embeds).device
    mask = call.pop("attention_mask", None)
    pos_ids = call.pop("position_ids", None)
    ltk = call.pop("logits_to_keep", 0) if binding.accepts_logits_to_keep else 0
    checked = {}

    def signature():
        """This rank's checks of the call; the values every CP rank must pass alike.

        Ranks handed different prompts would each compute their chunk of another prompt.
        max_new_tokens: generate's budget (None outside generate); ranks with different budgets
        would run in step until the first stops, then the others would wait in a collective for it.
        """
        lengths = [seq] * batch if mask is None else _mask_lengths(mask, batch, seq)
        pos = pos_ids
        if pos is None:  # what transformers uses without position_ids: 0..seq-1 on the padded row
            pos = torch.arange(seq, device=device)[None, :]
        if pos.dim() != 2 or pos.shape[-1] != seq or pos.shape[0] not in (1, batch):
            raise NotImplementedError(
                f"position_ids of shape {tuple(pos.shape)} are not supported; expected (batch, seq) or (1, seq)"
            )
        cache._check_prefill(lengths)
        # Which padded positions' logits to return.
        if isinstance(ltk, int):
            wanted = torch.arange(seq - ltk if 0 < ltk <= seq else 0, seq, device=device)
        else:
            wanted = torch.as_tensor(ltk, device=device).reshape(-1) % seq
        checked.update(lengths=lengths, pos_ids=pos.expand(batch, seq), wanted=wanted)
        return (batch, seq, _checksum(ids), _checksum(embeds), _checksum(mask), _checksum(pos.expand(batch, seq)),
                _checksum(wanted),
                binding.strategy, binding.prefill, binding.layout, binding.block_size, binding.new_tokens_hint,
                *(getattr(cfg, n, None) for n in _WIDTHS),
                *(binding.settings_hint or (None,) * len(_SETTINGS)))

    # The model's shape too: replicas whose attention shapes agree but whose widths do not would pass every
    # collective of the forward (chunks' keys, the logits' SUM) and return a mixture of two models.
    cfg = _text_config(model.config)
    names = ("batch", "seq", "input_ids", "inputs_embeds", "attention_mask", "position_ids", "logits_wanted",
             "strategy", "prefill", "layout", "block_size", "max_new_tokens", *_WIDTHS, *_SETTINGS)
    g = binding.groups
    group, ranks = (None, ()) if g is None else (g.cp_group, g.cp_ranks)
    agreement.agree("hf.prefill", names, signature, group, ranks, stats=binding.stats,
                    device=None if g is None else _comm_device(g, device))
    lengths, pos_ids, wanted = checked["lengths"], checked["pos_ids"], checked["wanted"]
    local = cache._begin_prefill(lengths, seq).to(device)  # (B, W) unpadded positions, -1 = filler
    pad = seq - torch.as_tensor(lengths, device=device)
    idx = pad[:, None] + local.clamp(min=0)  # index into the padded row
    if ids is not None:
        call["input_ids"] = ids.gather(1, idx)
    else:
        call["inputs_embeds"] = embeds.gather(1, idx[..., None].expand(-1, -1, embeds.shape[-1]))
    call["position_ids"] = pos_ids.gather(1, idx)
    call["attention_mask"] = None

    # Which of the wanted positions this rank holds: the model computes logits only there.
    compact = wanted[None, :] - pad[:, None]  # (B, K) unpadded position, < 0 for a pad
    needed = ((local[:, :, None] == compact[:, None, :]) & (compact[:, None, :] >= 0)).any(dim=2).any(dim=0)
    local_pos = local
    if binding.accepts_logits_to_keep:
        rows_local = needed.nonzero().flatten()  # local slots some row needs
        call["logits_to_keep"] = rows_local
        local_pos = local[:, rows_local]
    out = _run(orig, binding, cache, call)
    logits = out.logits  # (B, |rows_local| or W, V)
    out.logits = assemble_logits(logits, local_pos, compact, g, stats=binding.stats,
                                 device=None if g is None else _comm_device(g, device)).to(logits.dtype)
    return out


def _decode(orig, binding: _Binding, cache: TreeCache, call: dict, batch: int, q_len: int):
    """One new token per row on a filled cache: input_ids (batch, 1) -> logits (batch, 1, vocab).

    The same on every rank; one ``tree_decode`` merge per layer (its strategy's collectives).
    """
    if q_len != 1:
        raise NotImplementedError(
            f"a forward of {q_len} tokens on a TreeCache that already holds {cache.get_seq_length()}: only one new "
            "token per row is supported after the prompt (no assisted decoding, chunked prefill or prompt "
            "continuation; start a new cache for a new prompt)"
        )
    mask = call.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise NotImplementedError(
            f"a {mask.dim()}-D attention_mask is not supported; tree attention takes the 2-D padding mask only "
            "(causality and padding come from global token positions)"
        )
    if mask is not None and mask.shape[-1] >= 1 and not bool(mask[:, -1].all()):
        raise ValueError("the attention_mask marks a new (decoded) token as padding; only prompts may be padded")
    cache._begin_decode(batch)
    call["attention_mask"] = None
    return _run(orig, binding, cache, call)


# --------------------------------------------------------------------------- token agreement in generate


class _RankZeroDraws(LogitsProcessor):
    """Before each token is chosen, every CP rank takes CP rank 0's random state.

    The draw transformers makes next (``torch.multinomial`` on the processed scores) then
    gives every rank rank 0's token: logits are bitwise identical across the group (one
    merge result, one all-reduced prefill), so the same state gives the same choice, however
    the ranks were seeded. Scores pass through unchanged.
    """

    def __init__(self, groups: TreeGroups, stats: CommStats | None):
        self.groups, self.stats = groups, stats

    def __call__(self, input_ids, scores):
        dev = scores.device
        state = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()
        buf = state.to(_comm_device(self.groups, dev))
        collectives.broadcast(buf, self.groups.cp_ranks[0], self.groups.cp_group, stats=self.stats,
                              what="generate: CP rank 0's random state before a draw")
        if self.groups.rank != 0:
            if dev.type == "cuda":
                torch.cuda.set_rng_state(buf.cpu(), dev)
            else:
                torch.set_rng_state(buf.cpu())
        return scores


class _TokensAgree(StoppingCriteria):
    """After each step, all CP ranks must hold rank 0's newest tokens; a divergence fails on every rank."""

    def __init__(self, groups: TreeGroups, stats: CommStats | None):
        self.groups, self.stats = groups, stats
        self.step = 0

    def __call__(self, input_ids, scores, **kwargs):
        last = input_ids[:, -1]
        parts = collectives.all_gather(last.to(_comm_device(self.groups, last.device)), self.groups.cp_group,
                                       stats=self.stats, what="generate: checking the ranks' new tokens")
        self.step += 1
        if any(not torch.equal(p, parts[0]) for p in parts[1:]):
            raise RuntimeError(
                f"CP ranks {list(self.groups.cp_ranks)} chose different tokens at generated step {self.step}: "
                f"{[p.tolist() for p in parts]}; their caches would diverge. generate's settings were compared at "
                "the prefill, so a custom logits processor or stopping criterion differs between the ranks or is "
                "not deterministic"
            )
        return torch.zeros(last.shape[0], dtype=torch.bool, device=input_ids.device)


def _new_tokens(model, kwargs, prompt_len: int) -> int | None:
    """How many tokens this ``generate`` call may append (max_new_tokens, else max_length - prompt)."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
    if new is not None:
        return int(new)
    length = kwargs.get("max_length", getattr(gc, "max_length", None))
    return None if length is None else max(int(length) - prompt_len, 0)


def _sharded_generate(model, orig, binding: _Binding, args, kwargs):
    for name in ("assistant_model", "prompt_lookup_num_tokens", "max_time", "prefill_chunk_size"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"generate({name}=...) is not supported with tree attention")
    if (kwargs.get("num_beams") or 1) > 1:
        raise NotImplementedError("beam search is not supported with tree attention (CP ranks hold different shards)")
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    prompt_len = int(inputs.shape[1]) if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 0
    if binding.groups is not None and binding.groups.size > 1:
        lp = LogitsProcessorList(list(kwargs.pop("logits_processor", None) or []))
        lp.append(_RankZeroDraws(binding.groups, binding.stats))
        sc = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []))
        sc.append(_TokensAgree(binding.groups, binding.stats))
        kwargs.update(logits_processor=lp, stopping_criteria=sc)
    binding.new_tokens_hint = _new_tokens(model, kwargs, prompt_len)
    binding.settings_hint = _generation_settings(model, kwargs)
    try:
        return orig(*args, **kwargs)
    finally:
        binding.new_tokens_hint = None
        binding.settings_hint = None


# --------------------------------------------------------------------------- enabling


def _attention_modules(model) -> list:
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def _check_model(model) -> None:
    if not isinstance(model, transformers.PreTrainedModel) or not hasattr(model, "generate"):
        hint = " (for a DeepSpeed engine, pass engine.module)" if hasattr(model, "module") else ""
        raise UnsupportedModelError(
            f"expected a transformers causal LM (PreTrainedModel with generate), got {type(model).__name__}{hint}"
        )
    cfg = _text_config(model.config)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{name} has cross-attention (encoder-decoder or add_cross_attention=True); tree attention supports "
            "decoder-only causal self-attention"
        )
    if not getattr(type(model), "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so its attention cannot be replaced by tree attention"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(
            f"{name} has {other} layers (config.layer_types); tree attention supports full causal attention "
            "layers only"
        )
    for attr in ("sliding_window", "attention_chunk_size"):
        if getattr(cfg, attr, None) is not None:
            raise UnsupportedModelError(
                f"{name}'s config sets {attr}={getattr(cfg, attr)}; sliding-window / chunked attention is not "
                f"supported yet. If the window covers every sequence you run, set config.{attr} = None"
            )
    for attr in ("attn_logit_softcapping", "alibi"):
        if getattr(cfg, attr, None):
            raise UnsupportedModelError(f"{name}'s config sets {attr}; tree attention computes plain softmax attention")


def check_model(model) -> None:
    """Raise :class:`UnsupportedModelError` when tree attention cannot run ``model`` exactly.

    What :func:`enable_tree_attention` checks before it changes anything; cheap on a
    meta-device instance (the eval checks a checkpoint's class this way before launch).
    """
    _check_model(model)


def enable_tree_attention(model, groups: TreeGroups | None, *, strategy: str = "auto", prefill: str = "ring",
                          layout: str = "load_balanced", block_size: int = 16, stats: CommStats | None = None):
    """Make ``model`` (a transformers causal LM) run CP-sharded over ``groups``; returns the same model.

    Every CP rank calls this on its own replica (same weights) and then runs the same
    ``generate``/forward calls with the same inputs. Registers ``"megatron_tree"`` with
    transformers' ``AttentionInterface`` and sets it as the model's ``attn_implementation``;
    wraps ``model.forward`` and ``model.generate`` on this instance (see the module docstring).

    groups: the CP group (``None``: one process, CP = 1)
    strategy: the ``tree_decode`` merge (one of ``comm.STRATEGIES``)
    prefill: ``"ring"`` or ``"allgather"`` CP attention over the prompt chunks
    layout, block_size: placement of the prompt and of decoded tokens (``cache.CacheConfig``)
    stats: a :class:`~megatron_tree.CommStats` that records every collective of the forwards

    Raises :class:`UnsupportedModelError` for a model it cannot run exactly: attention that does
    not go through ``AttentionInterface``, cross-attention, sliding-window/chunked/soft-capped
    attention. Idempotent for the same groups; call :func:`disable_tree_attention` first to
    change them.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    if prefill not in PREFILL_METHODS:
        raise ValueError(f"unknown prefill method {prefill!r}; expected one of {PREFILL_METHODS}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown cache layout {layout!r}; expected one of {LAYOUTS}")
    if groups is not None and not isinstance(groups, TreeGroups):
        raise TypeError(f"groups must be a TreeGroups or None, got {type(groups).__name__}")
    existing = getattr(model, _MARK, None)
    if existing is not None:
        if not _same_groups(existing.groups, groups):
            raise ValueError(
                f"model already runs tree attention over {_describe(existing.groups)}; call disable_tree_attention "
                "before enabling it on another group"
            )
        existing.strategy, existing.prefill, existing.stats = strategy, prefill, stats
        existing.layout, existing.block_size = layout, block_size
        return model
    _check_model(model)
    cfg = _text_config(model.config)
    modules = _attention_modules(model)
    if len(modules) != cfg.num_hidden_layers:
        raise UnsupportedModelError(
            f"found {len(modules)} attention modules (a layer_idx and a class name ending in 'Attention') in "
            f"{type(model).__name__}, expected one per layer ({cfg.num_hidden_layers})"
        )
    forward_params = inspect.signature(model.forward).parameters
    binding = _Binding(
        groups=groups, strategy=strategy, prefill=prefill, layout=layout, block_size=block_size, stats=stats,
        num_layers=int(cfg.num_hidden_layers),
        cache_kwarg="cache" if "cache" in forward_params else "past_key_values",
        accepts_logits_to_keep="logits_to_keep" in forward_params,
        previous_attn=model.config._attn_implementation, attention_modules=modules,
    )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(
            f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r}; transformers "
            "refused to switch it, so tree attention cannot replace its attention"
        )
    for m in modules:
        setattr(m, _MARK, binding)
    orig_forward, orig_generate = model.forward, model.generate

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        return _sharded_forward(model, orig_forward, binding, args, kwargs)

    @functools.wraps(orig_generate)
    def generate(*args, **kwargs):
        return _sharded_generate(model, orig_generate, binding, args, kwargs)

    model.forward, model.generate = forward, generate
    setattr(model, _MARK, binding)
    return model


def disable_tree_attention(model):
    """Undo :func:`enable_tree_attention`: the previous attention implementation, forward and generate."""
    binding = getattr(model, _MARK, None)
    if binding is None:
        return model
    for name in ("forward", "generate"):
        if name in model.__dict__:
            del model.__dict__[name]
    for m in binding.attention_modules:
        if hasattr(m, _MARK):
            delattr(m, _MARK)
    model.set_attn_implementation(binding.previous_attn or "sdpa")
    delattr(model, _MARK)
    return model


# --------------------------------------------------------------------------- the eval's model protocol


class HFTreeModel:
    """A transformers model behind the library's decode-loop protocol (``generate.generate``, the eval).

    ``new_cache(batch, max_len)``, ``prefill(prompts, cache)`` -> (batch, vocab) logits of each
    prompt's last token, ``decode_step(ids, cache)`` -> (batch, vocab) logits of the next
    token, identical on every CP rank; ``groups``, ``device``, ``dtype``, ``config``
    (``vocab_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).
    ``hf`` is the enabled transformers model (``hf.generate`` works too); :meth:`unsharded`
    gives a one-process replica sharing its weights, for reference logits.
    """

    def __init__(self, hf_model, groups: TreeGroups | None, **enable_kwargs):
        self.hf = enable_tree_attention(hf_model, groups, **enable_kwargs)
        self.groups = groups
        self._binding: _Binding = getattr(self.hf, _MARK)
        cfg = _text_config(self.hf.config)
        self.config = cfg
        if getattr(cfg, "head_dim", None) is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if getattr(cfg, "num_key_value_heads", None) is None:
            cfg.num_key_value_heads = cfg.num_attention_heads

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def new_cache(self, batch_size: int, max_seq_len: int, layout: str | None = None,
                  block_size: int | None = None) -> TreeCache:
        """An empty cache for ``batch_size`` rows of up to ``max_seq_len`` tokens (1/CP of them per rank)."""
        return TreeCache(self.hf, self.groups, max_seq_len=max_seq_len, batch_size=batch_size,
                         layout=layout or self._binding.layout, block_size=block_size or self._binding.block_size)

    def _with(self, **over):
        b = self._binding
        saved = {k: getattr(b, k) for k in over}
        for k, v in over.items():
            if v is not None:
                setattr(b, k, v)
        return saved

    def unsharded(self):
        """A plain transformers replica for reference logits, sharing this model's weight tensors (no copy).

        It runs the attention implementation the model had before tree attention, in one process:
        ``ref(input_ids).logits`` is the unsharded forward the eval compares against.
        """
        import copy

        cfg = copy.deepcopy(self.hf.config)
        with torch.device("meta"):
            ref = type(self.hf)(cfg)
        ref.load_state_dict(self.hf.state_dict(), assign=True)
        for name, buf in self.hf.named_buffers():  # non-persistent buffers (e.g. RoPE's inv_freq)
            owner, _, leaf = name.rpartition(".")
            ref.get_submodule(owner)._buffers[leaf] = buf
        ref.set_attn_implementation(self._binding.previous_attn or "sdpa")
        return ref.eval()

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: TreeCache, method: str | None = None,
                stats: CommStats | None = None) -> torch.Tensor:
        """Left-pad ``prompts`` and run them through the sharded forward; returns (batch, vocab) logits."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        if cache.get_seq_length() != 0:
            cache.reset()
        seq = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), seq, dtype=torch.long)
        mask = torch.zeros(len(prompts), seq, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, seq - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[b, seq - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        saved = self._with(prefill=method, stats=stats)
        try:
            out = self.hf(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                          position_ids=pos.to(self.device), **{self._binding.cache_kwarg: cache}, logits_to_keep=1)
        finally:
            self._with(**saved)
        return out.logits[:, -1]

    @torch.no_grad()
    def decode_step(self, next_ids, cache: TreeCache, step: DecodeStep | None = None, *, strategy: str | None = None,
                    stats: CommStats | None = None) -> torch.Tensor:
        """Append one token per row (the same on every rank); returns (batch, vocab) logits.

        step: the loop's ``decode.generate.DecodeStep``: every layer's attention runs its ``attend``
        (``generate``'s ``shifted`` redo rewinds the cache and calls this again); without one, a
        plain step of ``strategy``/``stats`` (default: the model's own).
        """
        b = self._binding
        if step is None:
            step = DecodeStep(strategy or b.strategy, stats if stats is not None else b.stats)
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=self.device).reshape(-1, 1)
        # The new tokens' positions are the rows' lengths, host bookkeeping; on CUDA they reach the
        # device in a non-blocking copy from pinned memory (a pageable copy would make the host wait).
        cuda = self.device.type == "cuda"
        host = torch.tensor(cache.lengths, dtype=torch.long, pin_memory=cuda)
        pos = host.to(self.device, non_blocking=cuda)[:, None]
        b.step = step
        try:
            out = self.hf(input_ids=ids, position_ids=pos, **{b.cache_kwarg: cache})
        finally:
            b.step = None
        return out.logits[:, -1]

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def load_hf_model(path, groups: TreeGroups | None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", **enable_kwargs) -> HFTreeModel:
    """Load a Hugging Face causal-LM checkpoint with transformers and enable tree attention on it.

    path: a directory with ``config.json`` and safetensors weights (any architecture
        transformers knows whose attention goes through its AttentionInterface)
    enable_kwargs: ``strategy``, ``prefill``, ``layout``, ``block_size``, ``stats`` of
        :func:`enable_tree_attention`
    Every CP rank loads the full weights. Returns an :class:`HFTreeModel` (``.hf`` is the
    transformers model, in eval mode).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return HFTreeModel(model, groups, **enable_kwargs)
