"""Exact speculative decoding across the CP group: draft trees verified in one decode step.

Invariant: a verification step is a decode step with T query rows (the last chosen token, the
tree's root, and T - 1 draft tokens) whose attention is exact and whose one cross-rank merge per
layer carries all T rows. Each row sees the whole committed cache (sharded over the CP ranks) and
its own ancestors among the T rows (``mask``, T x T bool: ``mask[i, j]`` iff row j is row i or
one of its ancestors). The attention of one layer is split in three exact parts::

    o_c, lse_c = flash_decode(q, k_shard, v_shard)      # every row over this rank's committed keys
    o_d, lse_d = draft_attention(q, k_draft, v_draft, mask)   # CP rank 0 only; elsewhere empty
    o, lse = merge_states([o_c, o_d], [lse_c, lse_d])   # local
    o, lse = comm.merge(o, lse, groups)                  # the one collective of the layer

The draft keys/values are computed by every rank alike (the same tokens through the same
weights), so counting them on one rank only makes them join the softmax exactly once. Drafts are
never written into the cache while they are verified: after acceptance the accepted tokens'
keys/values go through the cache's ordinary decode-step path (``begin_decode_step`` + ``append``,
the placement rule unchanged, every rank alike), so the cache never holds a rejected draft and
needs no rollback.

The loop (:func:`generate_speculative`) drafts with prompt lookup (n-gram matches in the prompt
and generated text) or a draft model (a small causal LM run replicated on every rank), in a tree
of ``width`` chains of ``depth`` tokens under the root. Greedy acceptance returns exactly the tokens
of non-speculative greedy :func:`decode.generate.generate`; speculative sampling
(:func:`speculative_accept`: recursive rejection sampling over siblings) draws tokens from exactly
the distribution ``decode.generate.sample_next`` samples from, decided on CP rank 0 and broadcast.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import math
import os
import time
from dataclasses import dataclass, field

import torch

from ..comm import merge as comm
from ..comm.merge import CommStats
from ..distributed import agreement, collectives
from ..distributed.topology import TreeGroups
from ..ops import dispatch as ops
from ..ops.contract import acc_dtype, softmax_scale_of
from ..ops.reference import add_sink, merge_states, soft_cap
from .generate import DecodeStep, GenerationResult, row_digest, stop_id_set

__all__ = ["check_draft_tree", "draft_attention", "verify_attention", "tree_mask", "SpeculativeConfig",
           "SpeculativeResult", "prompt_lookup_drafts", "generate_speculative", "VERIFY_SIGNATURE", "target_probs",
           "speculative_accept"]


# --------------------------------------------------------------------------- the draft tree


def check_draft_tree(mask, rows: int | None = None) -> None:
    """Raise ``ValueError``/``TypeError`` unless ``mask`` is the ancestor mask of a draft tree.

    mask: (T, T) bool, ``mask[i, j]`` iff row j is row i itself or one of its ancestors. A tree:
    the diagonal is true, no row sees a later row (``mask[i, j]`` only for ``j <= i``), and each
    row's ancestors are its parent's ancestors plus the parent (the parent is the latest row it
    sees before itself; a row that sees no earlier row is a root). rows: the T it must have.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"draft mask must be a (T, T) bool tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"draft mask must be a bool tensor (True: row j is row i or its ancestor), got {mask.dtype}")
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1]:
        raise ValueError(f"draft mask must be square (T, T), got shape {tuple(mask.shape)}")
    t = mask.shape[0]
    if rows is not None and t != rows:
        raise ValueError(f"draft mask is ({t}, {t}) but there are {rows} draft query rows")
    if t == 0:
        raise ValueError("draft mask is (0, 0): a verification step needs at least one query row")
    m = mask.detach().cpu()
    if not bool(m.diagonal().all()):
        i = int((~m.diagonal()).nonzero()[0])
        raise ValueError(f"draft mask is not a tree: row {i} does not see itself (mask[{i}, {i}] must be True)")
    later = torch.triu(m, diagonal=1)
    if bool(later.any()):
        i, j = (int(x) for x in later.nonzero()[0])
        raise ValueError(f"draft mask is not a tree: row {i} sees the later row {j} (mask[{i}, {j}] is True; "
                         "a row sees only itself and earlier rows, its ancestors)")
    for i in range(t):
        seen = m[i, :i].nonzero().flatten()
        if seen.numel() == 0:
            continue  # a root
        parent = int(seen[-1])
        want = m[parent].clone()
        want[i] = True
        if not torch.equal(m[i], want):
            bad = int((m[i] != want).nonzero()[0])
            raise ValueError(
                f"draft mask is not a tree: row {i}'s ancestors are not a chain to a root (its parent is row "
                f"{parent}, the latest row it sees, but mask[{i}, {bad}] = {bool(m[i, bad])} while row {parent} "
                f"{'sees' if bool(m[parent, bad]) else 'does not see'} row {bad})")


def tree_mask(width: int, depth: int) -> torch.Tensor:
    """The mask of a root with ``width`` chains of ``depth`` draft tokens under it: T = 1 + width * depth.

    Row 0 is the root; chain c's token at depth d (1-based) is row ``1 + c * depth + d - 1``.
    ``width=1`` is a chain (lower-triangular mask)."""
    t = 1 + width * depth
    m = torch.zeros(t, t, dtype=torch.bool)
    m[:, 0] = True
    for c in range(width):
        for d in range(depth):
            i = 1 + c * depth + d
            m[i, 1 + c * depth: i + 1] = True
    return m


def tree_depths(mask: torch.Tensor) -> torch.Tensor:
    """(T,) int64: each row's depth below its root (the number of ancestors)."""
    return mask.sum(dim=1).to(torch.int64) - 1


