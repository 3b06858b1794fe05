"""RULER ``niah_single_1`` through lm-evaluation-harness: the ``megatron_tree`` backend at CP vs lm-eval's ``hf``.

    python -m benchmarks.niah [--lengths 4096 8192 16384] [--samples 2] [--cp 2] [--layers 2]
        [--out benchmarks/results/niah.json] [--markdown docs/niah.md]

Invariant: both backends evaluate the same task (RULER's ``niah_single_1`` template, haystack, needle
and scorer, from lm-eval's own ``tasks/ruler``) on the same checkpoint and tokenizer, in the same
run, length by length, one after the other (the order alternates per length so the shared
machine's noise hits both alike); the time is of lm-eval's ``generate_until`` call on each backend
(sample building excluded), divided by the samples it served.

* ``hf``: lm-eval's ``HFLM`` in this process, every core (``torch.set_num_threads``), batch 1.
* ``tree``: ``--cp`` gloo processes, one thread each, each an lm-eval ``TreeLM`` (``--model
  megatron_tree``, ``cp_size=--cp``) running ``simple_evaluate`` on the same task; while one backend
  runs, the other's processes block on a queue and use no CPU.

RULER's task builds 500 samples per length before ``--limit`` applies (about 5 minutes per process
here); this benchmark registers a copy of the task whose dataset function asks RULER's
``generate_samples`` for ``--samples`` samples instead (same template, haystack, seed and scorer).

The model is SmolLM2-135M's architecture (``bench.prefill.SMOLLM2_135M``, its first ``--layers``
layers) with seeded random weights over a word-level tokenizer whose vocabulary covers RULER's
haystack, needle words and digits (built here, offline). Its answers are random, so the scores
compare the backends (identical generations) rather than measure the model.

KV bytes per rank: the keys and values each rank's cache allocated for the longest sample
(``TreeCache.kv_nbytes``), beside what one process would hold (``unsharded_kv_nbytes``).

One unreported warm-up sample per backend (``--warmup`` tokens) comes first. Generation stops at
the tokenizer's end token or after RULER's 128 tokens; both backends generate the same tokens, so
each length's samples cost both the same number of decode steps (``generated_tokens``).

Output: a table on stdout and, with ``--out``/``--markdown``, JSON (command, versions, load) and a
Markdown table.
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

import torch

__all__ = ["TASK", "write_task", "build_tokenizer", "build_checkpoint", "record_caches", "evaluate", "main"]

TASK = "mt_niah_single_1"

_DATASET_MODULE = '''"""niah_single_1 with a given number of samples (the benchmark's copy; RULER's own builds 500)."""
import os

from lm_eval.tasks.ruler import niah_utils
from lm_eval.tasks.ruler.common_utils import aggregate_metrics, get_tokenizer, process_results, resolve_tokenizer_name  # noqa: F401


def niah_single_1(**kwargs):
    seq_lengths = kwargs.pop("max_seq_lengths")
    tokenizer = get_tokenizer(resolve_tokenizer_name(kwargs))
    return niah_utils.download_dataset(
        niah_utils.generate_samples(
            niah_utils.get_haystack(type_haystack="repeat"), max_seq_length=seq, template=niah_utils.TEMPLATE,
            type_haystack="repeat", type_needle_k="words", type_needle_v="numbers",
            num_samples=int(os.environ["MT_NIAH_SAMPLES"]), TOKENIZER=tokenizer,
        )
        for seq in seq_lengths
    )
'''


def write_task(root: str) -> str:
    """The task YAML (RULER's niah_single_1 with this directory's dataset function) in ``root``."""
    import lm_eval

    ruler = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "ruler")
    with open(os.path.join(ruler, "niah_single_1.yaml"), encoding="utf-8") as f:
        text = f.read()
    text = text.replace("task: niah_single_1", f"task: {TASK}")
    text = text.replace("!function niah_utils.niah_single_1", "!function mt_niah_data.niah_single_1")
    text = text.replace("!function common_utils.", "!function mt_niah_data.")
    text = text.replace("tag:\n  - longcxt\n", "")
    with open(os.path.join(root, f"{TASK}.yaml"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(root, "mt_niah_data.py"), "w", encoding="utf-8") as f:
        f.write(_DATASET_MODULE)
    return root


def build_tokenizer(path: str):
    """A word-level tokenizer (digits split) over RULER's haystack, template and needle key words."""
    import re

    from lm_eval.tasks.ruler import niah_utils, prepare_niah
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = " ".join([str(niah_utils.get_haystack(type_haystack="repeat")), niah_utils.TEMPLATE, prepare_niah.NEEDLE,
                     "The special magic number for mentioned in the provided text is numbers are",
                     " ".join(prepare_niah.adjs), " ".join(prepare_niah.nouns)])
    words = sorted(set(re.findall(r"[A-Za-z_]+|[^\w\s]", text)))
    specials = ["<unk>", "<pad>", "</s>"] + [str(d) for d in range(10)]
    vocab = {t: i for i, t in enumerate(specials + [w for w in words if w not in specials])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                  pre_tokenizers.Digits(individual_digits=True)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def build_checkpoint(path: str, tok, layers: int, max_positions: int, **config) -> None:
    """SmolLM2-135M's architecture (``config`` overrides), first ``layers`` layers, seeded random weights, saved."""
    import transformers

    from .prefill import SMOLLM2_135M

    cfg = transformers.LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers, "vocab_size": len(tok),
                                      "max_position_embeddings": max_positions, "pad_token_id": tok.pad_token_id,
                                      "eos_token_id": tok.eos_token_id, "bos_token_id": None, **config})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)


