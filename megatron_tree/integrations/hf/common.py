"""What every part of the transformers integration shares: the transformers import and its version
check, the names registered with transformers, the refusal error, and the per-model binding that
:func:`~megatron_tree.integrations.hf.enable.enable_tree_attention` attaches to a model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...utils.extras import require

transformers = require("hf", "megatron_tree.integrations.hf")

from ...decode.cache import StoragePool
from ...distributed.collectives import CommStats
from ...distributed.topology import TreeGroups

ATTN_IMPLEMENTATION = "megatron_tree"
"""The name registered with transformers' ``AttentionInterface``."""
MIN_TRANSFORMERS = (5, 17)
"""Oldest transformers release this module was tested against (5.17, the GPU machine's, and 5.24)."""
_MARK = "_megatron_tree"  # attribute on the model and on each attention module: the binding


class UnsupportedModelError(ValueError):
    """A model or config this backend cannot run exactly (it says what, and what would work)."""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


if _version_tuple(transformers.__version__) < MIN_TRANSFORMERS:  # pragma: no cover
    raise ImportError(
        f"megatron_tree.integrations.hf needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))} "
        f"(the releases its Cache, AttentionInterface and generate hooks were written against), but "
        f"{transformers.__version__} is installed"
    )

# --------------------------------------------------------------------------- per-model state


@dataclass
class _Binding:
    """What :func:`enable_tree_attention` attached to one model (shared by its attention modules)."""

    groups: TreeGroups | None
    strategy: str
    prefill: str
    layout: str
    block_size: int
    stats: CommStats | None
    num_layers: int
    windows: tuple
    """The sliding window of every layer (``None``: full causal attention)."""
    rotary: list
    """The model's rotary-embedding modules (made to see the global sequence length at prefill)."""
    cache_kwarg: str
    """Name of the cache argument of this transformers release's ``forward``: ``cache`` (5.2x) or ``past_key_values``."""
    accepts_logits_to_keep: bool
    previous_attn: str | None
    attention_modules: list = field(default_factory=list)
    active: "TreeCache | None" = None
    """The cache of the forward in progress (set by the forward wrapper, read by the attention function)."""
    new_tokens_hint: int | None = None
    """Tokens ``generate`` may append (sizes a cache it creates); set only while ``generate`` runs."""
    max_prefill_tokens: int | None = None
    """Most prompt tokens one forward computes (chunked prefill, in windows; ``forward.prefill_chunk``), or None."""
    allow_beyond_window: bool = False
    """A RoPE model's prefill takes prompts past ``max_position_embeddings`` (``enable_tree_attention``'s flag)."""
    work: object = None
    """A ``decode.prefill.PrefillWork`` every layer's prefill attention adds its counts to, or None."""
    settings_hint: tuple | None = None
    """``generate``'s sampling and stop settings (:func:`_generation_settings`), compared across CP ranks
    at the prefill; set only while ``generate`` runs."""
    orig_forward: object = None
    """The model's own ``forward`` (bound) as it was before tree attention wrapped it."""
    compiled: object = None
    """The decode step's device half compiled (``enable_tree_attention(compile_step=...)``), or None (eager)."""
    user_steps: object = None
    """The decode steps a user's ``torch.compile`` around ``model.forward`` compiles (``forward.UserSteps``),
    made at the first such step."""
    stats_slot: object = None
    """The ``collectives.StatsSlot`` a compiled step records its traffic through (made at the first such step)."""
    step: object = None
    """The decode loop's ``decode.generate.DecodeStep`` while ``HFTreeModel.decode_step`` runs (its
    ``attend`` is every layer's decode attention); ``None``: a plain step of ``strategy``/``stats``."""
    pool: StoragePool = field(default_factory=StoragePool)
    """Where the static caches the model makes (compiled steps) leave their storage when they end, for the next
    cache of the same shape: a captured step then replays on the same addresses instead of recording anew."""

    @property
    def cp_size(self) -> int:
        return 1 if self.groups is None else self.groups.size

    def plain_replica(self, hf_model):
        """A plain transformers replica of ``hf_model`` (the model this binding is on) sharing its weight tensors
        (no copy): the attention implementation it had before tree attention, transformers' own caches, one
        process. The decode tier's draft caches ask the binding for it (``decode.speculative.DraftCaches``), as
        the decode tier imports nothing of the integrations."""
        import copy

        cfg = copy.deepcopy(hf_model.config)
        with torch.device("meta"):
            ref = type(hf_model)(cfg)
        ref.load_state_dict(hf_model.state_dict(), assign=True)
        for name, buf in hf_model.named_buffers():  # non-persistent buffers (e.g. RoPE's inv_freq)
            owner, _, leaf = name.rpartition(".")
            ref.get_submodule(owner)._buffers[leaf] = buf
        ref.set_attn_implementation(self.previous_attn or "sdpa")
        return ref.eval()


