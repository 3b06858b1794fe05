"""megatron_tree: exact, topology-aware context-parallel decoding (Tree Attention).

Public API (DESIGN.md section 3): ``flash_decode``, ``merge_states``, ``TreeGroups``,
``tree_decode``, ``CommStats``. Importing the package has no side effects.
"""

from .attention import tree_decode
from .comm import STRATEGIES, CommError, CommStats
from .ops import flash_decode, merge_states
from .topology import Level, TopologyError, TreeGroups

__version__ = "0.1.0"

__all__ = [
    "flash_decode", "merge_states", "tree_decode", "TreeGroups", "Level", "TopologyError",
    "CommStats", "CommError", "STRATEGIES", "__version__",
]
