"""The sweep: for each (context length, batch size, merge strategy) a CP prefill and timed decode steps.

Invariant: every decode runs through :func:`megatron_tree.decode.generate`, the package's
one generation loop; this module only hooks into it (:class:`StepTimer`: a barrier on the
CP group before each forward, a device sync after it, the step's logits kept when asked)
and turns what it saw into one ``runs[i]`` entry of results.json. Every CP rank keeps its
own greedy choice (``broadcast=False``), so ranks that disagree are seen, not hidden.
With ``eval.engine: dynamic`` (Megatron models) the loop is Megatron-Core's own
``DynamicInferenceEngine`` instead (``integrations.megatron_dynamic.generate_dynamic``),
hooked the same way (:class:`DynamicStepTimer`); its engine hands back log-probabilities,
not logits, so that is what its exactness compares.

Per run: decode-step latency (max over the CP ranks of each step), tokens/s, prefill time,
collectives and bytes per level per step (``comm.CommStats``), peak memory per rank, the
generated token ids, and exactness on rank 0: max |delta logits| of the prefill and of
sampled decode steps against the model's reference over the full sequence, and whether the
reference's greedy choices are the tokens the run generated.
"""

from __future__ import annotations

import math
import random
import time

from .config import ConfigError, EvalConfig
from ..decode.generate import GenerationHook, generate

__all__ = ["percentile", "peak_memory", "random_prompts", "StepTimer", "decode", "run_one", "warm_up",
           "compare_with_reference", "resolved_strategy", "DynamicStepTimer", "decode_dynamic",
           "compare_dynamic_with_reference", "passkey_eval", "perplexity_eval"]


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


def random_prompts(seed: int, ctx: int, batch: int, vocab: int) -> list[list[int]]:
    """Identical on every rank: seeded by (model seed, context length, batch size)."""
    rng = random.Random(f"{seed}-{ctx}-{batch}")
    return [[rng.randrange(vocab) for _ in range(ctx)] for _ in range(batch)]


class StepTimer(GenerationHook):
    """Times the prefill and each decode step between a CP barrier and a device sync.

    Steps ``>= timed_from`` are timed and record traffic into ``stats``; the warmup steps before them
    record into a scratch ``CommStats`` that is dropped (the same kind of step as the timed ones: a
    compiled step is traced with or without stats, so the warmup pays the timed steps' trace); the logits
    of the prefill, of the steps in ``keep`` (or of every step with ``keep_all``) are kept on the CPU.
    """

    def __init__(self, groups, device, *, timed_from: int, stats, keep=(), keep_all: bool = False, bar=None):
        from ..distributed.collectives import CommStats

        self.groups, self.device, self.timed_from, self.stats = groups, device, timed_from, stats
        self.scratch = CommStats() if stats is not None else None
        self.keep, self.keep_all, self.bar = set(keep), keep_all, bar
        self.prefill_time = 0.0
        self.prefill_logits = None
        self.times: list[float] = []
        self.kept: dict = {}
        self.step_logits: list = []
        self._t0 = 0.0

    def _barrier(self) -> None:
        from ..distributed import collectives

        collectives.barrier(self.groups.cp_group, what="eval: the CP barrier before a timed step")
        self._t0 = time.perf_counter()

    def before_prefill(self) -> None:
        self._barrier()

    def after_prefill(self, logits) -> None:
        _sync(self.device)
        self.prefill_time = time.perf_counter() - self._t0
        self.prefill_logits = logits.float().cpu()

    def before_step(self, step: int):
        self._barrier()
        return self.stats if step >= self.timed_from else self.scratch

    def after_step(self, step: int, logits) -> None:
        _sync(self.device)
        if step >= self.timed_from:
            self.times.append(time.perf_counter() - self._t0)
        if self.keep_all:
            self.step_logits.append(logits.float().cpu())
        elif step in self.keep:
            self.kept[step] = logits.float().cpu()
        if self.bar is not None:
            self.bar.update(1)


