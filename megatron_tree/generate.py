"""``generate``: batched autoregressive generation over a sequence-sharded KV cache.

Invariant: every CP rank makes the same token choice at every step. Logits are already
identical on every rank (the tree merge hands every rank the same result), and on top of
that the choice made on CP rank 0 is broadcast to the group each step, so a sampling
decision can never diverge -- a divergence would desynchronise the caches silently.
Sampling uses a ``torch.Generator`` seeded with ``seed``, so a run is reproducible.

Rows of different lengths share one batch: each row has its own length in the cache
(per-row ``cache_seqlens``), so no padding token ever enters attention.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from . import collectives
from .cache import CacheOverflowError, ShardedKVCache
from .comm import CommStats

__all__ = ["generate", "GenerationResult", "sample_next"]


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
    cache: ShardedKVCache | None = None,
    strategy: str = "auto",
    stats: CommStats | None = None,
    progress: bool = True,
    prefill_method: str = "ring",
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt, on every rank of ``model.groups``.

    model: a :class:`megatron_tree.models.llama.Llama` (anything with ``prefill``,
        ``decode_step``, ``new_cache``, ``groups`` and ``config.vocab_size``)
    prompts: token-id lists of any (non-zero) lengths; every CP rank passes the same
    stop_token_ids: a row stops after producing one of these ids
    seed: seeds the sampling generator (identical results for identical seeds)
    cache: reuse a cache from ``model.new_cache``; by default one sized
        ``max(len(prompt)) + max_new_tokens`` is made. Every prompt plus ``max_new_tokens``
        must fit in it.
    strategy, stats: passed to ``tree_decode`` at every decode step
    progress: show a tqdm bar on CP rank 0
    """
    vocab = model.config.vocab_size
    _check_args(prompts, max_new_tokens, do_sample, temperature, top_k, top_p, vocab)
    prompts = [list(p) for p in prompts]
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
    groups = model.groups
    rank0 = groups is None or groups.rank == 0
    generator = torch.Generator(device="cpu")
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()

    def choose(logits: torch.Tensor) -> torch.Tensor:
        ids = sample_next(logits, do_sample=do_sample, temperature=temperature, top_k=top_k,
                          top_p=top_p, generator=generator).to(model.device)
        if groups is not None and groups.size > 1:  # CP rank 0 decides for everyone
            # (B,) int64: B already agreed on by the model's checked collectives (prefill, merge)
            collectives.broadcast(ids, groups.cp_ranks[0], groups.cp_group,
                                  what="generate: broadcasting CP rank 0's token choice")
        return ids

    from tqdm.auto import tqdm

    bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=not (progress and rank0))
    try:
        t0 = time.perf_counter()
        ids = choose(model.prefill(prompts, cache, method=prefill_method))
        prefill_time = time.perf_counter() - t0
        out = [[t] for t in ids.tolist()]
        done = [t in stops for t in ids.tolist()]
        bar.update(1)
        step_times: list[float] = []
        for _ in range(max_new_tokens - 1):
            if all(done):
                break
            t0 = time.perf_counter()
            ids = choose(model.decode_step(ids, cache, strategy=strategy, stats=stats))
            step_times.append(time.perf_counter() - t0)
            for b, t in enumerate(ids.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stops
            bar.update(1)
    finally:
        bar.close()
    return GenerationResult(tokens=out, prefill_time=prefill_time, step_times=step_times)
