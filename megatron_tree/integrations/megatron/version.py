"""Which megatron-core releases this integration supports, and every API difference between them.

Invariant: every difference the Megatron integration meets between releases is one field of
:class:`MegatronAPI` (found by *looking at* the imported release: a class, a parameter, an
attribute; never by comparing version strings) and at most one small adapter function
below; code elsewhere asks these, never the version. The version string is used for one
thing only: to refuse, with a clear error, a release outside the ranges the integration was
tested on (:data:`SUPPORTED_RANGES`), because feature detection cannot prove that an untested
release *behaves* the same. What 0.19 adds that tree attention does not handle yet is refused
here too (:func:`refuse_unsupported_features`), before any collective.

Known of the releases between: 0.17 (April 2026) and 0.18 (June 2026) need Python >= 3.12 like
0.19; they were not run here. 0.18 introduced ``MegatronLLM``; whether its dynamic context
already took an ``InferenceConfig`` was not checked, so both are refused rather than guessed.

Why a module of its own: the attention, the contexts, the patches and the CPU shim all ask it,
and none of them may import another for this.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

__all__ = [
    "SUPPORTED_RANGES", "megatron_version", "check_megatron_version", "MegatronAPI", "megatron_api", "check_supported", "init_gpt_wrapper",
    "prep_model_for_inference", "get_only_last_token_logits", "set_only_last_token_logits",
    "kv_block_allocator", "batch_on_this_cp_rank", "inference_mode_off", "inference_mode_active",
    "refuse_unsupported_features",
]

SUPPORTED_RANGES = (("0.16.1", "0.17"), ("0.19.0", "0.20"))
"""``[low, high)`` megatron-core ranges the integration was tested on (0.16.1: Python 3.11; 0.19: 3.12)."""


def megatron_version() -> str:
    """Version of the megatron-core that is imported (``megatron.core.package_info.__version__``)."""
    from megatron.core import package_info

    return package_info.__version__


@dataclass(frozen=True)
class MegatronAPI:
    """What the imported megatron-core offers, each field detected from the release itself."""

    version: str
    """``megatron.core.package_info.__version__`` (used only by :func:`check_supported`)."""
    wrapper_config: bool
    """``InferenceWrapperConfig`` exists and ``GPTInferenceWrapper(model, config, context, pg)`` takes it
    (0.16.1); else ``GPTInferenceWrapper(model, inference_context)`` (0.19)."""
    prep_takes_prompts: bool
    """``prep_model_for_inference(prompts_tokens=None)`` (0.16.1); 0.19 takes no argument."""
    only_last_in_config: bool
    """``materialize_only_last_token_logits`` lives on ``context.config`` (an ``InferenceConfig``, 0.19)
    rather than on the context (0.16.1)."""
    inference_config: bool
    """``InferenceConfig`` exists: ``DynamicInferenceContext(model_config, inference_config)`` (0.19)."""
    kv_allocator_attr: str
    """Name of the dynamic context's block allocator: ``block_allocator`` (0.16.1) or ``kv_block_allocator``."""
    kv_buffer_hook: str
    """Dynamic context method that allocates the KV buffer: ``allocate_all_tensors`` (0.16.1) or
    ``_allocate_memory_buffer`` (0.19)."""
    softmax_offset: bool
    """``Attention.flash_decode_and_prefill`` takes ``softmax_offset`` (0.19: sink softmax)."""
    inference_mode: bool
    """A process-wide ``InferenceMode`` flag exists (0.19), set by every engine built and never cleared
    by the static engine."""
    llm_api: bool
    """``megatron.core.inference.apis.MegatronLLM`` exists (0.19)."""
    cp_batch_hybrid: bool
    """``megatron.core.utils.get_batch_on_this_cp_rank`` takes a required ``is_hybrid_cp`` (0.19)."""


@functools.lru_cache(maxsize=1)
def megatron_api() -> MegatronAPI:
    """Detect the imported megatron-core's API once."""
    from megatron.core import package_info
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.inference.model_inference_wrappers import abstract_model_inference_wrapper as amw
    from megatron.core.transformer.attention import Attention
    from megatron.core.utils import get_batch_on_this_cp_rank

    try:
        from megatron.core.inference.model_inference_wrappers import inference_wrapper_config  # noqa: F401

        wrapper_config = True
    except ImportError:
        wrapper_config = False
    try:
        from megatron.core.inference.config import InferenceConfig  # noqa: F401

        inference_config = True
    except ImportError:
        inference_config = False
    try:
        from megatron.core.inference.apis import MegatronLLM  # noqa: F401

        llm_api = True
    except ImportError:
        llm_api = False
    try:
        from megatron.core.inference.utils import InferenceMode  # noqa: F401

        inference_mode = True
    except ImportError:
        inference_mode = False
    ctx_cls = dynamic_context.DynamicInferenceContext
    prep = inspect.signature(amw.AbstractModelInferenceWrapper.prep_model_for_inference).parameters
    base_init = inspect.signature(dynamic_context.BaseInferenceContext.__init__).parameters
    return MegatronAPI(
        version=megatron_version(),
        wrapper_config=wrapper_config,
        prep_takes_prompts="prompts_tokens" in prep,
        only_last_in_config="inference_config" in base_init,
        inference_config=inference_config,
        kv_allocator_attr="kv_block_allocator" if "kv_block_allocator" in inspect.getsource(ctx_cls.__init__)
        else "block_allocator",
        kv_buffer_hook="_allocate_memory_buffer" if hasattr(ctx_cls, "_allocate_memory_buffer")
        else "allocate_all_tensors",
        softmax_offset="softmax_offset" in inspect.signature(Attention.flash_decode_and_prefill).parameters,
        inference_mode=inference_mode,
        llm_api=llm_api,
        cp_batch_hybrid="is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters,
    )


