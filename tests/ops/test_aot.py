"""Machine code of the kernels, compiled ahead of time for A100 (sm_80) and H100 (sm_90), and
a scan of the kernel sources for Triton APIs the GPU machine's Triton 3.6 lacks or 3.9 removed.

No GPU is needed: ``kernels/aot.py`` compiles the launches the launchers build for real
calls (specialised by Triton's own binder for the CUDA backend) and reads their SASS with
Triton's bundled cuobjdump. The tests assert what a FlashDecoding-class kernel must be:
no 16-bit scalar loads, 128-bit asynchronous K/V loads, fp16/bf16 tensor-core MMAs (no
TF32), at most 168 registers and no spills; the merge kernel's loads are vectorised too.

Compilation runs once per session, in subprocesses without TRITON_INTERPRET (the test
session has the interpreter on, and Triton's code generator fails under it), split over
the CPU cores. ``MEGATRON_TREE_AOT_MATRIX=full`` compiles every configuration instead of
the representative set (``bench/aot_triton36.sh`` does that under Triton 3.6);
``MEGATRON_TREE_AOT_REPORT=path`` writes every row (with its instruction counts) as JSON.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
KERNEL_DIR = ROOT / "megatron_tree" / "ops" / "triton"
# Shared memory one block may use (opt-in maximum): A100 163 KB of its 164 KB per SM,
# H100/H200 227 KB of 228 KB per SM (CUDA programming guide, compute capabilities table).
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
MAX_REGS_LOWP = 168
"""fp16/bf16 decode: at most 168 registers, so 3 blocks of 4 warps fit an SM's 64K registers."""
LOWP = ("bfloat16", "float16")
N = 256
"""Cache length of the compiled calls: not a compile-time value (only strides' 16-divisibility
is), so small tensors compile exactly what a 512K cache would, in little memory."""


# ---- the configurations -------------------------------------------------------------------

def _decode_cases(full: bool):
    """(label, q, k, v, kwargs) of decode calls; every label names what it exercises.

    Representative set: fp16/bf16 x D 64/128/256 x GQA 32/8 (one split: the output written
    directly) and MQA 32/1 (32 query rows per program, split: fp32 partials + merge), plus
    D 80 causal with Sq 4 and cache_seqlens, paged (block ids per key and per tile) with
    fp32 output (tree_decode's call), and fp32 input; the attention variants (sliding window,
    soft-capping, cache_starts, paged with cache_starts, MLA's Dk != Dv, Gemma 2's window plus
    soft-capping). ``full`` adds D 80/96 everywhere, fp32 for every shape, every feature for
    every shape and every variant at D 80 and 256.
    """
    dtypes = (torch.bfloat16, torch.float16, torch.float32) if full else LOWP_T
    dims = (64, 80, 96, 128, 256) if full else (64, 128, 256)
    shapes = {"gqa": (32, 8, 1, 1), "mqa": (32, 1, 1, 3)}
    if full:
        shapes["mqa_sq2"] = (32, 1, 2, 3)  # 64 query rows: the widest row tile
    for dtype in dtypes:
        for d in dims:
            for name, (hq, hkv, sq, splits) in shapes.items():
                q, kv = torch.zeros(2, sq, hq, d, dtype=dtype), torch.zeros(2, N, hkv, d, dtype=dtype)
                yield {"variant": name, "dtype": str(dtype)[6:], "d": d, "heads": f"{hq}/{hkv}", "sq": sq}, \
                    q, kv, kv, {"num_splits": splits}
                if full and name != "mqa_sq2":  # the variants at a padded and the widest head dim
                    yield from _feature_cases(dtype, d, hq, hkv, sq, only=FEATURES + (VARIANTS if d in (80, 256) else ()))
    if not full:
        yield from _feature_cases(torch.bfloat16, 80, 8, 2, 4, only=("causal", "window"))
        yield from _feature_cases(torch.bfloat16, 128, 32, 8, 1, only=("paged16", "paged16_starts", "starts"))
        yield from _feature_cases(torch.float16, 128, 32, 8, 1, only=("paged256",))
        yield from _feature_cases(torch.bfloat16, 256, 32, 8, 1, only=("softcap",))
        yield from _variant_cases(torch.bfloat16)
        yield from _variant_cases(torch.float16, only=("mla",))
        q, kv = torch.zeros(2, 1, 32, 128), torch.zeros(2, N, 8, 128)
        yield {"variant": "gqa", "dtype": "float32", "d": 128, "heads": "32/8", "sq": 1}, q, kv, kv, {}
        yield from _variant_cases(torch.float32, only=("gemma2",))
    else:
        for dtype in dtypes:
            yield from _variant_cases(dtype)


