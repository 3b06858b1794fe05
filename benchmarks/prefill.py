"""End-to-end prefill and decode: transformers in one process against CP-sharded tree attention, side by side.

    python -m benchmarks.prefill [--lengths 4096 16384] [--rounds 2] [--new-tokens 6]
        [--cp 2] [--layers N] [--checkpoint DIR] [--out docs/prefill.json]

Invariant: both paths run the same weights on the same prompt in the same run, one after the
other in every round (round r starts with path r mod 2, so the shared machine's noise hits both
alike), and their greedy tokens are compared; the times are of the same calls a user makes.

* ``single``: the transformers model as it is (``attn_implementation="sdpa"``), one process
  using every core (``torch.set_num_threads(--threads)``, default all): prefill is one forward of
  the prompt with ``logits_to_keep=1`` and the argmax of its logits (time to first token);
  decode is one forward per token over transformers' own cache.
* ``cp``: ``--cp`` processes (gloo, one thread each) running the same model through
  :class:`~megatron_tree.integrations.hf.HFTreeModel` (``enable_tree_attention``): the prompt in
  the load-balanced layout, every layer on 1/CP of the tokens, ring prefill on the fused local
  kernels; decode one ``decode_step`` per token (``tree_decode`` over the sharded cache). While
  one path runs the other's processes block on a queue: they use no CPU.

The model is SmolLM2-135M's architecture (Llama: hidden 576, 30 layers, 9 heads, 3 KV heads,
MLP 1536, vocab 49152, tied embeddings) with seeded random weights, or ``--checkpoint`` (a local
transformers directory) when one is on disk; ``--layers`` keeps the first N layers (the per-layer
work, and so the ratio of the paths, is unchanged). The prompt is seeded random token ids.

Counted on every CP rank by the ring itself (``decode.prefill.PrefillWork``, passed to
``enable_tree_attention(work=...)``): the attention work of the causal prompt per layer (visible
(query, key) pairs), checked against what the layout the cache recorded implies; KV blocks
attended and skipped, kernel launches, seconds in local attention and seconds the ring waited for
a block after computing the previous one (communication not hidden by computation).

Output: a table on stdout and, with ``--out``, JSON (meta with the command, versions, CPU and
load; one entry per (length, round, path); a summary per length: medians and the ratios).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

__all__ = ["SMOLLM2_135M", "build_model", "run_single", "main"]

SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=32768, rope_theta=100000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=True, hidden_act="silu",
)
"""SmolLM2-135M's config.json (its architecture; max_position_embeddings raised to hold 16K prompts)."""


def build_model(checkpoint: str | None, layers: int | None, seed: int = 0):
    """The benchmark's transformers model in fp32, eval mode, ``sdpa`` attention; identical in every process."""
    import transformers

    if checkpoint:
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                                  attn_implementation="sdpa")
        if layers is not None:
            model.model.layers = model.model.layers[:layers]
            model.config.num_hidden_layers = layers
    else:
        cfg = transformers.LlamaConfig(**{**SMOLLM2_135M, **({} if layers is None else {"num_hidden_layers": layers})})
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(cfg)
    return model.float().eval()


def prompt_ids(length: int, vocab: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed + length)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


def _cache_kwarg() -> str:
    import inspect

    import transformers

    params = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x


_CACHE_KWARG = _cache_kwarg()


def _cache_of(out):
    return getattr(out, _CACHE_KWARG)


@torch.no_grad()
def run_single(model, ids: list[int], new_tokens: int) -> dict:
    """Prefill (forward + argmax) and greedy decode over transformers' own cache, timed."""
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    tok = int(out.logits[0, -1].argmax())
    prefill = time.perf_counter() - t0
    tokens, steps, past = [tok], [], _cache_of(out)
    for _ in range(new_tokens - 1):
        t = time.perf_counter()
        out = model(input_ids=torch.tensor([[tok]]), use_cache=True, **{_CACHE_KWARG: past})
        tok = int(out.logits[0, -1].argmax())
        past = _cache_of(out)
        steps.append(time.perf_counter() - t)
        tokens.append(tok)
    return {"prefill_s": prefill, "decode_s": steps, "tokens": tokens}