def decode(em, prompts, n_steps: int, ev: EvalConfig, device, strategy: str, *, timed_from: int = 0, keep=(),
           forced=None, bar=None) -> dict:
    """CP prefill of ``prompts``, then ``n_steps`` greedy (or teacher-forced) decode steps, timed.

    forced: (batch, n_steps + 1) token ids fed instead of the argmax (perplexity). Returns
    tokens (batch, 1 + n_steps) int64, prefill_logits (batch, vocab), prefill_time,
    step_times (max over the CP ranks), stats, kept {step: logits}, step_logits [logits].
    """
    import torch
    import torch.distributed as dist

    from ..comm.merge import CommStats

    stats = CommStats()
    timer = StepTimer(em.groups, device, timed_from=timed_from, stats=stats, keep=keep, keep_all=forced is not None,
                      bar=bar)
    longest = max(len(p) for p in prompts)
    cache = em.lm.new_cache(len(prompts), longest + n_steps + 1, layout=ev.cache_layout, block_size=ev.block_size)
    res = generate(em.lm, prompts, n_steps + 1, cache=cache, strategy=strategy, progress=False,
                   prefill_method=ev.prefill_method, hook=timer, forced_tokens=forced, broadcast=False)
    # A step takes as long as its slowest rank.
    t = torch.tensor(timer.times, dtype=torch.float64)
    if t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=em.groups.cp_group)
    return {"tokens": torch.tensor(res.tokens, dtype=torch.long), "prefill_logits": timer.prefill_logits,
            "prefill_time": timer.prefill_time, "step_times": t.tolist(), "stats": stats, "kept": timer.kept,
            "step_logits": timer.step_logits}


class _ReferenceCache:
    """The last reference forward: consecutive strategies of a sweep decode the same tokens."""

    def __init__(self):
        self.key = None
        self.logits = None


def _reference_logits(em, ids, ctx: int, device, cache: _ReferenceCache | None):
    """The reference's logits (batch, len - ctx + 1, vocab) fp32 on the CPU from position ctx - 1 on.

    ids: (batch, len) int64 -- prompt + fed tokens; one forward, reused from ``cache`` when the
    previous call had the same ids.
    """
    import torch

    key = (ids.shape, hash(tuple(ids.flatten().tolist())))
    if cache is not None and cache.key == key:
        return cache.logits
    with torch.no_grad():
        full = em.reference(ids.to(device))[:, ctx - 1 :].float().cpu()
    if cache is not None:
        cache.key, cache.logits = key, full
    return full


def compare_with_reference(em, prompts, tokens, out, sampled, tolerance, device,
                           cache: _ReferenceCache | None = None) -> dict:
    """max |delta logits| of the prefill and the sampled decode steps against one reference forward.

    Decode step s fed ``tokens[:, s]`` at position ctx + s; the reference reads its logits at
    that position of a forward over prompt + tokens[:, :last sampled + 1]. Its argmax at
    every position is the token it would have chosen: ``reference_tokens``.
    """
    import torch

    ctx = len(prompts[0])
    last = max(sampled)
    ids = torch.cat([torch.tensor(prompts, dtype=torch.long), tokens[:, : last + 1]], dim=1)
    full = _reference_logits(em, ids, ctx, device, cache)
    prefill_d = (full[:, 0] - out["prefill_logits"]).abs().max().item()
    per_step = {s: (full[:, 1 + s] - out["kept"][s]).abs().max().item() for s in sampled}
    worst = max([prefill_d, *per_step.values()])
    ref_tokens = full.argmax(-1)  # (batch, last + 2): the reference's choice after each prefix
    match = bool(torch.equal(ref_tokens, tokens[:, : last + 2]))
    return {
        "reference": em.reference_name, "quantity": "logits", "checked_steps": sampled, "prefill_max_abs_dlogits": prefill_d,
        "step_max_abs_dlogits": [per_step[s] for s in sampled], "max_abs_dlogits": worst, "tolerance": tolerance,
        "logits_within_tolerance": bool(worst <= tolerance), "reference_tokens": ref_tokens.tolist(),
        "tokens_match_reference": match, "within_tolerance": bool(worst <= tolerance) and match,
    }


def resolved_strategy(strategy: str, engine: str, groups, merge_shape: tuple) -> str:
    """The merge a run's decode steps actually run, as the report labels it (``auto->allgather``).

    ``auto``: what the cost model picks for this step's merge state (fp32 partials of
    ``merge_shape``; ``none (CP 1)`` at CP 1). ``shifted`` on Megatron's dynamic engine: ``packed``
    (the engine has no place to redo a step, so its attention passes no shift: docs/strategies.md,
    ``integrations.megatron.dynamic``), two all-reduces per layer where ``shifted`` would take one.
    Any other: itself.
    """
    if strategy == "auto":
        from ..comm.merge import choose_strategy

        return "none (CP 1)" if groups.size == 1 else choose_strategy(groups, merge_shape, 4)
    if strategy == "shifted" and engine == "dynamic":
        return "packed"
    return strategy


