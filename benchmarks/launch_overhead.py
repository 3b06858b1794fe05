"""The host time of an eager GPU call, in its parts, measured on a CPU (no GPU needed).

An eager ``mt.flash_decode`` on CUDA tensors spends its host time in two places: this package's Python
(input checks, the custom op, the backend choice, building the launch: :func:`~megatron_tree.ops.triton.
flash_decode.run_plan`) and Triton's own launch path (``kernel[grid](...)``: its binder
specialises every argument and builds the cache key, then the C launcher runs). Issue 31 bounds the whole
at 40 us per call on the GPU machine. Both parts are Python and can be timed here:

- ``ours``: ``mt.flash_decode(..., backend="triton")`` / ``mt.merge_states(..., backend="triton")`` on CPU
  tensors with the kernel launch replaced by a no-op -- the package's whole path up to ``kernel[grid]``;
- ``build_launches``: building the launches alone (a part of ``ours``): what ``ours`` calls for it --
  :func:`~megatron_tree.ops.triton.flash_decode.run_plan` with the plan its signature keeps (the outputs,
  partials and launches, each launch's ``run`` the no-op), in code before it ``decode_launches``;
- ``triton_binder``: what ``JITFunction.run`` does for the same launch before the C launcher -- the binder
  of Triton's CUDA backend (sm_90) and the cache key -- per launch of the call (split kernel and merge);
  since planned launches keep their compiled kernel (``megatron_tree/ops/triton/launch.py``), only a
  signature's first call (or every call with ``MEGATRON_TREE_FAST_LAUNCH=0``) pays it;
- ``fast_launch``: what a planned launch does instead on the calls after the first, before the C launcher:
  the 16-byte alignment test of its tensors and the argument tuple (not counted: Triton's
  ``launch_metadata`` and torch's current device and stream, which need a GPU).

``total`` is ``ours`` + ``fast_launch`` (a signature's every call after its first); ``total, JIT`` is
``ours`` + ``triton_binder`` (every call through Triton's JIT).

Split counts are chosen for an H200's wave (:data:`H200_WAVE`), so the launches are the GPU's: a split
kernel and the merge of its partials where the grid is small. Not counted: the C launcher and the driver (a few us per launch on the GPU machine) and CUDA's caching
allocator (``torch.empty`` on CUDA, against CPU's here). The CPU tensors' value checks (``cache_seqlens``
read on the host, which CUDA tensors skip) are inside ``ours``, so it overstates the GPU path a little.
Times are this machine's CPU's: compare the parts with each other, not with a GPU host's.

Same clock and rounds as ``benchmarks.host_path``: median over interleaved rounds of the mean thread CPU
time per call, one thread.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m benchmarks.launch_overhead --out benchmarks/results/launch_overhead.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch

__all__ = ["main"]

SHAPES = {"llama8b_32k": (1, 32, 8, 128, 32768), "llama8b_b8_4k": (8, 32, 8, 128, 4096),
          "llama8b_b64_4k": (64, 32, 8, 128, 4096)}
"""Name -> B, Hq, Hkv, D, N of a bf16 decode call (one query token); N only sets the split count."""
H200_WAVE = 132 * 3
"""Programs per wave the split count is chosen for, as on an H200: 132 SMs x 3 resident programs of the bf16
decode kernel (<= 168 registers x 4 warps); CPU's stand-in wave would choose other split counts, so other launches."""


