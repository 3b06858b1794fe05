"""Backend choice for the local decode and the local merge.

Invariant: callers above this layer never name a backend implementation; they call
:func:`flash_decode` / :func:`merge_states` here and get the same contract (DESIGN.md
section 3) from the Triton kernels on CUDA tensors and from ``reference.py`` on CPU.
The environment variable ``MEGATRON_TREE_BACKEND`` (``torch`` or ``triton``) forces a
backend, as does the ``backend=`` argument.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

from . import reference

Backend = Literal["torch", "triton"]
BACKENDS = ("torch", "triton")
ENV_BACKEND = "MEGATRON_TREE_BACKEND"


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that will run on ``device``: the argument, else the environment, else by device."""
    choice = backend if backend is not None else os.environ.get(ENV_BACKEND) or None
    if choice is not None and choice not in BACKENDS:
        source = "backend argument" if backend is not None else f"${ENV_BACKEND}"
        raise ValueError(f"unknown {source} {choice!r}; expected one of {BACKENDS}")
    if choice is None:
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before "
            "megatron_tree.kernels is imported; use backend='torch' or backend=None on CPU"
        )
    return choice


def flash_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention of q over one KV shard; see :func:`reference.partial_attention` for shapes.

    q: (batch, seqlen_q, nheads_q, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    returns out: (batch, seqlen_q, nheads_q, headdim) in q.dtype,
            lse: (batch, nheads_q, seqlen_q) float32, natural log, -inf where no key is visible
    """
    reference.check_decode_inputs(q, k, v, cache_seqlens, q_positions, k_positions)
    name = resolve_backend(q.device, backend)
    if name == "triton":
        from .kernels import flash_decode as kernel  # imported lazily: needs triton

        return kernel.flash_decode(
            q, k, v, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
            q_positions=q_positions, k_positions=k_positions,
        )
    return reference.partial_attention(
        q, k, v, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
        q_positions=q_positions, k_positions=k_positions,
    )


def merge_states(outs: torch.Tensor, lses: torch.Tensor, *, backend: str | None = None):
    """Merge P partial states: outs (P, B, Sq, Hq, D), lses (P, B, Hq, Sq) -> (out, lse)."""
    name = resolve_backend(outs.device, backend)
    if name == "triton":
        from .kernels import merge as kernel

        return kernel.merge_states(outs, lses)
    return reference.merge_states(outs, lses)
