"""Prototype: tree attention through Megatron-Core's module slots only, on 0.16.1 and 0.19.x, no source patch.

Invariant: Megatron's installed source and its imported functions are never changed. Tree
attention enters through two ``ModuleSpec`` slots of the transformer layer:

* ``self_attention.submodules.core_attention`` -- :class:`~.static.TreeDotProductAttention` (as today);
* ``self_attention.module`` -- :class:`TreeSelfAttention`, a ``SelfAttention`` subclass that
  overrides the two methods the runtime patches replace today (patches 0001/0002 in
  ``patches/``): ``_adjust_key_value_for_inference`` (the KV-cache update, deferring to the core
  attention's ``adjust_key_value_for_inference``) and ``flash_decode_and_prefill`` (the dynamic
  engine's attention, deferring to the core attention's ``dynamic_attention``; 0.19 adds
  ``softmax_offset``). Where the core attention declines (``None``: Megatron's own context at
  CP = 1), Megatron's own method runs unchanged.

Everything that differs between the releases is asked of :mod:`._proto_compat` (feature
detection in one place). The existing classes are reused by import: the core attention, the
CP-sharded static context and its wrapper from :mod:`.static`, the paged dynamic context from
:mod:`.dynamic`; the subclasses here only adapt constructors and signatures.

Why a separate module: the lead keeps :mod:`.static`/:mod:`.dynamic` unchanged while this is
proven; the next helper folds these classes into them (see /work/notes/megatron019.md).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch

from . import static
from ._proto_compat import check_supported, init_gpt_wrapper, megatron_api, prep_model_for_inference, \
    get_only_last_token_logits, kv_block_allocator, refuse_unsupported_features, set_only_last_token_logits
from .dynamic import TreeDynamicInferenceContext
from .static import MARKER, TreeDotProductAttention, TreeGPTInferenceWrapper, TreeInferenceContext

__all__ = [
    "TreeSelfAttention", "SlotCoreAttention", "get_gpt_layer_slot_spec", "SlotInferenceContext",
    "SlotGPTInferenceWrapper", "SlotDynamicInferenceContext", "SlotDynamicGPTInferenceWrapper",
    "megatron_attention_fingerprint", "build_dynamic_engine_any", "dynamic_kv_bytes", "TreeMegatronLLM",
]

SLOT_MARKER = "megatron_tree.TreeSelfAttention"


@contextlib.contextmanager
def _release_accepted():
    """Let :mod:`.static`'s 0.16.1-only version check accept the imported release while a class is built.

    Stand-in for the merged version-range adapter (:func:`._proto_compat.check_supported` is the check
    that runs); restores :data:`.static.SUPPORTED_VERSIONS` on exit.
    """
    api = check_supported("megatron_tree (module-slot prototype)")
    saved = static.SUPPORTED_VERSIONS
    static.SUPPORTED_VERSIONS = tuple(dict.fromkeys(saved + (api.version,)))
    try:
        yield api
    finally:
        static.SUPPORTED_VERSIONS = saved


class SlotCoreAttention(TreeDotProductAttention):
    """:class:`~.static.TreeDotProductAttention` for the ``core_attention`` slot on any supported release."""

    def __init__(self, config, *args, **kwargs):
        refuse_unsupported_features(config)
        with _release_accepted():
            super().__init__(config, *args, **kwargs)


def _self_attention_base():
    from megatron.core.transformer.attention import SelfAttention

    return SelfAttention


class TreeSelfAttention(_self_attention_base()):
    """``SelfAttention`` whose inference KV-cache update and dynamic attention defer to the core attention.

    Filled into ``ModuleSpec.module`` of the layer's ``self_attention`` (see :func:`get_gpt_layer_slot_spec`);
    constructed by Megatron with ``SelfAttention``'s own arguments. Training forwards, and inference with a
    core attention that has no hooks, run Megatron's code unchanged.
    """

    _megatron_tree = SLOT_MARKER

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                                        sequence_len_offset=None, *, inference_params=None):
        """Megatron's tuple ``(query, key, value, rotary_pos_emb, attn_mask_type, block_table)``.

        query: [sq, b, hq, d]; key, value: [sq, b, hkv, d] (static) or [T, 1, h, d] (dynamic, packed).
        """
        ctx = inference_context if inference_context is not None else inference_params
        hook = getattr(self.core_attention, "adjust_key_value_for_inference", None)
        if hook is not None and ctx is not None:
            result = hook(self, ctx, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                          rotary_pos_cos_sin, sequence_len_offset)
            if result is not None:
                return result
        return super()._adjust_key_value_for_inference(
            inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
            rotary_pos_cos_sin, sequence_len_offset, inference_params=inference_params,
        )

    def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                 block_table, is_decode_only, softmax_offset=None):
        """Attention of a dynamic (packed, paged) batch: q [T, 1, hq, d] -> [T, 1, hq, d].

        softmax_offset: 0.19's per-head sink logit; refused (``NotImplementedError``) when given,
        because a sink must join the softmax once over the whole CP group, not once per rank.
        """
        if softmax_offset is not None:
            raise NotImplementedError(
                "sink / off-by-one softmax (softmax_offset) is not supported by tree attention yet; "
                "expected softmax_type='vanilla'"
            )
        hook = getattr(self.core_attention, "dynamic_attention", None)
        if hook is not None:
            result = hook(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                          block_table, is_decode_only)
            if result is not None:
                return result
        args = (q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, is_decode_only)
        if megatron_api().softmax_offset:
            return super().flash_decode_and_prefill(*args, softmax_offset=softmax_offset)
        return super().flash_decode_and_prefill(*args)


def get_gpt_layer_slot_spec(*, strategy: str = "auto", backend: str | None = None, **local_spec_kwargs):
    """``get_gpt_layer_local_spec(**local_spec_kwargs)`` with both slots filled; applies no patch.

    ``self_attention.module`` -> :class:`TreeSelfAttention`; ``core_attention`` ->
    :class:`SlotCoreAttention` (``strategy``/``backend`` bound). Each slot keeps what it held in
    ``__wrapped__`` (the module slot: on the spec, ``_megatron_tree_wrapped_module``).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention

    check_supported("get_gpt_layer_slot_spec")
    spec = copy.deepcopy(get_gpt_layer_local_spec(**local_spec_kwargs))
    attn = spec.submodules.self_attention
    if attn.module is not SelfAttention:
        raise TypeError(f"expected the layer spec's self_attention.module to be SelfAttention, got {attn.module!r}")
    core = functools.partial(SlotCoreAttention, strategy=strategy, backend=backend)
    core._megatron_tree = MARKER
    core.__wrapped__ = attn.submodules.core_attention
    attn.submodules.core_attention = core
    attn._megatron_tree_wrapped_module = attn.module
    attn.module = TreeSelfAttention
    return spec


