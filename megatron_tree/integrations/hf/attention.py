"""The attention function registered with transformers' ``AttentionInterface``: CP prefill over the
prompt chunks, ``tree_decode`` (through the decode loop's step) over the rank's KV shard."""

from __future__ import annotations

from .common import _MARK, ATTN_IMPLEMENTATION, UnsupportedModelError
from transformers import AttentionInterface

from ...decode.generate import DecodeStep
from ...decode.prefill import cp_prefill

_REFUSED_ATTENTION_KWARGS = ("sliding_window", "softcap", "s_aux", "attention_chunk_size")


def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract, computed across the CP group.

    query: (batch, nheads_q, q_len, head_dim); key, value: what :meth:`TreeCache.update`
    returned; attention_mask: ignored (padding and causality come from the cache's global
    positions: transformers builds no mask for this implementation).
    returns (attn_output (batch, q_len, nheads_q, head_dim), None)
    """
    binding = getattr(module, _MARK, None)
    if binding is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but was not prepared by "
            "megatron_tree.integrations.hf.enable_tree_attention"
        )
    cache = binding.active
    if cache is None or cache._phase is None:
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
    q = query.transpose(1, 2)  # (b, q_len, hq, d)
    k, v = key.transpose(1, 2), value.transpose(1, 2)
    if cache._phase == "prefill":
        qpos, kpos = cache._q_positions.to(q.device), cache._k_positions.to(q.device)
        out = cp_prefill(q, k, v, qpos, kpos, binding.groups, method=binding.prefill, softmax_scale=scaling,
                         stats=binding.stats, work=binding.work)
    else:  # the one attention call of every integration: the decode loop's step (or a plain one)
        step = binding.step if binding.step is not None else DecodeStep(binding.strategy, binding.stats)
        out = step.attend(module.layer_idx, q, k, v, binding.groups, cache_seqlens=cache.storage.seqlens,
                          softmax_scale=scaling)
    return out, None


AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
