"""Baseline context-parallel decoders that tree attention is measured against.

Invariant: every baseline returns the same exact result as :func:`tree_decode` on the same
groups and shards (identical on every rank), computes local partial states with
``ops.flash_decode`` and combines them with the project's one merge formula
(``ops.merge_states`` -> ``reference.lse_weights`` / ``normalize``); only the movement of
data differs. They live in the library, not in the benchmark, so that tests can prove them
exact and so that users can run the comparison themselves.

* :func:`ring_decode` -- Ring Attention at decode time: every rank's KV shard travels
  P-1 hops around the CP ring (``isend``/``irecv``); each hop's transfer is posted before
  the local kernel runs on the shard in hand, so transfer and compute overlap. GQA keys
  and values travel with their ``nheads_kv`` heads (never expanded to the query heads).
* :func:`passq_ring_decode` -- the decode-time ring reviewers asked for: the KV stays
  put, each rank computes its partial state once, and the (small) partial states travel
  P-1 hops around the ring; every rank then merges the P states.
* :func:`allgather_kv_decode` -- every rank all-gathers the whole KV cache and decodes it
  locally.

Partial states are merged in shard order (rank 0's shard first), so every rank computes
bit-identical outputs -- a requirement when every rank samples the next token itself.
Traffic is recorded in a :class:`comm.CommStats` under level ``"cp"``: a point-to-point
message counts its bytes once as payload and once as sent; an all-gather counts
``(P-1) * payload`` sent, the same model ``comm.py`` uses. Collectives go through
``collectives.py`` inside the CP group's :class:`~megatron_tree.distributed.agreement.Agreement` on
:data:`BASELINE_SIGNATURE` (ranks that disagree get a :class:`DisagreementError`, not a gloo
abort); :meth:`ShardPlan.build` exchanges the KV shapes with the lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..distributed import agreement, collectives
from ..ops import contract, dispatch as ops
from .merge import CommStats
from ..distributed.topology import TreeGroups

__all__ = ["ShardPlan", "ring_decode", "passq_ring_decode", "allgather_kv_decode", "BASELINES",
           "BASELINE_SIGNATURE"]

BASELINES = ("ring", "passq_ring", "allgather_kv")
BASELINE_SIGNATURE = ("batch", "seqlen_q", "heads_q", "heads_kv", "headdim", "dtype", "backend", "shard_lengths")
"""What every CP rank of a baseline decode must agree on."""


@dataclass
class ShardPlan:
    """Shard lengths of every CP rank plus reusable communication buffers.

    Built once (one all-gather of the shard lengths) and passed to every decode step, as
    a serving system keeps its workspaces; a step whose shard length differs from the plan
    is an error. The buffers are allocated on first use and counted by
    :meth:`workspace_bytes` (they are part of the baseline's peak memory).
    """

    lengths: tuple[int, ...]
    """KV shard length (dim 1 of k/v) of every CP rank, in CP-rank order."""
    rank: int
    """This process's CP rank."""
    kv_shape: tuple | None = None
    """(batch, nheads_kv, headdim, dtype) every rank agreed on at build (``None``: not checked)."""
    buffers: dict = field(default_factory=dict)
    """Name -> reusable tensor (ring double buffers, all-gather outputs)."""

    @classmethod
    def build(cls, k: torch.Tensor, groups: TreeGroups) -> "ShardPlan":
        """Exchange shard lengths; every CP rank calls this with its own k: (batch, shard_len, nheads_kv, headdim).

        One all-gather of (status, shard_len, batch, nheads_kv, headdim, dtype) per rank
        (``agreement.agree``): ranks whose KV shapes differ raise :class:`DisagreementError`
        here, naming each rank's value.
        """
        b, n, hkv, d = k.shape
        rows = agreement.agree("ShardPlan.build", ("batch", "heads_kv", "headdim", "dtype"), (b, hkv, d, k.dtype),
                               groups.cp_group, groups.cp_ranks, local=(n,), device=k.device)  # NCCL: device tensors
        return cls(tuple(row[0] for row in rows), groups.rank, (b, hkv, d, k.dtype))

    @property
    def max_len(self) -> int:
        return max(self.lengths)

    def workspace_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        t = self.buffers.get(name)
        if t is None or t.numel() < numel or t.dtype != dtype or t.device != device:
            t = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[name] = t
        return t

    def check(self, k: torch.Tensor, groups: TreeGroups) -> None:
        if len(self.lengths) != groups.size:
            raise ValueError(f"plan was built for {len(self.lengths)} CP ranks, groups have {groups.size}")
        if self.lengths[groups.rank] != k.shape[1]:
            raise ValueError(
                f"plan says CP rank {groups.rank} holds {self.lengths[groups.rank]} keys, but k has "
                f"{k.shape[1]}; rebuild the plan with ShardPlan.build after the cache changed"
            )
        got = (k.shape[0], k.shape[2], k.shape[3], k.dtype)
        if self.kv_shape is not None and got != self.kv_shape:
            raise ValueError(
                f"plan was built for k of (batch, nheads_kv, headdim, dtype) = {self.kv_shape}, got {got}; "
                "rebuild the plan with ShardPlan.build"
            )


def _seqlens(cache_seqlens, k) -> torch.Tensor:
    if cache_seqlens is not None:
        return cache_seqlens
    return torch.full((k.shape[0],), k.shape[1], dtype=torch.int32, device=k.device)


def _signature(q, k, backend, lengths) -> tuple:
    b, sq, hq, d = q.shape
    try:
        name = ops.resolve_backend(q.device, backend)
    except (ValueError, RuntimeError):  # agree first; the kernel call then says what is wrong
        name = None
    return (b, sq, hq, k.shape[2], d, q.dtype, name, lengths)


def _finish(outs, lses, q_dtype, return_lse, lse_dtype=None):
    out, lse = ops.merge_states(torch.stack(outs), torch.stack(lses))
    out = out.to(q_dtype)
    return (out, lse.to(contract.lse_acc_dtype(lse_dtype, q_dtype))) if return_lse else out


def ring_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: TreeGroups,
    *,
    plan: ShardPlan | None = None,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    stats: CommStats | None = None,
    backend: str | None = None,
    lse_dtype: torch.dtype | None = None,
):
    """Ring Attention decode: KV shards rotate P-1 hops; each rank attends to every shard.

    Per rank: q: (batch, seqlen_q, nheads_q, headdim) replicated; k, v: (batch, shard_len,
    nheads_kv, headdim) this rank's shard (lengths may differ, 0 allowed); cache_seqlens:
    (batch,) int32 valid keys per row of this shard. plan: from :meth:`ShardPlan.build`
    (built here, with one extra all-gather, when omitted).
    returns out: (batch, seqlen_q, nheads_q, headdim) in q.dtype, identical on every rank,
    and with ``return_lse`` lse: (batch, nheads_q, seqlen_q) float32 (``lse_dtype=torch.float64``:
    returned whole, as :func:`~megatron_tree.tree_decode` does; partials are merged in float64 either way).

    Hop h sends the shard in hand (k, v, seqlens: three messages) to CP rank r+1 and
    receives CP rank r-h-1's shard from r-1 while the kernel runs on the shard in hand.
    Receive buffers are two flat workspaces of the largest shard (double buffering).
    """
    contract.lse_acc_dtype(lse_dtype, q.dtype)  # a bad lse_dtype fails before any message
    p, r = groups.size, groups.rank
    plan = plan if plan is not None else ShardPlan.build(k, groups)
    plan.check(k, groups)
    b, _, hkv, d = k.shape
    outs: list = [None] * p
    lses: list = [None] * p
    cur = (k, v, _seqlens(cache_seqlens, k))
    nxt, prv = groups.cp_ranks[(r + 1) % p], groups.cp_ranks[(r - 1) % p]
    cap = b * plan.max_len * hkv * d
    with groups.agreement.call("ring decode", BASELINE_SIGNATURE, _signature(q, k, backend, plan.lengths)):
        for hop in range(p):
            src = (r - hop) % p  # owner of the shard in hand
            pending = None
            if hop < p - 1:
                n_in = plan.lengths[(src - 1) % p]
                slot = hop % 2
                bk = plan.buffer(f"ring_k{slot}", cap, k.dtype, k.device)[: b * n_in * hkv * d].view(b, n_in, hkv, d)
                bv = plan.buffer(f"ring_v{slot}", cap, v.dtype, v.device)[: b * n_in * hkv * d].view(b, n_in, hkv, d)
                bs = plan.buffer(f"ring_s{slot}", b, torch.int32, k.device)[:b]
                pending = collectives.p2p([(t, nxt) for t in cur], [(t, prv) for t in (bk, bv, bs)], groups.cp_group,
                                          stats=stats, what=f"ring decode, hop {hop}")
            outs[src], lses[src] = ops.flash_decode(
                q, cur[0], cur[1], cache_seqlens=cur[2], softmax_scale=softmax_scale, backend=backend,
                lse_dtype=torch.float64,
            )
            if pending is not None:
                pending.wait()
                cur = (bk, bv, bs)
    if stats is not None:
        stats.calls += 1
    return _finish(outs, lses, q.dtype, return_lse, lse_dtype)


