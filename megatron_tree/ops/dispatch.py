"""Backend choice for the local decode and the local merge, registered as torch custom ops.

Invariant: callers above this layer never name a backend implementation; they call
:func:`flash_decode` / :func:`merge_states` here and get the same contract (docs/design.md §3) from the Triton kernels (``kernels/``) on CUDA tensors and from the torch path
(``torch_decode.py``, checked against ``reference.py``) on CPU. The environment variable
``MEGATRON_TREE_BACKEND`` (``torch`` or ``triton``) forces a backend, as does the
``backend=`` argument; ``triton`` on CPU tensors runs the Triton interpreter and needs
``TRITON_INTERPRET=1`` set before ``megatron_tree.ops.triton`` is imported.

Both entry points go through ``torch.library`` custom ops (``megatron_tree::flash_decode``,
``megatron_tree::merge_states``) with fake implementations, so ``torch.compile`` captures a
decode step as one opaque node (no graph break) and CUDA graphs can record it: on CUDA
the launch path does no host-device synchronisation (``cache_seqlens`` values are clamped
in the kernel rather than checked on the host). On CPU tensors the values are checked inside
the op, where the torch path reads ``cache_seqlens`` to slice rows anyway, so the code around
the op never reads a tensor's values either (``megatron_tree.utils.sync_guard``).
"""

from __future__ import annotations

import os
from typing import Literal, Optional

import torch

from . import contract, fused_prefill, reference, torch_decode

__all__ = ["flash_decode", "merge_states", "prefill_attention", "prefill_kernel", "resolve_backend", "BACKENDS",
           "ENV_BACKEND"]

Backend = Literal["torch", "triton"]
BACKENDS = ("torch", "triton")
ENV_BACKEND = "MEGATRON_TREE_BACKEND"


def resolve_backend(device: torch.device, backend: str | None = None) -> str:
    """The backend that will run on ``device``: the argument, else the environment, else by device."""
    choice = backend if backend is not None else os.environ.get(ENV_BACKEND) or None
    if choice is not None and choice not in BACKENDS:
        source = "backend argument" if backend is not None else f"${ENV_BACKEND}"
        raise ValueError(f"unknown {source} {choice!r}; expected one of {BACKENDS}")
    if choice is None:
        return "triton" if device.type == "cuda" else "torch"
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend='triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 set before "
            "megatron_tree.ops.triton is imported; use backend='torch' or backend=None on CPU"
        )
    return choice


def _check(q, k, v, cache_seqlens, q_positions, k_positions, block_table, out_dtype, lse_dtype, **variants) -> None:
    # Shapes, dtypes and devices only: nothing here reads a tensor's values, so a decode step
    # stays free of host syncs. The value checks (cache_seqlens and cache_starts within [0, N],
    # block ids within the cache) run inside the op on CPU tensors, where the torch path reads
    # cache_seqlens anyway; on CUDA the kernel clamps instead.
    contract.check_decode_inputs(q, k, v, cache_seqlens, q_positions, k_positions, block_table, out_dtype,
                                  by_value=False, lse_dtype=lse_dtype, **variants)


def _check_values(q, k, cache_seqlens, block_table, cache_starts=None, n=None) -> list | None:
    """The value checks of the contract, for CPU inputs (host memory: reading it syncs nothing).
    Returns cache_seqlens' values as read for the check (a list of ints), or None without it.
    n: the KV length (``contract.kv_length``) where the caller knows it from the signature."""
    if n is None:
        n = contract.kv_length(k, block_table)
    # shapes, dtypes and devices were checked once for the signature (_decode_signature; a direct call
    # of the op, as for merge_states, is checked by its caller): the values only
    lens = None if cache_seqlens is None else contract.check_cache_seqlens_values(cache_seqlens, n)
    if cache_starts is not None:
        contract.check_cache_seqlens_values(cache_starts, n, "cache_starts")
    if block_table is not None:
        contract.check_block_table(block_table, q.shape[0], k.shape[0], k.shape[1], cache_seqlens, q.device,
                                    cache_starts=cache_starts)
    return lens


