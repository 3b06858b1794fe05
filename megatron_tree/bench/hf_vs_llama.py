"""Does ``models/llama.py`` earn its place? The library's Llama vs transformers' through ``integrations.hf``.

Invariant: both models are the same checkpoint (a random Llama saved with transformers'
``save_pretrained``), run on the same ``TreeGroups``, the same prompts, the same cache layout,
prefill method and merge strategy, through the same decode-loop protocol (``new_cache`` /
``prefill`` / ``decode_step``), interleaved round by round (round i starts with model i mod 2)
so machine noise hits both alike. Per CP size it records the prefill time and every decode
step's time (max over ranks, from a barrier), and checks that both models' logits agree.
Reported: medians and p90s side by side and the ratio transformers / library.

    python -m megatron_tree.bench.hf_vs_llama --ranks 2,4 --out-dir docs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

from ..strategies import STRATEGIES

MODELS = ("llama", "hf")


def make_checkpoint(path: str, args) -> None:
    """A random transformers Llama of the benchmark's shape, saved with safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads, max_position_embeddings=args.context + args.steps + 8,
                      initializer_range=0.05, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)


def _percentile(xs, q):
    xs = sorted(xs)
    pos = (len(xs) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _rank(rank, world, store_path, path, opts, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(opts["threads"])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    try:
        from megatron_tree.integrations.hf import load_hf_model
        from megatron_tree.models.llama import Llama
        from megatron_tree.topology import TreeGroups

        groups = TreeGroups.build()
        models = {"llama": Llama.from_pretrained(path, groups=groups).eval(), "hf": load_hf_model(path, groups)}
        gen = torch.Generator().manual_seed(opts["seed"])
        vocab = models["llama"].config.vocab_size
        prompts = [torch.randint(0, vocab, (opts["context"],), generator=gen).tolist() for _ in range(opts["batch"])]
        cache_len = opts["context"] + opts["steps"] + 1
        prefill_s = {m: [] for m in MODELS}
        step_ms = {m: [] for m in MODELS}
        max_dlogits = 0.0

        def timed(fn):
            dist.barrier()
            t0 = time.perf_counter()
            out = fn()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
            return out, float(t)

        for rnd in range(opts["warmup"] + opts["rounds"]):
            order = MODELS if rnd % 2 == 0 else MODELS[::-1]
            seen = {}
            for name in order:
                model = models[name]
                cache = model.new_cache(len(prompts), cache_len, layout=opts["layout"], block_size=16)
                with torch.no_grad():
                    logits, t = timed(lambda: model.prefill(prompts, cache, method=opts["prefill"]))
                    steps, logs = [], [logits]
                    ids = logits.argmax(-1)
                    for _ in range(opts["steps"]):
                        logits, dt = timed(lambda: model.decode_step(ids, cache, strategy=opts["strategy"]))
                        ids = logits.argmax(-1)
                        steps.append(dt)
                        logs.append(logits)
                seen[name] = torch.stack(logs)
                if rnd >= opts["warmup"]:
                    prefill_s[name].append(t)
                    step_ms[name].extend(1e3 * s for s in steps)
            max_dlogits = max(max_dlogits, float((seen["llama"] - seen["hf"]).abs().max()))
        if rank == 0:
            queue.put({"prefill_s": prefill_s, "step_ms": step_ms, "max_dlogits": max_dlogits,
                       "levels": [[lvl.name, lvl.size] for lvl in groups.levels]})
    except BaseException as e:  # noqa: BLE001 -- report it to the parent
        if rank == 0:
            queue.put({"error": repr(e)})
        raise
    finally:
        dist.destroy_process_group()


def run(ranks: int, path: str, opts: dict) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="mt_hfbench_")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ranks, os.path.join(tmp, "store"), path, opts, queue))
             for r in range(ranks)]
    for p in procs:
        p.start()
    res = queue.get(timeout=opts["timeout_s"])
    for p in procs:
        p.join(timeout=60)
    if "error" in res:
        raise RuntimeError(f"CP {ranks}: {res['error']}")
    return res


def summarise(ranks: int, res: dict) -> dict:
    row = {"cp": ranks, "levels": res["levels"], "max_dlogits": res["max_dlogits"]}
    for m in MODELS:
        row[m] = {"prefill_s_median": statistics.median(res["prefill_s"][m]),
                  "step_ms_median": statistics.median(res["step_ms"][m]),
                  "step_ms_p90": _percentile(res["step_ms"][m], 0.9),
                  "steps": len(res["step_ms"][m]), "prefills": len(res["prefill_s"][m])}
    row["ratio_hf_over_llama"] = {
        "prefill": row["hf"]["prefill_s_median"] / row["llama"]["prefill_s_median"],
        "step": row["hf"]["step_ms_median"] / row["llama"]["step_ms_median"],
    }
    return row


def markdown(rows, meta) -> str:
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Model: {meta['shape']}; batch {meta['opts']['batch']}, context {meta['opts']['context']} tokens, "
        f"{meta['opts']['steps']} decode steps x {meta['opts']['rounds']} rounds (interleaved), prefill "
        f"`{meta['opts']['prefill']}`, merge `{meta['opts']['strategy']}`, gloo, fp32, {meta['cpus']} CPUs, "
        f"{meta['date']}.",
        "",
        "| CP | prefill s (library) | prefill s (transformers) | ratio | decode ms p50 (library) | "
        "decode ms p50 (transformers) | ratio | p90 library / transformers | max abs dlogits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b, q = r["llama"], r["hf"], r["ratio_hf_over_llama"]
        lines.append(f"| {r['cp']} | {a['prefill_s_median']:.3f} | {b['prefill_s_median']:.3f} | {q['prefill']:.2f} | "
                     f"{a['step_ms_median']:.1f} | {b['step_ms_median']:.1f} | {q['step']:.2f} | "
                     f"{a['step_ms_p90']:.1f} / {b['step_ms_p90']:.1f} | {r['max_dlogits']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tree.bench.hf_vs_llama",
                                 description="The library's Llama vs transformers' LlamaForCausalLM with tree attention.")
    ap.add_argument("--ranks", default="2,4", help="CP sizes, comma separated (local gloo processes)")
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens per row")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs both models)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prefill", default="ring", choices=("ring", "allgather"))
    ap.add_argument("--strategy", default="packed", choices=STRATEGIES)
    ap.add_argument("--layout", default="load_balanced", choices=("load_balanced", "contiguous"))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out-dir", default=None, help="write hf_vs_llama.json and .md here")
    args = ap.parse_args(argv)
    opts = {k: getattr(args, k) for k in ("context", "batch", "steps", "rounds", "warmup", "prefill", "strategy",
                                           "layout", "threads", "seed", "timeout_s")}
    command = "python -m megatron_tree.bench.hf_vs_llama " + " ".join(argv if argv is not None else sys.argv[1:])
    import torch
    import transformers

    meta = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "opts": opts,
            "shape": (f"Llama, {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, "
                      f"{args.heads} query / {args.kv_heads} KV heads, vocab {args.vocab}")}
    rows = []
    with tempfile.TemporaryDirectory(prefix="mt_hfbench_ckpt_") as path:
        make_checkpoint(path, args)
        for p in (int(x) for x in args.ranks.split(",") if x):
            rows.append(summarise(p, run(p, path, opts)))
    md = markdown(rows, meta)
    if args.out_dir:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "hf_vs_llama.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out_dir, "hf_vs_llama.md"), "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
