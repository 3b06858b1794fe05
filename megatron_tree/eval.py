"""Long-context decode eval: ``python -m megatron_tree.eval --config configs/<name>.yaml [key=value ...]``.

Invariant: one process per rank, launched by torchrun, the deepspeed launcher or Slurm
(or none, for a single process); everything the run does is in the resolved
:class:`~megatron_tree.config.RunConfig`. A configuration that cannot run -- an unknown
key, a wrong type, a CP size that does not fit the launched world, a topology that does
not factor, a missing checkpoint -- fails on *every* rank with the same message before any
collective is issued, so a launcher never hangs on a half-failed job.

For each (context length, batch size, merge strategy) a run does a context-parallel
prefill of random (or tokenized) prompts, then ``warmup_steps + decode_steps`` greedy
decode steps, and records:

* decode-step latency p50/p90/p99 (max over the CP ranks of each step), tokens/s, prefill time;
* collectives and bytes per level per step (``comm.CommStats``);
* peak memory per rank (CPU: the process's peak resident set, ``getrusage`` ``ru_maxrss``;
  CUDA: ``torch.cuda.max_memory_allocated`` since the run started);
* exactness: max |delta logits| of the prefill and of sampled decode steps against an
  unsharded replica of the model (``groups=None``, the same weights) over the full sequence.

Global rank 0 writes ``results.json`` (schema: docs/eval.md), the latency plot and the
wandb run into ``output_dir``; the other ranks are quiet.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

from .config import ConfigError, RunConfig, load_config, to_dict

__all__ = ["main", "run_eval", "map_slurm_env", "check_launch", "percentile"]

RESULTS_SCHEMA_VERSION = 1


# --------------------------------------------------------------------------- launch environment


def map_slurm_env(env) -> dict:
    """torch's variables from Slurm's when a task was started by ``srun`` without torchrun.

    Returns the variables to add (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); empty
    when RANK is already set or this is not a Slurm task. MASTER_ADDR/PORT come from the
    sbatch script (first host of the node list).
    """
    if "RANK" in env or "SLURM_PROCID" not in env:
        return {}
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
    }
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    if per_node:
        out["LOCAL_WORLD_SIZE"] = per_node.split("(")[0].split(",")[0]
    return out


def launcher_name(env) -> str:
    if "TORCHELASTIC_RUN_ID" in env:
        return "slurm+torchrun" if "SLURM_PROCID" in env else "torchrun"
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "deepspeed"
    if "SLURM_PROCID" in env:
        return "slurm"
    return "none"


def check_launch(cfg: RunConfig, world: int) -> int:
    """The CP size for ``world`` launched ranks, or a ConfigError that names the mismatch.

    Runs before any process group exists, identically on every rank.
    """
    cp = cfg.topology.cp_size or world
    if cp > world:
        raise ConfigError(
            f"topology.cp_size: {cp} does not fit the launched world of {world} rank(s); "
            f"launch at least {cp} processes or set topology.cp_size to a divisor of {world}"
        )
    if world % cp:
        raise ConfigError(
            f"topology.cp_size: {cp} does not divide the launched world of {world} rank(s); "
            f"expected a divisor of {world}"
        )
    intra = cfg.topology.intra_size
    if intra is not None and cp % intra:
        raise ConfigError(
            f"topology.intra_size: {intra} does not factor the CP size {cp}; expected a divisor of {cp}"
        )
    return cp


def _hf_config(path: str) -> dict:
    file = os.path.join(path, "config.json")
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.path: {file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model.path: {file} must hold a JSON object, got {type(data).__name__}")
    return data


def check_inputs(cfg: RunConfig) -> None:
    """Files the run needs (checkpoint, tokenizer, text file, ds_config), checked before launch."""
    m, ev = cfg.model, cfg.eval
    max_pos = m.max_position_embeddings
    if m.source == "hf":
        p = Path(m.path)
        if not p.is_dir():
            raise ConfigError(f"model.path: checkpoint directory {m.path!r} does not exist")
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.path: {m.path!r} has no config.json (expected a Hugging Face checkpoint)")
        if not any(p.glob("*.safetensors")):
            raise ConfigError(f"model.path: {m.path!r} has no *.safetensors weights")
        max_pos = _hf_config(m.path).get("max_position_embeddings", max_pos)
    need = max(ev.context_lengths) + ev.warmup_steps + ev.decode_steps + 1
    if need > max_pos and not ev.allow_beyond_max_position:
        raise ConfigError(
            f"eval.context_lengths: the longest run needs {need} positions (context + warmup + decode "
            f"steps + 1), but the model has max_position_embeddings {max_pos}; shorten it or set "
            "eval.allow_beyond_max_position=true"
        )
    if ev.passkey.enabled or ev.perplexity.text_file:
        tok = tokenizer_path(cfg)
        what = "eval.passkey.enabled" if ev.passkey.enabled else "eval.perplexity.text_file"
        if tok is None:
            raise ConfigError(
                f"{what} needs a tokenizer: set model.tokenizer to a tokenizer.json or use a checkpoint "
                "directory that has one"
            )
        if not os.path.isfile(tok):
            raise ConfigError(f"model.tokenizer: {tok!r} does not exist")
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ConfigError(f"{what} needs the 'tokenizers' package to read {tok!r}; pip install tokenizers") from None
    if ev.perplexity.text_file and not os.path.isfile(ev.perplexity.text_file):
        raise ConfigError(f"eval.perplexity.text_file: {ev.perplexity.text_file!r} does not exist")
    if cfg.wandb.ds_config and not os.path.isfile(cfg.wandb.ds_config):
        raise ConfigError(f"wandb.ds_config: {cfg.wandb.ds_config!r} does not exist")


def tokenizer_path(cfg: RunConfig) -> str | None:
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    if cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "tokenizer.json")):
        return os.path.join(cfg.model.path, "tokenizer.json")
    return None


def init_distributed(cfg: RunConfig, env) -> tuple[str, "object"]:
    """Initialise torch.distributed from the launcher's env:// variables; returns (backend, device)."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = cfg.dist.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend: nccl needs CUDA, which this machine does not have; use gloo or auto")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(env.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=cfg.topology.timeout_s)
    if "RANK" not in env:  # a single process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif cfg.dist.init == "deepspeed":
        try:  # the integration's helper skips the CPU shm op's g++ compile
            from .integrations.deepspeed import init_distributed as ds_init
        except ImportError:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        else:
            ds_init(dist_backend=backend, timeout_s=cfg.topology.timeout_s, env=env)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    return backend, device