LOWP_T = (torch.bfloat16, torch.float16)
FEATURES = ("causal", "paged16", "paged256")
VARIANTS = ("window", "softcap", "starts", "paged16_starts")


def _feature_cases(dtype, d, hq, hkv, sq, only=FEATURES + VARIANTS):
    """The compile-time switches: causal with per-row cache_seqlens; paged caches whose blocks
    are smaller (16: one block id per key) or larger (256: one per tile) than a tile, with
    fp32 output (what tree_decode asks for); and the attention variants on the same shapes, so
    each can be compared with the build without it (:func:`test_variants_are_compiled_out_when_off`):
    ``window`` (causal plus a sliding window), ``softcap``, ``starts`` (cache_starts) and
    ``paged16_starts`` (a paged window as a slot range)."""
    label = {"dtype": str(dtype)[6:], "d": d, "heads": f"{hq}/{hkv}", "sq": sq}
    q = torch.zeros(2, sq, hq, d, dtype=dtype)
    kv = torch.zeros(2, N, hkv, d, dtype=dtype)
    causal = {"cache_seqlens": torch.tensor([0, N], dtype=torch.int32),
              "q_positions": torch.arange(N - sq, N).expand(2, sq), "k_positions": torch.arange(N)}
    if "causal" in only:
        yield {"variant": "causal", **label}, q, kv, kv, causal
    if "window" in only:
        yield {"variant": "window", **label}, q, kv, kv, {**causal, "window": 100}
    if "softcap" in only:
        yield {"variant": "softcap", **label}, q, kv, kv, {"softcap": 50.0}
    if "starts" in only:
        yield {"variant": "starts", **label}, q, kv, kv, {"cache_starts": torch.tensor([3, 100], dtype=torch.int32)}
    for page in (16, 256):
        for starts in ("", "_starts"):
            if f"paged{page}{starts}" in only:
                pool = torch.zeros(2 * N // page + 1, page, hkv, d, dtype=dtype)
                table = torch.zeros(2, N // page, dtype=torch.int32)
                extra = {"cache_starts": torch.tensor([40, 0], dtype=torch.int32)} if starts else {}
                yield {"variant": f"paged{page}{starts}", **label}, q, pool, pool, {
                    "block_table": table, "cache_seqlens": torch.tensor([100, N], dtype=torch.int32),
                    "out_dtype": torch.float32, **extra}


def _variant_cases(dtype, only=("mla", "gemma2")):
    """Model-shaped variants: ``mla`` -- K and V of different head dims (transformers'
    DeepSeek-V3 caches k of 192 = 128 + 64 rope dims and v of 128 per head, 16/16 heads here)
    with fp32 partials (what tree_decode asks for); ``gemma2`` -- Gemma 2's sliding window and
    soft-capping together (head dim 256, 2 query heads per KV head, Sq 1)."""
    name = str(dtype)[6:]
    if "mla" in only:
        q, k, v = (torch.zeros(2, 1, 16, 192, dtype=dtype), torch.zeros(2, N, 16, 192, dtype=dtype),
                   torch.zeros(2, N, 16, 128, dtype=dtype))
        yield {"variant": "mla", "dtype": name, "d": 192, "dv": 128, "heads": "16/16", "sq": 1}, q, k, v, {
            "cache_seqlens": torch.tensor([7, N], dtype=torch.int32), "out_dtype": torch.float32}
    if "gemma2" in only:
        q, kv = torch.zeros(2, 1, 16, 256, dtype=dtype), torch.zeros(2, N, 8, 256, dtype=dtype)
        yield {"variant": "gemma2", "dtype": name, "d": 256, "heads": "16/8", "sq": 1}, q, kv, kv, {
            "cache_seqlens": torch.tensor([N - 9, N], dtype=torch.int32), "q_positions": torch.tensor([[N], [N]]),
            "k_positions": torch.arange(N), "window": 64, "softcap": 50.0, "out_dtype": torch.float32}


def _merge_cases(full: bool):
    """ops.merge_states after comm's all-gather (partials in any dtype) and the decode combine."""
    from megatron_tree.ops.triton import merge as mk

    combos = [(torch.float32, torch.bfloat16, 128, 8), (torch.float32, torch.float32, 80, 130),
              (torch.float16, torch.float16, 64, 2)]
    if full:
        combos = [(src, dst, d, p) for src in (torch.float32, torch.bfloat16, torch.float16)
                  for dst in ({src, torch.bfloat16, torch.float16} if src == torch.float32 else {src})
                  for d in (64, 80, 128, 256) for p in (2, 130)]
    for src, dst, d, p in combos:
        outs = torch.zeros(p, 2, 1, 8, d, dtype=src)
        lses = torch.zeros(p, 2, 8, 1)
        out = torch.zeros(2, 1, 8, d, dtype=dst)
        yield ({"variant": "merge", "dtype": str(src)[6:], "out": str(dst)[6:], "d": d, "p": p},
               mk.merge_launch(outs, lses, out, lses[0].clone()))


def _launches(full: bool):
    """(label, launch) of every kernel launch the cases build, decode kernels and merges."""
    from megatron_tree.ops.triton import flash_decode as fd

    for label, q, k, v, kw in _decode_cases(full):
        _, _, launches = fd.decode_launches(q, k, v, **kw)
        label = {**label, "out": str(launches[0].args[7].dtype)[6:], "splits": launches[0].grid[1]}
        yield {**label, "kernel": "decode"}, launches[0]
        if len(launches) == 2:  # the combine of the splits' fp32 partials
            outs, out = launches[1].args[0], launches[1].args[2]
            yield ({"kernel": "merge", "variant": f"{label['variant']} combine", "dtype": str(outs.dtype)[6:],
                    "out": str(out.dtype)[6:], "d": outs.shape[-1], "p": outs.shape[0]}, launches[1])
    for label, launch in _merge_cases(full):
        yield {**label, "kernel": "merge"}, launch


def compile_rows(full: bool, shard: int, shards: int) -> list[dict]:
    """Compile this shard's unique launches for sm_80 and sm_90; one row per compiled kernel."""
    from megatron_tree.ops.triton import aot

    unique = {}
    for label, launch in _launches(full):
        for arch in (80, 90):
            unique.setdefault(aot.compile_key(launch, arch), ({**label, "arch": arch}, launch))
    rows = []
    for i, (label, launch) in enumerate(unique.values()):
        if i % shards != shard:
            continue
        compiled = aot.compile_launch(launch, label["arch"])
        cfg = {k: v for k, v in launch.kwargs.items() if k.isupper() or k.startswith("num_")}
        rows.append({**label, "config": cfg, **aot.resources(compiled), **aot.sass_facts(aot.sass(compiled))})
    return rows


@pytest.fixture(scope="session")
def rows():
    full = os.environ.get("MEGATRON_TREE_AOT_MATRIX", "ci") == "full"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    shards = max(1, min(4, os.cpu_count() or 1))

    def run(shard):
        cmd = [sys.executable, __file__, "full" if full else "ci", str(shard), str(shards)]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)

    with ThreadPoolExecutor(shards) as pool:
        procs = list(pool.map(run, range(shards)))
    out = []
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-6000:]
        out += json.loads(proc.stdout.strip().splitlines()[-1])
    report = os.environ.get("MEGATRON_TREE_AOT_REPORT")
    if report:
        Path(report).write_text(json.dumps(out, indent=1))
    return out