def run_one(em, ev: EvalConfig, seed: int, device, ctx: int, batch: int, strategy: str, *, rank: int, bar=None,
            ref_cache: _ReferenceCache | None = None) -> dict:
    """One (context length, batch size, strategy) run; the returned dict is results.json's ``runs[i]``."""
    import torch
    import torch.distributed as dist

    ex = ev.exactness
    n_steps = ev.warmup_steps + ev.decode_steps
    check = ex.enabled and (ex.max_context is None or ctx <= ex.max_context)
    rng = random.Random(f"exact-{seed}-{ctx}-{batch}-{strategy}")
    sampled = sorted({s for s in range(n_steps) if rng.random() < ex.sample_rate} | {n_steps - 1}) if check else []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prompts = random_prompts(seed, ctx, batch, em.vocab_size)
    dynamic = ev.engine == "dynamic"
    if dynamic:
        out = decode_dynamic(em, prompts, n_steps, ev, device, strategy, timed_from=ev.warmup_steps, bar=bar)
    else:
        out = decode(em, prompts, n_steps, ev, device, strategy, timed_from=ev.warmup_steps, keep=sampled, bar=bar)
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
    dist.all_gather_object(gathered, (em.groups.cp_ranks, toks.tolist(), mem))
    agree = all(g[1] == toks.tolist() for g in gathered if g[0] == em.groups.cp_ranks)
    exact = None
    if check and rank == 0 and dynamic:
        exact = compare_dynamic_with_reference(em, prompts, toks, out["log_probs"], ex.tolerance, device, ref_cache)
    elif check and rank == 0:
        exact = compare_with_reference(em, prompts, toks, out, sampled, ex.tolerance, device, ref_cache)
    resolved = resolved_strategy(strategy, ev.engine, em.groups, (batch, 1, em.heads, em.head_dim))
    return {
        "context_length": ctx, "batch_size": batch, "strategy": strategy, "resolved_strategy": resolved,
        "engine": ev.engine, "prefill_s": out["prefill_time"],
        "decode_latency_ms": {
            "p50": percentile(times_ms, 50), "p90": percentile(times_ms, 90), "p99": percentile(times_ms, 99),
            "mean": sum(times_ms) / len(times_ms), "min": min(times_ms), "max": max(times_ms),
        },
        "step_latency_ms": times_ms,
        "tokens_per_s": batch * len(times_ms) / (sum(times_ms) / 1e3),
        "comm_per_step": comm,
        "peak_memory_bytes": [g[2] for g in gathered],
        "peak_memory_kind": mem_kind,
        "tokens": toks.tolist(),
        "tokens_agree_across_ranks": agree,
        "kv_blocks_per_rank": out.get("kv_blocks_per_rank"),
        "exactness": exact,
    }


def warm_up(em, ev: EvalConfig, seed: int, device) -> None:
    """One untimed short prefill + decode step per strategy before the sweep.

    The first collective on each process group sets up its connections (seconds on gloo),
    and the first kernels allocate; without this the first run of the sweep pays for it.
    """
    ctx = min(ev.context_lengths)
    for strategy in ev.strategies:
        prompts = random_prompts(seed, ctx, 1, em.vocab_size)
        if ev.engine == "dynamic":
            decode_dynamic(em, prompts, 1, ev, device, strategy)
        else:
            decode(em, prompts, 1, ev, device, strategy)


# --------------------------------------------------------------------------- Megatron's dynamic engine


class DynamicStepTimer:
    """``generate_dynamic``'s hook: each engine step timed between a CP barrier and a device sync;
    the core attentions record traffic into ``stats`` on steps ``>= timed_from`` only."""

    def __init__(self, groups, device, cores, *, timed_from: int, stats, bar=None):
        self.groups, self.device, self.cores, self.timed_from, self.stats = groups, device, cores, timed_from, stats
        self.bar = bar
        self.times: list[float] = []
        self._t0 = 0.0

    def before_step(self, step: int) -> None:
        from ..distributed import collectives

        for core in self.cores:
            core.comm_stats = self.stats if step >= self.timed_from else None
        collectives.barrier(self.groups.cp_group, what="eval: the CP barrier before an engine step")
        self._t0 = time.perf_counter()

    def after_step(self, step: int) -> None:
        _sync(self.device)
        self.times.append(time.perf_counter() - self._t0)
        for core in self.cores:
            core.comm_stats = None
        if self.bar is not None and step > 0:
            self.bar.update(1)