# --------------------------------------------------------------------------- model


def build_model(cfg: RunConfig, groups, device):
    """The model on this rank (weights replicated on every CP rank) and its LlamaConfig."""
    import dataclasses

    import torch

    from .models.llama import Llama, LlamaConfig

    dtype = getattr(torch, cfg.model.dtype)
    m = cfg.model
    if m.source == "hf":
        model = Llama.from_pretrained(m.path, groups=groups, dtype=dtype, device=device)
        lcfg = model.config
    else:
        wanted = {f.name for f in dataclasses.fields(LlamaConfig)}
        lcfg = LlamaConfig(**{k: v for k, v in to_dict(m).items() if k in wanted})
        torch.manual_seed(m.seed)  # identical random weights on every rank
        model = Llama(lcfg, groups=groups, dtype=dtype)
    return model.to(device).eval(), lcfg


def build_reference(model, lcfg, cfg: RunConfig, device):
    """An unsharded replica (``groups=None``) sharing the model's weight tensors."""
    import torch

    from .models.llama import Llama

    # Built on the meta device and pointed at the model's tensors: no second copy of the weights.
    with torch.device("meta"):
        ref = Llama(lcfg, groups=None, dtype=getattr(torch, cfg.model.dtype))
    ref.load_state_dict(model.state_dict(), assign=True)
    return ref.to(device).eval()


