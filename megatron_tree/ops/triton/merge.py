"""Triton kernel: merge P partial attention states (docs/design.md §1).

Invariant: this is the only Triton implementation of the merge formula, and it follows
``reference.merge_states`` exactly -- ``m = max_u lse_u``, ``w_u = exp(lse_u - m)`` (0 for an
empty shard, and no NaN when every shard is empty), ``o = sum_u w_u o_u / sum_u w_u``,
``lse = m + log sum_u w_u``, with ``lse_u - m`` and ``m + log`` formed in float64 so that a
float64 partial lse (flash_decode's splits; ``lse_dtype=torch.float64``) keeps its precision. The lse of up to 128 partials are read at once for ``m``, then
the partial outputs once each, with 128-bit loads; every offset is int64. It serves two
callers: ``ops.merge_states`` (the local merge after ``comm``'s all-gather on GPU) and
``flash_decode.py`` (its KV splits are partial states too), so the split-KV kernel and the
distributed merge share one formula and one set of edge cases.

Kernel tier only: ``@triton.jit`` code and a launcher that checks shapes, allocates and builds
the grid. No torch.distributed here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .launch import FastSlot, Launch

__all__ = ["merge_states", "merge_launch", "Launch", "MAX_BLOCK_P", "merge_config", "SUPPORTED_DTYPES",
           "round_like_gpu", "INTERPRETED"]

MAX_BLOCK_P = 128
"""Partial states whose lse one program reads at once (P up to this needs no running rescale)."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers. ``triton.cdiv`` and ``triton.next_power_of_2`` are Triton's constexpr functions
    (Triton >= 3.5): usable inside kernels, each host call unwraps its arguments -- microseconds a call, several
    per launch."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1) of a host integer (see :func:`cdiv`)."""
    return 1 << (n - 1).bit_length()

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256


@triton.jit
def round_like_gpu(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (round to nearest even, as the GPU converts), kept in fp32.

    For the interpreter, whose fp32 -> bf16 cast truncates: after this the cast is exact.
    x must be finite (probabilities and attention outputs are).
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


# Shapes and lse strides vary between calls and are sometimes 1: not specialised on, so
# the compiled set stays small. The head dim is a compile-time constant and the strides of
# the outputs stay specialised (16-element alignment, innermost stride 1), so partial
# outputs are read and the result written with vector loads and stores.
_MERGE_GENERIC = ["P", "SQ", "HQ", "s_lp", "s_lb", "s_lh", "s_ls", "s_Lb", "s_Lh", "s_Ls"]


@triton.jit(do_not_specialize=_MERGE_GENERIC)
def _merge_kernel(
    OUTS, LSES, O, LSE,
    P, SQ, HQ,
    s_op, s_ob, s_os, s_oh, s_od,
    s_lp, s_lb, s_lh, s_ls,
    s_Ob, s_Os, s_Oh, s_Od,
    s_Lb, s_Lh, s_Ls,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK_P: tl.constexpr,
    EXACT_ROUNDING: tl.constexpr,
):
    # One program merges one (batch, query, head) row over all P partial states. Every
    # index is int64 before it meets a stride: s * s_os alone passes 2^31 once
    # Sq * Hq * D does.
    row = tl.program_id(0).to(tl.int64)
    h = row % HQ
    s = (row // HQ) % SQ
    b = (row // HQ) // SQ
    offs_d = tl.arange(0, BLOCK_D)
    lse_base = LSES + b * s_lb + h * s_lh + s * s_ls
    out_base = OUTS + b * s_ob + s * s_os + h * s_oh

    # Pass 1: m = max_u lse_u, all lse of the row at once when P <= BLOCK_P (= up to 128).
    # The lse are read in float64 (float32 lse widen exactly): lse - m and m + log(den) are
    # formed there, so a float64 lse's precision reaches the weights (reference.lse_weights).
    m = tl.max(tl.full([BLOCK_P], float("-inf"), tl.float64), 0)
    for p0 in range(0, P, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        lse = tl.load(lse_base + offs_p.to(tl.int64) * s_lp, mask=offs_p < P, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse.to(tl.float64), 0))
    # All shards empty: m = -inf; weigh against 0 so every weight is 0 (no inf - inf).
    m_safe = tl.where(m == float("-inf"), 0.0, m)

    # Pass 2: num = sum_u w_u o_u, den = sum_u w_u, CHUNK_P partial outputs per load.
    den = tl.sum(tl.zeros([CHUNK_P], tl.float32), 0)
    num = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(0, P, CHUNK_P):
        offs_p = p0 + tl.arange(0, CHUNK_P)
        p_ok = offs_p < P
        p64 = offs_p.to(tl.int64)
        lse = tl.load(lse_base + p64 * s_lp, mask=p_ok, other=float("-inf")).to(tl.float64)
        w = tl.exp((lse - m_safe).to(tl.float32))
        if HEAD_DIM == BLOCK_D:
            o_mask = p_ok[:, None]
        else:
            o_mask = p_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        o = tl.load(out_base + p64[:, None] * s_op + offs_d[None, :] * s_od, mask=o_mask, other=0.0)
        # An empty shard (w = 0) contributes nothing even if its output holds garbage.
        num += tl.sum(tl.where(w[:, None] > 0, w[:, None] * o.to(tl.float32), 0.0), 0)
        den += tl.sum(w, 0)

    # Only den == 0 is "no key": a NaN den (a NaN partial lse) stays NaN, as in reference.normalize.
    empty = den == 0
    out = tl.where(empty, 0.0, num / tl.where(empty, 1.0, den))
    lse_out = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, den).to(tl.float64)))
    if EXACT_ROUNDING:  # the interpreter: round to nearest even first, so its cast is exact
        out = round_like_gpu(out, O.dtype.element_ty)
    tl.store(O + b * s_Ob + s * s_Os + h * s_Oh + offs_d * s_Od, out.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)
    tl.store(LSE + b * s_Lb + h * s_Lh + s * s_Ls, lse_out.to(LSE.dtype.element_ty))