def _vtuple(v: str) -> tuple:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out + [0] * (3 - len(out)))


def check_megatron_version(what: str) -> str:
    """The imported release, or ``RuntimeError`` naming ``what``, the release found and the supported ranges.

    Reads the version each call (not cached), so every entry point refuses alike.
    """
    version = megatron_version()
    v = _vtuple(version)
    if not any(_vtuple(lo) <= v < _vtuple(hi) for lo, hi in SUPPORTED_RANGES):
        ranges = ", ".join(f">={lo},<{hi}" for lo, hi in SUPPORTED_RANGES)
        raise RuntimeError(
            f"{what} supports megatron-core {ranges} (0.16.1 on Python 3.11, 0.19.x on Python >= 3.12), but "
            f"{version} is imported; 0.17 and 0.18 were not tested (their inference API sits between the "
            "two), so refusing rather than guessing"
        )
    return version


def check_supported(what: str) -> MegatronAPI:
    """:func:`check_megatron_version`, then the detected API."""
    check_megatron_version(what)
    return megatron_api()


# --------------------------------------------------------------------------- one adapter per difference


def init_gpt_wrapper(wrapper, model, inference_context, *, hidden_size: int, params_dtype, padded_vocab_size: int,
                     pg_collection=None) -> None:
    """Run ``GPTInferenceWrapper.__init__`` on ``wrapper`` with the release's signature.

    0.16.1: ``(model, InferenceWrapperConfig(...), inference_context, pg_collection)``;
    0.19: ``(model, inference_context)`` -- the groups come from ``inference_context.config.pg_collection``
    or Megatron's ``parallel_state``.
    """
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    api = megatron_api()
    if api.wrapper_config:
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

        cfg = InferenceWrapperConfig(
            hidden_size=hidden_size, params_dtype=params_dtype, inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=padded_vocab_size, inference_max_requests=inference_context.max_batch_size
            if hasattr(inference_context, "max_batch_size") else inference_context.max_requests,
            inference_max_seq_length=inference_context.max_sequence_length,
        )
        GPTInferenceWrapper.__init__(wrapper, model, cfg, inference_context, pg_collection)
    else:
        if pg_collection is not None and getattr(inference_context.config, "pg_collection", None) is None:
            inference_context.config.pg_collection = pg_collection
        GPTInferenceWrapper.__init__(wrapper, model, inference_context)


def prep_model_for_inference(wrapper, prompts_tokens=None) -> None:
    """``GPTInferenceWrapper.prep_model_for_inference`` with or without the 0.16.1 ``prompts_tokens``."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    if megatron_api().prep_takes_prompts:
        GPTInferenceWrapper.prep_model_for_inference(wrapper, prompts_tokens)
    else:
        GPTInferenceWrapper.prep_model_for_inference(wrapper)


def get_only_last_token_logits(ctx) -> bool:
    """The context's ``materialize_only_last_token_logits`` (0.19: on ``ctx.config``)."""
    return ctx.config.materialize_only_last_token_logits if megatron_api().only_last_in_config \
        else ctx.__dict__["materialize_only_last_token_logits"]


def set_only_last_token_logits(ctx, value: bool) -> None:
    """Set the context's ``materialize_only_last_token_logits`` where the release reads it."""
    if megatron_api().only_last_in_config:
        ctx.config.materialize_only_last_token_logits = bool(value)
    else:
        ctx.__dict__["materialize_only_last_token_logits"] = bool(value)


def batch_on_this_cp_rank(batch: dict, cp_group=None) -> dict:
    """``get_batch_on_this_cp_rank``: this CP rank's chunks r and 2·CP-1-r of every tensor's sequence dim.

    0.19 adds a required ``is_hybrid_cp`` (False here: one CP group per sequence, the layout the
    training loop and the tree core attention share).
    """
    from megatron.core.utils import get_batch_on_this_cp_rank

    if megatron_api().cp_batch_hybrid:
        return get_batch_on_this_cp_rank(batch, False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)


