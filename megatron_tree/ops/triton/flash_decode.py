"""Triton kernel: split-KV flash decoding that returns the partial state ``(out, lse)``.

Invariant: one program owns one (batch row, KV head, block of query rows, KV split). Its
query rows are *all* the query heads of that KV head's GQA group times the ``Sq`` query
tokens, so every K/V tile is read from memory exactly once per split, whatever Hq/Hkv is
(MQA included); KV is never expanded. Each split keeps flash-attention's online softmax with
scores in natural-log units, exponentiating differences in base 2 (``exp2((s - m) log2 e)``:
``s - m`` is exact for nearby scores, so probabilities keep one rounding at any ``|s|``), and
writes ``lse = m + ln l``, in float64 where the state is merged again (the splits' partials,
and ``lse_dtype=torch.float64``). Splits are partial states exactly like a CP rank's shard,
combined by the one merge kernel in ``merge.py``; with a single split the kernel writes the
result itself.

What makes it fast on a GPU (each fact is asserted from the SASS by ``tests/ops/test_aot.py``):

* the head dim is a compile-time constant and the innermost strides are specialised to 1,
  so K/V rows are read with 128-bit loads, issued asynchronously (``cp.async``) and
  software-pipelined ``num_stages`` deep;
* fp16/bf16 K and V go into the tensor cores as they are (``mma`` with fp32
  accumulation); the probabilities are rounded to the input dtype for the second product,
  as flash-attention does. fp32 input keeps fp32 accuracy (3-pass tf32);
* ``causal``, ``cache_seqlens`` present and the paged layout are compile-time switches:
  a call without them loads nothing for them and allocates nothing for them; so are the
  attention variants -- ``cache_starts`` (tiles before a row's first valid key are skipped),
  a sliding ``window`` (a lower bound on key positions beside the causal one), ``softcap``
  (``c * tanh(s / c)`` from one ``exp2``) -- and V's own head dim (MLA), so the plain kernel's
  machine code is what it was without them;
* the split count fills whole waves of the GPU, computed from the compiled kernel's
  registers, shared memory and warps and the device's limits (:func:`waves`).

The Triton interpreter computes bf16 arithmetic and bf16 ``tl.dot`` wrongly (docs/design.md, platform facts), so
under it (``EXACT_INPUTS``) inputs are converted to fp32 right after loading, and the
probabilities and the output are rounded to their dtype by integer arithmetic
(``merge.round_like_gpu``: round to nearest even, what the GPU's conversion does; the
interpreter's own fp32 -> bf16 cast truncates): the interpreter tests check the GPU's
rounding, exactly.

NaN is never an empty row: the only "no visible key" test is ``l == 0``. A NaN score makes
``l`` NaN whatever ``tl.max`` does with it (the GPU's ``max.f32`` drops a NaN operand, the
interpreter's numpy keeps it), so such a row's out and lse are NaN and a merge keeps them NaN.

Paged KV (``block_table``): key ``j`` of batch row ``b`` is slot ``j % page`` of block
``block_table[b, j // page]`` of a ``[num_blocks, page, Hkv, D]`` cache; ``cache_seqlens``,
``k_positions`` and splits all count keys in that logical order.

Only plain pointer arithmetic and APIs present in Triton 3.6 through 3.9 are used (no
``tl.make_block_ptr``, no TMA descriptors), so the same source compiles on the GPU
machine's Triton 3.6 and the pinned 3.7 (``tests/ops/test_aot.py`` checks both facts).

Kernel tier only: no torch.distributed, no backend choice (that is ``ops.py``).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import FastSlot, Launch
from .merge import INTERPRETED, cdiv, merge_plan, next_pow2, round_like_gpu
from .merge import contiguous_strides as _contiguous

__all__ = ["flash_decode", "decode_launches", "decode_config", "choose_num_splits", "waves", "SUPPORTED_DTYPES",
           "MAX_HEADDIM", "MAX_BLOCK_M", "MAX_SPLITS", "INTERPRETED"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256
MAX_BLOCK_M = 64
"""Query rows (GQA group x Sq) per program; larger groups are tiled over the grid."""
MAX_SPLITS = 128
"""At most this many KV splits per (row, KV head): the merge reads them all at once."""
MIN_TILES_PER_SPLIT = 2
"""A split reads at least this many KV tiles, so the merge stays small next to the reads."""
INTERPRETER_WAVE = 4
"""Stand-in programs per wave on CPU (interpreter), so tests exercise the multi-split path."""


# Integer arguments that vary between calls and are sometimes 1 (Sq, G, Hkv, ...) are not
# specialised on: each would double the set of compiled variants (and the AOT check) for no
# speed. Strides of q, K/V and out stay specialised -- stride 1 and 16-element alignment
# are what let Triton vectorise their loads and stores.
_DECODE_GENERIC = [
    "window", "N", "G", "HKV", "chunk", "num_m_blocks", "s_bt",
    "s_qpb", "s_qps", "s_kpb", "s_kpn", "s_lp", "s_lb", "s_lh", "s_ls",
]


@triton.jit
def soft_cap(x, cap):
    """``cap * tanh(x / cap)`` in fp32 from one exp2: ``tanh(a) = (1 - t) / (1 + t)``, ``t = e^(-2|a|)``.

    No overflow at any x (t <= 1), an absolute error of a few fp32 roundings of ``cap`` (what
    ``torch.tanh`` in fp32 has), NaN stays NaN and +-inf goes to +-cap. Written out because
    ``tanh`` is only in ``triton.language.extra`` (libdevice), which differs between releases.
    """
    a = x * (1.0 / cap)
    t = tl.exp2(tl.abs(a) * -2.8853900817779268)  # -2 log2 e
    th = (1.0 - t) / (1.0 + t)
    return cap * tl.where(a < 0, -th, th)


@triton.jit(do_not_specialize=_DECODE_GENERIC)
def _split_kv_kernel(
    Q, K, V, SEQLENS, BLOCK_TABLE, QPOS, KPOS, O, LSE, STARTS,
    scale, window, softcap,
    N, SQ, G, HKV, chunk, num_m_blocks,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_kn, s_kh, s_kd,
    s_vb, s_vn, s_vh, s_vd,
    s_bt,
    s_qpb, s_qps,
    s_kpb, s_kpn,
    s_op, s_ob, s_os, s_oh, s_od,
    s_lp, s_lb, s_lh, s_ls,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_SEQLENS: tl.constexpr,
    EXACT_INPUTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # PAGE: 0 for a contiguous (B, N, Hkv, D) cache, else the block size of a paged one
    # (then s_kb / s_vb are block strides and s_bt the block table's row stride).
    # EXACT_INPUTS: multiply in fp32 after widening the inputs (fp32 input, or the
    # interpreter); otherwise fp16/bf16 operands go into the tensor cores as loaded.
    # HEAD_DIM_V / BLOCK_DV: V's and the output's head dim (MLA; = HEAD_DIM / BLOCK_D otherwise).
    # HAS_STARTS: keys before STARTS[b] are not read (tiles wholly before it are skipped);
    # WINDOW (with CAUSAL): key positions must also exceed q_pos - window; SOFTCAP: scores ->
    # softcap * tanh(scores / softcap). Each is compile-time: off, it costs nothing.
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % num_m_blocks
    bh = pid // num_m_blocks
    b = bh // HKV
    hkv = bh % HKV
    b64 = b.to(tl.int64)

    # Keys [start, end) of this split that row b holds (cache_seqlens clamped to [0, N]).
    if HAS_SEQLENS:
        seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), N)
    else:
        seqlen = N
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)
    if HAS_STARTS:
        # Keys [first, seqlen) are valid. A contiguous cache, or a paged one with a block id per
        # key, starts its loop at ``first`` itself: no key below it is ever in a tile. Tiles
        # that lie inside one block (PAGE % BLOCK_N == 0) start at a multiple of BLOCK_N and
        # mask the keys of their first tile below ``first``.
        first = tl.minimum(tl.maximum(tl.load(STARTS + b), 0), N)
        if PAGE != 0 and PAGE % BLOCK_N == 0:
            loop_start = tl.maximum(start, first // BLOCK_N * BLOCK_N)
            # first <= key < end as one unsigned compare: key - first wraps past span below first
            span = (tl.maximum(end, first) - first).to(tl.uint32)
        else:
            loop_start = tl.maximum(start, first)
    else:
        loop_start = start

    # Query rows r = g * SQ + s: query head hkv * G + g, query token s.
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < G * SQ
    s = offs_m % SQ  # int32 while live across the loop (fewer registers); int64 at each use
    head = hkv * G + offs_m // SQ
    offs_d = tl.arange(0, BLOCK_D)
    if HEAD_DIM == BLOCK_D:  # compile-time: no head-dim mask at all
        q_mask = row_ok[:, None]
    else:  # 80, 96, ...: a constant-width mask, so the loads stay vectorised
        q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(Q + b64 * s_qb + s[:, None].to(tl.int64) * s_qs + head[:, None].to(tl.int64) * s_qh
                + offs_d[None, :] * s_qd,
                mask=q_mask, other=0.0)
    if EXACT_INPUTS:
        q = q.to(tl.float32)
    if CAUSAL:
        # Positions are compared as int32 (token positions stay below 2^31): half the registers.
        qpos = tl.load(QPOS + b64 * s_qpb + s.to(tl.int64) * s_qps, mask=row_ok, other=0).to(tl.int32)
        if WINDOW:
            wnd = window.to(tl.uint32)

    hkv64 = hkv.to(tl.int64)
    if PAGE == 0:
        k_base = K + b64 * s_kb + hkv64 * s_kh
        v_base = V + b64 * s_vb + hkv64 * s_vh
    else:
        k_base = K + hkv64 * s_kh
        v_base = V + hkv64 * s_vh
        bt_row = BLOCK_TABLE + b64 * s_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(loop_start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # n_ok: keys below end, which K and positions are read for (memory of this row);
        # in_range: the valid ones, which V is read for and the scores kept of. They differ
        # only in the first tile of a row with cache_starts in whole-tile blocks: a K row below
        # the start may hold anything (a masked score), a V row may not (0 * NaN in the PV product).
        n_ok = offs_n < end
        if HAS_STARTS and PAGE != 0 and PAGE % BLOCK_N == 0:
            in_range = (offs_n - first).to(tl.uint32) < span
        else:
            in_range = n_ok
        if PAGE == 0:
            k_rows = offs_n.to(tl.int64) * s_kn
            v_rows = offs_n.to(tl.int64) * s_vn
        elif PAGE % BLOCK_N == 0:
            # n0 is a multiple of BLOCK_N (chunk is), so the whole tile lies in one block.
            blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
            slot = (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
            k_rows = blk * s_kb + slot * s_kn
            v_rows = blk * s_vb + slot * s_vn
        else:
            blk = tl.load(bt_row + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            slot = (offs_n % PAGE).to(tl.int64)
            k_rows = blk * s_kb + slot * s_kn
            v_rows = blk * s_vb + slot * s_vn
        if HEAD_DIM == BLOCK_D:
            kv_mask = n_ok[:, None]
        else:
            kv_mask = n_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        if HEAD_DIM_V == BLOCK_DV:
            v_mask = in_range[:, None]
        else:
            v_mask = in_range[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
        if EXACT_INPUTS:
            k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        if CAUSAL:
            kpos = tl.load(KPOS + b64 * s_kpb + offs_n.to(tl.int64) * s_kpn, mask=n_ok, other=0).to(tl.int32)
            if WINDOW:  # q - window < k <= q, i.e. 0 <= q - k < window: one unsigned compare
                visible = in_range[None, :] & ((qpos[:, None] - kpos[None, :]).to(tl.uint32) < wnd)
            else:
                visible = in_range[None, :] & (kpos[None, :] <= qpos[:, None])
        else:
            visible = in_range[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        # A NaN score: tl.max / tl.maximum drop NaN on the GPU (PTX max.f32) and the interpreter
        # keeps it (numpy), so m may be finite or NaN; p and l are NaN either way, and stay so.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with no visible key so far keeps m = -inf; rescale against 0 to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # Differences first, then base 2: s - m is exact for nearby scores, so p keeps one
        # rounding at any |s| (s * log2 e rounded first would be off by 0.5 % at |s| = 1e5).
        alpha = tl.exp2((m_i - m_safe) * 1.4426950408889634)  # log2 e
        p = tl.exp2((scores - m_safe[:, None]) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_rows[:, None] + offs_dv[None, :] * s_vd, mask=v_mask, other=0.0)
        if EXACT_INPUTS:
            v = v.to(tl.float32)
            p = round_like_gpu(p, V.dtype.element_ty)
        else:
            p = p.to(V.dtype.element_ty)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # Only l == 0 is "no visible key": a NaN score left l NaN, so out and lse are NaN (a merge
    # must not take the row for an empty shard).
    empty = l_i == 0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    # lse = m + ln l. m is a score (natural log units); a float64 LSE (split partials, and
    # partials that a CP merge combines again) keeps the sum whole (reference's docstring).
    if LSE.dtype.element_ty == tl.float64:
        lse = tl.where(empty, float("-inf"),
                       tl.where(empty, 0.0, m_i).to(tl.float64) + tl.log(tl.where(empty, 1.0, l_i).to(tl.float64)))
    else:
        lse = tl.where(empty, float("-inf"), tl.where(empty, 0.0, m_i) + tl.log(tl.where(empty, 1.0, l_i)))
    split64 = split.to(tl.int64)
    if HEAD_DIM_V == BLOCK_DV:
        o_mask = row_ok[:, None]
    else:
        o_mask = row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V)
    s64 = s.to(tl.int64)
    head64 = head.to(tl.int64)
    if EXACT_INPUTS:
        out = round_like_gpu(out, O.dtype.element_ty)  # then the interpreter's cast is exact
    tl.store(O + split64 * s_op + b64 * s_ob + s64[:, None] * s_os + head64[:, None] * s_oh + offs_dv[None, :] * s_od,
             out.to(O.dtype.element_ty), mask=o_mask)
    tl.store(LSE + split64 * s_lp + b64 * s_lb + head64 * s_lh + s64 * s_ls, lse, mask=row_ok)


def decode_config(headdim: int, rows: int, dtype: torch.dtype, paged: bool = False,
                  headdim_v: int | None = None) -> dict:
    """Launch constants for one call: tile sizes, warps, stages and the dot precision.

    headdim: D of q and k; headdim_v: V's (default D; MLA's may be smaller): tiles are sized for
    the wider of the two, warps for V's (the accumulator's) width -- MLA's 192/128 takes 4, as
    D 128 does (8 spill 8 bytes on sm_90 under Triton 3.6);
    rows: query rows per KV head (GQA group size x Sq). Head dims that are not a
    power of two (80, 96) are padded to the next one with a compile-time mask. Query rows
    come in tiles of 16 (decode with GQA groups up to 16) or, for larger groups and several
    query tokens in fp16/bf16, of up to 64 / 32 / 16 rows for head dims 64 / 128 / 256
    (8 warps; 16-row tiles with head dims up to 128 use 4). fp32 input at head dim 256 uses 8
    warps too.
    A paged cache adds two pipeline stages: Triton schedules the block-id load and the K/V
    loads that depend on it in stages of their own, and with two more stages two K/V tiles
    stay in flight as in the contiguous kernel (``tests/ops/test_aot.py`` counts the copies).
    ``tests/ops/test_aot.py`` compiles every configuration this returns for sm_80 and sm_90 and
    checks registers (<= 168 for fp16/bf16), spills and the instructions used.
    """
    return dict(_decode_config(headdim, rows, dtype, paged, headdim if headdim_v is None else headdim_v))


@functools.lru_cache(maxsize=1024)  # host time: built once per shape, copied per call (callers may update it)
def _decode_config(headdim: int, rows: int, dtype: torch.dtype, paged: bool, headdim_v: int) -> dict:
    for name, dim in (("head dims", headdim), ("V head dims", headdim_v)):
        if not 1 <= dim <= MAX_HEADDIM:
            raise ValueError(f"flash_decode kernel supports {name} 1..{MAX_HEADDIM}, got {dim}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"flash_decode kernel supports {SUPPORTED_DTYPES}, got {dtype}")
    block_dv = max(16, next_pow2(headdim_v))
    block_d = max(16, next_pow2(headdim), block_dv)  # tile sizes follow the wider
    cfg = _tiles(block_d, block_dv, rows, dtype, paged)
    cfg["BLOCK_D"] = max(16, next_pow2(headdim))
    cfg["BLOCK_DV"] = block_dv
    return cfg


def _tiles(block_d: int, block_dv: int, rows: int, dtype: torch.dtype, paged: bool) -> dict:
    """:func:`decode_config`'s tiles, warps and stages for head-dim tiles of ``block_d`` (the
    wider of K's and V's) and an accumulator ``block_dv`` wide (= block_d unless MLA)."""
    if dtype == torch.float32:
        # Not the performance path: fp32 K/V tiles are staged twice as large and split
        # three ways for tf32x3, so tiles stay small (a 64 x 256 query tile overflows A100's
        # shared memory).
        return {"BLOCK_M": 16, "BLOCK_N": 32 if block_d <= 128 else 16, "BLOCK_D": block_d,
                "DOT_PRECISION": "tf32x3", "num_warps": 4 if block_d <= 128 else 8,
                "num_stages": 4 if paged else 2}
    block_m = 16 if rows <= 16 else min(next_pow2(rows), max(16, MAX_BLOCK_M * 64 // block_d))
    return {
        "BLOCK_M": block_m,
        # 64 keys x D per tile (32 for D = 256 or 64-row tiles): K and V tiles of 16 KB per
        # pipeline stage, and registers under 168 (checked under Triton 3.6 and 3.7).
        "BLOCK_N": 64 if block_d <= 128 and block_m <= 32 else 32,
        "BLOCK_D": block_d,
        "DOT_PRECISION": "tf32",  # unused for fp16/bf16 inputs (they multiply as they are)
        # Wider tiles take 8 warps: with 4, sm_80 needs up to 200 registers.
        "num_warps": 4 if block_m == 16 and block_dv <= 128 else 8,
        "num_stages": 5 if paged else 3,
    }


# ---- split count from the compiled kernel's occupancy -----------------------------------

@functools.lru_cache(maxsize=None)
def _device_limits(index: int) -> dict:
    props = torch.cuda.get_device_properties(index)
    return {
        "sms": props.multi_processor_count,
        "regs": getattr(props, "regs_per_multiprocessor", 65536),
        "threads": getattr(props, "max_threads_per_multi_processor", 2048),
        "smem": getattr(props, "shared_memory_per_multiprocessor", 0)
        or (getattr(props, "shared_memory_per_block_optin", 0) + 1024),
        "blocks": 32,  # resident blocks per SM on sm_80 / sm_90 (CUDA guide, compute capabilities)
    }


def blocks_per_sm(regs: int, shared: int, num_warps: int, limits: dict) -> int:
    """Resident programs per SM for a kernel using ``regs`` registers per thread and ``shared``
    bytes of shared memory with ``num_warps`` warps (registers are allocated per warp in
    units of 256; the driver reserves 1 KB of shared memory per block)."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = (limits["regs"] // per_warp) // num_warps
    by_threads = limits["threads"] // (32 * num_warps)
    by_smem = limits["smem"] // (shared + 1024) if shared else limits["blocks"]
    return max(1, min(by_regs, by_threads, by_smem, limits["blocks"]))


