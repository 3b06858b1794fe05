"""When ATen's fused CPU attention beats the two-matmul loop, per decode shape: the data behind
``megatron_tree.ops.torch_decode.use_fused``.

``ops.flash_decode(backend="torch")`` on CPU has two paths for an unmasked float32 row (no
positions, no soft-cap): one call of ATen's fused flash-attention kernel
(``torch._scaled_dot_product_flash_attention_for_cpu``, which returns the lse), or the loop of
``torch_decode.decode`` (two batched matmuls per row, the query heads of one KV head together).
The fused call costs a few microseconds of host time where the loop costs about twenty small
calls; but it reads each KV head once per *query* head of its group, the loop once per KV head, so
with a GQA group of 4 or more the fused kernel is the slower one past a few hundred keys.

For each (Hq, Hkv, D) and number of keys N this times both paths on the same head-major cache (the
layout of ``decode.cache.ShardedKVCache`` on CPU), B = 1, one query token, ``--threads`` threads,
interleaved call by call (fused then loop), and reports the median over ``--reps`` pairs of the
ratio fused time / loop time (< 1: the fused kernel is faster), next to the path ``use_fused``
chooses, so that a rule that picks the slower path by a wide margin shows here.

    PYTHONPATH=$PWD python -m benchmarks.cpu_fused --out benchmarks/results/cpu_fused.json

Writes JSON and a markdown table beside it. Absolute times mean little on a shared machine: the
ratio, measured call by call, is what this measures. A second section times a model's whole decode step
with the rule and with the length-only rule it replaced (``model_step``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

SHAPES = ((9, 3, 64), (32, 8, 128), (32, 8, 64), (12, 12, 64), (16, 2, 64), (8, 1, 128), (28, 4, 128))
"""(Hq, Hkv, D): SmolLM2-135M, Llama-3-8B, its head dim halved, MHA, GQA groups of 8, Qwen2.5-7B's 7."""

KEYS = (128, 512, 2048, 8192)


def _pair(q, k, v, n: int):
    from megatron_tree.ops import torch_decode as td

    lens = [n]
    scale = q.shape[-1] ** -0.5  # the loop's default

    def fused():
        return td._fused(q, k, v, lens, None, scale)

    def loop():
        saved = td._FUSED
        td._FUSED = None  # the loop's own path for the same row
        try:
            return td.decode(q, k, v, None, None, None, None, None, None, None, None, None, None, lens=lens)
        finally:
            td._FUSED = saved

    return fused, loop


