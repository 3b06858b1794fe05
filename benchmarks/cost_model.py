"""Whole-step predictions of every context-parallel decoder, for benchmarks and plots.

Invariant: the merge prices, presets and shapes come from ``megatron_tree.comm.cost`` (the policy
``strategy="auto"`` uses), so a benchmark prediction and an ``auto`` choice can never
disagree about what a merge costs; this module adds what only the benchmarks need: the
local kernel inside a step, the KV-moving baselines, byte and memory formulas (equal, call
by call, to what ``comm.CommStats`` and ``baselines`` record; tests compare them), the
first-call (cold-start) term, the comparison with a measured sweep, plots and the CLI.

A decode step of a tree strategy is one local kernel over the shard plus its merge. The
baselines:

* ``ring`` -- this project's Ring Attention baseline (``baselines.ring_decode``): P-1 hops,
  each hop's transfer overlapping the kernel on the shard in hand when the preset says so.
* ``paper_ring`` -- the paper's ring (flash_attn_jax ``ring_fwd``, a ``lax.scan`` of P
  steps): every step runs the kernel, merges, then ``ppermute``\\s K, V and the shard index
  to the next rank; P dependent steps, P transfers (the last one unused), no overlap.
* ``passq_ring`` -- partial states travel P-1 hops; ``allgather_kv`` -- every rank gathers
  the whole cache; ``single`` -- one rank decodes everything.

A point-to-point step in which every rank sends to its neighbour at once ends when the
slowest pair is done, so it pays the inter-node α and β as soon as the group spans nodes
(unlike a pipelined NCCL collective, where a small message pays each hop's own latency).

The paper's microbenchmark timed one cold call of a jitted function; ``predict(...,
cold=True)`` adds the preset's ``cold_start`` seconds for that (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import os

from megatron_tree.comm.cost import (  # noqa: F401 -- re-exported: the benchmarks' one import for the model
    ALL_STRATEGIES, BASELINES, UNSHIFTED_CANDIDATES, ENV_PRESET, MERGES, PRESET_DIR, Dims, Link, Preset,
    allgather_time, allreduce_time, choose_strategy, default_preset, kernel_time, load_preset, local_merge_time,
    merge_cost, node_layout, predict, preset_names,
)

__all__ = [
    "Link", "Preset", "Dims", "MERGES", "BASELINES", "ALL_STRATEGIES", "load_preset", "default_preset",
    "sent_bytes", "predict", "predict_all", "peak_memory_bytes", "choose_strategy", "merge_cost",
    "speedup_table", "paper_reproduction", "compare_with_bench", "PAPER_GPUS", "PAPER_CONTEXT", "PAPER_RATIO",
]

PAPER_GPUS, PAPER_CONTEXT, PAPER_RATIO = 128, 5_120_000, 8.0
"""The paper's headline: close to 8x faster than Ring Attention at 128 GPUs and 5.12M tokens."""
COLD_STARTS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
"""Cold-start seconds at which ``paper_reproduction`` also reports the first-call ratio."""


# ---------------------------------------------------------------------------- bytes


def _ar(p: int, n: int) -> int:
    return 2 * (p - 1) * n // p  # integer, exactly as comm._all_reduce records it


def sent_bytes(strategy: str, dims: Dims, p: int, intra_size: int | None = None,
               shard_tokens: int = 0) -> dict:
    """Bytes one rank sends per decode step, by level, as ``CommStats``/``baselines`` record them.

    Even shards of ``shard_tokens`` tokens are assumed for the KV-moving baselines.
    Levels: ``cp`` for flat collectives and the baselines, ``intra``/``inter`` for two_level.
    ``shifted`` counts its common case (one SUM); ``paper_ring`` its P transfers of K, V and
    a 4-byte shard index.
    """
    o, l = dims.out_bytes, dims.lse_bytes
    if p == 1:
        return {}
    if strategy == "packed":
        return {"cp": _ar(p, l) + _ar(p, o + l)}
    if strategy == "allreduce3":
        return {"cp": _ar(p, l) + _ar(p, l) + _ar(p, o)}
    if strategy == "allgather":  # the partial lse travels in float64
        return {"cp": (p - 1) * (o + dims.lse_wire_bytes)}
    if strategy == "shifted":  # cat[w*o, w, nonempty count, every rank's shift digest]
        return {"cp": _ar(p, o + 2 * l + dims.shift_digest_bytes(p))}
    if strategy == "two_level":
        k = intra_size if intra_size else p
        if not 1 < k < p:  # one level only: TreeGroups names it intra (or inter with one rank per node)
            return {"intra" if k > 1 else "inter": _ar(p, l) + _ar(p, o + l)}
        n = p // k
        return {"intra": _ar(k, l) + _ar(k, o + l), "inter": _ar(n, l) + _ar(n, o + l)}
    if strategy in ("ring", "allgather_kv"):
        return {"cp": (p - 1) * (dims.kv_shard(shard_tokens) + dims.batch * 4)}
    if strategy == "paper_ring":
        return {"cp": p * (dims.kv_shard(shard_tokens) + 4)}
    if strategy == "passq_ring":
        return {"cp": (p - 1) * (o + dims.lse_wire_bytes)}
    if strategy == "single":
        return {}
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")