def _show(rs) -> str:
    keys = ("kernel", "variant", "dtype", "out", "d", "dv", "heads", "arch", "regs", "stack", "shared", "ldg_u16",
            "ldg_128", "ldgsts_128", "mma")
    return "\n".join(str({k: r.get(k) for k in keys}) for r in rs)


# ---- the checks -------------------------------------------------------------------------------

def test_every_configuration_compiles_for_sm80_and_sm90_within_limits(rows):
    decode = [r for r in rows if r["kernel"] == "decode"]
    merge = [r for r in rows if r["kernel"] == "merge"]
    assert {r["arch"] for r in rows} == {80, 90} and len(decode) >= 2 * 16 and len(merge) >= 2 * 6, _show(rows)
    for r in rows:
        assert r["regs"] <= 255 and r["shared"] <= SMEM_LIMIT[r["arch"]], _show([r])
        assert r["stack"] == 0 and r["stl"] == 0, f"register spills:\n{_show([r])}"


@pytest.mark.parametrize("arch", [80, 90])
def test_lowp_decode_streams_kv_with_128bit_async_loads_into_bf16_fp16_tensor_cores(rows, arch):
    """For bf16/fp16, D 64/128/256, GQA and MQA (and the causal and paged variants):
    no 16-bit scalar load anywhere (the K/V loop included), K/V tiles copied global->shared
    128 bits at a time by cp.async (LDGSTS.128) and pipelined (the copies of the prologue's
    stages and of the loop body: >= 3 per tile per thread), MMAs on fp16/bf16 operands with
    fp32 accumulation and no TF32, <= 168 registers, no spills."""
    lowp = [r for r in rows if r["kernel"] == "decode" and r["dtype"] in LOWP and r["arch"] == arch]
    covered = {(r["dtype"], r["d"], r["variant"]) for r in lowp}
    for dtype in LOWP:
        for d in (64, 128, 256):
            assert {(dtype, d, "gqa"), (dtype, d, "mqa")} <= covered, sorted(covered)
    assert {"causal", "paged16", "paged256", *VARIANTS, "mla", "gemma2"} <= {r["variant"] for r in lowp}
    # mma.sync m16n8k16 (HMMA.16816) or, for 64-row tiles on sm_90, wgmma (HGMMA); never TF32.
    want = {"bfloat16": r"(HMMA\.16816|HGMMA\.64x\d+x16)\.F32\.BF16", "float16": r"(HMMA\.16816|HGMMA\.64x\d+x16)\.F32"}
    for r in lowp:
        assert r["mma"] and all(re.fullmatch(want[r["dtype"]], op) for op in r["mma"]), f"MMA kind:\n{_show([r])}"
        assert r["ldg_u16"] == 0, f"16-bit scalar loads:\n{_show([r])}"
        # one K tile (BLOCK_D wide) and one V tile (BLOCK_DV: MLA's V is narrower) per stage
        cfg = r["config"]
        tile_copies = cfg["BLOCK_N"] * (cfg["BLOCK_D"] + cfg["BLOCK_DV"]) * 2 // (16 * 32 * cfg["num_warps"])
        assert r["ldgsts_128"] >= 3 * tile_copies, f"K/V copies not 128-bit or not pipelined:\n{_show([r])}"
        assert r["regs"] <= MAX_REGS_LOWP and r["stack"] == 0, _show([r])


