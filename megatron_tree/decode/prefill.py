"""Exact context-parallel prefill: attention over every rank's chunk of the prompt, and its logits.

Invariant: both variants compute causal attention of this rank's queries over the keys of
*every* rank, masked by global positions, and return exactly what single-process attention
over the whole prompt returns for these queries (up to float rounding):

* :func:`ring_prefill` -- Ring Attention: KV blocks travel around the CP ring with
  ``isend``/``irecv`` (the next block is in flight while the current one is computed), a
  block whose keys are all after this rank's queries is skipped, and every other block's
  partial state -- from the fused prefill kernels (``ops.prefill_attention``: torch's fused
  flash attention with lse on CPU, flash / memory-efficient attention on CUDA; memory one
  kernel tile, never seqlen_q x seqlen_k) -- is folded into the running one with the project's
  single merge formula (``ops.merge_states`` -> ``reference.lse_weights``/``normalize``,
  docs/design.md §1). With the load-balanced layout (``placement.prefill_ranges``) every
  rank does the same causal work; :class:`PrefillWork` counts it.
* :func:`allgather_prefill` -- one all-gather of every rank's keys/values/positions, then
  one local attention: P times the memory, the simplest baseline.

* :func:`assemble_logits` -- the one assembly of prefill logits (last token, every token or
  any set of positions) from each rank's logits of its own chunk: one all-reduce SUM to
  which only the rank holding a position contributes, exact and identical on every rank.

Padding convention: a query or key whose position is negative is padding. Padded keys are
never visible; padded queries see nothing and get output 0. Ranks may hold different
numbers of tokens: the key length is padded to the CP-wide maximum internally.

Agreement: both variants start with one all-gather of a fixed-size record per rank
(``agreement.agree``: whether its own inputs passed their checks, its key length, and
everything that must not differ: batch, heads, head dim, dtype, method, kernel backend), so
a malformed input on one rank, or ranks that disagree, raise the same error on every rank,
naming the rank or each rank's value, before any KV moves -- never a gloo abort on
mismatched buffers, never a wait for the timeout.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..distributed import agreement, collectives
from ..ops import contract, dispatch as ops, reference
from ..comm.merge import CommStats
from ..distributed.topology import TreeGroups

__all__ = ["ring_prefill", "allgather_prefill", "cp_prefill", "assemble_logits", "PREFILL_METHODS", "PrefillWork",
           "visible_pairs"]

PREFILL_METHODS = ("ring", "allgather")
_HIDDEN = torch.iinfo(torch.int64).max  # the position of a padded key: after every query


def _check(q, k, v, q_pos, k_pos, window=None, softcap=None, sinks=None) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, seqlen, heads, headdim), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if tuple(q_pos.shape) != tuple(q.shape[:2]):
        raise ValueError(f"q_pos must have shape {tuple(q.shape[:2])} (batch, seqlen_q), got {tuple(q_pos.shape)}")
    if tuple(k_pos.shape) != tuple(k.shape[:2]):
        raise ValueError(f"k_pos must have shape {tuple(k.shape[:2])} (batch, seqlen_k), got {tuple(k_pos.shape)}")
    contract.check_variants(q, window=window, softcap=softcap, sinks=sinks)


def _pad_keys(k, v, k_pos, length: int):
    """Pad the key axis to ``length``; padded keys get a position no query reaches."""
    k_pos = torch.where(k_pos < 0, torch.full_like(k_pos, _HIDDEN), k_pos.to(torch.int64))
    extra = length - k.shape[1]
    if extra:
        b, _, h, d = k.shape
        k = torch.cat([k, k.new_zeros(b, extra, h, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, extra, h, v.shape[-1])], dim=1)  # V's own head dim (MLA)
        k_pos = torch.cat([k_pos, k_pos.new_full((b, extra), _HIDDEN)], dim=1)
    return k.contiguous(), v.contiguous(), k_pos.contiguous()


PREFILL_SIGNATURE = ("batch", "heads_q", "heads_kv", "headdim", "headdim_v", "dtype", "method", "backend",
                     "window", "softcap", "sinks", "kernel")
"""What every CP rank of a prefill must agree on (the local lengths may differ)."""


@dataclass
class PrefillWork:
    """What one rank's CP prefill computed, skipped and waited for: counted, summed over the calls it is passed to.

    ``pairs`` is the attention work: every (query, key) pair of real tokens the causal mask
    lets through, summed over batch rows (times heads x head dim x 4 for FLOPs). With the
    load-balanced layout it is within one chunk's rounding across the ranks of a causal prompt.
    """

    pairs: int = 0
    """Visible (query, key) pairs of real tokens this rank computed, over every block and batch row."""
    blocks: int = 0
    """KV blocks attended (this rank's own block included)."""
    skipped: int = 0
    """KV blocks skipped whole: every key in them is after every query of this rank (or padding)."""
    kernels: dict = field(default_factory=dict)
    """Local kernel launches by name (``fused_prefill.KERNELS``)."""
    compute_s: float = 0.0
    """Seconds in local attention and merging."""
    wait_s: float = 0.0
    """Seconds spent waiting for the next KV block after the current one was computed: the part of the
    ring's communication that computation did not hide."""

    def add(self, other: "PrefillWork") -> None:
        """Add another count into this one."""
        self.pairs += other.pairs
        self.blocks += other.blocks
        self.skipped += other.skipped
        for name, n in other.kernels.items():
            self.kernels[name] = self.kernels.get(name, 0) + n
        self.compute_s += other.compute_s
        self.wait_s += other.wait_s


def visible_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor) -> int:
    """(query, key) pairs with ``0 <= k_pos <= q_pos``, summed over batch rows.

    q_pos: (batch, seqlen_q), k_pos: (batch, seqlen_k) integer positions, negative = padding
    """
    keys = torch.where(k_pos < 0, torch.full_like(k_pos, _HIDDEN), k_pos.to(torch.int64))
    keys = torch.sort(keys, dim=1).values.contiguous()
    cnt = torch.searchsorted(keys, q_pos.to(torch.int64).contiguous(), right=True)
    return int(cnt[q_pos >= 0].sum())



