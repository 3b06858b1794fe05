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
one). Any adapter that provides :class:`DecodeModel` runs in it -- Megatron-Core's
``GPTModel`` (``integrations.megatron.model.MegatronLM``), a transformers model
(``integrations.hf.HFTreeModel``) -- and its cache
:class:`DecodeCache`. The ``shifted`` redo lives here and only here (:class:`StepRunner`):
the loop hands each ``decode_step`` a :class:`DecodeStep` whose :meth:`~DecodeStep.attend`
is the one attention call every integration's layers make, reads the step's merge flags once,
and when one is raised rewinds the cache (``cache.rewind_step()``) and runs the step again
with ``packed``; adapters never see the shift or the flags.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from ..distributed import agreement, collectives
from .attention import tree_decode
from .cache import CacheOverflowError
from ..comm.merge import CommStats
from ..distributed.topology import TreeGroups

__all__ = ["generate", "GenerationResult", "GenerationHook", "sample_next", "DecodeModel", "DecodeCache",
           "DecodeStep", "StepRunner", "row_digest", "tokens_digest"]


# --------------------------------------------------------------------------- the model protocol


@runtime_checkable
class DecodeCache(Protocol):
    """The cache a :class:`DecodeModel` makes: this CP rank's share of a batch's KV cache.

    The adapter may assume the loop passes the cache only to the model that made it, one
    prefill before any decode step, and decode steps in order. The loop assumes every CP rank's
    cache places each token on the same rank (``decode.placement``/``decode.plan``: the
    contiguous ``ShardedKVCache``, Megatron's ``TreeInferenceContext``, transformers' ``TreeCache``).
    """

    @property
    def batch_size(self) -> int:
        """Rows of the cache (-1: not fixed yet, it takes the prompts' rows)."""

    @property
    def max_seq_len(self) -> int | None:
        """Most tokens (prompt and generated) one row may hold (None: the cache grows as rows need)."""

    def rewind_step(self) -> None:
        """Take the last decode step back: the rows' lengths are as before it, and the next decode
        step places the same tokens on the same slots again (the step planner's redo; rewriting
        the same keys there is idempotent). The loop calls it only to run a ``shifted`` step again."""


@runtime_checkable
class DecodeModel(Protocol):
    """What a model adapter provides to :func:`generate` (and to the eval, which drives ``generate``).

    Every CP rank of ``groups`` holds its own replica (the same weights) and makes the same
    calls with the same arguments; ``generate`` checks the call's arguments across ranks once
    (``agreement.agree``), so an adapter may assume they agree. Logits must be identical on every
    CP rank (they are: the tree merge and the prefill's logits assembly hand every rank the
    same result).
    """

    @property
    def groups(self) -> TreeGroups | None:
        """The CP group and its levels (``None``: one process)."""

    @property
    def device(self) -> torch.device:
        """Where token ids and logits live."""

    @property
    def vocab_size(self) -> int:
        """Logits per token; token ids lie in ``[0, vocab_size)`` (``generate`` checks prompts against it)."""

    def new_cache(self, batch_size: int, max_seq_len: int) -> DecodeCache:
        """An empty cache for ``batch_size`` rows of up to ``max_seq_len`` tokens (each rank holds ~1/CP)."""

    def prefill(self, prompts: list[list[int]], cache: DecodeCache, **kwargs) -> torch.Tensor:
        """Run the prompts (token-id lists, lengths may differ, each >= 1) CP-sharded and fill ``cache``
        (reset first); returns (batch, vocab) logits of each prompt's last token. ``generate`` passes
        ``method=`` only when its caller chose a prefill method."""

    def decode_step(self, next_ids: torch.Tensor, cache: DecodeCache, step: "DecodeStep") -> torch.Tensor:
        """Append one token per row (``next_ids``: (batch,) int64, the same on every rank) and return
        (batch, vocab) logits of the next token. Every layer's attention over the cache is
        ``step.attend(layer_key, q, k, v, groups, **tree_decode_kwargs)``, with a key unique to
        the layer; the adapter may assume nothing else about the step (it may be run again after
        ``cache.rewind_step()``, with the same ids)."""

    # Optional: ``step_batch(batch, max_seq_len) -> int``, the batch to run ``batch`` prompts at in a cache of
    # ``max_seq_len`` tokens per row (>= ``batch``; the same on every CP rank), for a model whose decode steps
    # are compiled or captured per batch size.
    # ``generate`` then repeats the shortest prompt in the extra rows and drops their tokens (its own cache only).


