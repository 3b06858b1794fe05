"""Megatron-LM-style text generation at CP > 1: ``python -m megatron_tree.eval.generate``.

Invariant: the same model, layout and launch as the eval -- the YAML config's ``model``,
``topology`` and ``dist`` sections, checked before any collective with the eval's checks,
built by the eval's :mod:`megatron_tree.eval.models` -- and the one generation loop,
:func:`megatron_tree.decode.generate` (every prompt prefilled CP-sharded at its full
length, rows of different lengths in one batch, CP rank 0's choice broadcast each step).
Only the prompts and the sampling come from the command line, under Megatron-LM's names
(``--out-seq-length``, ``--temperature``, ``--top_k``, ``--top_p``, ``--greedy``,
``--sample-input-file``, ``--sample-output-file``). A row stops at the model's EOS
(:func:`eos_ids`: transformers' ``eos_token_id``, or the tokenizer's, as Megatron-LM stops at its
end-of-document id) or at a ``--stop-token-id``; ``--ignore-eos`` keeps only the latter.
``--greedy`` with a flag that asks for sampling is refused, naming both.

Prompts are text when a tokenizer is configured (``model.tokenizer`` or
``<model.path>/tokenizer.json``), else whitespace-separated token ids. Global rank 0
writes one JSON object per prompt (``prompt``, ``prompt_tokens``, ``tokens``, ``text``) to
``--sample-output-file`` or stdout. Launch it like the eval: ``MODULE=megatron_tree.eval.generate
bash launch/local.sh --prompt "..."`` (every launcher script takes ``MODULE``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from .config import ConfigError, RunConfig, load_config

__all__ = ["main", "parse_args", "read_prompts"]


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="megatron-tree-generate",
        description="Generate text with a Megatron-Core GPTModel at TP x CP (or a transformers model at CP); "
                    "the model, topology and launch come from the YAML config, as for the eval.",
    )
    p.add_argument("--config", default=None, help="YAML config (default: the built-in tiny CPU model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    src.add_argument("--sample-input-file", "--prompts-file", dest="prompts_file",
                     help="one prompt per line")
    p.add_argument("--sample-output-file", "--output-file", dest="output_file", default=None,
                   help="JSON lines out (default: stdout)")
    p.add_argument("--out-seq-length", "--max-new-tokens", dest="max_new_tokens", type=int, default=32,
                   help="tokens to generate per prompt")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default unless --temperature/top-k/top-p)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top_k", "--top-k", dest="top_k", type=int, default=None)
    p.add_argument("--top_p", "--top-p", dest="top_p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: model.seed)")
    p.add_argument("--stop-token-id", dest="stop", type=int, action="append", default=[],
                   help="a row stops after producing this id (repeatable), besides the model's EOS")
    p.add_argument("--ignore-eos", dest="ignore_eos", action="store_true",
                   help="do not stop at the model's EOS (Megatron-Core's SamplingParams.no_early_termination); "
                        "--stop-token-id ids still stop a row")
    p.add_argument("--token-ids", action="store_true", help="prompts are token ids even when a tokenizer is configured")
    p.add_argument("overrides", nargs="*", help="dotted key=value config overrides, e.g. model.path=/ckpt")
    args, unknown = p.parse_known_args(argv)
    extra = [u for u in unknown if not u.startswith(("--local_rank", "--local-rank"))]
    if extra:
        p.error(f"unrecognised arguments: {' '.join(extra)}")
    # Sampling flags are checked here, before any model is built (a bad one used to surface as
    # generate()'s traceback after the build). Megatron-LM's conventions: top_k 0 = no top-k,
    # temperature 0 = greedy.
    if args.max_new_tokens < 1:
        p.error(f"--out-seq-length must be a positive integer, got {args.max_new_tokens}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        p.error(f"--top_p must lie in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < 0:
        p.error(f"--top_k must be >= 0 (0: no top-k), got {args.top_k}")
    if args.temperature is not None and not args.temperature >= 0:
        p.error(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
    if args.greedy:  # argmax decoding and a flag that asks for sampling contradict each other: say which was meant
        knobs = [f"{flag} {v}" for flag, v, off in (("--temperature", args.temperature, 0), ("--top_k", args.top_k, 0),
                                                     ("--top_p", args.top_p, None)) if v is not None and v != off]
        if knobs:
            p.error(f"--greedy contradicts {', '.join(knobs)} (greedy takes the argmax; the others sample): give one")
    if args.top_k == 0:
        args.top_k = None
    return args


def read_prompts(args, tok, vocab: int) -> tuple[list[str], list[list[int]]]:
    """Prompt strings and their token ids; a ConfigError names the bad prompt."""
    if args.prompts_file:
        if not os.path.isfile(args.prompts_file):
            raise ConfigError(f"--sample-input-file: {args.prompts_file!r} does not exist")
        with open(args.prompts_file, "rb") as f:
            data = f.read()
        try:
            lines = data.decode("utf-8").split("\n")
        except UnicodeDecodeError as e:
            line = data[: e.start].count(b"\n") + 1
            raise ConfigError(
                f"--sample-input-file: {args.prompts_file!r} is not UTF-8 text: byte {e.start} (line {line}) is "
                f"{data[e.start:e.start + 1]!r}; save the prompts as UTF-8, one per line"
            ) from None
        texts = [line for line in lines if line.strip()]
    else:
        texts = list(args.prompt)
    if not texts:
        raise ConfigError("no prompts given (the input file is empty)")
    ids = []
    for i, text in enumerate(texts):
        if tok is not None and not args.token_ids:
            row = tok.encode(text, add_special_tokens=False).ids
        else:
            try:
                row = [int(t) for t in text.split()]
            except ValueError:
                raise ConfigError(
                    f"prompt {i} ({text[:40]!r}) is not whitespace-separated token ids, and no tokenizer is "
                    "configured (set model.tokenizer)"
                ) from None
        bad = [t for t in row if not 0 <= t < vocab]
        if not row or bad:
            raise ConfigError(f"prompt {i} ({text[:40]!r}) has no tokens or ids outside [0, {vocab}): {bad[:5]}")
        ids.append(row)
    return texts, ids


def _ids(value) -> list[int]:
    """An ``eos_token_id`` field (an int, a list of ints or null) as a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def eos_ids(cfg: RunConfig, tok_file: str | None) -> list[int]:
    """The model's end-of-sequence ids, where a row stops by default (file reads only, the same on every rank).

    A transformers checkpoint (``model.source=hf``): ``generation_config.json``'s ``eos_token_id`` where that file
    exists, else ``config.json``'s -- what transformers' ``generate`` stops at (an int or a list). Otherwise
    (``megatron``, ``random``): the tokenizer's EOS, as Megatron-LM stops at its tokenizer's end-of-document id:
    the ``eos_token`` of the ``tokenizer_config.json`` beside ``tokenizer.json``. None known: no default stop.
    """
    import json

    def read(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    m = cfg.model
    if m.source == "hf" and m.path:
        gen = os.path.join(m.path, "generation_config.json")
        conf = os.path.join(m.path, "config.json")
        if os.path.isfile(gen):
            return _ids(read(gen).get("eos_token_id"))
        return _ids(read(conf).get("eos_token_id")) if os.path.isfile(conf) else []
    if tok_file is None:
        return []
    tok_conf = os.path.join(os.path.dirname(tok_file), "tokenizer_config.json")
    if not os.path.isfile(tok_conf):
        return []
    eos = read(tok_conf).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return []
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(tok_file).token_to_id(eos)
    return [] if eos_id is None else [eos_id]


def generate_main(cfg: RunConfig, args, env) -> list[dict] | None:
    """Build the model at the config's layout, generate, and return the rows on global rank 0."""
    from .launch import (check_launch, check_model, init_distributed, past_max_position, single_process_topology,
                         tokenizer_path)

    world = int(env.get("WORLD_SIZE", 1))
    cfg = single_process_topology(cfg, world, "megatron-tree-generate")
    cp_size = check_launch(cfg, world, env)
    if args.output_file:  # rank 0 writes it after generating: a folder that is not there fails now, not then
        folder = os.path.dirname(os.path.abspath(args.output_file))
        if not os.path.isdir(folder) or os.path.isdir(args.output_file):
            what = "is a directory" if os.path.isdir(args.output_file) else f"has no folder {folder!r}"
            raise ConfigError(f"--sample-output-file: {args.output_file!r} {what}; expected a file path in an "
                              "existing folder")
    checkpoint, max_pos = check_model(cfg.model)
    tok_file = tokenizer_path(cfg)
    if tok_file is not None and not os.path.isfile(tok_file):
        raise ConfigError(f"model.tokenizer: {tok_file!r} does not exist")
    tok = None
    if tok_file is not None and not args.token_ids:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tok_file)
    texts, prompts = read_prompts(args, tok, cfg.model.vocab_size)
    stop = list(args.stop) if args.ignore_eos else sorted(set(args.stop) | set(eos_ids(cfg, tok_file)))
    need = max(len(p) for p in prompts) + args.max_new_tokens - 1  # the last token's position is never run
    # the eval's rule, before any collective
    runs = need > max_pos and past_max_position(cfg.model)[0]
    if need > max_pos and not (cfg.eval.allow_beyond_max_position and runs):
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        fix = ("shorten it or set eval.allow_beyond_max_position=true" if runs else
               "its positions are a learned table of that many rows: shorten it")
        raise ConfigError(
            f"--out-seq-length: prompt {longest} has {len(prompts[longest])} tokens; with --out-seq-length "
            f"{args.max_new_tokens} it needs {need} positions, but the model has max_position_embeddings {max_pos}; "
            + fix
        )

    import torch.distributed as dist

    from . import models
    from .console import progress_enabled
    from ..decode.generate import generate

    backend, device = init_distributed(cfg, env)
    stack = contextlib.ExitStack()
    try:
        rank = dist.get_rank()
        em = models.build(cfg.model, cfg.topology, cp_size=cp_size, rank=rank, device=device, env=env,
                          want_reference=False, checkpoint=checkpoint, stack=stack,
                          allow_beyond_window=cfg.eval.allow_beyond_max_position)
        sample = args.temperature is not None or args.top_k is not None or args.top_p is not None
        sample = sample and not args.greedy and args.temperature != 0
        res = generate(em.lm, prompts, args.max_new_tokens, do_sample=sample,
                       temperature=args.temperature or 1.0, top_k=args.top_k, top_p=args.top_p,
                       stop_token_ids=stop, seed=cfg.model.seed if args.seed is None else args.seed,
                       progress=progress_enabled(cfg.eval.progress, rank))
        if rank != 0:
            return None
        return [{"prompt": t, "prompt_tokens": p, "tokens": out, "text": tok.decode(out) if tok else None}
                for t, p, out in zip(texts, prompts, res.tokens)]
    finally:
        stack.close()
        dist.destroy_process_group()


def main(argv=None) -> int:
    """Console entry point ``megatron-tree-generate``; 2 on a bad config, prompt or checkpoint."""
    from .launch import is_user_error, map_slurm_env

    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    mapped = map_slurm_env(env)
    os.environ.update(mapped)
    env.update(mapped)
    rank = env.get("RANK", "0")
    from .console import quiet_library_bars, quiet_third_party

    # the eval's console: third-party warnings once, on rank 0; bars only in a terminal session
    quiet_third_party(int(rank) if rank.isdigit() else 0, prog="megatron-tree-generate")
    quiet_library_bars()
    try:
        cfg = load_config(args.config, args.overrides)
        rows = generate_main(cfg, args, env)
    except ValueError as e:
        if not is_user_error(e):
            raise
        print(f"megatron-tree-generate: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if rows is not None:
        lines = "".join(json.dumps(r) + "\n" for r in rows)
        if args.output_file:
            with open(args.output_file, "w", encoding="utf-8") as f:
                f.write(lines)
        else:
            sys.stdout.write(lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
