"""The wrapper of ``model.generate``: refuses what cannot run sharded, sizes the cache for the request,
and keeps the CP ranks' tokens in agreement (rank 0's random state before each draw, a check after
each step). Greedy, sampling, beam search and assisted decoding (``assistant_model``,
``prompt_lookup_num_tokens``: the forward of several tokens and ``TreeCache.crop``) run as transformers
runs them."""

from __future__ import annotations

import torch

from .common import _MARK, _Binding, _comm_device, _generation_settings
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from ...distributed import collectives
from ...distributed.collectives import CommStats
from ...distributed.topology import TreeGroups


class _RankZeroDraws(LogitsProcessor):
    """Before each token is chosen, every CP rank takes CP rank 0's random state.

    The draw transformers makes next (``torch.multinomial`` on the processed scores) then
    gives every rank rank 0's token: logits are bitwise identical across the group (one
    merge result, one all-reduced prefill), so the same state gives the same choice, however
    the ranks were seeded. Scores pass through unchanged. Assisted decoding calls the processors once per
    verified row and transformers hands them to the assistant's ``generate`` too, so its draws (an
    assistant sampling candidates, the speculative acceptance after the rows) are rank 0's as well.
    """

    def __init__(self, groups: TreeGroups, stats: CommStats | None):
        self.groups, self.stats = groups, stats

    def __call__(self, input_ids, scores):
        dev = scores.device
        state = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()
        buf = state.to(_comm_device(self.groups, dev))
        collectives.broadcast(buf, self.groups.cp_ranks[0], self.groups.cp_group, stats=self.stats,
                              what="generate: CP rank 0's random state before a draw")
        if self.groups.rank != 0:
            if dev.type == "cuda":
                torch.cuda.set_rng_state(buf.cpu(), dev)
            else:
                torch.set_rng_state(buf.cpu())
        return scores


class _TokensAgree(StoppingCriteria):
    """After each step, all CP ranks must hold rank 0's sequences; a divergence fails on every rank.

    A step may have appended several tokens (assisted decoding accepts candidates), so each row is
    compared whole: its length, its last token and a position-weighted checksum of all its tokens
    (one all-gather of (batch, 3) int64 per step)."""

    def __init__(self, groups: TreeGroups, stats: CommStats | None):
        self.groups, self.stats = groups, stats
        self.step = 0

    def __call__(self, input_ids, scores, **kwargs):
        ids = input_ids.long()
        weights = torch.arange(1, ids.shape[1] + 1, device=ids.device)
        record = torch.stack([torch.full_like(ids[:, -1], ids.shape[1]), ids[:, -1], ((ids + 1) * weights).sum(dim=1)],
                             dim=1)
        parts = collectives.all_gather(record.to(_comm_device(self.groups, ids.device)), self.groups.cp_group,
                                       stats=self.stats, what="generate: checking the ranks' new tokens")
        self.step += 1
        if any(not torch.equal(p, parts[0]) for p in parts[1:]):
            raise RuntimeError(
                f"CP ranks {list(self.groups.cp_ranks)} chose different tokens at generated step {self.step}: newest "
                f"tokens {[p[:, 1].tolist() for p in parts]}, sequence lengths {[p[:, 0].tolist() for p in parts]}; "
                "their caches would diverge. generate's settings were compared at the prefill, so a custom logits "
                "processor or stopping criterion (or an assistant model) differs between the ranks or is not "
                "deterministic"
            )
        return torch.zeros(ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _new_tokens(model, kwargs, prompt_len: int) -> int | None:
    """How many tokens this ``generate`` call may append (max_new_tokens, else max_length - prompt)."""
    gc = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
    if new is not None:
        return int(new)
    length = kwargs.get("max_length", getattr(gc, "max_length", None))
    return None if length is None else max(int(length) - prompt_len, 0)


def _asked(model, kwargs, name: str):
    """A generation setting as generate will see it: the call's keyword, else its generation_config's,
    else the model's."""
    if kwargs.get(name) is not None:
        return kwargs[name]
    for gc in (kwargs.get("generation_config"), getattr(model, "generation_config", None)):
        if gc is not None and getattr(gc, name, None) is not None:
            return getattr(gc, name)
    return None


def _check_assisted(model, binding: _Binding, kwargs) -> None:
    """Assisted-decoding settings a tree-enabled model cannot run, refused before generate starts (each
    names what to change), rather than from a forward rounds later."""
    early = _asked(model, kwargs, "assistant_early_exit")
    if early is not None:
        raise NotImplementedError(
            f"generate(assistant_early_exit={early}) is not supported with tree attention: transformers drafts "
            "with the target's own first layers on the target's cache, which holds every layer's shard; pass an "
            "assistant_model (a small model run replicated on every rank) or prompt_lookup_num_tokens instead")
    assistant = kwargs.get("assistant_model")
    if assistant is not None and getattr(assistant, _MARK, None) is not None:
        raise ValueError(
            "the assistant_model has tree attention enabled: the assistant runs whole on every rank (it is "
            "small; its cache is cropped and reused every round as transformers does) -- pass it as an "
            "ordinary transformers model (megatron_tree.hf.disable_tree_attention(assistant), or load it "
            "without enabling)")


def _sharded_generate(model, orig, binding: _Binding, args, kwargs):
    for name, why in (("max_time", "ranks would stop at different steps, each by its own clock"),
                      ("prefill_chunk_size", "the prompt is chunked by enable_tree_attention(max_prefill_tokens=...)")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"generate({name}=...) is not supported with tree attention: {why}")
    _check_assisted(model, binding, kwargs)
    inputs = args[0] if args else kwargs.get("inputs", kwargs.get("input_ids"))
    prompt_len = int(inputs.shape[1]) if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 else 0
    if binding.groups is not None and binding.groups.size > 1:
        lp = LogitsProcessorList(list(kwargs.pop("logits_processor", None) or []))
        lp.append(_RankZeroDraws(binding.groups, binding.stats))
        sc = StoppingCriteriaList(list(kwargs.pop("stopping_criteria", None) or []))
        sc.append(_TokensAgree(binding.groups, binding.stats))
        kwargs.update(logits_processor=lp, stopping_criteria=sc)
    binding.new_tokens_hint = _new_tokens(model, kwargs, prompt_len)
    binding.settings_hint = _generation_settings(model, kwargs)
    try:
        return orig(*args, **kwargs)
    finally:
        binding.new_tokens_hint = None
        binding.settings_hint = None