def _agree_and_length(q, k, v, q_pos, k_pos, method: str, backend, groups: TreeGroups, stats,
                      window=None, softcap=None, sinks=None, kernel=None) -> int:
    """This rank's checks, then one all-gather of (status, seqlen_k, *PREFILL_SIGNATURE): the CP-wide key length.

    Every rank sees every rank's record (``agreement.agree``), so a rank whose own inputs are
    malformed, or ranks that disagree, make the same error on every rank before any KV moves.
    """

    def signature():
        _check(q, k, v, q_pos, k_pos, window, softcap, sinks)
        try:
            name = ops.resolve_backend(q.device, backend)
        except (ValueError, RuntimeError):  # unusable here: agree first, then the kernel call says why
            name = None
        b, _, hq, d = q.shape
        sink = None if sinks is None else tuple(sinks.double().tolist())
        return (b, hq, k.shape[2], d, v.shape[-1], q.dtype, method, name, window, softcap, sink,
                ops.prefill_kernel(q, v, kernel, window=window, softcap=softcap))

    length = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    rows = agreement.agree("CP prefill", PREFILL_SIGNATURE, signature, groups.cp_group, groups.cp_ranks,
                           local=(length,), device=q.device if isinstance(q, torch.Tensor) else None, stats=stats)
    return max(row[0] for row in rows)