# The two ops are defined on a torch.library.Library with one CompositeExplicitAutograd kernel
# each, not with torch.library.custom_op: custom_op wraps every call in a Python autograd
# function (about 10 us of host time per call on CPU, measured by benchmarks/host_path.py);
# a decode step needs no gradient, and without an autograd kernel a backward through the op
# raises. New arguments go at the end with defaults, so positional calls of the op stay valid.
torch.library.define(
    "megatron_tree::flash_decode",
    "(Tensor q, Tensor k, Tensor v, Tensor? cache_seqlens, float? softmax_scale, Tensor? q_positions, "
    "Tensor? k_positions, str backend, Tensor? block_table=None, ScalarType? out_dtype=None, "
    "ScalarType? lse_dtype=None, Tensor? cache_starts=None, SymInt? window=None, float? softcap=None) "
    "-> (Tensor, Tensor)")
torch.library.define("megatron_tree::merge_states", "(Tensor outs, Tensor lses, str backend) -> (Tensor, Tensor)")


def _flash_decode_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: Optional[torch.Tensor],
    softmax_scale: Optional[float],
    q_positions: Optional[torch.Tensor],
    k_positions: Optional[torch.Tensor],
    backend: str,
    block_table: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    lse_dtype: Optional[torch.dtype] = None,
    cache_starts: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    lens = _check_values(q, k, cache_seqlens, block_table, cache_starts) if q.device.type == "cpu" else None
    if backend == "triton":
        fd = _FD or _triton()[0]
        plan = fd.plan_of(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype,
                          lse_dtype, None, None, None, window, softcap, cache_starts)
        return fd.run_plan(plan, q, k, v, block_table, cache_seqlens, q_positions, k_positions, cache_starts)
    # positional, with the lengths the check has read (each keyword and each read is host time on a tiny call)
    return torch_decode.decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions,
                               out_dtype, lse_dtype, window, softcap, cache_starts, lens)


@torch.library.register_fake("megatron_tree::flash_decode")
def _flash_decode_fake(q, k, v, cache_seqlens, softmax_scale, q_positions, k_positions, backend, block_table=None,
                       out_dtype=None, lse_dtype=None, cache_starts=None, window=None, softcap=None):
    b, sq, hq, _ = q.shape
    out = q.new_empty((b, sq, hq, v.shape[-1]), dtype=q.dtype if out_dtype is None else out_dtype)
    return out, q.new_empty((b, hq, sq), dtype=contract.lse_acc_dtype(lse_dtype, q.dtype))