def merge_config(headdim: int, p: int) -> dict:
    """:func:`_merge_config` (see there), a copy per call: built once per shape (host time)."""
    return dict(_merge_config(headdim, p))


@functools.lru_cache(maxsize=1024)
def _merge_config(headdim: int, p: int) -> dict:
    """Launch constants for a head dim and P partial states.

    ``BLOCK_D``: the head dim's next power of two; ``BLOCK_P``: lse values read at once (P's
    next power of two, at most ``MAX_BLOCK_P``); ``CHUNK_P``: partial outputs per load, at most
    32 elements per thread and at least 8 (so 16-bit partials load 128 bits at a time; rows
    past P are masked); 4 warps for tiles of 1024 elements and more, else 1.
    """
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"merge kernel supports head dims 1..{MAX_HEADDIM}, got {headdim}")
    block_d = max(16, next_pow2(headdim))
    block_p = min(MAX_BLOCK_P, max(2, next_pow2(p)))
    num_warps = 4 if block_p * block_d >= 1024 else 1
    chunk_p = max(min(block_p, 32 * 32 * num_warps // block_d), 8 * 32 * num_warps // block_d)
    return {"BLOCK_D": block_d, "BLOCK_P": block_p, "CHUNK_P": chunk_p, "num_warps": num_warps}


INTERPRETED = not isinstance(_merge_kernel, JITFunction)
"""True when ``TRITON_INTERPRET=1`` was set before import (kernels then run on CPU tensors)."""


def merge_launch(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> Launch:
    """The launch that writes the merge of P partial states into ``out`` and ``lse`` (any strides).

    outs: (P, batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32
    lses: (P, batch, nheads_q, seqlen_q) float32 or float64, natural log, -inf for an empty state
    out: (batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32 (written)
    lse: (batch, nheads_q, seqlen_q) float32 or float64 (written)
    """
    kernel, grid, tail, constants = merge_plan(outs.shape, outs.stride(), lses.stride(), out.stride(), lse.stride())
    return Launch(kernel, grid, (outs, lses, out, lse) + tail, constants)


def merge_plan(shape: tuple, outs_stride: tuple, lses_stride: tuple, out_stride: tuple, lse_stride: tuple) -> tuple:
    """What :func:`merge_launch` launches besides its four tensors, from their layout alone:
    ``(kernel, grid, trailing args, constants)``; the args are ``(outs, lses, out, lse) + trailing``.

    shape: outs' (P, batch, seqlen_q, nheads_q, headdim); the strides: of outs, lses, out, lse.
    """
    p, b, sq, hq, d = shape
    return (_merge_kernel, (b * sq * hq,), (p, sq, hq, *outs_stride, *lses_stride, *out_stride, *lse_stride),
            {"HEAD_DIM": d, "EXACT_ROUNDING": INTERPRETED, **merge_config(d, p)})


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial states exactly, like ``reference.merge_states``.

    outs: (P, batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32, any strides
    lses: (P, batch, nheads_q, seqlen_q) float32 or float64, natural log, -inf for an empty
        state; float64 lses are used whole
    returns out: (batch, seqlen_q, nheads_q, headdim) in outs.dtype (0 where every state is
            empty), lse: (batch, nheads_q, seqlen_q) float32, float64 for float64 lses (-inf where
            every state is empty)
    """
    check_inputs(outs, lses)
    lse_dtype = torch.float64 if lses.dtype == torch.float64 else torch.float32
    if outs.shape[0] == 1:
        return outs[0], lses[0].to(lse_dtype)
    out, lse, launch = planned_launch(outs, lses.to(lse_dtype))
    if launch is not None:
        launch.run()
    return out, lse


def check_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """What :func:`merge_states` takes, checked from the tensors' shapes, dtypes and devices alone (raises
    ``ValueError``/``TypeError``); ``ops.dispatch`` runs it once per signature (:func:`signature_plan`)."""
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
    if lses.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"lses must be float32 or float64 (natural log), got {lses.dtype}")
    if outs.device != lses.device:
        raise ValueError(f"outs is on {outs.device} but lses is on {lses.device}")
    if p == 0:
        raise ValueError("merge_states needs at least one partial state (P >= 1), got P = 0")


def planned_launch(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Launch | None]:
    """``(out, lse, launch)``: the outputs of merging ``outs`` and ``lses`` (out in outs' dtype, lse in lses'), fresh
    and contiguous, and the :func:`merge_launch` that writes them (None for an empty merge), planned once per
    signature of ``outs`` and ``lses`` (shape, strides, dtypes, device: what the launch holds besides its tensors;
    host time), with the plan's fast slot (:mod:`.launch`)."""
    p, b, sq, hq, d = outs.shape
    out = torch.empty((b, sq, hq, d), dtype=outs.dtype, device=outs.device)
    lse = torch.empty((b, hq, sq), dtype=lses.dtype, device=outs.device)
    if b * sq * hq == 0:
        return out, lse, None
    kernel, grid, tail, constants, slot = _launch_plan(outs, lses)
    # the launch's own kwargs: a caller's change to them must not reach the plan (decode_launches copies its too)
    return out, lse, Launch(kernel, grid, (outs, lses, out, lse) + tail, dict(constants), slot)


def _launch_plan(outs: torch.Tensor, lses: torch.Tensor) -> tuple:
    """(kernel, grid, trailing args, constants, fast slot) of the launch merging ``outs`` and ``lses`` (a non-empty
    merge) into fresh contiguous outputs, from ``_PLANS``."""
    key = (outs.shape, outs.stride(), outs.dtype, lses.stride(), lses.dtype, outs.device)
    plan = _PLANS.get(key)
    if plan is None:
        p, b, sq, hq, d = outs.shape
        plan = merge_plan(outs.shape, outs.stride(), lses.stride(), contiguous_strides((b, sq, hq, d)),
                          contiguous_strides((b, hq, sq))) + (FastSlot(4),)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def signature_plan(outs: torch.Tensor, lses: torch.Tensor) -> tuple:
    """For a caller that remembers the signature of ``outs`` and ``lses`` (``ops.dispatch``): :func:`check_inputs`,
    then what :func:`run_plan` needs for every call of that signature with P >= 2 -- ``(out spec, lse spec, launch
    plan or None, device)``, the specs ``(shape, strides, dtype)`` of contiguous outputs. Raises for inputs
    :func:`merge_states` refuses."""
    check_inputs(outs, lses)
    p, b, sq, hq, d = outs.shape
    if p == 1:
        raise ValueError("signature_plan is for P >= 2 (one state is its own merge)")
    launch = _launch_plan(outs, lses) if b * sq * hq else None
    return (((b, sq, hq, d), contiguous_strides((b, sq, hq, d)), outs.dtype),
            ((b, hq, sq), contiguous_strides((b, hq, sq)), lses.dtype), launch, outs.device)


def run_plan(plan: tuple, outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_states` of ``outs`` and ``lses`` (P >= 2) through :func:`signature_plan`'s ``plan`` of their
    signature: fresh outputs, the launch run (its plan's own constants: the launch is never handed out)."""
    (o_shape, o_stride, o_dtype), (l_shape, l_stride, l_dtype), launch, dev = plan
    out = torch.empty_strided(o_shape, o_stride, dtype=o_dtype, device=dev)
    lse = torch.empty_strided(l_shape, l_stride, dtype=l_dtype, device=dev)
    if launch is not None:
        Launch(launch[0], launch[1], (outs, lses, out, lse) + launch[2], launch[3], launch[4]).run()
    return out, lse


def contiguous_strides(shape: tuple) -> tuple:
    """The strides of a contiguous tensor of ``shape`` (as torch gives them: a size-0 dim counts as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def clear_plans() -> None:
    """Forget every merge plan, here and, through :data:`epoch`, where callers keep one (``ops.dispatch``)."""
    global epoch
    _PLANS.clear()
    epoch += 1


_PLANS: dict = {}
"""merge_states' launches by signature: (kernel, grid, trailing args, constants, fast slot) (:mod:`.launch`).
Cleared past ``_MAX_PLANS`` signatures (shapes of a long-running server come and go)."""
_MAX_PLANS = 1024
epoch = 0
"""How many times :func:`clear_plans` has run (a kept plan older than that is taken anew)."""
