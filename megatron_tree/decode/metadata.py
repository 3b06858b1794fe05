"""``StepMetadata``: what one decode step's attention needs beyond q, k and v, built once per step;
``PrefillMetadata`` and ``VerifyMetadata``: the same for a prompt's forward and a speculative verification.

Invariant: a cache fills its step's metadata on the host side of the step (placement is host
bookkeeping, :mod:`.plan`) into device buffers it allocated with its storage, updated in place,
so that the step itself -- every layer's cache write and attention -- reads only tensors whose
shapes and addresses do not change from step to step and never reads a device value on the
host. That is what lets ``torch.compile(fullgraph=True)`` trace a step once and a CUDA graph
replay it: the values change, the graph does not.

The object is passed explicitly: the cache that made it hands it to the layers' attention (the
transformers integration reads ``TreeCache.metadata``, one of these three while a forward runs and
``None`` between forwards; its :attr:`mode` says which), which hands its fields to
:func:`~megatron_tree.decode.attention.tree_decode` through :meth:`StepMetadata.attention_args`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

__all__ = ["PrefillMetadata", "StepMetadata", "VerifyMetadata"]


@dataclass(eq=False)
class StepMetadata:
    """One decode step of one new token per row, on this CP rank (persistent buffers, updated in place).

    seqlens: (batch,) int32 -- this rank's valid keys of each row after the step (the new token counted
        where this rank keeps it); ``cache_seqlens`` of ``tree_decode``
    q_positions: (batch, 1) int64 -- the new tokens' global positions (RoPE and causal masking)
    k_positions: (batch, kv_len) int64 -- global position of every key slot the step reads, -1 in free slots
    store: (batch,) int64 -- the storage slot each row's new key is written to on this rank: its own
        slot, or the storage's spare slot where another rank keeps the token (written, never read)
    kv_len: key slots per row a step reads -- the storage's capacity when the shapes are static (one
        compiled graph for every step), else the longest row this rank holds (a host int)
    starts: ``{window: (batch,) int32}`` -- for every sliding window of the model, the first slot of
        each row still inside it (``cache_starts``; slots hold a row's tokens in arrival order, so
        positions ascend along a row and the slots before it only hold keys that left the window)
    """

    mode: ClassVar[str] = "decode"

    seqlens: torch.Tensor
    q_positions: torch.Tensor
    k_positions: torch.Tensor
    store: torch.Tensor
    kv_len: int
    starts: dict = field(default_factory=dict)

    def update_starts(self, windows) -> None:
        """(Re)compute :attr:`starts` for each distinct window in ``windows`` (``None`` entries skipped),
        in place: a few device ops per window per step, none per layer."""
        kp, qp = self.k_positions, self.q_positions
        valid = torch.arange(kp.shape[1], device=kp.device)[None, :] < self.seqlens[:, None]
        for w in {w for w in windows if w is not None}:
            starts = ((kp <= qp - w) & valid).sum(dim=1).to(self.seqlens.dtype)
            if w in self.starts and self.starts[w].shape == starts.shape:
                self.starts[w].copy_(starts)
            else:
                self.starts[w] = starts

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of this metadata a step reads (the window starts included): persistent, so a cache whose
        steps are compiled marks them static (a CUDA graph then reads them in place, not a copy per replay)."""
        return (self.seqlens, self.q_positions, self.k_positions, self.store, *self.starts.values())

    def attention_args(self, window: int | None = None) -> dict:
        """``tree_decode`` keyword arguments of a layer with sliding ``window`` (``None``: full causal).

        A full-attention layer's new token sees every key of the row, so it needs only the lengths;
        a windowed layer also gets the positions and the window's first slots."""
        if window is None:
            return {"cache_seqlens": self.seqlens}
        return {"cache_seqlens": self.seqlens, "q_positions": self.q_positions, "k_positions": self.k_positions,
                "cache_starts": self.starts[window]}


@dataclass(eq=False)
class PrefillMetadata:
    """A forward over (a window of) the prompts, on this CP rank: its queries attend by global positions.

    q_positions: (batch, S) int64 -- global positions of this rank's query tokens; -1 marks filler
    k_positions: (batch, N) int64 -- global positions of the keys the attention reads: this rank's
        chunks (the forward's own tokens, the CP prefill brings the others'), or for a window of a
        chunked prefill this rank's stored slots ``[0, kv_end)``
    slots: (batch, S) int64 -- a window of a chunked prefill: this rank's storage slot of each of the
        window's tokens (-1: filler); ``None`` for a forward over whole prompts
    kv_end: a window of a chunked prefill: the storage slots its attention reads (``None`` otherwise)
    """

    mode: ClassVar[str] = "prefill"

    q_positions: torch.Tensor
    k_positions: torch.Tensor
    slots: torch.Tensor | None = None
    kv_end: int | None = None


@dataclass(eq=False)
class VerifyMetadata:
    """A forward of T draft tokens per row over the committed cache (speculative verification, assisted
    decoding's chain): the drafts are kept aside, not stored, and attend the committed keys and each other.

    q_positions: (batch, T) int64 -- the drafts' global positions (each row's length plus the draft's depth)
    """

    mode: ClassVar[str] = "verify"

    q_positions: torch.Tensor
