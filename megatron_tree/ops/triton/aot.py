"""Ahead-of-time compilation of kernel launches for a GPU target, and what their machine code says.

Invariant: a :class:`~megatron_tree.ops.triton.merge.Launch` built by a launcher for CPU
tensors compiles here exactly as the JIT would compile it on a GPU of the given
architecture (Triton's own binder specialises the arguments), with no GPU present (docs/design.md, platform facts).
The SASS is read with the ``cuobjdump`` bundled in Triton, and :func:`sass_facts` counts the
instructions that decide a decode kernel's speed: 16-bit scalar loads (``LDG.E.U16``) versus
128-bit ones (``LDG.E.128``, asynchronous ``LDGSTS...128``), the tensor-core MMA kind
(bf16/fp16 ``HMMA.16816``/``HGMMA`` versus TF32), registers and spill stack.

Used by ``tests/ops/test_aot.py`` (sm_80 / sm_90 with the pinned Triton) and
``bench/aot_triton36.sh`` (the GPU machine's Triton 3.6, in its own virtual environment).
Must be imported without ``TRITON_INTERPRET=1``: the interpreter replaces the JIT functions.
Kernel tier: triton and torch only.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime import jit

__all__ = ["compile_key", "compile_launch", "sass", "resources", "sass_facts", "CUOBJDUMP"]

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _as_jit(kernel) -> jit.JITFunction:
    """The JITFunction behind a kernel (also one decorated under the interpreter)."""
    if isinstance(kernel, jit.JITFunction):
        return kernel
    return jit.JITFunction(kernel.fn, **kernel.kwargs)


def _prepare(launch, arch: int):
    kernel = _as_jit(launch.kernel)
    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, spec, opts)
    key = (kernel.fn.__name__, arch, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
           repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))
    return key, ASTSource(kernel, signature, constexprs, attrs), target, options


def compile_key(launch, arch: int) -> tuple:
    """What identifies the compiled kernel of ``launch`` on ``arch`` (equal keys: one binary)."""
    return _prepare(launch, arch)[0]


def compile_launch(launch, arch: int):
    """Compile ``launch`` for ``sm_<arch>``; returns Triton's compiled kernel (cubin in ``.asm``)."""
    key, src, target, options = _prepare(launch, arch)
    try:
        return triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # name the configuration that failed
        raise RuntimeError(f"{key} failed to compile: {e}") from e


def _cuobjdump(compiled, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(CUOBJDUMP), flag, f.name], capture_output=True, text=True, check=True).stdout


def sass(compiled) -> str:
    """The kernel's SASS as ``cuobjdump -sass`` prints it."""
    return _cuobjdump(compiled, "-sass")


def resources(compiled) -> dict:
    """Registers per thread, spill stack (bytes) and shared memory (bytes) of a compiled kernel."""
    text = _cuobjdump(compiled, "--dump-resource-usage")
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    if not match:
        raise RuntimeError(f"cuobjdump printed no resource usage:\n{text}")
    return {"regs": int(match.group(1)), "stack": int(match.group(2)), "shared": compiled.metadata.shared}


_MMA = re.compile(r"\b(HMMA\.\w+(?:\.\w+)*|HGMMA\.\w+(?:\.\w+)*)")


def sass_facts(text: str) -> dict:
    """Instruction counts that matter for a memory-bound kernel, from its SASS.

    ldg_u16: 16-bit scalar global loads; ldg_128: 128-bit synchronous loads;
    ldgsts_128: 128-bit asynchronous global->shared copies (cp.async); ldgsts_narrow: narrower
    ones; ldg_64 / ldg_32: other loads; stl / ldl: spill traffic; mma: each MMA opcode with its
    count (``HMMA.16816.F32.BF16``, ``HGMMA.64x64x16.F32.BF16``, ``HMMA.1688.F32.TF32`` ...);
    mufu_ex2: special-function exp2s; isetp: integer compares (masks by position or slot);
    instructions: every instruction but ``NOP`` (the padding after the kernel's end); opcodes: a
    digest of the opcode sequence (registers and constants left out), equal for two builds that
    run the same instructions.
    """
    lines = [ln.split("*/", 1)[1] if "*/" in ln else ln for ln in text.splitlines() if "/*" in ln]
    ops = [ln.strip().split(";")[0] for ln in lines]
    facts = {
        "ldg_u16": sum(bool(re.search(r"\bLDG\.E\.(U16|S16)\b", op)) for op in ops),
        "ldg_128": sum(bool(re.search(r"\bLDG\.E\.128\b", op)) for op in ops),
        "ldgsts_128": sum(bool(re.search(r"\bLDGSTS\.E(\.\w+)*\.128\b", op)) for op in ops),
        "ldgsts_narrow": sum(bool(re.search(r"\bLDGSTS\b", op)) and not re.search(r"\.128\b", op) for op in ops),
        "ldg_64": sum(bool(re.search(r"\bLDG\.E\.64\b", op)) for op in ops),
        "ldg_32": sum(bool(re.search(r"\bLDG\.E(\.(EL|EF|LU|CONSTANT|STRONG\.\w+))?\s", op + " ")) for op in ops),
        "stl": sum(bool(re.search(r"\bSTL\b", op)) for op in ops),
        "ldl": sum(bool(re.search(r"\bLDL\b", op)) for op in ops),
        "mufu_ex2": sum(bool(re.search(r"\bMUFU\.EX2\b", op)) for op in ops),
        "isetp": sum(bool(re.search(r"\bU?ISETP\b", op)) for op in ops),
        "instructions": sum(bool(op.strip()) and not re.fullmatch(r"(@!?U?P\w+\s+)?NOP", op.strip()) for op in ops),
        "mma": {},
    }
    for op in ops:
        m = _MMA.search(op)
        if m:
            facts["mma"][m.group(1)] = facts["mma"].get(m.group(1), 0) + 1
    mnemonics = [re.sub(r"^@!?U?P\w+\s+", "", op.strip()).split(" ")[0] for op in ops if op.strip()]
    facts["opcodes"] = hashlib.sha1("\n".join(mnemonics).encode()).hexdigest()[:16]
    return facts
