"""Prototype: megatron-core's CUDA-assuming code on a CPU-only machine, for 0.16.1 and 0.19.x alike.

Invariant: as :mod:`.cpu` (whose stand-ins it reuses): nothing here changes numerics, every
attribute it touches is restored on exit, and it refuses to run where CUDA is available.
Unlike :func:`.cpu.megatron_on_cpu`, which names 0.16.1's attributes and fails on entry under
0.19 (``dynamic_engine.range_push`` is gone), each replacement here is *feature-detected*: an
attribute is replaced only where the imported release has it, and :func:`megatron_on_cpu_any`
reports which ones it replaced, so the list of what a release needs is measured, not assumed.

What 0.19 needs beyond 0.16.1 (found by running its static and dynamic engines on CPU):
pinned host buffers created with ``torch.empty/zeros/full(..., pin_memory=True)`` and
``Tensor.pin_memory()`` (the dynamic context's bookkeeping, the controller's sampling
buffers), ``torch.cuda.Stream`` / ``torch.cuda.stream`` / ``torch.cuda.current_stream`` (the
controller's async copy stream), events recorded on a stream, and ``torch.cuda.nvtx`` (0.19
calls Megatron's ``nvtx_range_push`` helpers instead of the engine's own ``range_push``).

Why a new module: :mod:`.cpu` is imported by the 0.16.1 tests as it is; this prototype shows
what the merged shim must do and is meant to replace it.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

from .cpu import _CpuEvent, _pos_emb_on_this_cp_rank, _standin_version_check, flash_attn_varlen_func, \
    flash_attn_with_kvcache

__all__ = ["megatron_on_cpu_any"]


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


def _full_window(window_size) -> bool:
    return window_size is None or tuple(window_size) == (-1, -1)


def flash_attn_varlen_func_019(q, k, v, *args, window_size=(-1, -1), return_attn_probs=False, **kwargs):
    """:func:`.cpu.flash_attn_varlen_func` taking the keywords 0.19 adds (full window, no lse only)."""
    if not _full_window(window_size) or return_attn_probs:
        raise NotImplementedError(
            f"CPU flash_attn_varlen_func stand-in: window_size={window_size}, return_attn_probs={return_attn_probs} "
            "(sliding windows and sink-softmax lse are not implemented)"
        )
    return flash_attn_varlen_func(q, k, v, *args, **kwargs)


def flash_attn_with_kvcache_019(q, k_cache, v_cache, *args, window_size=(-1, -1), return_softmax_lse=False,
                                **kwargs):
    """:func:`.cpu.flash_attn_with_kvcache` taking the keywords 0.19 adds (full window, no lse only)."""
    if not _full_window(window_size) or return_softmax_lse:
        raise NotImplementedError(
            f"CPU flash_attn_with_kvcache stand-in: window_size={window_size}, "
            f"return_softmax_lse={return_softmax_lse} (not implemented)"
        )
    kwargs.pop("num_splits", None)
    return flash_attn_with_kvcache(q, k_cache, v_cache, *args, **kwargs)


def _unpinned(fn):
    def call(*args, pin_memory=False, **kwargs):
        return fn(*args, **kwargs)

    call.__wrapped__ = fn
    return call


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
    ("megatron.core.transformer.attention", "flash_attn_varlen_func", lambda old: flash_attn_varlen_func_019),
    ("megatron.core.transformer.attention", "flash_attn_with_kvcache", lambda old: flash_attn_with_kvcache_019),
    ("megatron.core.transformer.attention", "is_fa_min_version", lambda old: _standin_version_check),
)


@contextlib.contextmanager
def megatron_on_cpu_any():
    """Within the block megatron-core's CUDA calls act on the CPU; yields the list of replaced names.

    Raises ``RuntimeError`` when CUDA is available (this shim would hide a device problem there).
    """
    if torch.cuda.is_available():
        raise RuntimeError("megatron_on_cpu_any() is a CPU-only shim; CUDA is available, run megatron-core natively")
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
