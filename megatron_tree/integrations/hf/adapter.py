"""The decode loop's model protocol over a transformers model (:class:`HFTreeModel`, what the eval
and ``decode.generate`` drive) and :func:`load_hf_model`."""

from __future__ import annotations

import torch

from .common import _MARK, _Binding, _text_config
from .cache import TreeCache
from .enable import enable_tree_attention
from .forward import compiled_for

from ...distributed.collectives import CommStats
from ...decode.generate import DecodeStep
from ...distributed.topology import TreeGroups


class HFTreeModel:
    """A transformers model behind the library's decode-loop protocol (``generate.generate``, the eval).

    ``new_cache(batch, max_len)``, ``prefill(prompts, cache)`` -> (batch, vocab) logits of each
    prompt's last token, ``decode_step(ids, cache)`` -> (batch, vocab) logits of the next
    token, identical on every CP rank; ``groups``, ``device``, ``dtype``, ``config``
    (``vocab_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``).
    ``hf`` is the enabled transformers model (``hf.generate`` works too); :meth:`unsharded`
    gives a one-process replica sharing its weights, for reference logits.
    """

    def __init__(self, hf_model, groups: TreeGroups | None, **enable_kwargs):
        self.hf = enable_tree_attention(hf_model, groups, **enable_kwargs)
        self.groups = groups
        self._binding: _Binding = getattr(self.hf, _MARK)
        cfg = _text_config(self.hf.config)
        self.config = cfg
        if getattr(cfg, "head_dim", None) is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        if getattr(cfg, "num_key_value_heads", None) is None:
            cfg.num_key_value_heads = cfg.num_attention_heads

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    def new_cache(self, batch_size: int, max_seq_len: int, layout: str | None = None,
                  block_size: int | None = None) -> TreeCache:
        """An empty cache for ``batch_size`` rows of up to ``max_seq_len`` tokens (1/CP of them per rank); static
        (fixed shapes) when the decode steps run compiled: ``compile_step``, or a user's
        ``model.hf.forward = torch.compile(model.hf.forward, ...)``; a static cache's storage is the one the
        model's last cache of that shape left (the model's ``decode.cache.StoragePool``), once that cache ended."""
        user = hasattr(self.hf.__dict__.get("forward"), "_torchdynamo_orig_callable")  # (torch.compile's wrapper)
        return TreeCache(self.hf, self.groups, max_seq_len=max_seq_len, batch_size=batch_size,
                         layout=layout or self._binding.layout, block_size=block_size or self._binding.block_size,
                         static=compiled_for(self._binding, self.device) is not None or user,
                         pool=self._binding.pool)

    def step_batch(self, batch: int, max_seq_len: int | None = None) -> int:
        """The batch ``generate`` runs ``batch`` prompts at, in a cache of ``max_seq_len`` tokens per row:
        ``batch`` when decode steps run eagerly; with ``compile_step``, the compiled steps' batch for it
        (``forward.CompiledSteps.batch_for``: a bucket, or a batch already compiled for a cache of that
        length bucket), the shortest prompt repeated in the extra rows."""
        compiled = compiled_for(self._binding, self.device)
        return batch if compiled is None else compiled.batch_for(batch, max_seq_len)

    def _with(self, **over):
        b = self._binding
        saved = {k: getattr(b, k) for k in over}
        for k, v in over.items():
            if v is not None:
                setattr(b, k, v)
        return saved

    def unsharded(self):
        """A plain transformers replica for reference logits, sharing this model's weight tensors (no copy).

        It runs the attention implementation the model had before tree attention, in one process:
        ``ref(input_ids).logits`` is the unsharded forward the eval compares against.
        """
        return unsharded_replica(self.hf)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: TreeCache, method: str | None = None,
                stats: CommStats | None = None) -> torch.Tensor:
        """Left-pad ``prompts`` and run them through the sharded forward; returns (batch, vocab) logits."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        if cache.get_seq_length() != 0:
            cache.reset()
        seq = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), seq, dtype=torch.long)
        mask = torch.zeros(len(prompts), seq, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, seq - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            mask[b, seq - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        saved = self._with(prefill=method, stats=stats)
        try:
            out = self.hf(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                          position_ids=pos.to(self.device), **{self._binding.cache_kwarg: cache}, logits_to_keep=1)
        finally:
            self._with(**saved)
        return out.logits[:, -1]

    @torch.no_grad()
    def decode_step(self, next_ids, cache: TreeCache, step: DecodeStep | None = None, *, strategy: str | None = None,
                    stats: CommStats | None = None) -> torch.Tensor:
        """Append one token per row (the same on every rank); returns (batch, vocab) logits.

        step: the loop's ``decode.generate.DecodeStep``: every layer's attention runs its ``attend``
        (``generate``'s ``shifted`` redo rewinds the cache and calls this again); without one, a
        plain step of ``strategy``/``stats`` (default: the model's own).
        """
        b = self._binding
        if step is None:
            step = DecodeStep(strategy or b.strategy, stats if stats is not None else b.stats)
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=self.device).reshape(-1, 1)
        # The new tokens' positions are the rows' lengths, host bookkeeping; on CUDA they reach the
        # device in a non-blocking copy from pinned memory (a pageable copy would make the host wait).
        cuda = self.device.type == "cuda"
        host = torch.tensor(cache.lengths, dtype=torch.long, pin_memory=cuda)
        pos = host.to(self.device, non_blocking=cuda)[:, None]
        b.step = step
        try:
            out = self.hf(input_ids=ids, position_ids=pos, **{b.cache_kwarg: cache})
        finally:
            b.step = None
        return out.logits[:, -1]

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)


def unsharded_replica(hf_model):
    """A plain transformers replica of a tree-enabled ``hf_model`` sharing its weight tensors (no copy): the
    attention implementation it had before tree attention, transformers' own caches, one process (what
    :meth:`HFTreeModel.unsharded` returns; ``_Binding.plain_replica``). A model that is not tree-enabled is
    returned as it is."""
    binding = getattr(hf_model, _MARK, None)
    return hf_model if binding is None else binding.plain_replica(hf_model)


def load_hf_model(path, groups: TreeGroups | None, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", **enable_kwargs) -> HFTreeModel:
    """Load a Hugging Face causal-LM checkpoint with transformers and enable tree attention on it.

    path: a directory with ``config.json`` and safetensors weights (any architecture
        transformers knows whose attention goes through its AttentionInterface)
    enable_kwargs: ``strategy``, ``prefill``, ``layout``, ``block_size``, ``stats``, ``work`` of
        :func:`enable_tree_attention`
    Every CP rank loads the full weights. Returns an :class:`HFTreeModel` (``.hf`` is the
    transformers model, in eval mode).

    The directory is checked first (:func:`.checkpoint.check_checkpoint`: config.json, the
    safetensors headers, the tensors against the model's), on every rank of ``groups`` alike:
    a missing, unexpected or misshapen tensor, a truncated file or a bad config.json is a
    :class:`~.checkpoint.CheckpointError` on every rank, naming it, before a tensor is read.
    """
    from .checkpoint import load_checked

    group, ranks = (None, ()) if groups is None else (groups.cp_group, groups.cp_ranks)
    model, _ = load_checked(path, dtype, group, ranks, site="load_hf_model")
    return HFTreeModel(model.to(device).eval(), groups, **enable_kwargs)
