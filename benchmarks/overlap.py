"""Overlapped decode step: ``tree_decode(..., overlap=True)`` against the unsplit step, side by side.

Invariant: for every configuration both variants run on the same ``TreeGroups``, query and
shards, interleaved round by round (round i starts with variant i mod 2) so that load from
other processes hits both alike; a round's time is the max over ranks from a barrier to the
step's end; reported are medians, minima, p90s, the ratio of the medians unsplit / split
(> 1: the split step is faster), the median of the per-round ratios (both variants ran back
to back in each round, so a slow drift of the machine's load cancels), and the largest
difference between the two outputs.

Beside each measured row it prints what ``cost.overlap_step_times`` predicts for the same
shapes on the ``cpu_gloo`` preset and on a GPU preset (``--gpu-preset``, default dgx_h100),
so a reader sees whether the measured ratio is what the model expects here and what it would
be with NCCL, where the collective runs on the NIC and copy engines while the SMs compute.

Run ``python -m benchmarks.overlap --help``; docs/benchmarks.md has the published
command and numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from megatron_tree.comm.strategies import STRATEGIES

VARIANTS = ("unsplit", "split")


def _rank_main(rank: int, world: int, cfgs: list, opts: dict, out_path: str) -> None:
    """One rank of a P-rank run (``run_ranks`` made the group); rank 0 saves rows after every config."""
    import torch
    import torch.distributed as dist

    from megatron_tree.decode.attention import tree_decode
    from megatron_tree.distributed.topology import TreeGroups
    from .decode import Config, _make_shard, _shard_lengths

    rows = []
    groups = {}
    for c in cfgs:
        cfg = Config(**{k: c[k] for k in ("ranks", "intra", "context", "batch", "heads_q", "heads_kv",
                                            "head_dim")})
        if cfg.intra not in groups:
            groups[cfg.intra] = TreeGroups.build(intra_size=cfg.intra, node_of=[0] * world,
                                                 transport="backend")  # (the recorded results are gloo's)
        g = groups[cfg.intra]
        lens = _shard_lengths(cfg.context, world)
        k, v = _make_shard(cfg, rank, lens[rank], opts["seed"], torch.float32, torch.device("cpu"))
        q = torch.randn(cfg.batch, 1, cfg.heads_q, cfg.head_dim,
                        generator=torch.Generator().manual_seed(opts["seed"]))
        outs, times = {}, {v_: [] for v_ in VARIANTS}

        def timed(variant):
            dist.barrier(group=g.cp_group)
            t0 = time.perf_counter()
            out = tree_decode(q, k, v, g, strategy=c["strategy"], overlap=variant == "split")
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=g.cp_group)
            return out, float(dt)

        for _ in range(opts["warmup"]):
            for variant in VARIANTS:
                outs[variant], _ = timed(variant)
        for i in range(opts["iters"]):
            for j in range(len(VARIANTS)):
                variant = VARIANTS[(i + j) % len(VARIANTS)]
                outs[variant], dt = timed(variant)
                times[variant].append(dt)
        if rank == 0:
            med = {v_: statistics.median(times[v_]) for v_ in VARIANTS}
            rows.append({
                **c,
                "iters": opts["iters"],
                "median_ms": {v_: med[v_] * 1e3 for v_ in VARIANTS},
                "p90_ms": {v_: sorted(times[v_])[int(0.9 * (len(times[v_]) - 1))] * 1e3 for v_ in VARIANTS},
                "times_ms": {v_: [t * 1e3 for t in times[v_]] for v_ in VARIANTS},
                "min_ms": {v_: min(times[v_]) * 1e3 for v_ in VARIANTS},
                "ratio_unsplit_over_split": med["unsplit"] / med["split"],
                # round i ran both variants back to back: the median of per-round ratios cancels slow drifts
                "paired_ratio": statistics.median(u / s_ for u, s_ in zip(times["unsplit"], times["split"])),
                "max_abs_diff": float((outs["split"] - outs["unsplit"]).abs().max()),
            })
            with open(out_path, "w") as f:  # after every config: a crash later keeps these rows
                json.dump(rows, f)


def predict(row: dict, preset_name: str) -> dict:
    """``cost.overlap_step_times`` for a row's shapes on a preset: unsplit and split seconds and their ratio."""
    from megatron_tree.comm.cost import Dims, load_preset, overlap_step_times

    preset = load_preset(preset_name)
    dims = Dims(row["batch"], row["heads_q"], row["heads_kv"], row["head_dim"])
    strategy = row["strategy"] if row["strategy"] != "auto" else "packed"
    unsplit, split = overlap_step_times(strategy, preset, dims, row["ranks"], row["intra"],
                                        -(-row["context"] // row["ranks"]))
    return {"unsplit_ms": unsplit * 1e3, "split_ms": split * 1e3, "ratio": unsplit / split}


def run(cfgs: list[dict], opts: dict) -> list[dict]:
    """Run each distinct P's configurations on P fresh local gloo ranks (``run_ranks``); return rank 0's rows."""
    from megatron_tree.utils.testing import run_ranks

    rows = []
    by_p: dict[int, list] = {}
    for c in cfgs:
        by_p.setdefault(c["ranks"], []).append(c)
    for p, group in by_p.items():
        with tempfile.TemporaryDirectory(prefix="mt_overlap_") as d:
            out = os.path.join(d, "rank0.json")
            run_ranks(_rank_main, p, group, opts, out, timeout=float("inf"), pg_timeout=opts["pg_timeout"],
                      threads=opts["threads"])
            with open(out) as f:
                rows.extend(json.load(f))
    return rows


def markdown(rows: list[dict], gpu_preset: str, command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| P | layout | strategy | context | B | Hq/Hkv | D | unsplit ms (min) | split ms (min) | unsplit/split "
        f"| paired | max \\|Δ\\| | model cpu_gloo | model {gpu_preset} (µs → µs) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cpu, gpu = r["model"]["cpu_gloo"], r["model"][gpu_preset]
        layout = f"{r['ranks'] // r['intra']} × {r['intra']}" if r["intra"] < r["ranks"] else "flat"
        lines.append(
            f"| {r['ranks']} | {layout} | {r['strategy']} | {r['context']} | {r['batch']} | "
            f"{r['heads_q']}/{r['heads_kv']} | {r['head_dim']} | {r['median_ms']['unsplit']:.1f} "
            f"({r['min_ms']['unsplit']:.1f}) | {r['median_ms']['split']:.1f} ({r['min_ms']['split']:.1f}) | "
            f"{r['ratio_unsplit_over_split']:.2f}× | {r['paired_ratio']:.2f}× | {r['max_abs_diff']:.1e} | "
            f"{cpu['ratio']:.2f}× | {gpu['unsplit_ms'] * 1e3:.0f} → {gpu['split_ms'] * 1e3:.0f} = {gpu['ratio']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.overlap",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="4,8", help="CP sizes P, comma separated")
    ap.add_argument("--intra", default="", help="P:ranks-per-node pairs for two-level groups, e.g. 8:4")
    ap.add_argument("--strategies", default="packed", help="merge strategies, comma separated")
    ap.add_argument("--contexts", default="4096,65536", help="total KV tokens, comma separated")
    ap.add_argument("--batch", default="4", help="batch sizes B (>= 2 to split), comma separated")
    ap.add_argument("--heads", default="8/8", help="Hq/Hkv pairs, comma separated")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15, help="timed rounds per configuration (each runs both)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pg-timeout", type=float, default=300.0)
    ap.add_argument("--gpu-preset", default="dgx_h100", help="cost-model preset for the GPU prediction column")
    ap.add_argument("--json", default=None, help="write the rows (with predictions) here")
    args = ap.parse_args(argv)
    unknown = [s for s in args.strategies.split(",") if s not in STRATEGIES]
    if unknown:
        ap.error(f"--strategies: unknown merge strategies {unknown}; expected some of {','.join(STRATEGIES)}")

    intra = dict(tuple(int(x) for x in s.split(":")) for s in args.intra.split(",") if s)
    cfgs = []
    for p in (int(x) for x in args.ranks.split(",")):
        for strategy in args.strategies.split(","):
            if strategy == "two_level" and p not in intra:
                continue  # a flat group has one level: two_level is packed
            for ctx in (int(x) for x in args.contexts.split(",")):
                for b in (int(x) for x in args.batch.split(",")):
                    for hh in args.heads.split(","):
                        hq, hkv = (int(x) for x in hh.split("/"))
                        cfgs.append({"ranks": p, "intra": intra.get(p, p), "strategy": strategy, "context": ctx,
                                     "batch": b, "heads_q": hq, "heads_kv": hkv, "head_dim": args.head_dim})
    opts = {"threads": args.threads, "warmup": args.warmup, "iters": args.iters, "seed": args.seed,
            "pg_timeout": args.pg_timeout}
    rows = run(cfgs, opts)
    for r in rows:
        r["model"] = {name: predict(r, name) for name in ("cpu_gloo", args.gpu_preset)}
    command = "python -m benchmarks.overlap " + " ".join(argv if argv is not None else sys.argv[1:])
    sys.stdout.write(markdown(rows, args.gpu_preset, command.strip()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command.strip(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