def _binder(launch):
    """A callable doing, for ``launch``, what Triton's ``JITFunction.run`` does before the C launcher on sm_90:
    bind and specialise the arguments (its binder for the CUDA backend) and build the kernel cache key."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime import jit

    from megatron_tree.ops.triton.aot import _as_jit

    kernel = _as_jit(launch.kernel)
    binder = jit.create_function_from_signature(kernel.signature, kernel.params, CUDABackend(GPUTarget("cuda", 90, 32)))
    args, kwargs = launch.args, {**launch.kwargs, "debug": False}
    key_cache: dict = {}
    compute_key = getattr(jit, "compute_cache_key", None)  # Triton >= 3.5 memoises the key per specialisation

    def bind():
        _, specialization, options = binder(*args, **kwargs)
        if compute_key is not None:
            return compute_key(key_cache, specialization, options)
        return str(specialization) + str(options)

    return bind


def _fast(launch):
    """A callable doing, for ``launch`` (planned: it has a fast slot), what :meth:`Launch.run` does in Python on the
    calls after a signature's first before the C launcher: the tensors' alignment test and the argument tuple."""
    from megatron_tree.ops.triton.aot import _as_jit
    from megatron_tree.ops.triton.launch import _aligned, constexpr_values

    args, n = launch.args, launch.fast.tensors
    constexprs = constexpr_values(_as_jit(launch.kernel), len(args), launch.kwargs)

    def fast():
        return _aligned(args, n) and args + constexprs

    return fast


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="a JSON path (a markdown table is written beside it)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--before", default=None,
                    help="a JSON this script wrote for other code (e.g. the commit before a change): its times go "
                         "beside this run's in the markdown and under 'before' in the JSON")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("benchmarks.launch_overhead: set TRITON_INTERPRET=1 (CPU tensors take the Triton path "
                         "through the interpreter's kernel objects; no kernel runs)")
    torch.set_num_threads(1)
    import megatron_tree as mt
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    from .host_path import _time, write

    from megatron_tree.ops import dispatch

    run, waves, moded = mk.Launch.run, fd.waves, dispatch._moded
    mk.Launch.run = lambda self: None  # no kernel runs: the host path up to kernel[grid] is what is timed
    fd.waves = lambda launch, device: H200_WAVE  # the GPU's split counts, so the GPU's launches
    clear_plans = getattr(fd, "clear_plans", lambda: None)  # (code before launch plans: --before runs)
    clear_plans()  # split counts are planned once per call signature: none planned with another wave
    via_op = [False]
    # the per-call test of the direct path, refused while a *_via_op callable runs: the same call through the op
    dispatch._moded = lambda t: via_op[0] or moded(t)

    def through_the_op(call):
        def timed():
            via_op[0] = True
            try:
                return call()
            finally:
                via_op[0] = False
        return timed

    # which path a plain CUDA tensor takes in this code: the direct one since dispatch._plain admits CUDA (before,
    # dispatch._plain_cpu sent CUDA through the op)
    cuda_path = "direct" if hasattr(dispatch, "_plain") else "via_op"
    try:
        rows = []
        for name, (b, hq, hkv, d, n) in SHAPES.items():
            g = torch.Generator().manual_seed(0)
            q = torch.randn(b, 1, hq, d, generator=g).to(torch.bfloat16)
            k = torch.zeros(b, n, hkv, d, dtype=torch.bfloat16)
            lens = torch.full((b,), n - 3, dtype=torch.int32)
            outs, lses = torch.randn(2, b, 1, hq, d, generator=g), torch.randn(2, b, hq, 1, generator=g)
            _, _, launches = fd.decode_launches(q, k, k, cache_seqlens=lens)
            if hasattr(fd, "run_plan"):  # the signature's plan, as flash_decode's direct path keeps it
                plan = fd.plan_of(q, k, k, None, lens, None, None, None, None, None, None, None, None, None, None,
                                  None)
                build = lambda: fd.run_plan(plan, q, k, k, None, lens, None, None, None)  # noqa: E731
            else:
                build = lambda: fd.decode_launches(q, k, k, cache_seqlens=lens)  # noqa: E731
            planned = hasattr(mk, "planned_launch")  # launches with a fast slot (not in code before them)
            merge = mk.planned_launch(outs, lses)[2] if planned else \
                mk.merge_launch(outs, lses, torch.empty(b, 1, hq, d), torch.empty(b, hq, 1))
            binders = [_binder(launch) for launch in launches]
            fasts = [_fast(launch) for launch in launches] if planned else []
            decode = lambda: mt.flash_decode(q, k, k, cache_seqlens=lens, backend="triton")  # noqa: E731
            merge_call = lambda: mt.merge_states(outs, lses, backend="triton")  # noqa: E731
            fns = {
                "flash_decode_direct": decode,
                "flash_decode_via_op": through_the_op(decode),
                "build_launches": build,
                "flash_decode_triton_binder": lambda: [bind() for bind in binders],
                **({"flash_decode_fast_launch": lambda: [fast() for fast in fasts]} if planned else {}),
                "merge_states_direct": merge_call,
                "merge_states_via_op": through_the_op(merge_call),
                "merge_states_triton_binder": _binder(merge),
                **({"merge_states_fast_launch": _fast(merge)} if planned else {}),
            }
            times = _time(fns, args.rounds, args.reps, args.warmup)
            us = {key: t["median_us"] for key, t in times.items()}
            rows.append({"shape": name, "B": b, "Hq": hq, "Hkv": hkv, "D": d, "N": n, "launches": len(launches),
                         "times": times,
                         "flash_decode_total_us": us[f"flash_decode_{cuda_path}"]
                         + us.get("flash_decode_fast_launch", us["flash_decode_triton_binder"]),
                         "flash_decode_total_jit_us": us[f"flash_decode_{cuda_path}"]
                         + us["flash_decode_triton_binder"],
                         "merge_states_total_us": us[f"merge_states_{cuda_path}"]
                         + us.get("merge_states_fast_launch", us["merge_states_triton_binder"]),
                         "merge_states_total_jit_us": us[f"merge_states_{cuda_path}"]
                         + us["merge_states_triton_binder"]})
    finally:
        mk.Launch.run, fd.waves, dispatch._moded = run, waves, moded
        clear_plans()
    import triton

    result = {"command": "TRITON_INTERPRET=1 PYTHONPATH=$PWD python -m benchmarks.launch_overhead "
                         + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
              "cpu": platform.processor() or platform.machine(), "rounds": args.rounds, "reps": args.reps,
              "cuda_path": cuda_path, "rows": rows}
    return write(result, args.before, args.out, _markdown)


def _markdown(result: dict) -> str:
    path = result.get("cuda_path", "via_op")
    lines = ["# Host time of an eager GPU call, in its parts, on this CPU", "",
             f"`{result['command']}` -- torch {result['torch']}, triton {result['triton']}, {result['rounds']} rounds x "
             f"{result['reps']} calls, median of the mean thread CPU time per call (us)", "",
             f"A plain CUDA tensor takes the **{'direct path' if path == 'direct' else 'path through the op'}** in this "
             "code. total = that path + the fast launch (a planned launch's calls after its signature's first); "
             "total, JIT = that path + Triton's binder and key (every call through Triton's JIT).", "",
             "| call (bf16) | launches | ours, direct | ours, through the op | of which building the launches | "
             "fast launch | Triton's binder + key | total | total, JIT |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        t = {k: v["median_us"] for k, v in r["times"].items()}
        shape = f"B {r['B']}, {r['Hq']}/{r['Hkv']}, D {r['D']}, N {r['N']}"
        lines.append(f"| flash_decode {shape} | {r['launches']} | {t['flash_decode_direct']:.1f} | "
                     f"{t['flash_decode_via_op']:.1f} | {_build(t):.1f} | "
                     f"{t.get('flash_decode_fast_launch', math.nan):.1f} | {t['flash_decode_triton_binder']:.1f} | "
                     f"{r['flash_decode_total_us']:.1f} | {r['flash_decode_total_jit_us']:.1f} |")
        lines.append(f"| merge_states P 2, {shape} | 1 | {t['merge_states_direct']:.1f} | {t['merge_states_via_op']:.1f} "
                     f"| | {t.get('merge_states_fast_launch', math.nan):.1f} | {t['merge_states_triton_binder']:.1f} | "
                     f"{r['merge_states_total_us']:.1f} | {r['merge_states_total_jit_us']:.1f} |")
    if "before" in result:
        lines += ["", f"Before (`{result['before']['command']}`), run right before this one -> this run, us "
                  "(the path a CUDA tensor takes in each; total: with its launch path after a signature's first call "
                  "-- Triton's binder and key where the code had no fast launch):", "",
                  "| call (bf16) | ours, the CUDA path | of which building the launches | total |", "|---|---|---|---|"]
        old_path = result["before"].get("cuda_path", "via_op")
        for old, new in zip(result["before"]["rows"], result["rows"]):
            o = {k: v["median_us"] for k, v in old["times"].items()}
            t = {k: v["median_us"] for k, v in new["times"].items()}
            shape = f"B {new['B']}, {new['Hq']}/{new['Hkv']}, D {new['D']}, N {new['N']}"
            lines.append(f"| flash_decode {shape} | {o[f'flash_decode_{old_path}']:.1f} -> {t[f'flash_decode_{path}']:.1f} | "
                         f"{_build(o):.1f} -> {_build(t):.1f} | "
                         f"{old['flash_decode_total_us']:.1f} -> {new['flash_decode_total_us']:.1f} |")
            lines.append(f"| merge_states P 2, {shape} | {o[f'merge_states_{old_path}']:.1f} -> "
                         f"{t[f'merge_states_{path}']:.1f} | | "
                         f"{old['merge_states_total_us']:.1f} -> {new['merge_states_total_us']:.1f} |")
    lines += ["", "Not counted: Triton's C launcher and the driver, torch's current device and stream, Triton's "
              "launch_metadata, and CUDA's caching allocator (CPU tensors here).",
              "Issue 31's bound on the GPU machine: eager flash_decode <= 40 us per call."]
    return "\n".join(lines) + "\n"


def _build(times: dict) -> float:
    """The time of building the launches in a row's times (``decode_launches`` in files written before
    ``build_launches``, when that was what ``ours`` called)."""
    return times["build_launches"] if "build_launches" in times else times["decode_launches"]


if __name__ == "__main__":
    main()