def passq_ring_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: TreeGroups,
    *,
    plan: ShardPlan | None = None,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    stats: CommStats | None = None,
    backend: str | None = None,
    lse_dtype: torch.dtype | None = None,
):
    """Partial-state ring: local kernel once, then the partial states travel P-1 hops.

    Shapes as :func:`ring_decode`. Each rank packs its state as cat[o, lse] (o in fp32, the
    lse's float64 bytes as two fp32 words: batch*seqlen_q*nheads_q*(headdim+2) values) into a
    (P, state) workspace; hop h sends
    the state that arrived at hop h-1 (its own at hop 0) to r+1 and receives the next one
    from r-1. After P-1 hops every rank holds all P states and merges them in shard order.
    """
    contract.lse_acc_dtype(lse_dtype, q.dtype)  # a bad lse_dtype fails before any message
    p, r = groups.size, groups.rank
    out, lse = ops.flash_decode(q, k, v, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, backend=backend,
                                lse_dtype=torch.float64)
    acc = contract.acc_dtype(out.dtype)
    lse_words = lse.reshape(-1).view(acc)  # the float64 lse's bytes, travelling whole
    no, nl = out.numel(), lse_words.numel()
    plan = plan if plan is not None else ShardPlan(tuple([k.shape[1]] * p), r)
    states = plan.buffer("passq_states", p * (no + nl), acc, q.device)[: p * (no + nl)].view(p, no + nl)
    states[r, :no] = out.reshape(-1)
    states[r, no:] = lse_words
    nxt, prv = groups.cp_ranks[(r + 1) % p], groups.cp_ranks[(r - 1) % p]
    with groups.agreement.call("pass-Q ring decode", BASELINE_SIGNATURE, _signature(q, k, backend, None)):
        for hop in range(p - 1):
            send_slot, recv_slot = (r - hop) % p, (r - hop - 1) % p
            collectives.p2p([(states[send_slot], nxt)], [(states[recv_slot], prv)], groups.cp_group,
                            stats=stats, what=f"pass-Q ring decode, hop {hop}").wait()
    if stats is not None:
        stats.calls += 1
    outs = states[:, :no].reshape(p, *out.shape)
    lses = states[:, no:].contiguous().view(lse.dtype).reshape(p, *lse.shape)
    res, res_lse = ops.merge_states(outs, lses)
    res = res.to(q.dtype)
    return (res, res_lse.to(contract.lse_acc_dtype(lse_dtype, q.dtype))) if return_lse else res