def _local(q, k, v, q_pos, k_pos, softmax_scale, backend, window=None, softcap=None, kernel=None, work=None):
    """Partial state of q over one KV block: out (B, Sq, Hq, Dv) float32 (float64 for float64
    input) and lse (B, Hq, Sq) float64, so that partials accumulate in full precision (a ring
    merges them again: ``reference``'s docstring). The kernel is ``ops``' one choice
    (``ops.prefill_kernel``: the fused prefill kernels, or the exact decode path for a window,
    soft-capping or MLA's V head dim; a block with no key inside a query's window is an empty
    partial for it)."""
    return ops.prefill_attention(q, k, v, q_positions=q_pos, k_positions=k_pos, softmax_scale=softmax_scale,
                                 kernel=kernel, backend=backend, window=window, softcap=softcap,
                                 calls=None if work is None else work.kernels)


def _alone(q, k, v, q_pos, k_pos, softmax_scale, backend, window, softcap, sinks, kernel, work):
    """Prefill without a CP group: one local call."""
    _check(q, k, v, q_pos, k_pos, window, softcap, sinks)
    k, v, kp = _pad_keys(k, v, k_pos, k.shape[1])
    return _one_block(q, k, v, q_pos.to(torch.int64), kp, softmax_scale, backend, window, softcap, sinks, kernel,
                      work)


def _one_block(q, k, v, q_pos, k_pos, softmax_scale, backend, window, softcap, sinks, kernel, work):
    """The queries over one block holding every key they see (no merge), counted in ``work``."""
    t0 = time.perf_counter()
    out = _finish(*_local(q, k, v, q_pos, k_pos, softmax_scale, backend, window, softcap, kernel, work), q, sinks)
    if work is not None:
        work.blocks += 1
        work.pairs += visible_pairs(q_pos, k_pos)
        work.compute_s += time.perf_counter() - t0
    return out


def _finish(out, lse, q, sinks):
    """The merged state in q's dtype, with the sink joined once (after every block's merge)."""
    if sinks is not None:
        out, _ = reference.add_sink(out, lse, sinks)
    return out.to(q.dtype)