# --------------------------------------------------------------------------- one run


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100] of a non-empty list."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of an empty list")
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device) -> tuple[int, str]:
    """(bytes, kind): CUDA allocator peak since the last reset, or the process's peak RSS on CPU."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device)), "cuda_max_memory_allocated"
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024, "cpu_peak_rss"


def random_prompts(cfg: RunConfig, ctx: int, batch: int, vocab: int) -> list[list[int]]:
    """Identical on every rank: seeded by (model seed, context length, batch size)."""
    rng = random.Random(f"{cfg.model.seed}-{ctx}-{batch}")
    return [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(batch)]


def greedy_decode(model, prompts, cache_len, cfg: RunConfig, groups, device, strategy, *,
                  bar=None, forced=None, record_steps=()):
    """CP prefill, then greedy (or teacher-forced) decode steps with per-step timing.

    prompts: ``batch`` lists of token ids; forced: (batch, n) token ids to feed instead of
    the argmax (perplexity), n = the number of decode steps; record_steps: decode step
    indices whose logits are kept (rows: (batch, vocab) on CPU).
    Returns a dict with tokens (batch, 1 + steps), prefill_logits, step_times, stats, kept.
    """
    import torch
    import torch.distributed as dist

    from .comm import CommStats

    ev = cfg.eval
    steps = forced.shape[1] if forced is not None else ev.warmup_steps + ev.decode_steps
    cache = model.new_cache(len(prompts), cache_len, layout=ev.cache_layout, block_size=ev.block_size)
    dist.barrier(group=groups.cp_group)
    t0 = time.perf_counter()
    with torch.no_grad():
        logits = model.prefill(prompts, cache, method=ev.prefill_method)
    _sync(device)
    prefill_time = time.perf_counter() - t0
    prefill_logits = logits.float().cpu()
    nxt = forced[:, 0].to(device) if forced is not None and forced.shape[1] else logits.argmax(-1)
    tokens = [nxt.cpu()]
    times, kept, stats = [], {}, CommStats()
    step_logits = []
    for s in range(steps):
        timed = forced is not None or s >= ev.warmup_steps
        dist.barrier(group=groups.cp_group)
        t0 = time.perf_counter()
        with torch.no_grad():
            logits = model.decode_step(nxt, cache, strategy=strategy, stats=stats if timed else None)
        _sync(device)
        dt = time.perf_counter() - t0
        if timed:
            times.append(dt)
        if s in record_steps:
            kept[s] = logits.float().cpu()
        if forced is not None:
            step_logits.append(logits.float().cpu())
            nxt = forced[:, s + 1].to(device) if s + 1 < forced.shape[1] else None
        else:
            nxt = logits.argmax(-1)
        if nxt is not None:
            tokens.append(nxt.cpu())
        if bar is not None:
            bar.update(1)
    # A step takes as long as its slowest rank.
    t = torch.tensor(times, dtype=torch.float64)
    if t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups.cp_group)
    return {"tokens": torch.stack(tokens, dim=1), "prefill_logits": prefill_logits, "prefill_time": prefill_time,
            "step_times": t.tolist(), "stats": stats, "kept": kept, "step_logits": step_logits}


def run_one(model, ref, cfg: RunConfig, groups, device, vocab, ctx, batch, strategy, *, rank, bar=None):
    """One (context length, batch size, strategy) run; the returned dict is results.json's ``runs[i]``."""
    import torch
    import torch.distributed as dist

    ev = cfg.eval
    ex = ev.exactness
    n_steps = ev.warmup_steps + ev.decode_steps
    check = ex.enabled and (ex.max_context is None or ctx <= ex.max_context)
    rng = random.Random(f"exact-{cfg.model.seed}-{ctx}-{batch}-{strategy}")
    sampled = sorted({s for s in range(n_steps) if rng.random() < ex.sample_rate} | {n_steps - 1}) if check else []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompts = random_prompts(cfg, ctx, batch, vocab)
    out = greedy_decode(model, prompts, ctx + n_steps + 1, cfg, groups, device, strategy, bar=bar,
                        record_steps=set(sampled))
    times_ms = [1e3 * t for t in out["step_times"]]
    stats = out["stats"]
    per_step = max(1, ev.decode_steps)
    comm = {
        "collectives": stats.collectives / per_step,
        "sent_bytes": stats.sent_bytes / per_step,
        "levels": {
            name: {"collectives": s.collectives / per_step, "payload_bytes": s.payload_bytes / per_step,
                   "sent_bytes": s.sent_bytes / per_step, "ops": {k: v / per_step for k, v in s.ops.items()}}
            for name, s in stats.levels.items()
        },
    }
    # Every CP rank must have decoded the same tokens (greedy on identical logits).
    toks = out["tokens"]
    gathered = [None] * dist.get_world_size()
    mem, mem_kind = peak_memory(device)
    dist.all_gather_object(gathered, (groups.cp_ranks, toks.tolist(), mem))
    agree = all(g[1] == toks.tolist() for g in gathered if g[0] == groups.cp_ranks)
    exact = None
    if check and rank == 0:
        exact = compare_with_reference(ref, prompts, toks, out, sampled, device, ex.tolerance)
    resolved = strategy
    if strategy == "auto":  # what the cost model picks for this step's merge state (fp32 partials)
        from .comm import choose_strategy

        lc = model.config
        resolved = "none (CP 1)" if groups.size == 1 else choose_strategy(
            groups, (batch, 1, lc.num_attention_heads, lc.head_dim), 4)
    return {
        "context_length": ctx, "batch_size": batch, "strategy": strategy, "resolved_strategy": resolved,
        "prefill_s": out["prefill_time"],
        "decode_latency_ms": {
            "p50": percentile(times_ms, 50), "p90": percentile(times_ms, 90), "p99": percentile(times_ms, 99),
            "mean": sum(times_ms) / len(times_ms), "min": min(times_ms), "max": max(times_ms),
        },
        "step_latency_ms": times_ms,
        "tokens_per_s": batch * len(times_ms) / (sum(times_ms) / 1e3),
        "comm_per_step": comm,
        "peak_memory_bytes": [g[2] for g in gathered],
        "peak_memory_kind": mem_kind,
        "tokens_agree_across_ranks": agree,
        "exactness": exact,
    }