def _timed(lm, record: list):
    """Wrap ``lm.generate_until`` to record (requests, seconds) of each call."""
    inner = lm.generate_until

    def generate_until(requests, disable_tqdm: bool = False):
        t0 = time.perf_counter()
        out = inner(requests, disable_tqdm=True)
        record.append((len(requests), time.perf_counter() - t0, [len(lm.tok_encode(r.args[0])) for r in requests]))
        return out

    lm.generate_until = generate_until
    return lm


def record_caches(lm) -> list:
    """Wrap a ``TreeLM``'s ``model.new_cache`` to keep every cache it makes (for their KV bytes and shards)."""
    caches = []
    new_cache = lm.model.new_cache
    lm.model.new_cache = lambda *a, **k: caches.append(new_cache(*a, **k)) or caches[-1]
    return caches


def evaluate(lm, root: str, length: int, samples: int) -> dict:
    """lm-eval's ``simple_evaluate`` of the task at one length; (generations, metric, seconds per sample)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    os.environ["MT_NIAH_SAMPLES"] = str(samples)
    record: list = []
    _timed(lm, record)
    metadata = {"max_seq_lengths": [length], "pretrained": os.path.join(root, "tok")}  # RULER reads both
    res = lm_eval.simple_evaluate(model=lm, tasks=[TASK], log_samples=True, batch_size=1, device="cpu",
                                  task_manager=TaskManager(include_path=root, include_defaults=False, metadata=metadata))
    if res is None:  # not lm-eval's rank 0
        return {}
    n = sum(r for r, _, _ in record)
    gens = [s["resps"][0][0] for s in sorted(res["samples"][TASK], key=lambda s: s["doc_id"])]
    return {"generations": gens, "generated_tokens": [len(lm.tok_encode(g)) for g in gens],
            "score": res["results"][TASK][f"{length},none"], "samples": n,
            "seconds_per_sample": sum(t for _, t, _ in record) / n,
            "prompt_tokens": sorted(x for _, _, xs in record for x in xs)}


def _worker(rank, world, root, cp, commands, results) -> None:
    """One CP rank (``run_ranks`` made the gloo group, one thread): a ``TreeLM`` evaluation per command
    until ``None``. A failure ends the ranks; the parent raises their tracebacks."""
    os.environ["LOCAL_RANK"] = str(rank)
    from megatron_tree.integrations.lm_eval import TreeLM

    while True:
        cmd = commands[rank].get()
        if cmd is None:
            break
        length, samples = cmd
        lm = TreeLM(pretrained=os.path.join(root, "model"), tokenizer=os.path.join(root, "tok"), cp_size=cp,
                    max_length=length, device="cpu", batch_size=1)
        caches = record_caches(lm)
        out = evaluate(lm, root, length, samples)
        biggest = max(caches, key=lambda c: c.kv_nbytes)
        out.update(kv_bytes_per_rank=biggest.kv_nbytes, kv_bytes_unsharded=biggest.storage.unsharded_kv_nbytes())
        results.put(("done", rank, out))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.niah", description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--samples", type=int, default=2, help="samples per length (RULER builds them)")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1024, help="length of one unreported warm-up sample per backend")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of the hf backend's process")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    from megatron_tree.utils import testing

    meta = {"command": "python -m benchmarks.niah " + " ".join(sys.argv[1:] if argv is None else argv),
            "torch": torch.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
            "threads_hf": args.threads, "threads_per_cp_rank": 1, "cp": args.cp, "layers": args.layers,
            "load_average_start": os.getloadavg(), "started": datetime.datetime.utcnow().isoformat() + "Z"}
    import lm_eval
    import transformers

    meta.update(lm_eval=lm_eval.__version__, transformers=transformers.__version__)
    root = tempfile.mkdtemp(prefix="mt_niah_")
    tok = build_tokenizer(os.path.join(root, "tok"))
    build_checkpoint(os.path.join(root, "model"), tok, args.layers, max(args.lengths) + 256)
    write_task(root)
    ctx = testing.context()
    commands = [ctx.Queue() for _ in range(args.cp)]
    results = ctx.Queue()
    # The ranks (environment above: offline) serve one length per command while this process runs hf.
    ranks = testing.RanksInBackground(_worker, args.cp, root, args.cp, commands, results, timeout=float("inf"),
                                      pg_timeout=3600)
    rows = []
    try:
        from lm_eval.models.huggingface import HFLM

        for i, length in enumerate([args.warmup] + args.lengths):
            row = {"length": length}
            samples = 1 if i == 0 else args.samples
            for path in (("hf", "tree") if i % 2 == 0 else ("tree", "hf")):
                if path == "hf":
                    torch.set_num_threads(args.threads)
                    lm = HFLM(pretrained=os.path.join(root, "model"), tokenizer=os.path.join(root, "tok"),
                              max_length=length, batch_size=1, device="cpu", dtype="float32")
                    row["hf"] = evaluate(lm, root, length, samples)
                    del lm
                else:
                    for q in commands:
                        q.put((length, samples))
                    outs = {}
                    while len(outs) < args.cp:
                        _, rank, out = ranks.get(results, timeout=7200)  # a failed rank: its traceback
                        outs[rank] = out
                    row["tree"] = outs[0]
                    row["tree"]["kv_bytes_each_rank"] = [outs[r]["kv_bytes_per_rank"] for r in range(args.cp)]
            row["identical_generations"] = row["hf"]["generations"] == row["tree"]["generations"]
            row["ratio_hf_over_tree"] = row["hf"]["seconds_per_sample"] / row["tree"]["seconds_per_sample"]
            row["load_average"] = os.getloadavg()
            if i == 0:  # the warm-up: first calls of both backends (thread pools, lazy imports), not reported
                continue
            rows.append(row)
            print(f"{length:>6} tokens: hf {row['hf']['seconds_per_sample']:.2f} s/sample, tree CP{args.cp} "
                  f"{row['tree']['seconds_per_sample']:.2f} s/sample ({row['ratio_hf_over_tree']:.2f}x), identical "
                  f"generations {row['identical_generations']}, KV/rank {row['tree']['kv_bytes_per_rank']:,} B of "
                  f"{row['tree']['kv_bytes_unsharded']:,} B", flush=True)
    finally:
        for q in commands:
            q.put(None)
        ranks.result(timeout=60)
    meta["load_average_end"] = os.getloadavg()
    report = {"meta": meta, "rows": rows}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown(report))
    return report


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [
        "# RULER niah_single_1: the megatron_tree lm-eval backend vs lm-eval's hf backend",
        "",
        f"Command: `{m['command']}` (lm-eval {m['lm_eval']}, transformers {m['transformers']}, torch {m['torch']}; "
        f"{m['cores']} cores; hf: one process, {m['threads_hf']} threads; tree: CP {m['cp']}, one thread per rank; "
        f"load average {m['load_average_start'][0]:.1f} at the start, {m['load_average_end'][0]:.1f} at the end).",
        f"Model: SmolLM2-135M's architecture, first {m['layers']} layers, random weights (generations compare "
        "the backends; the score measures nothing about the model). Seconds per sample: lm-eval's "
        "`generate_until` call (prompt prefill and 128 greedy tokens), sample building excluded.",
        "",
        "| length | samples | median prompt tokens | generated tokens | hf s/sample | tree s/sample | hf / tree | "
        "identical generations | KV bytes per rank | KV bytes in one process |",
        "|---:|---:|---:|---:|---:|---:|---:|:--|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['length']} | {r['tree']['samples']} | {statistics.median(r['tree']['prompt_tokens']):.0f} | "
            f"{sum(r['tree']['generated_tokens'])} | {r['hf']['seconds_per_sample']:.2f} | "
            f"{r['tree']['seconds_per_sample']:.2f} | {r['ratio_hf_over_tree']:.2f}x | {r['identical_generations']} | "
            f"{r['tree']['kv_bytes_per_rank']:,} | {r['tree']['kv_bytes_unsharded']:,} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