def _round_up_tokens(n: int) -> int:
    """Megatron pads a step's tokens to a multiple of its TOKEN_ROUNDER; the step budget must hold the padding."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    r = DynamicInferenceContext.TOKEN_ROUNDER
    return -(-n // r) * r


def decode_dynamic(em, prompts, n_steps: int, ev: EvalConfig, device, strategy: str, *, timed_from: int = 0,
                   bar=None) -> dict:
    """Every prompt as one request of Megatron's ``DynamicInferenceEngine`` over the paged CP-sharded cache.

    All requests arrive at step 0 and the step's token budget holds every prompt, so engine
    step 0 is the prefill (and the first token) and steps 1 .. n_steps are decode steps, one
    token per row each -- the static path's shape, timed the same way. ``timed_from``
    counts decode steps. Returns tokens (batch, 1 + n_steps) int64, log_probs (batch,
    1 + n_steps) of those tokens, prefill_time, step_times (decode steps >= timed_from, max
    over the CP ranks), stats, kv_blocks_per_rank (most blocks in use on each CP rank), and
    the engine's step count.
    """
    import torch
    import torch.distributed as dist
    from megatron.core.utils import unwrap_model

    from ..comm.merge import CommStats
    from ..integrations.megatron.dynamic import build_dynamic_engine, generate_dynamic
    from ..integrations.megatron.model import IdTokenizer
    from ..integrations.megatron.version import inference_mode_off

    lm = em.lm
    model = lm.model
    cores = [layer.self_attention.core_attention for layer in unwrap_model(model).decoder.layers]
    for core in cores:
        core.strategy = strategy
    shape, cp = lm.shape, em.groups.size
    batch, longest, new = len(prompts), max(len(p) for p in prompts), n_steps + 1
    max_len = longest + new
    block = ev.block_size
    per_request = -(-max_len // (cp * block))  # logical blocks (one block on every rank) of a whole request
    blocks = batch * per_request + 2  # + Megatron's dummy block + one spare: nothing is ever evicted
    itemsize = torch.empty((), dtype=next(model.parameters()).dtype).element_size()
    token_bytes = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.kv_channels * itemsize
    stats = CommStats()
    timer = DynamicStepTimer(em.groups, device, cores, timed_from=1 + timed_from, stats=stats, bar=bar)
    # megatron-core 0.19's engines set a process-wide InferenceMode flag and never clear it; the
    # eval's reference forward after this run must not see it (a no-op on 0.16.1).
    with inference_mode_off():
        engine = build_dynamic_engine(
            model, IdTokenizer(eod=em.vocab_size - 1), max_sequence_length=max_len,  # eod never stops: termination_id -1
            buffer_size_gb=(blocks + 0.5) * block * token_bytes / 2**30, block_size_tokens=block,
            max_tokens=_round_up_tokens(sum(len(p) for p in prompts)), max_requests=batch)
        try:
            run = generate_dynamic(engine, prompts, num_tokens_to_generate=new, hook=timer)
        finally:
            for core in cores:
                core.comm_stats = None
    lengths = sorted({len(t) for t in run.tokens.values()})
    if run.errors or run.evicted or run.steps != new or sorted(run.tokens) != list(range(batch)) or lengths != [new]:
        raise RuntimeError(
            f"the dynamic engine did not run the {batch} request(s) as one prefill step and {n_steps} decode steps: "
            f"{run.steps} steps, {run.evicted} evictions, tokens per request {lengths}, errors {run.errors}"
        )
    t = torch.tensor(timer.times, dtype=torch.float64)
    if cp > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=em.groups.cp_group)
    used = run.blocks_per_rank or [[0] * cp]
    return {
        "tokens": torch.tensor([run.tokens[i] for i in range(batch)], dtype=torch.long),
        "log_probs": torch.tensor([run.log_probs[i] for i in range(batch)], dtype=torch.float64),
        "prefill_time": float(t[0]), "step_times": t[1 + timed_from:].tolist(), "stats": stats,
        "kv_blocks_per_rank": [max(step[r] for step in used) for r in range(cp)], "engine_steps": run.steps,
    }


def compare_dynamic_with_reference(em, prompts, tokens, log_probs, tolerance, device,
                                   cache: _ReferenceCache | None = None) -> dict:
    """The dynamic engine's greedy tokens and their log-probabilities against one reference forward.

    Megatron's engine hands back log-probabilities, not logits: the quantity compared is
    max |delta log p| of every generated token (prefill's and each decode step's), where
    the reference -- Megatron's own GPTModel at CP = 1, TP = 1 -- scores the same tokens
    with one full causal forward over prompt + tokens.
    """
    import torch

    ctx = len(prompts[0])
    ids = torch.cat([torch.tensor(prompts, dtype=torch.long), tokens[:, :-1]], dim=1)
    full = _reference_logits(em, ids, ctx, device, cache)
    ref_lp = torch.log_softmax(full.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)  # (batch, 1 + steps)
    diff = (ref_lp - log_probs).abs()
    ref_tokens = full.argmax(-1)
    match = bool(torch.equal(ref_tokens, tokens))
    worst = diff.max().item()
    steps = list(range(tokens.shape[1] - 1))
    return {
        "reference": em.reference_name, "quantity": "log_probs", "checked_steps": steps,
        "prefill_max_abs_dlogits": None, "step_max_abs_dlogits": None, "max_abs_dlogits": None,
        "prefill_max_abs_dlogprobs": diff[:, 0].max().item(),
        "step_max_abs_dlogprobs": [diff[:, 1 + s].max().item() for s in steps], "max_abs_dlogprobs": worst,
        "tolerance": tolerance, "logits_within_tolerance": None, "logprobs_within_tolerance": bool(worst <= tolerance),
        "reference_tokens": ref_tokens.tolist(), "tokens_match_reference": match,
        "within_tolerance": bool(worst <= tolerance) and match,
    }


# --------------------------------------------------------------------------- tokenized tasks


def greedy_n(em, prompts, n: int, ev: EvalConfig, device):
    """``n`` greedy tokens per prompt, (batch, n), with the config's first strategy."""
    return decode(em, prompts, n - 1, ev, device, ev.strategies[0])["tokens"][:, :n]