def measure(hq: int, hkv: int, d: int, n: int, reps: int) -> dict:
    """fused/loop time ratio (median of ``reps`` interleaved pairs) for one shape; checks the two agree."""
    from megatron_tree.ops import torch_decode as td

    g = torch.Generator().manual_seed(hq * 1000 + n)
    cap = n + 16
    q = torch.randn(1, 1, hq, d, generator=g)
    k = torch.randn(1, hkv, cap, d, generator=g).transpose(1, 2)  # head-major storage, (1, cap, hkv, d) view
    v = torch.randn(1, hkv, cap, d, generator=g).transpose(1, 2)
    fused, loop = _pair(q, k, v, n)
    a, b = fused(), loop()
    err = max(float((a[0] - b[0]).abs().max()), float((a[1] - b[1]).abs().max()))
    if err > 1e-4:
        raise AssertionError(f"fused and loop disagree by {err} at {(hq, hkv, d, n)}")
    ratios, t_loop = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fused()
        t1 = time.perf_counter()
        loop()
        t2 = time.perf_counter()
        ratios.append((t1 - t0) / (t2 - t1))
        t_loop.append(t2 - t1)
    return {"hq": hq, "hkv": hkv, "d": d, "n": n, "fused_over_loop": statistics.median(ratios),
            "loop_us": 1e6 * statistics.median(t_loop), "rule": "fused" if td.use_fused(hq // hkv, n) else "loop"}


def model_step(context: int, steps: int = 40) -> dict:
    """A model's decode step with the rule against the length-only rule it replaced (fused up to 2048 keys,
    whatever the group), alternating step by step in one process: ``HFTreeModel.decode_step`` at world 1
    of a random GQA-4 Llama (hidden 1024, 8 query / 2 KV heads of 128, 4 layers) with two caches of the
    same ``context``-token prompt. Returns the median ms/step of each and the median per-pair ratio."""
    import transformers

    from megatron_tree.decode.generate import DecodeStep
    from megatron_tree.integrations.hf import HFTreeModel
    from megatron_tree.ops import torch_decode as td

    cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=1000,
                                   max_position_embeddings=2 * context + 2 * steps)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = HFTreeModel(transformers.LlamaForCausalLM(cfg).eval(), None, strategy="packed")
    rules = {"use_fused": td.use_fused, "length_only": lambda group, keys: keys <= 2048}
    caches = {name: model.new_cache(1, context + steps + 8) for name in rules}
    times: dict = {name: [] for name in rules}
    logits: dict = {name: [] for name in rules}
    try:
        with torch.no_grad():
            for cache in caches.values():
                model.prefill([[i % 997 for i in range(context)]], cache)
            for i in range(steps):
                for name in (list(rules) if i % 2 == 0 else list(rules)[::-1]):
                    td.use_fused = rules[name]
                    t0 = time.perf_counter()
                    logits[name].append(model.decode_step(torch.tensor([7]), caches[name], DecodeStep("packed")))
                    times[name].append(time.perf_counter() - t0)
    finally:
        td.use_fused = rules["use_fused"]
    diff = max(float((a - b).abs().max()) for a, b in zip(*logits.values()))
    if diff > 1e-4:
        raise AssertionError(f"the two rules' logits differ by {diff}")
    keep = slice(2, None)  # the first steps warm up
    return {"context": context, "ms_per_step": {n: 1e3 * statistics.median(t[keep]) for n, t in times.items()},
            "use_fused_over_length_only": statistics.median(
                [a / b for a, b in zip(times["use_fused"][keep], times["length_only"][keep])]),
            "max_logit_diff": diff}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (at least 1)")
    p.add_argument("--reps", type=int, default=40, help="interleaved fused/loop pairs per shape (at least 1)")
    p.add_argument("--out", default=None, help="JSON path; the Markdown table goes beside it (.md)")
    p.add_argument("--step-contexts", type=int, nargs="*", default=[1000, 2000],
                   help="contexts of the model-step comparison (model_step); none to skip it")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    bad = [c for c in args.step_contexts if c < 1]
    if bad:
        p.error(f"--step-contexts takes prompt lengths of at least 1 token, got {bad}")
    if args.out:  # before the timing: an unwritable --out is found now, not after minutes of it
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.set_num_threads(args.threads)
    steps = [model_step(c) for c in args.step_contexts]
    for r in steps:
        print(f"model step at {r['context']} tokens: use_fused {r['ms_per_step']['use_fused']:.2f} ms, length-only "
              f"{r['ms_per_step']['length_only']:.2f} ms, ratio {r['use_fused_over_length_only']:.3f}", flush=True)
    rows = []
    for hq, hkv, d in SHAPES:
        for n in KEYS:
            r = measure(hq, hkv, d, n, args.reps)
            rows.append(r)
            print(f"Hq/Hkv/D {hq}/{hkv}/{d} N={n}: fused/loop {r['fused_over_loop']:.2f} "
                  f"(loop {r['loop_us']:.0f} us), rule: {r['rule']}", flush=True)
    out = {"command": " ".join(["python -m benchmarks.cpu_fused", *(argv if argv is not None else sys.argv[1:])]),
           "torch": torch.__version__, "machine": platform.machine(), "threads": args.threads,
           "load_average": os.getloadavg()[0], "rows": rows, "model_step": steps}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        md = os.path.splitext(args.out)[0] + ".md"
        with open(md, "w") as f:
            f.write(f"# Fused CPU attention vs the loop, per decode shape ({args.threads} thread(s))\n\n"
                    f"`{out['command']}`; median of {args.reps} interleaved pairs of the ratio fused time / loop "
                    f"time (< 1: fused faster), B = 1, one query token, head-major fp32 cache; load average "
                    f"{out['load_average']:.1f}.\n\n| Hq/Hkv/D | " + " | ".join(f"N={n}" for n in KEYS) + " |\n|---|"
                    + "---|" * len(KEYS) + "\n")
            for hq, hkv, d in SHAPES:
                cells = [r for r in rows if (r["hq"], r["hkv"], r["d"]) == (hq, hkv, d)]
                f.write(f"| {hq}/{hkv}/{d} | " + " | ".join(
                    f"{r['fused_over_loop']:.2f} ({r['rule']})" for r in cells) + " |\n")
            f.write("\nIn parentheses: the path `torch_decode.use_fused` takes for that shape.\n")
            if steps:
                f.write("\nA model's decode step (`model_step`: `HFTreeModel.decode_step` at world 1, a random GQA-4 "
                        "Llama, hidden 1024, 8/2 heads of 128, 4 layers), the rule against the length-only rule it "
                        "replaced (fused up to 2048 keys), alternating step by step:\n\n| context | use_fused ms/step "
                        "| length-only ms/step | ratio (median of pairs) |\n|---|---|---|---|\n")
                for r in steps:
                    f.write(f"| {r['context']} | {r['ms_per_step']['use_fused']:.2f} | "
                            f"{r['ms_per_step']['length_only']:.2f} | {r['use_fused_over_length_only']:.3f} |\n")
    return out


if __name__ == "__main__":
    main()
