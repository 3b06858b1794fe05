"""What a finished sweep leaves behind: results.json, the latency plot, the wandb run, summary lines.

Invariant: runs on global rank 0 only, after every collective of the run; it reads the
run dicts the sweep produced and never changes them, so results.json, wandb and the
printed lines all say the same thing. Schema of results.json: docs/eval.md (version 2).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["RESULTS_SCHEMA_VERSION", "build_results", "save_plot", "summary_line", "track", "write", "print_summary"]

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


def save_plot(runs: list[dict], path: Path, title: str = "tree decode latency vs context length") -> str:
    """Decode latency p50 vs context length, one line per (strategy, batch size)."""
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.subplots()
    strategies = list(dict.fromkeys(r["strategy"] for r in runs))
    batches = sorted({r["batch_size"] for r in runs})
    styles = ["-", "--", ":", "-."]
    for i, strategy in enumerate(strategies):
        for j, batch in enumerate(batches):
            pts = sorted((r["context_length"], r["decode_latency_ms"]["p50"]) for r in runs
                         if r["strategy"] == strategy and r["batch_size"] == batch)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=f"C{i}",
                    linestyle=styles[j % len(styles)], label=f"{strategy} (batch {batch})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step latency p50 (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


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


def print_summary(results: dict, path: Path, tracker_dir: str | None, wandb_mode: str, tolerance: float) -> None:
    for r in results["runs"]:
        print(summary_line(r), flush=True)
    if results["passkey"]:
        print("passkey accuracy: " + ", ".join(f"ctx={p['context_length']}: {p['accuracy']:.2f}"
                                              for p in results["passkey"]))
    if results["perplexity"]:
        ppl = results["perplexity"]
        print(f"perplexity: {ppl['perplexity']:.3f} over {ppl['eval_tokens']} tokens of {ppl['text_file']}")
    print(f"results: {path.resolve()}")
    print(f"plot:    {Path(results['plot']).resolve()}")
    print(f"wandb:   {tracker_dir or 'disabled'}"
          + (f"  (sync with: wandb sync {tracker_dir})" if tracker_dir and wandb_mode == "offline" else ""))
    if not passed(results):
        worst = results["max_abs_dlogits"] if results["max_abs_dlogprobs"] is None else results["max_abs_dlogprobs"]
        what = "max|dlogits|" if results["max_abs_dlogprobs"] is None else "max|dlogprobs|"
        print(f"FAILED: {what} {worst} exceeds eval.exactness.tolerance {tolerance}, "
              "the reference chose other tokens, or ranks decoded different tokens", file=sys.stderr)
