"""``generate``: batched autoregressive generation over a sequence-sharded KV cache.

Invariant: every CP rank makes the same token choice at every step. Logits are already
identical on every rank (the tree merge hands every rank the same result), and on top of
that the choice made on CP rank 0 is broadcast to the group each step, so a sampling
decision can never diverge -- a divergence would desynchronise the caches silently.
Sampling uses a ``torch.Generator`` seeded with ``seed``, so a run is reproducible.

Rows of different lengths share one batch: each row has its own length in the cache
(per-row ``cache_seqlens``), so no padding token ever enters attention.

This is the one decode loop of the package: the eval drives it too, through a
:class:`GenerationHook` that times each step and keeps logits (no second loop beside this
one). Any model with ``prefill``, ``decode_step``, ``new_cache``, ``groups``, ``device`` and
``config.vocab_size`` runs in it: transformers models (``integrations.hf.HFTreeModel``) and
Megatron-Core's ``GPTModel`` (``integrations.megatron.model.MegatronLM``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch

from .. import collectives
from .attention import ShiftState
from .cache import CacheOverflowError, ShardedKVCache
from ..comm import CommStats

__all__ = ["generate", "GenerationResult", "GenerationHook", "sample_next"]


@dataclass
class GenerationResult:
    """What :func:`generate` returns (the same on every CP rank)."""

    tokens: list[list[int]]
    """New tokens of each prompt (a stop token, when hit, is the row's last token)."""
    prefill_time: float = 0.0
    """Seconds spent in prefill (including the first token's choice)."""
    step_times: list[float] = field(default_factory=list)
    """Seconds of each decode step (forward, token choice and its broadcast)."""

    @property
    def decode_time(self) -> float:
        return sum(self.step_times)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput over the batch (rows x steps / decode seconds)."""
        t = self.decode_time
        return len(self.tokens) * len(self.step_times) / t if t > 0 else float("nan")


class GenerationHook:
    """Callbacks of :func:`generate`'s loop; override what you need (every method is a no-op here).

    The eval's timing hook puts a barrier before and a device sync after each forward, keeps
    the logits of chosen steps and records traffic of timed steps only.
    """

    def before_prefill(self) -> None:
        """Called right before the prefill forward."""

    def after_prefill(self, logits: torch.Tensor) -> None:
        """logits: (batch, vocab) of each prompt's last token, before the first token is chosen."""

    def before_step(self, step: int):
        """Called before decode step ``step`` (0-based); returns the ``CommStats`` to record into
        (``None``: the ``stats`` given to :func:`generate`)."""
        return None

    def after_step(self, step: int, logits: torch.Tensor) -> None:
        """logits: (batch, vocab) of decode step ``step``, before its token is chosen."""


def sample_next(
    logits: torch.Tensor,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Choose the next token of each row.

    logits: (batch, vocab) -> (batch,) int64 on the CPU. Greedy (argmax) unless
    ``do_sample``; then logits / temperature, keep the ``top_k`` largest, keep the smallest
    set of most likely tokens whose probability reaches ``top_p``, and draw from the rest.
    """
    logits = logits.detach().float().cpu()
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # probability mass ahead of each token
        drop_sorted = before >= top_p  # the most likely token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check_args(prompts, max_new_tokens, do_sample, temperature, top_k, top_p, vocab):
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in p if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if do_sample:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
        if top_p is not None and not 0 < top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1] or be None, got {top_p!r}")


GENERATE_SIGNATURE = ("batch", "prompt_lengths", "prompt_ids", "max_new_tokens", "stop_token_ids", "do_sample",
                      "temperature", "top_k", "top_p", "seed", "strategy", "prefill_method", "broadcast",
                      "forced_tokens")
"""What every CP rank of one :func:`generate` call must pass alike (checked once per call)."""


def _digest(row) -> str:
    """A short digest of one token-id row (equal rows, equal digests), as the error shows it."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in row)
    return hashlib.blake2b(data, digest_size=6).hexdigest()


def _agree_on_call(model, prompts, max_new_tokens, stop_token_ids, do_sample, temperature, top_k, top_p, seed,
                   strategy, prefill_method, broadcast, forced_tokens) -> None:
    """Every CP rank must make this call alike, else all raise the same DisagreementError.

    Ranks handed different prompts (contents or lengths), budgets or sampling would each run a
    consistent-looking but different generation: the collectives' sizes can still match, so
    nothing else would notice. One fixed-size all-gather per call (``collectives.agree_values``).
    """
    groups = model.groups
    if groups is None or groups.size == 1:
        return
    forced = None if forced_tokens is None else tuple(_digest(r) for r in forced_tokens.detach().cpu().tolist())
    values = (len(prompts), tuple(len(p) for p in prompts), tuple(_digest(p) for p in prompts), max_new_tokens,
              tuple(sorted(set(stop_token_ids or ()))), bool(do_sample), float(temperature), top_k,
              None if top_p is None else float(top_p), seed, strategy, prefill_method, bool(broadcast), forced)
    collectives.agree_values("generate", GENERATE_SIGNATURE, values, groups.cp_group, groups.cp_ranks,
                             device=model.device)


def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids=None,
    seed: int | None = None,
    cache=None,
    strategy: str = "auto",
    stats: CommStats | None = None,
    progress: bool = True,
    prefill_method: str | None = None,
    hook: GenerationHook | None = None,
    forced_tokens: torch.Tensor | None = None,
    broadcast: bool = True,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt, on every rank of ``model.groups``.

    model: an :class:`~megatron_tree.integrations.hf.HFTreeModel`, an
        :class:`~megatron_tree.integrations.megatron.model.MegatronLM`, or anything with
        ``prefill``, ``decode_step``, ``new_cache``, ``groups``, ``device`` and ``config.vocab_size``
    prompts: token-id lists of any (non-zero) lengths; every CP rank passes the same (checked:
        every CP rank must pass equal prompts and arguments, else every rank raises the same
        ``DisagreementError`` naming each rank's value; one small all-gather per call)
    stop_token_ids: a row stops after producing one of these ids
    seed: seeds the sampling generator (identical results for identical seeds)
    cache: reuse a cache from ``model.new_cache``; by default one sized
        ``max(len(prompt)) + max_new_tokens`` is made. Every prompt plus ``max_new_tokens``
        must fit in it.
    strategy, stats: passed to ``tree_decode`` at every decode step. ``"shifted"``: one SUM per
        layer per step after the first; each layer's merge leaves a device flag, read once per
        step here (next to the logits' own host read), and a step whose flag is raised is run
        again with ``packed`` (counted in ``stats.fallbacks``)
    progress: show a tqdm bar on CP rank 0
    prefill_method: the model's CP prefill (``None``: the model's default)
    hook: a :class:`GenerationHook` called around the prefill and each decode step
    forced_tokens: (batch, n) token ids fed instead of the chosen ones (teacher forcing, for
        scoring); token ``i`` is fed after the prefill (``i = 0``) or decode step ``i - 1``
    broadcast: CP rank 0's choice is broadcast each step (default). ``False`` keeps every
        rank's own choice, so that a check across ranks can see a divergence (the eval).
    """
    vocab = model.config.vocab_size
    _check_args(prompts, max_new_tokens, do_sample, temperature, top_k, top_p, vocab)
    prompts = [list(p) for p in prompts]
    if forced_tokens is not None and tuple(forced_tokens.shape) != (len(prompts), max_new_tokens):
        raise ValueError(
            f"forced_tokens has shape {tuple(forced_tokens.shape)}, expected (batch, max_new_tokens) = "
            f"({len(prompts)}, {max_new_tokens})"
        )
    _agree_on_call(model, prompts, max_new_tokens, stop_token_ids, do_sample, temperature, top_k, top_p, seed,
                   strategy, prefill_method, broadcast, forced_tokens)
    need = max(len(p) for p in prompts) + max_new_tokens
    if cache is None:
        cache = model.new_cache(len(prompts), need)
    else:
        if cache.batch_size != len(prompts):
            raise ValueError(f"cache has batch size {cache.batch_size} but {len(prompts)} prompts were given")
        for i, p in enumerate(prompts):
            if len(p) + max_new_tokens > cache.max_seq_len:
                raise CacheOverflowError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens} slots, beyond the cache's max_seq_len {cache.max_seq_len}"
                )
    stops = set(stop_token_ids or ())
    hook = hook if hook is not None else GenerationHook()
    groups = model.groups
    rank0 = groups is None or groups.rank == 0
    generator = torch.Generator(device="cpu")
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()

    def choose(logits: torch.Tensor, i: int) -> torch.Tensor:
        if forced_tokens is not None:
            return forced_tokens[:, i].to(model.device)
        ids = sample_next(logits, do_sample=do_sample, temperature=temperature, top_k=top_k,
                          top_p=top_p, generator=generator).to(model.device)
        if broadcast and groups is not None and groups.size > 1:  # CP rank 0 decides for everyone
            # (B,) int64: B already agreed on by the model's checked collectives (prefill, merge)
            collectives.broadcast(ids, groups.cp_ranks[0], groups.cp_group,
                                  what="generate: broadcasting CP rank 0's token choice")
        return ids

    from tqdm.auto import tqdm

    prefill_kw = {} if prefill_method is None else {"method": prefill_method}
    shift = ShiftState() if strategy == "shifted" and groups is not None and groups.size > 1 else None
    bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=not (progress and rank0))
    try:
        hook.before_prefill()
        t0 = time.perf_counter()
        logits = model.prefill(prompts, cache, **prefill_kw)
        hook.after_prefill(logits)
        ids = choose(logits, 0)
        prefill_time = time.perf_counter() - t0
        out = [[t] for t in ids.tolist()]
        done = [t in stops for t in ids.tolist()]
        bar.update(1)
        step_times: list[float] = []
        for step in range(max_new_tokens - 1):
            if all(done):
                break
            step_stats = hook.before_step(step)
            t0 = time.perf_counter()
            st = stats if step_stats is None else step_stats
            if shift is None:
                logits = model.decode_step(ids, cache, strategy=strategy, stats=st)
            else:  # the step's one read of the merges' flags, and its redo when one is raised
                logits, _ = shift.run_step(
                    lambda: model.decode_step(ids, cache, strategy=strategy, stats=st, shift=shift), st)
            hook.after_step(step, logits)
            ids = choose(logits, step + 1)
            step_times.append(time.perf_counter() - t0)
            for b, t in enumerate(ids.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stops
            bar.update(1)
    finally:
        bar.close()
    return GenerationResult(tokens=out, prefill_time=prefill_time, step_times=step_times)