def _merge_states_impl(outs: torch.Tensor, lses: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "triton":
        out, lse = (_MK or _triton()[1]).merge_states(outs, lses)
    else:
        out, lse = reference.merge_stacked(outs, lses)  # checked by the caller (or opcheck's own inputs)
    if outs.shape[0] == 1:  # P = 1 returns views of the inputs; a custom op may not alias them
        out, lse = out.clone(), lse.clone()
    # The fake implementation promises contiguous outputs; the reference's may be transposed views.
    return (out if out.is_contiguous() else out.contiguous()), (lse if lse.is_contiguous() else lse.contiguous())


@torch.library.register_fake("megatron_tree::merge_states")
def _merge_states_fake(outs, lses, backend):
    _, b, sq, hq, d = outs.shape
    lse_dtype = torch.promote_types(lses.dtype, contract.acc_dtype(outs.dtype))
    return outs.new_empty((b, sq, hq, d)), lses.new_empty((b, hq, sq), dtype=lse_dtype)


torch.library.impl("megatron_tree::flash_decode", "CompositeExplicitAutograd", _flash_decode_impl)
torch.library.impl("megatron_tree::merge_states", "CompositeExplicitAutograd", _merge_states_impl)
_flash_decode_op = torch.ops.megatron_tree.flash_decode.default
_merge_states_op = torch.ops.megatron_tree.merge_states.default

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FD = _MK = None
"""The Triton launchers (``ops.triton.flash_decode`` and ``.merge``), once :func:`_triton` has imported them."""


def _triton():
    """The Triton launcher modules, imported on first use (they need triton), kept in ``_FD`` / ``_MK`` so that a
    call finds them without an import statement (a measurable part of its host time)."""
    global _FD, _MK
    if _FD is None:
        from .triton import flash_decode, merge

        _FD, _MK = flash_decode, merge
    return _FD, _MK


def _kernel_backend(name: str, dtype: torch.dtype, forced: bool, headdim: int = 0, out_dtype=None) -> str:
    # The kernels cover fp16/bf16/fp32 (in and out) and head dims up to 256; anything else on
    # CUDA quietly takes the torch path unless a backend was forced (then the kernel's error
    # names it).
    if name == "triton" and not forced and (
            dtype not in _KERNEL_DTYPES or headdim > 256 or (out_dtype is not None and out_dtype not in _KERNEL_DTYPES)):
        return "torch"
    return name


SIGNATURE_CACHE_SIZE = 256
"""Signatures (shapes, dtypes, devices, variant arguments, backend settings) whose validation and
backend resolution are remembered; past that many the memory starts afresh."""
_signatures: dict = {}


def _meta(t):
    """What the shape-only checks and the launch plan read of an argument: a tensor's shape, strides, dtype
    and device; of anything else its type (such an argument either always fails its check or is None)."""
    if isinstance(t, torch.Tensor):
        return t.shape, t.stride(), t.dtype, t.device
    return None if t is None else ("not a tensor", type(t))


def _scale_key(scale):
    """A ``softmax_scale`` other than None or a float, as part of a signature: its type and value; a tensor
    (hashed by identity, not value) raises ``TypeError``: such a call is checked and planned for itself only."""
    if isinstance(scale, torch.Tensor):
        raise TypeError("a tensor softmax_scale")
    return type(scale), scale


def _remember(key, check):
    """``check()``'s result for ``key``, computed once per key while the key is remembered.

    ``check`` raises for bad input (nothing is remembered then) and depends only on what ``key``
    holds. While ``torch.compile`` traces, the checks run every time and nothing is remembered:
    they are shape-only, so Dynamo evaluates them at trace time and its guards recompile on a
    new signature."""
    if torch.compiler.is_compiling():
        return check()
    try:
        return _signatures[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable argument (e.g. a list as out_dtype): its check raises
        return check()
    value = check()
    if len(_signatures) >= SIGNATURE_CACHE_SIZE:
        _signatures.clear()
    _signatures[key] = value
    return value


def _plain(t) -> bool:
    """Whether ``t`` is a plain CPU or CUDA tensor: the half, remembered per signature, of the test whether a call
    may run the op's body directly -- plain eager work, where the op boundary (there for ``torch.compile``, its
    CUDA graphs and the host-sync guard, which treat the op as one opaque node) would only cost host time: about
    16 us a call, as much as the rest of an eager call's path before Triton's launcher
    (``benchmarks/launch_overhead.py``). A tensor subclass or another device goes through the op; so do a traced
    call and a call :func:`_moded` finds. A capture with ``torch.cuda.graph`` records the same kernels either way."""
    return type(t) is torch.Tensor and t.device.type in ("cpu", "cuda")


def _moded(t: torch.Tensor) -> bool:
    """The per-call half of :func:`_plain`'s test: a torch function or dispatch mode is on
    (``sync_guard.no_host_sync``, fake tensors), or ``t`` records gradients -- the call goes
    through the op."""
    return (torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack() != 0
            or (t.requires_grad and torch.is_grad_enabled()))


_BELOW_AUTOGRAD = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCPU) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradCUDA) | \
    torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
"""The dispatch keys a plain-eager call has no use for: with no input recording gradients
(:func:`_moded`) the autograd and view-tracking layers only pass each of the body's torch calls
on, at a fixed host cost per call (about a sixth of a tiny merge's, benchmarks/host_path.py)."""