def ring_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    groups: TreeGroups | None,
    *,
    softmax_scale: float | None = None,
    backend: str | None = None,
    stats: CommStats | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kernel: str | None = None,
    work: PrefillWork | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys, KV passed around a ring.

    Per rank:

    q: (batch, seqlen_q, nheads_q, headdim) -- this rank's prompt tokens
    k: (batch, seqlen_k, nheads_kv, headdim), v: (batch, seqlen_k, nheads_kv, headdim_v) -- this
        rank's keys/values (seqlen_k may differ between ranks; headdim_v may differ from headdim: MLA)
    q_pos: (batch, seqlen_q), k_pos: (batch, seqlen_k) integer global positions, < 0 = padding
    window: sliding window by global position (a query at p sees keys p - window < j <= p);
        softcap: score soft-capping; both as for ``ops.flash_decode``, the same on every rank
    sinks: (nheads_q,) one logit per query head joining the softmax once, after every block's
        merge (``reference.add_sink``); the same on every rank
    kernel: the local kernel (``fused_prefill.KERNELS``; default ``ops.prefill_kernel``:
        torch's fused CPU flash attention on CPU, flash / memory-efficient attention on CUDA; the
        exact decode path for window, softcap or MLA); backend: the decode backend of the exact path
    work: a :class:`PrefillWork` this call's counts are added to, or None
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in q.dtype

    Each ring step computes the current block while the next one is in flight; a block whose
    keys are all after every query of this rank (causal: the later chunks) is skipped without
    a kernel call or a merge. Collectives: one all-gather of a fixed-size record (seqlen_k and
    the signature; see the module docstring), then P-1 rounds of one batch of isend/irecv of (k, v, k_pos) to
    the next/from the previous CP rank; recorded in ``stats`` (level ``"cp"``, ops
    ``all_gather`` and ``send``, one per message) when one is given.
    """
    if groups is None or groups.size == 1:
        return _alone(q, k, v, q_pos, k_pos, softmax_scale, backend, window, softcap, sinks, kernel, work)
    p, me = groups.size, groups.rank
    length = _agree_and_length(q, k, v, q_pos, k_pos, "ring", backend, groups, stats, window, softcap, sinks, kernel)
    q_pos = q_pos.to(torch.int64)
    k, v, kp = _pad_keys(k, v, k_pos, length)
    nxt, prv = groups.cp_ranks[(me + 1) % p], groups.cp_ranks[(me - 1) % p]
    q_last = int(q_pos.max()) if q_pos.numel() else -1

    acc_out = acc_lse = None
    block = (k, v, kp)
    for step in range(p):
        pending, incoming = None, None
        if step < p - 1:  # the next block travels while this one is computed
            incoming = tuple(torch.empty_like(t) for t in block)
            pending = collectives.p2p([(t, nxt) for t in block], [(t, prv) for t in incoming], groups.cp_group,
                                      level="cp", stats=stats, what=f"ring prefill, round {step}")
        t0 = time.perf_counter()
        bk, bv, bp = block
        try:
            if bp.numel() and int(bp.min()) <= q_last:
                out, lse = _local(q, bk, bv, q_pos, bp, softmax_scale, backend, window, softcap, kernel, work)
                if acc_out is None:
                    acc_out, acc_lse = out, lse
                else:
                    acc_out, acc_lse = ops.merge_states(torch.stack([acc_out, out]), torch.stack([acc_lse, lse]))
                if work is not None:
                    work.blocks += 1
                    work.pairs += visible_pairs(q_pos, bp)
            elif work is not None:  # every key is in the future (or padding): skipped
                work.skipped += 1
        except BaseException:
            # This round's blocks were posted before the computation failed. Finish them before raising, so the
            # ranks stay in step: a peer that fails alike has posted the same round, and the next call's round 0
            # must not meet these messages. A peer that did not fail goes on to the next round and gets the
            # groups' timeout's CommError.
            if pending is not None:
                with contextlib.suppress(Exception):
                    pending.wait()
            raise
        t1 = time.perf_counter()
        if pending is not None:
            pending.wait()
        if work is not None:
            work.compute_s += t1 - t0
            work.wait_s += time.perf_counter() - t1
        if incoming is not None:
            block = incoming
    if acc_out is None:  # no visible key at all (e.g. only padded queries on this rank)
        return q.new_zeros(*q.shape[:3], v.shape[-1])
    return _finish(acc_out, acc_lse, q, sinks)


def allgather_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    groups: TreeGroups | None,
    *,
    softmax_scale: float | None = None,
    backend: str | None = None,
    stats: CommStats | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    kernel: str | None = None,
    work: PrefillWork | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys, after an all-gather of KV.

    Shapes as :func:`ring_prefill`. Collectives: one all-gather of a fixed-size record
    (seqlen_k and the signature), three all-gathers (k, v, k_pos), recorded in ``stats``
    when one is given. Holds every rank's keys at once: P times ring's KV memory.
    """
    if groups is None or groups.size == 1:
        return _alone(q, k, v, q_pos, k_pos, softmax_scale, backend, window, softcap, sinks, kernel, work)
    length = _agree_and_length(q, k, v, q_pos, k_pos, "allgather", backend, groups, stats, window, softcap, sinks,
                               kernel)
    q_pos = q_pos.to(torch.int64)
    k, v, kp = _pad_keys(k, v, k_pos, length)
    gathered = []
    for t in (k, v, kp):
        parts = collectives.all_gather(t, groups.cp_group, level="cp", stats=stats, what="all-gather prefill")
        gathered.append(torch.cat(parts.unbind(0), dim=1))
    k_all, v_all, kp_all = gathered
    return _one_block(q, k_all, v_all, q_pos, kp_all, softmax_scale, backend, window, softcap, sinks, kernel, work)


