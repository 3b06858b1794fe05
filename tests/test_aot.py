"""Ahead-of-time compilation of every kernel configuration for A100 (sm_80) and H100 (sm_90),
and a scan of the kernel sources for Triton APIs the GPU machine's Triton 3.6 lacks or 3.9 removed.

No GPU is needed: ``triton.compile`` produces cubin for a ``GPUTarget`` on any machine
(ENV.md). The launches compiled are the ones the launchers build for real calls
(``decode_launches`` / ``merge_launch``), specialised by Triton's own binder for the CUDA
backend, so the compiled set is exactly what a GPU run would JIT-compile for these calls.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from triton.runtime import jit

from megatron_tree.kernels import flash_decode as fd
from megatron_tree.kernels import merge as mk

KERNEL_DIR = Path(fd.__file__).parent
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# Shared memory one block may use (opt-in maximum): A100 163 KB of its 164 KB per SM,
# H100/H200 227 KB of 228 KB per SM (CUDA programming guide, compute capabilities table).
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _as_jit(kernel) -> jit.JITFunction:
    """The JITFunction behind a kernel (tests import kernels under TRITON_INTERPRET=1)."""
    if isinstance(kernel, jit.JITFunction):
        return kernel
    return jit.JITFunction(kernel.fn, **kernel.kwargs)


def _compile_args(launch, arch: int):
    """(key, ASTSource, options) exactly as the JIT would build them on a GPU of ``arch``."""
    kernel = _as_jit(launch.kernel)
    target = GPUTarget("cuda", arch, 32)
    backend = CUDABackend(target)
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, spec, opts)
    key = (kernel.fn.__name__, arch, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
           repr(sorted(attrs.items())), repr(sorted(options.__dict__.items())))
    return key, ASTSource(kernel, signature, constexprs, attrs), target, options


def _resources(compiled) -> dict:
    """Registers and spill stack of a compiled kernel, read from its cubin with cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    match = re.search(r"REG:(\d+) STACK:(\d+)", text)
    assert match, f"cuobjdump printed no resource usage:\n{text}"
    return {"regs": int(match.group(1)), "stack": int(match.group(2)), "shared": compiled.metadata.shared}


def _decode_calls():
    """Calls covering every decode_config the GPU path can return: each dtype x head dim
    (64..256, padded ones included) x query-row tile (16 / 64), plus causal, ragged, MQA and
    a strided cache slice -- these change runtime arguments, not the compiled set."""
    for dtype in DTYPES:
        for d in (64, 80, 96, 128, 256):
            for hq, hkv, sq in ((32, 8, 1), (32, 1, 1), (8, 2, 4)):
                q = torch.zeros(2, sq, hq, d, dtype=dtype)
                cache = torch.zeros(2, 96, hkv, d, dtype=dtype)
                yield q, cache, cache, {}
        q = torch.zeros(2, 4, 8, 128, dtype=dtype)
        big = torch.zeros(2, 128, 4, 128, dtype=dtype)  # a slice of a larger preallocated cache
        kv = big[:, :80, 1:3]
        pos = torch.arange(80)
        yield q, kv, kv, {"cache_seqlens": torch.tensor([0, 80], dtype=torch.int32),
                          "q_positions": torch.tensor([[76, 77, 78, 79]] * 2), "k_positions": pos}


def _all_launches():
    launches = []
    for q, k, v, kw in _decode_calls():
        launches += fd.decode_launches(q, k, v, **kw)[2]
    for dtype in DTYPES:  # ops.merge_states after comm's all-gather: outs in any dtype
        for d in (64, 80, 128, 256):
            outs = torch.zeros(4, 2, 1, 8, d, dtype=dtype)
            lses = torch.zeros(4, 2, 8, 1)
            launches.append(mk.merge_launch(outs, lses, outs[0].clone(), lses[0].clone()))
    return launches