class SlotInferenceContext(TreeInferenceContext):
    """:class:`~.static.TreeInferenceContext` on either release.

    ``materialize_only_last_token_logits`` is a property over wherever the release keeps it
    (the context in 0.16.1, ``context.config`` in 0.19), so the wrapper's ``_forward`` and
    Megatron's controller read and write one value.
    """

    materialize_only_last_token_logits = property(get_only_last_token_logits, set_only_last_token_logits)


class SlotGPTInferenceWrapper(TreeGPTInferenceWrapper):
    """:class:`~.static.TreeGPTInferenceWrapper` constructed with the release's signature, applying no patch.

    ``SlotGPTInferenceWrapper(model, inference_context, pg_collection=None)`` on both releases.
    """

    def __init__(self, model, inference_context, pg_collection=None):
        import torch.distributed as dist
        from megatron.core.utils import unwrap_model

        if not isinstance(inference_context, SlotInferenceContext):
            raise TypeError(
                f"SlotGPTInferenceWrapper needs a SlotInferenceContext, got {type(inference_context).__name__}")
        inner = unwrap_model(model)
        _check_slots(inner)
        init_gpt_wrapper(self, model, inference_context, hidden_size=inner.config.hidden_size,
                         params_dtype=inner.config.params_dtype, padded_vocab_size=inner.vocab_size,
                         pg_collection=pg_collection)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            raise NotImplementedError("SlotGPTInferenceWrapper does not support pipeline parallelism")

    def prep_model_for_inference(self, prompts_tokens=None):
        from megatron.core.utils import unwrap_model

        prep_model_for_inference(self, prompts_tokens)
        self.inference_context.bind_rope(unwrap_model(self.model))


def _check_slots(inner) -> None:
    layers = inner.decoder.layers
    bad = [i for i, layer in enumerate(layers) if not isinstance(layer.self_attention, TreeSelfAttention)
           or not isinstance(layer.self_attention.core_attention, TreeDotProductAttention)]
    if bad:
        first = layers[bad[0]].self_attention
        raise TypeError(
            f"layers {bad} hold {type(first).__name__} / {type(first.core_attention).__name__}; build the model "
            "with get_gpt_layer_slot_spec() so TreeSelfAttention and TreeDotProductAttention fill both slots"
        )