def peak_memory_bytes(strategy: str, dims: Dims, p: int, context: int) -> int:
    """Analytic peak of tensor bytes held by one rank during a step (the busiest rank).

    Resident: q and the KV shard. Workspaces: the kernel's fp32 scores and probabilities
    (2 * B*Hq*Sq*n*4) and its output; per strategy the buffers it adds (ring: min(2, P-1)
    receive buffers of a shard, double buffering; the paper's ring: the one shard its
    ``ppermute`` writes; all-gather-KV: P shards plus the kernel's workspace for one; pass-Q
    ring / allgather merge: P partial states; single rank: the whole cache).
    """
    shard = -(-context // p)
    q = dims.batch * dims.seqlen_q * dims.heads_q * dims.head_dim * dims.kv_bytes
    state = dims.out_bytes + dims.lse_bytes

    def kernel_ws(tokens):
        return 2 * dims.batch * dims.heads_q * dims.seqlen_q * tokens * 4 + state

    base = q + dims.kv_shard(shard)
    if strategy in MERGES and strategy != "allgather":  # the merges that reduce in place
        return base + kernel_ws(shard) + 2 * state
    if strategy == "allgather":
        return base + kernel_ws(shard) + (p + 1) * state
    if strategy == "ring":
        return base + min(2, p - 1) * dims.kv_shard(shard) + kernel_ws(shard) + (p + 1) * state
    if strategy == "paper_ring":
        return base + dims.kv_shard(shard) + kernel_ws(shard) + 2 * state
    if strategy == "passq_ring":
        return base + kernel_ws(shard) + (p + 1) * state
    if strategy == "allgather_kv":
        return base + p * dims.kv_shard(shard) + kernel_ws(shard) + (p + 1) * state
    if strategy == "single":
        return q + dims.kv_shard(context) + kernel_ws(context)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")


# ---------------------------------------------------------------------------- time


def predict_all(preset: Preset, dims: Dims, p: int, context: int, intra_size: int | None = None,
                cold: bool = False) -> dict:
    """``{strategy: seconds}`` for every strategy of :data:`ALL_STRATEGIES`."""
    return {s: predict(s, preset, dims, p, context, intra_size, cold) for s in ALL_STRATEGIES}


# ---------------------------------------------------------------------------- the paper's number


def _paper_dims(kv_bytes: int = 2) -> Dims:
    """The paper's microbenchmark block: B=1, 16 heads x 128, no GQA, fp16 (arXiv 2408.04093;
    Zyphra/tree_attention ``tree_shard_test.py`` builds q, k, v in float16)."""
    return Dims(batch=1, heads_q=16, heads_kv=16, head_dim=128, kv_bytes=kv_bytes)


def _best_tree(times: dict) -> str:
    # one call (the paper's measurement): no previous step's lse to shift by, so no ``shifted``
    return min(UNSHIFTED_CANDIDATES, key=lambda s: (times[s], UNSHIFTED_CANDIDATES.index(s)))


def paper_reproduction(preset: Preset, gpus: int = PAPER_GPUS, context: int = PAPER_CONTEXT,
                       dims: Dims | None = None) -> dict:
    """The paper's comparison at one point, as its harness ran it and in steady state.

    The harness times the paper's Algorithm 3 (``allreduce3``, one flat group) against its
    ring (``paper_ring``) in one first call each, so both pay ``cold_start``. Returns the
    step times (seconds), the cold and warm ring/tree ratios, the ``cold_start`` that would
    give exactly :data:`PAPER_RATIO`, and this project's steady-state comparison (best
    implemented tree merge vs its own overlapped ring).
    """
    dims = dims or _paper_dims()
    warm = predict_all(preset, dims, gpus, context)
    tree, ring = warm["allreduce3"], warm["paper_ring"]
    c = preset.cold_start
    best = _best_tree(warm)
    return {
        "preset": preset.name, "gpus": gpus, "context": context, "cold_start_s": c,
        "tree_warm_s": tree, "ring_warm_s": ring, "warm_ratio": ring / tree,
        "tree_cold_s": tree + c, "ring_cold_s": ring + c, "cold_ratio": (ring + c) / (tree + c),
        "cold_start_for_paper_ratio_s": (ring - PAPER_RATIO * tree) / (PAPER_RATIO - 1),
        "best_tree": best, "best_tree_warm_s": warm[best], "our_ring_warm_s": warm["ring"],
        "our_warm_ratio": warm["ring"] / warm[best],
        "cold_ratio_if": {x: (ring + x) / (tree + x) for x in COLD_STARTS},
    }


def speedup_table(preset: Preset, dims: Dims, gpus, contexts, intra_size: int | None = None) -> list[dict]:
    """Rows of predicted step times and ring/tree ratios over a grid of (P, context).

    ``speedup_vs_paper_ring``: the paper's ring over the best implemented tree merge, steady
    state; ``paper_cold_ratio``: the paper's own measurement (first calls, ring over
    ``allreduce3``); ``speedup_vs_ring``/``_passq``: this project's baselines, steady state.
    """
    rows = []
    c = preset.cold_start
    for p in gpus:
        for n in contexts:
            t = predict_all(preset, dims, p, n, intra_size)
            best = _best_tree(t)
            rows.append({
                "gpus": p, "context": n, **{f"t_{s}": t[s] for s in ALL_STRATEGIES},
                "best_tree": best, "speedup_vs_ring": t["ring"] / t[best],
                "speedup_vs_paper_ring": t["paper_ring"] / t[best],
                "paper_warm_ratio": t["paper_ring"] / t["allreduce3"],
                "paper_cold_ratio": (t["paper_ring"] + c) / (t["allreduce3"] + c),
                "speedup_vs_passq": t["passq_ring"] / t[best],
                "two_level_over_packed": t["packed"] / t["two_level"],
            })
    return rows


# ---------------------------------------------------------------------------- plots


def plot_predictions(preset: Preset, dims: Dims, out_dir: str, tag: str | None = None) -> list[str]:
    """PNG plots of the predicted ring/tree ratio vs #GPUs and vs context length.

    Solid: steady state, the paper's ring over the best tree merge. Dashed (when the preset
    has a ``cold_start``): one first call of each, the paper's ring over its Algorithm 3 --
    what the paper's harness measured. The star marks the paper's headline.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = tag or preset.name
    os.makedirs(out_dir, exist_ok=True)
    cold = preset.cold_start > 0
    paths = []
    gpus = [8, 16, 32, 64, 128, 256, 512, 1024]
    contexts = [80_000, 320_000, 1_280_000, 5_120_000, 10_000_000]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, n in enumerate(contexts):
        rows = speedup_table(preset, dims, gpus, [n])
        ax.plot(gpus, [r["speedup_vs_paper_ring"] for r in rows], marker="o", color=f"C{i}",
                label=f"{n/1e6:g}M tokens")
        if cold:
            ax.plot(gpus, [r["paper_cold_ratio"] for r in rows], ls="--", marker=".", color=f"C{i}")
    ax.set_xscale("log", base=2)
    paths.append(_save_speedup_plot(plt, fig, ax, "GPUs (P)", preset, cold, PAPER_GPUS,
                                    os.path.join(out_dir, f"cost_speedup_vs_gpus_{tag}.png")))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ctx = [20_000 * 2 ** i for i in range(10)]
    for i, p in enumerate((8, 32, 128, 1024)):
        rows = speedup_table(preset, dims, [p], ctx)
        ax.plot(ctx, [r["speedup_vs_paper_ring"] for r in rows], marker="o", color=f"C{i}", label=f"P={p}")
        if cold:
            ax.plot(ctx, [r["paper_cold_ratio"] for r in rows], ls="--", marker=".", color=f"C{i}")
    ax.set_xscale("log")
    paths.append(_save_speedup_plot(plt, fig, ax, "context length (tokens)", preset, cold, PAPER_CONTEXT,
                                    os.path.join(out_dir, f"cost_speedup_vs_context_{tag}.png")))
    return paths


def _save_speedup_plot(plt, fig, ax, xlabel: str, preset: Preset, cold: bool, paper_x: int, path: str) -> str:
    """Shared styling of the predicted-ratio plots (log y, labels, legend, the paper's point); returns path."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted ring / tree time")
    title = f"Tree vs the paper's ring, predicted ({preset.name})"
    if cold:
        ax.plot([paper_x], [PAPER_RATIO], marker="*", ms=14, color="k", ls="none", label="paper: ≈8× (128 GPUs, 5.12M)")
        ax.plot([], [], color="gray", ls="-", label="steady state")
        ax.plot([], [], color="gray", ls="--", label=f"first call (+{preset.cold_start * 1e3:.0f} ms cold start)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- check against a sweep


def compare_with_bench(rows: list[dict], preset: Preset, use_run_lanes: bool = True) -> list[dict]:
    """Predicted vs measured median step time for every measured row of a ``bench.decode`` JSON.

    With ``use_run_lanes`` and a shared-host preset, ``host_cores`` is replaced by the parallel
    lanes the benchmark probed right before each configuration (``host_lanes``), so the model
    sees the machine as the run saw it (other users' load varies minute to minute).
    """
    out = []
    for r in rows:
        if "skipped" in r:
            continue
        lanes = r.get("host_lanes")
        pr = dataclasses.replace(preset, host_cores=lanes) if (use_run_lanes and lanes and preset.shared_host) else preset
        kind = r["strategy"].split(":")[-1]
        name = r.get("resolved") or kind if kind == "auto" else kind
        dims = Dims(r["batch"], r["heads_q"], r["heads_kv"], r["head_dim"], kv_bytes=4)
        intra = r["intra"] if r["intra"] < r["ranks"] else r["ranks"]
        pred = predict(name, pr, dims, r["ranks"], r["context"], intra) * 1e3
        out.append({"ranks": r["ranks"], "intra": r["intra"], "context": r["context"], "batch": r["batch"],
                    "heads": f"{r['heads_q']}/{r['heads_kv']}", "strategy": r["strategy"],
                    "measured_ms": r["median_ms"], "predicted_ms": pred, "ratio": pred / r["median_ms"],
                    "host_lanes": pr.host_cores})
    return out


# ---------------------------------------------------------------------------- CLI


def _print_paper(preset: Preset) -> dict:
    r = paper_reproduction(preset)
    print(f"paper's point ({r['gpus']} GPUs, {r['context'] / 1e6:g}M tokens, B=1, 16 heads x 128, fp16), "
          f"preset {preset.name}:")
    print(f"  steady state: paper's ring {r['ring_warm_s'] * 1e3:.1f} ms / Algorithm 3 {r['tree_warm_s'] * 1e3:.3f} ms"
          f" = {r['warm_ratio']:.0f}x")
    if r["cold_start_s"] > 0:
        print(f"  first call (+{r['cold_start_s'] * 1e3:.0f} ms cold start each): {r['ring_cold_s'] * 1e3:.1f} / "
              f"{r['tree_cold_s'] * 1e3:.1f} ms = {r['cold_ratio']:.1f}x  (paper: ~{PAPER_RATIO:g}x)")
    else:
        print("  first call: this preset has no cold_start")
    print(f"  a first call of each gives exactly {PAPER_RATIO:g}x with a cold start of "
          f"{r['cold_start_for_paper_ratio_s'] * 1e3:.0f} ms")
    print(f"  this project, steady state: ring {r['our_ring_warm_s'] * 1e3:.1f} ms / {r['best_tree']} "
          f"{r['best_tree_warm_s'] * 1e3:.3f} ms = {r['our_warm_ratio']:.0f}x")
    print("  first-call ratio if the cold start were: " + ", ".join(
        f"{c * 1e3:g} ms -> {x:.1f}x" for c, x in r["cold_ratio_if"].items()))
    return r


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m benchmarks.cost_model",
                                 description="Predict decode-step latency of every strategy from a preset.")
    ap.add_argument("--preset", default="dgx_h100", help="preset name or YAML path")
    ap.add_argument("--gpus", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--contexts", default="80000,320000,1280000,5120000,10000000")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads-q", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-bytes", type=int, default=2, help="2 for bf16/fp16, 4 for fp32")
    ap.add_argument("--plot-dir", default=None, help="write the two ratio plots here")
    ap.add_argument("--json", default=None, help="write the prediction rows here")
    ap.add_argument("--paper", action="store_true",
                    help="only the paper's point (128 GPUs, 5.12M tokens): first-call and steady-state ratios")
    ap.add_argument("--compare", default=None, metavar="JSON",
                    help="compare predictions with a bench.decode results JSON instead (use --preset cpu_gloo)")
    ap.add_argument("--min-context", type=int, default=0, help="with --compare: only rows with at least this context")
    ap.add_argument("--preset-lanes", action="store_true",
                    help="with --compare: keep the preset's host_cores instead of the lanes probed by the run")
    args = ap.parse_args(argv)
    preset = load_preset(args.preset)
    if args.paper:
        r = _print_paper(preset)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    if args.compare:
        with open(args.compare) as f:
            rows = [r for r in json.load(f)["rows"] if r["context"] >= args.min_context]
        cmp_rows = compare_with_bench(rows, preset, use_run_lanes=not args.preset_lanes)
        print(f"{'P':>3} {'ctx':>7} {'B':>2} {'H':>5} {'strategy':>16} {'measured':>9} {'predicted':>9} {'pred/meas':>9} {'lanes':>5}")
        for c in cmp_rows:
            print(f"{c['ranks']:>3} {c['context']:>7} {c['batch']:>2} {c['heads']:>5} {c['strategy']:>16} "
                  f"{c['measured_ms']:>9.1f} {c['predicted_ms']:>9.1f} {c['ratio']:>9.2f} {c['host_lanes']:>5.2f}")
        within = [c for c in cmp_rows if 0.7 <= c["ratio"] <= 1.3]
        print(f"within ±30%: {len(within)} of {len(cmp_rows)} rows")
        by = {}
        for c in cmp_rows:
            by.setdefault(c["strategy"], []).append(c["ratio"])
        for k, v in by.items():
            inside = sum(0.7 <= x <= 1.3 for x in v)
            print(f"  {k:>16}: median pred/meas {sorted(v)[len(v) // 2]:.2f}, within ±30% {inside}/{len(v)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preset": preset.as_dict(), "rows": cmp_rows}, f, indent=1)
        return 0
    dims = Dims(args.batch, args.heads_q, args.heads_kv, args.head_dim, kv_bytes=args.kv_bytes)
    rows = speedup_table(preset, dims, [int(x) for x in args.gpus.split(",")], [int(x) for x in args.contexts.split(",")])
    print(f"preset {preset.name}: B={dims.batch} Hq={dims.heads_q} Hkv={dims.heads_kv} D={dims.head_dim} "
          f"kv_bytes={dims.kv_bytes}")
    cold = preset.cold_start > 0
    print(f"{'P':>5} {'context':>9} {'paper ring':>10} {'ring ms':>9} {'passQ ms':>9} {'tree ms':>9} {'best tree':>10} "
          f"{'pring/tree':>10} {'ring/tree':>9} {'1st call':>8} {'flat/2lvl':>9}")
    for r in rows:
        first = f"{r['paper_cold_ratio']:>8.2f}" if cold else f"{'-':>8}"
        print(f"{r['gpus']:>5} {r['context']:>9} {r['t_paper_ring']*1e3:>10.2f} {r['t_ring']*1e3:>9.2f} "
              f"{r['t_passq_ring']*1e3:>9.3f} {r['t_' + r['best_tree']]*1e3:>9.3f} {r['best_tree']:>10} "
              f"{r['speedup_vs_paper_ring']:>10.1f} {r['speedup_vs_ring']:>9.1f} {first} "
              f"{r['two_level_over_packed']:>9.2f}")
    if cold and dims == _paper_dims(2):
        _print_paper(preset)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": preset.as_dict(), "dims": dataclasses.asdict(dims), "rows": rows}, f, indent=1)
    if args.plot_dir:
        for p in plot_predictions(preset, dims, args.plot_dir):
            print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
