"""The decode tier: everything between the merge (``comm``) and the frameworks' integrations.

``tree_decode`` over a contiguous or paged shard (``attention``), the one placement rule
(``placement``) and step planner (``plan``), a step's attention metadata (``metadata``), the sharded caches (``cache``: contiguous,
``paged``), CP prefill and the one assembly of its logits (``prefill``), and the one
generation loop with its written model protocol and the ``shifted`` redo (``generate``), and exact
speculative decoding across the CP group (``speculative``: draft trees verified in one step).
Every integration (Megatron-Core, transformers, the lm-eval backend) is a thin adapter over it.
"""

from .attention import tree_decode
from .cache import CacheConfig, CacheOverflowError, ShardedKVCache, StoragePool
from .generate import (DecodeCache, DecodeModel, DecodeStep, GenerationHook, GenerationResult, StepRunner,
                       generate)
from .metadata import PrefillMetadata, StepMetadata, VerifyMetadata
from .paged import PagedKVCache, PoolExhaustedError
from .placement import LAYOUTS, PlacementError, RowPlacement, prefill_ranges
from .plan import StepPlan, StepPlanner
from .prefill import PREFILL_METHODS, allgather_prefill, assemble_logits, cp_prefill, ring_prefill
from .speculative import SpeculativeConfig, SpeculativeResult, generate_speculative, verify_attention

__all__ = [
    "tree_decode", "CacheConfig", "CacheOverflowError", "ShardedKVCache", "StoragePool", "GenerationHook",
    "GenerationResult", "generate", "DecodeModel", "DecodeCache", "DecodeStep", "StepRunner", "PagedKVCache",
    "PoolExhaustedError", "LAYOUTS", "PlacementError", "RowPlacement", "prefill_ranges", "StepPlan",
    "StepPlanner", "PREFILL_METHODS", "allgather_prefill", "assemble_logits", "cp_prefill", "ring_prefill",
    "SpeculativeConfig", "SpeculativeResult", "generate_speculative", "verify_attention", "StepMetadata",
    "PrefillMetadata", "VerifyMetadata",
]