def cp_prefill(q, k, v, q_pos, k_pos, groups, *, method: str = "ring", softmax_scale=None, backend=None, stats=None,
               window=None, softcap=None, sinks=None, kernel=None, work=None):
    """Dispatch to :func:`ring_prefill` or :func:`allgather_prefill` by ``method`` (the same arguments)."""
    if method == "ring":
        fn = ring_prefill
    elif method == "allgather":
        fn = allgather_prefill
    else:
        raise ValueError(f"unknown prefill method {method!r}; expected one of {PREFILL_METHODS}")
    return fn(q, k, v, q_pos, k_pos, groups, softmax_scale=softmax_scale, backend=backend, stats=stats,
              window=window, softcap=softcap, sinks=sinks, kernel=kernel, work=work)


# --------------------------------------------------------------------------- prefill logits


def assemble_logits(
    local_logits: torch.Tensor,
    local_positions: torch.Tensor,
    wanted: torch.Tensor,
    groups: TreeGroups | None,
    *,
    stats: CommStats | None = None,
    device: torch.device | None = None,
    signature: tuple | None = None,
) -> torch.Tensor:
    """The logits of the prompt positions ``wanted``, from each CP rank's logits of its own chunk.

    Per rank (every rank passes its own chunk's logits, the same ``wanted``):

    local_logits: (batch, W, vocab) -- this rank's logits at its W local tokens, any float dtype
    local_positions: (batch, W) int -- global position of each of them; negative: padding
    wanted: (batch, K) or (K,) int -- the global positions to return (last token: ``[[L - 1]]``;
        every token: ``arange(L)``); a negative entry is a pad and returns 0
    device: where the all-reduce runs (NCCL: a CUDA device; default local_logits' device)
    signature: ``(site, names, values)`` the CP group's agreement checks before the all-reduce
        (default ``("prefill logits", ("batch", "positions", "vocab"), (B, K, vocab))``)
    returns (batch, K, vocab) float32 (float64 for float64 logits: ``contract.acc_dtype``, never narrower
        than the model computed them) on local_logits' device, identical on every CP rank

    Collectives (CP > 1): one all-reduce SUM of (batch, K, vocab) in that dtype inside the CP group's
    :class:`~megatron_tree.distributed.agreement.Agreement` on ``signature``. The rank holding a position
    contributes its logits, every other rank zeros, so the sum is exact (x + 0 = x) and
    bitwise identical on every rank; each position is held by exactly one rank (the placement
    rule's prompt chunks), so no rank's logits are added twice. This is the one assembly of
    prefill logits: the transformers, Megatron static and ``MegatronLM`` prefills all use it.
    """
    b, w, vocab = local_logits.shape
    dtype = contract.acc_dtype(local_logits.dtype)
    wanted = wanted.to(device=local_logits.device, dtype=torch.int64)
    if wanted.dim() == 1:
        wanted = wanted[None, :].expand(b, -1)
    positions = local_positions.to(device=local_logits.device, dtype=torch.int64)
    hit = (positions[:, :, None] == wanted[:, None, :]) & (wanted[:, None, :] >= 0)  # (B, W, K)
    if w:
        pick = hit.to(torch.int64).argmax(dim=1)  # (B, K): the local token that holds it, if any
        mine = local_logits.gather(1, pick[..., None].expand(-1, -1, vocab)).to(dtype)
        mine = torch.where(hit.any(dim=1)[..., None], mine, torch.zeros((), device=mine.device))
    else:  # this rank holds no token of the prompt
        mine = torch.zeros(b, wanted.shape[1], vocab, dtype=dtype, device=local_logits.device)
    if groups is None or groups.size == 1:
        return mine
    site, names, values = signature or ("prefill logits", ("batch", "positions", "vocab"), tuple(mine.shape))
    buf = mine if device is None else mine.to(device)
    with groups.agreement.call(site, names, values):
        collectives.all_reduce(buf, groups.cp_group, op="sum", stats=stats,
                               what=f"{site}: summing each position's logits from the rank that holds it")
    return buf.to(mine.device)