# --------------------------------------------------------------------------- one decode step


class DecodeStep:
    """One decode step as the loop hands it to ``model.decode_step``: the attention every layer calls.

    strategy, stats: the merge of every layer (``tree_decode``'s) and where its traffic is
    recorded. Made by :class:`StepRunner`; a ``DecodeStep()`` of one's own (``strategy="auto"``)
    is a plain step for a direct ``decode_step`` call.
    """

    def __init__(self, strategy: str = "auto", stats: CommStats | None = None, *, _state=None):
        self.strategy = strategy
        self.stats = stats
        self._state = _state

    def attend(self, layer_key, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: TreeGroups | None,
               **kwargs) -> torch.Tensor:
        """Exact attention of one layer's ``q`` over every rank's ``(k, v)`` shard: ``tree_decode``.

        layer_key: a hashable naming the layer (its shift under ``shifted`` is kept per key);
        q, k, v, groups and kwargs (``cache_seqlens``, ``block_table``, ``softmax_scale``,
        ``q_positions``, ``k_positions``, ``backend``, ...) as for :func:`tree_decode`, without
        ``strategy``/``stats``/``shift``/``deferred``/``return_lse`` (the step's own).
        returns out: (batch, seqlen_q, nheads_q, headdim), identical on every CP rank.

        Under ``shifted`` (in :class:`StepRunner`) the merge takes the layer's lse of the previous
        step as its shift and leaves its device flag with the runner; on the step's second try it
        runs ``packed``.
        """
        if self._state is None:
            return tree_decode(q, k, v, groups, strategy=self.strategy, stats=self.stats, **kwargs)
        return self._state.decode(layer_key, q, k, v, groups, stats=self.stats, **kwargs)

    @property
    def shifts(self) -> dict | None:
        """Each layer's shift under ``shifted`` (layer key -> (batch, heads_q, seqlen_q)), else ``None``."""
        return None if self._state is None else self._state.shifts

    @shifts.setter
    def shifts(self, value: dict) -> None:
        if self._state is None:
            raise ValueError("this step does not run strategy='shifted': it carries no shifts")
        self._state.shifts = value


class _ShiftState:
    """What ``shifted`` carries from one step to the next: each layer's merged lse of the previous
    step (its next shift, bit-identical on every CP rank: ``comm``'s module docstring) and this
    step's device flags (``tree_decode(deferred=)``), read once per step by :class:`StepRunner`."""

    def __init__(self):
        self.shifts: dict = {}
        self.flags: list = []
        self.redo = False

    def decode(self, key, q, k, v, groups, **kwargs) -> torch.Tensor:
        r = self.shifts.get(key)
        if r is not None and tuple(r.shape) != (q.shape[0], q.shape[2], q.shape[1]):
            r = None  # another batch shape: start again from packed (every rank sees the same shapes)
        if self.redo:
            out, lse = tree_decode(q, k, v, groups, strategy="packed", return_lse=True, **kwargs)
        else:
            out, lse = tree_decode(q, k, v, groups, strategy="shifted", shift=r, return_lse=True,
                                   deferred=self.flags, **kwargs)
        self.shifts[key] = lse
        return out


