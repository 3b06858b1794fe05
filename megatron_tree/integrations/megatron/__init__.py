"""Megatron-Core integration: tree attention in Megatron-Core's module slots, its static and dynamic engines.

Importing this package imports megatron-core (0.16.1 on Python 3.11, 0.19.x on Python >= 3.12;
:mod:`.version`). Re-exported here: the groups (:mod:`.groups`), the attention slots
(:mod:`.attention`) and the static engine's pieces (:mod:`.static`). The dynamic engine lives in
:mod:`.dynamic`, 0.19's ``MegatronLLM`` in :mod:`.llm`, model building and checkpoints in
:mod:`.model` and :mod:`.checkpoint`, the source patches for models without the module slot in :mod:`.patches`, the CPU
shim in :mod:`.cpu`.
"""

from ...utils.extras import require

require("megatron", "megatron_tree.integrations.megatron")

from .attention import (MARKER, SLOT_MARKER, TreeDotProductAttention, TreeSelfAttention,  # noqa: F401
                        get_gpt_layer_tree_spec, megatron_attention_fingerprint, restore_core_attention,
                        use_tree_attention)
from .groups import initialize_model_parallel, load_balanced_positions, tree_groups_from_megatron  # noqa: F401
from .static import ForwardPlan, TreeGPTInferenceWrapper, TreeInferenceContext  # noqa: F401
from .version import SUPPORTED_RANGES, check_megatron_version, megatron_api, megatron_version  # noqa: F401

__all__ = [
    "SUPPORTED_RANGES", "megatron_version", "megatron_api", "check_megatron_version", "tree_groups_from_megatron",
    "initialize_model_parallel", "load_balanced_positions", "MARKER", "SLOT_MARKER", "TreeDotProductAttention",
    "TreeSelfAttention", "use_tree_attention", "restore_core_attention", "get_gpt_layer_tree_spec",
    "megatron_attention_fingerprint", "TreeInferenceContext", "TreeGPTInferenceWrapper", "ForwardPlan",
]
