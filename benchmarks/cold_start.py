"""First call vs warm calls: the paper's timing methodology beside the steady state.

The paper's microbenchmark (Zyphra/tree_attention ``tree_shard_test.py`` and
``ring_shard_test.py``) times a single call of each jitted decoder: tracing, compilation and
the communicators' first use are inside the timed window. This benchmark measures both
methodologies here, tree vs ring, on the same shards:

* every (strategy, repetition) runs in fresh processes (one ``run_ranks`` call each), so a
  first call is really the first in its process (nothing warmed by the other strategy);
  repetitions alternate the order of the strategies. ``run_ranks`` forks its ranks from a
  server that imported modules once; here it imports torch alone (:data:`PRELOAD`) -- the
  import, which the paper's scripts also leave outside the clock. The server never makes a
  group, runs a kernel or imports ``torch._dynamo`` or this package, so each rank still pays
  every first use itself;
* ``setup``: process-group and ``TreeGroups`` creation (+ the ring's ``ShardPlan``), the part
  of the paper's first call that gloo does eagerly at group creation where NCCL does it on
  first use; ``first``: the first decode step; ``warm``: the median of the next steps. Each
  time is the maximum over ranks of the time from a barrier to the step's end; imports and
  making the shards happen before the clock starts, as in the paper's scripts.
* two modes: ``cold`` leaves every one-time cost in the first step, as the paper's harness
  does -- on older torch chiefly its compiler stack (``torch._dynamo``), which it imported on the
  first call of a ``torch.library`` custom op such as ``ops.flash_decode`` (torch 2.13 no longer
  does); ``preloaded`` imports it before the clock, leaving first use of memory and links.

The tree side is the paper's Algorithm 3 (``allreduce3``); the ring side is this project's
ring (``baselines.ring_decode``). Run ``python -m benchmarks.cold_start --help``;
docs/benchmarks.md has the published command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

STRATEGIES = ("tree:allreduce3", "ring")
PRELOAD = ("torch",)
"""What the harness's fork server imports: torch only (see the module docstring)."""


def _rank_main(rank: int, world: int, opts: dict) -> dict | None:
    """One rank of a fresh launch; rank 0 returns the record. The harness made the group already:
    its creation time (``testing.GROUP_INIT_SECONDS``) is added to ``setup``."""
    import torch
    import torch.distributed as dist

    from megatron_tree.decode.attention import tree_decode
    from megatron_tree.comm.baselines import ShardPlan, ring_decode
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.utils import testing
    from .decode import Config, _make_shard, _shard_lengths

    cfg = Config(world, opts["intra"], opts["context"], opts["batch"], opts["heads_q"], opts["heads_kv"],
                 opts["head_dim"])
    lens = _shard_lengths(cfg.context, world)
    k, v = _make_shard(cfg, rank, lens[rank], opts["seed"], torch.float32, torch.device("cpu"))
    q = torch.randn(cfg.batch, 1, cfg.heads_q, cfg.head_dim, generator=torch.Generator().manual_seed(opts["seed"]))
    strategy = opts["strategy"]
    if opts["mode"] == "preloaded":
        import torch._dynamo  # noqa: F401 -- what the first custom-op call would import

    t0 = time.perf_counter()
    # gloo for every method (the ring's point-to-point messages have no shared-memory path): the comparison,
    # and the recorded results, are over one transport
    groups = TreeGroups.build(intra_size=opts["intra"] if opts["intra"] < world else None, transport="backend")
    if strategy == "ring":
        plan = ShardPlan.build(k, groups)

        def step():
            return ring_decode(q, k, v, groups, plan=plan)
    else:
        kind = strategy.split(":")[-1]

        def step():
            return tree_decode(q, k, v, groups, strategy=kind)
    setup = testing.GROUP_INIT_SECONDS + time.perf_counter() - t0

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def timed():
        dist.barrier()
        start = time.perf_counter()
        out = step()
        return out, slowest(time.perf_counter() - start)

    setup = slowest(setup)
    out, first = timed()
    warm = [timed()[1] for _ in range(opts["warm"])]
    if rank == 0:
        return {"setup_s": setup, "first_s": first, "warm_s": warm, "out": out.double().flatten().tolist()}
    return None


def run(opts: dict) -> list[dict]:
    """Every (repetition, strategy) in fresh processes; returns one record per launch."""
    from megatron_tree.utils.testing import run_ranks

    records = []
    for rep in range(opts["repeat"]):
        for mode in opts["modes"]:
            order = STRATEGIES if (rep + opts["modes"].index(mode)) % 2 == 0 else STRATEGIES[::-1]
            for strategy in order:
                o = {**opts, "strategy": strategy, "mode": mode}
                rec = run_ranks(_rank_main, opts["ranks"], o, timeout=float("inf"), pg_timeout=opts["timeout_s"],
                                threads=opts["threads"], preload=PRELOAD)[0]
                rec.update({"strategy": strategy, "mode": mode, "rep": rep,
                            "warm_median_s": statistics.median(rec["warm_s"])})
                records.append(rec)
                if opts.get("progress"):
                    print(f"rep {rep} {mode:>9} {strategy:>16}: setup {rec['setup_s'] * 1e3:8.1f} ms, first "
                          f"{rec['first_s'] * 1e3:8.1f} ms, warm {rec['warm_median_s'] * 1e3:8.1f} ms", file=sys.stderr)
    return records


