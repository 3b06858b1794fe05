"""``tree_decode``: exact attention of a few query tokens over a sequence-sharded KV cache.

Invariant: the local half (``ops.flash_decode`` on this rank's shard) and the global half
(``comm.merge`` over the CP group's levels) are the only two steps; everything else here
is checking the contract of DESIGN.md section 3 so that bad input fails before any rank
enters a collective. The algorithm, like the paper's JAX ``tree_decode``::

    out, lse = flash_decode(q, k_shard, v_shard)        # local partial state
    out, lse = merge(out, lse, groups, strategy)         # m = max lse; sum w*o / sum w
    return out.to(q.dtype)
"""

from __future__ import annotations

import torch

from . import comm, ops
from .comm import CommStats
from .reference import acc_dtype
from .topology import TreeGroups

__all__ = ["tree_decode"]


def tree_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: TreeGroups | None,
    *,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    strategy: str = "auto",
    return_lse: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    stats: CommStats | None = None,
    backend: str | None = None,
):
    """Exact attention of ``q`` over the union of every CP rank's ``(k, v)`` shard.

    Per rank (every rank passes the same q, its own shard of the sequence):

    q: (batch, seqlen_q, nheads_q, headdim) -- replicated on every CP rank
    k, v: (batch, shard_len, nheads_kv, headdim) -- this rank's keys/values; shard_len may
        differ between ranks and may be 0
    cache_seqlens: (batch,) int32 -- valid keys of this shard per batch row (rows may differ)
    q_positions: (batch, seqlen_q), k_positions: (batch, shard_len) or (shard_len,) -- global
        token positions for causal masking when seqlen_q > 1; without them every query sees
        every valid key
    strategy: one of ``comm.STRATEGIES``; stats: a :class:`CommStats` to record traffic into
    returns out: (batch, seqlen_q, nheads_q, headdim) in q.dtype, identical on every CP rank,
            and with ``return_lse`` also lse: (batch, nheads_q, seqlen_q) float32, natural log
    """
    if strategy not in comm.STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {comm.STRATEGIES}")
    # fp32 partials (DESIGN.md section 1): a bf16/fp16 result is rounded once, below.
    out, lse = ops.flash_decode(
        q, k, v, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
        q_positions=q_positions, k_positions=k_positions, out_dtype=acc_dtype(q.dtype), backend=backend,
    )
    if groups is not None:
        out, lse = comm.merge(out, lse, groups, strategy, stats)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