def warm_up(model, cfg: RunConfig, groups, device, vocab) -> None:
    """One untimed short prefill + decode step per strategy before the sweep.

    The first collective on each process group sets up its connections (seconds on gloo),
    and the first kernels allocate; without this the first run of the sweep pays for it.
    """
    import dataclasses

    sub = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, warmup_steps=0, decode_steps=1))
    ctx = min(cfg.eval.context_lengths)
    for strategy in cfg.eval.strategies:
        greedy_decode(model, random_prompts(cfg, ctx, 1, vocab), ctx + 2, sub, groups, device, strategy)


def compare_with_reference(ref, prompts, tokens, out, sampled, device, tolerance) -> dict:
    """max |delta logits| of the prefill and the sampled decode steps against one unsharded forward.

    Decode step s fed ``tokens[:, s]`` at position ctx + s; the reference reads its logits
    at that position of a forward over prompt + tokens[:, :last sampled + 1].
    """
    import torch

    ctx = len(prompts[0])
    last = max(sampled)
    ids = torch.cat([torch.tensor(prompts, dtype=torch.long), tokens[:, : last + 1]], dim=1).to(device)
    with torch.no_grad():
        full = ref(ids).float().cpu()
    prefill_d = (full[:, ctx - 1] - out["prefill_logits"]).abs().max().item()
    per_step = {s: (full[:, ctx + s] - out["kept"][s]).abs().max().item() for s in sampled}
    worst = max([prefill_d, *per_step.values()])
    return {
        "checked_steps": sampled, "prefill_max_abs_dlogits": prefill_d,
        "step_max_abs_dlogits": [per_step[s] for s in sampled],
        "max_abs_dlogits": worst, "tolerance": tolerance, "within_tolerance": bool(worst <= tolerance),
    }


# --------------------------------------------------------------------------- tokenized tasks


def load_tokenizer(cfg: RunConfig):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_path(cfg))


def _bos(cfg: RunConfig) -> list[int]:
    if cfg.model.source == "hf":
        bos = _hf_config(cfg.model.path).get("bos_token_id")
        if isinstance(bos, int):
            return [bos]
    return []


