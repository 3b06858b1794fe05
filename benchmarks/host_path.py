"""Host time per call of the decode step's entry points next to torch SDPA, on tiny CPU tensors.

What it measures: on tensors this small (B=1, one query token, a few heads, N <= 256 keys) the
arithmetic is a few microseconds, so the time of a call is the Python and dispatcher work around
it -- the host path. ``mt.flash_decode``, ``mt.merge_states`` and ``mt.tree_decode`` over a real
one-rank gloo group are timed side by side with ``torch.nn.functional.scaled_dot_product_attention``
on the same q, k, v (GQA through ``enable_gqa=True``), one thread, in interleaved rounds: each
round times every callable ``--reps`` times back to back (its mean per call), and the reported
time is the median of the per-round means; ratios are of those medians, measured in one run.
The clock is the calling thread's CPU time (on a shared machine the wall clock also counts the
time other processes hold the core); the wall-clock medians are recorded beside it.

    PYTHONPATH=$PWD python -m benchmarks.host_path --out benchmarks/results/host_path.json

Writes JSON (command, torch version, per-shape times and ratios) and a markdown table beside it.
Only the public API (``import megatron_tree as mt``) and torch are used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_tree as mt

TARGETS = {"flash_decode": 4.0, "merge_states": 4.0, "tree_decode": 6.0}
"""Issue 31's bound on each entry point's host time as a multiple of SDPA's on the same tensors."""


def _tensors(b, hq, hkv, d, n, p, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, hq, d, generator=g)
    k = torch.randn(b, n, hkv, d, generator=g)
    v = torch.randn(b, n, hkv, d, generator=g)
    lens = torch.full((b,), n, dtype=torch.int32)
    outs = torch.randn(p, b, 1, hq, d, generator=g)
    lses = torch.randn(p, b, hq, 1, generator=g)
    return q, k, v, lens, outs, lses


def _callables(q, k, v, lens, outs, lses, groups):
    # SDPA takes (B, H, S, D); the transposes are views, made once outside the timed call.
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    return {
        "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True),
        "flash_decode": lambda: mt.flash_decode(q, k, v, cache_seqlens=lens),
        "merge_states": lambda: mt.merge_states(outs, lses),
        "tree_decode": lambda: mt.tree_decode(q, k, v, groups, cache_seqlens=lens),
    }


