"""``TreeAttention``: the attention block of a decoder layer on a sequence-sharded KV cache.

Invariant: one module, three paths that compute the same function of global token
positions -- q/k/v projections, RoPE at *global* positions, attention, o_proj:

* :meth:`TreeAttention.forward` -- the whole sequence in one process, no cache (the
  unsharded reference);
* :meth:`TreeAttention.prefill` -- this CP rank's chunk of the prompt, exact causal
  attention across ranks (``prefill.cp_prefill``), keys/values stored in the cache;
* :meth:`TreeAttention.decode` -- one new token per row, appended to the rank the cache's
  plan names, attention by ``tree_decode`` over every rank's shard.

Because RoPE is applied before keys enter the cache and uses global positions, a key is
the same tensor whichever rank stores it, so the merge across ranks is exact.

RoPE follows the Llama convention of Hugging Face checkpoints (halves rotated, not
interleaved pairs), with the Llama-3 frequency scaling ("rope_type": "llama3") and linear
scaling as options.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from . import ops
from .decode.attention import tree_decode
from .decode.cache import ShardedKVCache
from .comm import CommStats
from .decode.prefill import cp_prefill
from .topology import TreeGroups

__all__ = ["rope_inv_freq", "RotaryEmbedding", "apply_rotary", "TreeAttention", "ROPE_TYPES"]

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies (head_dim // 2,) float32 of RoPE, with optional scaling.

    scaling: ``None``/``{"rope_type": "default"}``; ``{"rope_type": "linear", "factor": f}``
    (frequencies / f); or Llama 3.1's ``{"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}``: wavelengths longer than
    ``original / low_freq_factor`` are divided by ``factor``, shorter than ``original /
    high_freq_factor`` kept, and those in between interpolated smoothly.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind != "llama3":
        raise ValueError(f"unsupported rope_type {kind!r}; expected one of {ROPE_TYPES}")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding:
    """cos/sin tables of RoPE at arbitrary (global) positions; holds no parameters."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        self.head_dim = head_dim
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)  # float32, CPU
        self._on_device: dict = {}  # device -> inv_freq there, copied once

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (batch, seqlen) integer -> cos, sin: (batch, seqlen, 1, head_dim) in dtype."""
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.clamp(min=0).to(torch.float32)[..., None] * inv  # (b, s, d/2), fp32
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, seqlen, heads, head_dim); cos, sin: (batch, seqlen, 1, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class TreeAttention(nn.Module):
    """Grouped-query self-attention whose KV cache is sharded along the sequence over CP ranks.

    Parameters have Hugging Face Llama names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``).
    Weights are replicated on every CP rank; only the cache is sharded.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rope: RotaryEmbedding,
        layer_idx: int,
        groups: TreeGroups | None = None,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        backend: str | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.groups = groups
        self.rope = rope
        self.backend = backend
        self.scale = 1.0 / math.sqrt(head_dim)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias, dtype=dtype)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x: (batch, seqlen, hidden) -> q (b, s, Hq, D), k, v (b, s, Hkv, D) with RoPE applied."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        cos, sin = self.rope(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        b, s = o.shape[:2]
        return self.o_proj(o.reshape(b, s, self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal attention over the whole sequence in this process (no cache, no communication).

        x: (batch, seqlen, hidden); positions: (batch, seqlen) integer -> (batch, seqlen, hidden)
        """
        q, k, v = self._qkv(x, positions)
        o, _ = ops.flash_decode(q, k, v, softmax_scale=self.scale, q_positions=positions,
                                k_positions=positions, backend=self.backend)
        return self._out(o)

    def prefill(self, x: torch.Tensor, positions: torch.Tensor, cache: ShardedKVCache, method: str = "ring",
                stats: CommStats | None = None) -> torch.Tensor:
        """This rank's prompt chunk: exact causal attention over every rank's chunk; fills the cache.

        x: (batch, S, hidden) -- this rank's prompt tokens, in the order of
            ``cache.start_prefill``; positions: (batch, S) int64 global, -1 = padding
        returns (batch, S, hidden)
        """
        q, k, v = self._qkv(x, positions)
        cache.write_prefill(self.layer_idx, k, v)
        o = cp_prefill(q, k, v, positions, positions, self.groups, method=method,
                       softmax_scale=self.scale, backend=self.backend, stats=stats)
        return self._out(o)

    def decode(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache: ShardedKVCache,
        *,
        strategy: str = "auto",
        stats: CommStats | None = None,
        step=None,
    ) -> torch.Tensor:
        """One new token per row: append its key/value to the owning rank, then tree attention.

        x: (batch, 1, hidden) -- replicated on every CP rank; positions: (batch,) int64 global;
        slots: (batch,) int64 storage index on this rank or -1 (``cache.begin_decode_step``)
        step: the loop's ``decode.generate.DecodeStep`` (its ``attend`` is the attention); without
            one, a plain step of ``strategy``/``stats``
        returns (batch, 1, hidden), identical on every CP rank
        """
        from .decode.generate import DecodeStep

        step = step if step is not None else DecodeStep(strategy, stats)
        q, k, v = self._qkv(x, positions[:, None])
        cache.append(self.layer_idx, k, v, slots)
        k_all, v_all = cache.layer_kv(self.layer_idx)
        o = step.attend(self.layer_idx, q, k_all, v_all, self.groups, cache_seqlens=cache.seqlens,
                        softmax_scale=self.scale, backend=self.backend)
        return self._out(o)