def megatron_attention_fingerprint() -> dict:
    """sha256 of Megatron's installed attention module file and the identity of the methods we override.

    Compared before and after a decode, it shows no source was modified on disk and no function
    replaced in the imported module (a runtime patch would change ``functions``).
    """
    import hashlib
    import inspect

    from megatron.core.transformer import attention

    names = ("_adjust_key_value_for_inference", "flash_decode_and_prefill", "forward")
    return {
        "file_sha256": hashlib.sha256(open(attention.__file__, "rb").read()).hexdigest(),
        "functions": {n: id(attention.Attention.__dict__[n]) for n in names},
        "source_sha256": {n: hashlib.sha256(inspect.getsource(attention.Attention.__dict__[n]).encode()).hexdigest()
                          for n in names},
        "patched": [n for n in names if hasattr(attention.Attention.__dict__[n], "_megatron_tree_patch")],
    }


# --------------------------------------------------------------------------- dynamic engine (0.19)


def _dynamic_base():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    return DynamicInferenceContext


class _DynamicKeywords(_dynamic_base()):
    """Sits between :class:`~.dynamic.TreeDynamicInferenceContext` and Megatron's context in the MRO.

    The parent's ``initialize_attention_state()`` and ``reset()`` call ``super()`` without 0.19's
    keywords; this class hands Megatron the keywords the engine passed (stashed by
    :class:`SlotDynamicInferenceContext`) and keeps the returned bookkeeping event.
    """

    _stashed: dict = {}

    def initialize_attention_state(self, **kwargs):
        self._event = super().initialize_attention_state(**{**self._stashed, **kwargs})

    def reset(self, *args, **kwargs):
        super().reset(*args, **{**self._stashed, **kwargs})


class SlotDynamicInferenceContext(TreeDynamicInferenceContext, _DynamicKeywords):
    """:class:`~.dynamic.TreeDynamicInferenceContext` built with 0.19's ``(model_config, inference_config)``.

    ``inference_config.block_size_tokens`` and ``buffer_size_gb`` mean *one CP rank's* block and
    KV memory (as in :class:`~.dynamic.TreeDynamicInferenceContext`); Megatron schedules in logical
    blocks of ``cp * block_size_tokens``. 0.19's KV memory hook is ``_allocate_memory_buffer``
    (0.16.1's ``allocate_all_tensors``, which the parent overrides, does not exist there): it
    allocates Megatron's ``memory_buffer`` with no token slots, so the only KV storage is
    ``kv_cache``, 1/CP of the logical cache.
    """

    def __init__(self, model_config, inference_config, *, groups=None, pg_collection=None):
        import dataclasses

        from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

        from ...decode.paged import PagedKVCache
        from .static import tree_groups_from_megatron

        api = check_supported("SlotDynamicInferenceContext")
        if not api.inference_config:
            raise RuntimeError(
                "SlotDynamicInferenceContext is 0.19's constructor; on 0.16.1 use TreeDynamicInferenceContext")
        refuse_unsupported_features(model_config, inference_config)
        self.groups = groups if groups is not None else tree_groups_from_megatron(pg_collection)
        self.cp_size, self.cp_rank = self.groups.size, self.groups.rank
        per_rank_block = int(inference_config.block_size_tokens)
        max_seq = int(inference_config.max_sequence_length)
        max_seq += max_seq % 2
        self.per_rank_buffer_size_gb = inference_config.buffer_size_gb
        logical = dataclasses.replace(
            inference_config, block_size_tokens=self.cp_size * per_rank_block,
            buffer_size_gb=inference_config.buffer_size_gb * self.cp_size, max_sequence_length=max_seq,
            use_flashinfer_fused_rope=False,
        )
        DynamicInferenceContext.__init__(self, model_config, logical)
        usable = kv_block_allocator(self).total_count - 1  # Megatron keeps one dummy block
        if usable * self.block_size_tokens < self.max_sequence_length:
            raise ValueError(
                f"buffer_size_gb={inference_config.buffer_size_gb} per rank holds {usable} blocks of {per_rank_block} "
                f"tokens per rank, fewer than max_sequence_length={self.max_sequence_length} over {self.cp_size} ranks"
            )
        self.kv_cache = PagedKVCache(
            num_layers=self.num_attention_layers, num_kv_heads=self.num_attention_heads_per_partition,
            head_dim=self.hidden_size_per_attention_head, block_size=per_rank_block, blocks_per_rank=usable,
            max_seq_len=self.max_sequence_length, cp_size=self.cp_size, cp_rank=self.cp_rank,
            dtype=self.params_dtype, device=torch.cuda.current_device(),
        )
        self.step = None
        self.rope_table = None

    def _allocate_memory_buffer(self):
        # Megatron's buffer is [2, layers, blocks, block_size_tokens, heads, dim]; with no token slots it
        # holds nothing, and nothing of Megatron's reads it: the KV lives in self.kv_cache.
        logical = self.block_size_tokens
        self.block_size_tokens = 0
        try:
            super()._allocate_memory_buffer()
        finally:
            self.block_size_tokens = logical

    def reset(self, *args, **kwargs) -> None:
        self._stashed = kwargs
        try:
            super().reset()
        finally:
            self._stashed = {}

    def initialize_attention_state(self, *, construct_graph_dimensions=None, **kwargs):
        """Takes 0.19's keywords and returns its bookkeeping event; the parent plans the step."""
        if construct_graph_dimensions is not None:
            raise NotImplementedError("SlotDynamicInferenceContext does not support CUDA graphs")
        self._stashed, self._event = kwargs, None
        try:
            super().initialize_attention_state()
        finally:
            self._stashed = {}
        return self._event