def _direct(body, *args):
    """``body(*args)`` -- an op's implementation, for a call :func:`_plain` and :func:`_moded` admit -- with the
    dispatcher starting below autograd, as it does inside the op (its autograd fallback redispatches
    there too): the same kernels, the same bits, less host time per torch call."""
    with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOGRAD):
        return body(*args)


def _environment_key():
    """A function returning what the backend choice reads from the environment, as part of a signature:
    ``$MEGATRON_TREE_BACKEND`` and ``$TRITON_INTERPRET`` as ``os.environ`` holds them. It reads the dict that
    ``os.environ`` keeps (CPython: every write through ``os.environ`` -- ``monkeypatch.setenv``,
    ``mock.patch.dict`` -- lands in it), encoded values and all: no decoding, and none of the ``KeyError`` that
    ``os.environ.get`` raises and catches for a variable that is not set (each a measurable part of a tiny call's
    host time, benchmarks/host_path.py). Where that dict is not there, ``os.environ.get``. Not used while
    ``torch.compile`` traces (no signature is remembered then): Dynamo would guard the dict, recompiling where
    ``os.environ.get``, which it guards as the environment, needs none."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return lambda: (os.environ.get(ENV_BACKEND), os.environ.get("TRITON_INTERPRET"))
    get, backend, interpret = data.get, encode(ENV_BACKEND), encode("TRITON_INTERPRET")
    return lambda: (get(backend), get(interpret))


_env_key = _environment_key()


def _forced() -> bool:
    """Whether ``$MEGATRON_TREE_BACKEND`` names a backend (read as ``resolve_backend`` reads it)."""
    return (os.environ.get(ENV_BACKEND) or None) is not None


def _decode_signature(q, k, v, cache_seqlens, softmax_scale, q_positions, k_positions, block_table, out_dtype,
                      lse_dtype, window, softcap, cache_starts, sinks, backend, compiling: bool) -> list:
    """What a :func:`flash_decode` call's signature fixes, after the shape-only checks of the contract,
    remembered per signature (:func:`_remember`): ``[kernel backend, resolved backend, whether q is a plain
    CPU or CUDA tensor, whether on CPU, the KV length N, launch plan, its epoch, fused plan]``; launch plan and
    epoch are filled in by the first call that runs the Triton kernels directly (:func:`_decode`) -- one lookup
    serves the checks, the backend choice and the launches, so the signature holds everything the plan depends on
    (strides, the scalar arguments; ``ops.triton.flash_decode.plan_of``'s key is a part of it). The fused plan is
    ``torch_decode.fused_plan``'s on the torch backend on CPU without sinks (else None): what of the CPU fused
    kernel's choice and call the signature fixes (strides, dtypes, the scale). The value checks run on every call
    (``_check_values``). ``compiling``: ``torch.compiler.is_compiling()``, asked once by the caller."""
    key = None
    if not compiling:
        try:  # q, k, v read straight off the tensors and the optional arguments, mostly None, without a call each
            key = ("decode", type(q), q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
                   v.shape, v.stride(), v.dtype, v.device,
                   cache_seqlens if cache_seqlens is None else _meta(cache_seqlens),
                   q_positions if q_positions is None else _meta(q_positions),
                   k_positions if k_positions is None else _meta(k_positions),
                   block_table if block_table is None else _meta(block_table),
                   softmax_scale if softmax_scale is None or type(softmax_scale) is float
                   else _scale_key(softmax_scale),
                   out_dtype, lse_dtype, type(window), window, type(softcap), softcap,
                   cache_starts if cache_starts is None else _meta(cache_starts),
                   sinks if sinks is None else _meta(sinks), backend, _env_key())
        except (AttributeError, TypeError):  # q, k or v not a tensor (its check raises), or a tensor scale
            key = None
        else:
            try:
                return _signatures[key]  # a remembered signature: _remember's lookup, without building check
            except (KeyError, TypeError):  # a new signature (or an unhashable argument: its check raises)
                pass

    def check():
        _check(q, k, v, cache_seqlens, q_positions, k_positions, block_table, out_dtype, lse_dtype, window=window,
               softcap=softcap, cache_starts=cache_starts, sinks=sinks, softmax_scale=softmax_scale)
        resolved = resolve_backend(q.device, backend)
        forced = backend is not None or _forced()
        name = _kernel_backend(resolved, q.dtype, forced, max(q.shape[-1], v.shape[-1]), out_dtype)
        cpu = q.device.type == "cpu"
        fused = torch_decode.fused_plan(q, k, v, block_table, softmax_scale, q_positions, out_dtype, lse_dtype,
                                        softcap) if name == "torch" and cpu and sinks is None else None
        return [name, resolved, _plain(q), cpu, contract.kv_length(k, block_table), None, -1, fused]

    return check() if key is None else _remember(key, check)


def _merge_signature(outs, lses, backend, compiling: bool) -> list:
    """What a :func:`merge_states` call's signature fixes, after its (shape-only) checks, remembered per
    signature (:func:`_remember`): ``[kernel backend, whether outs and lses are plain CPU or CUDA tensors,
    P, launch plan, its epoch]``, the last two filled in by the first call that runs the Triton kernel directly.
    The signature: the tensors' types, shapes, strides, dtypes and devices, the backend argument and the
    environment. ``compiling``: ``torch.compiler.is_compiling()``, asked once by the caller."""
    key = None
    if not compiling:
        try:  # the key read straight off the tensors (no helper call each: a tiny merge's host time)
            key = ("merge", type(outs), outs.shape, outs.stride(), outs.dtype, outs.device, type(lses), lses.shape,
                   lses.stride(), lses.dtype, lses.device, backend, _env_key())
            return _signatures[key]  # a remembered signature: _remember's lookup, without building check
        except AttributeError:  # not tensors: the check below raises its clear error
            key = None
        except (KeyError, TypeError):  # a new signature (or an unhashable backend: its check raises)
            pass

    def check():
        contract.check_merge_inputs(outs, lses)
        forced = backend is not None or _forced()
        name = _kernel_backend(resolve_backend(outs.device, backend), outs.dtype, forced, outs.shape[-1])
        return [name, _plain(outs) and type(lses) is torch.Tensor, outs.shape[0], None, -1]

    return check() if key is None else _remember(key, check)


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
    backend: str | None = None,
    lse_dtype: torch.dtype | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    cache_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention of q over one KV shard; see :func:`reference.partial_attention` for details.

    q: (batch, seqlen_q, nheads_q, headdim)
    k: (batch, seqlen_k, nheads_kv, headdim), v: (batch, seqlen_k, nheads_kv, headdim_v), or with
        block_table a paged cache (num_blocks, block_size, nheads_kv, headdim[_v]); headdim_v
        may differ from headdim (MLA: out has V's head dim)
    block_table: (batch, max_blocks) int32; row b's key j lives in block block_table[b, j // block_size]
    cache_seqlens: (batch,) int32 keys per row in [0, N] (N = seqlen_k, or max_blocks * block_size)
    cache_starts: (batch,) int32 in [0, N]: keys before it are not valid, nor read (left
        padding; on a shard whose slots follow positions, the first slot a sliding window
        still shows -- the window as a slot range, with no positions needed)
    q_positions: (batch, seqlen_q), k_positions: (batch, N) or (N,): causal by global position
    window: sliding window, with positions only: query at position p sees keys j with
        ``p - window < j <= p`` (transformers' ``sliding_window``, its
        ``sliding_window_causal_mask_function``; flash-attn's and Megatron's
        ``window_size=(window - 1, 0)``); a shard with no key inside is an empty partial.
        The kernel still reads every key up to cache_seqlens and masks by position; a caller
        that knows the first slot inside the window may pass it as cache_starts too (same
        result), and the tiles before it are skipped
    softcap: scores -> ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2's
        ``attn_logit_softcapping``); the lse is over the capped scores
    sinks: (nheads_q,) float, one logit per query head joining the softmax with a zero value
        (GPT-OSS), by :func:`reference.add_sink` after the local attention: for this shard as
        the whole sequence. Over CP shards pass it to ``tree_decode`` instead (it joins once,
        after the merge), never to each rank's ``flash_decode``.
    out_dtype: dtype of out (default q.dtype); float32 leaves a bf16/fp16 partial unrounded
    lse_dtype: dtype of lse: float32 (the default) or float64, never narrower than the
        accumulation (float64 input always gives float64); float64 carries a partial that will
        be merged again whole, so the merge stays exact at large scores (|s| = 1e5 tested;
        ``reference``'s module docstring)
    returns out: (batch, seqlen_q, nheads_q, headdim_v) in out_dtype,
            lse: (batch, nheads_q, seqlen_q) in lse_dtype, natural log, -inf where no key is visible
            (and no sink), NaN where a visible score (or the sink) is NaN
    """
    return _decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, backend,
                   lse_dtype, window, softcap, sinks, cache_starts)[:2]