def compile_all() -> dict:
    """Compile every unique launch for sm_80 and sm_90; return counts and per-kernel resources.

    Runs in a subprocess without TRITON_INTERPRET: with the interpreter enabled (as the test
    session has it) Triton's code generator fails on valid kernels.
    """
    unique = {}
    for launch in _all_launches():
        for arch in (80, 90):
            key, src, target, options = _compile_args(launch, arch)
            unique.setdefault(key, (src, target, options, launch))
    rows = []
    for key, (src, target, options, launch) in unique.items():
        try:
            compiled = triton.compile(src, target=target, options=options.__dict__)
        except Exception as e:  # name the configuration that failed
            raise RuntimeError(f"{key} failed to compile: {e}") from e
        rows.append({"kernel": key[0], "arch": target.arch, "dtype": str(launch.args[0].dtype),
                     "config": launch.kwargs, **_resources(compiled)})
    return {"kernels": rows}


def test_every_kernel_configuration_compiles_for_sm80_and_sm90_within_limits():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, cwd=root,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["kernels"]
    names = [r["kernel"] for r in rows]
    # Decode: fp16/bf16 x (3 head-dim tiles x 16-row tile + 2 wider row tiles) + fp32 x 3;
    # merge: 5 (partial dtype, output dtype) pairs x 3 head-dim tiles; per arch.
    assert names.count("_split_kv_kernel") == 2 * 13, rows
    assert names.count("_merge_kernel") == 2 * 15, rows
    assert {r["arch"] for r in rows} == {80, 90}
    report = "\n".join(str(r) for r in rows)
    for r in rows:
        assert r["regs"] <= 255, f"too many registers:\n{r}\n--- all:\n{report}"
        assert r["shared"] <= SMEM_LIMIT[r["arch"]], f"shared memory over the sm_{r['arch']} limit:\n{r}"
        # fp16/bf16 decode is the performance path: it must not spill registers either.
        if r["kernel"] == "_split_kv_kernel" and r["dtype"] != "torch.float32":
            assert r["stack"] == 0, f"register spills:\n{r}\n--- all:\n{report}"


# Every tl.* name the kernels may use: each exists in Triton 3.6 (the GPU machine) and in
# 3.7-3.9. A new name fails this test until someone checks it against those releases.
ALLOWED_TL = {
    "constexpr", "program_id", "arange", "load", "store", "zeros", "full", "dot", "trans",
    "where", "maximum", "minimum", "max", "sum", "exp", "exp2", "log", "log2",
    "float32", "int64", "int32",
}
BANNED = ("make_block_ptr", "advance", "make_tensor_descriptor", "_experimental_descriptor",
          "experimental_device_tensormap", "tensormap", "warp_specialize")


def _api_violations(source: str) -> list[str]:
    """Triton API uses in ``source`` that Triton 3.6 lacks or 3.9 removed (or not yet checked)."""
    tree = ast.parse(source)
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tl"}
    problems = [f"tl.{name} not checked against Triton 3.6/3.9" for name in sorted(used - ALLOWED_TL)]
    idents = ({n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
              | {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
              | {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
              | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)})
    problems += [f"{name}, missing in Triton 3.6 or removed in 3.9" for name in BANNED if name in idents]
    if any("extra" in i.split(".") for i in idents):
        problems.append("imports triton.language.extra")
    return problems


def test_kernel_sources_use_only_triton_apis_present_in_3_6_and_3_9():
    files = sorted(KERNEL_DIR.glob("*.py"))
    assert {p.name for p in files} >= {"flash_decode.py", "merge.py"}
    for path in files:
        assert _api_violations(path.read_text()) == [], path.name


def test_api_scan_catches_a_banned_call():
    # The scan above must be able to fail: each kind of violation is reported.
    head = "import triton.language as tl\n"
    assert _api_violations(head + "def f(p):\n    return tl.make_block_ptr(p)\n") == [
        "tl.make_block_ptr not checked against Triton 3.6/3.9", "make_block_ptr, missing in Triton 3.6 or removed in 3.9"]
    assert _api_violations(head + "def f(x):\n    return tl.cumsum(x, 0)\n") == [
        "tl.cumsum not checked against Triton 3.6/3.9"]
    assert _api_violations("from triton.language.extra import libdevice\n") == ["imports triton.language.extra"]
    assert _api_violations(head + "def f(x):\n    return tl.exp2(x)\n") == []


if __name__ == "__main__":  # the subprocess of the compile test
    print(json.dumps(compile_all()))
