"""Triton kernel: merge P partial attention states in one pass (DESIGN.md section 1).

Invariant: this is the only Triton implementation of the merge formula, and it follows
``reference.merge_states`` exactly -- ``m = max_u lse_u``, ``w_u = exp(lse_u - m)`` (0 for an
empty shard, and no NaN when every shard is empty), ``o = sum_u w_u o_u / sum_u w_u``,
``lse = m + log sum_u w_u`` -- read with a running maximum so each partial is loaded once.
It serves two callers: ``ops.merge_states`` (the local merge after ``comm``'s all-gather on
GPU) and the combine pass of ``flash_decode.py`` (its KV splits are partial states too), so
the split-KV kernel and the distributed merge share one formula and one set of edge cases.

Kernel tier only: ``@triton.jit`` code and a launcher that checks shapes, allocates and builds
the grid. No torch.distributed here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["merge_states", "merge_launch", "Launch", "MERGE_BLOCK_P", "merge_config", "SUPPORTED_DTYPES"]

MERGE_BLOCK_P = 16
"""Partial states read per loop iteration (a fixed tile: P is small and padding is masked)."""

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


# Shapes and outer strides vary between calls and are sometimes 1: not specialised on, so
# the compiled set stays one kernel per (dtype, BLOCK_D). Innermost strides stay specialised.
_MERGE_GENERIC = ["P", "SQ", "HQ", "D", "s_op", "s_ob", "s_os", "s_oh", "s_lp", "s_lb", "s_lh",
                  "s_ls", "s_Ob", "s_Os", "s_Oh", "s_Lb", "s_Lh", "s_Ls"]


@triton.jit(do_not_specialize=_MERGE_GENERIC)
def _merge_kernel(
    OUTS, LSES, O, LSE,
    P, SQ, HQ, D,
    s_op, s_ob, s_os, s_oh, s_od,
    s_lp, s_lb, s_lh, s_ls,
    s_Ob, s_Os, s_Oh, s_Od,
    s_Lb, s_Lh, s_Ls,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program merges one (batch, query, head) row over all P partial states.
    row = tl.program_id(0)
    h = row % HQ
    s = (row // HQ) % SQ
    b = (row // HQ) // SQ
    b64 = b.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lse_base = LSES + b64 * s_lb + h * s_lh + s * s_ls
    out_base = OUTS + b64 * s_ob + s * s_os + h * s_oh

    m = tl.max(tl.full([BLOCK_P], float("-inf"), tl.float32), 0)
    den = tl.sum(tl.zeros([BLOCK_P], tl.float32), 0)
    num = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        p_ok = offs_p < P
        p64 = offs_p.to(tl.int64)
        lse = tl.load(lse_base + p64 * s_lp, mask=p_ok, other=float("-inf")).to(tl.float32)
        o = tl.load(out_base + p64[:, None] * s_op + offs_d[None, :] * s_od,
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse, 0))
        # All shards seen so far empty: m_new = -inf; rescale against 0 so every weight is 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp(m - m_safe)
        w = tl.exp(lse - m_safe)
        # An empty shard (w = 0) contributes nothing even if its output holds garbage.
        contrib = tl.where(w[:, None] > 0, w[:, None] * o, 0.0)
        num = num * rescale + tl.sum(contrib, 0)
        den = den * rescale + tl.sum(w, 0)
        m = m_new

    has = den > 0
    out = num / tl.where(has, den, 1.0)
    out = tl.where(has, out, 0.0)
    lse_out = tl.where(has, tl.where(has, m, 0.0) + tl.log(tl.where(has, den, 1.0)), float("-inf"))
    tl.store(O + b64 * s_Ob + s * s_Os + h * s_Oh + offs_d * s_Od,
             out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(LSE + b64 * s_Lb + h * s_Lh + s * s_Ls, lse_out)


def merge_config(headdim: int) -> dict:
    """Launch constants for a head dim: ``BLOCK_D`` (next power of two, >= 64, as in
    ``flash_decode.decode_config``) and ``num_warps``."""
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"merge kernel supports head dims 1..{MAX_HEADDIM}, got {headdim}")
    block_d = max(64, triton.next_power_of_2(headdim))
    return {"BLOCK_P": MERGE_BLOCK_P, "BLOCK_D": block_d, "num_warps": 1 if block_d <= 64 else 2}


class Launch(NamedTuple):
    """One kernel launch, built but not run: ``kernel[grid](*args, **kwargs)``.

    Launchers return these so that ``tests/test_aot.py`` can compile, for sm_80 and sm_90,
    exactly the specialisations a real call launches.
    """

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


def merge_launch(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> Launch:
    """The launch that writes the merge of P partial states into ``out`` and ``lse`` (any strides).

    outs: (P, batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32
    lses: (P, batch, nheads_q, seqlen_q) float32, natural log, -inf for an empty state
    out: (batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32 (written)
    lse: (batch, nheads_q, seqlen_q) float32 (written)
    """
    p, b, sq, hq, d = outs.shape
    cfg = merge_config(d)
    return Launch(
        _merge_kernel, (b * sq * hq,),
        (outs, lses, out, lse, p, sq, hq, d,
         *outs.stride(), *lses.stride(), *out.stride(), *lse.stride()),
        {"BLOCK_P": cfg["BLOCK_P"], "BLOCK_D": cfg["BLOCK_D"], "num_warps": cfg["num_warps"]},
    )


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial states exactly, like ``reference.merge_states``.

    outs: (P, batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32, any strides
    lses: (P, batch, nheads_q, seqlen_q) natural log, -inf for an empty state (read as float32)
    returns out: (batch, seqlen_q, nheads_q, headdim) in outs.dtype (0 where every state is
            empty), lse: (batch, nheads_q, seqlen_q) float32 (-inf where every state is empty)
    """
    if outs.dim() != 5 or lses.dim() != 4:
        raise ValueError(
            f"merge_states expects outs (P, B, Sq, Hq, D) and lses (P, B, Hq, Sq), "
            f"got {tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    p, b, sq, hq, d = outs.shape
    if tuple(lses.shape) != (p, b, hq, sq):
        raise ValueError(
            f"lses must have shape {(p, b, hq, sq)} to match outs {tuple(outs.shape)}, got {tuple(lses.shape)}"
        )
    if outs.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"Triton merge_states supports {SUPPORTED_DTYPES} outputs, got {outs.dtype}; "
                        "use backend='torch' for other dtypes")
    if not lses.is_floating_point():
        raise TypeError(f"lses must be a float tensor (natural log), got {lses.dtype}")
    if outs.device != lses.device:
        raise ValueError(f"outs is on {outs.device} but lses is on {lses.device}")
    if p == 0:
        raise ValueError("merge_states needs at least one partial state (P >= 1), got P = 0")
    if p == 1:
        return outs[0], lses[0].to(torch.float32)
    out = torch.empty((b, sq, hq, d), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=outs.device)
    if b * sq * hq:
        merge_launch(outs, lses.to(torch.float32), out, lse).run()
    return out, lse
