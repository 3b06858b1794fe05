"""Triton kernel: split-KV flash decoding that returns the partial state ``(out, lse)``.

Invariant: one program owns one (batch row, KV head, block of query rows, KV split). Its
query rows are *all* the query heads of that KV head's GQA group times the ``Sq`` query
tokens, so every K/V tile is read from memory exactly once per split, whatever Hq/Hkv is
(MQA included); KV is never expanded. Each split keeps flash-attention's online softmax in
base 2 (``exp2`` of scores pre-multiplied by ``log2 e``) and converts to the natural log at
its boundary, then the splits are combined by the one merge kernel in ``merge.py``: a split
is a partial state exactly like a CP rank's shard. Values are converted to float32 right
after every ``tl.load`` (the interpreter computes bf16 arithmetic wrongly; on GPU the
bf16/fp16 -> fp32 -> tf32 path is lossless for the inputs), and partials travel in fp32.

Only plain pointer arithmetic and APIs present in Triton 3.6 through 3.9 are used (no
``tl.make_block_ptr``, no TMA descriptors), so the same source compiles on the GPU
machine's Triton 3.6 and the pinned 3.7 (``tests/test_aot.py`` checks both facts).

Kernel tier only: no torch.distributed, no backend choice (that is ``ops.py``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .merge import Launch, merge_launch

__all__ = ["flash_decode", "decode_launches", "decode_config", "choose_num_splits", "SUPPORTED_DTYPES", "MAX_HEADDIM",
           "MAX_BLOCK_M"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADDIM = 256
MAX_BLOCK_M = 64
"""Query rows (GQA group x Sq) per program; larger groups are tiled over the grid."""
MAX_SPLITS = 128
MIN_BLOCKS_PER_SPLIT = 4
"""A split reads at least this many KV tiles, so the combine pass stays small next to the reads."""
PROGRAMS_PER_SM = 4
"""Target programs per SM: enough loads in flight to saturate HBM on A100/H100-class GPUs."""
INTERPRETER_SMS = 4
"""Stand-in SM count on CPU (interpreter), so tests exercise the multi-split path."""
LOG2E = 1.4426950408889634


# Integer arguments that vary between calls and are sometimes 1 (Sq, G, Hkv, ...) are not
# specialised on: each would double the set of compiled variants (and the AOT check) for no
# speed. K/V strides and the innermost strides stay specialised -- stride 1 and 16-element
# alignment are what let Triton vectorise the K/V loads, the only loads that matter.
_DECODE_GENERIC = [
    "N", "D", "SQ", "G", "HKV", "chunk", "num_m_blocks", "s_qb", "s_qs", "s_qh",
    "s_qpb", "s_qps", "s_kpb", "s_kpn", "s_op", "s_ob", "s_os", "s_oh", "s_lp", "s_lb", "s_lh",
    "s_ls", "causal",
]


@triton.jit(do_not_specialize=_DECODE_GENERIC)
def _split_kv_kernel(
    Q, K, V, SEQLENS, QPOS, KPOS, O, LSE,
    scale_log2,
    N, D, SQ, G, HKV, chunk, num_m_blocks,
    s_qb, s_qs, s_qh, s_qd,
    s_kb, s_kn, s_kh, s_kd,
    s_vb, s_vn, s_vh, s_vd,
    s_qpb, s_qps,
    s_kpb, s_kpn,
    s_op, s_ob, s_os, s_oh, s_od,
    s_lp, s_lb, s_lh, s_ls,
    causal,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % num_m_blocks
    bh = pid // num_m_blocks
    b = bh // HKV
    hkv = bh % HKV
    b64 = b.to(tl.int64)

    # Keys [start, end) of this split that row b holds (cache_seqlens clamped to [0, N]).
    seqlen = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), N)
    start = split * chunk
    end = tl.minimum(start + chunk, seqlen)

    # Query rows r = g * SQ + s: query head hkv * G + g, query token s.
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < G * SQ
    g = offs_m // SQ
    s = offs_m % SQ
    head = hkv * G + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptrs = (Q + b64 * s_qb + s[:, None].to(tl.int64) * s_qs + head[:, None].to(tl.int64) * s_qh
              + offs_d[None, :] * s_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # causal is a runtime flag, not a constexpr: it halves the set of compiled configurations.
    # Without it the position pointers are a one-element placeholder read with stride 0 (an
    # L1 hit, nothing next to the K/V tiles) and the position test is switched off.
    qpos = tl.load(QPOS + b64 * s_qpb + s * s_qps, mask=row_ok, other=0)
    no_mask = causal == 0

    k_base = K + b64 * s_kb + hkv.to(tl.int64) * s_kh
    v_base = V + b64 * s_vb + hkv.to(tl.int64) * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        n64 = offs_n.to(tl.int64)
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + n64[:, None] * s_kn + offs_d[None, :] * s_kd, mask=kv_mask, other=0.0)
        k = k.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        kpos = tl.load(KPOS + b64 * s_kpb + n64 * s_kpn, mask=n_ok, other=0)
        visible = n_ok[None, :] & ((kpos[None, :] <= qpos[:, None]) | no_mask)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row with no visible key so far keeps m = -inf; rescale against 0 to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + n64[:, None] * s_vn + offs_d[None, :] * s_vd, mask=kv_mask, other=0.0)
        v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    # Base 2 inside, natural log at the boundary: lse = ln 2 * (m + log2 l).
    lse = tl.where(has, (tl.where(has, m_i, 0.0) + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    split64 = split.to(tl.int64)
    o_ptrs = (O + split64 * s_op + b64 * s_ob + s[:, None].to(tl.int64) * s_os
              + head[:, None].to(tl.int64) * s_oh + offs_d[None, :] * s_od)
    tl.store(o_ptrs, out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + split64 * s_lp + b64 * s_lb + head * s_lh + s * s_ls, lse, mask=row_ok)


@functools.lru_cache(maxsize=None)
def _no_positions(device: torch.device) -> torch.Tensor:
    """A one-element int64 placeholder passed as the position pointers of non-causal calls."""
    return torch.zeros(1, dtype=torch.int64, device=device)


def decode_config(headdim: int, rows: int, dtype: torch.dtype) -> dict:
    """Launch constants for one call: tile sizes, warps, stages and the dot precision.

    headdim: D; rows: query rows per KV head (GQA group size x Sq). Head dims that are not a
    power of two (80, 96) are padded to the next one and masked; head dims below 64 are
    padded to 64. Query rows come in tiles of 16 (decode with GQA groups up to 16) or, for
    larger groups and several query tokens in fp16/bf16, of 64 / 32 / 16 rows for head dims
    64 / 128 / 256. These few choices keep the set of configurations
    small enough that ``tests/test_aot.py`` compiles every one of them for sm_80 and sm_90.
    """
    if not 1 <= headdim <= MAX_HEADDIM:
        raise ValueError(f"flash_decode kernel supports head dims 1..{MAX_HEADDIM}, got {headdim}")
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"flash_decode kernel supports {SUPPORTED_DTYPES}, got {dtype}")
    block_d = max(64, triton.next_power_of_2(headdim))
    # fp32 input (not the performance path) keeps 16-row tiles: a 64 x 256 fp32 query tile
    # split for tf32x3 overflows an A100's shared memory.
    # Larger groups take 64 x 64, 32 x 128 (or 16 x 256) query tiles: wider ones spill.
    block_m = 16 if rows <= 16 or dtype == torch.float32 else max(16, MAX_BLOCK_M * 64 // block_d)
    return {
        "BLOCK_M": block_m,
        # K/V tiles of BLOCK_N x BLOCK_D live in registers as fp32: halve them for wide
        # tiles and for fp32 input (whose shared-memory staging is twice as large).
        "BLOCK_N": (64 if block_d * block_m <= 128 * 16 else 32) // (2 if dtype == torch.float32 else 1),
        "BLOCK_D": block_d,
        # fp16/bf16 converted to fp32 are exact in tf32; fp32 input needs the 3-pass tf32
        # split (fp32-accurate on tensor cores; "ieee" spills registers at these tile sizes).
        "DOT_PRECISION": "tf32x3" if dtype == torch.float32 else "tf32",
        "num_warps": 4 if block_m * block_d < 64 * 64 else 8,
        "num_stages": 2,
    }


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a stand-in constant for CPU tensors/interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_num_splits(seqlen_k: int, programs: int, sms: int, block_n: int) -> int:
    """KV splits per (row, KV head): fill ``PROGRAMS_PER_SM * sms`` programs, but give each
    split at least ``MIN_BLOCKS_PER_SPLIT`` tiles of ``block_n`` keys and at most ``MAX_SPLITS``.

    seqlen_k: N (the cache length, not the data-dependent cache_seqlens, so the launch needs
    no device sync and can be captured in a CUDA graph); programs: B * Hkv * query-row blocks.
    """
    tiles = triton.cdiv(max(seqlen_k, 1), block_n)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, max(programs, 1))
    return max(1, min(want, triton.cdiv(tiles, MIN_BLOCKS_PER_SPLIT), MAX_SPLITS))


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
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV flash decoding of q over one KV shard (inputs already validated by ``ops``).

    q: (batch, seqlen_q, nheads_q, headdim) fp16/bf16/fp32, any strides
    k, v: (batch, seqlen_k, nheads_kv, headdim), any strides (e.g. a slice of a larger cache)
    cache_seqlens: (batch,) int32, valid keys per row (0 allowed; clamped to [0, seqlen_k])
    q_positions: (batch, seqlen_q), k_positions: (batch, seqlen_k) or (seqlen_k,) integers;
        key j is visible to query i iff k_pos[j] <= q_pos[i]
    num_splits, block_n: overrides of the heuristics (tests, benchmarks)
    block_table: not yet supported by this kernel (the torch path has it)
    out_dtype: dtype of out (default q.dtype)
    returns out: (batch, seqlen_q, nheads_q, headdim) in out_dtype, zero where no key is visible
            lse: (batch, nheads_q, seqlen_q) float32, natural log, -inf where no key is visible
    """
    if block_table is not None:
        raise NotImplementedError("the Triton decode kernel does not take a block_table yet; use backend='torch'")
    out, lse, launches = decode_launches(
        q, k, v, cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, q_positions=q_positions,
        k_positions=k_positions, num_splits=num_splits, block_n=block_n, out_dtype=out_dtype,
    )
    for launch in launches:
        launch.run()
    return out, lse