def _worker(rank, world, args, commands, results) -> None:
    """One CP rank (``run_ranks`` made the gloo group, one thread): builds the model, then runs one
    request per command until ``None``. A failure ends the ranks; the parent raises their tracebacks."""
    import torch.distributed as dist

    from megatron_tree.decode.prefill import PrefillWork, visible_pairs
    from megatron_tree.integrations.hf import HFTreeModel
    from megatron_tree.distributed.topology import TreeGroups

    groups = TreeGroups.build()
    work = PrefillWork()
    model = HFTreeModel(build_model(args.checkpoint, args.layers), groups, prefill="ring", work=work)
    results.put(("ready", rank, None))
    while True:
        cmd = commands[rank].get()
        if cmd is None:
            break
        ids, new_tokens = cmd
        cache = model.new_cache(1, len(ids) + new_tokens)
        dist.barrier()
        with torch.no_grad():
            t0 = time.perf_counter()
            counted = PrefillWork()
            work.__dict__.update(counted.__dict__)  # counts of this request's prefill only
            work.kernels = {}
            logits = model.prefill([ids], cache)
            tok = int(logits[0].argmax())
            prefill = time.perf_counter() - t0
            tokens, steps = [tok], []
            for _ in range(new_tokens - 1):
                t = time.perf_counter()
                tok = int(model.decode_step([tok], cache)[0].argmax())
                steps.append(time.perf_counter() - t)
                tokens.append(tok)
        store = cache.storage
        n_mine = int(store.seqlens[0])
        mine = store.positions[0, :n_mine]
        prompt_mine = mine[mine < len(ids)]
        layers = model.config.num_hidden_layers
        layout_pairs = visible_pairs(prompt_mine[None], torch.arange(len(ids))[None])
        if work.pairs != layers * layout_pairs:
            raise RuntimeError(f"rank {rank}: the ring counted {work.pairs} visible pairs over {layers} layers, "
                               f"the stored layout implies {layers} x {layout_pairs}")
        results.put(("done", rank, {"prefill_s": prefill, "decode_s": steps, "tokens": tokens,
                                    "pairs": work.pairs // layers, "prompt_tokens": int(prompt_mine.numel()),
                                    "blocks": work.blocks, "skipped": work.skipped, "kernels": dict(work.kernels),
                                    "attention_s": work.compute_s, "ring_wait_s": work.wait_s}))


