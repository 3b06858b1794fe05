"""Run megatron-core 0.16.1's CUDA-assuming code on a CPU-only torch, for tests and CI.

Invariant: nothing here changes numerics; every replacement does on the CPU what the
replaced call does on the GPU (allocate on "the current device", move to it, time an
event), and :func:`megatron_on_cpu` restores every attribute it touched when it exits.
It exists because megatron-core calls ``torch.cuda.current_device()`` when it allocates
(RoPE, KV buffers, the inference controller) and pins host memory when it slices RoPE for
context parallelism; a CPU-only torch raises on both. It is never needed on a GPU and
:func:`megatron_on_cpu` refuses to run when CUDA is available, so it cannot hide a real
device problem there.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["megatron_on_cpu"]


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


@contextlib.contextmanager
def megatron_on_cpu():
    """Within the block, megatron-core's CUDA calls act on the CPU; everything is restored after.

    Replaces ``torch.cuda.current_device`` (-> ``"cpu"``), ``torch.cuda.Event``,
    ``torch.cuda.synchronize``, ``torch.Tensor.cuda`` (-> no move) and megatron's
    ``get_pos_emb_on_this_cp_rank`` (same chunks, no pinned memory).
    """
    if torch.cuda.is_available():
        raise RuntimeError("megatron_on_cpu() is a CPU-only shim; CUDA is available, run megatron-core natively")
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    saved = [
        (torch.cuda, "current_device"), (torch.cuda, "Event"), (torch.cuda, "synchronize"),
        (torch.Tensor, "cuda"), (rope_utils, "get_pos_emb_on_this_cp_rank"),
        (rotary_pos_embedding, "get_pos_emb_on_this_cp_rank"),
    ]
    originals = [(obj, name, getattr(obj, name)) for obj, name in saved]
    try:
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.Event = _CpuEvent
        torch.cuda.synchronize = lambda *a, **k: None
        torch.Tensor.cuda = lambda self, *a, **k: self
        rope_utils.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
        yield
    finally:
        for obj, name, value in originals:
            setattr(obj, name, value)