class SlotDynamicGPTInferenceWrapper(SlotGPTInferenceWrapper):
    """``GPTInferenceWrapper`` for a slot-spec model and a :class:`SlotDynamicInferenceContext` (0.19)."""

    def __init__(self, model, inference_context, pg_collection=None):
        import torch.distributed as dist
        from megatron.core.utils import unwrap_model

        if not isinstance(inference_context, TreeDynamicInferenceContext):
            raise TypeError(
                "SlotDynamicGPTInferenceWrapper needs a TreeDynamicInferenceContext (0.16.1) or a "
                f"SlotDynamicInferenceContext (0.19), got {type(inference_context).__name__}")
        inner = unwrap_model(model)
        _check_slots(inner)
        refuse_unsupported_features(inner.config, getattr(inference_context, "config", None))
        init_gpt_wrapper(self, model, inference_context, hidden_size=inner.config.hidden_size,
                         params_dtype=inner.config.params_dtype, padded_vocab_size=inner.vocab_size,
                         pg_collection=pg_collection)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            raise NotImplementedError("SlotDynamicGPTInferenceWrapper does not support pipeline parallelism")
        inference_context.bind_rope(inner)

    # Megatron's own GPTInferenceWrapper behaviour for dynamic batching (the parent's static-only
    # _forward and mask building are not used by the dynamic controller path).
    def _forward(self, inference_input):
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

        return GPTInferenceWrapper._forward(self, inference_input)

    def _build_attention_mask_and_position_ids(self, prompts_tokens):
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

        return GPTInferenceWrapper._build_attention_mask_and_position_ids(self, prompts_tokens)


def dynamic_kv_bytes(ctx) -> dict:
    """KV bytes this rank holds in a dynamic context: Megatron's ``memory_buffer`` and, for ours, ``kv_cache``."""
    mb = getattr(ctx, "memory_buffer", None)
    out = {"megatron_memory_buffer": 0 if mb is None else mb.numel() * mb.element_size()}
    if isinstance(ctx, TreeDynamicInferenceContext):
        out["tree_kv_cache"] = sum(t.numel() * t.element_size() for t in (ctx.kv_cache.k, ctx.kv_cache.v))
    return out


