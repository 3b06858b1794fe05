"""Local prefill attention on fused kernels that return the log-sum-exp: one query chunk over one KV block.

Invariant: :func:`prefill_attention` returns the same partial state as
``reference.partial_attention(q, k, v, q_positions=..., k_positions=...)`` -- causal by global
position (key j visible to query i iff ``k_pos[j] <= q_pos[i]``), negative positions are
padding -- but computes it with fused attention kernels that never hold more than one
kernel tile of scores, instead of a decode kernel built for a handful of queries.

Why it lives here (beside ``torch_decode.py``, below ``ops``): it is a backend of one local
op, like the decode paths; ``ops.prefill_attention`` validates and calls it. It imports
``ops`` lazily only for its exact fallback (the decode path), never a tier above.

How: the fused kernels know two masks, none and causal (top-left aligned, one key per query
step). Positions are sorted (a no-op for the prompt chunks of every CP layout, which hold
ascending position runs) so that the keys a query sees are a *prefix* of the sorted keys of
length ``cnt[i] = #{j : k_pos[j] <= q_pos[i]}``, non-decreasing in i. :func:`plan` cuts the
rows into segments of that staircase:

* flat (``cnt`` constant ``c``): one unmasked call over keys ``[0, c)``, or nothing (``c = 0``);
* unit slope (``cnt[i] = c0 + i``, a diagonal block, with any offset): an unmasked call over
  keys ``[0, c0 - 1)`` and a causal call over the next ``L`` keys, merged;
* ragged (short runs: random position sets, irregular interleavings): tiles of at most
  ``tile`` rows, an unmasked call over the keys every row of the tile sees and an explicit
  mask only over the keys between the tile's first and last row.

A head/tail CP layout's pair of chunks is therefore one causal call on its own block and one
unmasked call (or a skip) on every other block.

Precision (docs/design.md §1; docs/kernels.md "Precision at large logits"): the kernels form
``lse = m + log l`` in float32, and a merge weighs a partial by ``exp(lse_u - M)``, so the
lse's rounding ``|lse| * 2^-24`` becomes a relative error of the weights. While every row of
a piece has ``|lse| < lse_bound`` (default :data:`LSE_BOUND` = 64 for float32: a rounding of at
most 2^-19) the float32 lse is used as it is. A piece with larger rows is computed again with each
row's scores shifted by ``c`` = its first-pass lse (an additive per-row mask on CPU), so the
kernel forms only ``lse - c`` (|.| ~ one rounding of c) in float32 and ``c + (lse - c)`` is
added in float64: exact at any magnitude, at twice the cost for such pieces only. Kernels
that take no per-row bias (CUDA) recompute such a piece on the exact decode path instead.
The returned lse is float64 either way.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch

from . import contract, reference

__all__ = [
    "prefill_attention", "select_kernel", "plan", "Segment", "KERNELS", "LSE_BOUND", "LSE_BOUND_16BIT",
    "MIN_RUN", "TILE", "CUDNN_ARCHS", "CUDNN_MAX_HEAD_DIM", "CUDNN_MIN_FLOP",
]

KERNELS = ("cpu_flash", "cuda_flash", "cuda_efficient", "flash_attn", "cuda_cudnn", "decode")
"""Kernels a local prefill step may run: torch's fused CPU flash attention, torch's CUDA flash and
memory-efficient attention (aten ops), flash-attn's ``flash_attn_func`` when importable, torch's cuDNN
attention (``aten._scaled_dot_product_cudnn_attention`` with its lse; the default where
:data:`CUDNN_ARCHS` says it was measured faster, for pieces of at least :data:`CUDNN_MIN_FLOP`), and the
exact decode path (``ops.flash_decode`` with positions, float64 lse) as the fallback."""

CUDNN_ARCHS = (9,)
"""Compute-capability majors where a prefill defaults to cuDNN attention, from a measurement: on one H200
(sm90; torch 2.11, CUDA 13, 2026-12-04) bf16 causal attention ran at 573-650 TFLOP/s on torch's cuDNN
kernel and 248-350 TFLOP/s on its FA2 kernel (``aten._flash_attention_forward``) at 16K-64K tokens, with
cuDNN's lse within 1.5e-6 of float64. Other GPUs keep flash until a run of ``benchmarks.prefill_gpu``
measures them."""

CUDNN_MAX_HEAD_DIM = 128
"""Largest head dim the cuDNN default is used for (a multiple of 8 up to it; larger ones stay on flash)."""

CUDNN_MIN_FLOP = 1e12
"""Smallest piece (4 * batch * query heads * head dim * visible scores) the ``cuda_cudnn`` kernel runs on
cuDNN; smaller pieces run on flash. cuDNN builds a plan for each new shape (tens of ms of host time,
measured on the H200); at the measured rates a piece of this size saves 1.3-2 ms per call, so the plan is
repaid within one prompt by a model of ~32 layers (every layer calls the same shapes), and a smaller piece
would spend more on planning than it saves."""

LSE_BOUND = 64.0
"""A float32 piece whose rows all have |lse| below this is used without the shifted second pass:
its lse's rounding is then at most 2^-19 (1.9e-6), a few times the fused kernel's own lse error
(~4e-7 measured)."""

LSE_BOUND_16BIT = 4096.0
"""The same for fp16/bf16 kernels: rounding at most 2^-13, far below one rounding of the 16-bit output."""

MIN_RUN = 8
"""Shortest flat or diagonal run of rows given its own kernel calls; shorter ones join a ragged tile."""

TILE = 256
"""Most rows of one ragged tile (bounds its explicit mask to TILE x block keys)."""

_NEG_INF = float("-inf")


def select_kernel(device: torch.device | str, dtype: torch.dtype, head_dim: int, *,
                  head_dim_v: int | None = None, window: int | None = None, softcap: float | None = None,
                  flash_attn_importable: bool | None = None, capability: tuple[int, int] | None = None) -> str:
    """The kernel a local prefill step runs for (device, dtype, head dims, variants); one of :data:`KERNELS`.

    This is the one prefill kernel choice of the package (``ops.prefill_kernel`` adds a caller's
    forced choice; the CP prefill of the decode tier asks it, never decides itself):

    * a sliding window, soft-capping, or V with another head dim than K (MLA): ``decode``, the
      exact decode path with positions (the fused kernels take none of them);
    * CPU, any floating dtype: ``cpu_flash`` (``aten._scaled_dot_product_flash_attention_for_cpu``;
      GQA natively, lse float32, float64 for float64 input);
    * CUDA fp16/bf16, head dim a multiple of 8 up to :data:`CUDNN_MAX_HEAD_DIM`, on a GPU whose
      compute capability is in the measured table :data:`CUDNN_ARCHS` (Hopper): ``cuda_cudnn`` (its
      small pieces run on flash, :data:`CUDNN_MIN_FLOP`; a GPU where cuDNN's first call disagrees
      with flash runs flash throughout and says so once);
    * other CUDA fp16/bf16, head dim a multiple of 8 up to 256: ``flash_attn`` when the package
      imports, else ``cuda_flash`` (``aten._flash_attention_forward``, GQA natively);
    * CUDA fp32 (or a head dim flash does not take) up to 256: ``cuda_efficient``
      (``aten._efficient_attention_forward``; equal heads only, so GQA folds the query heads of a
      KV head into its batch axis over stride-0 KV: no copy);
    * anything else (float64 on CUDA, head dim > 256): ``decode``.

    capability: the CUDA device's (major, minor); default: asked of the device (none without CUDA).
    """
    if unfused_variants(head_dim, head_dim_v, window, softcap):
        return "decode"
    kind = torch.device(device).type
    if kind == "cpu":
        return "cpu_flash"
    if kind != "cuda" or dtype not in (torch.float16, torch.bfloat16, torch.float32) or head_dim > 256:
        return "decode"
    if dtype != torch.float32 and head_dim % 8 == 0:
        if capability is None:
            capability = _capability(device)
        if capability is not None and capability[0] in CUDNN_ARCHS and head_dim <= CUDNN_MAX_HEAD_DIM:
            return "cuda_cudnn"
        return _flash_kernel(flash_attn_importable)
    return "cuda_efficient"


def _flash_kernel(flash_attn_importable: bool | None = None) -> str:
    if flash_attn_importable is None:
        flash_attn_importable = _flash_attn_func() is not None
    return "flash_attn" if flash_attn_importable else "cuda_flash"


def _capability(device) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(torch.device(device))


def unfused_variants(head_dim: int, head_dim_v: int | None, window, softcap) -> list[str]:
    """The variants of a prefill step no fused kernel takes (each routes it to the exact path), by name."""
    return [name for name, on in (("a sliding window", window is not None), ("soft-capping", softcap is not None),
                                  ("a V head dim other than K's", head_dim_v is not None and head_dim_v != head_dim))
            if on]


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func  # optional: the package may be absent
    except Exception:  # noqa: BLE001 -- a broken install is as good as none
        return None
    return flash_attn_func


@functools.lru_cache(maxsize=None)
def _cudnn_agrees(device: str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether cuDNN attention, on its first call for (device, dtype, head dim), gives flash's output and
    lse on a small causal GQA piece (64 queries, 2 query heads over 1 KV head). The cuDNN default rests on
    one GPU's measurement; a torch, cuDNN or GPU where the op returns something else (another lse layout,
    another causal alignment) or raises gets flash for all its pieces and one warning, not a wrong answer.
    One host read per (device, dtype, head dim) in the process."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, h, head_dim, generator=g).to(device=device, dtype=dtype) for h in (2, 1, 1))
    flash = _flash_kernel()
    scale = head_dim ** -0.5
    try:
        out, lse = _LAUNCH["cuda_cudnn"](q, k, v, scale, True, None)
        want_out, want_lse = _LAUNCH[flash](q, k, v, scale, True, None)
        d_out = float((out.float() - want_out.float()).abs().max())
        d_lse = float((lse.float().reshape(want_lse.shape) - want_lse.float()).abs().max())
        # bounds of a few 16-bit roundings of |out| < 4 and of float32 lse; a wrong mask or layout is off by O(1)
        problem = None if d_out <= 0.1 and d_lse <= 1e-2 else \
            f"differs from {flash} (max |d out| {d_out:.3g}, max |d lse| {d_lse:.3g})"
    except Exception as e:  # noqa: BLE001 -- any failure of the op means: do not use it here
        problem = f"raised {type(e).__name__}: {str(e)[:200]}"
    if problem is not None:
        warnings.warn(f"prefill: cuDNN attention on {device} ({dtype}, head dim {head_dim}) {problem} on a check "
                      f"piece; prefill pieces run on {flash} instead", RuntimeWarning, stacklevel=2)
    return problem is None


# ---------------------------------------------------------------------------------------------
# The plan: which kernel calls cover which rows and keys of the sorted staircase.


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of the sorted queries and how their visible keys are covered."""

    kind: Literal["empty", "flat", "unit", "ragged"]
    """empty: no key visible; flat: every row sees keys [0, full); unit: row r of the segment
    sees keys [0, full + 1 + r) (causal over keys [full, full + rows)); ragged: row r sees
    keys [0, cnt[start + r]) (unmasked over [0, full), masked over [full, last))."""
    start: int
    stop: int
    full: int
    """Keys [0, full) are visible to every row of the segment (an unmasked call when > 0)."""
    last: int = 0
    """ragged: one past the last key any row sees (the masked call covers [full, last))."""

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _run_ends(values: torch.Tensor) -> list[int]:
    """For each index i, one past the last index of the run of equal values containing i."""
    n = values.numel()
    starts = torch.ones(n, dtype=torch.bool)
    starts[1:] = values[1:] != values[:-1]
    run = torch.cumsum(starts.to(torch.int64), 0) - 1
    ends = torch.nonzero(starts).flatten()[1:].tolist() + [n]
    return [ends[r] for r in run.tolist()]