def _time(fns: dict, rounds: int, reps: int, warmup: int) -> dict:
    """Median over ``rounds`` of each callable's mean microseconds per call over ``reps`` calls, the
    callables interleaved within every round (so drift on a shared machine hits all alike).

    Two clocks: this thread's CPU time (``time.thread_time_ns``: what the host spends on the call;
    time the scheduler gives to other processes on a busy machine is not counted) -- the
    ``median_us`` the ratios use -- and wall-clock time (``wall_median_us``)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    cpu = {name: [] for name in fns}
    wall = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(reps):
                fn()
            w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            cpu[name].append((c1 - c0) / reps / 1e3)
            wall[name].append((w1 - w0) / reps / 1e3)
    return {name: {"median_us": statistics.median(cpu[name]), "min_us": min(cpu[name]), "max_us": max(cpu[name]),
                   "wall_median_us": statistics.median(wall[name])} for name in fns}


def _world1_groups():
    """A real one-rank gloo process group (FileStore rendezvous) and its TreeGroups."""
    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(prefix="host_path_"), "store")
        dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    return mt.TreeGroups.build()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/host_path.json")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--shapes", default="1,4,2,16,32;1,4,2,64,128;1,4,2,64,256",
                    help="B,Hq,Hkv,D,N;... (fp32, one query token)")
    ap.add_argument("--states", type=int, default=2, help="P, partial states merged by merge_states")
    ap.add_argument("--before", default=None,
                    help="a JSON this script wrote for other code (e.g. the commit before a change): its "
                         "times and ratios go beside this run's in the markdown and under 'before' in the JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    groups = _world1_groups()
    rows = []
    for spec in args.shapes.split(";"):
        b, hq, hkv, d, n = (int(x) for x in spec.split(","))
        tensors = _tensors(b, hq, hkv, d, n, args.states)
        times = _time(_callables(*tensors, groups), args.rounds, args.reps, args.warmup)
        sdpa = times["sdpa"]["median_us"]
        ratios = {name: times[name]["median_us"] / sdpa for name in TARGETS}
        rows.append({"shape": {"B": b, "Sq": 1, "Hq": hq, "Hkv": hkv, "D": d, "N": n, "P": args.states,
                               "dtype": "float32"},
                     "times": times, "ratio_to_sdpa": ratios,
                     "within_target": {name: ratios[name] <= TARGETS[name] for name in TARGETS}})
    result = {
        "command": "PYTHONPATH=$PWD python -m benchmarks.host_path " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "threads": torch.get_num_threads(), "rounds": args.rounds, "reps": args.reps,
        "method": "median over rounds of the mean host time per call (this thread's CPU time, "
                  "time.thread_time_ns) over reps back-to-back calls; the callables interleaved in every round; "
                  "ratios of medians from the same run (wall-clock medians beside them)",
        "targets": TARGETS, "rows": rows,
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in os.getloadavg()],
                         "note": "1, 5, 15 min load averages of the machine (os.getloadavg) as the run began and ended"},
    }
    return write(result, args.before, args.out, _markdown)


def write(result: dict, before: str | None, out: str | None, markdown) -> dict:
    """Finish a benchmark's run: ``before``'s run (a JSON this benchmark wrote for other code) under
    ``result["before"]``, then ``result`` as JSON at ``out`` (when given) with ``markdown(result)`` beside it
    (same name, ``.md``), and the markdown printed. Returns ``result``."""
    if before:
        with open(before, encoding="utf-8") as f:
            old = json.load(f)
        result["before"] = {"file": before, **{k: v for k, v in old.items() if k != "before"}}
    text = markdown(result)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        with open(os.path.splitext(out)[0] + ".md", "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    return result


def _markdown(result: dict) -> str:
    lines = ["# Host time per call on tiny CPU tensors (one thread)", "",
             f"`{result['command']}` -- torch {result['torch']}, {result['rounds']} rounds x {result['reps']} calls; "
             f"{result['method']}.", "",
             "| B, Hq/Hkv, D, N | SDPA us | flash_decode us (x SDPA) | merge_states us (x SDPA) | "
             "tree_decode world 1 us (x SDPA) |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        s, t, r = row["shape"], row["times"], row["ratio_to_sdpa"]
        cells = [f"{t[name]['median_us']:.1f} ({r[name]:.1f}x)" for name in TARGETS]
        lines.append(f"| {s['B']}, {s['Hq']}/{s['Hkv']}, {s['D']}, {s['N']} | {t['sdpa']['median_us']:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Targets (issue 31): " + ", ".join(f"{k} <= {v:g}x" for k, v in result["targets"].items()), ""]
    if "load_average" in result:
        la = result["load_average"]
        lines += [f"Machine load average (1/5/15 min): {'/'.join(map(str, la['before']))} as the run began, "
                  f"{'/'.join(map(str, la['after']))} as it ended.", ""]
    if "before" in result:
        lines += [f"Before (`{result['before']['command']}`), x SDPA in its own run -> this run:", "",
                  "| B, Hq/Hkv, D, N | " + " | ".join(TARGETS) + " |", "|---|---|---|---|"]
        for old, new in zip(result["before"]["rows"], result["rows"]):
            s = new["shape"]
            cells = [f"{old['ratio_to_sdpa'][name]:.1f}x -> {new['ratio_to_sdpa'][name]:.1f}x" for name in TARGETS]
            lines.append(f"| {s['B']}, {s['Hq']}/{s['Hkv']}, {s['D']}, {s['N']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