def decode_launches(q, k, v, *, cache_seqlens=None, softmax_scale=None, q_positions=None,
                    k_positions=None, num_splits=None, block_n=None, out_dtype=None):
    """Allocate the outputs and build (without running) the kernel launches of one decode call.

    Same arguments and shapes as :func:`flash_decode`; returns ``(out, lse, launches)``.
    Split out so that ``tests/test_aot.py`` compiles exactly what a real call would launch.
    """
    b, sq, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    cfg = decode_config(d, g * sq, q.dtype)
    if block_n is not None:
        cfg["BLOCK_N"] = block_n
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    dev = q.device
    out = torch.empty((b, sq, hq, d), dtype=q.dtype if out_dtype is None else out_dtype, device=dev)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=dev)
    if b * sq * hq == 0:
        return out, lse, []
    if cache_seqlens is None:
        cache_seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    causal = q_positions is not None
    if causal != 0:
        q_pos = q_positions.to(torch.int64)
        k_pos = k_positions.to(torch.int64)
        k_pos = k_pos if k_pos.dim() == 2 else k_pos[None, :]
        s_qp = q_pos.stride()
        s_kp = (k_pos.stride(0) if k_pos.shape[0] == b and b > 1 else 0, k_pos.stride(1))
    else:
        q_pos = k_pos = _no_positions(dev)
        s_qp = s_kp = (0, 0)

    m_blocks = triton.cdiv(g * sq, cfg["BLOCK_M"])
    programs = b * hkv * m_blocks
    if num_splits is None:
        num_splits = choose_num_splits(n, programs, sm_count(dev), cfg["BLOCK_N"])
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    chunk = triton.cdiv(triton.cdiv(max(n, 1), num_splits), cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    num_splits = triton.cdiv(max(n, 1), chunk)

    # Partials are always fp32, also for a single split (then the combine is just the cast to
    # q.dtype): one pointer type per input dtype keeps the compiled set small (test_aot.py).
    o_part = torch.empty((num_splits, b, sq, hq, d), dtype=torch.float32, device=dev)
    lse_part = torch.empty((num_splits, b, hq, sq), dtype=torch.float32, device=dev)

    split = Launch(
        _split_kv_kernel, (programs, num_splits),
        (q, k, v, cache_seqlens, q_pos, k_pos, o_part, lse_part,
         scale * LOG2E,
         n, d, sq, g, hkv, chunk, m_blocks,
         *q.stride(), *k.stride(), *v.stride(), *s_qp, *s_kp, *o_part.stride(), *lse_part.stride(),
         int(causal)),
        {"DOT_PRECISION": cfg["DOT_PRECISION"], "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"],
         "BLOCK_D": cfg["BLOCK_D"], "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
    )
    return out, lse, [split, merge_launch(o_part, lse_part, out, lse)]
