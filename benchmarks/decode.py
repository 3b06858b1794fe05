"""Decode benchmark: every strategy side by side on one process group and one KV cache.

Invariant: within one configuration every strategy runs on the same ``TreeGroups``, the
same query and the same shards, interleaved round by round (round i starts with strategy
i mod S), so machine noise hits all of them alike; results are reported as medians, p90s
and ratios against ring, and every strategy's output is checked against tree decode.

Per configuration and strategy it records:

* latency of one decode step: per round, the max over ranks of the time from a barrier to
  the step's end (median, p90);
* bytes sent per rank per level, from ``comm.CommStats`` (tree) and the same accounting in
  ``baselines`` (ring, pass-Q ring, all-gather-KV), beside the cost model's formula;
* peak memory per rank: analytic (``cost_model.peak_memory_bytes``) and measured as
  resident tensors we hold (KV shard or whole cache, plus the strategy's workspaces, exact
  byte counts) plus the transient peak of the step read from the kernel's high-water mark
  of resident memory (``/proc/self/status`` VmHWM after resetting it via
  ``/proc/self/clear_refs``), minus the resident set before the step.

Run ``python -m benchmarks.decode --help``; docs/benchmarks.md has the command
of the published sweep. Ranks are local gloo processes (CPU); on a GPU machine pass
``--device cuda --dist-backend nccl`` (one process per GPU).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

from megatron_tree.comm.strategies import STRATEGIES as TREE
BASE = ("ring", "passq_ring", "allgather_kv", "single")
ALL = tuple(f"tree:{s}" for s in TREE) + BASE


@dataclass(frozen=True)
class Config:
    """One cell of the sweep."""

    ranks: int
    """CP size P."""
    intra: int
    """CP ranks per (simulated) node; == ranks for a flat group."""
    context: int
    """Total KV tokens over all ranks."""
    batch: int
    """B."""
    heads_q: int
    """Hq."""
    heads_kv: int
    """Hkv."""
    head_dim: int
    """D."""


def _parse_tokens(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(s[-1:], 1)
    return int(s[:-1]) * mult if mult > 1 else int(s)


def _percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _rss_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _shard_lengths(context: int, p: int) -> list[int]:
    base, extra = divmod(context, p)
    return [base + (1 if r < extra else 0) for r in range(p)]


def _make_shard(cfg: Config, rank: int, n: int, seed: int, dtype, device):
    """K, V for one rank: a random 1024-token block tiled to n tokens (reproducible from seed and rank)."""
    import torch

    g = torch.Generator().manual_seed(seed * 1000 + rank)
    blk = min(n, 1024) if n else 0
    out = []
    for _ in range(2):
        base = torch.randn(cfg.batch, blk, cfg.heads_kv, cfg.head_dim, generator=g, dtype=torch.float32)
        t = torch.empty(cfg.batch, n, cfg.heads_kv, cfg.head_dim, dtype=dtype, device=device)
        for s in range(0, n, blk or 1):
            e = min(n, s + blk)
            t[:, s:e].copy_(base[:, : e - s])
        out.append(t)
    return out


def _estimate_host_bytes(cfg: Config, strategies, kv_bytes: int) -> dict:
    """Bytes the whole host holds for a config: resident shards plus each strategy's additions."""
    from .cost_model import Dims, peak_memory_bytes

    dims = Dims(cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim, kv_bytes=kv_bytes)
    p = cfg.ranks
    resident = dims.kv_shard(cfg.context)
    extra = {}
    for s in strategies:
        name = s.split(":")[-1]
        name = "packed" if name == "auto" else name
        if name == "single":
            extra[s] = peak_memory_bytes("single", dims, p, cfg.context)
        else:
            extra[s] = p * (peak_memory_bytes(name, dims, p, cfg.context) - dims.kv_shard(-(-cfg.context // p)))
    return {"resident": resident, "extra": extra}


def _rank_main(rank: int, world: int, cfgs: list, opts: dict, out_path: str) -> None:
    """One rank of a P-rank run (``run_ranks`` made the group): every config, rank 0 saving rows as it goes."""
    import torch

    if opts["device"] == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = []
    groups_by_intra = {}
    bar = None
    if rank == 0 and opts["progress"]:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(cfgs), desc=f"P={world}", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
    for cfg in cfgs:
        if cfg["intra"] not in groups_by_intra:
            from megatron_tree.distributed.topology import TreeGroups

            # gloo for every method (the ring's point-to-point messages have no shared-memory path): the
            # side-by-side comparison, and the recorded results and the alpha-beta fit, are over one transport
            groups_by_intra[cfg["intra"]] = TreeGroups.build(intra_size=cfg["intra"], node_of=[0] * world,
                                                             transport="backend")
        lanes = _probe_lanes(opts, opts["probe_tokens"]) if opts["probe_tokens"] > 0 else None
        res = _run_config(Config(**cfg), groups_by_intra[cfg["intra"]], opts)
        if rank == 0:
            for r in res:
                r["host_lanes"] = lanes
            results.extend(res)
            with open(out_path, "w") as f:  # after every config: a crash later keeps these rows
                json.dump(results, f)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"ctx={cfg['context']} B={cfg['batch']} H={cfg['heads_q']}/{cfg['heads_kv']}")
    if bar is not None:
        bar.close()


def _probe_lanes(opts: dict, tokens: int, reps: int = 3):
    """How many ranks of this world truly run at once right now (other users share the host).

    Rank 0 runs the decode kernel alone, then every rank runs it at once; P times the lone
    time over the concurrent time. Recorded per config so that the cost model can be checked
    against the conditions the benchmark actually ran under (``cost_model --compare``).
    """
    import torch
    import torch.distributed as dist

    from megatron_tree.ops.dispatch import flash_decode

    if opts["device"] != "cpu":
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    q = torch.randn(1, 1, 8, 128)
    k, v = torch.randn(1, tokens, 8, 128), torch.randn(1, tokens, 8, 128)
    flash_decode(q, k, v)

    def timed(active: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if active:
            flash_decode(q, k, v)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    alone = statistics.median(timed(rank == 0) for _ in range(reps))
    together = statistics.median(timed(True) for _ in range(reps))
    return max(1e-3, world * alone / together)


def _run_config(cfg: Config, groups, opts: dict) -> list:
    """Run every strategy of one config on this rank; rank 0 returns the result rows."""
    import torch
    import torch.distributed as dist

    from megatron_tree.comm import merge as comm
    from megatron_tree.decode.attention import tree_decode
    from megatron_tree.comm.baselines import ShardPlan, allgather_kv_decode, passq_ring_decode, ring_decode
    from megatron_tree.comm.merge import CommStats
    from megatron_tree.ops.dispatch import flash_decode
    from .cost_model import Dims, peak_memory_bytes, sent_bytes

    rank, p = groups.rank, groups.size
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[opts["dtype"]]
    device = torch.device(opts["device"])
    kv_bytes = torch.tensor([], dtype=dtype).element_size()
    lens = _shard_lengths(cfg.context, p)
    k, v = _make_shard(cfg, rank, lens[rank], opts["seed"], dtype, device)
    q = torch.randn(cfg.batch, 1, cfg.heads_q, cfg.head_dim, generator=torch.Generator().manual_seed(opts["seed"]),
                    dtype=torch.float32).to(dtype=dtype, device=device)

    # Which strategies fit in the host memory budget (decided identically on every rank).
    est = _estimate_host_bytes(cfg, opts["strategies"], kv_bytes)
    budget = opts["mem_budget_gb"] * 2**30
    skipped = {}
    strategies = []
    for s in opts["strategies"]:
        if s == "single" and p == 1:
            skipped[s] = "P=1: single is the same run"
        elif est["resident"] + est["extra"][s] > budget:
            skipped[s] = (f"needs ~{(est['resident'] + est['extra'][s]) / 2**30:.1f} GiB on the host "
                          f"(budget {opts['mem_budget_gb']} GiB)")
        else:
            strategies.append(s)

    plans = {}
    full = {}

    def make_step(s):
        kind = s.split(":")[-1]
        stats = CommStats()
        if s == "tree:shifted":
            shift = {}

            def step():  # a decode loop's steady state: the previous step's merged lse is the shift
                if "r" not in shift:  # the loop's first step has none yet: packed, once, in warmup
                    shift["r"] = tree_decode(q, k, v, groups, strategy="packed", return_lse=True)[1]
                out, shift["r"] = tree_decode(q, k, v, groups, strategy="shifted", shift=shift["r"],
                                              return_lse=True, stats=stats)
                return out
        elif s.startswith("tree:"):
            def step():
                return tree_decode(q, k, v, groups, strategy=kind, stats=stats)
        elif s == "single":
            def step():
                if rank != 0:
                    return None
                if "k" not in full:  # the whole cache on rank 0, rebuilt from every rank's seed
                    parts = [_make_shard(cfg, r, lens[r], opts["seed"], dtype, device) for r in range(p)]
                    full["k"] = torch.cat([x[0] for x in parts], dim=1)
                    full["v"] = torch.cat([x[1] for x in parts], dim=1)
                    del parts
                return flash_decode(q, full["k"], full["v"])[0]
        else:
            fn = {"ring": ring_decode, "passq_ring": passq_ring_decode, "allgather_kv": allgather_kv_decode}[s]
            plans[s] = ShardPlan.build(k, groups)

            def step():
                return fn(q, k, v, groups, plan=plans[s], stats=stats)
        return step, stats

    steps = {s: make_step(s) for s in strategies}
    times = {s: [] for s in strategies}
    outs = {}

    def timed(s):
        fn, stats = steps[s]
        stats.reset()
        dist.barrier(group=groups.cp_group)
        t0 = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=groups.cp_group)
        return out, float(dt)

    # Warmup (builds workspaces, the single-rank cache), then interleaved rounds.
    for _ in range(opts["warmup"]):
        for s in strategies:
            outs[s], dt = timed(s)
            times[s].append(-dt)  # negative: warmup, dropped below
    slow = [s for s in strategies if opts["warmup"] and -times[s][-1] > opts["max_step_s"]]
    for s in slow:  # identical on every rank: the times are all-reduced maxima
        skipped[s] = f"warmup step took {-times[s][-1]:.1f} s > --max-step-s {opts['max_step_s']}"
        strategies.remove(s)
        if s == "single":
            full.clear()
        plans.pop(s, None)
    iters = opts["iters"]
    if opts["cell_budget_s"] > 0 and strategies:
        per_round = sum(-times[s][-1] for s in strategies) if opts["warmup"] else 0.0
        if per_round > 0:
            iters = max(min(opts["min_iters"], iters), min(iters, int(opts["cell_budget_s"] / per_round)))
        agreed = torch.tensor([iters], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=groups.cp_group)
        iters = int(agreed)
    # Round 0 also measures memory: the resident-set high-water mark is reset before each step
    # (a gc and the reset happen before the barrier, outside the timed window).
    shard_bytes = k.numel() * k.element_size() * 2
    mem = {}
    for i in range(iters):
        for j in range(len(strategies)):
            s = strategies[(i + j) % len(strategies)]
            if i == 0:
                gc.collect()
                if device.type == "cuda":  # the caching allocator's own peak counter
                    before = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                else:
                    before = _rss_kb("VmRSS")
                    ok = _reset_hwm()
            outs[s], dt = timed(s)
            times[s].append(dt)
            if i == 0:
                if device.type == "cuda":
                    transient = torch.cuda.max_memory_allocated() - before
                else:
                    hwm = _rss_kb("VmHWM")
                    transient = (hwm - before) * 1024 if ok and before >= 0 and hwm >= 0 else None
                if s == "single":
                    resident = (full["k"].numel() * 2 * full["k"].element_size()) if rank == 0 and full else 0
                else:
                    resident = shard_bytes + (plans[s].workspace_bytes() if s in plans else 0)
                mem[s] = {"resident": resident, "transient": transient}

    # Bytes of one step, per rank per level (stats hold the last step).
    byte_rows = {s: {lvl: st.sent_bytes for lvl, st in steps[s][1].levels.items()} for s in strategies}
    resolved = {}
    for s in strategies:
        if s == "tree:auto":
            resolved[s] = comm.choose_strategy(groups, tuple(q.shape), 4)
    all_bytes = [None] * p
    dist.all_gather_object(all_bytes, byte_rows, group=groups.cp_group)

    dims = Dims(cfg.batch, cfg.heads_q, cfg.heads_kv, cfg.head_dim, kv_bytes=kv_bytes)
    all_mem = [None] * p
    dist.all_gather_object(all_mem, mem, group=groups.cp_group)

    # Agreement with tree decode (packed when it ran, else the first tree strategy).
    ref_name = "tree:packed" if "tree:packed" in outs else next((s for s in strategies if s.startswith("tree:")), None)
    errs = {}
    if rank == 0 and ref_name is not None:
        ref = outs[ref_name].float()
        for s in strategies:
            if outs.get(s) is not None:
                errs[s] = float((outs[s].float() - ref).abs().max())
    full.clear()
    plans.clear()
    if rank != 0:
        return []

    rows = []
    shard = -(-cfg.context // p)
    ring_ts = [t for t in times.get("ring", []) if t >= 0]  # negative entries are warmup
    ring_med = statistics.median(ring_ts) if ring_ts else None
    for s in opts["strategies"]:
        row = {**asdict(cfg), "strategy": s, "levels": [l.name for l in groups.levels]}
        if s in skipped:
            row["skipped"] = skipped[s]
            rows.append(row)
            continue
        ts = [t for t in times[s] if t >= 0]
        kind = s.split(":")[-1]
        model_name = resolved.get(s, kind)
        analytic = sent_bytes(model_name, dims, p, cfg.intra if cfg.intra < p else None, shard_tokens=shard) \
            if kind != "single" else {}
        if kind == "two_level" and cfg.intra >= p:
            analytic = sent_bytes("two_level", dims, p, p)
        mems = [m[s] for m in all_mem]
        peak_measured = max(m["resident"] + (m["transient"] or 0) for m in mems)
        row.update({
            "resolved": resolved.get(s),
            "iters": len(ts),
            "median_ms": statistics.median(ts) * 1e3,
            "p90_ms": _percentile(ts, 0.9) * 1e3,
            "times_ms": [t * 1e3 for t in ts],
            "bytes_per_level_rank0": all_bytes[0][s],
            "bytes_per_level_max_rank": {lvl: max(b[s].get(lvl, 0) for b in all_bytes) for lvl in all_bytes[0][s]},
            "bytes_analytic": analytic,
            "peak_analytic_bytes": peak_memory_bytes("packed" if kind == "auto" else kind, dims, p, cfg.context),
            "peak_measured_bytes": peak_measured,
            "peak_measured_detail": mems,
            "max_abs_err_vs_tree": errs.get(s),
            "ratio_vs_ring": (ring_med / statistics.median(ts)) if ring_med and ts else None,
        })
        rows.append(row)
    return rows


def _cell(r: dict) -> tuple:
    return (r["ranks"], r["intra"], r["context"], r["batch"], r["heads_q"], r["heads_kv"])


def add_ratios(rows: list[dict]) -> list[dict]:
    """Set ``ratio_vs_ring`` = ring median / strategy median within each cell (None without ring)."""
    ring = {_cell(r): r["median_ms"] for r in rows if r["strategy"] == "ring" and "skipped" not in r}
    for r in rows:
        if "skipped" not in r:
            rm = ring.get(_cell(r))
            r["ratio_vs_ring"] = rm / r["median_ms"] if rm and r["median_ms"] > 0 else None
    return rows


def run_sweep(cfgs: list[Config], opts: dict, on_rows=None) -> list[dict]:
    """Run the configs of each distinct P on P fresh local ranks (``run_ranks``); returns the result rows.

    ``on_rows(rows)`` is called after each P with every row so far (to save partial results).
    If a run fails, the rows it finished are kept, reported, and the error is raised after.
    """
    from megatron_tree.utils.testing import run_ranks

    rows = []
    by_p: dict[int, list] = {}
    for c in cfgs:
        by_p.setdefault(c.ranks, []).append(asdict(c))
    for p, group in by_p.items():
        with tempfile.TemporaryDirectory(prefix="mt_bench_") as d:
            out = os.path.join(d, "rank0.json")
            error = None
            try:
                # A sweep has no fixed length: collectives are bounded by pg_timeout, the whole run is not.
                run_ranks(_rank_main, p, group, opts, out, timeout=float("inf"), pg_timeout=opts["pg_timeout"],
                          backend=opts["dist_backend"], threads=opts["threads"])
            except Exception as e:  # noqa: BLE001 -- keep the finished rows, then re-raise
                error = e
            if os.path.exists(out):
                with open(out) as f:
                    rows.extend(json.load(f))
            if on_rows is not None:
                on_rows(rows)
            if error is not None:
                raise RuntimeError(f"the P={p} run failed after {len(rows)} result rows: {error}") from error
    return rows


# ---------------------------------------------------------------------------- reports


def _fmt_tokens(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def markdown_tables(rows: list[dict], command: str) -> str:
    """The Markdown section of docs/benchmarks.md: latency, ratios, bytes, memory."""
    cells: dict = {}
    for r in rows:
        key = (r["ranks"], r["intra"], r["context"], r["batch"], r["heads_q"], r["heads_kv"])
        cells.setdefault(key, {})[r["strategy"]] = r
    strat = [s for s in ALL if any(s in c for c in cells.values())]
    short = {s: s.replace("tree:", "") for s in strat}
    lines = [f"Command: `{command}`", "",
             "Median decode-step latency in ms (p90 in parentheses); `tree best` is the fastest tree merge; "
             "`ring/tree` = ring median / tree-best median.", ""]
    hdr = ["P (levels)", "context", "B", "Hq/Hkv"] + [short[s] for s in strat] + ["tree best", "ring/tree"]
    lines += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for key in sorted(cells):
        p, intra, n, b, hq, hkv = key
        c = cells[key]
        vals = []
        for s in strat:
            r = c.get(s)
            if r is None:
                vals.append("")
            elif "skipped" in r:
                vals.append("skip")
            else:
                extra = f" →{r['resolved']}" if r.get("resolved") else ""
                vals.append(f"{r['median_ms']:.1f} ({r['p90_ms']:.1f}){extra}")
        tree = [c[s] for s in strat if s.startswith("tree:") and s in c and "skipped" not in c[s]]
        best = min(tree, key=lambda r: r["median_ms"]) if tree else None
        ring = c.get("ring")
        ratio = (ring["median_ms"] / best["median_ms"]) if best and ring and "skipped" not in ring else None
        lvl = f"{p} ({p // intra}×{intra})" if intra < p else f"{p}"  # nodes × ranks per node
        lines.append("| " + " | ".join([lvl, _fmt_tokens(n), str(b), f"{hq}/{hkv}"] + vals + [
            short[best["strategy"]] if best else "-", f"{ratio:.1f}×" if ratio else "-"]) + " |")
    lines += ["", "Bytes sent per rank per step (measured by CommStats / baseline accounting; levels in brackets) "
              "and peak memory per rank (analytic / measured):", ""]
    hdr2 = ["P", "context", "B", "Hq/Hkv", "strategy", "bytes/rank", "= formula", "peak analytic", "peak measured"]
    lines += ["| " + " | ".join(hdr2) + " |", "|" + "---|" * len(hdr2)]
    for key in sorted(cells):
        p, intra, n, b, hq, hkv = key
        for s in strat:
            r = cells[key].get(s)
            if r is None or "skipped" in r:
                continue
            meas = r["bytes_per_level_max_rank"]
            bl = ", ".join(f"{_fmt_bytes(v)} [{k}]" for k, v in meas.items()) or "0"
            same = "yes" if {k: v for k, v in meas.items() if v} == {k: v for k, v in r["bytes_analytic"].items() if v} else "NO"
            lines.append("| " + " | ".join([str(p), _fmt_tokens(n), str(b), f"{hq}/{hkv}", short[s], bl, same,
                                              _fmt_bytes(r["peak_analytic_bytes"]), _fmt_bytes(r["peak_measured_bytes"])]) + " |")
    skipped = [r for r in rows if "skipped" in r]
    if skipped:
        lines += ["", "Skipped cells: " + "; ".join(
            f"P={r['ranks']} {_fmt_tokens(r['context'])} B={r['batch']} {r['heads_q']}/{r['heads_kv']} {short.get(r['strategy'], r['strategy'])}: {r['skipped']}"
            for r in skipped)]
    return "\n".join(lines) + "\n"


def plot_results(rows: list[dict], out_dir: str) -> list[str]:
    """PNG plots: latency vs context per P, ring/tree ratio vs context, bytes/rank vs context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in rows if "skipped" not in r]
    ps = sorted({r["ranks"] for r in ok})
    heads = sorted({(r["heads_q"], r["heads_kv"]) for r in ok})
    b0 = min(r["batch"] for r in ok)
    paths = []
    fig, axes = plt.subplots(1, len(ps), figsize=(4.5 * len(ps), 3.8), squeeze=False)
    for ax, p in zip(axes[0], ps):
        for s in ALL:
            pts = sorted((r["context"], r["median_ms"]) for r in ok
                         if r["ranks"] == p and r["strategy"] == s and r["batch"] == b0 and (r["heads_q"], r["heads_kv"]) == heads[0])
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=s.replace("tree:", "tree "))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"P={p}, B={b0}, Hq/Hkv={heads[0][0]}/{heads[0][1]}")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("median step (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bench_latency.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    # Colour = P, line style = batch, marker = head layout: every curve reads off unambiguously.
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    batches = sorted({r["batch"] for r in ok})
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    for pi, p in enumerate(ps):
        for bi, b in enumerate(batches):
            for hi, (hq, hkv) in enumerate(heads):
                pts = sorted((r["context"], r["ratio_vs_ring"]) for r in ok if r["ranks"] == p and r["batch"] == b
                             and (r["heads_q"], r["heads_kv"]) == (hq, hkv) and r["strategy"] == "tree:packed"
                             and r.get("ratio_vs_ring"))
                if pts:
                    ax.plot([x for x, _ in pts], [y for _, y in pts], color=f"C{pi}",
                            linestyle=styles[bi % len(styles)], marker=markers[hi % len(markers)],
                            label=f"P={p} B={b} {hq}/{hkv}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ring / tree(packed) median")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bench_ratio_vs_ring.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in ("ring", "allgather_kv", "passq_ring", "tree:packed", "tree:two_level"):
        for p in ps:
            pts = sorted((r["context"], sum(r["bytes_per_level_max_rank"].values())) for r in ok
                         if r["strategy"] == s and r["ranks"] == p and r["batch"] == b0 and (r["heads_q"], r["heads_kv"]) == heads[0])
            if pts:
                ax.plot([x for x, _ in pts], [max(y, 1) for _, y in pts], marker="o", label=f"{s} P={p}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("bytes sent per rank per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "bench_bytes.png"))
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------- CLI


def build_configs(args) -> list[Config]:
    intra_map = {}
    for item in args.intra.split(",") if args.intra else []:
        p, k = item.split(":")
        intra_map[int(p)] = int(k)
    cfgs = []
    for p in [int(x) for x in args.ranks.split(",")]:
        intra = intra_map.get(p, p)
        if p % intra:
            raise SystemExit(f"--intra {p}:{intra}: {intra} does not divide P={p}")
        for n in [_parse_tokens(x) for x in args.contexts.split(",")]:
            for b in [int(x) for x in args.batch.split(",")]:
                for h in args.heads.split(","):
                    hq, hkv = (int(x) for x in h.split("/"))
                    cfgs.append(Config(p, intra, n, b, hq, hkv, args.head_dim))
    return cfgs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode",
                                 description="Tree vs ring vs all-gather decode, side by side on local ranks.")
    ap.add_argument("--ranks", default="2,4,8", help="CP sizes P, comma separated")
    ap.add_argument("--intra", default="8:4", help="P:ranks-per-node for two-level groups (default 8:4 -> 2 x 4)")
    ap.add_argument("--contexts", default="16K,64K,256K", help="total KV tokens (K = 1024)")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--heads", default="8/8,32/8", help="Hq/Hkv pairs")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"))
    ap.add_argument("--strategies", default=",".join(ALL), help=f"subset of {','.join(ALL)}")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=7, help="max timed rounds per config")
    ap.add_argument("--min-iters", type=int, default=2, help="rounds even when a config exceeds --cell-budget-s")
    ap.add_argument("--cell-budget-s", type=float, default=15.0,
                    help="seconds of timed rounds per config (iters shrink to fit, not below --min-iters; 0: off)")
    ap.add_argument("--max-step-s", type=float, default=30.0,
                    help="a strategy whose warmup step takes longer is reported as skipped for that config")
    ap.add_argument("--mem-budget-gb", type=float, default=8.0,
                    help="host memory a config may use; strategies that would exceed it are skipped and reported")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--probe-tokens", type=int, default=32768,
                    help="shard length of the parallel-lanes probe run before each config (0: no probe)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dist-backend", default="gloo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="docs", help="JSON and PNG plots go here")
    ap.add_argument("--markdown", default=None, help="write the Markdown tables here (default: OUT_DIR/bench_results.md)")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only re-render Markdown and plots from a results JSON into --out-dir")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        rows = add_ratios(data["rows"])
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "bench_results.json"), "w") as f:
            json.dump(data, f, indent=1)
        md = markdown_tables(rows, data["meta"]["command"])
        with open(args.markdown or os.path.join(args.out_dir, "bench_results.md"), "w") as f:
            f.write(md)
        plot_results(rows, args.out_dir)
        print(md)
        return 0
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in strategies if s not in ALL]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; expected some of {ALL}")
    opts = {
        "strategies": strategies, "warmup": args.warmup, "iters": args.iters, "min_iters": args.min_iters,
        "cell_budget_s": args.cell_budget_s, "max_step_s": args.max_step_s, "mem_budget_gb": args.mem_budget_gb, "threads": args.threads,
        "device": args.device, "dist_backend": args.dist_backend, "seed": args.seed, "dtype": args.dtype,
        "progress": not args.no_progress, "pg_timeout": 1800, "probe_tokens": args.probe_tokens,
    }
    cfgs = build_configs(args)
    command = "python -m benchmarks.decode " + " ".join(argv if argv is not None else sys.argv[1:])
    t0 = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    import torch

    meta = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "opts": opts}
    md = ""

    def save(rows):
        nonlocal md
        add_ratios(rows)
        meta["wall_s"] = round(time.time() - t0, 1)
        with open(os.path.join(args.out_dir, "bench_results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        md = markdown_tables(rows, command)
        with open(args.markdown or os.path.join(args.out_dir, "bench_results.md"), "w") as f:
            f.write(md)
        if rows:
            plot_results(rows, args.out_dir)

    run_sweep(cfgs, opts, on_rows=save)
    print(md)
    print(f"wrote {args.out_dir}/bench_results.json, bench_results.md and bench_*.png in {meta['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
