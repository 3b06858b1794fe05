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
library's layers below do not import it. The package imports transformers (>= 5.17) when it
is itself imported and says so clearly when it is missing or older.

The package, one concept a module: ``common`` (the transformers import, names, the binding),
``cache`` (:class:`TreeCache`), ``attention`` (the registered attention function), ``forward``
(the sharded forward), ``generate`` (the generate wrapper), ``enable`` (enabling, the model
checks), ``adapter`` (:class:`HFTreeModel`, :func:`load_hf_model`), ``checkpoint`` (the check of a
checkpoint directory every loader runs first).
"""

from .common import ATTN_IMPLEMENTATION, MIN_TRANSFORMERS, UnsupportedModelError
from .cache import TreeCache
from .attention import tree_attention_forward
from .enable import check_model, disable_tree_attention, enable_tree_attention, release_cache_storage
from .adapter import HFTreeModel, load_hf_model
from .checkpoint import CheckpointError, check_checkpoint

__all__ = [
    "ATTN_IMPLEMENTATION", "MIN_TRANSFORMERS", "UnsupportedModelError", "TreeCache", "tree_attention_forward",
    "check_model",
    "enable_tree_attention", "disable_tree_attention", "release_cache_storage", "HFTreeModel", "load_hf_model",
    "CheckpointError", "check_checkpoint",
]
