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

Agreement: both variants start with one all-gather of a fixed-size record per rank (its key
length plus everything that must not differ: batch, heads, head dim, dtype, method, kernel
backend), so ranks that disagree raise the same :class:`DisagreementError` on every rank,
naming each rank's value, before any KV moves -- never a gloo abort on mismatched buffers.
"""

from __future__ import annotations

import torch

from .. import collectives, ops, reference
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


_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
PREFILL_SIGNATURE = ("batch", "heads_q", "heads_kv", "headdim", "dtype", "method", "backend")
"""What every CP rank of a prefill must agree on (the local lengths may differ)."""


def _code(value, table) -> int:
    return table.index(value) if value in table else -1


def _agree_and_length(q, k, method: str, backend, groups: TreeGroups, stats) -> int:
    """One all-gather of (seqlen_k, *PREFILL_SIGNATURE) per rank: the CP-wide key length, or an error.

    Every rank sees every rank's record, so a disagreement is the same
    :class:`DisagreementError` on every rank.
    """
    b, _, hq, d = q.shape
    try:
        name = ops.resolve_backend(q.device, backend)
    except (ValueError, RuntimeError):  # unusable here: agree first, then the kernel call says why
        name = None
    record = [k.shape[1], b, hq, k.shape[2], d, _code(q.dtype, _DTYPES), _code(method, PREFILL_METHODS),
              _code(name, ops.BACKENDS)]
    mine = torch.tensor(record, dtype=torch.int64, device=q.device)  # NCCL needs device tensors
    rows = collectives.all_gather(mine, groups.cp_group, level="cp", stats=stats,
                                  what=f"CP prefill ({method}): exchanging shapes and key lengths").tolist()
    decode = (lambda v: v, lambda v: v, lambda v: v, lambda v: v, lambda v: _name(v, _DTYPES),
              lambda v: _name(v, PREFILL_METHODS), lambda v: _name(v, ops.BACKENDS))
    table = {rank: {n: f(v) for n, f, v in zip(PREFILL_SIGNATURE, decode, row[1:])}
             for rank, row in zip(groups.cp_ranks, rows)}
    err = collectives.disagreement("CP prefill", table)
    if err is not None:
        raise err
    return max(row[0] for row in rows)


def _name(code: int, table) -> str:
    return str(table[code]).replace("torch.", "") if 0 <= code < len(table) else f"other ({code})"


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
    _check(q, k, v, q_pos, k_pos)
    q_pos = q_pos.to(torch.int64)
    if groups is None or groups.size == 1:
        k, v, kp = _pad_keys(k, v, k_pos, k.shape[1])
        return _local(q, k, v, q_pos, kp, softmax_scale, backend)[0].to(q.dtype)
    p, me = groups.size, groups.rank
    length = _agree_and_length(q, k, "ring", backend, groups, stats)
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
    _check(q, k, v, q_pos, k_pos)
    q_pos = q_pos.to(torch.int64)
    if groups is None or groups.size == 1:
        k, v, kp = _pad_keys(k, v, k_pos, k.shape[1])
        return _local(q, k, v, q_pos, kp, softmax_scale, backend)[0].to(q.dtype)
    length = _agree_and_length(q, k, "allgather", backend, groups, stats)
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