class _CPRanks:
    """``cp`` worker processes that hold the enabled model and run one request per command."""

    def __init__(self, args):
        from megatron_tree.utils import testing

        self.world = args.cp
        ctx = testing.context()
        self.commands = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        # The harness runs in a thread of this process, which times the single path meanwhile.
        self.ranks = testing.RanksInBackground(_worker, self.world, args, self.commands, self.results,
                                               timeout=float("inf"), pg_timeout=1800)
        self._collect("ready")

    def _collect(self, what):
        got = {}
        while len(got) < self.world:
            kind, rank, value = self.ranks.get(self.results, timeout=3600)  # a failed rank: its traceback
            if kind != what:
                raise RuntimeError(f"CP rank {rank} said {kind!r}, expected {what!r}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def run(self, ids, new_tokens):
        for q in self.commands:
            q.put((ids, new_tokens))
        per_rank = self._collect("done")
        first = per_rank[0]
        for r, other in enumerate(per_rank[1:], 1):
            if other["tokens"] != first["tokens"]:
                raise RuntimeError(f"CP rank {r} generated {other['tokens']}, rank 0 {first['tokens']}")
        return {"prefill_s": max(x["prefill_s"] for x in per_rank), "decode_s": first["decode_s"],
                "tokens": first["tokens"], "per_rank": [{k: v for k, v in x.items() if k not in ("tokens", "decode_s")}
                                                        for x in per_rank],
                "pairs": [x["pairs"] for x in per_rank]}

    def close(self):
        for q in self.commands:
            q.put(None)
        self.ranks.result(timeout=60)


def _summary(entries, length):
    out = {}
    for path in ("single", "cp"):
        rows = [e for e in entries if e["length"] == length and e["path"] == path]
        if not rows:
            continue
        out[path] = {"prefill_s": statistics.median(e["prefill_s"] for e in rows),
                     "decode_per_token_s": statistics.median(s for e in rows for s in e["decode_s"]) if any(
                         e["decode_s"] for e in rows) else None}
    if "single" in out and "cp" in out:
        s, c = out["single"], out["cp"]
        out["cp_prefill_speed_vs_single"] = s["prefill_s"] / c["prefill_s"]
        if s["decode_per_token_s"] and c["decode_per_token_s"]:
            out["cp_decode_speed_vs_single"] = s["decode_per_token_s"] / c["decode_per_token_s"]
        singles = [e["tokens"] for e in entries if e["length"] == length and e["path"] == "single"]
        cps = [e["tokens"] for e in entries if e["length"] == length and e["path"] == "cp"]
        out["tokens_equal"] = all(t == singles[0] for t in singles + cps)
        pairs = next(e["pairs"] for e in entries if e["length"] == length and e["path"] == "cp")
        mean = sum(pairs) / len(pairs)
        out["attention_pairs_per_rank"] = pairs
        out["attention_work_spread"] = (max(pairs) - min(pairs)) / mean
        out["attention_pairs_total_expected"] = length * (length + 1) // 2
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--rounds", type=int, nargs="+", default=[2],
                    help="rounds per length (one value for all, or one per length)")
    ap.add_argument("--new-tokens", type=int, default=6)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    ap.add_argument("--checkpoint", default=None, help="a local transformers checkpoint directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rounds = args.rounds * len(args.lengths) if len(args.rounds) == 1 else args.rounds
    if len(rounds) != len(args.lengths):
        ap.error(f"--rounds takes one value or one per length ({len(args.lengths)}), got {len(args.rounds)}")
    if args.new_tokens < 1:
        ap.error("--new-tokens must be at least 1")

    torch.set_num_threads(args.threads)
    model = build_model(args.checkpoint, args.layers)
    cp = _CPRanks(args)
    meta = {"command": "python -m benchmarks.prefill " + " ".join(sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads_single": args.threads, "threads_per_cp_rank": 1, "cp": args.cp,
            "model": args.checkpoint or f"SmolLM2-135M architecture, random weights (seed 0)",
            "layers": model.config.num_hidden_layers, "dtype": "float32", "new_tokens": args.new_tokens,
            "load_average_start": os.getloadavg(), "started": datetime.datetime.utcnow().isoformat() + "Z"}
    entries, summary = [], {}

    def write():
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "summary": summary, "entries": entries}, f, indent=1)

    warm = prompt_ids(64, model.config.vocab_size)  # first calls pay one-time costs: not timed
    run_single(model, warm, 2)
    cp.run(warm, 2)
    print(f"{'length':>7} {'round':>5} {'path':>6} {'prefill s':>10} {'decode s/tok':>12}  tokens", flush=True)
    try:
        for length, n_rounds in zip(args.lengths, rounds):
            ids = prompt_ids(length, model.config.vocab_size)
            for r in range(n_rounds):
                order = ("single", "cp") if r % 2 == 0 else ("cp", "single")
                for path in order:
                    res = run_single(model, ids, args.new_tokens) if path == "single" else cp.run(ids, args.new_tokens)
                    entries.append({"length": length, "round": r, "path": path, **res,
                                    "load_average": os.getloadavg()})
                    dec = statistics.median(res["decode_s"]) if res["decode_s"] else float("nan")
                    print(f"{length:>7} {r:>5} {path:>6} {res['prefill_s']:>10.2f} {dec:>12.3f}  {res['tokens']}",
                          flush=True)
                    write()
            summary[str(length)] = _summary(entries, length)
            print(json.dumps({length: summary[str(length)]}), flush=True)
            write()
    finally:
        cp.close()
    meta["load_average_end"] = os.getloadavg()
    write()
    return summary


if __name__ == "__main__":
    main()