def allgather_kv_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: TreeGroups,
    *,
    plan: ShardPlan | None = None,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    stats: CommStats | None = None,
    backend: str | None = None,
    lse_dtype: torch.dtype | None = None,
):
    """All-gather the whole KV cache (k, v, seqlens: three all-gathers), then decode locally.

    Shapes as :func:`ring_decode`. Shards shorter than the longest are padded to it (the
    all-gather needs equal sizes; the padding is masked by the gathered seqlens). The
    gathered cache, (P, batch, max_len, nheads_kv, headdim) for k and for v, lives in
    reusable workspaces of the plan: P times a shard on every rank.
    """
    contract.lse_acc_dtype(lse_dtype, q.dtype)  # a bad lse_dtype fails before any message
    p = groups.size
    plan = plan if plan is not None else ShardPlan.build(k, groups)
    plan.check(k, groups)
    b, n, hkv, d = k.shape
    m = plan.max_len
    seq = _seqlens(cache_seqlens, k)
    gathered = []
    with groups.agreement.call("all-gather-KV decode", BASELINE_SIGNATURE, _signature(q, k, backend, plan.lengths)):
        for name, t in (("k", k), ("v", v)):
            if n < m:  # pad this rank's shard to the common size
                pad = plan.buffer(f"ag_pad_{name}", b * m * hkv * d, t.dtype, t.device)[: b * m * hkv * d].view(b, m, hkv, d)
                pad[:, :n].copy_(t)
                t = pad
            out_buf = plan.buffer(f"ag_{name}", p * b * m * hkv * d, t.dtype, t.device)[: p * b * m * hkv * d]
            gathered.append(_gather_into(out_buf.view(p, b, m, hkv, d), t, groups, stats))
        seqs = _gather_into(torch.empty(p, b, dtype=torch.int32, device=k.device), seq, groups, stats)
    outs, lses = [], []
    for u in range(p):
        o, l = ops.flash_decode(q, gathered[0][u], gathered[1][u], cache_seqlens=seqs[u],
                                softmax_scale=softmax_scale, backend=backend, lse_dtype=torch.float64)
        outs.append(o)
        lses.append(l)
    if stats is not None:
        stats.calls += 1
    return _finish(outs, lses, q.dtype, return_lse, lse_dtype)


def _gather_into(out_buf: torch.Tensor, t: torch.Tensor, groups: TreeGroups, stats) -> torch.Tensor:
    """All-gather t into out_buf (P, *t.shape) over the CP group; record the traffic."""
    return collectives.all_gather(t, groups.cp_group, out=out_buf, stats=stats, what="all-gather-KV decode")
