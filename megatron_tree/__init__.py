"""megatron_tree: exact, topology-aware context-parallel decoding (Tree Attention).

The front door is one tier, the functional API (docs/design.md §3)::

    import megatron_tree as mt
    groups = mt.TreeGroups.from_env()                      # the CP group and its node levels
    out = mt.tree_decode(q, k_shard, v_shard, groups, cache_seqlens=lens)
    out, lse = mt.flash_decode(q, k, v, cache_seqlens=lens)  # the local half
    out, lse = mt.merge_states(outs, lses)                   # the exact merge of partial states

with the groups (``TreeGroups``, ``Level``), the accounting (``CommStats``), the strategy names
(``STRATEGIES``) and the errors every entry point raises (``CommError``, ``DisagreementError``,
``TopologyError``, ``CacheOverflowError``). The decode tier's caches and generation loop are in
:mod:`megatron_tree.decode`.

The two integrations are reached lazily, so importing the package imports neither
transformers nor megatron-core and has no side effects:

* ``mt.hf`` -- transformers models (``mt.hf.enable_tree_attention(model, groups)``,
  ``mt.hf.load_hf_model(path, groups)``);
* ``mt.megatron`` -- Megatron-Core (``mt.megatron.get_gpt_layer_tree_spec()``, its engines).
"""

import importlib as _importlib

from .comm.merge import STRATEGIES, CommError, CommStats, DisagreementError
from .decode.attention import tree_decode
from .decode.cache import CacheOverflowError
from .ops.dispatch import flash_decode, merge_states
from .distributed.topology import LauncherEnvError, Level, TopologyError, TreeGroups

__version__ = "0.1.0"

_LAZY = {"hf": "megatron_tree.integrations.hf", "megatron": "megatron_tree.integrations.megatron"}

__all__ = [
    "tree_decode", "flash_decode", "merge_states",
    "TreeGroups", "Level",
    "CommStats", "STRATEGIES",
    "CommError", "DisagreementError", "TopologyError", "LauncherEnvError", "CacheOverflowError",
    "hf", "megatron", "__version__",
]


def __getattr__(name):
    """Import an integration on first use (``mt.hf``, ``mt.megatron``)."""
    if name in _LAZY:
        module = _importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(
        f"module 'megatron_tree' has no attribute {name!r}; the front door holds {', '.join(__all__)} "
        "(the caches and the generation loop are in megatron_tree.decode)")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