_WAVES: dict = {}


def waves(launch: Launch, device: torch.device) -> int:
    """Programs one wave of ``device`` runs at once for ``launch``'s compiled kernel.

    Compiles (once per configuration and device) to read the kernel's registers and shared
    memory; on CPU (interpreter) returns the stand-in ``INTERPRETER_WAVE``.
    """
    if device.type != "cuda":
        return INTERPRETER_WAVE
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, tuple(str(a.dtype) for a in launch.args[:9] if isinstance(a, torch.Tensor)),
           tuple(sorted(launch.kwargs.items())))
    wave = _WAVES.get(key)
    if wave is None:
        compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
        compiled._init_handles()  # loads the module onto the device, which reads n_regs (Triton 3.6-3.7)
        limits = _device_limits(index)
        wave = limits["sms"] * blocks_per_sm(compiled.n_regs, compiled.metadata.shared,
                                             compiled.metadata.num_warps, limits)
        _WAVES[key] = wave
    return wave


@functools.lru_cache(maxsize=4096)  # a loop over up to MAX_SPLITS counts: ~40 us of host time per eager call
def choose_num_splits(tiles: int, programs: int, wave: int) -> int:
    """KV splits per (row, KV head, query-row block) so the grid fills whole waves.

    tiles: KV tiles of the cache (from its length N, not the data-dependent cache_seqlens,
    so the launch needs no device sync and can be captured in a CUDA graph); programs:
    B * Hkv * query-row blocks; wave: programs the GPU runs at once (:func:`waves`).
    A split reads at least ``MIN_TILES_PER_SPLIT`` tiles and there are at most
    ``MAX_SPLITS``. Among split counts that change the work per split, take the fewest
    whose wave efficiency (programs / (waves x wave)) is within 90 % of the best (the
    heuristic FlashDecoding uses).
    """
    programs = max(programs, 1)
    if programs >= 0.8 * wave:
        return 1
    most = max(1, min(MAX_SPLITS, tiles // MIN_TILES_PER_SPLIT))
    effs = {}
    for s in range(1, most + 1):
        if s > 1 and -(-tiles // s) == -(-tiles // (s - 1)):
            continue  # same tiles per split as s - 1: more programs for the same work
        n = programs * s / wave
        effs[s] = n / math.ceil(n)
    best = max(effs.values())
    return min(s for s, e in effs.items() if e >= 0.9 * best)


# ---- workspace for the partial states ----------------------------------------------------

_WORKSPACE: dict = {}


def _partials(o_shape: tuple, o_stride: tuple, l_shape: tuple, l_stride: tuple,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for the split partials: o ``o_shape`` fp32, lse ``l_shape`` fp64 (merged again: kept whole), both
    contiguous (``o_stride``, ``l_stride``: their strides, from the plan).

    On a CUDA device's default stream, views of one reused workspace per device (the lse part starting
    64-byte aligned), made once per shape pair and kept with the buffer: kernels ordered on one stream
    never race. On any other stream fresh buffers: while a CUDA graph is captured they come from the
    graph's private pool (a reused buffer could be freed or grown under a graph that still points at it),
    and Inductor's CUDA graphs run their warmup on a stream of their own, allocating from that pool too,
    whose blocks they may hand out again (a cached one would then be shared). On CPU fresh buffers too
    (threads of one process may decode at once).
    """
    # (a capture never runs on the default stream: CUDA refuses to capture it)
    if device.type != "cuda" or torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        return (torch.empty_strided(o_shape, o_stride, dtype=torch.float32, device=device),
                torch.empty_strided(l_shape, l_stride, dtype=torch.float64, device=device))
    o_numel, l_numel = math.prod(o_shape), math.prod(l_shape)
    o_pad = -(-o_numel // 16) * 16
    numel = o_pad + 2 * l_numel
    buf, views = _WORKSPACE.get(device.index, (None, None))
    if buf is None or buf.numel() < numel:
        buf, views = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device), {}
        _WORKSPACE[device.index] = buf, views
    parts = views.get((o_shape, l_shape))
    if parts is None:
        parts = (buf[:o_numel].view(o_shape),
                 buf[o_pad:o_pad + 2 * l_numel].view(torch.float64).view(l_shape))
        if len(views) >= 256:  # bounded: shapes of a long-running server come and go
            views.clear()
        views[(o_shape, l_shape)] = parts
    return parts


def flash_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    lse_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    config: dict | None = None,
    window: int | None = None,
    softcap: float | None = None,
    cache_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV flash decoding of q over one KV shard (inputs already validated by ``ops``).

    q: (batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32, any strides
    k: (batch, seqlen_k, nheads_kv, headdim), v: (batch, seqlen_k, nheads_kv, headdim_v), any
        strides (e.g. a slice of a larger cache), or with ``block_table`` a paged cache
        (num_blocks, page, nheads_kv, headdim[_v]), any strides; headdim_v may differ (MLA)
    block_table: (batch, max_blocks) int32: row b's key j is in block block_table[b, j // page];
        then seqlen_k = max_blocks * page. Entries past a row's cache_seqlens, or wholly before
        its cache_starts, are not read.
    cache_seqlens: (batch,) int32, valid keys per row (0 allowed; clamped to [0, seqlen_k])
    cache_starts: (batch,) int32, the first valid key per row (clamped to [0, seqlen_k]); the
        tiles before it are skipped -- for a paged shard whose slots follow positions, the
        first slot a sliding window still shows makes the window a slot range
    q_positions: (batch, seqlen_q), k_positions: (batch, seqlen_k) or (seqlen_k,) integers
        below 2^31 (compared as int32); key j is visible to query i iff k_pos[j] <= q_pos[i]
    window: with positions, key j is visible to query i only if also q_pos[i] - window < k_pos[j]
    softcap: scores -> softcap * tanh(scores / softcap) before the softmax
    out_dtype: dtype of ``out`` (default q.dtype); float32 keeps partials unrounded
    lse_dtype: float32 (default) or float64 (``m + ln l`` kept whole, for a merge that follows)
    num_splits, block_n, config: overrides of the heuristics (tests, benchmarks); config may
        set BLOCK_N, num_warps, num_stages
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in out_dtype, zero where no key is visible
            lse: (batch, nheads_q, seqlen_q) in lse_dtype, natural log, -inf where no key is
            visible, NaN where a visible score is NaN
    """
    plan = plan_of(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, lse_dtype,
                   num_splits, block_n, config, window, softcap, cache_starts)
    return run_plan(plan, q, k, v, block_table, cache_seqlens, q_positions, k_positions, cache_starts)


class _Plan(NamedTuple):
    """What :func:`decode_launches` builds for one call signature, without the call's tensors.

    out, lse: (shape, strides, dtype) of the results (contiguous); partials: (o shape, o strides, lse
    shape, lse strides) of the split partials, or None; split: (grid, trailing args, constants, fast
    slot) of the split kernel's launch, None when the call is empty; merge: (kernel, grid, trailing
    args, constants, fast slot) of the merge launch, or None; device: q's (part of the signature);
    copy_lengths: cache_seqlens or cache_starts is a strided view over several rows, which the kernel,
    reading row b's at offset b, takes as a contiguous copy. The trailing args follow the launch's
    tensors: split (q, k, v, seqlens, table, qpos, kpos, o, l, starts), merge (partial o, partial lse,
    out, lse). The fast slots keep each launch's compiled kernel for the calls after the first
    (:mod:`.launch`).
    """

    out: tuple
    lse: tuple
    partials: tuple | None
    split: tuple | None
    merge: tuple | None
    device: torch.device
    copy_lengths: bool = False


_PLANS: dict = {}
"""Call signature -> :class:`_Plan`: a launch is built once per signature (host time), then filled with
each call's tensors. Cleared past ``_MAX_PLANS`` signatures and by :func:`clear_plans`."""
_MAX_PLANS = 4096
epoch = 0
"""How many times :func:`clear_plans` has run: a caller that keeps a plan of its own (``ops.dispatch`` keeps one
with each remembered signature) takes a new one when this has changed since."""


def clear_plans() -> None:
    """Forget every built plan (e.g. after replacing :func:`waves`, which split counts depend on), here and, through
    :data:`epoch`, where callers keep one."""
    global epoch
    _PLANS.clear()
    epoch += 1


def decode_launches(q, k, v, *, block_table=None, cache_seqlens=None, softmax_scale=None, q_positions=None,
                    k_positions=None, out_dtype=None, lse_dtype=None, num_splits=None, block_n=None, config=None,
                    window=None, softcap=None, cache_starts=None):
    """Allocate the outputs and build (without running) the kernel launches of one decode call.

    Same arguments and shapes as :func:`flash_decode`; returns ``(out, lse, launches)``: one
    launch (the split kernel writing ``out`` itself) or two (split kernel, then merge).
    Split out so that ``tests/ops/test_aot.py`` compiles exactly what a real call would launch.
    What the launches hold besides the tensors depends only on the call's signature (shapes,
    strides, dtypes, device, which tensors are present, the scalar arguments), so it is planned
    once per signature (:class:`_Plan`, :func:`plan_of`) and each call fills in its tensors.
    """
    plan = plan_of(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, lse_dtype,
                   num_splits, block_n, config, window, softcap, cache_starts)
    (o_shape, o_stride, o_dtype), (l_shape, l_stride, l_dtype) = plan.out, plan.lse
    out = torch.empty_strided(o_shape, o_stride, dtype=o_dtype, device=plan.device)
    lse = torch.empty_strided(l_shape, l_stride, dtype=l_dtype, device=plan.device)
    if plan.split is None:
        return out, lse, []
    if plan.copy_lengths:
        cache_seqlens, cache_starts = _contiguous_lengths(cache_seqlens, cache_starts)
    grid, tail, constants, slot = plan.split
    # each launch its own constants: a caller's change to a launch's kwargs must not reach the plan
    if plan.merge is None:  # the split kernel writes the result itself, rounded once
        tensors = _split_tensors(q, k, v, cache_seqlens, block_table, q_positions, k_positions, out, lse, cache_starts)
        return out, lse, [Launch(_split_kv_kernel, grid, tensors + tail, dict(constants), slot)]
    o_part, lse_part = _partials(*plan.partials, plan.device)
    tensors = _split_tensors(q, k, v, cache_seqlens, block_table, q_positions, k_positions, o_part, lse_part,
                             cache_starts)
    kernel, m_grid, m_tail, m_constants, m_slot = plan.merge
    return out, lse, [Launch(_split_kv_kernel, grid, tensors + tail, dict(constants), slot),
                      Launch(kernel, m_grid, (o_part, lse_part, out, lse) + m_tail, dict(m_constants), m_slot)]


def run_plan(plan: _Plan, q, k, v, block_table, cache_seqlens, q_positions, k_positions, cache_starts):
    """Run the launches of ``plan`` (:func:`plan_of` of this call's signature) for this call's tensors;
    returns ``(out, lse)``. What :func:`decode_launches` builds, then each launch run, with positional
    arguments and the plan's own constants (the launches are never handed out): the eager path's host time."""
    dev = plan.device
    (o_shape, o_stride, o_dtype), (l_shape, l_stride, l_dtype) = plan.out, plan.lse
    out = torch.empty_strided(o_shape, o_stride, dtype=o_dtype, device=dev)
    lse = torch.empty_strided(l_shape, l_stride, dtype=l_dtype, device=dev)
    split = plan.split
    if split is None:
        return out, lse
    if plan.copy_lengths:
        cache_seqlens, cache_starts = _contiguous_lengths(cache_seqlens, cache_starts)
    if plan.merge is None:  # the split kernel writes the result itself, rounded once
        Launch(_split_kv_kernel, split[0],
               _split_tensors(q, k, v, cache_seqlens, block_table, q_positions, k_positions, out, lse, cache_starts)
               + split[1], split[2], split[3]).run()
        return out, lse
    partials = plan.partials
    o_part, lse_part = _partials(partials[0], partials[1], partials[2], partials[3], dev)
    Launch(_split_kv_kernel, split[0],
           _split_tensors(q, k, v, cache_seqlens, block_table, q_positions, k_positions, o_part, lse_part, cache_starts)
           + split[1], split[2], split[3]).run()
    kernel, m_grid, m_tail, m_constants, m_slot = plan.merge
    Launch(kernel, m_grid, (o_part, lse_part, out, lse) + m_tail, m_constants, m_slot).run()
    return out, lse


def plan_of(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, lse_dtype,
            num_splits, block_n, config, window, softcap, cache_starts) -> _Plan:
    """The :class:`_Plan` of a call of :func:`decode_launches` (its arguments, positional), built once per
    signature and kept in ``_PLANS``; a call with a tensor for a scalar argument is planned for itself only."""
    try:
        key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, v.shape, v.stride(), v.dtype,
               None if block_table is None else (block_table.shape, block_table.stride(), block_table.dtype),
               None if cache_seqlens is None else (cache_seqlens.dtype, cache_seqlens.stride()),
               None if cache_starts is None else (cache_starts.dtype, cache_starts.stride()),
               None if q_positions is None else (q_positions.shape, q_positions.stride(), q_positions.dtype),
               None if k_positions is None else (k_positions.shape, k_positions.stride(), k_positions.dtype),
               _scalar(softmax_scale), out_dtype, lse_dtype, _scalar(num_splits), _scalar(block_n), _scalar(window),
               _scalar(softcap), None if config is None else tuple(sorted(config.items())))
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument (a tensor scalar, a config value): planned for this call only
        key = plan = None
    if plan is None:
        plan = _plan(q, k, v, block_table=block_table, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale,
                     q_positions=q_positions, k_positions=k_positions, out_dtype=out_dtype, lse_dtype=lse_dtype,
                     num_splits=num_splits, block_n=block_n, config=config, window=window, softcap=softcap,
                     cache_starts=cache_starts)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = plan
    return plan


def _split_tensors(q, k, v, cache_seqlens, block_table, q_positions, k_positions, o, l, cache_starts) -> tuple:
    """The split kernel's tensor arguments, in its order, writing ``o`` and ``l``. An absent tensor is
    compile-time absent: q stands in for its pointer (never read)."""
    return (q, k, v, q if cache_seqlens is None else cache_seqlens, q if block_table is None else block_table,
            q if q_positions is None else q_positions, q if k_positions is None else k_positions, o, l,
            q if cache_starts is None else cache_starts)


def _contiguous_lengths(cache_seqlens, cache_starts) -> tuple:
    """cache_seqlens and cache_starts (either may be None) as contiguous tensors, each a copy only where it is a
    strided view (the kernel reads row b's value at offset b)."""
    return (None if cache_seqlens is None else cache_seqlens.contiguous(),
            None if cache_starts is None else cache_starts.contiguous())


def _scalar(x):
    """``x`` as part of a plan's key: a tensor (hashed by identity, not value) is unhashable here."""
    if isinstance(x, torch.Tensor):
        raise TypeError("a tensor scalar")
    return x


def _plan(q, k, v, *, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, lse_dtype,
          num_splits, block_n, config, window, softcap, cache_starts) -> _Plan:
    """The :class:`_Plan` of a call of :func:`decode_launches` (its arguments): reads the tensors' shapes,
    strides, dtypes and device only."""
    b, sq, hq, d = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    page = 0 if block_table is None else k.shape[1]
    n = k.shape[1] if block_table is None else block_table.shape[1] * page
    g = hq // hkv
    cfg = decode_config(d, g * sq, q.dtype, paged=block_table is not None, headdim_v=dv)
    cfg.update(config or {})
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dev = q.device
    out_spec = ((b, sq, hq, dv), _contiguous((b, sq, hq, dv)), q.dtype if out_dtype is None else out_dtype)
    if lse_dtype not in (None, torch.float32, torch.float64):
        raise TypeError(f"lse_dtype must be torch.float32, torch.float64 or None, got {lse_dtype!r}")
    lse_spec = ((b, hq, sq), _contiguous((b, hq, sq)), torch.float32 if lse_dtype is None else lse_dtype)
    if b * sq * hq == 0:
        return _Plan(out_spec, lse_spec, None, None, None, dev)
    causal = q_positions is not None
    copy_lengths = any(t is not None and not t.is_contiguous() for t in (cache_seqlens, cache_starts))
    if window is not None and not causal:
        raise ValueError("window needs q_positions and k_positions (a bound on global key positions)")
    if causal:
        s_qp = q_positions.stride()
        s_kp = (k_positions.stride(0), k_positions.stride(1)) if k_positions.dim() == 2 else (0, k_positions.stride(0))
    else:
        s_qp = s_kp = (0, 0)
    s_bt = block_table.stride(0) if block_table is not None else 0

    m_blocks = cdiv(g * sq, cfg["BLOCK_M"])
    programs = b * hkv * m_blocks
    constants = {
        "HEAD_DIM": d, "BLOCK_D": cfg["BLOCK_D"], "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
        "PAGE": page, "CAUSAL": causal, "HAS_SEQLENS": cache_seqlens is not None,
        "EXACT_INPUTS": INTERPRETED or q.dtype == torch.float32, "DOT_PRECISION": cfg["DOT_PRECISION"],
        "HEAD_DIM_V": dv, "BLOCK_DV": cfg["BLOCK_DV"], "HAS_STARTS": cache_starts is not None,
        "WINDOW": window is not None, "SOFTCAP": softcap is not None,
        "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
    }

    def tail(o_stride, l_stride, chunk):
        # what follows the tensors of a split launch writing o, l (contiguous, of these strides): the final
        # (out, lse), or the partials with a leading split dimension
        s_op, s_lp = (o_stride[0], l_stride[0]) if len(o_stride) == 5 else (0, 0)
        return (scale, 0 if window is None else min(int(window), 2 ** 31 - 1),
                1.0 if softcap is None else float(softcap),
                n, sq, g, hkv, chunk, m_blocks,
                *q.stride(), *k.stride(), *v.stride(), s_bt, *s_qp, *s_kp,
                s_op, *o_stride[-4:], s_lp, *l_stride[-3:])

    tiles = cdiv(max(n, 1), cfg["BLOCK_N"])
    out_stride, lse_stride = out_spec[1], lse_spec[1]
    if num_splits is None:
        # The compiled kernel is the same for any split count (chunk is a runtime argument); the
        # wave is read from the kernel compiled for this call's tensors.
        out = torch.empty_strided(out_spec[0], out_spec[1], dtype=out_spec[2], device=dev)
        lse = torch.empty_strided(lse_spec[0], lse_spec[1], dtype=lse_spec[2], device=dev)
        probe = Launch(_split_kv_kernel, (programs, 1),
                       _split_tensors(q, k, v, cache_seqlens, block_table, q_positions, k_positions, out, lse,
                                      cache_starts) + tail(out_stride, lse_stride, n), constants)
        num_splits = choose_num_splits(tiles, programs, waves(probe, dev))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    chunk = cdiv(tiles, num_splits) * cfg["BLOCK_N"]
    num_splits = cdiv(max(n, 1), chunk)
    if num_splits == 1:
        return _Plan(out_spec, lse_spec, None,
                     ((programs, 1), tail(out_stride, lse_stride, chunk), constants, FastSlot(10)), None, dev,
                     copy_lengths)
    # the partials: o (P, B, Sq, Hq, Dv) fp32, lse (P, B, Hq, Sq) fp64, contiguous (:func:`_partials`)
    o_shape, l_shape = (num_splits, b, sq, hq, dv), (num_splits, b, hq, sq)
    o_stride, l_stride = _contiguous(o_shape), _contiguous(l_shape)
    merge = merge_plan(o_shape, o_stride, l_stride, out_stride, lse_stride) + (FastSlot(4),)
    return _Plan(out_spec, lse_spec, (o_shape, o_stride, l_shape, l_stride),
                 ((programs, num_splits), tail(o_stride, l_stride, chunk), constants, FastSlot(10)), merge, dev,
                 copy_lengths)

