"""0.19's ``MegatronLLM`` (what Megatron-RL and the text-generation server build on) over the CP-sharded engine.

Invariant: :class:`TreeMegatronLLM` is Megatron's ``MegatronLLM`` with one change: the context,
wrapper and engine it serves from are the tree pipeline's (:class:`~.dynamic.TreeDynamicInferenceContext`,
:class:`~.dynamic.TreeDynamicGPTInferenceWrapper`, Megatron's own ``DynamicInferenceEngine``),
so its ``generate`` returns, at any CP size, the tokens Megatron's own ``MegatronLLM`` returns at
CP = 1. Every CP rank calls ``generate`` with the same prompts (each runs the same scheduler).

Why a module of its own: the class exists only where the release has ``MegatronLLM``
(``megatron.core.inference.apis``, 0.18+); on 0.16.1 constructing it is a clear error.
"""

from __future__ import annotations

from .dynamic import TreeDynamicGPTInferenceWrapper, TreeDynamicInferenceContext
from .version import check_supported

__all__ = ["TreeMegatronLLM"]


def _megatron_llm_base():
    try:
        from megatron.core.inference.apis import MegatronLLM
    except ImportError:  # 0.16.1: no high-level API; the class below then refuses to be constructed
        return object
    return MegatronLLM


class TreeMegatronLLM(_megatron_llm_base()):
    """``MegatronLLM`` (direct mode) over the CP-sharded dynamic engine of a tree-spec model.

    ``TreeMegatronLLM(model=..., tokenizer=..., inference_config=None, use_coordinator=False, groups=None)``.
    ``MegatronLLM.__init__`` builds ``DynamicInferenceContext(model.config, inference_config)``,
    ``GPTInferenceWrapper`` and ``DynamicInferenceEngine`` inline, with no argument that takes a
    context or an engine; this subclass builds the tree pipeline instead and sets the attributes
    the base's methods read (``generate``, ``engine``, ``context``, ``controller``, ``shutdown``).
    ``inference_config.block_size_tokens`` and ``buffer_size_gb`` mean one CP rank's block and KV
    memory, as in :class:`~.dynamic.TreeDynamicInferenceContext`.

    Coordinator mode is refused at CP > 1: Megatron's coordinator hands requests to model-parallel
    rank 0 of each data-parallel replica and broadcasts them over the ``mp`` group (TP x PP), which
    does not hold a replica's CP peers.
    """

    def __init__(self, *, model, tokenizer, inference_config=None, use_coordinator: bool = False, groups=None):
        api = check_supported("TreeMegatronLLM")
        if not api.llm_api:
            raise RuntimeError(
                f"megatron-core {api.version} has no MegatronLLM (megatron.core.inference.apis, 0.18+); use "
                "build_dynamic_engine() and generate_dynamic() instead"
            )
        from megatron.core.inference.config import InferenceConfig
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )
        from megatron.core.utils import unwrap_model

        if use_coordinator:
            raise NotImplementedError(
                "TreeMegatronLLM supports use_coordinator=False only: Megatron's coordinator broadcasts requests "
                "over the TP x PP group, which does not include the CP peers of a replica"
            )
        inner = unwrap_model(model)
        context = TreeDynamicInferenceContext(inner.config, inference_config or InferenceConfig(), groups=groups,
                                              pg_collection=inner.pg_collection)
        controller = TextGenerationController(
            inference_wrapped_model=TreeDynamicGPTInferenceWrapper(model, context), tokenizer=tokenizer)
        self._engine = DynamicInferenceEngine(controller=controller, context=context)
        self._context, self._controller = context, controller
        self._use_coordinator, self._is_primary_rank = False, True
        self._loop_manager = self._coord_runtime = None
        self._shutdown_called = False
