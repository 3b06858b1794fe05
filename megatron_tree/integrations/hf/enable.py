"""Enabling and disabling tree attention on a transformers model: the model checks, the binding, the
attention implementation switch and the instance-level ``forward``/``generate`` wrappers."""

from __future__ import annotations

import functools
import inspect

from .common import _MARK, ATTN_IMPLEMENTATION, UnsupportedModelError, _Binding, _describe, _same_groups, _text_config
from . import attention  # noqa: F401 -- registers ATTN_IMPLEMENTATION with transformers' AttentionInterface
from .forward import _sharded_forward
from .generate import _sharded_generate
import transformers

from ...collectives import CommStats
from ...comm import STRATEGIES
from ...decode.cache import LAYOUTS
from ...decode.prefill import PREFILL_METHODS, PrefillWork
from ...topology import TreeGroups


def _attention_modules(model) -> list:
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def _check_model(model) -> None:
    if not isinstance(model, transformers.PreTrainedModel) or not hasattr(model, "generate"):
        hint = " (for a DeepSpeed engine, pass engine.module)" if hasattr(model, "module") else ""
        raise UnsupportedModelError(
            f"expected a transformers causal LM (PreTrainedModel with generate), got {type(model).__name__}{hint}"
        )
    cfg = _text_config(model.config)
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False) or getattr(cfg, "add_cross_attention", False):
        raise UnsupportedModelError(
            f"{name} has cross-attention (encoder-decoder or add_cross_attention=True); tree attention supports "
            "decoder-only causal self-attention"
        )
    if not getattr(type(model), "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface "
            "(_supports_attention_backend is False), so its attention cannot be replaced by tree attention"
        )
    layer_types = getattr(cfg, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        raise UnsupportedModelError(
            f"{name} has {other} layers (config.layer_types); tree attention supports full causal attention "
            "layers only"
        )
    for attr in ("sliding_window", "attention_chunk_size"):
        if getattr(cfg, attr, None) is not None:
            raise UnsupportedModelError(
                f"{name}'s config sets {attr}={getattr(cfg, attr)}; sliding-window / chunked attention is not "
                f"supported yet. If the window covers every sequence you run, set config.{attr} = None"
            )
    for attr in ("attn_logit_softcapping", "alibi"):
        if getattr(cfg, attr, None):
            raise UnsupportedModelError(f"{name}'s config sets {attr}; tree attention computes plain softmax attention")


def check_model(model) -> None:
    """Raise :class:`UnsupportedModelError` when tree attention cannot run ``model`` exactly.

    What :func:`enable_tree_attention` checks before it changes anything; cheap on a
    meta-device instance (the eval checks a checkpoint's class this way before launch).
    """
    _check_model(model)


def enable_tree_attention(model, groups: TreeGroups | None, *, strategy: str = "auto", prefill: str = "ring",
                          layout: str = "load_balanced", block_size: int = 16, stats: CommStats | None = None,
                          work: PrefillWork | None = None, max_prefill_tokens: int | None = None):
    """Make ``model`` (a transformers causal LM) run CP-sharded over ``groups``; returns the same model.

    Every CP rank calls this on its own replica (same weights) and then runs the same
    ``generate``/forward calls with the same inputs. Registers ``"megatron_tree"`` with
    transformers' ``AttentionInterface`` and sets it as the model's ``attn_implementation``;
    wraps ``model.forward`` and ``model.generate`` on this instance (see the module docstring).

    groups: the CP group (``None``: one process, CP = 1)
    strategy: the ``tree_decode`` merge (one of ``comm.STRATEGIES``)
    prefill: ``"ring"`` or ``"allgather"`` CP attention over the prompt chunks
    layout, block_size: placement of the prompt and of decoded tokens (``cache.CacheConfig``)
    stats: a :class:`~megatron_tree.CommStats` that records every collective of the forwards
    max_prefill_tokens: the most prompt tokens one forward computes (all CP ranks together); a longer
        prompt is prefilled in windows of that many tokens (rounded down to a multiple of 2 x CP),
        one forward each over the cache so far, each window load-balanced on its own: exact, and
        the memory of a forward is bounded by the window (None: one forward over the whole prompt)
    work: a :class:`~megatron_tree.decode.prefill.PrefillWork` that counts this rank's prefill
        attention (visible pairs, blocks attended and skipped, kernel launches, un-hidden ring wait)

    Raises :class:`UnsupportedModelError` for a model it cannot run exactly: attention that does
    not go through ``AttentionInterface``, cross-attention, sliding-window/chunked/soft-capped
    attention. Idempotent for the same groups; call :func:`disable_tree_attention` first to
    change them.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    if prefill not in PREFILL_METHODS:
        raise ValueError(f"unknown prefill method {prefill!r}; expected one of {PREFILL_METHODS}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown cache layout {layout!r}; expected one of {LAYOUTS}")
    if max_prefill_tokens is not None and (not isinstance(max_prefill_tokens, int) or isinstance(max_prefill_tokens, bool)
                                           or max_prefill_tokens < 1):
        raise ValueError(f"max_prefill_tokens must be a positive integer or None, got {max_prefill_tokens!r}")
    if groups is not None and not isinstance(groups, TreeGroups):
        raise TypeError(f"groups must be a TreeGroups or None, got {type(groups).__name__}")
    existing = getattr(model, _MARK, None)
    if existing is not None:
        if not _same_groups(existing.groups, groups):
            raise ValueError(
                f"model already runs tree attention over {_describe(existing.groups)}; call disable_tree_attention "
                "before enabling it on another group"
            )
        existing.strategy, existing.prefill, existing.stats, existing.work = strategy, prefill, stats, work
        existing.max_prefill_tokens = max_prefill_tokens
        existing.layout, existing.block_size = layout, block_size
        return model
    _check_model(model)
    cfg = _text_config(model.config)
    modules = _attention_modules(model)
    if len(modules) != cfg.num_hidden_layers:
        raise UnsupportedModelError(
            f"found {len(modules)} attention modules (a layer_idx and a class name ending in 'Attention') in "
            f"{type(model).__name__}, expected one per layer ({cfg.num_hidden_layers})"
        )
    forward_params = inspect.signature(model.forward).parameters
    binding = _Binding(
        groups=groups, strategy=strategy, prefill=prefill, layout=layout, block_size=block_size, stats=stats,
        work=work, max_prefill_tokens=max_prefill_tokens, num_layers=int(cfg.num_hidden_layers),
        cache_kwarg="cache" if "cache" in forward_params else "past_key_values",
        accepts_logits_to_keep="logits_to_keep" in forward_params,
        previous_attn=model.config._attn_implementation, attention_modules=modules,
    )
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(
            f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r}; transformers "
            "refused to switch it, so tree attention cannot replace its attention"
        )
    for m in modules:
        setattr(m, _MARK, binding)
    orig_forward, orig_generate = model.forward, model.generate

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        return _sharded_forward(model, orig_forward, binding, args, kwargs)

    @functools.wraps(orig_generate)
    def generate(*args, **kwargs):
        return _sharded_generate(model, orig_generate, binding, args, kwargs)

    model.forward, model.generate = forward, generate
    setattr(model, _MARK, binding)
    return model


def disable_tree_attention(model):
    """Undo :func:`enable_tree_attention`: the previous attention implementation, forward and generate."""
    binding = getattr(model, _MARK, None)
    if binding is None:
        return model
    for name in ("forward", "generate"):
        if name in model.__dict__:
            del model.__dict__[name]
    for m in binding.attention_modules:
        if hasattr(m, _MARK):
            delattr(m, _MARK)
    model.set_attn_implementation(binding.previous_attn or "sdpa")
    delattr(model, _MARK)
    return model
