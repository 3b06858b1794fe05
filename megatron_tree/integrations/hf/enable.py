"""Enabling and disabling tree attention on a transformers model: the model checks, the binding, the
attention implementation switch and the instance-level ``forward``/``generate`` wrappers."""

from __future__ import annotations

import functools
import inspect

from .common import _MARK, ATTN_IMPLEMENTATION, UnsupportedModelError, _Binding, _describe, _same_groups, _text_config
from . import attention  # noqa: F401 -- registers ATTN_IMPLEMENTATION with transformers' AttentionInterface
from .forward import AUTO, _sharded_forward, compile_step
from ...comm.merge import CompileError
from .generate import _sharded_generate
import transformers

from ...distributed.collectives import CommStats
from ...comm.merge import STRATEGIES
from ...decode.cache import LAYOUTS
from ...decode.prefill import PREFILL_METHODS, PrefillWork
from ...distributed.topology import TreeGroups
from ...utils import user_compile


def _attention_modules(model) -> list:
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def _rotary_modules(model) -> list:
    """transformers' rotary-embedding modules (``rope_type`` set): those whose frequencies may depend on the
    sequence length (``dynamic``, ``longrope``) read it from the positions they are handed."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding") and hasattr(m, "rope_type")]


def _routes_through_interface(module) -> bool | None:
    """Whether the attention module's forward dispatches through transformers' attention functions
    (``ALL_ATTENTION_FUNCTIONS``, which ``AttentionInterface`` registers into) -- read from its code, since
    a class's ``_supports_attention_backend`` flag is sometimes left False on modules that do (StableLM)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):  # no source (compiled or dynamically made): trust the model class's flag
        return None


def _layer_windows(cfg, name: str) -> tuple:
    """The sliding window of every layer (``None``: full causal attention), as transformers' masks apply it.

    With ``config.layer_types`` (Qwen2, Gemma 2/3, GPT-OSS, Cohere2, ...): ``sliding_attention`` layers
    see ``config.sliding_window`` keys (the query's own included), ``full_attention`` layers all keys,
    whatever ``sliding_window`` holds (Qwen2-MoE stores 0 for "off"). Without it (Mistral, Phi3,
    Starcoder2): every layer has ``config.sliding_window`` when it is set. Anything else is refused.
    """
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    layer_types = list(getattr(cfg, "layer_types", None) or [])

    def positive(why: str) -> int:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise UnsupportedModelError(
                f"{name} has {why} but config.sliding_window={window!r}; expected a positive number of keys"
            )
        return window

    if layer_types:
        if len(layer_types) != n:
            raise UnsupportedModelError(
                f"{name}'s config.layer_types lists {len(layer_types)} layers, the model has {n}"
            )
        other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if other:
            raise UnsupportedModelError(
                f"{name} has {other} layers (config.layer_types); tree attention supports full causal and "
                "sliding-window attention layers ('full_attention', 'sliding_attention')"
            )
        if "sliding_attention" in layer_types:
            positive("'sliding_attention' layers")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if window is None:
        return (None,) * n
    return (positive("no config.layer_types (every layer slides)"),) * n


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
    modules = _attention_modules(model)
    routed = [_routes_through_interface(m) for m in modules]
    flag = bool(getattr(type(model), "_supports_attention_backend", False))
    bypass = sorted({type(m).__name__ for m, r in zip(modules, routed) if r is False or (r is None and not flag)})
    if not modules or bypass:
        what = (f"its attention modules ({', '.join(bypass)}) compute attention in their own code" if bypass
                else "it has no attention module with a layer_idx")
        raise UnsupportedModelError(
            f"{name} does not route its attention through transformers' AttentionInterface ({what}), so its "
            "attention cannot be replaced by tree attention"
        )
    bidirectional = sorted({type(m).__name__ for m in modules if getattr(m, "is_causal", True) is False})
    if bidirectional:
        raise UnsupportedModelError(
            f"{name}'s attention modules {bidirectional} are not causal (is_causal=False, e.g. "
            "use_bidirectional_attention); tree attention is causal decoding"
        )
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise UnsupportedModelError(
            f"{name}'s config sets attention_chunk_size={cfg.attention_chunk_size} (chunked attention, each query "
            "sees only the keys of its own chunk); tree attention does not support chunked attention"
        )
    if getattr(cfg, "alibi", None):
        raise UnsupportedModelError(f"{name}'s config sets alibi; tree attention adds no position bias to the scores")
    _layer_windows(cfg, name)


