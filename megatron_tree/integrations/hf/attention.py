"""The attention function registered with transformers' ``AttentionInterface``: CP prefill over the
prompt chunks, ``tree_decode`` (through the decode loop's step) over the rank's KV shard."""

from __future__ import annotations

import torch

from .common import _MARK, ATTN_IMPLEMENTATION, UnsupportedModelError
from transformers import AttentionInterface

from ...decode.generate import DecodeStep
from ...decode.prefill import cp_prefill

_REFUSED_ATTENTION_KWARGS = ("attention_chunk_size",)


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract, computed across the CP group.

    query: (batch, nheads_q, q_len, head_dim); key, value: what :meth:`TreeCache.update`
    returned (or what the module made of it: MLA expands its latent into (batch, nheads, n,
    head_dim) keys and (batch, nheads, n, head_dim_v) values); attention_mask: ignored (padding,
    causality and sliding windows come from the cache's global positions).
    kwargs the module passes: ``sliding_window`` (checked against the layer's window, which comes
    from the config as transformers' masks apply it), ``softcap`` (score soft-capping), ``s_aux``
    (attention sinks: (nheads_q,) logits joining the softmax once, after the CP merge).
    returns (attn_output (batch, q_len, nheads_q, head_dim_v), None)
    """
    binding = getattr(module, _MARK, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but was not prepared by "
            "megatron_tree.integrations.hf.enable_tree_attention; enable_tree_attention sets the implementation on "
            "the model's config, so a second model built from the same config object runs it too: build other "
            "models from a copy of the config (copy.deepcopy(config))"
        )
    cache = binding.active
    meta = None if cache is None else cache.metadata  # the forward's metadata, built once by the cache
    if meta is None:
        raise RuntimeError(
            f"{ATTN_IMPLEMENTATION!r} attention ran outside the sharded forward enable_tree_attention installed "
            "(was model.forward replaced after enabling?)"
        )
    for name in _REFUSED_ATTENTION_KWARGS:
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(
                f"{type(module).__name__} asks for {name}={kwargs[name]!r}; tree attention computes full causal "
                "softmax attention only"
            )
    if dropout:
        raise UnsupportedModelError(f"attention dropout {dropout} (training mode?) is not supported; call model.eval()")
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{type(module).__name__} is not causal; tree attention is causal decoding")
    window = binding.windows[module.layer_idx]
    asked = kwargs.get("sliding_window")
    if asked is not None and asked != window:
        raise UnsupportedModelError(
            f"{type(module).__name__} (layer {module.layer_idx}) asks for sliding_window={asked!r}, but the "
            f"config makes this layer's mask {'full causal' if window is None else f'a window of {window}'} "
            "(config.layer_types / config.sliding_window); tree attention follows the mask and refuses the mismatch"
        )
    variants = dict(window=window, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
    q = query.transpose(1, 2)  # (b, q_len, hq, d)
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    q, k, v = _autocast(q, k, v)
    if meta.mode == "prefill":
        qpos, kpos = meta.q_positions.to(q.device), meta.k_positions.to(q.device)
        out = cp_prefill(q, k, v, qpos, kpos, binding.groups, method=binding.prefill, softmax_scale=scaling,
                         stats=binding.stats, work=binding.work, **variants)
    else:  # the one attention call of every integration: the decode loop's step (or a plain one)
        if k.dtype != q.dtype:  # k, v: the cache's storage (autocast cast them to q's dtype, when on)
            raise TypeError(
                f"the TreeCache stores {cache.dtype} keys and values (its dtype), but layer {module.layer_idx} "
                f"computes in {q.dtype}: a decode step attends over the stored keys with the layer's query, which "
                f"must share one dtype; make the cache with dtype={q.dtype} or without a dtype (a cache made from "
                "the model takes its parameters', one made from a config the layers' own)")
        step = binding.step if binding.step is not None else DecodeStep(binding.strategy, binding.stats)
        if meta.mode == "verify":  # speculative drafts: the committed shard as it stands (no new token)
            variants["cache_seqlens"] = cache.storage.seqlens
            if cache._expands:  # (MLA) the drafts' expanded keys/values follow the shard's: split them off
                t = q.shape[1]
                variants["drafts"] = (k[:, -t:], v[:, -t:])
                k, v = k[:, :-t], v[:, :-t]
            else:  # the drafts' keys/values as the layer made them (kept aside by the cache), cast as k and v are
                variants["drafts"] = _autocast(q, *cache._drafts[module.layer_idx])[1:]
            if window is not None:  # the drafts' positions (VerifyMetadata) and the shard's, valid up to
                # storage.seqlens: the drafts are kept aside, so the stored slots are the committed keys
                variants["q_positions"] = meta.q_positions.to(q.device)
                variants["k_positions"] = cache.storage.positions[:, :k.shape[1]].to(q.device)
        else:  # the step's metadata, built once by the cache for every layer (decode.metadata.StepMetadata)
            variants.update(meta.attention_args(window))
        out = step.attend(module.layer_idx, q, k, v, binding.groups, softmax_scale=scaling, **variants)
    return out, None


def _autocast(q, k, v):
    """q, k, v as the attention they replace sees them under ``torch.autocast``: transformers' ``sdpa`` (and its
    ``eager`` matmuls) run in the autocast dtype there, so an fp32 model under ``autocast(dtype=bfloat16)`` hands
    over an fp32 q and k (rotary embeddings compute in fp32) with a bf16 v, and a decode step's fp32 cached keys
    with a bf16 query. Autocast casts every fp16/bf16/fp32 input of ``scaled_dot_product_attention`` to its dtype
    (float64 is left alone); so does this, so the model's tokens are transformers' own under autocast too."""
    kind = q.device.type
    if not torch.is_autocast_enabled(kind):
        return q, k, v
    dtype = torch.get_autocast_dtype(kind)
    cast = lambda t: t.to(dtype) if t.dtype in _AUTOCAST_ELIGIBLE and t.dtype != dtype else t  # noqa: E731
    return cast(q), cast(k), cast(v)


_AUTOCAST_ELIGIBLE = (torch.float16, torch.bfloat16, torch.float32)


AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
