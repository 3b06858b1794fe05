"""megatron_tree: exact, topology-aware context-parallel decoding (Tree Attention).

Public API (DESIGN.md section 3): ``flash_decode``, ``merge_states``, ``TreeGroups``,
``tree_decode``, ``CommStats``; the decode tier: ``ShardedKVCache``, ``generate``. Models are the
frameworks' own (``integrations.hf``: transformers; ``integrations.megatron``: Megatron-Core).
Importing the package has no side effects.
"""

from .decode.attention import tree_decode
from .comm import STRATEGIES, CommError, CommStats, DisagreementError
from .ops import flash_decode, merge_states
from .topology import Level, TopologyError, TreeGroups
from .decode.cache import CacheConfig, CacheOverflowError, ShardedKVCache
from .decode.generate import GenerationResult, generate

__version__ = "0.1.0"

__all__ = [
    "flash_decode", "merge_states", "tree_decode", "TreeGroups", "Level", "TopologyError",
    "CommStats", "CommError", "DisagreementError", "STRATEGIES", "CacheConfig", "CacheOverflowError", "ShardedKVCache",
    "generate", "GenerationResult", "__version__",
]