def _same_groups(a: TreeGroups | None, b: TreeGroups | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.cp_ranks == b.cp_ranks and a.cp_group is b.cp_group


def _describe(groups: TreeGroups | None, named: bool = False) -> str:
    """``groups`` in a message; ``named``: with its process group's name, which tells apart two groups
    over the same ranks (``TreeGroups`` built twice)."""
    if groups is None:
        return "no CP group (one process)"
    text = f"the CP group of ranks {list(groups.cp_ranks)}"
    if named:
        text += f" (process group {getattr(groups.cp_group, 'group_name', None) or id(groups.cp_group)!r})"
    return text


def _comm_device(groups: TreeGroups, like: torch.device) -> torch.device:
    """Where a tensor must live for a collective on ``groups`` (NCCL: CUDA; gloo: CPU)."""
    backend = str(dist.get_backend(groups.cp_group)).lower()
    if "nccl" in backend:
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _text_config(cfg):
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if callable(get) else cfg


def _rope(cfg) -> dict:
    """The RoPE settings of transformers config ``cfg``'s text config ({} for a model without RoPE)."""
    text = _text_config(cfg)
    return getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}


def position_window(cfg) -> int | None:
    """The longest prompt the CP prefill takes for transformers config ``cfg``: its text config's
    ``max_position_embeddings``; ``None`` (no limit) where it has none or its RoPE is dynamic NTK (built to
    run past it). One rule for the prefill's refusal and for what callers check beforehand."""
    rope = _rope(cfg)
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        return None
    return getattr(_text_config(cfg), "max_position_embeddings", None)


def rotary_positions(cfg) -> bool:
    """Whether transformers config ``cfg``'s positions are rotary (``rope_parameters``: computed for any
    position, so a prompt may run past ``max_position_embeddings`` when the user allows it) rather than a
    learned table of ``max_position_embeddings`` rows (GPT-2, OPT), which no prompt may pass."""
    return bool(_rope(cfg))


_SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty",
             "eos_token_id", "min_new_tokens", "generation_config", "generate_arguments")
"""``generate``'s settings every CP rank must pass alike (compared at the prefill): the sampling and stop
fields by name, then a digest of the whole effective generation config and of the call's other arguments.
Sampling settings that differ give ranks different token choices from the same logits; stop settings
that differ leave one rank stopping while the others wait for it."""


def _setting(value):
    """A generation setting as it is compared and printed: plain values as they are, tensors as lists,
    processors and other objects by their class (their state cannot be compared)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.detach().reshape(-1).tolist())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_setting(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _setting(v)) for k, v in value.items()))
    return f"<{type(value).__name__}>"


def _generation_settings(model, kwargs: dict) -> tuple:
    """The values of :data:`_SETTINGS` for one ``generate(**kwargs)`` call (the prompt's tensors are
    compared on their own): a field passed to ``generate`` wins over the generation config's."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    fields = tuple(_setting(kwargs[n] if n in kwargs else getattr(gc, n, None)) for n in _SETTINGS[:-2])
    config = None
    if gc is not None:
        config = hashlib.blake2b(repr(_setting(gc.to_dict())).encode(), digest_size=6).hexdigest()
    skip = {"input_ids", "inputs", "attention_mask", "generation_config", *_SETTINGS}
    rest = _setting({k: v for k, v in kwargs.items() if k not in skip})
    return (*fields, config, hashlib.blake2b(repr(rest).encode(), digest_size=6).hexdigest())