def flash_decode_resolved(q, k, v, *, block_table=None, cache_seqlens=None, softmax_scale=None, q_positions=None,
                          k_positions=None, out_dtype=None, backend=None, lse_dtype=None, window=None, softcap=None,
                          sinks=None, cache_starts=None):
    """:func:`flash_decode`, returning also the backend it resolved (``resolve_backend``'s answer,
    before the kernels' dtype fallback): ``(out, lse, backend)``, so a caller that needs the
    name (``tree_decode``, for the merge's signature) does not resolve it a second time."""
    return _decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, backend,
                   lse_dtype, window, softcap, sinks, cache_starts)


def _decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions, out_dtype, backend,
            lse_dtype, window, softcap, sinks, cache_starts):
    """:func:`flash_decode_resolved` with positional arguments (keyword passing is a measurable part of a
    tiny call's host time)."""
    compiling = torch.compiler.is_compiling()
    sig = _decode_signature(q, k, v, cache_seqlens, softmax_scale, q_positions, k_positions, block_table, out_dtype,
                            lse_dtype, window, softcap, cache_starts, sinks, backend, compiling)
    name, resolved = sig[0], sig[1]
    # the direct eager path: _plain known from the signature, the rest per call (k or v recording gradients, not only
    # q, takes the op, whose outputs refuse a backward: contract.no_backward)
    direct = sig[2] and not (compiling or _moded(q) or (k.requires_grad or v.requires_grad) and torch.is_grad_enabled())
    fused = sig[7]
    if fused is not None and direct:
        # CPU, the torch backend, the unmasked float32 case: the op's body (_flash_decode_impl) with what depends only
        # on the signature decided there (torch_decode.fused_plan); the value checks and the choice by the longest
        # row (use_fused) per call, on the lengths read once
        n = sig[4]
        lens = [n] * q.shape[0] if cache_seqlens is None else contract.check_cache_seqlens_values(cache_seqlens, n)
        starts = None if cache_starts is None else contract.check_cache_seqlens_values(cache_starts, n,
                                                                                         "cache_starts")
        with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOGRAD):  # _direct, inlined
            got = torch_decode.fused_planned(q, k, v, lens, starts, fused)
            if got is None:  # the loop (or the batched path), on the lengths read
                got = torch_decode.decode(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions,
                                          k_positions, out_dtype, lse_dtype, window, softcap, cache_starts, lens)
        return got[0], got[1], resolved
    if direct and name == "triton" and sinks is None:
        # the kernels' launches as the signature planned them: the op's body (_flash_decode_impl) without a plan
        # lookup of its own. Not below autograd (_direct): its only torch calls allocate the outputs, which that
        # would make slower, not faster (benchmarks/launch_overhead.py)
        if sig[3]:  # CPU: the value checks, as the op's body runs them
            _check_values(q, k, cache_seqlens, block_table, cache_starts, sig[4])
        fd = _FD or _triton()[0]
        plan = sig[5]
        if plan is None or sig[6] != fd.epoch:  # the signature's first direct call, or plans cleared since
            epoch = fd.epoch
            plan = fd.plan_of(q, k, v, block_table, cache_seqlens, softmax_scale, q_positions, k_positions,
                              out_dtype, lse_dtype, None, None, None, window, softcap, cache_starts)
            sig[5], sig[6] = plan, epoch
        out, lse = fd.run_plan(plan, q, k, v, block_table, cache_seqlens, q_positions, k_positions, cache_starts)
        return out, lse, resolved
    window = None if window is None else int(window)
    softcap = None if softcap is None else float(softcap)
    if sinks is None:
        if direct:  # _direct, inlined
            with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOGRAD):
                out, lse = _flash_decode_impl(q, k, v, cache_seqlens, softmax_scale, q_positions, k_positions, name,
                                              block_table, out_dtype, lse_dtype, cache_starts, window, softcap)
            return out, lse, resolved
        out, lse = _flash_decode_op(q, k, v, cache_seqlens, softmax_scale, q_positions, k_positions, name,
                                    block_table, out_dtype, lse_dtype, cache_starts, window, softcap)
        return (*contract.no_backward("flash_decode", (out, lse), (q, k, v)), resolved)
    # The sink joins the finished state: unrounded partial and whole lse first, one rounding after.
    args = (q, k, v, cache_seqlens, softmax_scale, q_positions, k_positions, name, block_table,
            contract.acc_dtype(q.dtype), torch.float64, cache_starts, window, softcap)
    out, lse = _direct(_flash_decode_impl, *args) if direct else contract.no_backward("flash_decode",
                                                                                   _flash_decode_op(*args), (q, k, v))
    out, lse = reference.add_sink(out, lse, sinks)
    return (out.to(q.dtype if out_dtype is None else out_dtype),
            lse.to(contract.lse_acc_dtype(lse_dtype, q.dtype)), resolved)


