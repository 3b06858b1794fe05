"""What a finished sweep leaves behind: results.json, the latency plot, the wandb run, summary lines.

Invariant: runs on global rank 0 only, after every collective of the run; it reads the
run dicts the sweep produced and never changes them, so results.json, wandb and the
printed lines all say the same thing. Schema of results.json: docs/eval.md (version 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["RESULTS_SCHEMA_VERSION", "build_results", "save_plot", "summary_line", "track", "write", "print_summary",
           "print_plan", "wandb_line", "wandb_record", "attention_summary", "verdict_line", "table_lines", "modelled_crossovers"]

RESULTS_SCHEMA_VERSION = 3
"""2: ``runs[].tokens``, ``exactness.reference``/``reference_tokens``/``tokens_match_reference``,
``exact`` also requires the reference's greedy tokens, ``model``, ``launch.tp_size``.
3: ``engine``, ``runs[].engine``, ``runs[].kv_blocks_per_rank``, ``exactness.quantity``,
``max_abs_dlogprobs``; a dynamic-engine run compares log-probabilities (``*_dlogprobs``) and
has ``null`` logits fields."""


def _worst(checked: list[dict], key: str):
    values = [e[key] for e in checked if e.get(key) is not None]
    return max(values) if values else None


def build_results(*, name: str, launch: dict, config: dict, model: dict, runs: list[dict], passkey, perplexity,
                  reference: str | None, engine: str = "static") -> dict:
    """The results dict of a sweep (everything but the outputs' paths and timings)."""
    checked = [r["exactness"] for r in runs if r["exactness"]]
    return {
        "schema_version": RESULTS_SCHEMA_VERSION, "name": name, "launch": launch, "config": config,
        "model": model, "engine": engine, "exactness_reference": reference, "runs": runs,
        "max_abs_dlogits": _worst(checked, "max_abs_dlogits"),
        "max_abs_dlogprobs": _worst(checked, "max_abs_dlogprobs"),
        "exact": all(e["within_tolerance"] for e in checked) if checked else None,
        "tokens_match_reference": all(e["tokens_match_reference"] for e in checked) if checked else None,
        "tokens_agree_across_ranks": all(r["tokens_agree_across_ranks"] for r in runs),
        "passkey": passkey, "perplexity": perplexity,
    }


def passed(results: dict) -> bool:
    """Ranks agreed and no checked run missed the reference."""
    return results["tokens_agree_across_ranks"] and results["exact"] is not False


def save_plot(runs: list[dict], path: Path, title: str = "tree decode latency vs context length",
              attention: dict | None = None) -> str:
    """Decode latency p50 vs context length, one line per (strategy, batch size); with ``attention``
    (:func:`attention_summary`) a second panel: the step's attention alone for tree decode, its
    all-gather merge and the ring / all-gather-KV baselines, each crossover marked. Legends sit
    below the panels, outside the data."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    panels = 2 if attention else 1
    fig = Figure(figsize=(6.4 * panels, 5.4))
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    batches = sorted({r["batch_size"] for r in runs})
    styles = ["-", "--", ":", "-."]
    for i, strategy in enumerate(strategies):
        for j, batch in enumerate(batches):
            pts = sorted((r["context_length"], r["decode_latency_ms"]["p50"]) for r in runs
                         if r["strategy"] == strategy and r["batch_size"] == batch)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                    linestyle=styles[j % len(styles)], label=f"{strategy} (batch {batch})")
    ax.set_title("whole decode step, each merge strategy", fontsize=9)
    ax.set_ylabel("decode step latency p50 (ms)")
    if attention:
        _attention_panel(axes[1], attention)
    for a in axes:
        a.set_xscale("log", base=2)
        a.set_xlabel("context length (tokens)")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    if attention:  # the crossovers between the title and the panels, clear of data and legends
        fig.suptitle(title, fontsize=10, y=1.1)
        fig.text(0.5, 0.99, "\n".join(crossover_notes(attention)), ha="center", va="bottom", fontsize=8)
    else:
        fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return str(path)


_METHOD_LABEL = {"tree": "tree ({strategy})", "allgather": "allgather merge (tree_decode)",
                 "ring": "ring (KV shards travel, overlapped)", "allgather_kv": "all-gather KV"}


def _attention_panel(ax, attention: dict) -> None:
    points = attention["points"]
    for i, method in enumerate(("tree", "allgather", "ring", "allgather_kv")):
        pts = sorted((p["context_length"], p["step_ms"], p["strategy"]) for p in points if p["method"] == method)
        if not pts:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="os^v"[i], color=f"C{i + 5}",
                label=_METHOD_LABEL[method].format(strategy=pts[0][2]))
    for against, x in attention["crossovers"].items():
        if against == "allgather_kv":
            continue
        if x["from_context"] is not None and not x["always"]:
            ax.axvline(x["from_context"], color="0.4", linestyle=":", linewidth=1)
            ax.annotate(f"tree < {against}", (x["from_context"], 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", fontsize=7, color="0.3")
    ax.set_title("attention alone, same groups and shards", fontsize=9)
    ax.set_ylabel("attention per decode step (all layers), median (ms)")


def crossover_notes(attention: dict) -> list[str]:
    """The crossover lines the table and the plot print: measured here, modelled on the GPU preset."""
    mod = attention["modelled"]
    return ["crossover here (measured): " + "; ".join(crossover_text(attention["crossovers"][m], m)
                                                      for m in ("ring", "allgather")),
            f"crossover on {mod['preset']} (modelled, CP {mod['cp_size']}, bf16, the model's heads): "
            + "; ".join(crossover_text(mod[m], m) for m in ("ring", "allgather"))]


def crossover_text(x: dict, against: str) -> str:
    ctxs = x.get("contexts") or []
    span = f"{ctxs[0]}-{ctxs[-1]}" if ctxs else "no contexts"
    if x["always"]:
        return f"tree beats {against} at every measured context ({span})"
    if x["from_context"] is None:
        return f"tree does not beat {against} in {span}"
    return f"tree beats {against} from {x['from_context']} tokens"


def attention_summary(points: list[dict] | None, launch: dict, dims: tuple | None = None) -> dict | None:
    """The attention-only comparison for results.json: the measured points, where tree decode
    overtakes each other method here (measured), and where the cost model puts it on a GPU preset
    (modelled)."""
    if not points:
        return None
    from .baselines import crossover

    return {
        "how": ("attention of one decode step alone (batch 1, the model's heads), x num layers; global rank 0's "
                "wall time per call after a barrier, median of interleaved rounds, every method on the same "
                "groups and shards"),
        "points": points,
        "crossovers": {m: crossover(points, "tree", m) for m in ("ring", "allgather", "allgather_kv")},
        "modelled": modelled_crossovers(launch, points, dims),
    }


def modelled_crossovers(launch: dict, points: list[dict], dims: tuple | None = None, preset: str = "dgx_h100") -> dict:
    """Where the alpha-beta cost model puts tree decode's crossover against ring and the all-gather
    merge on a GPU preset, for this job's CP layout and ``dims`` (heads_q, heads_kv, head_dim) in bf16
    (contexts 2^8 .. 2^24)."""
    from ..comm.cost import Dims, load_preset, predict

    pr = load_preset(preset)
    cp = launch["cp_size"]
    intra = launch["level_sizes"].get("intra") if len(launch["level_sizes"]) == 2 else None
    tree = next(p["strategy"] for p in points if p["method"] == "tree")
    hq, hkv, d = dims or (32, 8, 128)
    dims = Dims(batch=1, heads_q=hq, heads_kv=hkv, head_dim=d, kv_bytes=2)
    ctxs = [2 ** e for e in range(8, 25)]
    out = {"preset": preset, "cp_size": cp, "intra_size": intra, "tree_strategy": tree,
           "dims": {"heads_q": dims.heads_q, "heads_kv": dims.heads_kv, "head_dim": dims.head_dim, "kv_bytes": 2}}
    for against in ("ring", "allgather"):
        pts = [{"context_length": c, "method": m, "step_ms": predict(s, pr, dims, cp, c, intra) * 1e3}
               for c in ctxs for m, s in (("tree", tree), (against, against))]
        from .baselines import crossover

        out[against] = crossover(pts, "tree", against)
    return out


def summary_line(r: dict) -> str:
    lat = r["decode_latency_ms"]
    ex = r["exactness"]
    levels = " ".join(f"{k}:{v['collectives']:g}/{v['sent_bytes']:.0f}B" for k, v in r["comm_per_step"]["levels"].items())
    what = "dlogprobs" if ex and ex.get("quantity") == "log_probs" else "dlogits"
    dl = f"{ex[f'max_abs_{what}']:.2e}" if ex else "n/a"
    same = "" if not ex else ("  tokens = reference" if ex["tokens_match_reference"] else "  tokens != reference")
    name = r["strategy"] if r["strategy"] == r["resolved_strategy"] else f"{r['strategy']}->{r['resolved_strategy']}"
    return (f"ctx={r['context_length']:<7d} batch={r['batch_size']:<3d} {name:<10s} "
            f"prefill {r['prefill_s']:.3f}s  decode p50 {lat['p50']:.2f} p90 {lat['p90']:.2f} "
            f"p99 {lat['p99']:.2f} ms  {r['tokens_per_s']:.1f} tok/s  coll/step {levels or '-'}  "
            f"max|{what}| {dl}{same}")


def track(tracker, results: dict, context_lengths, plot: str) -> None:
    """Tables per context length, the plot and the summary into the (rank-0) tracker."""
    runs, launch = results["runs"], results["launch"]
    for ctx in context_lengths:
        rows = [[r["strategy"], r["batch_size"], r["prefill_s"], r["decode_latency_ms"]["p50"],
                 r["decode_latency_ms"]["p90"], r["decode_latency_ms"]["p99"], r["tokens_per_s"],
                 r["comm_per_step"]["collectives"], r["comm_per_step"]["sent_bytes"],
                 max(r["peak_memory_bytes"]), r["exactness"]["max_abs_dlogits"] if r["exactness"] else None,
                 r["exactness"].get("max_abs_dlogprobs") if r["exactness"] else None]
                for r in runs if r["context_length"] == ctx]
        tracker.table(f"runs/ctx_{ctx}", ["strategy", "batch_size", "prefill_s", "p50_ms", "p90_ms", "p99_ms",
                                          "tokens_per_s", "collectives_per_step", "sent_bytes_per_step",
                                          "peak_memory_bytes_max", "max_abs_dlogits", "max_abs_dlogprobs"], rows)
    tracker.image("decode_latency_vs_context", plot)
    summ = {"max_abs_dlogits": results["max_abs_dlogits"], "max_abs_dlogprobs": results["max_abs_dlogprobs"],
            "engine": results["engine"], "exact": results["exact"],
            "tokens_match_reference": results["tokens_match_reference"], "world_size": launch["world_size"],
            "cp_size": launch["cp_size"], "tp_size": launch["tp_size"],
            **{f"level_size/{k}": v for k, v in launch["level_sizes"].items()}}
    for r in runs:
        key = f"{r['strategy']}/ctx{r['context_length']}/b{r['batch_size']}"
        summ.update({f"{key}/p50_ms": r["decode_latency_ms"]["p50"], f"{key}/tokens_per_s": r["tokens_per_s"]})
    for p in results["passkey"] or []:
        summ[f"passkey/ctx{p['context_length']}/accuracy"] = p["accuracy"]
    if results["perplexity"]:
        summ["perplexity"] = results["perplexity"]["perplexity"]
    tracker.summary(summ)


def write(results: dict, out_dir: Path) -> Path:
    path = out_dir / "results.json"
    path.write_text(json.dumps(results, indent=2))
    return path


def _table_row(r: dict) -> list[str]:
    lat, ex = r["decode_latency_ms"], r["exactness"]
    levels = " ".join(f"{k}:{v['collectives']:g}/{v['sent_bytes']:.0f}B" for k, v in r["comm_per_step"]["levels"].items())
    what = "dlogprobs" if ex and ex.get("quantity") == "log_probs" else "dlogits"
    name = r["strategy"] if r["strategy"] == r["resolved_strategy"] else f"{r['strategy']}->{r['resolved_strategy']}"
    return [str(r["context_length"]), str(r["batch_size"]), name, f"{r['prefill_s']:.3f}", f"{lat['p50']:.2f}",
            f"{lat['p90']:.2f}", f"{lat['p99']:.2f}", f"{r['tokens_per_s']:.1f}", levels or "-",
            f"{ex[f'max_abs_{what}']:.2e}" if ex else "n/a",
            "-" if not ex else ("same" if ex["tokens_match_reference"] else "DIFFER")]


def _columns(header: list[str], rows: list[list[str]], left=()) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(x.ljust(w) if i in left else x.rjust(w) for i, (x, w) in enumerate(zip(row, widths)))
    return [fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)]


def table_lines(results: dict) -> list[str]:
    """The sweep as a table with a header row (and the attention-only comparison, when measured)."""
    runs = results["runs"]
    what = "dlogits" if results.get("max_abs_dlogprobs") is None else "dlogprobs"
    header = ["ctx", "batch", "strategy", "prefill_s", "p50_ms", "p90_ms", "p99_ms", "tok/s",
              "collectives/bytes per step", f"max|{what}|", "tokens vs ref"]
    lines = _columns(header, [_table_row(r) for r in runs], left=(2, 8, 10))
    att = results.get("attention_baselines")
    if att:
        methods = ("tree", "allgather", "ring", "allgather_kv")
        ctxs = sorted({p["context_length"] for p in att["points"]})
        by = {(p["context_length"], p["method"]): p["step_ms"] for p in att["points"]}
        tree = next(p["strategy"] for p in att["points"] if p["method"] == "tree")
        lines += ["", f"attention alone per decode step, ms ({att['how']}):"]
        lines += _columns(["ctx", f"tree({tree})", "allgather", "ring", "allgather_kv"],
                          [[str(c), *(f"{by[(c, m)]:.3f}" for m in methods)] for c in ctxs])
        lines += crossover_notes(att)
    return lines


def verdict_line(results: dict, out_dir, tolerance: float) -> str:
    """One line: exact or not against what, by how much, over how many tokens, and where the results are."""
    checked = [r["exactness"] for r in results["runs"] if r["exactness"]]
    where = f"results in {Path(out_dir).resolve()}/ (results.json, decode_latency.png{', wandb' if results.get('wandb', {}).get('run_dir') else ''})"
    agree = "" if results["tokens_agree_across_ranks"] else ", RANKS DECODED DIFFERENT TOKENS"
    if not checked:
        return f"verdict: NOT CHECKED (eval.exactness.enabled is false){agree}; {where}"
    what = "dlogits" if results["max_abs_dlogprobs"] is None else "dlogprobs"
    worst = results[f"max_abs_{what}"]
    tokens = sum(len(row) for e in checked for row in e["reference_tokens"])
    state = "EXACT" if passed(results) else "NOT EXACT"
    launch = results["launch"]
    levels = " x ".join(f"{k} {v}" for k, v in launch["level_sizes"].items())
    same = "identical" if results["tokens_match_reference"] else "NOT identical"
    return (f"verdict: {state}: CP {launch['cp_size']} ({levels}) vs {results['exactness_reference']} (CP = 1): "
            f"max|{what}| {worst:.2e} (tolerance {tolerance:g}), {tokens} tokens compared in {len(checked)} runs, "
            f"{same}{agree}; {where}")


def print_plan(cfg, launch: dict, em, n_runs: int, out_dir) -> None:
    """What the job is about to run (rank 0, before the sweep)."""
    ev, m = cfg.eval, cfg.model
    levels = " x ".join(f"{k} {v}" for k, v in launch["level_sizes"].items())
    weights = m.path or ("random weights, seed %d" % m.seed)
    ref = em.reference_name if ev.exactness.enabled else "none (eval.exactness.enabled: false)"
    lines = [
        f"megatron-tree-eval: {cfg.name}: {em.info.get('class', m.source)} ({weights}), "
        f"CP {launch['cp_size']} = {levels} on {launch['world_size']} processes ({launch['launcher']}, "
        f"{launch['backend']}/{launch['device']})",
        f"  sweep: {n_runs} runs = contexts {list(ev.context_lengths)} x batch {list(ev.batch_sizes)} x strategies "
        f"{list(ev.strategies)}; each {ev.warmup_steps} warm-up + {ev.decode_steps} timed decode steps ({ev.engine} engine)",
        f"  reference: {ref}" + (f", sample rate {ev.exactness.sample_rate:g}, tolerance {ev.exactness.tolerance:g}"
                                 if ev.exactness.enabled else ""),
        "  then: " + ("attention alone: tree vs allgather merge vs ring vs all-gather KV at each context; "
                      if ev.attention_baselines else "") + f"outputs to {Path(out_dir).resolve()}",
    ]
    print("\n".join(lines), flush=True)


def wandb_line(tracker_dir: str | None, wandb_mode: str) -> str:
    """The summary's wandb line: the run's directory (with the command that uploads an offline run), or
    ``disabled`` and, where the environment switched it off, the variable that did."""
    from .tracking import env_disabled

    if tracker_dir:
        return f"wandb:   {tracker_dir}" + (f"  (sync with: wandb sync {tracker_dir})" if wandb_mode == "offline" else "")
    off = env_disabled()
    return "wandb:   disabled" + (f" ({off} in the environment)" if off else "")


def wandb_record(tracker_dir: str | None, wandb_mode: str) -> dict:
    """results.json's ``wandb`` entry: ``enabled``, the ``mode`` the run used (``"disabled"`` when no run was
    made), its ``run_dir``, and ``disabled_by``, the environment variable that switched wandb off (or null)."""
    from .tracking import env_disabled

    on = tracker_dir is not None
    return {"enabled": on, "mode": wandb_mode if on else "disabled", "run_dir": tracker_dir,
            "disabled_by": None if on else env_disabled()}


def print_summary(results: dict, path: Path, tracker_dir: str | None, wandb_mode: str, tolerance: float) -> None:
    for line in table_lines(results):
        print(line, flush=True)
    if results["passkey"]:
        print("passkey accuracy: " + ", ".join(f"ctx={p['context_length']}: {p['accuracy']:.2f}"
                                              for p in results["passkey"]))
    if results["perplexity"]:
        ppl = results["perplexity"]
        print(f"perplexity: {ppl['perplexity']:.3f} over {ppl['eval_tokens']} tokens of {ppl['text_file']}")
    print(f"results: {path.resolve()}")
    print(f"plot:    {Path(results['plot']).resolve()}")
    print(wandb_line(tracker_dir, wandb_mode))
    if not passed(results):
        worst = results["max_abs_dlogits"] if results["max_abs_dlogprobs"] is None else results["max_abs_dlogprobs"]
        what = "max|dlogits|" if results["max_abs_dlogprobs"] is None else "max|dlogprobs|"
        print(f"FAILED: {what} {worst} exceeds eval.exactness.tolerance {tolerance}, "
              "the reference chose other tokens, or ranks decoded different tokens", file=sys.stderr, flush=True)
    print(verdict_line(results, path.parent, tolerance), flush=True)