def plan(cnt: torch.Tensor, *, min_run: int = MIN_RUN, tile: int = TILE) -> list[Segment]:
    """Cut the staircase ``cnt`` (sorted query i sees the first ``cnt[i]`` sorted keys;
    non-decreasing, (L,) int64) into segments (module docstring). Greedy: at each row take the
    longer of the flat and the unit-slope run starting there when it has ``min_run`` rows or
    more, else add rows to a ragged tile of at most about ``tile`` rows."""
    n = cnt.numel()
    if n == 0:
        return []
    cnt = cnt.to(torch.int64).cpu()
    end_f = _run_ends(cnt)
    end_u = _run_ends(cnt - torch.arange(n))
    c = cnt.tolist()
    segments: list[Segment] = []
    ragged = None

    def close_ragged(stop):
        lo, hi = c[ragged], c[stop - 1]
        if hi == lo:
            segments.append(Segment("flat" if lo else "empty", ragged, stop, lo))
        else:
            segments.append(Segment("ragged", ragged, stop, lo, hi))

    i = 0
    while i < n:
        lf, lu = end_f[i] - i, end_u[i] - i
        if max(lf, lu) >= min_run:
            if ragged is not None:
                close_ragged(i)
                ragged = None
            if lf >= lu:
                segments.append(Segment("flat" if c[i] else "empty", i, i + lf, c[i]))
                i += lf
            elif c[i] == 0:  # the unit run's first row sees nothing; the rest is a diagonal from key 0
                segments.append(Segment("empty", i, i + 1, 0))
                if lu > 1:
                    segments.append(Segment("unit", i + 1, i + lu, 0))
                i += lu
            else:
                segments.append(Segment("unit", i, i + lu, c[i] - 1))
                i += lu
        else:
            if ragged is None:
                ragged = i
            i += max(lf, lu)
            if i - ragged >= tile:
                close_ragged(i)
                ragged = None
    if ragged is not None:
        close_ragged(n)
    return segments