def merge_states(outs: torch.Tensor, lses: torch.Tensor, *, backend: str | None = None):
    """Merge P partial states: outs (P, B, Sq, Hq, D), lses (P, B, Hq, Sq) -> (out, lse).

    out: (B, Sq, Hq, D) in outs.dtype; lse: (B, Hq, Sq) float32, or float64 for float64 outs
    or lses (float64 lses are used whole: the merge is then exact at large score magnitudes).
    """
    compiling = torch.compiler.is_compiling()
    sig = _merge_signature(outs, lses, backend, compiling)
    name = sig[0]
    if sig[2] == 1:  # one state is the result: a copy (never a view of the input), lse widened
        return (torch.clone(outs[0], memory_format=torch.contiguous_format),
                lses[0].to(torch.promote_types(lses.dtype, contract.acc_dtype(outs.dtype)),
                           memory_format=torch.contiguous_format, copy=True))
    # the direct eager path (_plain known from the signature, the rest per call); _direct inlined
    if sig[1] and not (compiling or _moded(outs) or lses.requires_grad and torch.is_grad_enabled()):
        if name != "triton":
            with torch._C._ExcludeDispatchKeyGuard(_BELOW_AUTOGRAD):
                return _merge_states_impl(outs, lses, name)
        # the kernel's launch as the signature planned it (the op's body: fresh contiguous outputs, P >= 2); not
        # below autograd, as flash_decode's planned launches (_decode)
        mk = _MK or _triton()[1]
        plan = sig[3]
        if plan is None or sig[4] != mk.epoch:  # the signature's first direct call, or plans cleared since
            epoch = mk.epoch
            plan = mk.signature_plan(outs, lses)  # the kernel's own checks: raises for what it refuses
            sig[3], sig[4] = plan, epoch
        return mk.run_plan(plan, outs, lses)
    return contract.no_backward("merge_states", _merge_states_op(outs, lses, name), (outs, lses))