class StepRunner:
    """Runs the decode steps of one generation: the one place a ``shifted`` step is checked and redone.

    strategy: the merge of every step; groups: the CP group (``shifted`` needs one of > 1 rank,
    else it is ``packed``). :meth:`run` makes the step's :class:`DecodeStep` and calls
    ``model.decode_step``; under ``shifted`` it then reads the step's merge flags once (one host
    read per step, where the loop reads the logits anyway), and when a merge's weights
    overflowed or all underflowed, rewinds the cache and runs the step again with ``packed``
    (counted in ``stats.fallbacks``) -- on the same slots, so the cache advances once.
    """

    def __init__(self, strategy: str = "auto", groups: TreeGroups | None = None):
        self.strategy = strategy
        shifted = strategy == "shifted" and groups is not None and groups.size > 1
        self._state = _ShiftState() if shifted else None

    @property
    def shifts(self) -> dict | None:
        """Each layer's current shift under ``shifted`` (settable, e.g. to test the redo), else ``None``."""
        return None if self._state is None else self._state.shifts

    @shifts.setter
    def shifts(self, value: dict) -> None:
        if self._state is None:
            raise ValueError("this runner does not run strategy='shifted': it carries no shifts")
        self._state.shifts = value

    def run(self, model: DecodeModel, next_ids: torch.Tensor, cache: DecodeCache,
            stats: CommStats | None = None) -> tuple[torch.Tensor, bool]:
        """One decode step of ``model``; returns ``(logits (batch, vocab), whether it was run twice)``.

        The same as ``step = self.step(stats)``, ``logits = model.decode_step(next_ids, cache, step)``,
        ``self.finish(model, next_ids, cache, step, logits)`` (a loop that guards the step itself,
        e.g. with ``sync_guard.no_host_sync``, calls the three)."""
        step = self.step(stats)
        return self.finish(model, next_ids, cache, step, model.decode_step(next_ids, cache, step))

    def step(self, stats: CommStats | None = None) -> DecodeStep:
        """The :class:`DecodeStep` of the next step (what ``model.decode_step`` is handed)."""
        return DecodeStep(self.strategy, stats, _state=self._state)

    def finish(self, model: DecodeModel, next_ids: torch.Tensor, cache: DecodeCache, step: DecodeStep,
               logits: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """After ``model.decode_step(next_ids, cache, step)`` returned ``logits``: under ``shifted``,
        the step's one read of its merges' flags, and its redo with ``packed`` when one is raised
        (``cache.rewind_step()``, then ``decode_step`` again); returns ``(logits, redone)``."""
        stats = step.stats
        state = self._state
        if state is None:
            return logits, False
        flags, state.flags = state.flags, []
        failed = int(torch.stack(flags).sum()) if flags else 0  # identical on every rank: all-reduced values
        if failed:
            if stats is not None:
                stats.fallbacks += failed
            cache.rewind_step()
            state.redo = True
            try:
                logits = model.decode_step(next_ids, cache, step)
            finally:
                state.redo = False
                state.flags = []
        return logits, bool(failed)


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


def _is_int(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _values_and_types(values: list) -> str:
    """The first few bad values and their types, as an error shows them."""
    types = sorted({type(t).__name__ for t in values})
    return f"{values[:5]}{' ...' if len(values) > 5 else ''} ({', '.join(types)})"


def stop_id_set(stop_token_ids, vocab: int | None = None) -> frozenset:
    """``stop_token_ids`` checked: ``None`` or a collection (list, tuple, set) of int token ids, each in
    ``[0, vocab)`` when ``vocab`` is given (an id outside it could never be generated: a typo would never stop).

    A single id is refused (pass ``[id]``) rather than guessed, as is a string or a float id.
    """
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (list, tuple, set, frozenset)):
        hint = f"; for one id pass [{stop_token_ids!r}]" if _is_int(stop_token_ids) else ""
        raise TypeError(f"stop_token_ids must be a list (or tuple/set) of int token ids or None, got "
                        f"{type(stop_token_ids).__name__} {stop_token_ids!r}{hint}")
    not_int = [t for t in stop_token_ids if not _is_int(t)]
    if not_int:
        raise TypeError(f"stop_token_ids: token ids must be integers, got {_values_and_types(not_int)}")
    outside = sorted(t for t in stop_token_ids if vocab is not None and not 0 <= t < vocab)
    if outside:
        raise ValueError(f"stop_token_ids outside the model's vocabulary [0, {vocab}): {outside[:5]}; such a token is "
                         "never generated, so it would never stop a row")
    return frozenset(stop_token_ids)


def _check_args(prompts, max_new_tokens, do_sample, temperature, top_k, top_p, vocab):
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        not_int = [t for t in p if not _is_int(t)]
        if not_int:
            raise TypeError(f"prompt {i}: token ids must be integers, got {_values_and_types(not_int)}")
        bad = [t for t in p if not 0 <= t < vocab]
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


def row_digest(row) -> str:
    """A short digest of one token-id row (equal rows, equal digests), as the error shows it."""
    data = b"".join(int(t).to_bytes(8, "little", signed=True) for t in row)
    return hashlib.blake2b(data, digest_size=6).hexdigest()


def tokens_digest(tokens: torch.Tensor, context: bytes = b"") -> str:
    """:func:`row_digest`'s digest of a whole tensor of token ids (any shape and device, read as int64 in one
    copy to the host), after ``context`` (other values the digest must cover, as bytes)."""
    data = tokens.detach().to(torch.int64).cpu().contiguous().numpy().tobytes()
    return hashlib.blake2b(context + data, digest_size=6).hexdigest()


def _check_call(model, prompts, max_new_tokens, do_sample, temperature, top_k, top_p, forced_tokens, cache) -> None:
    """This rank's own checks of a :func:`generate` call (they ride on the call's agreement)."""
    _check_args(prompts, max_new_tokens, do_sample, temperature, top_k, top_p, model.vocab_size)
    if forced_tokens is not None and tuple(forced_tokens.shape) != (len(prompts), max_new_tokens):
        raise ValueError(
            f"forced_tokens has shape {tuple(forced_tokens.shape)}, expected (batch, max_new_tokens) = "
            f"({len(prompts)}, {max_new_tokens})"
        )
    if cache is not None:
        if cache.batch_size not in (-1, len(prompts)):  # (-1: a cache that takes its rows from the prompts)
            raise ValueError(f"cache has batch size {cache.batch_size} but {len(prompts)} prompts were given")
        for i, p in enumerate(prompts):
            if cache.max_seq_len is not None and len(p) + max_new_tokens > cache.max_seq_len:  # (None: it grows)
                raise CacheOverflowError(
                    f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                    f"{len(p) + max_new_tokens} slots, beyond the cache's max_seq_len {cache.max_seq_len}"
                )


def _agree_on_call(model, prompts, max_new_tokens, stop_token_ids, do_sample, temperature, top_k, top_p, seed,
                   strategy, prefill_method, broadcast, forced_tokens, cache) -> None:
    """This rank's checks, then every CP rank must make this call alike; else all raise the same error.

    Ranks handed different prompts (contents or lengths), budgets or sampling would each run a
    consistent-looking but different generation: the collectives' sizes can still match, so
    nothing else would notice; a rank whose own arguments are bad would leave the others
    waiting in the prefill. One fixed-size all-gather per call (``agreement.agree``).
    """

    def values():
        _check_call(model, prompts, max_new_tokens, do_sample, temperature, top_k, top_p, forced_tokens, cache)
        forced = None if forced_tokens is None else tuple(row_digest(r) for r in forced_tokens.detach().cpu().tolist())
        return (len(prompts), tuple(len(p) for p in prompts), tuple(row_digest(p) for p in prompts), max_new_tokens,
                tuple(sorted(stop_id_set(stop_token_ids, model.vocab_size))), bool(do_sample), float(temperature), top_k,
                None if top_p is None else float(top_p), seed, strategy, prefill_method, bool(broadcast), forced)

    groups = model.groups
    group, ranks = (None, ()) if groups is None else (groups.cp_group, groups.cp_ranks)
    agreement.agree("generate", GENERATE_SIGNATURE, values, group, ranks, device=model.device)


def _step_rows(model, batch: int, max_seq_len: int) -> int:
    """The rows ``generate`` runs ``batch`` prompts at: ``model.step_batch(batch, max_seq_len)`` (a model
    without ``step_batch``: ``batch``), checked."""
    fit = getattr(model, "step_batch", None)
    n = batch if fit is None else fit(batch, max_seq_len)
    if not isinstance(n, int) or n < batch:
        raise ValueError(f"{type(model).__name__}.step_batch({batch}, {max_seq_len}) returned {n!r}; "
                         f"expected an int >= {batch} (the batch to run the prompts at)")
    return n


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
    speculative=None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after each prompt, on every rank of ``model.groups``.

    model: a :class:`DecodeModel` adapter (``MegatronLM``, ``HFTreeModel``)
    prompts: token-id lists of any (non-zero) lengths; every CP rank passes the same (checked:
        every CP rank must pass equal prompts and arguments, else every rank raises the same
        ``DisagreementError`` naming each rank's value; a rank whose own arguments are bad makes
        every rank raise its error, naming it; one small all-gather per call)
    stop_token_ids: a row stops after producing one of these ids: a list (tuple, set) of ints, e.g.
        ``[eos_id]``; a single int or a non-integer id is a ``TypeError`` naming it
    seed: seeds the sampling generator (identical results for identical seeds)
    cache: reuse a cache from ``model.new_cache``; by default one sized
        ``max(len(prompt)) + max_new_tokens`` is made. Every prompt plus ``max_new_tokens``
        must fit in it. In the cache it makes itself, for a model whose steps are compiled per batch size
        (``step_batch``, e.g. ``HFTreeModel`` with ``compile_step``), the batch runs at the model's
        size for it, the shortest prompt repeated in the extra rows: their tokens are dropped (rows never
        see each other's keys, so the real rows attend exactly as in a batch of their own).
    strategy, stats: passed to ``tree_decode`` at every decode step (:class:`DecodeStep`).
        ``"shifted"``: one SUM per layer per step after the first; each layer's merge leaves a
        device flag, read once per step here (next to the logits' own host read), and a step
        whose flag is raised is run again with ``packed`` on the same cache slots
        (:class:`StepRunner`; counted in ``stats.fallbacks``)
    progress: show a tqdm bar on CP rank 0
    prefill_method: the model's CP prefill (``None``: the model's default)
    hook: a :class:`GenerationHook` called around the prefill and each decode step
    forced_tokens: (batch, n) token ids fed instead of the chosen ones (teacher forcing, for
        scoring); token ``i`` is fed after the prefill (``i = 0``) or decode step ``i - 1``
    broadcast: CP rank 0's choice is broadcast each step (default). ``False`` keeps every
        rank's own choice, so that a check across ranks can see a divergence (the eval).
    speculative: a ``decode.speculative.SpeculativeConfig``: generation whose steps verify
        draft trees (prompt lookup or a draft model) in one forward each; greedy: the same tokens,
        sampling: the same distribution, in fewer steps (``decode.speculative.generate_speculative``;
        transformers models).
        Returns its ``SpeculativeResult`` (tokens, steps, accepted tokens per step).
    """
    if speculative is not None:
        unsupported = [name for name, off in (("forced_tokens", forced_tokens is None),
                                              ("hook", hook is None), ("prefill_method", prefill_method is None),
                                              ("broadcast=False", broadcast)) if not off]
        if unsupported:
            raise NotImplementedError(f"speculative generation takes none of {unsupported}")
        if not callable(getattr(speculative, "generate", None)):
            raise TypeError(f"speculative must be a decode.speculative.SpeculativeConfig, got "
                            f"{type(speculative).__name__}")
        # (the config runs its own loop: decode.speculative sits above this module, which never imports it)
        return speculative.generate(model, prompts, max_new_tokens, stop_token_ids=stop_token_ids, cache=cache,
                                    strategy=strategy, stats=stats, progress=progress, do_sample=do_sample,
                                    temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    _agree_on_call(model, prompts, max_new_tokens, stop_token_ids, do_sample, temperature, top_k, top_p, seed,
                   strategy, prefill_method, broadcast, forced_tokens, cache)
    prompts = [list(p) for p in prompts]
    batch = len(prompts)
    extra = 0
    if cache is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        extra = _step_rows(model, batch, longest) - batch
        cache = model.new_cache(batch + extra, longest)
    # the extra rows copy the shortest prompt (the cheapest to prefill; the first of equals) and its tokens
    copied = min(range(batch), key=lambda b: len(prompts[b]))
    rows = prompts + [prompts[copied]] * extra
    stops = stop_id_set(stop_token_ids)
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
    runner = StepRunner(strategy, groups)
    bar = tqdm(total=max_new_tokens, desc="generate", unit="tok", disable=not (progress and rank0))
    try:
        hook.before_prefill()
        t0 = time.perf_counter()
        logits = model.prefill(rows, cache, **prefill_kw)[:batch]
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
            fed = ids if not extra else torch.cat([ids, ids[copied:copied + 1].expand(extra)])  # (copies of a row)
            logits, _ = runner.run(model, fed, cache, st)  # under shifted: its one flag read and redo
            logits = logits[:batch]
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
