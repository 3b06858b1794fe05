"""Run megatron-core's CUDA-assuming code (0.16.1 and 0.19.x) on a CPU-only torch, for tests and CI.

Invariant: nothing here changes numerics; every replacement does on the CPU what the
replaced call does on the GPU (allocate on "the current device", move to it, time an
event, attend with flash-attention's semantics), and :func:`megatron_on_cpu` restores
every attribute it touched when it exits. It exists because megatron-core calls
``torch.cuda.current_device()`` when it allocates (RoPE, KV buffers, the inference
controller), pins host memory (RoPE slicing for context parallelism, the dynamic
controller's sampling buffers), marks NVTX ranges (the dynamic engine) and, for its
dynamic inference context, attends only through flash-attn's varlen / paged kernels; a
CPU-only torch has none of these. It is never needed on a GPU and :func:`megatron_on_cpu`
refuses to run when CUDA is available, so it cannot hide a real device problem there.

Each megatron-core replacement is feature-detected: an attribute is replaced only where the
imported release has it, and :func:`megatron_on_cpu` yields the names it replaced, so what a
release needs is measured, not assumed. 0.19 needs beyond 0.16.1: pinned host buffers made
with ``torch.empty/zeros/full(..., pin_memory=True)`` and ``Tensor.pin_memory()``, CUDA
streams and events recorded on them (the controller's async copy stream) and
``torch.cuda.nvtx`` (0.19 calls Megatron's ``nvtx_range_push`` helpers instead of the
engine's own ``range_push``), and for speculative decoding (MTP drafts) the controller's two
Triton kernels ``verify_speculative_tokens`` / ``prepare_next_forward_pass``, which Triton cannot
launch without a GPU driver: megatron-core ships torch versions of both with the same contract
(``mtp_utils_pytorch``; integer bookkeeping, so nothing numeric changes).

The flash-attn stand-ins (:func:`flash_attn_varlen_func`, :func:`flash_attn_with_kvcache`)
are plain softmax attention in torch, written from flash-attn's documented contract and
deliberately not from this library's kernels, so that Megatron's own dynamic engine run
through them is an independent reference for the tree path.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

__all__ = ["megatron_on_cpu", "flash_attn_varlen_func", "flash_attn_with_kvcache", "FLASH_ATTN_STANDIN_VERSION"]

FLASH_ATTN_STANDIN_VERSION = "2.7.3"
"""The flash-attn API the stand-ins implement (the part megatron-core 0.16.1's dynamic path calls)."""


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event``: records wall time so ``elapsed_time`` works."""

    def __init__(self, enable_timing: bool = False, **_):
        self._t = None

    def record(self, stream=None):
        import time

        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end: "_CpuEvent") -> float:
        return (end._t - self._t) * 1000.0


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """Megatron's ``get_pos_emb_on_this_cp_rank`` without pinned memory: chunks r and 2P-1-r."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _attend(q, k, v, softmax_scale, causal: bool):
    """Softmax attention of one sequence. q: [sq, hq, d]; k, v: [sk, hkv, d] -> [sq, hq, d].

    GQA as flash-attn: query head h reads KV head h // (hq // hkv). ``causal`` aligns the mask
    to the bottom right (query i sees keys j <= i + sk - sq), as flash-attn >= 2.1 does.
    """
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    kk = k.to(acc).repeat_interleave(hq // hkv, dim=1)
    vv = v.to(acc).repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(acc), kk) * scale
    if causal:
        hidden = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(hidden.to(s.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a query with no visible key gets 0, as flash-attn
    return torch.einsum("hqk,khd->qhd", p, vv).to(q.dtype)


def _paged(cache, table_row, n: int):
    """The first ``n`` tokens of one sequence from a paged cache [blocks, block_size, h, d]."""
    blocks = -(-n // cache.shape[1])
    return cache.index_select(0, table_row[:blocks].to(torch.int64)).reshape(-1, *cache.shape[2:])[:n]


def _full_window(window_size) -> bool:
    return window_size is None or tuple(window_size) == (-1, -1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, block_table=None, window_size=(-1, -1),
                           return_attn_probs=False, **unsupported):
    """flash-attn's ``flash_attn_varlen_func`` (2.7.3 API) on the CPU.

    q: [total_q, hq, d] packed sequences delimited by cu_seqlens_q; with ``block_table``
    ([batch, max_blocks] int32) k and v are paged caches [num_blocks, block_size, hkv, d] and
    sequence i has cu_seqlens_k[i+1] - cu_seqlens_k[i] keys; without it k, v are packed like q.
    Rows of q past cu_seqlens_q[-1] (padding) are returned as 0.
    """
    if dropout_p or any(v_ is not None and v_ is not False for v_ in unsupported.values()):
        raise NotImplementedError(f"CPU flash_attn_varlen_func stand-in: unsupported arguments {sorted(unsupported)}")
    if not _full_window(window_size) or return_attn_probs:  # keywords 0.19 passes
        raise NotImplementedError(
            f"CPU flash_attn_varlen_func stand-in: window_size={window_size}, return_attn_probs={return_attn_probs} "
            "(sliding windows and sink-softmax lse are not implemented)"
        )
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        a, b = cq[i], cq[i + 1]
        if a == b:
            continue
        if block_table is not None:
            n = ck[i + 1] - ck[i]
            ki, vi = _paged(k, block_table[i], n), _paged(v, block_table[i], n)
        else:
            ki, vi = k[ck[i]: ck[i + 1]], v[ck[i]: ck[i + 1]]
        out[a:b] = _attend(q[a:b], ki, vi, softmax_scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, num_splits=0, window_size=(-1, -1), return_softmax_lse=False,
                            **unsupported):
    """flash-attn's ``flash_attn_with_kvcache`` (2.7.3 API) on the CPU, without the fused cache update.

    q: [batch, sq, hq, d]; k_cache, v_cache: [batch, n, hkv, d], or paged [num_blocks,
    block_size, hkv, d] with ``block_table`` [batch, max_blocks]; cache_seqlens: [batch]
    keys per row. (Megatron's dynamic path passes no new k/v and no rotary tables.)
    """
    if k is not None or v is not None or rotary_cos is not None or cache_batch_idx is not None or any(
        v_ is not None and v_ is not False for v_ in unsupported.values()
    ):
        raise NotImplementedError("CPU flash_attn_with_kvcache stand-in: only reads the cache (no k/v/rotary)")
    if not _full_window(window_size) or return_softmax_lse:  # keywords 0.19 passes
        raise NotImplementedError(
            f"CPU flash_attn_with_kvcache stand-in: window_size={window_size}, "
            f"return_softmax_lse={return_softmax_lse} (not implemented)"
        )
    out = torch.zeros_like(q)
    lens = cache_seqlens.tolist() if cache_seqlens is not None else [k_cache.shape[1]] * q.shape[0]
    for i, n in enumerate(lens):
        if n == 0:
            continue
        if block_table is not None:
            ki, vi = _paged(k_cache, block_table[i], n), _paged(v_cache, block_table[i], n)
        else:
            ki, vi = k_cache[i, :n], v_cache[i, :n]
        out[i] = _attend(q[i], ki, vi, softmax_scale, causal)
    return out


def _standin_version_check(version, check_equality=True) -> bool:
    """``is_fa_min_version`` answered for the stand-ins' API version."""
    from packaging.version import Version

    have, want = Version(FLASH_ATTN_STANDIN_VERSION), Version(version)
    return have >= want if check_equality else have > want


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream``: work on the CPU is already ordered."""

    def __init__(self, *_, **__):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        pass

    def record_event(self, event=None):
        event = event or _CpuEvent()
        event.record()
        return event


class _Nvtx:
    """Stand-in for ``torch.cuda.nvtx``: ranges are profiler markers only."""

    @staticmethod
    def range_push(msg):
        return 0

    @staticmethod
    def range_pop():
        return 0

    @staticmethod
    @contextlib.contextmanager
    def range(msg, *a, **k):
        yield


def _on_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def _unpinned(fn):
    """``fn`` with ``pin_memory`` dropped and a ``device="cuda"`` (Megatron's optimizer's loss scale) on the CPU."""

    def call(*args, pin_memory=False, **kwargs):
        if _on_cpu(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    call.__wrapped__ = fn
    return call


def _mtp_pytorch(name: str):
    """megatron-core's torch implementation of one of its MTP Triton kernels (``mtp_utils_pytorch.<name>``)."""
    from megatron.core.inference.text_generation_controllers import mtp_utils_pytorch

    return getattr(mtp_utils_pytorch, name)


# (module, attribute, replacement factory) -- applied only where the module has the attribute.
_MEGATRON = (
    ("megatron.core.models.common.embeddings.rope_utils", "get_pos_emb_on_this_cp_rank",
     lambda old: _pos_emb_on_this_cp_rank),
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
     lambda old: _pos_emb_on_this_cp_rank),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank",
     lambda old: _pos_emb_on_this_cp_rank),
    ("megatron.core.inference.engines.dynamic_engine", "range_push", lambda old: (lambda *a, **k: None)),  # 0.16
    ("megatron.core.inference.engines.dynamic_engine", "range_pop", lambda old: (lambda *a, **k: None)),  # 0.16
    ("megatron.core.inference.contexts.dynamic_context", "triton_append_key_value_cache", lambda old: None),
    ("megatron.core.transformer.attention", "flash_attn_varlen_func", lambda old: flash_attn_varlen_func),
    ("megatron.core.transformer.attention", "flash_attn_with_kvcache", lambda old: flash_attn_with_kvcache),
    ("megatron.core.transformer.attention", "is_fa_min_version", lambda old: _standin_version_check),
    # 0.19's speculative decoding (MTP): its Triton kernels -> the same-contract torch versions in
    # mtp_utils_pytorch (integer bookkeeping: which draft tokens match, which to keep).
    ("megatron.core.inference.text_generation_controllers.text_generation_controller", "verify_speculative_tokens",
     lambda old: _mtp_pytorch("verify_speculative_tokens")),
    ("megatron.core.inference.text_generation_controllers.text_generation_controller", "prepare_next_forward_pass",
     lambda old: _mtp_pytorch("prepare_next_forward_pass")),
)


@contextlib.contextmanager
def megatron_on_cpu():
    """Within the block megatron-core's CUDA calls act on the CPU; yields the list of replaced names.

    torch level: ``torch.cuda.current_device`` (-> ``"cpu"``), ``Event``, ``Stream``, ``stream``,
    ``current_stream``, ``synchronize``, ``nvtx``, ``Tensor.cuda`` (-> no move), pinned host
    buffers (``pin_memory=True`` and ``Tensor.pin_memory()`` -> unpinned: pinning only speeds up
    copies to a GPU). megatron-core level, each only where the imported release has it (the
    names differ between 0.16.1 and 0.19): ``get_pos_emb_on_this_cp_rank`` (same chunks, no
    pinned memory), the dynamic engine's NVTX ranges, the dynamic context's Triton KV-append
    kernel (-> Megatron's own indexing fallback), in Megatron's attention module,
    flash-attn's ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` (-> the torch
    stand-ins above) with ``is_fa_min_version`` answering for their API version, and 0.19's
    MTP verification kernels in the text generation controller (-> ``mtp_utils_pytorch``'s).

    Raises ``RuntimeError`` when CUDA is available (this shim would hide a device problem there).
    """
    if torch.cuda.is_available():
        raise RuntimeError("megatron_on_cpu() is a CPU-only shim; CUDA is available, run megatron-core natively")
    cuda = torch.cuda
    torch_level = [
        (cuda, "current_device", lambda old: (lambda: "cpu")),
        (cuda, "Event", lambda old: _CpuEvent),
        (cuda, "Stream", lambda old: _CpuStream),
        (cuda, "stream", lambda old: (lambda s=None: contextlib.nullcontext())),
        (cuda, "current_stream", lambda old: (lambda *a, **k: _CpuStream())),
        (cuda, "synchronize", lambda old: (lambda *a, **k: None)),
        (cuda, "nvtx", lambda old: _Nvtx),
        (torch.Tensor, "cuda", lambda old: (lambda self, *a, **k: self)),
        (torch.Tensor, "pin_memory", lambda old: (lambda self, *a, **k: self)),
        (torch, "empty_like", _unpinned),
        (torch, "empty", _unpinned),
        (torch, "zeros", _unpinned),
        (torch, "ones", _unpinned),
        (torch, "full", _unpinned),
        (torch, "tensor", _unpinned),
        (torch, "arange", _unpinned),
    ]
    targets = list(torch_level)
    for module_name, attr, factory in _MEGATRON:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            targets.append((module, attr, factory))
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    replaced = []
    try:
        for (obj, attr, factory), (_, _, old) in zip(targets, saved):
            setattr(obj, attr, factory(old))
            replaced.append(f"{getattr(obj, '__name__', type(obj).__name__)}.{attr}")
        yield replaced
    finally:
        for obj, attr, old in saved:
            setattr(obj, attr, old)
