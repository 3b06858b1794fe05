"""What every part of the transformers integration shares: the transformers import and its version
check, the names registered with transformers, the refusal error, and the per-model binding that
:func:`~megatron_tree.integrations.hf.enable.enable_tree_attention` attaches to a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

try:
    import transformers
except ImportError as e:  # pragma: no cover -- exercised only where transformers is absent
    raise ImportError(
        "megatron_tree.integrations.hf needs transformers >= 5.17 (pip install 'transformers>=5.17'); "
        f"importing it failed: {e}"
    ) from e

from ...collectives import CommStats
from ...topology import TreeGroups

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
    work: object = None
    """A ``decode.prefill.PrefillWork`` every layer's prefill attention adds its counts to, or None."""
    step: object = None
    """The decode loop's ``decode.generate.DecodeStep`` while ``HFTreeModel.decode_step`` runs (its
    ``attend`` is every layer's decode attention); ``None``: a plain step of ``strategy``/``stats``."""

    @property
    def cp_size(self) -> int:
        return 1 if self.groups is None else self.groups.size


def _same_groups(a: TreeGroups | None, b: TreeGroups | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.cp_ranks == b.cp_ranks and a.cp_group is b.cp_group


def _describe(groups: TreeGroups | None) -> str:
    return "no CP group (one process)" if groups is None else f"the CP group of ranks {list(groups.cp_ranks)}"


def _comm_device(groups: TreeGroups, like: torch.device) -> torch.device:
    """Where a tensor must live for a collective on ``groups`` (NCCL: CUDA; gloo: CPU)."""
    backend = str(dist.get_backend(groups.cp_group)).lower()
    if "nccl" in backend:
        return like if like.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _text_config(cfg):
    get = getattr(cfg, "get_text_config", None)
    return get(decoder=True) if callable(get) else cfg