def test_fp32_decode_keeps_fp32_accuracy_on_tensor_cores(rows):
    fp32 = [r for r in rows if r["kernel"] == "decode" and r["dtype"] == "float32"]
    assert fp32
    for r in fp32:  # 3xTF32: three TF32 MMAs per product (hi*hi, hi*lo, lo*hi)
        assert set(r["mma"]) == {"HMMA.1688.F32.TF32"} and r["config"]["DOT_PRECISION"] == "tf32x3", _show([r])


def test_non_causal_decode_loads_no_positions(rows):
    """causal is a compile-time switch: only the causal builds (causal, window, gemma2) load
    positions (and cache_seqlens), with narrow loads, and cache_starts is one narrow load of its
    own; a plain call's kernel -- soft-capped or MLA too -- has no load but q's and K/V's 128-bit ones."""
    decode = [r for r in rows if r["kernel"] == "decode"]
    for r in decode:
        narrow = r["ldg_64"] + r["ldg_32"] + r["ldgsts_narrow"] + r["ldg_u16"]
        if r["variant"] in ("causal", "window", "gemma2"):
            assert narrow >= 2, _show([r])
        elif r["variant"] == "starts":
            assert narrow >= 1, _show([r])
        elif r["variant"] in ("gqa", "mqa", "mqa_sq2", "softcap"):
            assert narrow == 0, _show([r])


# variant -> the build of the same shape without it (the plain GQA shape's; the full matrix also
# has variants of shapes whose plain build differs in more, e.g. MQA's split count: not compared)
_WITHOUT = {"window": "causal", "softcap": "gqa", "starts": "gqa", "paged16_starts": "paged16"}