# --------------------------------------------------------------------------- the attention


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                    softmax_scale: float | None = None, softcap: float | None = None,
                    positions: torch.Tensor | None = None, window: int | None = None):
    """Attention of each draft row over its ancestors among the drafts (pure torch), as a partial state.

    q: (batch, T, nheads_q, headdim); k: (batch, T, nheads_kv, headdim); v: (batch, T, nheads_kv,
    headdim_v); mask: (T, T) bool (:func:`check_draft_tree`). GQA: query head h reads KV head
    ``h // (nheads_q // nheads_kv)``.
    positions: (batch, T) int64, the draft rows' global positions (a row's committed length plus its
    depth: siblings share one); with ``window`` (a sliding window, >= 1) row i sees ancestor j only
    when ``positions[:, i] - positions[:, j] < window`` (a query at p sees keys p - window < j <= p).
    returns out: (batch, T, nheads_q, headdim_v) float32 (float64 for float64 input), lse:
    (batch, nheads_q, T) float64, natural log (every row sees at least itself)
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    acc = acc_dtype(q.dtype)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = q.to(acc).reshape(b, t, hkv, g, d)
    s = torch.einsum("bihgd,bjhd->bhgij", qf, k.to(acc)) * scale  # (b, hkv, g, T, T)
    s = soft_cap(s, softcap)
    seen = mask.to(s.device)[None]  # (1 or batch, T, T)
    if window is not None:
        p = positions.to(s.device)
        seen = seen & ((p[:, :, None] - p[:, None, :]) < window)
    s = s.masked_fill(~seen[:, None, None], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bhgij,bjhd->bihgd", p / den, v.to(acc)).reshape(b, t, hq, v.shape[3])
    lse = (m.double() + torch.log(den.double())).reshape(b, hkv * g, t)
    return out, lse


def _tensor_digest(*ts) -> str:
    """A short digest of tensors' bytes (equal tensors, equal digests)."""
    h = hashlib.blake2b(digest_size=8)
    for t in ts:
        c = t.detach().contiguous().cpu()
        h.update(str((tuple(c.shape), c.dtype)).encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


VERIFY_SIGNATURE = ("batch", "rows", "heads_q", "headdim", "dtype", "mask", "drafts", "strategy", "window",
                    "positions")
"""What every CP rank of one :func:`verify_attention` call must pass alike (checked when ``check=True``)."""


def verify_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    draft_k: torch.Tensor,
    draft_v: torch.Tensor,
    mask: torch.Tensor,
    groups: TreeGroups | None,
    *,
    cache_seqlens: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    strategy: str = "auto",
    stats: CommStats | None = None,
    backend: str | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    room: int | None = None,
    check: bool = True,
    return_lse: bool = False,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    window: int | None = None,
):
    """Exact attention of T draft rows over the sharded committed cache plus their ancestors among the drafts.

    Per rank (every rank passes the same q, draft_k, draft_v and mask; its own shard):

    q: (batch, T, nheads_q, headdim) -- the draft rows' queries, replicated
    k, v: this rank's committed shard, as for :func:`~megatron_tree.decode.tree_decode` (contiguous
        (batch, shard_len, nheads_kv, headdim[_v]), or paged pools with ``block_table``); every
        draft row sees every valid committed key (``cache_seqlens``), or with ``window`` those
        its window still holds
    draft_k, draft_v: (batch, T, nheads_kv, headdim[_v]) -- the draft rows' own keys/values,
        replicated (every rank computes them alike; only CP rank 0 counts them)
    mask: (T, T) bool ancestor mask of the draft tree (:func:`check_draft_tree`)
    q_positions: (batch, T) int64, the draft rows' global positions, replicated (a row's committed
        length plus its depth in the tree: siblings share one; an ancestor's is smaller);
        k_positions: (batch, shard_len) or (shard_len,) int64, this shard's key positions (a
        ``ShardedKVCache``'s ``positions``); both are needed with ``window`` and go together
    window: a sliding window (int >= 1, the same on every rank; ``None``: full causal): a row at
        position p sees the committed keys at j > p - window and the ancestors at p_a > p - window
    room: with it, T must be at most ``room`` (the slots the cache has left per row)
    check: compare the call across the CP group first (one all-gather of a small record and a
        digest of the drafts and mask: ``agreement.agree``), so a bad mask, drafts that differ
        between ranks or a bad shard give the same error on every rank before any merge
        collective; a loop that checked its step's drafts once passes ``False`` for its layers
    returns out: (batch, T, nheads_q, headdim_v) in q.dtype, identical on every CP rank (and with
        ``return_lse`` the lse (batch, nheads_q, T) float64)

    Collectives: the check's all-gather (``check=True``) and one ``comm.merge`` for all T rows.
    """
    if strategy not in comm.STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {comm.STRATEGIES}")
    rank0 = groups is None or groups.rank == 0

    def values():
        for name, t in (("q", q), ("draft_k", draft_k), ("draft_v", draft_v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D tensor (batch, T, heads, headdim), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        b, t, hq, d = q.shape
        check_draft_tree(mask, t)
        if tuple(draft_k.shape[:2]) != (b, t) or tuple(draft_v.shape[:3]) != tuple(draft_k.shape[:3]) \
                or draft_k.shape[3] != d or draft_k.shape[2] != k.shape[2] or draft_v.shape[3] != v.shape[3]:
            raise ValueError(
                f"draft_k/draft_v must be (batch, T, nheads_kv, headdim[_v]) = ({b}, {t}, {k.shape[2]}, {d}/"
                f"{v.shape[3]}) like q and the cache, got {tuple(draft_k.shape)} and {tuple(draft_v.shape)}")
        if room is not None and t > room:
            raise ValueError(f"{t} draft rows do not fit: the cache has room for {room} more token(s) per row")
        if q.dtype != draft_k.dtype or q.dtype != draft_v.dtype:
            raise TypeError(f"q and the drafts must share one dtype, got q={q.dtype}, draft_k={draft_k.dtype}, "
                            f"draft_v={draft_v.dtype}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int (a sliding window of that many keys) or None, got "
                             f"{window!r}")
        if (q_positions is None) != (k_positions is None):
            raise ValueError("q_positions and k_positions go together: pass both (the draft rows' and the shard's "
                             "global positions) or neither")
        if window is not None and q_positions is None:
            raise ValueError(f"window={window} needs q_positions (batch, T) and k_positions: the draft rows' and the "
                             "committed shard's global positions decide what the window holds")
        if q_positions is not None:
            if not isinstance(q_positions, torch.Tensor) or tuple(q_positions.shape) != (b, t) \
                    or q_positions.dtype != torch.int64:
                raise ValueError(
                    f"q_positions must be a (batch, T) = ({b}, {t}) int64 tensor of the draft rows' global positions, "
                    f"got {tuple(q_positions.shape) if isinstance(q_positions, torch.Tensor) else type(q_positions).__name__}"
                    f"{'' if not isinstance(q_positions, torch.Tensor) else f' {q_positions.dtype}'}")
            qp = q_positions.detach().cpu()
            anc = mask.detach().cpu() & ~torch.eye(t, dtype=torch.bool)
            late = anc[None] & (qp[:, None, :] >= qp[:, :, None])  # (b, i, j): ancestor j not before row i
            if bool(late.any()):
                r, i, j = (int(x) for x in late.nonzero()[0])
                raise ValueError(
                    f"q_positions do not follow the draft tree: batch row {r}'s draft row {i} is at position "
                    f"{int(qp[r, i])} but its ancestor row {j} at {int(qp[r, j])} (an ancestor's position must be smaller)")
        digest = _tensor_digest(draft_k, draft_v) if check else None
        pdigest = _tensor_digest(q_positions) if check and q_positions is not None else None
        return (b, t, hq, d, str(q.dtype), _tensor_digest(mask), digest, strategy, window, pdigest)

    if check and groups is not None and groups.size > 1:
        agreement.agree("speculative.verify", VERIFY_SIGNATURE, values, groups.cp_group, groups.cp_ranks,
                        stats=stats)
    else:
        values()
    try:
        out, lse = ops.flash_decode(q, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                                    softmax_scale=softmax_scale, out_dtype=acc_dtype(q.dtype), backend=backend,
                                    lse_dtype=torch.float64, softcap=softcap, q_positions=q_positions,
                                    k_positions=k_positions, window=window)
        resolved = ops.resolve_backend(q.device, backend)
    except Exception as e:  # noqa: BLE001 -- this rank's own failure: every rank raises it (as tree_decode)
        if groups is not None and groups.size > 1 and not isinstance(e, comm.CommError):
            groups.agreement.fail("merge", e)
        raise
    if rank0:  # the drafts join the softmax once: on CP rank 0 (the others' partial for them is empty)
        do, dl = draft_attention(q, draft_k, draft_v, mask, softmax_scale=softmax_scale, softcap=softcap,
                                 positions=q_positions, window=window)
        out, lse = merge_states(torch.stack([out, do.to(out.dtype)]), torch.stack([lse.double(), dl]))
    if groups is not None:  # (the settings the partials were made with: compared by the merge's agreement)
        out, lse = comm.merge(out, lse, groups, strategy, stats, dtype=q.dtype, backend=resolved,
                              softmax_scale=softmax_scale_of(softmax_scale, q.shape[-1]), window=window,
                              softcap=softcap)
    if sinks is not None:
        out, lse = add_sink(out, lse, sinks)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- drafting


@dataclass
class SpeculativeConfig:
    """How :func:`generate_speculative` drafts.

    method: ``"prompt_lookup"`` (n-gram matches in the prompt and generated text) or
        ``"draft_model"`` (``draft_model``: a transformers causal LM, run replicated on every rank)
    width: chains under the root (tree branching; 1: a chain); depth: draft tokens per chain
    max_ngram, min_ngram: the n-gram lengths prompt lookup tries, longest first
    """

    method: str = "prompt_lookup"
    width: int = 1
    depth: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    draft_model: object = None

    def generate(self, model, prompts, max_new_tokens: int, **kwargs) -> "SpeculativeResult":
        """:func:`generate_speculative` with this config (what ``decode.generate(speculative=)`` calls)."""
        return generate_speculative(model, prompts, max_new_tokens, speculative=self, **kwargs)

    def check(self, vocab: int) -> None:
        if self.method not in ("prompt_lookup", "draft_model"):
            raise ValueError(f"speculative method must be 'prompt_lookup' or 'draft_model', got {self.method!r}")
        for name in ("width", "depth", "max_ngram", "min_ngram"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"speculative {name} must be a positive integer, got {val!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"speculative min_ngram ({self.min_ngram}) exceeds max_ngram ({self.max_ngram})")
        if self.method == "draft_model":
            if self.draft_model is None:
                raise ValueError("speculative method 'draft_model' needs draft_model= (a causal LM)")
            if isinstance(self.draft_model, (str, bytes, os.PathLike)):
                raise ValueError(f"speculative draft_model must be a loaded causal LM, got the path "
                                 f"{self.draft_model!r}: load it first, e.g. "
                                 "transformers.AutoModelForCausalLM.from_pretrained(path).eval()")
            if not isinstance(_draft_module(self.draft_model), torch.nn.Module):
                raise ValueError(f"speculative draft_model must be a causal LM module (e.g. transformers' "
                                 f"AutoModelForCausalLM.from_pretrained(path).eval()), got "
                                 f"{type(self.draft_model).__name__}")
            dv = _vocab_of(self.draft_model)
            if dv != vocab:
                raise ValueError(f"the draft model's vocabulary has {dv} tokens but the target model's has {vocab}: "
                                 "draft tokens must be the target's token ids (use a draft model of the same "
                                 "tokenizer)")


def _draft_module(model):
    """The module a draft model runs as: a transformers model as given, or the transformers model inside
    the package's own wrapper (``HFTreeModel``, what ``load_hf_model`` returns: its ``.hf``)."""
    inner = getattr(model, "hf", None)
    return inner if not isinstance(model, torch.nn.Module) and isinstance(inner, torch.nn.Module) else model


def _vocab_of(model) -> int:
    model = _draft_module(model)
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)() if cfg is not None else None
    v = getattr(cfg, "vocab_size", None) if cfg is not None else getattr(model, "vocab_size", None)
    if v is None:
        raise ValueError(f"cannot tell the draft model's vocabulary size ({type(model).__name__} has no "
                         "config.vocab_size)")
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return int(v)


def prompt_lookup_drafts(seq: list[int], width: int, depth: int, max_ngram: int = 3, min_ngram: int = 1) -> list:
    """Up to ``width`` distinct continuations (each up to ``depth`` tokens) of ``seq``'s last n-gram.

    For n from ``max_ngram`` down to ``min_ngram``: every earlier occurrence of ``seq[-n:]``
    (latest first) proposes the tokens that followed it; continuations whose first token is
    already proposed are skipped, so the chains branch at the root. Returns a list of token lists.
    """
    found: list[list[int]] = []
    firsts: set[int] = set()
    n_seq = len(seq)
    for n in range(min(max_ngram, n_seq - 1), min_ngram - 1, -1):
        tail = seq[n_seq - n:]
        for start in range(n_seq - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                cont = seq[start + n:start + n + depth]
                if cont and cont[0] not in firsts:
                    firsts.add(cont[0])
                    found.append(cont)
                    if len(found) == width:
                        return found
    return found


def _has_windows(model) -> bool:
    """Whether a transformers model's config gives some layer a sliding window (``sliding_window`` set, or
    ``sliding_attention`` among ``layer_types``)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return False
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return bool(getattr(cfg, "sliding_window", None)) or "sliding_attention" in (getattr(cfg, "layer_types", None)
                                                                                  or ())


@dataclass
class _DraftGroup:
    """Rows drafted together over one batched transformers ``Cache`` (``len(rows)`` batch rows, in
    ``rows``' order), each holding its first ``seen`` tokens."""

    rows: list
    cache: object
    seen: int


class DraftCaches:
    """The draft model's KV cache, kept from one step to the next, so a step feeds the draft model only
    the tokens each row gained since (replicated: every rank makes the same calls). Without it every
    draft token re-read the whole sequence (at a 3K-token prompt the draft model cost 20x a plain step:
    benchmarks/results/speculative_trained.md).

    Rows of one length that have grown alike share one batched cache and are drafted in one forward
    per draft token (a group, :class:`_DraftGroup`): the speculative loop advances every row by the
    same count, so rows that start with equal lengths stay together, and a batch of B such rows costs
    ``depth`` forwards per step, not ``B * depth``. A group whose rows come to differ in length is split
    (its cache copied and its batch rows selected), never merged.

    A model whose forward returns no croppable cache runs without one (full forwards over the whole
    sequence per draft token). A tree-enabled draft model (``load_hf_model``'s, with or without CP groups)
    drafts through its plain replica sharing its weights (its binding's ``plain_replica``):
    tree attention's ``TreeCache`` holds a shard of every row and cannot repeat or select rows, which a
    tree of width > 1 and a group's split need.
    """

    def __init__(self, model, batch: int):
        model = _draft_module(model)
        binding = getattr(model, "_megatron_tree", None)  # (integrations.hf.common._MARK: tree-enabled)
        if binding is not None:
            model = binding.plain_replica(model)
        self.model = model
        self.dev = next(model.parameters()).device
        # transformers renamed the cache argument and output (past_key_values -> cache); use what it takes
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.batch = batch
        self.groups: list[_DraftGroup] = []
        self.enabled = True

    def held(self, b: int) -> tuple[int, int]:
        """(tokens the draft cache holds for row ``b``, batch rows of the cache it shares); (0, 0) before
        its first draft."""
        for g in self.groups:
            if b in g.rows:
                return (0 if g.cache is None else g.cache.get_seq_length()), len(g.rows)
        return 0, 0

    def _forward(self, ids: torch.Tensor, cache):
        if not self.enabled:
            return self.model(ids).logits, None
        if cache is None and _has_windows(self.model):
            # transformers' own cache of a sliding-window layer keeps only the window and cannot be cropped
            # once it is full; full layers hold every key (the model's masks still apply its windows)
            from transformers import DynamicCache

            cache = DynamicCache()
        out = self.model(input_ids=ids, use_cache=True, **{self.cache_kw: cache})
        cache = getattr(out, self.cache_kw, None)
        if cache is None or not all(hasattr(cache, n) for n in ("crop", "batch_repeat_interleave",
                                                                   "batch_select_indices")):
            self.enabled = False  # (this model keeps no cache we can roll back: full forwards from now on)
            cache = None
        return out.logits, cache

    def _regroup(self, seqs: list[list[int]], done: list[bool] | None = None) -> list[_DraftGroup]:
        """The groups of this step: the rows of each kept group split by their current length (a split
        copies the cache and selects its batch rows), rows never drafted grouped by length; ordered by
        their first rows (the order the rows' random draws follow). Finished rows (``done[b]``) leave
        their group for good: they are never drafted again."""
        if len(seqs) != self.batch:
            raise ValueError(f"DraftCaches was made for {self.batch} rows, got {len(seqs)}")
        owner = {b: g for g in self.groups for b in g.rows}
        parts: dict = {}
        for b, seq in enumerate(seqs):
            if done is None or not done[b]:
                parts.setdefault((id(owner.get(b)), len(seq)), []).append(b)
        by_old: dict = {}  # id of a kept group (or of None) -> its rows' parts, in the rows' order
        for (gid, _), rows in parts.items():
            by_old.setdefault(gid, []).append(rows)
        groups = []
        for old in self.groups + [None]:
            mine = by_old.get(id(old), [])
            if old is None:
                groups += [_DraftGroup(rows, None, 0) for rows in mine]
                continue
            at = {b: i for i, b in enumerate(old.rows)}  # a row's batch index in the kept cache
            for i, rows in enumerate(mine):
                cache = old.cache if i == len(mine) - 1 else copy.deepcopy(old.cache)
                if rows != old.rows:
                    cache.batch_select_indices(torch.tensor([at[b] for b in rows], device=self.dev))
                groups.append(_DraftGroup(rows, cache, old.seen))
        groups.sort(key=lambda g: g.rows[0])
        self.groups = groups
        return groups

    def _grow(self, group: _DraftGroup, seqs: list[list[int]], width: int, depth: int, first, step):
        """The rows of ``group`` (n of them, their tokens so far in ``seqs``) over their cache: feed the
        tokens they gained, start ``width`` chains per row with ``first(logits)`` (the last position's
        (n, vocab) logits -> (n * width, 1) tokens, row by row), extend each with ``step(logits)``
        ((n * width, vocab) -> (n * width, 1)) to ``depth`` tokens, and leave the cache holding each row
        but its last token. Returns (chains (n, width, depth), None), or (None, the first forward's
        logits (n, L, vocab)) when this model keeps no cache (the caller then runs full forwards)."""
        rows, n = group.rows, len(group.rows)
        cache = group.cache if self.enabled else None
        new = [seqs[b][group.seen:] if cache is not None else seqs[b] for b in rows]  # equal lengths
        logits, cache = self._forward(torch.tensor(new, device=self.dev), cache)
        if cache is None:
            return None, logits
        chains = first(logits[:, -1])
        if width > 1 and depth > 1:
            cache.batch_repeat_interleave(width)
        while chains.shape[1] < depth:
            logits, cache = self._forward(chains[:, -1:], cache)
            chains = torch.cat([chains, step(logits[:, -1])], dim=1)
        # back to the rows' tokens but their last (the next step feeds from there: never nothing, even for
        # rows that gained no token): the chains' keys and the last token's go, one batch row per row stays
        cache.crop(-depth)
        if width > 1 and depth > 1:
            cache.batch_select_indices(torch.arange(0, n * width, width, device=self.dev))
        group.cache, group.seen = cache, len(seqs[rows[0]]) - 1
        return chains.reshape(n, width, depth), None

    def chains(self, seqs: list[list[int]], width: int, depth: int,
               done: list[bool] | None = None) -> list[list[list[int]]]:
        """Per row (its tokens so far: ``seqs[b]``): ``width`` chains of ``depth`` greedy draft tokens,
        chain c starting from the c-th most likely next token; the rows' cache is left holding each
        row but its last token. A finished row (``done[b]``) is not drafted: its chains repeat its last
        token (the loop keeps none of its tokens)."""
        out: list = [[[seq[-1]] * depth for _ in range(width)] for seq in seqs]
        # without a cache, row by row (rows of different lengths cannot share a full forward)
        for group in self._regroup(seqs, done) if self.enabled else \
                [_DraftGroup([b], None, 0) for b in range(len(seqs)) if done is None or not done[b]]:
            chains, logits = self._grow(group, seqs, width, depth,
                                        lambda last: torch.topk(last.float(), width).indices.reshape(-1, 1),
                                        lambda last: last.float().argmax(-1, keepdim=True))
            for i, b in enumerate(group.rows):
                if chains is not None:
                    out[b] = chains[i].tolist()
                    continue
                # no cache: the chains extend by full forwards over the whole sequence (the first forward,
                # over every row of the group, gave the first tokens)
                seq = seqs[b]
                row = torch.topk(logits[i, -1].float(), width).indices[:, None]  # (width, 1)
                ctx = torch.tensor([seq], device=self.dev).expand(width, -1)
                while row.shape[1] < depth:
                    step_logits = self.model(torch.cat([ctx, row], dim=1)).logits[:, -1].float()
                    row = torch.cat([row, step_logits.argmax(-1, keepdim=True)], dim=1)
                out[b] = row.tolist()
        return out

    def sampled(self, seqs: list[list[int]], width: int, depth: int, probs, generator,
                done: list[bool] | None = None) -> tuple | None:
        """Per row: ``width`` chains of ``depth`` tokens *sampled* from the draft model's distribution
        (``probs`` of its logits), a row's chains' first tokens drawn independently from one distribution;
        returns tokens (batch, width, depth) int64 and q (batch, width, depth, vocab) float64, the
        distribution each token was drawn from. The rows' cache is left holding each row but its last
        token, as :meth:`chains` leaves it. None when this model keeps no cache (the caller then runs
        full forwards); it is found at the first forward, before any draw. A finished row (``done[b]``)
        is not drafted and draws nothing: its chains repeat its last token, each with q one-hot on it."""
        if not self.enabled:
            return None
        tokens, qs = [None] * len(seqs), [None] * len(seqs)
        for group in self._regroup(seqs, done):
            qd = []

            def draw(q, qd=qd):
                qd.append(q)
                return torch.multinomial(q, 1, generator=generator)

            chains, _ = self._grow(group, seqs, width, depth,
                                   lambda last: draw(probs(last).double().repeat_interleave(width, 0)),
                                   lambda last: draw(probs(last).double()))
            if chains is None:
                return None
            q = torch.stack(qd, dim=1).reshape(len(group.rows), width, depth, -1)
            for i, b in enumerate(group.rows):
                tokens[b], qs[b] = chains[i], q[i]
        vocab = next(q.shape[-1] for q in qs if q is not None)  # (the loop drafts only while a row is unfinished)
        for b, seq in enumerate(seqs):
            if tokens[b] is None:
                tokens[b] = torch.full((width, depth), seq[-1], dtype=torch.long)
                qs[b] = torch.nn.functional.one_hot(tokens[b], vocab).double()
        return torch.stack(tokens), torch.stack(qs)


@torch.no_grad()
def _draft_model_sampled_cached(caches: DraftCaches, seqs: list[list[int]], width: int, depth: int, probs,
                                generator, done: list[bool] | None = None) -> tuple:
    """:func:`_draft_model_sampled`'s result, drafted over the draft model's kept cache
    (:meth:`DraftCaches.sampled`): tokens (batch, width, depth) int64, q (batch, width, depth, vocab)
    float64. Falls back to full forwards for a draft model that keeps no cache."""
    got = caches.sampled(seqs, width, depth, probs, generator, done)
    return got if got is not None else _draft_model_sampled(caches.model, seqs, width, depth, probs, generator)


@torch.no_grad()
def _draft_model_drafts(caches: DraftCaches, seqs: list[list[int]], width: int, depth: int,
                        done: list[bool] | None = None) -> list[list[list[int]]]:
    """Per row: ``width`` chains of ``depth`` greedy tokens of the draft model (:meth:`DraftCaches.chains`;
    finished rows not drafted)."""
    return caches.chains(seqs, width, depth, done)


@torch.no_grad()
def _draft_model_sampled(model, seqs: list[list[int]], width: int, depth: int, probs, generator) -> tuple:
    """Per row: ``width`` chains of ``depth`` tokens *sampled* from ``model``'s distribution (``probs``
    of its logits: the target's temperature/top-k/top-p), the chains' first tokens drawn independently
    from one distribution. Returns tokens (batch, width, depth) int64 and their proposal
    distributions q (batch, width, depth, vocab) float64 (q[b, c, d] is what token [b, c, d] was drawn
    from). Rows of one length run as one batch; one full forward per depth (no cache)."""
    dev = next(model.parameters()).device
    tokens = [None] * len(seqs)
    qs = [None] * len(seqs)
    by_len: dict = {}
    for b, seq in enumerate(seqs):
        by_len.setdefault(len(seq), []).append(b)
    for rows in by_len.values():
        ctx = torch.tensor([seqs[b] for b in rows], device=dev).repeat_interleave(width, 0)  # (n * width, L)
        q = probs(model(ctx[::width]).logits[:, -1]).double().repeat_interleave(width, 0)  # (n * width, V)
        chain = torch.multinomial(q, 1, generator=generator)  # siblings: independent draws from one q
        qd = [q]
        while chain.shape[1] < depth:
            q = probs(model(torch.cat([ctx, chain.to(dev)], dim=1)).logits[:, -1]).double()
            chain = torch.cat([chain, torch.multinomial(q, 1, generator=generator)], dim=1)
            qd.append(q)
        chain = chain.reshape(len(rows), width, depth)
        qd = torch.stack(qd, dim=1).reshape(len(rows), width, depth, -1)
        for i, b in enumerate(rows):
            tokens[b], qs[b] = chain[i], qd[i]
    return torch.stack(tokens), torch.stack(qs)


# --------------------------------------------------------------------------- speculative sampling


def target_probs(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
    """The distribution ``decode.generate.sample_next(do_sample=True)`` draws from, for logits of any
    leading shape (..., vocab) -> float32 probabilities on the CPU (the same operations in the same
    order, so ``torch.multinomial`` of a row draws what ``sample_next`` draws with that generator)."""
    shape = logits.shape
    x = logits.detach().float().cpu().reshape(-1, shape[-1]) / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1).reshape(shape)


def _parents(mask: torch.Tensor) -> list[int]:
    """Each row's parent in a draft tree (-1 for row 0); raises unless row 0 is the one root."""
    check_draft_tree(mask)
    m = mask.detach().cpu()
    out = [-1]
    for i in range(1, m.shape[0]):
        seen = m[i, :i].nonzero().flatten()
        if seen.numel() == 0 or not bool(m[i, 0]):
            raise ValueError(f"speculative sampling needs one root (row 0) under which every draft hangs; row {i} "
                             "does not descend from row 0")
        out.append(int(seen[-1]))
    return out


def speculative_accept(p: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor, q: torch.Tensor | None = None,
                       generator: torch.Generator | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """Speculative sampling over a draft tree: which drafts to keep and the token after them, per row.

    p: (batch, T, vocab) the target's next-token distribution after each tree row (row 0: the root,
        the last chosen token; row i: after the root and row i's ancestors and row i itself)
    tokens: (batch, T) int64 draft tokens (row 0's is not used)
    mask: (T, T) the tree (:func:`check_draft_tree`), every row under row 0
    q: (batch, T, vocab) the distribution each draft token was drawn from, or ``None``: every draft is
        a point mass at its token (prompt lookup, or any draft chosen without randomness)
    returns (paths, emitted): per row the accepted rows from the root down (``[0, ...]``) and the
        tokens they yield (the accepted drafts, then one token drawn at the last accepted row),
        ``len(emitted[b]) == len(paths[b])``

    The rule (recursive rejection sampling; SpecInfer's multi-step speculative sampling): at the
    current row with residual distribution r (first its p), each child x in row order is accepted
    with probability min(1, r(x) / q(x)); an accepted child becomes the current row (r = its p);
    a rejected one replaces r by normalize(max(0, r - q)). When no child is accepted (or the row
    is a leaf), one token is drawn from r. Each emitted token then follows p given the tokens
    before it, exactly, provided each draft was drawn from its q independently of its earlier
    siblings' draws (the siblings of a draft model's tree are independent draws; a point mass
    needs nothing). The draws come from ``generator`` in a fixed order: the same seed, the same
    result.
    """
    b, t, v = p.shape
    if tuple(tokens.shape) != (b, t):
        raise ValueError(f"tokens must be (batch, T) = ({b}, {t}) like p, got {tuple(tokens.shape)}")
    if q is not None and tuple(q.shape) != (b, t, v):
        raise ValueError(f"q must be (batch, T, vocab) = ({b}, {t}, {v}) like p, got {tuple(q.shape)}")
    parents = _parents(mask)
    if mask.shape[0] != t:
        raise ValueError(f"draft mask is ({mask.shape[0]}, {mask.shape[0]}) but p has {t} tree rows")
    children = [[i for i in range(1, t) if parents[i] == u] for u in range(t)]
    p = p.detach().cpu().double()
    tokens = tokens.detach().cpu().long()
    q = None if q is None else q.detach().cpu().double()
    rows = torch.arange(b)
    cur = torch.zeros(b, dtype=torch.long)
    stopped = torch.zeros(b, dtype=torch.bool)
    r = p[:, 0].clone()
    for u in range(t):
        here = (cur == u) & ~stopped
        if u > 0:
            r[here] = p[here, u]
        for c in children[u]:
            draw = torch.rand(b, generator=generator, dtype=torch.float64)
            live = (cur == u) & ~stopped
            x = tokens[:, c]
            qx = torch.ones(b, dtype=torch.float64) if q is None else q[rows, c, x]
            accept = live & (draw * qx < r[rows, x])  # P = min(1, r(x) / q(x)); draw in [0, 1)
            reject = live & ~accept
            cur = torch.where(accept, torch.full_like(cur, c), cur)
            if bool(reject.any()):
                qc = torch.nn.functional.one_hot(x, v).double() if q is None else q[:, c]
                res = (r - qc).clamp_min(0.0)
                total = res.sum(dim=-1, keepdim=True)
                # total == 0 only when r == q (then x was accepted surely): keep r
                use = reject & (total[:, 0] > 0)
                r = torch.where(use[:, None], res / total.clamp_min(1e-300), r)
        stopped |= cur == u
    final = torch.multinomial(r, 1, generator=generator)[:, 0].tolist()
    m = mask.detach().cpu()
    node_paths = [m[i].nonzero().flatten().tolist() for i in range(t)]  # row i's ancestors and itself, root first
    toks = tokens.tolist()
    paths = [node_paths[c] for c in cur.tolist()]
    emitted = [[toks[row][n] for n in path[1:]] + [final[row]] for row, path in enumerate(paths)]
    return [list(path) for path in paths], emitted


# --------------------------------------------------------------------------- the verification step (transformers)


class _VerifyStep(DecodeStep):
    """The step ``HFTreeModel``'s layers call during verification: :func:`verify_attention` of the layer's
    queries over its committed shard and the drafts' own keys/values (kept aside by the TreeCache)."""

    def __init__(self, cache, mask, strategy, stats):
        super().__init__(strategy, stats)
        self.cache, self.mask = cache, mask

    def attend(self, layer_key, q, k, v, groups, drafts=None, **kwargs):
        """drafts: the draft rows' (keys, values) as the layer made them (MLA expands its latent), else the
        ones the cache kept aside. A sliding-window layer also passes ``window``, the drafts'
        ``q_positions`` (batch, T) and the shard's ``k_positions`` (the hf attention's verify phase)."""
        kwargs.pop("cache_starts", None)
        dk, dv = drafts if drafts is not None else self.cache._drafts[layer_key]
        return verify_attention(q, k, v, dk, dv, self.mask, groups, strategy=self.strategy, stats=self.stats,
                                check=False, **kwargs)


VERIFY_FORWARD_SIGNATURE = ("batch", "rows", "tokens", "mask", "cache_lengths")
"""What every CP rank of one :func:`verify_forward` call must pass alike (checked when ``check=True``)."""


@torch.no_grad()
def verify_forward(model, cache, tokens: torch.Tensor, mask: torch.Tensor, *, strategy: str = "auto",
                   stats: CommStats | None = None, check: bool = True) -> torch.Tensor:
    """Run T draft rows per batch row through ``model`` (an ``HFTreeModel``) without storing them.

    tokens: (batch, T) int64, the same on every rank; row 0 of each is the root (the last chosen
    token, not yet in the cache); mask: (T, T) tree mask. Positions are each row's length plus the
    row's depth (siblings share one); a sliding-window layer's drafts see the committed keys and
    ancestors their window holds by those positions. Returns (batch, T, vocab) logits, identical on
    every rank; the drafts' keys/values of every layer stay in ``cache._drafts`` for :func:`commit`.

    check: first compare the call across the CP group (``agreement.agree``: one small all-gather of the
    tokens', the mask's and the cache's digests), after this rank's own checks (tokens (batch, T)
    integer ids in the vocabulary, the cache's batch, a tree mask of T rows), so a bad call or ranks
    handed different drafts raise the same error on every rank instead of each rank computing other
    logits; a loop that agreed on its step's drafts already (or broadcast them) passes ``False``.
    """
    binding = model._binding
    if cache.storage is None:
        raise ValueError("TreeCache is empty: run the prompt's prefill before verifying drafts")

    def values():
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point \
                or tokens.dtype == torch.bool or tokens.is_complex():
            raise ValueError(f"tokens must be a (batch, T) integer tensor of token ids, got "
                             f"{tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__}"
                             f"{f' {tokens.dtype}' if isinstance(tokens, torch.Tensor) else ''}")
        nb, nt = tokens.shape
        if nb != cache.batch_size:
            raise ValueError(f"tokens have {nb} batch rows, the cache holds {cache.batch_size}")
        check_draft_tree(mask, nt)
        ids = tokens.detach().cpu()
        vocab = model.vocab_size
        if nt and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
            bad = ids[(ids < 0) | (ids >= vocab)].tolist()
            raise ValueError(f"tokens hold ids outside the model's vocabulary [0, {vocab}): {bad[:5]}")
        return (nb, nt, _tensor_digest(ids.long()), _tensor_digest(mask.detach().cpu()), tuple(cache.lengths))

    groups = model.groups
    if check and groups is not None and groups.size > 1:
        agreement.agree("speculative.verify_forward", VERIFY_FORWARD_SIGNATURE, values, groups.cp_group,
                        groups.cp_ranks, stats=stats, device=model.device)
    else:
        values()
    b, t = tokens.shape
    depths = tree_depths(mask).cpu()  # a CUDA mask too: the positions are built on the host, from host lengths
    pos = torch.tensor(cache.lengths, dtype=torch.long)[:, None] + depths[None, :]
    cache._begin_verify(pos)
    binding.active = cache
    binding.step = _VerifyStep(cache, mask.to(model.device), strategy, stats)
    orig = type(model.hf).forward.__get__(model.hf)
    try:
        out = orig(input_ids=tokens.to(model.device), position_ids=pos.to(model.device),
                   **{binding.cache_kwarg: cache}, use_cache=True, return_dict=True)
        cache._finish()
    finally:
        binding.active = None
        binding.step = None
        cache.metadata = None
    return out.logits


def commit(cache, nodes: torch.Tensor) -> None:
    """Append the chosen draft rows' keys/values (kept by :func:`verify_forward`) to ``cache``.

    nodes: (batch, n) int64, the rows of each batch row to append, in order (the accepted path,
    root first). Each token goes through the cache's ordinary decode step (``begin_decode_step``
    places it, ``append`` stores it where the placement says), every rank alike.
    """
    layers = cache.num_layers
    # checked before the cache is touched: a step placed and then refused would leave a slot that no key was
    # written to, read by every later step
    if sorted(cache._drafts) != list(range(layers)):
        raise ValueError("commit needs the draft rows' keys/values of every layer: run verify_forward first (and "
                         "commit its drafts once)")
    if not isinstance(nodes, torch.Tensor) or nodes.dim() != 2 or nodes.dtype.is_floating_point \
            or nodes.dtype == torch.bool:
        raise ValueError(f"nodes must be a (batch, n) integer tensor of draft rows, got "
                         f"{tuple(nodes.shape) if isinstance(nodes, torch.Tensor) else type(nodes).__name__}"
                         f"{f' {nodes.dtype}' if isinstance(nodes, torch.Tensor) else ''}")
    b, t = cache._drafts[0][0].shape[:2]
    if nodes.shape[0] != b:
        raise ValueError(f"nodes have {nodes.shape[0]} batch rows, the verified drafts {b}")
    if nodes.numel() and not (0 <= int(nodes.min()) and int(nodes.max()) < t):
        raise ValueError(f"nodes must be draft rows in [0, {t}) (the verification had {t} rows), got "
                         f"{sorted(set(nodes.flatten().tolist()))}")
    cache._make_room(nodes.shape[1])  # (a cache of fixed size that cannot take them all refuses before the first)
    for j in range(nodes.shape[1]):
        cache._begin_decode(b)
        idx = nodes[:, j]
        for layer in range(layers):
            dk, dv = cache._drafts[layer]
            at = idx.to(dk.device)[:, None, None, None]
            kj = dk.gather(1, at.expand(-1, 1, *dk.shape[2:]))
            vj = dv.gather(1, at.expand(-1, 1, *dv.shape[2:]))
            cache.storage.append(layer, kj, vj, cache._slots)
        cache._written = set(range(layers))
        cache._finish()
    cache._drafts = {}


# --------------------------------------------------------------------------- the loop


@dataclass
class SpeculativeResult(GenerationResult):
    """What :func:`generate_speculative` returns (the same on every CP rank): ``generate``'s result
    (greedy: ``tokens`` are exactly non-speculative greedy ``generate``'s; sampling: drawn from the
    same distribution; ``step_times`` one per verification step) and the drafting's counts."""

    steps: int = 0
    """Verification steps run (each one decode forward with one merge per layer)."""
    accepted: list[int] = field(default_factory=list)
    """Per step: tokens committed per row (accepted drafts plus the step's own token, >= 1)."""
    drafted: int = 0
    """Draft tokens offered per row, summed over steps (the chain depth of every step)."""

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput over the batch: tokens generated after the first / decode seconds (a step
        commits several per row)."""
        t = self.decode_time
        return (sum(len(row) for row in self.tokens) - len(self.tokens)) / t if t > 0 else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Mean tokens gained per verification step (1: no draft accepted)."""
        return sum(self.accepted) / len(self.accepted) if self.accepted else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over the drafts offered (per step, ``accepted - 1`` of the depth)."""
        return sum(a - 1 for a in self.accepted) / self.drafted if self.drafted else float("nan")


SPECULATIVE_SIGNATURE = ("batch", "prompt_lengths", "prompt_ids", "max_new_tokens", "stop_token_ids", "method",
                         "width", "depth", "max_ngram", "min_ngram", "draft_vocab", "strategy", "do_sample",
                         "temperature", "top_k", "top_p", "seed")


def _build_tree(row_chains: list, width: int, depth: int, fill: int) -> list[int]:
    """One batch row's T - 1 draft tokens in :func:`tree_mask`'s order (missing chains and tokens filled)."""
    toks = []
    for c in range(width):
        chain = list(row_chains[c]) if c < len(row_chains) else []
        chain = chain[:depth] + [fill] * (depth - len(chain[:depth]))
        toks += chain
    return toks


@torch.no_grad()
def generate_speculative(model, prompts: list[list[int]], max_new_tokens: int, *,
                         speculative: SpeculativeConfig | None = None, stop_token_ids=None, cache=None,
                         strategy: str = "auto", stats: CommStats | None = None, progress: bool = True,
                         do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                         top_p: float | None = None, seed: int | None = None) -> SpeculativeResult:
    """Generation with drafts verified in one step each: greedy ``generate``'s tokens, or its sampling distribution.

    model: an ``integrations.hf.HFTreeModel``; prompts, max_new_tokens, stop_token_ids, cache,
    strategy, stats, progress, do_sample, temperature, top_k, top_p, seed: as for
    :func:`decode.generate.generate`. speculative: a :class:`SpeculativeConfig` (default: prompt
    lookup, one chain of 4).

    Each step feeds the last chosen token (the root) and the draft tree's tokens (the same tree
    shape for every row; positions are the row's length plus the depth) and commits ``n`` tokens
    per row: the fewest any unfinished row accepted plus one (rows share the cache's steps; a
    row's later tokens are dropped and drawn again next step, which keeps sampling exact: each
    emitted token follows the target given the tokens before it).

    Greedy: the target's greedy token at the root, then down while a child holds the target's
    greedy token; every rank decides alike. Before each step every CP rank compares the step's
    draft tokens and tree (one small all-gather: ``agreement.agree``).

    Sampling (``do_sample``): CP rank 0 drafts (prompt lookup: point masses; a draft model: tokens
    drawn from its distribution under the same temperature/top-k/top-p), broadcasts the tree's
    tokens, and after the verification forward decides with :func:`speculative_accept` over the
    target distribution of ``sample_next`` (:func:`target_probs`) and broadcasts the decision
    (one small broadcast each), so every rank keeps CP rank 0's tokens. ``seed`` seeds CP rank 0's
    generator: the same seed, the same tokens (at any CP size, up to the last-bit differences of
    the logits between layouts).
    """
    cfg = speculative or SpeculativeConfig()
    if not (hasattr(model, "hf") and hasattr(model, "_binding")):
        raise NotImplementedError(
            f"speculative generation runs on a transformers model (integrations.hf.HFTreeModel), got "
            f"{type(model).__name__}: its decode step must take T draft rows with a tree mask")
    groups = model.groups
    vocab = model.vocab_size
    compiled = getattr(model._binding, "compiled", None)
    if compiled is not None:  # (an explicit compile_step compiles one-token steps; this loop has none)
        compiled.say_eager("speculative generation verifies its drafts in several-token forwards, which run "
                           "eagerly")

    def call_values():
        from .generate import _check_call

        # generate's own checks, a cache handed in included (its batch; room for every prompt plus max_new_tokens)
        _check_call(model, prompts, max_new_tokens, do_sample, temperature, top_k, top_p, None, cache)
        stops = stop_id_set(stop_token_ids, vocab)
        cfg.check(vocab)
        dv = _vocab_of(cfg.draft_model) if cfg.method == "draft_model" else None
        return (len(prompts), tuple(len(p) for p in prompts), tuple(row_digest(p) for p in prompts),
                max_new_tokens, tuple(sorted(stops)), cfg.method, cfg.width, cfg.depth, cfg.max_ngram,
                cfg.min_ngram, dv, strategy, bool(do_sample), float(temperature), top_k,
                None if top_p is None else float(top_p), seed)

    group, ranks = (None, ()) if groups is None else (groups.cp_group, groups.cp_ranks)
    agreement.agree("generate_speculative", SPECULATIVE_SIGNATURE, call_values, group, ranks, device=model.device)
    stops = stop_id_set(stop_token_ids)
    prompts = [list(p) for p in prompts]
    if cache is None:
        cache = model.new_cache(len(prompts), max(len(p) for p in prompts) + max_new_tokens)
    rank0 = groups is None or groups.rank == 0
    shared = groups is not None and groups.size > 1
    generator = torch.Generator(device="cpu")
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()

    def probs(logits):
        return target_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)

    def from_rank0(t: torch.Tensor, what: str) -> torch.Tensor:
        # shapes agree on every rank: batch and T follow from the agreed call (T: the step's depth)
        if shared:
            collectives.broadcast(t, groups.cp_ranks[0], groups.cp_group, what=f"generate_speculative: {what}")
        return t

    from tqdm.auto import tqdm

    bar = tqdm(total=max_new_tokens, desc="generate (speculative)", unit="tok",
               disable=not (progress and rank0))
    result = SpeculativeResult(tokens=[])
    batch = len(prompts)
    draft_caches = DraftCaches(cfg.draft_model, batch) if cfg.method == "draft_model" else None
    try:
        t0 = time.perf_counter()
        logits = model.prefill(prompts, cache)
        if do_sample:  # CP rank 0 draws the first token (as generate does) and broadcasts it
            cur = torch.multinomial(probs(logits), 1, generator=generator)[:, 0] if rank0 else \
                torch.zeros(batch, dtype=torch.long)
            cur = from_rank0(cur, "broadcasting CP rank 0's first token")
        else:
            cur = logits.float().argmax(-1).cpu()  # identical on every rank (the prefill's assembled logits)
        result.prefill_time = time.perf_counter() - t0
        out = [[t] for t in cur.tolist()]
        done = [t in stops for t in cur.tolist()]
        bar.update(1)

        def produced() -> int:  # tokens of the unfinished rows (they advance together)
            return max(len(out[b]) for b in range(len(out)) if not done[b])

        while not all(done) and produced() < max_new_tokens:
            t0 = time.perf_counter()
            remaining = max_new_tokens - produced()
            depth = min(cfg.depth, remaining - 1)
            width = cfg.width if depth >= 1 else 0
            mask = tree_mask(width, depth) if width else torch.ones(1, 1, dtype=torch.bool)
            seqs = [p + o for p, o in zip(prompts, out)]
            q = None
            if not do_sample or rank0:
                if not width:
                    chains = [[] for _ in seqs]
                elif cfg.method == "prompt_lookup":
                    chains = [prompt_lookup_drafts(s, width, depth, cfg.max_ngram, cfg.min_ngram) for s in seqs]
                elif do_sample:
                    drawn, qd = _draft_model_sampled_cached(draft_caches, seqs, width, depth, probs, generator, done)
                    chains = drawn.tolist()
                    q = torch.cat([torch.zeros(batch, 1, qd.shape[-1], dtype=qd.dtype),
                                   qd.reshape(batch, width * depth, -1)], dim=1)
                else:
                    chains = _draft_model_drafts(draft_caches, seqs, width, depth, done)
                tokens = torch.tensor([[s[-1]] + _build_tree(c, width, depth, s[-1]) for s, c in zip(seqs, chains)],
                                      dtype=torch.long)
            else:
                tokens = torch.zeros(batch, mask.shape[0], dtype=torch.long)
            if do_sample:
                tokens = from_rank0(tokens, "broadcasting CP rank 0's draft tree")
            else:
                agreement.agree("generate_speculative.step", ("rows", "drafts", "mask"),
                                lambda: (tokens.shape[1], row_digest(tokens.flatten().tolist()),
                                         _tensor_digest(mask)), group, ranks, device=model.device)
            # (the step's drafts were agreed on above, or broadcast from CP rank 0)
            logits = verify_forward(model, cache, tokens, mask, strategy=strategy, stats=stats, check=False)
            active = [b for b in range(batch) if not done[b]]
            if do_sample:
                t = mask.shape[0]
                decision = torch.zeros(batch, 1 + 2 * t, dtype=torch.long)
                if rank0:
                    paths, emitted = speculative_accept(probs(logits), tokens, mask, q, generator)
                    n = min(len(paths[b]) for b in active)
                    for b in range(batch):
                        path = paths[b][:n] + [paths[b][-1]] * (n - len(paths[b]))  # a finished row: padded
                        new = emitted[b][:n] + [emitted[b][-1]] * (n - len(emitted[b]))
                        decision[b, 0] = n
                        decision[b, 1:1 + n] = torch.tensor(path)
                        decision[b, 1 + t:1 + t + n] = torch.tensor(new)
                decision = from_rank0(decision, "broadcasting CP rank 0's accepted drafts")
                n = int(decision[0, 0])
                nodes = decision[:, 1:1 + n]
                news = decision[:, 1 + t:1 + t + n].tolist()
            else:
                pred = logits.float().argmax(-1).cpu()  # (B, T): the target's greedy token after each row
                paths = []
                for b in range(batch):
                    node, path = 0, [0]
                    while True:
                        kids = [1 + c * depth + _depth_of(node, depth) for c in range(width)
                                if _depth_of(node, depth) < depth and (node == 0 or (node - 1) // depth == c)]
                        nxt = next((k for k in kids if int(tokens[b, k]) == int(pred[b, node])), None)
                        if nxt is None:
                            break
                        node = nxt
                        path.append(node)
                    paths.append(path)
                n = min(len(paths[b]) for b in active)
                nodes = torch.tensor([p[:n] if len(p) >= n else p + [p[-1]] * (n - len(p)) for p in paths])
                news = [[int(tokens[b, k]) for k in nodes[b, 1:].tolist()] + [int(pred[b, int(nodes[b, -1])])]
                        for b in range(batch)]
            commit(cache, nodes)
            for b in range(batch):
                for tok in news[b]:
                    if done[b] or len(out[b]) >= max_new_tokens:
                        break
                    out[b].append(tok)
                    done[b] = tok in stops
            result.steps += 1
            result.accepted.append(n)
            result.drafted += depth
            result.step_times.append(time.perf_counter() - t0)
            bar.update((max_new_tokens if all(done) else produced()) - bar.n)
            bar.set_postfix_str(f"accepted {result.mean_accepted:.2f} tok/step")
    finally:
        bar.close()
    result.tokens = out
    return result


def _depth_of(node: int, depth: int) -> int:
    """Depth of ``node`` in :func:`tree_mask`'s order (the root is 0)."""
    return 0 if node == 0 else (node - 1) % depth + 1