def prefill_kernel(q: torch.Tensor, v: torch.Tensor, kernel: str | None = None, *, window: int | None = None,
                   softcap: float | None = None) -> str:
    """The local kernel a prefill of ``q`` over values ``v`` runs: ``kernel`` when given (checked against
    ``fused_prefill.KERNELS``), else ``fused_prefill.select_kernel``'s choice for the device, dtype, head
    dims and variants. The decode tier asks this before a CP prefill (every rank's choice joins the
    cross-rank agreement) and :func:`prefill_attention` runs what it returns."""
    if kernel is not None:
        if kernel not in fused_prefill.KERNELS:
            raise ValueError(f"unknown prefill kernel {kernel!r}; expected one of {fused_prefill.KERNELS}")
        variants = fused_prefill.unfused_variants(q.shape[-1], v.shape[-1], window, softcap)
        if kernel != "decode" and variants:
            raise ValueError(f"prefill kernel {kernel!r} takes no {' or '.join(variants)}; leave kernel unset or "
                             "pass kernel='decode' (the exact path)")
        return kernel
    return fused_prefill.select_kernel(q.device, q.dtype, q.shape[-1], head_dim_v=v.shape[-1], window=window,
                                       softcap=softcap)


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
    window: int | None = None,
    softcap: float | None = None,
    calls: dict | None = None,
    cudnn_min_flop: float = fused_prefill.CUDNN_MIN_FLOP,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local causal attention of a prefill query chunk over one KV block, on fused kernels that return the lse.

    q: (batch, seqlen_q, nheads_q, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), GQA/MQA
        without repeating KV (Hq % Hkv == 0)
    q_positions: (batch, seqlen_q), k_positions: (batch, seqlen_k) or (seqlen_k,), integer global
        positions: key j is visible to query i iff k_pos[j] <= q_pos[i]; a negative position is
        padding (a padded key is never visible, a padded query gets out 0 / lse -inf)
    kernel: force one of ``fused_prefill.KERNELS`` (default: :func:`prefill_kernel`); backend: the decode
        backend (``torch``/``triton``) of the exact path (``flash_decode`` with positions); window,
        softcap: as for :func:`flash_decode` (they, and a V head dim other than K's, run the exact path);
        calls: a dict counting the kernel launches by name
        cudnn_min_flop: the ``cuda_cudnn`` kernel's smaller pieces run on flash (``fused_prefill.CUDNN_MIN_FLOP``:
            cuDNN plans each new shape); 0 runs them all on cuDNN
    returns out: (batch, seqlen_q, nheads_q, headdim) float32 (float64 for float64 input): a partial
            that will be merged again stays unrounded (bf16 is rounded once, after the last merge);
            lse: (batch, nheads_q, seqlen_q) float64, natural log, -inf where no key is visible:
            exact for the merge at any score magnitude (``fused_prefill``'s module docstring)

    Memory: one kernel tile of scores at a time (an explicit mask of at most
    ``fused_prefill.TILE`` x seqlen_k only for irregular position sets), never seqlen_q x seqlen_k.
    Reads the positions on the host to plan the kernel calls (one sync per call on CUDA).
    """
    if not isinstance(q_positions, torch.Tensor) or not isinstance(k_positions, torch.Tensor):
        raise TypeError("prefill_attention needs q_positions and k_positions as integer tensors, got "
                        f"{type(q_positions).__name__} and {type(k_positions).__name__}")
    if q_positions.dtype == torch.bool or k_positions.dtype == torch.bool:
        raise TypeError("q_positions and k_positions must be integer positions, not bool masks")
    kernel = prefill_kernel(q, v, kernel, window=window, softcap=softcap)
    if kernel == "decode":
        # the exact decode path with positions (what the fused kernels cannot take), one launch
        if calls is not None:
            calls["decode"] = calls.get("decode", 0) + 1
        return flash_decode(q, k, v, softmax_scale=softmax_scale, q_positions=q_positions, k_positions=k_positions,
                            backend=backend, out_dtype=contract.acc_dtype(q.dtype), lse_dtype=torch.float64,
                            window=window, softcap=softcap)
    contract.check_decode_inputs(q, k, v, None, q_positions, k_positions, by_value=False)
    return fused_prefill.prefill_attention(q, k, v, q_positions=q_positions, k_positions=k_positions,
                                           softmax_scale=softmax_scale, kernel=kernel, backend=backend,
                                           exact_attention=flash_decode, calls=calls,
                                           cudnn_min_flop=cudnn_min_flop)