def summarize(records: list[dict], opts: dict) -> dict:
    """Medians over repetitions per strategy, the ring/tree ratios of both methodologies, and
    the cost model's steady-state prediction for the same configuration (``cpu_gloo``)."""
    from . import cost_model as cm

    by_mode = {}
    for mode in opts["modes"]:
        med = {}
        for s in STRATEGIES:
            rs = [r for r in records if r["strategy"] == s and r["mode"] == mode]
            med[s] = {key: statistics.median(r[key] for r in rs) for key in ("setup_s", "first_s", "warm_median_s")}
            med[s]["setup_plus_first_s"] = statistics.median(r["setup_s"] + r["first_s"] for r in rs)
        tree, ring = med["tree:allreduce3"], med["ring"]
        by_mode[mode] = {
            "medians": med,
            "ratio_first_call": ring["first_s"] / tree["first_s"],
            "ratio_setup_plus_first_call": ring["setup_plus_first_s"] / tree["setup_plus_first_s"],
            "tree_first_over_warm": tree["first_s"] / tree["warm_median_s"],
            "ring_first_over_warm": ring["first_s"] / ring["warm_median_s"],
        }
    warm = {s: statistics.median(r["warm_median_s"] for r in records if r["strategy"] == s) for s in STRATEGIES}
    preset = cm.load_preset("cpu_gloo")
    dims = cm.Dims(opts["batch"], opts["heads_q"], opts["heads_kv"], opts["head_dim"], kv_bytes=4)
    intra = opts["intra"] if opts["intra"] < opts["ranks"] else opts["ranks"]
    pred = {s: cm.predict(s.split(":")[-1], preset, dims, opts["ranks"], opts["context"], intra) for s in STRATEGIES}
    outs = [r.pop("out") for r in records]
    diff = max(max(abs(a - b) for a, b in zip(outs[0], o)) for o in outs)
    return {
        "modes": by_mode,
        "warm_median_s": warm,
        "ratio_warm": warm["ring"] / warm["tree:allreduce3"],
        "predicted_warm_s": pred,
        "predicted_ratio_warm": pred["ring"] / pred["tree:allreduce3"],
        "max_abs_diff_between_runs": diff,
    }


def main(argv=None) -> int:
    from .decode import _parse_tokens

    ap = argparse.ArgumentParser(prog="python -m benchmarks.cold_start",
                                 description="First call vs warm calls of tree (Algorithm 3) and ring decode.")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--intra", type=int, default=0, help="ranks per simulated node (0: one node)")
    ap.add_argument("--context", default="64K", help="total KV tokens (K = 1024)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", default="8/8", help="Hq/Hkv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="fresh launches per strategy and mode")
    ap.add_argument("--modes", default="cold,preloaded", help="cold, preloaded or both (see the module docstring)")
    ap.add_argument("--warm", type=int, default=5, help="timed calls after the first")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="write records and summary JSON here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    hq, hkv = (int(x) for x in args.heads.split("/"))
    opts = {"ranks": args.ranks, "intra": args.intra or args.ranks, "context": _parse_tokens(args.context),
            "batch": args.batch, "heads_q": hq, "heads_kv": hkv, "head_dim": args.head_dim, "repeat": args.repeat,
            "warm": args.warm, "threads": args.threads, "seed": args.seed, "timeout_s": args.timeout_s,
            "progress": not args.quiet, "modes": [m for m in args.modes.split(",") if m]}
    bad = set(opts["modes"]) - {"cold", "preloaded"}
    if bad or not opts["modes"]:
        ap.error(f"--modes takes cold and/or preloaded, got {args.modes!r}")
    t0 = time.time()
    records = run(opts)
    summary = summarize(records, opts)
    command = "python -m benchmarks.cold_start " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"P={args.ranks} context={opts['context']} B={args.batch} H={args.heads} D={args.head_dim}, "
          f"{args.repeat} fresh launches per strategy and mode ({time.time() - t0:.0f} s); medians")
    print(f"{'mode':>9} {'strategy':>16} {'setup ms':>9} {'first ms':>9} {'warm ms':>9} {'first/warm':>10}")
    for mode, res in summary["modes"].items():
        m = res["medians"]
        for s in STRATEGIES:
            print(f"{mode:>9} {s:>16} {m[s]['setup_s'] * 1e3:>9.1f} {m[s]['first_s'] * 1e3:>9.1f} "
                  f"{m[s]['warm_median_s'] * 1e3:>9.1f} {m[s]['first_s'] / m[s]['warm_median_s']:>10.2f}")
        print(f"{mode:>9} ring/tree: first call {res['ratio_first_call']:.2f}x, setup + first call "
              f"{res['ratio_setup_plus_first_call']:.2f}x")
    print(f"ring/tree warm: {summary['ratio_warm']:.2f}x "
          f"(cost model, cpu_gloo: {summary['predicted_ratio_warm']:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "opts": opts, "records": records, "summary": summary}, f, indent=1)
    if summary["max_abs_diff_between_runs"] > 1e-5:
        print(f"tree and ring disagree: max |diff| {summary['max_abs_diff_between_runs']:.3g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