def passkey_eval(em, ev: EvalConfig, seed: int, device, tok) -> list[dict]:
    """Accuracy of retrieving a 5-digit pass key hidden at evenly spread depths, per context length."""
    pk = ev.passkey
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    filler = enc("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
    question = enc(" What is the pass key? The pass key is")
    out = []
    for ctx in pk.context_lengths or ev.context_lengths:
        rng = random.Random(f"passkey-{seed}-{ctx}")
        keys = [rng.randrange(10000, 100000) for _ in range(pk.trials)]
        prompts = []
        for i, key in enumerate(keys):
            needle = enc(f" The pass key is {key}. Remember it. {key} is the pass key. ")
            room = ctx - len(em.bos) - len(needle) - len(question)
            if room < 0:
                raise ConfigError(f"eval.passkey.context_lengths: {ctx} tokens cannot hold the passkey prompt")
            hay = (filler * (room // max(1, len(filler)) + 1))[:room]
            depth = int(room * (i + 0.5) / pk.trials)
            prompts.append(em.bos + hay[:depth] + needle + hay[depth:] + question)
        res = greedy_n(em, prompts, pk.new_tokens, ev, device)
        answers = [tok.decode(row) for row in res.tolist()]
        hits = [str(k) in a for k, a in zip(keys, answers)]
        out.append({"context_length": ctx, "accuracy": sum(hits) / len(hits), "trials": len(hits),
                    "answers": answers, "keys": keys})
    return out


def perplexity_eval(em, ev: EvalConfig, device, tok) -> dict:
    """Perplexity of ``eval_tokens`` tokens after a CP-prefilled prefix, scored by decode steps."""
    import torch

    pc = ev.perplexity
    with open(pc.text_file, encoding="utf-8") as f:
        ids = em.bos + tok.encode(f.read(), add_special_tokens=False).ids
    need = pc.prefix_tokens + pc.eval_tokens
    if len(ids) < need:
        raise ConfigError(
            f"eval.perplexity.text_file: {pc.text_file!r} has {len(ids)} tokens; prefix_tokens + eval_tokens "
            f"needs {need}"
        )
    prefix = [ids[: pc.prefix_tokens]]
    targets = torch.tensor([ids[pc.prefix_tokens : need]], dtype=torch.long)
    # The prefill's logits predict target 0; feeding target t as decode step t predicts t + 1.
    r = decode(em, prefix, pc.eval_tokens - 1, ev, device, ev.strategies[0], forced=targets)
    logits = [r["prefill_logits"], *r["step_logits"]]
    lp = torch.stack([torch.log_softmax(l[0], -1) for l in logits])  # (eval_tokens, vocab)
    nll = -lp.gather(1, targets[0, : len(logits)].unsqueeze(1)).squeeze(1)
    return {"text_file": pc.text_file, "prefix_tokens": pc.prefix_tokens, "eval_tokens": len(logits),
            "nll": nll.mean().item(), "perplexity": math.exp(nll.mean().item())}