def build_dynamic_engine_any(model, tokenizer, *, max_sequence_length: int, buffer_size_gb: float,
                             block_size_tokens: int, max_tokens: int, max_requests: int,
                             enable_chunked_prefill: bool, groups=None):
    """Megatron's ``DynamicInferenceEngine`` for ``model`` on 0.16.1 or 0.19, applying no patch.

    A model whose layers hold :class:`TreeSelfAttention` gets the CP-sharded context
    (``buffer_size_gb`` and ``block_size_tokens`` per rank; :class:`SlotDynamicInferenceContext`
    on 0.19, :class:`~.dynamic.TreeDynamicInferenceContext` on 0.16.1) and
    :class:`SlotDynamicGPTInferenceWrapper`; any other model Megatron's own context and
    ``GPTInferenceWrapper`` (CP must be 1). Where the release puts each knob (0.19: one
    ``InferenceConfig``; 0.16.1: context keywords and engine keywords) is this function's business.
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.utils import unwrap_model

    api = check_supported("build_dynamic_engine_any")
    inner = unwrap_model(model)
    config = inner.config
    tree = isinstance(inner.decoder.layers[0].self_attention, TreeSelfAttention)
    if not tree and config.context_parallel_size != 1:
        raise ValueError(
            f"Megatron's own attention at context_parallel_size={config.context_parallel_size}: build the model "
            "with get_gpt_layer_slot_spec()"
        )
    if api.inference_config:
        from megatron.core.inference.config import InferenceConfig

        icfg = InferenceConfig(
            max_sequence_length=max_sequence_length, buffer_size_gb=buffer_size_gb,
            block_size_tokens=block_size_tokens, max_tokens=max_tokens, max_requests=max_requests,
            enable_chunked_prefill=enable_chunked_prefill, use_flashinfer_fused_rope=False,
        )
        if tree:
            context = SlotDynamicInferenceContext(config, icfg, groups=groups, pg_collection=inner.pg_collection)
            wrapper = SlotDynamicGPTInferenceWrapper(model, context)
        else:
            context = DynamicInferenceContext(config, icfg)
            wrapper = GPTInferenceWrapper(model, context)
        engine_kwargs = {}
    else:
        dims = dict(
            params_dtype=config.params_dtype, num_layers=config.num_layers, kv_channels=config.kv_channels,
            num_attention_heads=config.num_query_groups or config.num_attention_heads,
            tensor_model_parallel_size=config.tensor_model_parallel_size, max_sequence_length=max_sequence_length,
            buffer_size_gb=buffer_size_gb, block_size_tokens=block_size_tokens, max_requests=max_requests,
            max_tokens=max_tokens,
        )
        if tree:
            context = TreeDynamicInferenceContext(groups=groups, pg_collection=inner.pg_collection, **dims)
            wrapper = SlotDynamicGPTInferenceWrapper(model, context)
        else:
            context = DynamicInferenceContext(**dims)
            wrapper = GPTInferenceWrapper.__new__(GPTInferenceWrapper)
            init_gpt_wrapper(wrapper, model, context, hidden_size=config.hidden_size, params_dtype=config.params_dtype,
                             padded_vocab_size=inner.vocab_size)
        engine_kwargs = dict(random_seed=0, enable_chunked_prefill=enable_chunked_prefill)
    controller = TextGenerationController(wrapper, tokenizer)
    return DynamicInferenceEngine(controller, context, **engine_kwargs)


# --------------------------------------------------------------------------- MegatronLLM (0.18+)


def _megatron_llm_base():
    try:
        from megatron.core.inference.apis import MegatronLLM
    except ImportError:  # 0.16.1, 0.17: no high-level API; the class below is then never constructed
        return object
    return MegatronLLM


class TreeMegatronLLM(_megatron_llm_base()):
    """0.19's ``MegatronLLM`` (direct mode) over the CP-sharded dynamic engine of a slot-spec model.

    ``MegatronLLM.__init__`` builds ``DynamicInferenceContext(model.config, inference_config)``,
    ``GPTInferenceWrapper`` and ``DynamicInferenceEngine`` inline, with no argument that takes a
    context or engine; this subclass builds the tree pipeline instead and sets the attributes the
    base's methods read (``generate``, ``engine``, ``context``, ``controller``, ``shutdown``).
    Every CP rank must call :meth:`generate` with the same prompts (each runs the same scheduler).

    Coordinator mode is refused at CP > 1: Megatron's coordinator hands requests to model-parallel
    rank 0 of each data-parallel replica and broadcasts them over the ``mp`` group (TP x PP), which
    does not hold a replica's CP peers.
    """

    def __init__(self, *, model, tokenizer, inference_config=None, use_coordinator: bool = False, groups=None):
        from megatron.core.inference.config import InferenceConfig
        from megatron.core.inference.engines import DynamicInferenceEngine
        from megatron.core.inference.text_generation_controllers.text_generation_controller import (
            TextGenerationController,
        )
        from megatron.core.utils import unwrap_model

        api = check_supported("TreeMegatronLLM")
        if not api.llm_api:
            raise RuntimeError(f"megatron-core {api.version} has no MegatronLLM (megatron.core.inference.apis, 0.18+)")
        inner = unwrap_model(model)
        if use_coordinator:
            raise NotImplementedError(
                "TreeMegatronLLM supports use_coordinator=False only: Megatron's coordinator broadcasts requests "
                "over the TP x PP group, which does not include the CP peers of a replica"
            )
        context = SlotDynamicInferenceContext(inner.config, inference_config or InferenceConfig(), groups=groups,
                                              pg_collection=inner.pg_collection)
        controller = TextGenerationController(inference_wrapped_model=SlotDynamicGPTInferenceWrapper(model, context),
                                              tokenizer=tokenizer)
        self._engine = DynamicInferenceEngine(controller=controller, context=context)
        self._context, self._controller = context, controller
        self._use_coordinator, self._is_primary_rank = False, True
        self._loop_manager = self._coord_runtime = None
        self._shutdown_called = False