# ---------------------------------------------------------------------------------------------
# Kernel launchers: q (B, L, Hq, D), k, v (B, W, Hkv, D) -> out (B, L, Hq, D), lse (B, Hq, L).


def _cpu_flash(q, k, v, scale, causal, mask):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, causal, attn_mask=mask, scale=scale)
    return out.transpose(1, 2), lse


def _cuda_flash(q, k, v, scale, causal, mask):
    # Square causal pieces only: flash's causal is bottom-right aligned, equal to top-left here.
    assert mask is None, "cuda_flash takes no mask (masked pieces run on cuda_efficient)"
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, causal, False, scale=scale)[:2]
    return out, lse


def _cudnn_op(q, k, v, causal, scale):
    """torch's cuDNN attention with its lse: q (B, Hq, L, D), k, v (B, Hkv, W, D) -> out (B, Hq, L, D),
    lse (B, Hq, L) float32 (some releases return (B, Hq, L, 1)); causal from the top left."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)[:2]
    return out, lse


def _cuda_cudnn(q, k, v, scale, causal, mask, op=_cudnn_op):
    # Square causal pieces only: cuDNN's causal mask is top-left aligned, which equals the bottom-right
    # alignment the pieces mean only when queries and keys are the same span. GQA is passed as is.
    assert mask is None, "cuda_cudnn takes no mask (masked pieces run on cuda_efficient)"
    b, length, hq, _ = q.shape
    out, lse = op(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    return out.transpose(1, 2), lse.reshape(b, hq, length)


def _flash_attn(q, k, v, scale, causal, mask):
    assert mask is None, "flash_attn takes no mask (masked pieces run on cuda_efficient)"
    out, lse, _ = _flash_attn_func()(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    return out, lse


def _efficient_bias(mask, dtype, hkv, g):
    """(1 or Hq, L, W) additive mask -> the (g, Hkv, L, W) bias of the folded heads, in q's dtype,
    last dim contiguous and rows 16-aligned (the kernel's requirements; torch's SDPA pads the same
    way), shared across heads with stride 0 when the mask is."""
    h, length, w = mask.shape
    buf = torch.empty((h, length, -(-w // 16) * 16), dtype=dtype, device=mask.device)
    buf[..., :w] = mask
    bias = buf[..., :w]
    if h == 1:
        return bias.expand(g, hkv, length, w)
    return bias.view(hkv, g, length, w).permute(1, 0, 2, 3)


def _efficient_op(q, k, v, bias, causal, scale):
    """torch's memory-efficient kernel: q, k, v (B, S, H, D) with equal heads, last dim contiguous;
    bias (B, H, L, W) in q's dtype or None; causal from the top left (custom_mask_type 1).
    Returns out (B, L, H, D) and lse (B, H, L rounded up to a multiple of 32) float32."""
    return torch.ops.aten._efficient_attention_forward(
        q, k, v, bias, None, None, None, None, 0.0, 1 if causal else 0, True, scale=scale)[:2]


def _cuda_efficient(q, k, v, scale, causal, mask, op=_efficient_op):
    # Equal heads only: fold the g query heads of each KV head into the batch axis, one batch
    # row at a time, over KV expanded with stride 0 (no copy); the lse comes padded.
    b, length, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    outs, lses = [], []
    for i in range(b):
        qi = q[i].view(length, hkv, g, d).permute(2, 0, 1, 3)  # (g, L, Hkv, D): query head h*g + j at [j, :, h]
        ki = k[i].unsqueeze(0).expand(g, -1, -1, -1)
        vi = v[i].unsqueeze(0).expand(g, -1, -1, -1)
        bias = None if mask is None else _efficient_bias(mask[min(i, mask.shape[0] - 1)], q.dtype, hkv, g)
        out, lse = op(qi, ki, vi, bias, causal, scale)
        outs.append(out.permute(1, 2, 0, 3).reshape(length, hq, d))
        lses.append(lse[..., :length].permute(1, 0, 2).reshape(hq, length))
    return torch.stack(outs), torch.stack(lses)


_LAUNCH = {"cpu_flash": _cpu_flash, "cuda_flash": _cuda_flash, "cuda_efficient": _cuda_efficient,
           "flash_attn": _flash_attn, "cuda_cudnn": _cuda_cudnn}
_MASKLESS = ("cuda_flash", "flash_attn", "cuda_cudnn")
"""The fused kernels that take no mask: a ragged (masked) piece of theirs runs on ``cuda_efficient``."""


# ---------------------------------------------------------------------------------------------


def _sorted_order(pos: torch.Tensor):
    """Valid (>= 0) entries of one row's positions in ascending order: (index, sorted positions),
    index a slice when they already are a contiguous ascending run (no copy needed), else a tensor."""
    valid = pos >= 0
    nvalid = int(valid.sum())
    if nvalid == 0:
        return slice(0, 0), pos[:0]
    first = int(valid.to(torch.int8).argmax())
    run = pos[first:first + nvalid]
    if bool((run >= 0).all()) and (nvalid < 2 or bool((run[1:] >= run[:-1]).all())):
        return slice(first, first + nvalid), run
    idx = torch.nonzero(valid).flatten()
    order = torch.argsort(pos[idx], stable=True)
    idx = idx[order]
    return idx, pos[idx]


def _take(t: torch.Tensor, index) -> torch.Tensor:
    return t[:, index] if isinstance(index, slice) else t.index_select(1, index)


class _Runner:
    """Runs the pieces of one plan on one kernel, with the precision refinement of the module docstring."""

    def __init__(self, kernel, scale, bound, backend, acc, exact_attention, calls=None,
                 cudnn_min_flop=CUDNN_MIN_FLOP):
        self.kernel, self.scale, self.bound, self.backend, self.acc = kernel, scale, bound, backend, acc
        self.exact_attention = exact_attention
        self.calls = calls
        self.cudnn_min_flop = cudnn_min_flop

    def launcher(self, q, k, causal, masked) -> str:
        """The kernel one piece launches: a masked piece of a maskless kernel runs on the memory-efficient
        one; a ``cuda_cudnn`` piece below ``cudnn_min_flop`` (or where cuDNN failed its check) on flash."""
        if masked and self.kernel in _MASKLESS:
            return "cuda_efficient"
        if self.kernel == "cuda_cudnn":
            b, length, hq, d = q.shape
            flop = 4 * b * hq * d * length * k.shape[1] / (2 if causal else 1)
            if flop < self.cudnn_min_flop or not _cudnn_agrees(str(q.device), q.dtype, d):
                return _flash_kernel()
        return self.kernel

    def count(self, name: str) -> None:
        if self.calls is not None:
            self.calls[name] = self.calls.get(name, 0) + 1

    def piece(self, q, k, v, qpos, kpos, causal=False, visible=None):
        """Partial state of q (B, L, Hq, D) over k, v (B, W, Hkv, D): out acc dtype, lse float64.

        visible: (L, W) bool, the explicit mask of a ragged piece (None: unmasked or causal);
        qpos (L,), kpos (W,): the sorted positions, for the exact fallback."""
        if self.kernel == "decode":
            return self.exact(q, k, v, qpos, kpos)
        mdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        mask = None
        if visible is not None:
            mask = torch.zeros(visible.shape, dtype=mdtype, device=q.device).masked_fill_(~visible, _NEG_INF)
            mask = mask[None, None]
        name = self.launcher(q, k, causal, mask is not None)
        launch = _LAUNCH[name]
        self.count(name)
        out, lse = launch(q, k, v, self.scale, causal, mask)
        has = None if visible is None else visible.any(dim=1)  # rows with a visible key in this piece
        if lse.dtype != torch.float64:
            finite = lse if has is None else torch.where(has, lse, torch.zeros_like(lse))
            if bool((finite.abs() >= self.bound).any()):
                if self.kernel != "cpu_flash":  # no per-row bias on CUDA: the exact path
                    return self.exact(q, k, v, qpos, kpos)
                shift = finite.to(mdtype)  # (B, Hq, L): per-row scores shifted by c = first-pass lse
                smask = -shift[..., None] if mask is None else (mask - shift[..., None])
                self.count(name)
                out, lse2 = launch(q, k, v, self.scale, causal, smask)
                lse = shift.double() + lse2.double()
        lse = lse.double()
        out = out.to(self.acc)
        if has is not None:  # fully masked rows: the kernels return lse 0 (CPU) and out 0 or NaN
            out = torch.where(has[None, :, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
            lse = torch.where(has[None, None, :], lse, torch.full((), _NEG_INF, dtype=lse.dtype, device=lse.device))
        return out, lse

    def exact(self, q, k, v, qpos, kpos):
        self.count("decode")
        b = q.shape[0]
        qp = qpos[None, :].expand(b, -1)
        kp = kpos[None, :].expand(b, -1)
        return self.exact_attention(q, k, v, softmax_scale=self.scale, q_positions=qp, k_positions=kp,
                                    out_dtype=self.acc, lse_dtype=torch.float64, backend=self.backend)


def _run_plan(runner: _Runner, q, k, v, qs, ks, segments):
    """Each non-empty segment's partial state: (rows, out (B, L, Hq, D), lse (B, Hq, L)), rows a
    slice of the sorted queries."""
    for seg in segments:
        if seg.kind == "empty":
            continue
        r = slice(seg.start, seg.stop)
        qr, qpr = q[:, r], qs[r]
        parts = []
        if seg.full > 0:
            parts.append(runner.piece(qr, k[:, :seg.full], v[:, :seg.full], qpr, ks[:seg.full]))
        if seg.kind == "unit":
            kr = slice(seg.full, seg.full + seg.rows)
            parts.append(runner.piece(qr, k[:, kr], v[:, kr], qpr, ks[kr], causal=True))
        elif seg.kind == "ragged":
            kr = slice(seg.full, seg.last)
            cnt = torch.searchsorted(ks[kr].contiguous(), qpr.contiguous(), right=True)  # (L,) in [0, W]
            visible = torch.arange(seg.last - seg.full, device=q.device)[None, :] < cnt[:, None]
            parts.append(runner.piece(qr, k[:, kr], v[:, kr], qpr, ks[kr], visible=visible))
        if len(parts) == 1:
            yield r, parts[0][0], parts[0][1]
        else:
            yield r, *reference.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    softmax_scale: float | None = None,
    kernel: str | None = None,
    backend: str | None = None,
    lse_bound: float | None = None,
    min_run: int = MIN_RUN,
    tile: int = TILE,
    exact_attention=None,
    calls: dict | None = None,
    cudnn_min_flop: float = CUDNN_MIN_FLOP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a query chunk over one KV block, as a partial state (inputs validated by ``ops``).

    q: (batch, seqlen_q, nheads_q, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim)
    q_positions: (batch, seqlen_q), k_positions: (batch, seqlen_k) or (seqlen_k,) integers;
        key j visible to query i iff k_pos[j] <= q_pos[i]; negative = padding (a padded key is
        never visible, a padded query sees nothing)
    kernel: one of :data:`KERNELS` (default :func:`select_kernel`); backend: the decode backend
        the exact path uses (``ops.flash_decode``'s ``backend``)
    lse_bound: a piece with a row of |lse| >= lse_bound takes the shifted second pass (default
        :data:`LSE_BOUND`, :data:`LSE_BOUND_16BIT` for 16-bit input; float64 input never needs it)
    min_run, tile: the planner's knobs (:func:`plan`)
    exact_attention: the exact decode path (``ops.flash_decode``'s signature), for the pieces the
        fused kernels cannot form exactly; ``ops`` passes it in (this module sits below ``ops``)
    calls: a dict that counts the kernel launches by name (one of :data:`KERNELS`; the shifted
        second pass counts as a second launch), or None
    cudnn_min_flop: the ``cuda_cudnn`` kernel runs smaller pieces on flash (:data:`CUDNN_MIN_FLOP`;
        0 runs every unmasked piece on cuDNN, as a benchmark timing cuDNN itself wants)
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input), 0 where
            no key is visible; lse: (batch, nheads_q, seqlen_q) float64, natural log, -inf there
    """
    b, sq, hq, d = q.shape
    n = k.shape[1]
    acc = contract.acc_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    name = kernel if kernel is not None else select_kernel(q.device, q.dtype, d)
    if name not in KERNELS:
        raise ValueError(f"unknown prefill kernel {name!r}; expected one of {KERNELS}")
    if name == "cpu_flash" and q.dtype != acc:
        # 16-bit on CPU: compute in float32 (the CPU kernel accumulates in float32 anyway and its
        # 16-bit path is slower), so the partial's out is not rounded to 16 bits before the merge.
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
    # every kernel here wants a unit-stride head dim; the CPU one does not check it and silently reads the wrong
    # elements of a view like k[..., ::2] (a copy only for such inputs)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if lse_bound is None:
        lse_bound = LSE_BOUND_16BIT if q.dtype in (torch.float16, torch.bfloat16) else LSE_BOUND
    qpos = q_positions.to(torch.int64)
    kpos = (k_positions if k_positions.dim() == 2 else k_positions[None, :].expand(b, n)).to(torch.int64)
    shared = b == 1 or (bool((qpos == qpos[:1]).all()) and bool((kpos == kpos[:1]).all()))
    groups = [slice(0, b)] if shared else [slice(i, i + 1) for i in range(b)]
    if exact_attention is None:
        raise TypeError("fused_prefill.prefill_attention needs exact_attention (ops.prefill_attention passes "
                        "ops.flash_decode); call ops.prefill_attention")
    runner = _Runner(name, scale, lse_bound, backend, acc, exact_attention, calls, cudnn_min_flop)
    out = lse = None
    if sq and n:  # (the CPU kernel dies on an empty axis: never call it so)
        for rows in groups:
            qi, qs = _sorted_order(qpos[rows.start])
            ki, ks = _sorted_order(kpos[rows.start])
            if qs.numel() == 0 or ks.numel() == 0:
                continue
            qsel, ksel, vsel = _take(q[rows], qi), _take(k[rows], ki), _take(v[rows], ki)
            cnt = torch.searchsorted(ks.contiguous(), qs.contiguous(), right=True)
            results = list(_run_plan(runner, qsel, ksel, vsel, qs, ks, plan(cnt, min_run=min_run, tile=tile)))
            if shared and qi == slice(0, sq) and len(results) == 1 and results[0][0] == slice(0, sq):
                # one call covered every query: nothing to copy
                return results[0][1].contiguous(), results[0][2].contiguous()
            if out is None:
                out = torch.zeros((b, sq, hq, d), dtype=acc, device=q.device)
                lse = torch.full((b, hq, sq), _NEG_INF, dtype=torch.float64, device=q.device)
            for r, o, l in results:  # sorted rows r back to their places
                at = slice(qi.start + r.start, qi.start + r.stop) if isinstance(qi, slice) else qi[r]
                out[rows, at] = o
                lse[rows, :, at] = l
    if out is None:
        out = torch.zeros((b, sq, hq, d), dtype=acc, device=q.device)
        lse = torch.full((b, hq, sq), _NEG_INF, dtype=torch.float64, device=q.device)
    return out, lse