def passkey_eval(model, cfg: RunConfig, groups, device, tok) -> list[dict]:
    """Accuracy of retrieving a 5-digit pass key hidden at evenly spread depths, per context length."""

    pk = cfg.eval.passkey
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    filler = enc("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
    question = enc(" What is the pass key? The pass key is")
    out = []
    for ctx in pk.context_lengths or cfg.eval.context_lengths:
        rng = random.Random(f"passkey-{cfg.model.seed}-{ctx}")
        keys = [rng.randrange(10000, 100000) for _ in range(pk.trials)]
        prompts = []
        for i, key in enumerate(keys):
            needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
            room = ctx - len(_bos(cfg)) - len(needle) - len(question)
            if room < 0:
                raise ConfigError(f"eval.passkey.context_lengths: {ctx} tokens cannot hold the passkey prompt")
            hay = (filler * (room // max(1, len(filler)) + 1))[:room]
            depth = int(room * (i + 0.5) / pk.trials)
            prompts.append(_bos(cfg) + hay[:depth] + needle + hay[depth:] + question)
        res = _greedy_n(model, prompts, pk.new_tokens, cfg, groups, device)
        answers = [tok.decode(row) for row in res.tolist()]
        hits = [str(k) in a for k, a in zip(keys, answers)]
        out.append({"context_length": ctx, "accuracy": sum(hits) / len(hits), "trials": len(hits),
                    "answers": answers, "keys": keys})
    return out


def _greedy_n(model, prompts, n, cfg, groups, device):
    """``n`` greedy tokens per prompt, (batch, n), with the config's first strategy."""
    import dataclasses

    sub = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, warmup_steps=0, decode_steps=n))
    r = greedy_decode(model, prompts, len(prompts[0]) + n + 2, sub, groups, device, cfg.eval.strategies[0])
    return r["tokens"][:, :n]


def perplexity_eval(model, cfg: RunConfig, groups, device, tok) -> dict:
    """Perplexity of ``eval_tokens`` tokens after a CP-prefilled prefix, scored by decode steps."""
    import torch

    pc = cfg.eval.perplexity
    with open(pc.text_file, encoding="utf-8") as f:
        ids = _bos(cfg) + tok.encode(f.read(), add_special_tokens=False).ids
    need = pc.prefix_tokens + pc.eval_tokens
    if len(ids) < need:
        raise ConfigError(
            f"eval.perplexity.text_file: {pc.text_file!r} has {len(ids)} tokens; prefix_tokens + eval_tokens "
            f"needs {need}"
        )
    prefix = [ids[: pc.prefix_tokens]]
    targets = torch.tensor([ids[pc.prefix_tokens : need]], dtype=torch.long)
    # The prefill's logits predict target 0; feeding target t as decode step t predicts t + 1.
    r = greedy_decode(model, prefix, need + 1, cfg, groups, device, cfg.eval.strategies[0], forced=targets[:, :-1])
    logits = [r["prefill_logits"], *r["step_logits"]]
    lp = torch.stack([torch.log_softmax(l[0], -1) for l in logits])  # (eval_tokens, vocab)
    nll = -lp.gather(1, targets[0, : len(logits)].unsqueeze(1)).squeeze(1)
    return {"text_file": pc.text_file, "prefix_tokens": pc.prefix_tokens, "eval_tokens": len(logits),
            "nll": nll.mean().item(), "perplexity": math.exp(nll.mean().item())}


# --------------------------------------------------------------------------- outputs


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
    dl = f"{ex['max_abs_dlogits']:.2e}" if ex else "n/a"
    name = r["strategy"] if r["strategy"] == r["resolved_strategy"] else f"{r['strategy']}->{r['resolved_strategy']}"
    return (f"ctx={r['context_length']:<7d} batch={r['batch_size']:<3d} {name:<10s} "
            f"prefill {r['prefill_s']:.3f}s  decode p50 {lat['p50']:.2f} p90 {lat['p90']:.2f} "
            f"p99 {lat['p99']:.2f} ms  {r['tokens_per_s']:.1f} tok/s  coll/step {levels or '-'}  "
            f"max|dlogits| {dl}")


# --------------------------------------------------------------------------- main


def run_eval(cfg: RunConfig, env=None) -> dict | None:
    """Run the whole sweep on this rank; returns the results dict on global rank 0, else None."""
    env = os.environ if env is None else env
    t_start = time.perf_counter()
    world = int(env.get("WORLD_SIZE", 1))
    cp_size = check_launch(cfg, world)
    check_inputs(cfg)

    import torch
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from .topology import TreeGroups
    from .tracking import make_tracker

    backend, device = init_distributed(cfg, env)
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if cp_size != check_launch(cfg, world):  # WORLD_SIZE lied; re-check against the real group
            raise ConfigError(f"WORLD_SIZE={env.get('WORLD_SIZE')} disagrees with the process group's {world}")
        if device.type == "cpu" and torch.get_num_threads() > 1 and world > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        ranks = [list(range(i, i + cp_size)) for i in range(0, world, cp_size)]
        groups = TreeGroups.from_env(ranks, intra_size=cfg.topology.intra_size, timeout=cfg.topology.timeout_s,
                                     env=env)
        out_dir = Path(cfg.output_dir)
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
        topo = groups.describe()
        launch = {
            "launcher": launcher_name(env), "world_size": world, "backend": backend, "device": device.type,
            "cp_size": cp_size, "num_cp_groups": world // cp_size,
            "level_sizes": {l["name"]: l["size"] for l in topo["levels"]}, "topology": topo,
        }
        resolved = {**to_dict(cfg), "launch": launch}
        phases = {"setup_s": time.perf_counter() - t_start}
        t0 = time.perf_counter()
        tracker, err = None, [None]
        try:
            tracker = make_tracker(cfg.wandb, rank=rank, output_dir=str(out_dir), config=resolved,
                                   default_name=f"{cfg.name}-{cp_size}cp")
        except Exception as e:  # noqa: BLE001 -- e.g. wandb online without an API key
            err = [f"wandb could not start on rank 0: {type(e).__name__}: {e}"]
        dist.broadcast_object_list(err, src=0)  # so every rank fails, not rank 0 alone
        if err[0]:
            raise ConfigError(err[0] + " (set wandb.mode=offline or wandb.enabled=false)")
        phases["wandb_init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model, lcfg = build_model(cfg, groups, device)
        ref = build_reference(model, lcfg, cfg, device) if cfg.eval.exactness.enabled and rank == 0 else None
        ev = cfg.eval
        combos = [(c, b, s) for c in ev.context_lengths for b in ev.batch_sizes for s in ev.strategies]
        show = rank == 0 and ev.progress
        every = 0.1 if sys.stderr.isatty() else 5.0  # keep non-terminal logs (Slurm, CI) short
        sweep = tqdm(combos, desc="sweep", disable=not show, file=sys.stderr, position=0, mininterval=every)
        phases["model_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm_up(model, cfg, groups, device, lcfg.vocab_size)
        phases["warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        runs, step = [], 0
        for ctx, batch, strategy in sweep:
            sweep.set_postfix_str(f"ctx={ctx} batch={batch} {strategy}")
            with tqdm(total=ev.warmup_steps + ev.decode_steps, desc="decode", leave=False, disable=not show,
                      file=sys.stderr, position=1, mininterval=every) as bar:
                r = run_one(model, ref, cfg, groups, device, lcfg.vocab_size, ctx, batch, strategy, rank=rank, bar=bar)
            runs.append(r)
            for ms in r["step_latency_ms"]:
                tracker.log({f"decode_latency_ms/{strategy}": ms, "context_length": ctx, "batch_size": batch}, step=step)
                step += 1
        sweep.close()
        phases["sweep_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = load_tokenizer(cfg) if (ev.passkey.enabled or ev.perplexity.text_file) else None
        passkey = passkey_eval(model, cfg, groups, device, tok) if ev.passkey.enabled else None
        ppl = perplexity_eval(model, cfg, groups, device, tok) if ev.perplexity.text_file else None

        checked = [r["exactness"]["max_abs_dlogits"] for r in runs if r["exactness"]]
        agree = all(r["tokens_agree_across_ranks"] for r in runs)
        results = None
        ok = True
        if rank == 0:
            results = {
                "schema_version": RESULTS_SCHEMA_VERSION, "name": cfg.name, "launch": launch,
                "config": to_dict(cfg), "runs": runs,
                "max_abs_dlogits": max(checked) if checked else None,
                "exact": (all(r["exactness"]["within_tolerance"] for r in runs if r["exactness"]) if checked else None),
                "tokens_agree_across_ranks": agree,
                "passkey": passkey, "perplexity": ppl,
            }
            ok = agree and results["exact"] is not False
            levels = " x ".join(f"{k} {v}" for k, v in launch["level_sizes"].items())
            plot = save_plot(runs, out_dir / "decode_latency.png",
                             f"{cfg.name}: decode latency, CP {cp_size} ({levels}), {backend}/{device.type}")
            for ctx in ev.context_lengths:
                rows = [[r["strategy"], r["batch_size"], r["prefill_s"], r["decode_latency_ms"]["p50"],
                         r["decode_latency_ms"]["p90"], r["decode_latency_ms"]["p99"], r["tokens_per_s"],
                         r["comm_per_step"]["collectives"], r["comm_per_step"]["sent_bytes"],
                         max(r["peak_memory_bytes"]), r["exactness"]["max_abs_dlogits"] if r["exactness"] else None]
                        for r in runs if r["context_length"] == ctx]
                tracker.table(f"runs/ctx_{ctx}", ["strategy", "batch_size", "prefill_s", "p50_ms", "p90_ms", "p99_ms",
                                                  "tokens_per_s", "collectives_per_step", "sent_bytes_per_step",
                                                  "peak_memory_bytes_max", "max_abs_dlogits"], rows)
            tracker.image("decode_latency_vs_context", plot)
            summ = {"max_abs_dlogits": results["max_abs_dlogits"], "exact": results["exact"],
                    "world_size": world, "cp_size": cp_size, **{f"level_size/{k}": v for k, v in launch["level_sizes"].items()}}
            for r in runs:
                key = f"{r['strategy']}/ctx{r['context_length']}/b{r['batch_size']}"
                summ.update({f"{key}/p50_ms": r["decode_latency_ms"]["p50"], f"{key}/tokens_per_s": r["tokens_per_s"]})
            for p in passkey or []:
                summ[f"passkey/ctx{p['context_length']}/accuracy"] = p["accuracy"]
            if ppl:
                summ["perplexity"] = ppl["perplexity"]
            tracker.summary(summ)
            results["plot"] = plot
            results["wandb"] = {"enabled": tracker.run_dir is not None, "mode": cfg.wandb.mode,
                                "run_dir": tracker.run_dir}
            phases["tasks_and_outputs_s"] = time.perf_counter() - t0
            results["phases_s"] = phases
            results["elapsed_s"] = time.perf_counter() - t_start
            path = out_dir / "results.json"
            path.write_text(json.dumps(results, indent=2))
            tracker.finish(exit_code=0 if ok else 1)
            for r in runs:
                print(summary_line(r), flush=True)
            if passkey:
                print("passkey accuracy: " + ", ".join(f"ctx={p['context_length']}: {p['accuracy']:.2f}" for p in passkey))
            if ppl:
                print(f"perplexity: {ppl['perplexity']:.3f} over {ppl['eval_tokens']} tokens of {ppl['text_file']}")
            print(f"results: {path.resolve()}")
            print(f"plot:    {Path(plot).resolve()}")
            print(f"wandb:   {tracker.run_dir or 'disabled'}"
                  + (f"  (sync with: wandb sync {tracker.run_dir})" if tracker.run_dir and cfg.wandb.mode == "offline" else ""))
            if not ok:
                print(f"FAILED: max|dlogits| {results['max_abs_dlogits']} exceeds eval.exactness.tolerance "
                      f"{ev.exactness.tolerance} or ranks decoded different tokens", file=sys.stderr)
        if rank != 0 and ev.log_all_ranks:
            for r in runs:
                print(f"[rank {rank}] {summary_line(r)}", flush=True)
        # Every rank learns the verdict, so a failed exactness check fails the whole job.
        verdict = [ok]
        dist.broadcast_object_list(verdict, src=0)
        if not verdict[0] and ev.exactness.fail_on_mismatch:
            raise ExactnessError("exactness check failed (see rank 0's output)")
        return results
    finally:
        dist.destroy_process_group()


class ExactnessError(RuntimeError):
    """Sharded decode disagreed with the unsharded model beyond the configured tolerance."""


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="megatron-tree-eval",
        description="Context-parallel tree-decode eval; every knob is in the YAML config.",
    )
    p.add_argument("--config", default=None, help="YAML config (default: the built-in tiny CPU eval)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. eval.decode_steps=4")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    args, unknown = p.parse_known_args(argv)
    extra = [u for u in unknown if not u.startswith(("--local_rank", "--local-rank"))]
    if extra:
        p.error(f"unrecognised arguments: {' '.join(extra)}")
    return args


def _is_user_error(e: BaseException) -> bool:
    """Config, topology and checkpoint errors: reported as one line, not a traceback."""
    from .topology import TopologyError

    kinds = [ConfigError, TopologyError]
    try:
        from .models.llama import CheckpointError

        kinds.append(CheckpointError)
    except ImportError:
        pass
    return isinstance(e, tuple(kinds))


def main(argv=None) -> int:
    """Console entry point ``megatron-tree-eval``; exits non-zero on any failure."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    mapped = map_slurm_env(env)
    os.environ.update(mapped)
    env.update(mapped)
    rank = env.get("RANK", "0")
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        run_eval(cfg, env)
    except ValueError as e:
        if not _is_user_error(e):
            raise
        print(f"megatron-tree-eval: rank {rank}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except ExactnessError as e:
        print(f"megatron-tree-eval: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
