"""The decode tier: everything between the merge (``comm``) and the frameworks' integrations.

``tree_decode`` over a contiguous or paged shard, the one placement rule and step planner,
the sharded caches (contiguous and paged), CP prefill and the one generation loop. Every
integration (Megatron-Core, transformers, the lm-eval backend) is a thin adapter over it.
"""

from .attention import ShiftState, tree_decode
from .cache import CacheConfig, CacheOverflowError, ShardedKVCache
from .generate import GenerationHook, GenerationResult, generate
from .paged import PagedKVCache, PoolExhaustedError
from .placement import LAYOUTS, PlacementError, RowPlacement, prefill_ranges
from .prefill import PREFILL_METHODS, allgather_prefill, cp_prefill, ring_prefill

__all__ = [
    "tree_decode", "ShiftState", "CacheConfig", "CacheOverflowError", "ShardedKVCache", "GenerationHook",
    "GenerationResult", "generate", "PagedKVCache", "PoolExhaustedError", "LAYOUTS", "PlacementError",
    "RowPlacement", "prefill_ranges", "PREFILL_METHODS", "allgather_prefill", "cp_prefill", "ring_prefill",
]