def kv_block_allocator(ctx):
    """The dynamic context's block allocator (``block_allocator`` in 0.16.1, ``kv_block_allocator`` in 0.19)."""
    return getattr(ctx, megatron_api().kv_allocator_attr)


@contextlib.contextmanager
def inference_mode_off():
    """0.19's process-wide ``InferenceMode`` flag is off on entry and back to its entry state on exit.

    A no-op on 0.16.1. Engines built inside the block set the flag (that is how 0.19 tells its
    modules they serve an engine); the exit clears it again.

    ``StaticInferenceEngine.__init__`` and ``DynamicInferenceEngine`` set the flag and the static engine
    never clears it; a later plain forward (training, a reference model) then takes inference-only
    branches (``gpt_model`` asserts ``runtime_gather_output``, slices the last token, ...).
    """
    if not megatron_api().inference_mode:
        yield
        return
    from megatron.core.inference.utils import InferenceMode

    was = InferenceMode.is_active()
    InferenceMode.unset_active()
    try:
        yield
    finally:  # an engine built inside the block set it: leave it as it was before the block
        (InferenceMode.set_active if was else InferenceMode.unset_active)()


def inference_mode_active() -> bool:
    """0.19's process-wide ``InferenceMode`` flag (set while an engine serves); always ``False`` on 0.16.1."""
    if not megatron_api().inference_mode:
        return False
    from megatron.core.inference.utils import InferenceMode

    return bool(InferenceMode.is_active())


_REFUSED_CONFIG = (  # (InferenceConfig field, value that is fine, what it is)
    ("enable_prefix_caching", False, "prefix caching (KV blocks shared between requests by hash)"),
    ("unified_memory_level", 0, "unified (CPU+GPU) memory for the KV buffer"),
    ("static_kv_memory_pointers", False, "static KV memory pointers across suspend/resume"),
    ("mamba_inference_state_config", None, "hybrid (Mamba) layers"),
    ("use_flashinfer_fused_rope", False, "flashinfer's fused RoPE (rotates at local positions)"),
)


def refuse_unsupported_features(model_config, inference_config=None) -> None:
    """``NotImplementedError`` naming the first 0.19 feature tree attention does not handle yet.

    Detected from the model's ``TransformerConfig`` (sink softmax, CUDA graphs, MLA, flash
    decode, sliding window) and, on 0.19, the ``InferenceConfig`` (prefix caching, async
    scheduling, KV offload, unified memory, hybrid models, flashinfer RoPE). Speculative decoding
    (``num_speculative_tokens``, MTP drafts) is not refused: the dynamic tree context follows it.
    Call it before any collective: every rank holds the same configs, so every rank raises alike.
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    checks = [
        (getattr(model_config, "softmax_type", "vanilla") != "vanilla",
         f"softmax_type={getattr(model_config, 'softmax_type', None)!r} (sink / off-by-one softmax)"),
        (getattr(model_config, "cuda_graph_impl", "none") not in ("none", None),
         f"cuda_graph_impl={getattr(model_config, 'cuda_graph_impl', None)!r} (CUDA graphs)"),
        (isinstance(model_config, MLATransformerConfig) or getattr(model_config, "multi_latent_attention", False),
         "multi-latent attention (MLA)"),
        (getattr(model_config, "flash_decode", False), "flash_decode=True (Megatron's static flash-decode path)"),
        (getattr(model_config, "window_size", None) is not None,
         f"window_size={getattr(model_config, 'window_size', None)!r} (sliding-window attention)"),
    ]
    if inference_config is not None:
        for name, fine, what in _REFUSED_CONFIG:
            value = getattr(inference_config, name, fine)
            checks.append((value not in (fine, None) if fine is not None else value is not None,
                           f"InferenceConfig.{name}={value!r} ({what})"))
        mode = getattr(inference_config, "async_sched_mode", None)
        if mode is not None and getattr(mode, "name", str(mode)) != "LEGACY":
            checks.append((True, f"InferenceConfig.async_sched_mode={mode!r} (asynchronous scheduling)"))
        kv_mode = getattr(inference_config, "kv_cache_management_mode", None)
        if kv_mode is not None and getattr(kv_mode, "name", str(kv_mode)) != "PERSIST":
            checks.append((True, f"InferenceConfig.kv_cache_management_mode={kv_mode!r} (KV offload / recompute)"))
        if getattr(inference_config, "num_cuda_graphs", None):
            checks.append((True, f"InferenceConfig.num_cuda_graphs={inference_config.num_cuda_graphs!r} (CUDA graphs)"))
    for bad, what in checks:
        if bad:
            raise NotImplementedError(
                f"tree attention does not support {what} yet; supported: vanilla softmax, no CUDA graphs, "
                "standard (GQA/MHA) attention, full causal attention, and on 0.19 an InferenceConfig without "
                "prefix caching, async scheduling, KV offload or hybrid layers"
            )
