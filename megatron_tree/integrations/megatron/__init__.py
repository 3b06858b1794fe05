"""Megatron-Core integration: tree attention in Megatron-Core's module slots, its static and dynamic engines.

Importing this package checks that megatron-core is installed (0.16.1 on Python 3.11, 0.19.x on
Python >= 3.12; :mod:`.version`) but does not import it: the names below load on first use, and
megatron.core is imported by the code that calls it. Re-exported here: the groups (:mod:`.groups`), the attention slots
(:mod:`.attention`) and the static engine's pieces (:mod:`.static`). The dynamic engine lives in
:mod:`.dynamic`, 0.19's ``MegatronLLM`` in :mod:`.llm`, model building and checkpoints in
:mod:`.model` and :mod:`.checkpoint`, the source patches for models without the module slot in :mod:`.patches`, the CPU
shim in :mod:`.cpu`.
"""

import importlib

from ...utils.extras import EXTRAS, installed

_EXPORTS = {
    "attention": ("MARKER", "SLOT_MARKER", "TreeDotProductAttention", "TreeSelfAttention", "get_gpt_layer_tree_spec",
                  "megatron_attention_fingerprint", "restore_core_attention", "use_tree_attention"),
    "groups": ("initialize_model_parallel", "load_balanced_positions", "tree_groups_from_megatron"),
    "static": ("ForwardPlan", "TreeGPTInferenceWrapper", "TreeInferenceContext"),
    "version": ("SUPPORTED_RANGES", "check_megatron_version", "megatron_api", "megatron_version"),
}
"""Submodule -> the names re-exported from it, imported on first use (:func:`__getattr__`)."""

_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [name for names in _EXPORTS.values() for name in names]


def _check_installed() -> None:
    """megatron-core must be installed, but is not imported here: importing megatron.core takes seconds
    (5-7 CPU-s), and the parts that only read files -- :mod:`.checkpoint`'s checks before launch, which
    make a wrong path fail at once -- need none of it. The modules that use it import it where they do."""
    module, dist = EXTRAS["megatron"]
    if not installed(module):
        raise ImportError(f"megatron_tree.integrations.megatron needs {dist}: pip install "
                          f"'megatron_tree[megatron]' ({module} is not installed)")


_check_installed()


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
