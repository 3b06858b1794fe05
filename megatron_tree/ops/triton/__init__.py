"""Triton kernels: split-KV flash decoding (``flash_decode``) and the partial-state merge (``merge``).

Invariant: this package is the kernel tier -- ``@triton.jit`` code and launchers that check
shapes, allocate and build grids. It imports triton and torch only (never torch.distributed
or another megatron_tree layer), so it can be compiled ahead of time on a machine without a
GPU. Submodules are imported explicitly
(``from megatron_tree.ops.triton import flash_decode``): ``TRITON_INTERPRET`` is read when the
kernels are decorated, so importing them here would fix that choice too early.
"""
