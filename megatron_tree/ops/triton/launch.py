"""A kernel launch built but not run, and the fast way a planned one runs again.

Invariant: :meth:`Launch.run` launches exactly what ``kernel[grid](*args, **kwargs)`` launches --
the same compiled kernel, on the same stream, with the same arguments and launch hooks. A launch
that a launcher planned (one :class:`FastSlot` per planned launch, shared by every call of that
signature) runs the first time through Triton's JIT (``JITFunction.run``) and keeps the compiled
kernel it returns; later calls hand their arguments to that compiled kernel directly. What the JIT
does per call besides -- bind and specialise every argument, build the cache key, look the kernel
up -- is its binder: about 14 us of host time per launch on this project's CPUs
(``benchmarks/launch_overhead.py``), a third of an eager decode call's.

That is exact because of what a plan fixes. The JIT picks a compiled kernel by the constexprs and
options (a plan's constants), each integer argument's value class (1, divisible by 16, other: a
plan's integers are fixed), each tensor's dtype (fixed by the plan's signature) and whether each
tensor's address is 16-byte aligned -- the one thing a call can change, so the fast path runs only
when every tensor is aligned and the kept kernel was compiled for aligned tensors; any other call
goes through the JIT. Also through the JIT: the interpreter (``TRITON_INTERPRET=1``), another
current device than the kept kernel's, a kernel with pre-run hooks (``JITFunction.add_pre_run_hook``:
the JIT calls them on every launch), ``MEGATRON_TREE_FAST_LAUNCH=0``, and Triton releases other
than those whose ``JITFunction.run`` this was checked against (:data:`CHECKED_TRITON`). Not seen
after a plan's first call: a change of the compile options the JIT reads per call
(``knobs.runtime.debug``, ``knobs.compilation.instrumentation_mode``, 3.7's
``knobs.runtime.add_stages_inspection_hook``) -- set them before it, or turn the fast launch off.
``tests/ops/test_launch.py`` holds the argument order and the specialisation to Triton's own binder
on CPU; the CUDA tests there compare the two paths' bits.

Kernel tier: triton and torch only.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import triton
from triton.runtime.jit import JITFunction

__all__ = ["Launch", "FastSlot", "FAST_LAUNCH", "CHECKED_TRITON", "ENV_FAST_LAUNCH"]

CHECKED_TRITON = ("3.6.", "3.7.")
"""Triton releases whose ``JITFunction.run`` the fast path repeats (read from their source: the same
``CompiledKernel.run`` call with the launch metadata and hooks, the same alignment specialisation)."""
ENV_FAST_LAUNCH = "MEGATRON_TREE_FAST_LAUNCH"
FAST_LAUNCH = os.environ.get(ENV_FAST_LAUNCH, "1") != "0" and triton.__version__.startswith(CHECKED_TRITON)
"""Whether planned launches keep and reuse their compiled kernel (read at import; tests may set it)."""


class FastSlot:
    """The compiled kernel of one planned launch, kept from its first run through the JIT.

    tensors: how many leading arguments of the launch are tensors (the rest are fixed by the plan).
    """

    __slots__ = ("tensors", "compiled", "device", "constexprs")

    def __init__(self, tensors: int):
        self.tensors = tensors
        self.compiled = None
        self.device = None
        self.constexprs = ()


def _aligned(args: tuple, n: int) -> bool:
    """Whether the first ``n`` arguments (tensors) all start 16-byte aligned, as Triton specialises them."""
    for t in args[:n]:
        if t.data_ptr() % 16:
            return False
    return True


def constexpr_values(kernel, n_args: int, kwargs: dict) -> tuple:
    """The values of ``kernel``'s parameters after its first ``n_args``, in its signature's order: what
    ``kwargs`` names, else the parameter's default -- the tail of the arguments the JIT hands the compiled
    kernel (its binder binds every parameter; launch options such as ``num_warps`` are not parameters)."""
    names = list(kernel.signature.parameters.items())[n_args:]
    return tuple(kwargs[name] if name in kwargs else param.default for name, param in names)


class Launch(NamedTuple):
    """One kernel launch, built but not run: ``kernel[grid](*args, **kwargs)``.

    Launchers return these so that ``tests/ops/test_aot.py`` can compile, for sm_80 and sm_90,
    exactly the specialisations a real call launches. ``fast``: the :class:`FastSlot` of a planned
    launch (its leading arguments are its tensors), or None.
    """

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    fast: FastSlot | None = None

    def run(self) -> None:
        slot = self.fast
        if slot is not None and slot.compiled is not None and FAST_LAUNCH and not self.kernel.pre_run_hooks:
            active = triton.runtime.driver.active
            device = active.get_current_device()
            if device == slot.device and _aligned(self.args, slot.tensors):
                compiled, grid = slot.compiled, self.grid
                stream = active.get_current_stream(device)
                params = self.args + slot.constexprs
                hooks = triton.knobs.runtime
                compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                             compiled.function, compiled.packed_metadata,
                             compiled.launch_metadata(grid, stream, *params), hooks.launch_enter_hook,
                             hooks.launch_exit_hook, *params)
                return
        compiled = self.kernel[self.grid](*self.args, **self.kwargs)
        if slot is not None and FAST_LAUNCH and slot.compiled is None and isinstance(self.kernel, JITFunction) \
                and compiled is not None and _aligned(self.args, slot.tensors):
            if hasattr(compiled, "result"):  # Triton 3.6 may hand back a future of an asynchronous compile
                compiled = compiled.result()
            slot.constexprs = constexpr_values(self.kernel, len(self.args), self.kwargs)
            slot.device = triton.runtime.driver.active.get_current_device()
            slot.compiled = compiled
