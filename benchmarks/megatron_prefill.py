"""Megatron's static path at CP > 1, timed: prefill of one prompt, then decode per token (median over steps).

``python -m benchmarks.megatron_prefill --cp 2 --length 1024 --new-tokens 16 --out x.json``

Builds a small seeded ``GPTModel`` with tree attention in both slots (``model.build_gpt``) on
``--cp`` gloo ranks (CPU, one thread each), runs ``MegatronLM.prefill`` (the core attention's CP
prefill) and ``--new-tokens - 1`` ``decode_step`` calls, and reports the slowest rank's prefill
seconds, rank 0's median decode seconds per token, the tokens (equal on every rank) and, where the
core attention counts it, the ring's ``PrefillWork``. Every import is absolute, so the same file
run with ``PYTHONPATH`` at another checkout times that checkout's code (side by side: before and
after a change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _worker(rank, world, args) -> dict:
    """One CP rank (``run_ranks`` made the gloo group, one thread): its timings, tokens and ring counts."""
    import torch.distributed as dist

    from megatron_tree.decode.prefill import PrefillWork
    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    with megatron_on_cpu():
        mt.initialize_model_parallel(world)
        shape = mm.GPTShape(vocab_size=1024, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.heads // 2,
                            max_position_embeddings=args.length + args.new_tokens + 8, initializer_range=0.02)
        model = mm.build_gpt(shape, tree=True, cp=world, seed=7)
        work = PrefillWork()
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.prefill_work = work  # read only where the ring exists
        lm = mm.MegatronLM(model, mt.tree_groups_from_megatron(model.pg_collection), shape)
        ids = torch.randint(0, 1024, (args.length,), generator=torch.Generator().manual_seed(11)).tolist()
        cache = lm.new_cache(1, args.length + args.new_tokens + 1)
        dist.barrier()
        with torch.no_grad():
            t0 = time.perf_counter()
            tok = lm.prefill([ids], cache).argmax(-1)
            prefill = time.perf_counter() - t0
            tokens, steps = [int(tok[0])], []
            for _ in range(args.new_tokens - 1):
                t = time.perf_counter()
                tok = lm.decode_step(tok, cache).argmax(-1)
                tokens.append(int(tok[0]))
                steps.append(time.perf_counter() - t)
    return {"prefill_s": prefill, "decode_s": steps, "tokens": tokens,
            "work": {"pairs": work.pairs, "blocks": work.blocks, "skipped": work.skipped}}


def run(args) -> dict:
    from megatron_tree.utils.testing import run_ranks

    per_rank = dict(enumerate(run_ranks(_worker, args.cp, args, timeout=900, pg_timeout=600)))
    if any(per_rank[r]["tokens"] != per_rank[0]["tokens"] for r in per_rank):
        raise RuntimeError("ranks generated different tokens")
    import megatron_tree

    return {"code": os.path.dirname(megatron_tree.__file__), "cp": args.cp, "length": args.length,
            "layers": args.layers, "hidden": args.hidden, "new_tokens": args.new_tokens,
            "prefill_s": max(x["prefill_s"] for x in per_rank.values()),
            "decode_per_token_s": statistics.median(per_rank[0]["decode_s"]),
            "tokens": per_rank[0]["tokens"], "work": [per_rank[r]["work"] for r in sorted(per_rank)]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = run(args)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