def check_model(model) -> None:
    """Raise :class:`UnsupportedModelError` when tree attention cannot run ``model`` exactly.

    What :func:`enable_tree_attention` checks before it changes anything; cheap on a
    meta-device instance (the eval checks a checkpoint's class this way before launch).
    """
    _check_model(model)


def enable_tree_attention(model, groups: TreeGroups | None, *, strategy: str = "auto", prefill: str = "ring",
                          layout: str = "load_balanced", block_size: int = 16, stats: CommStats | None = None,
                          work: PrefillWork | None = None, max_prefill_tokens: int | None = None,
                          compile_step: bool | str | dict = "auto", batch_buckets=None,
                          allow_beyond_window: bool = False):
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
        prompt is prefilled in windows of that many tokens (rounded down to a multiple of 2 x CP, and at
        least 2 x CP),
        one forward each over the cache so far, each window load-balanced on its own: exact, and
        the memory of a forward is bounded by the window (None: one forward over the whole prompt)
    work: a :class:`~megatron_tree.decode.prefill.PrefillWork` that counts this rank's prefill
        attention (visible pairs, blocks attended and skipped, kernel launches, un-hidden ring wait)
    compile_step: compile every decode step's device half with ``torch.compile(fullgraph=True)`` --
        ``True``, or a dict of ``torch.compile`` arguments (``{"mode": "reduce-overhead"}``: CUDA
        graphs). ``"auto"`` (default): captured in CUDA graphs (``{"mode": "reduce-overhead"}``) where
        the cache is on a GPU and the CP group runs NCCL (or is one process), with a strategy other than
        ``shifted``; eager everywhere else (CPU, gloo groups), and eager from the first step whose
        compilation fails (a warning says why). ``False``: always eager. The step's host half places the new tokens and fills the cache's ``StepMetadata``;
        the compiled half (every layer's cache write, local attention and CP merge, the merge as one
        opaque op) reads only those buffers, so it is traced once. Caches become static (every step
        reads all of a rank's slots, masked by the rows' lengths). An explicit setting is refused with
        ``strategy="shifted"`` (CP > 1) and, capturing, on CPU caches or non-NCCL groups; a dict that
        ``torch.compile`` refuses (an unknown argument, backend or mode) is a ValueError here, before any forward.
        A user's own ``model.forward = torch.compile(model.forward, fullgraph=True, ...)`` does the same
        with that call's settings (its prefill and host halves run eagerly; only the decode step's
        device half is traced, once per cache shape).
    batch_buckets: the batch sizes compiled steps are made for (e.g. ``(1, 2, 4, 8)``, as serving
        engines capture theirs): the package's ``generate`` (and the lm-eval backend that drives it)
        pads a batch up to the smallest bucket that holds it, repeating its shortest prompt, and drops
        the extra rows' tokens, when it makes the cache itself (a cache passed in is not padded);
        a step of any other batch runs eagerly, said once in a warning. None (default): steps are
        compiled per batch as it comes, and a batch pads up to one already compiled for a cache of
        the same length bucket, of at most twice its size (an eval's last, partial batch reuses the
        full batches' step). Not with ``compile_step=False``.
    allow_beyond_window: let a prompt run past the model's ``max_position_embeddings`` (False: such a prompt
        is a ValueError at the prefill). For RoPE models, whose positions are computed for any index: the
        attention stays exact (the same as the unmodified model's), answer quality past the trained window
        is the model's own; measuring speed and exactness at contexts longer than a checkpoint's window is
        what it is for. A model whose positions are a learned table (GPT-2, OPT) is refused all the same.
        Dynamic-NTK RoPE runs past its window without it.

    Raises :class:`UnsupportedModelError`, before any collective, for a model it cannot run
    exactly: attention modules whose code does not go through ``AttentionInterface``,
    cross-attention, bidirectional or chunked attention, ALiBi, layer types other than full and
    sliding-window attention. Sliding windows (per layer), attention sinks, soft-capping, K and V
    of different head dims (MLA) and sequence-length-dependent RoPE run exactly. Idempotent for the same groups; call :func:`disable_tree_attention` first to
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
    if not isinstance(allow_beyond_window, bool):
        raise TypeError(f"allow_beyond_window must be True or False, got {allow_beyond_window!r}")
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
        existing.max_prefill_tokens, existing.allow_beyond_window = max_prefill_tokens, allow_beyond_window
        existing.layout, existing.block_size = layout, block_size
        existing.compiled = _compile_setting(existing, strategy, compile_step, batch_buckets)
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
        work=work, max_prefill_tokens=max_prefill_tokens, allow_beyond_window=allow_beyond_window,
        num_layers=int(cfg.num_hidden_layers), windows=_layer_windows(cfg, type(model).__name__),
        rotary=_rotary_modules(model),
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
    binding.orig_forward = orig_forward
    binding.compiled = _compile_setting(binding, strategy, compile_step, batch_buckets)

    @functools.wraps(orig_forward)
    def forward(*args, **kwargs):
        # A torch.compile around this forward (model.forward = torch.compile(model.forward, ...)) left its
        # callback set: taken aside for the host half (a C call, before any Python frame could see it),
        # handed back for the decode step's device half (user_compile)
        prior = user_compile.set_eval_frame(None)
        try:
            return _sharded_forward(model, orig_forward, binding, args, kwargs, prior)
        finally:
            user_compile.set_eval_frame(prior)

    user_compile.host_frame(forward, _TRACED_CALLER)

    @functools.wraps(orig_generate)
    def generate(*args, **kwargs):
        return _sharded_generate(model, orig_generate, binding, args, kwargs)

    def create_masks_for_generate(*, attention_mask=None, **_):
        # transformers' generate builds the prefill's masks through this hook when its cache is compileable
        # (cache_implementation="static"); with no mask function for tree attention its own returns None (or a
        # dict of Nones): the padding would be lost. The forward takes the 2-D padding mask itself.
        return attention_mask

    model.forward, model.generate = forward, generate
    model.create_masks_for_generate = create_masks_for_generate
    setattr(model, _MARK, binding)
    return model


_TRACED_CALLER = (
    "a traced frame called the forward of a model running tree attention (a compiled function or module that "
    "calls the model): its host half (the prompt's placement, the ranks' checks) runs eagerly and it compiles "
    "its decode step's device half itself. Compile model.forward itself -- model.forward = "
    "torch.compile(model.forward, fullgraph=True, ...) -- or compile the caller with fullgraph=False, or use "
    "enable_tree_attention(model, groups, compile_step=True)")
"""What Dynamo says when a traced frame reaches the sharded forward (``user_compile.host_frame``)."""


def _compile_setting(binding, strategy: str, setting, batch_buckets=None):
    """``forward.compile_step`` after the one check that needs the strategy."""
    explicit = setting not in (False, None) and not (isinstance(setting, str) and setting == AUTO)
    if explicit and strategy == "shifted" and binding.cp_size > 1:  # (one rank: no merge; auto: eager steps)
        raise CompileError("strategy='shifted' carries every layer's lse between steps in host state and cannot "
                           "run in a compiled step (compile_step); use 'packed', 'auto' or another strategy, or "
                           "compile_step=False")
    return compile_step(binding, setting, batch_buckets)


def release_cache_storage(model) -> int:
    """Let go of the cache storage a tree-enabled ``model`` keeps for its next static cache (see
    ``decode.cache.StoragePool``: compiled steps replay on it); returns the bytes of keys and values let go
    (0: none was kept, or the model is not tree-enabled). The memory returns to torch's allocator
    (``torch.cuda.empty_cache()`` hands it back to the device)."""
    binding = getattr(model, _MARK, None)
    if binding is None:
        return 0
    held = binding.pool.holds
    binding.pool.clear()
    return held


def disable_tree_attention(model):
    """Undo :func:`enable_tree_attention`: the previous attention implementation, forward and generate."""
    binding = getattr(model, _MARK, None)
    if binding is None:
        return model
    binding.pool.clear()
    for name in ("forward", "generate", "create_masks_for_generate"):
        if name in model.__dict__:
            del model.__dict__[name]
    for m in binding.attention_modules:
        if hasattr(m, _MARK):
            delattr(m, _MARK)
    model.set_attn_implementation(binding.previous_attn or "sdpa")
    delattr(model, _MARK)
    return model
