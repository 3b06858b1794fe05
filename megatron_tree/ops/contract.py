"""The input contract of the local decode and the merge, and the dtype policy of partial states.

Invariant: every entry point that takes a partial attention's or a merge's inputs checks them
here, so one bad input gets one message wherever it enters (``ops``, the oracle in
``reference``, ``decode``); the checks raise ``TypeError``/``ValueError`` naming the argument,
what it was and what was expected. Checks that read tensor values (``by_value=True``) are for
host memory; on CUDA or while tracing they are skipped (the kernels clamp instead), since a
read there synchronises with the device every step.

The dtype policy: partial states accumulate and travel in float32 (float64 for float64 input,
:func:`acc_dtype`), and a partial lse may be asked in float64 (:func:`lse_acc_dtype`; why, in
``reference``'s module docstring).
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "acc_dtype", "check_decode_inputs", "check_cache_seqlens", "check_block_table", "check_merge_inputs",
    "check_sinks", "check_variants", "kv_length", "lse_acc_dtype", "no_backward", "LSE_DTYPES", "MAX_WINDOW",
    "softmax_scale_of", "check_softmax_scale",
]

LSE_DTYPES = (torch.float32, torch.float64)
"""Dtypes a partial state's lse may be asked in (``lse_dtype=``)."""
MAX_WINDOW = 2 ** 31 - 1
"""Largest sliding window (positions are compared as int32 in the kernel)."""


class _NoBackward(torch.autograd.Function):
    """Views of its first ``n`` tensors whose backward raises (:func:`no_backward`)."""

    @staticmethod
    def forward(ctx, what, n, *tensors):
        ctx.what = what
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.what} has no backward: megatron_tree's decode, merge and CP attention are inference only, and a "
            "gradient through them would be wrong (the kernels and collectives record none). Run the forward under "
            "torch.no_grad() or torch.inference_mode(); to train a transformers model, disable_tree_attention(model) "
            "first"
        )