def test_variants_are_compiled_out_when_off(rows):
    """Each variant is a compile-time switch: its build of a shape runs other instructions than the
    build without it, and more of those it needs -- MUFU.EX2 for soft-capping's tanh, a load of
    the row's start for cache_starts (a window replaces the causal compare by one unsigned
    compare: the same count) -- so a call without it runs none of its code."""
    decode = [r for r in rows if r["kernel"] == "decode"]
    key = lambda r, variant: (variant, r["dtype"], r["d"], r["heads"], r["sq"], r["arch"])  # noqa: E731
    by_key = {key(r, r["variant"]): r for r in decode}
    pairs = [(r, by_key.get(key(r, _WITHOUT[r["variant"]]))) for r in decode if r["variant"] in _WITHOUT]
    pairs = [(with_, without) for with_, without in pairs if without is not None
             and with_["out"] == without["out"] and with_["splits"] == without["splits"]]
    assert {r["variant"] for r, _ in pairs} == set(_WITHOUT), sorted({r["variant"] for r in decode})
    for with_, without in pairs:
        assert with_["opcodes"] != without["opcodes"], _show([with_, without])
        fact = {"softcap": "mufu_ex2", "starts": "ldg_32"}.get(with_["variant"])
        if fact:
            assert with_[fact] > without[fact], (fact, _show([with_, without]))


def test_merge_kernel_reads_partials_with_vector_loads(rows):
    merge = [r for r in rows if r["kernel"] == "merge"]
    assert {r["dtype"] for r in merge} >= {"float32", "float16"}
    for r in merge:
        assert r["ldg_u16"] == 0 and r["ldg_128"] + r["ldgsts_128"] >= 1 and r["regs"] <= MAX_REGS_LOWP, _show([r])


# Every tl.* name the kernels may use: each exists in Triton 3.6 (the GPU machine) and in
# 3.7-3.9. A new name fails this test until someone checks it against those releases.
ALLOWED_TL = {
    "constexpr", "program_id", "arange", "load", "store", "zeros", "full", "dot", "trans",
    "where", "maximum", "minimum", "max", "sum", "exp", "exp2", "log", "log2", "abs",
    "float32", "float64", "float16", "bfloat16", "int64", "int32", "uint32",
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


def test_sass_facts_read_the_instructions_that_matter():
    """The counter the checks above rely on, on hand-written SASS lines in cuobjdump's format."""
    from megatron_tree.ops.triton.aot import sass_facts

    sass = "\n".join(f"        /*{i:04x}*/                   {op} ;  /* 0x0 */" for i, op in enumerate([
        "LDG.E.U16 R4, desc[UR4][R2.64]", "LDG.E.128 R8, desc[UR4][R6.64]",
        "LDGSTS.E.BYPASS.LTC128B.128 [R3], desc[UR4][R4.64]", "@P0 LDGSTS.E.BYPASS.LTC128B.128.ZFILL [R3+0x800], desc[UR4][R6.64]",
        "LDG.E.64 R10, desc[UR4][R12.64]", "LDG.E R5, desc[UR4][R2.64]", "HMMA.16816.F32.BF16 R20, R4, R8, R20",
        "HMMA.16816.F32.BF16 R24, R4, R10, R24", "HMMA.1688.F32.TF32 R0, R2, R4, R0", "STL [R1], R6",
        "LDGSTS.E.64 [R5+0x100], desc[UR4][R8.64]",
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24", "MUFU.EX2 R3, R2", "ISETP.GE.AND P0, PT, R2, R3, PT",
        "NOP"]))
    facts = sass_facts(sass)
    digest = facts.pop("opcodes")
    assert re.fullmatch(r"[0-9a-f]{16}", digest)
    assert sass_facts(sass.replace("HMMA.1688.F32.TF32 R0", "HMMA.1688.F32.TF32 R8"))["opcodes"] == digest
    assert sass_facts(sass.replace("STL [R1], R6", "STL.64 [R1], R6"))["opcodes"] != digest
    assert facts == {"ldg_u16": 1, "ldg_128": 1, "ldgsts_128": 2, "ldgsts_narrow": 1, "ldg_64": 1, "ldg_32": 1,
                     "stl": 1, "ldl": 0, "mufu_ex2": 1, "isetp": 1, "instructions": 14,
                     "mma": {"HMMA.16816.F32.BF16": 2, "HMMA.1688.F32.TF32": 1, "HGMMA.64x64x16.F32.BF16": 1}}


if __name__ == "__main__":  # a compile shard, run by the fixture: matrix shard shards
    matrix, shard, shards = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(compile_rows(matrix == "full", shard, shards)))
