"""Exact context-parallel prefill attention: each CP rank holds a chunk of the prompt.

Invariant: both variants compute causal attention of this rank's queries over the keys of
*every* rank, masked by global positions, and return exactly what single-process attention
over the whole prompt returns for these queries (up to float rounding):

* :func:`ring_prefill` -- Ring Attention: KV blocks travel around the CP ring with
  ``isend``/``irecv`` (the next block is in flight while the current one is computed) and
  every block's partial state is folded into the running one with the project's single merge
  formula (``ops.merge_states`` -> ``reference.lse_weights``/``normalize``, DESIGN.md section 1).
* :func:`allgather_prefill` -- one all-gather of every rank's keys/values/positions, then
  one local attention: P times the memory, the simplest baseline.

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

import torch

from .. import agreement, collectives, ops, reference
from ..comm import CommStats
from ..topology import TreeGroups

__all__ = ["ring_prefill", "allgather_prefill", "cp_prefill", "PREFILL_METHODS"]

PREFILL_METHODS = ("ring", "allgather")
_HIDDEN = torch.iinfo(torch.int64).max  # the position of a padded key: after every query


def _check(q, k, v, q_pos, k_pos) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be (batch, seqlen, heads, headdim), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if tuple(q_pos.shape) != tuple(q.shape[:2]):
        raise ValueError(f"q_pos must have shape {tuple(q.shape[:2])} (batch, seqlen_q), got {tuple(q_pos.shape)}")
    if tuple(k_pos.shape) != tuple(k.shape[:2]):
        raise ValueError(f"k_pos must have shape {tuple(k.shape[:2])} (batch, seqlen_k), got {tuple(k_pos.shape)}")


def _pad_keys(k, v, k_pos, length: int):
    """Pad the key axis to ``length``; padded keys get a position no query reaches."""
    k_pos = torch.where(k_pos < 0, torch.full_like(k_pos, _HIDDEN), k_pos.to(torch.int64))
    extra = length - k.shape[1]
    if extra:
        b, _, h, d = k.shape
        k = torch.cat([k, k.new_zeros(b, extra, h, d)], dim=1)
        v = torch.cat([v, v.new_zeros(b, extra, h, d)], dim=1)
        k_pos = torch.cat([k_pos, k_pos.new_full((b, extra), _HIDDEN)], dim=1)
    return k.contiguous(), v.contiguous(), k_pos.contiguous()


PREFILL_SIGNATURE = ("batch", "heads_q", "heads_kv", "headdim", "dtype", "method", "backend")
"""What every CP rank of a prefill must agree on (the local lengths may differ)."""


def _agree_and_length(q, k, v, q_pos, k_pos, method: str, backend, groups: TreeGroups, stats) -> int:
    """This rank's checks, then one all-gather of (status, seqlen_k, *PREFILL_SIGNATURE): the CP-wide key length.

    Every rank sees every rank's record (``agreement.agree``), so a rank whose own inputs are
    malformed, or ranks that disagree, make the same error on every rank before any KV moves.
    """

    def signature():
        _check(q, k, v, q_pos, k_pos)
        try:
            name = ops.resolve_backend(q.device, backend)
        except (ValueError, RuntimeError):  # unusable here: agree first, then the kernel call says why
            name = None
        b, _, hq, d = q.shape
        return (b, hq, k.shape[2], d, q.dtype, method, name)

    length = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    rows = agreement.agree("CP prefill", PREFILL_SIGNATURE, signature, groups.cp_group, groups.cp_ranks,
                           local=(length,), device=q.device if isinstance(q, torch.Tensor) else None, stats=stats)
    return max(row[0] for row in rows)


def _local(q, k, v, q_pos, k_pos, softmax_scale, backend):
    """Partial state of q over one KV block: out (B, Sq, Hq, D) float32 (float64 for float64
    input) and lse (B, Hq, Sq) float64, so that partials accumulate in full precision (a ring
    merges them again: ``reference``'s docstring)."""
    acc = reference.acc_dtype(q.dtype)
    out, lse = ops.flash_decode(
        q, k, v, softmax_scale=softmax_scale, q_positions=q_pos, k_positions=k_pos, backend=backend,
        out_dtype=acc, lse_dtype=torch.float64,
    )
    return out, lse


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
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys, KV passed around a ring.

    Per rank:

    q: (batch, seqlen_q, nheads_q, headdim) -- this rank's prompt tokens
    k, v: (batch, seqlen_k, nheads_kv, headdim) -- this rank's keys/values (seqlen_k may
        differ between ranks)
    q_pos: (batch, seqlen_q), k_pos: (batch, seqlen_k) integer global positions, < 0 = padding
    returns out: (batch, seqlen_q, nheads_q, headdim) in q.dtype

    Collectives: one all-gather of a fixed-size record (seqlen_k and the signature; see
    the module docstring), then P-1 rounds of one batch of isend/irecv of (k, v, k_pos) to
    the next/from the previous CP rank; recorded in ``stats`` (level ``"cp"``, ops
    ``all_gather`` and ``send``, one per message) when one is given.
    """
    if groups is None or groups.size == 1:
        _check(q, k, v, q_pos, k_pos)
        k, v, kp = _pad_keys(k, v, k_pos, k.shape[1])
        return _local(q, k, v, q_pos.to(torch.int64), kp, softmax_scale, backend)[0].to(q.dtype)
    p, me = groups.size, groups.rank
    length = _agree_and_length(q, k, v, q_pos, k_pos, "ring", backend, groups, stats)
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
        bk, bv, bp = block
        if bp.numel() and int(bp.min()) <= q_last:  # else every key is in the future: skip
            out, lse = _local(q, bk, bv, q_pos, bp, softmax_scale, backend)
            if acc_out is None:
                acc_out, acc_lse = out, lse
            else:
                acc_out, acc_lse = ops.merge_states(torch.stack([acc_out, out]), torch.stack([acc_lse, lse]))
        if pending is not None:
            pending.wait()
        if incoming is not None:
            block = incoming
    if acc_out is None:  # no visible key at all (e.g. only padded queries on this rank)
        return torch.zeros_like(q)
    return acc_out.to(q.dtype)


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
) -> torch.Tensor:
    """Causal attention of this rank's queries over all ranks' keys, after an all-gather of KV.

    Shapes as :func:`ring_prefill`. Collectives: one all-gather of a fixed-size record
    (seqlen_k and the signature), three all-gathers (k, v, k_pos), recorded in ``stats``
    when one is given. Holds every rank's keys at once: P times ring's KV memory.
    """
    if groups is None or groups.size == 1:
        _check(q, k, v, q_pos, k_pos)
        k, v, kp = _pad_keys(k, v, k_pos, k.shape[1])
        return _local(q, k, v, q_pos.to(torch.int64), kp, softmax_scale, backend)[0].to(q.dtype)
    length = _agree_and_length(q, k, v, q_pos, k_pos, "allgather", backend, groups, stats)
    q_pos = q_pos.to(torch.int64)
    k, v, kp = _pad_keys(k, v, k_pos, length)
    gathered = []
    for t in (k, v, kp):
        parts = collectives.all_gather(t, groups.cp_group, level="cp", stats=stats, what="all-gather prefill")
        gathered.append(torch.cat(parts.unbind(0), dim=1))
    k_all, v_all, kp_all = gathered
    out, _ = _local(q, k_all, v_all, q_pos, kp_all, softmax_scale, backend)
    return out.to(q.dtype)


def cp_prefill(q, k, v, q_pos, k_pos, groups, *, method: str = "ring", softmax_scale=None, backend=None, stats=None):
    """Dispatch to :func:`ring_prefill` or :func:`allgather_prefill` by ``method``."""
    if method == "ring":
        fn = ring_prefill
    elif method == "allgather":
        fn = allgather_prefill
    else:
        raise ValueError(f"unknown prefill method {method!r}; expected one of {PREFILL_METHODS}")
    return fn(q, k, v, q_pos, k_pos, groups, softmax_scale=softmax_scale, backend=backend, stats=stats)