def no_backward(what: str, outputs: tuple, inputs: tuple = ()) -> tuple:
    """``outputs`` of code with no backward (the ops' kernels, the CP collectives) computed from ``inputs``: as they
    are, or, where gradients are being recorded for any of them, views whose backward raises a RuntimeError naming
    ``what`` -- so a backward through them is an error, not a silently wrong (or silently missing) gradient, even
    where the outputs came out of a collective detached from the inputs. Free when gradients are off."""
    tensors = [t for t in (*outputs, *inputs) if isinstance(t, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return tuple(outputs)
    return _NoBackward.apply(what, len(outputs), *outputs, *(t for t in inputs if isinstance(t, torch.Tensor)))


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype partial states accumulate and travel in: float64 for float64 input, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def lse_acc_dtype(lse_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The lse dtype of a partial state: ``lse_dtype`` when given, else :func:`acc_dtype` of ``dtype``;
    never narrower than the accumulation dtype (float64 input keeps a float64 lse)."""
    acc = acc_dtype(dtype)
    if lse_dtype is None:
        return acc
    if lse_dtype not in LSE_DTYPES:
        raise TypeError(f"lse_dtype must be one of {LSE_DTYPES} or None, got {lse_dtype!r}")
    return torch.promote_types(lse_dtype, acc)


def softmax_scale_of(softmax_scale, headdim: int) -> float:
    """The factor a kernel multiplies the scores by: ``softmax_scale``, or ``1/sqrt(headdim)`` for ``None``
    (the expression every backend and the reference use, so ``None`` and that value are one setting)."""
    return float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(headdim)


def check_softmax_scale(softmax_scale) -> None:
    """softmax_scale: None (``1/sqrt(headdim)``) or a finite real number. A NaN or infinite scale makes every
    score NaN or infinite, an answer no caller means; a NaN one also never equals itself, so ranks comparing
    their settings could never find it agreed. (A 0-d tensor is left to the kernel: reading its value here
    would synchronise a CUDA device with the host.)"""
    if softmax_scale is None or isinstance(softmax_scale, torch.Tensor):
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float (the factor the scores q.k are multiplied by) or None "
                        f"(1/sqrt(headdim)), got {type(softmax_scale).__name__} {softmax_scale!r}")
    if not math.isfinite(float(softmax_scale)):
        raise ValueError(f"softmax_scale must be finite, got {float(softmax_scale)}")


def kv_length(k: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
    """Keys per batch row that ``cache_seqlens`` and ``k_positions`` count: ``seqlen_k`` of a
    contiguous cache, ``max_blocks * block_size`` of a paged one."""
    return k.shape[1] if block_table is None else block_table.shape[1] * k.shape[1]


def check_decode_inputs(q, k, v, cache_seqlens=None, q_positions=None, k_positions=None, block_table=None,
                        out_dtype=None, *, by_value: bool = True, lse_dtype=None, window=None, softcap=None,
                        cache_starts=None, sinks=None, softmax_scale=None) -> None:
    """Validate the flash-decode contract and raise ``ValueError``/``TypeError`` naming the problem.

    q: (batch, seqlen_q, nheads_q, headdim); k: (batch, seqlen_k, nheads_kv, headdim), v: the
    same but for its own head dim (``headdim_v``; MLA), or with ``block_table`` (batch,
    max_blocks) int32 a paged cache (num_blocks, block_size, nheads_kv, headdim[_v]);
    cache_seqlens, cache_starts: (batch,) int32 in [0, N]; q_positions: (batch, seqlen_q) integer;
    k_positions: (batch, N) or (N,) integer, where N = :func:`kv_length`; out_dtype: a
    floating-point dtype or None; lse_dtype: float32, float64 or None; window, softcap, sinks,
    softmax_scale: :func:`check_variants`. ``by_value=False`` skips the checks that read tensor values (on CUDA
    or while tracing they would synchronise with the host every step).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            layout = "(batch, seqlen, heads, headdim)" if name == "q" or block_table is None else \
                "(num_blocks, block_size, heads, headdim) with a block_table"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}"
                        + _autocast_hint(q.device.type))
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must have the same shape but for the head dim (V's may differ, as in MLA), "
                         f"got k={tuple(k.shape)}, v={tuple(v.shape)}")
    b, _, hq, d = q.shape
    bk, _, hkv, dk = k.shape
    if block_table is None and bk != b:
        raise ValueError(f"batch size of k/v ({bk}) differs from q's ({b})")
    if dk != d:
        raise ValueError(f"head dim of k ({dk}) differs from q's ({d}): q and k share one head dim (v may have "
                         "its own)")
    if hkv == 0:
        raise ValueError(f"k and v must have at least one KV head, got shape {tuple(k.shape)} (heads is dim 2)")
    if hq % hkv != 0:
        raise ValueError(
            f"number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv})"
        )
    if d == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be at least 1, got q/k {d} and v {v.shape[3]}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype must be a floating-point torch.dtype or None, got {out_dtype!r}")
    lse_acc_dtype(lse_dtype, q.dtype)  # raises for anything but float32 / float64 / None
    if block_table is not None:
        _check_block_table_shape(block_table, b)  # before its width is read (a 1-D table has none)
    n = kv_length(k, block_table)
    if cache_seqlens is not None:
        check_cache_seqlens(cache_seqlens, b, n, q.device, by_value=by_value)
    if cache_starts is not None:
        check_cache_seqlens(cache_starts, b, n, q.device, by_value=by_value, name="cache_starts")
    if block_table is not None:
        check_block_table(block_table, b, k.shape[0], k.shape[1], cache_seqlens, q.device, by_value=by_value,
                          cache_starts=cache_starts)
    check_variants(q, window=window, softcap=softcap, sinks=sinks, positions=q_positions is not None,
                   softmax_scale=softmax_scale)
    if (q_positions is None) != (k_positions is None):
        raise ValueError("causal masking needs both q_positions and k_positions (or neither)")
    if q_positions is not None:
        if q_positions.dtype.is_floating_point or tuple(q_positions.shape) != (b, q.shape[1]):
            raise ValueError(
                f"q_positions must be an integer tensor of shape ({b}, {q.shape[1]}), "
                f"got {q_positions.dtype} {tuple(q_positions.shape)}"
            )
        if k_positions.dtype.is_floating_point or tuple(k_positions.shape) not in ((b, n), (n,)):
            what = " (max_blocks * block_size)" if block_table is not None else ""
            raise ValueError(
                f"k_positions must be an integer tensor of shape ({b}, {n}) or ({n},){what}, "
                f"got {k_positions.dtype} {tuple(k_positions.shape)}"
            )
        for name, t in (("q_positions", q_positions), ("k_positions", k_positions)):
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _autocast_hint(device_type: str) -> str:
    """The mismatch's likely cause when ``torch.autocast`` is on: autocast casts the projections' outputs (and
    rotary embeddings compute in float32), while these entry points are no autocast op and cast nothing."""
    if not torch.is_autocast_enabled(device_type):
        return ""
    return (f" -- torch.autocast({device_type!r}, dtype={torch.get_autocast_dtype(device_type)}) is on: it casts the "
            "projections that made q, k and v (a cache keeps its own dtype), but this function is no autocast op "
            "and casts nothing; cast q, k and v to one dtype first (as autocast does for scaled_dot_product_attention: "
            f"all to {torch.get_autocast_dtype(device_type)}). transformers models enabled by "
            "megatron_tree.hf.enable_tree_attention (mt.hf) cast them themselves")


def _used_blocks(block_table, block_size: int, cache_seqlens, cache_starts) -> torch.Tensor:
    """(batch, max_blocks) bool: the table entries a row reads -- those holding a key in
    ``[cache_starts[b], cache_seqlens[b])`` (from 0 / to the table's end when absent)."""
    batch, width = block_table.shape
    device = block_table.device
    lens = (cache_seqlens.to(torch.int64) if cache_seqlens is not None
            else torch.full((batch,), width * block_size, dtype=torch.int64, device=device))
    col = torch.arange(width, device=device)[None, :]
    used = col < (lens + block_size - 1)[:, None] // block_size
    if cache_starts is not None:
        starts = cache_starts.to(torch.int64)
        used &= (col >= (starts // block_size)[:, None]) & (starts < lens)[:, None]
    return used


def _check_block_table_shape(block_table, batch: int) -> None:
    """block_table: an int32 tensor of shape (batch, max_blocks)."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be an int32 tensor of shape ({batch}, max_blocks), "
                        f"got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must have shape ({batch}, max_blocks) (one row per batch row), "
                         f"got {tuple(block_table.shape)}")


def check_block_table(block_table, batch: int, num_blocks: int, block_size: int, cache_seqlens, device, *,
                      by_value: bool = True, cache_starts=None) -> None:
    """block_table: (batch, max_blocks) int32 on ``device``; with ``by_value`` also every entry a
    row uses (those holding a key in ``[cache_starts[b], cache_seqlens[b])``) in ``[0, num_blocks)``.

    Entries past a row's length, and wholly before its start, are never read (engines pad them
    with -1 or 0, and a sliding window may free the blocks it has passed).
    """
    _check_block_table_shape(block_table, batch)
    if block_table.device != device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {device}")
    if block_size < 1:
        raise ValueError(f"a paged cache needs blocks of at least one token, got block_size {block_size}")
    if not by_value or batch == 0 or block_table.shape[1] == 0:
        return
    used = _used_blocks(block_table, block_size, cache_seqlens, cache_starts)
    bad = used & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {col}] = {int(block_table[row, col])} is not a block of the cache "
            f"(expected 0 <= id < num_blocks = {num_blocks} for every block a row uses)"
        )


def check_cache_seqlens(cache_seqlens, batch: int, seqlen_k: int, device, *, by_value: bool = True,
                        name: str = "cache_seqlens") -> None:
    """cache_seqlens (or cache_starts, ``name``): (batch,) int32 on ``device``; with ``by_value``
    also every value in [0, seqlen_k].

    ``by_value=False`` skips reading the values (on CUDA or while tracing that would force a
    host-device synchronisation every step and break CUDA-graph capture).
    """
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor of shape ({batch},), got {type(cache_seqlens).__name__}")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cache_seqlens.dtype}")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},) (one per batch row), got {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != device:
        raise ValueError(f"{name} is on {cache_seqlens.device} but q is on {device}")
    if by_value and batch:
        check_cache_seqlens_values(cache_seqlens, seqlen_k, name)


def check_cache_seqlens_values(cache_seqlens, seqlen_k: int, name: str = "cache_seqlens") -> list:
    """Every value of ``cache_seqlens`` (a host tensor whose shape, dtype and device
    :func:`check_cache_seqlens` has checked) in [0, seqlen_k]: the per-call part of that check.
    Returns the values read (a list of ints), for a caller that needs them too."""
    values = cache_seqlens.tolist()  # one read of the values (host memory here), then plain ints
    if values and (min(values) < 0 or max(values) > seqlen_k):
        raise ValueError(
            f"{name} must lie in [0, {seqlen_k}] (the KV length), got values in [{min(values)}, {max(values)}]"
        )
    return values


def check_variants(q, *, window=None, softcap=None, sinks=None, positions: bool = True,
                   softmax_scale=None) -> None:
    """The attention variants' arguments, checked before any work or collective.

    window: an int >= 1 (at most :data:`MAX_WINDOW`), only with positions (q_positions and
        k_positions: a window is a lower bound on global key positions); softcap: a finite real
        number > 0; sinks: a floating-point tensor of shape (nheads_q,) on q's device; softmax_scale:
        :func:`check_softmax_scale`.
    """
    check_softmax_scale(softmax_scale)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int (keys j with p - window < j <= p are visible) or None, "
                            f"got {type(window).__name__} {window!r}")
        if not 1 <= int(window) <= MAX_WINDOW:
            raise ValueError(f"window must lie in [1, {MAX_WINDOW}] (1: a query sees only its own position), "
                             f"got {int(window)}")
        if not positions:
            raise ValueError("window needs q_positions and k_positions (a sliding window bounds global key "
                             "positions); without stored positions pass the first visible slot per row as "
                             "cache_starts instead")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise TypeError(f"softcap must be a positive float (scores -> softcap * tanh(scores / softcap)) or "
                            f"None, got {type(softcap).__name__} {softcap!r}")
        if not (math.isfinite(float(softcap)) and float(softcap) > 0):
            raise ValueError(f"softcap must be finite and > 0, got {float(softcap)}")
    if sinks is not None:
        check_sinks(sinks, q)


def check_sinks(sinks, q) -> None:
    """sinks: a floating-point tensor of shape (nheads_q,) on q's device (one logit per query head)."""
    hq = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        got = sinks.dtype if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise TypeError(f"sinks must be a floating-point tensor of shape ({hq},) (one logit per query head), "
                        f"got {got}")
    if tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must have shape ({hq},) (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")


def check_merge_inputs(outs: torch.Tensor, lses: torch.Tensor) -> None:
    """outs: (P, batch, seqlen_q, nheads_q, headdim); lses: (P, batch, nheads_q, seqlen_q) float32 or
    float64; P >= 1."""
    for name, t in (("outs", outs), ("lses", lses)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"merge_states: {name} must be a stacked tensor (torch.stack the partial states), "
                            f"got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"merge_states: {name} must be floating point, got {t.dtype}")
    if lses.dtype not in LSE_DTYPES:
        raise TypeError(f"merge_states: lses must be float32 or float64, got {lses.dtype} (an lse rounded to 16 "
                        "bits is off by up to 0.5 % of its value, and fp16 overflows past 65504: keep partial "
                        "lse in float32, or float64 for large scores)")
    if outs.dim() != 5 or lses.dim() != 4:
        raise ValueError(
            f"merge_states expects outs (P, B, Sq, Hq, D) and lses (P, B, Hq, Sq), "
            f"got {tuple(outs.shape)} and {tuple(lses.shape)}"
        )
    p, b, sq, hq, _ = outs.shape
    if p == 0:
        raise ValueError(f"merge_states needs at least one partial state (P >= 1), got outs {tuple(outs.shape)} "
                         "with P = 0")
    if tuple(lses.shape) != (p, b, hq, sq):
        raise ValueError(f"lses must have shape {(p, b, hq, sq)} to match outs {tuple(outs.shape)}, got {tuple(lses.shape)}")
