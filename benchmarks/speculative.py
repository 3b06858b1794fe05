"""Speculative decoding at CP 2 over gloo: prompt-lookup drafts against plain greedy ``generate``, in one run.

    python -m benchmarks.speculative [--prompt-len 1024] [--new-tokens 64] [--rounds 5]
        [--out benchmarks/results/speculative.json] [--markdown benchmarks/results/speculative.md]

The model (built here, seeded; say so wherever the numbers are quoted): a transformers
``LlamaForCausalLM`` (4 layers, hidden 256, 4 query / 2 KV heads, vocabulary 2048) with random
weights whose attention output projections are scaled by 1e-3, so its next token depends almost
only on the last one (a bigram model with attention still in every layer). Such a model's greedy
text falls into a cycle. The prompt is a span of random tokens followed by the model's own greedy
text (so it holds the cycle many times over), and its continuation repeats spans of the prompt:
a copy-heavy generation where prompt lookup (n-gram matches in the prompt and generated text)
drafts well. It is not a trained language model: acceptance here is an upper end of what real text
gives.

Two CP ranks (``megatron_tree.utils.testing.run_ranks``, gloo, one thread each) load the model
through ``integrations.hf.load_hf_model``. Each round runs plain greedy ``generate`` and every
speculative configuration on the same prompt, alternating, after one warm-up round. Per run: the
decode steps' times stamped inside the run (``GenerationResult.step_times``, a barrier-free
``perf_counter`` around each step), ms per generated token = the run's decode seconds / tokens after
the first; the table gives medians over rounds and the ratio to plain greedy within each round
(median). Speculative greedy tokens are asserted equal to plain greedy's; the sampling rows
(``do_sample`` at temperature 1 and 0.1) report their acceptance only. This model's distribution is
flat at temperature 1, and a sampled token off the cycle leads the text away from every span of the
prompt, so prompt lookup drafts little when sampling here.
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

CONFIGS = [  # (name, SpeculativeConfig kwargs, sampling temperature or False: greedy)
    ("lookup w1 d4", {"width": 1, "depth": 4}, False),
    ("lookup w1 d8", {"width": 1, "depth": 8}, False),
    ("lookup w3 d4", {"width": 3, "depth": 4}, False),
    ("lookup w1 d4, sampling T=1", {"width": 1, "depth": 4}, 1.0),
    ("lookup w1 d4, sampling T=0.1", {"width": 1, "depth": 4}, 0.1),
]


def build(path: str, prompt_len: int, seed: int = 0, attn_scale: float = 1e-3) -> list[int]:
    """Save the model into ``path``; return the prompt (random tokens, then the model's greedy text)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
                      initializer_range=0.1, rope_theta=10000.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn_scale)
    model.save_pretrained(path, safe_serialization=True)
    g = torch.Generator().manual_seed(seed + 1)
    head = torch.randint(0, cfg.vocab_size, (prompt_len // 4,), generator=g).tolist()
    with torch.no_grad():
        ids = model.generate(torch.tensor([head]), max_new_tokens=prompt_len - len(head),
                             min_new_tokens=prompt_len - len(head), do_sample=False, pad_token_id=0)
    return ids[0].tolist()


def _rank(rank, world, path, prompt, new_tokens, rounds):
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import load_hf_model

    groups = TreeGroups.build(intra_size=None)
    model = load_hf_model(path, groups)
    runs = {"plain greedy": []}
    runs.update({name: [] for name, _, _ in CONFIGS})
    for r in range(rounds + 1):  # round 0: warm-up, not recorded
        plain = generate(model, [prompt], new_tokens, progress=False)
        rec = {"plain greedy": {"tokens": plain.tokens, "steps": len(plain.step_times),
                                "step_ms": [t * 1e3 for t in plain.step_times], "accepted": None}}
        for name, kw, sampling in CONFIGS:
            extra = {"do_sample": True, "seed": r, "temperature": sampling} if sampling else {}
            res = generate(model, [prompt], new_tokens, progress=False, speculative=SpeculativeConfig(**kw), **extra)
            rec[name] = {"tokens": res.tokens, "steps": res.steps, "step_ms": [t * 1e3 for t in res.step_times],
                         "accepted": res.accepted, "drafted": res.drafted}
        if r:
            for name, v in rec.items():
                runs[name].append(v)
    return runs


def summarise(runs: dict, new_tokens: int) -> list[dict]:
    plain = runs["plain greedy"]
    rows = []
    for name, recs in runs.items():
        ms_tok = [sum(r["step_ms"]) / (new_tokens - 1) for r in recs]
        ratio = [a / b for a, b in zip(ms_tok, (sum(p["step_ms"]) / (new_tokens - 1) for p in plain))]
        acc = [a for r in recs if r["accepted"] for a in r["accepted"]]
        drafted = sum(r.get("drafted", 0) for r in recs)
        sampling = "sampling" in name
        rows.append({
            "config": name,
            "steps": statistics.median(r["steps"] for r in recs),
            "tokens_per_step": statistics.median([(new_tokens - 1) / r["steps"] for r in recs]),
            "acceptance_rate": (sum(a - 1 for a in acc) / drafted) if drafted else None,
            "median_step_ms": statistics.median(t for r in recs for t in r["step_ms"]),
            "ms_per_token": statistics.median(ms_tok),
            "ms_per_token_vs_plain": statistics.median(ratio),
            "tokens_equal_greedy": None if sampling else all(r["tokens"] == p["tokens"] for r, p in zip(recs, plain)),
        })
    return rows


def markdown(report: dict) -> str:
    lines = [f"# Speculative decoding at CP 2 (gloo, CPU): {report['model']}", "",
             f"Prompt {report['prompt_len']} tokens, {report['new_tokens']} new tokens, batch 1, "
             f"{report['rounds']} rounds (medians), `{report['command']}` on {report['machine']}.", "",
             "| config | steps | tokens/step | acceptance | median step ms | ms/token | vs plain | tokens = greedy |",
             "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        eq = "-" if r["tokens_equal_greedy"] is None else ("yes" if r["tokens_equal_greedy"] else "NO")
        lines.append(f"| {r['config']} | {r['steps']:g} | {r['tokens_per_step']:.2f} | {acc} | "
                     f"{r['median_step_ms']:.1f} | {r['ms_per_token']:.2f} | {r['ms_per_token_vs_plain']:.2f} | {eq} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attn-scale", type=float, default=1e-3, help="the attention output projections' scale")
    p.add_argument("--out", default="benchmarks/results/speculative.json")
    p.add_argument("--markdown", default="benchmarks/results/speculative.md")
    args = p.parse_args(argv)
    from megatron_tree.utils.testing import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        prompt = build(tmp, args.prompt_len, attn_scale=args.attn_scale)
        t0 = time.perf_counter()
        ranks = run_ranks(_rank, 2, tmp, prompt, args.new_tokens, args.rounds, timeout=3000)
        wall = time.perf_counter() - t0
    rows = summarise(ranks[0], args.new_tokens)
    bad = [r["config"] for r in rows if r["tokens_equal_greedy"] is False]
    for name in ranks[0]:
        if [r["tokens"] for r in ranks[0][name]] != [r["tokens"] for r in ranks[1][name]]:
            raise SystemExit(f"{name}: the CP ranks kept different tokens")
    report = {
        "model": f"tiny Llama (4 layers, hidden 256, vocab 2048), random weights, attention outputs x{args.attn_scale:g} "
                 + ("(a bigram model whose greedy text cycles; not a trained LM)" if args.attn_scale <= 1e-2 else
                    "(not a trained LM; its greedy text does not repeat the prompt)"),
        "prompt": "prompt_len/4 random tokens, then the model's own greedy continuation",
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds, "cp": 2,
        "backend": "gloo", "threads_per_rank": 1, "wall_s": wall,
        "command": "python -m benchmarks.speculative " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores shared (torch {torch.__version__})",
        "rows": rows,
    }
    if bad:
        raise SystemExit(f"speculative greedy tokens differ from plain greedy's: {bad}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
