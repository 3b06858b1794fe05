"""Tree attention in Megatron-Core's two attention slots: ``core_attention`` and ``self_attention.module``.

Invariant: Megatron's tensors cross this boundary in Megatron's layout (``[s, b, h, d]``)
and ours in flash-attention's (``(b, s, h, d)``); every attention computed here is exact
attention over the whole sequence, whatever the context-parallel (CP) size, computed by
``ops.flash_decode`` on local shards and ``comm.merge`` (through ``tree_decode``) across
them. Megatron's installed source and its imported functions are never changed: tree
attention enters through two ``ModuleSpec`` slots of the transformer layer.

* :class:`TreeDotProductAttention` fills ``self_attention.submodules.core_attention``.
* :class:`TreeSelfAttention` fills ``self_attention.module``: a ``SelfAttention`` subclass
  that overrides the two methods Megatron has no slot for, ``_adjust_key_value_for_inference``
  (the inference KV-cache update) and ``flash_decode_and_prefill`` (the dynamic engine's
  attention), deferring both to the core attention. Where the core attention declines
  (``None``: Megatron's own context at CP = 1), Megatron's own method runs unchanged; training
  forwards are Megatron's code.

:func:`use_tree_attention` fills both slots of a spec (idempotent, marked, reversible through
``__wrapped__``, version-gated, logged); :func:`get_gpt_layer_tree_spec` builds one.

Why it lives here: the core attention asks the inference context to store keys
(``store_key_value``) and, for a dynamic batch, to attend over them (``attend``), so this module
never imports the static or the dynamic context; both import it.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...distributed import collectives
from ...ops import dispatch as ops, reference
from ...comm.merge import STRATEGIES
from ...decode.generate import DecodeStep
from ...decode.prefill import PrefillWork, ring_prefill
from ...distributed.topology import TopologyError, TreeGroups
from .groups import load_balanced_positions, tree_groups_from_megatron
from .version import check_megatron_version, inference_mode_active, megatron_api, refuse_unsupported_features

__all__ = [
    "MARKER", "SLOT_MARKER", "NEVER", "CorePlan", "PagedLayer", "gather_seq", "TreeDotProductAttention",
    "TreeSelfAttention", "use_tree_attention", "restore_core_attention", "get_gpt_layer_tree_spec", "check_tree_slots",
    "check_context_groups", "megatron_attention_fingerprint",
]

log = logging.getLogger("megatron_tree.integrations")

MARKER = "megatron_tree.TreeDotProductAttention"
"""``_megatron_tree`` of the ``core_attention`` slot when it holds ours."""
SLOT_MARKER = "megatron_tree.TreeSelfAttention"
"""``_megatron_tree`` of :class:`TreeSelfAttention` (the ``self_attention.module`` slot)."""

# --------------------------------------------------------------------------- core attention


NEVER = 2**62
"""Key position of padding: later than every query, so the causal mask never shows it."""


def gather_seq(t: torch.Tensor, groups: TreeGroups, site: str) -> torch.Tensor:
    """All-gather ``t`` ([s, ...], equal shape on every rank) over the CP group; concatenated along dim 0.

    site names the call for the CP group's agreement check: ranks whose shapes or dtypes
    differ get a ``DisagreementError`` naming each rank's, not a gloo abort.
    """
    if groups.size == 1:
        return t
    with groups.agreement.call(site, ("shape", "dtype"), (tuple(t.shape), t.dtype)):
        parts = collectives.all_gather(t, groups.cp_group, what=f"Megatron integration: {site}")
    return torch.cat(parts.unbind(0), dim=0)


# --------------------------------------------------------------------------- core attention


class _GatherSeq(torch.autograd.Function):
    """:func:`gather_seq` with a backward: each rank's gradient of its chunk is the sum over the CP
    group of every rank's gradient of that chunk of the gathered tensor (one all-reduce, then a slice)."""

    @staticmethod
    def forward(ctx, t, groups, site):
        ctx.groups, ctx.site, ctx.rows = groups, site, t.shape[0]
        return gather_seq(t, groups, site)

    @staticmethod
    def backward(ctx, grad):
        grad = collectives.all_reduce(grad.contiguous(), ctx.groups.cp_group,
                                      what=f"Megatron integration: {ctx.site} (backward)")
        r = ctx.groups.rank
        return grad[r * ctx.rows:(r + 1) * ctx.rows], None, None


@dataclass(frozen=True, eq=False)
class CorePlan:
    """One static-batching forward's attention metadata, built once per step by the context.

    A context's ``store_key_value`` returns it as the ``attn_mask_type`` of Megatron's tuple:
    ``SelfAttention.forward`` passes that value unread to the core attention's ``forward``
    (static batching), so the metadata travels with the call, not through module state. It *is*
    the mask of that call: a causal mask by global positions, with padding and lengths.
    """

    mode: str
    """``"prefill"`` (this rank's queries and keys, for the ring) or ``"decode"`` (replicated queries, local shard)."""
    q_positions: torch.Tensor
    """(batch, seqlen_q) global positions of the queries; -1 marks padding (it sees no key)."""
    k_positions: torch.Tensor
    """(batch, seqlen_k) global positions of the keys handed to the core attention; padding
    is never visible (a position past every query, or a slot beyond ``k_lengths``)."""
    k_lengths: torch.Tensor | None = None
    """decode: (batch,) int32 valid keys of each row in this rank's shard."""
    attend: object | None = None
    """decode: the decode loop's ``DecodeStep`` (``generate``'s, through ``MegatronLM.decode_step``);
    ``None``: a plain step of the core attention's ``strategy``/``comm_stats``."""


@dataclass(frozen=True, eq=False)
class PagedLayer:
    """A dynamic-batching forward's handle on one layer's stored keys, built by the context's KV-cache hook.

    Returned as the ``block_table`` of Megatron's tuple: ``SelfAttention.forward`` passes that value
    unread to ``flash_decode_and_prefill`` (which :class:`TreeSelfAttention` fills), so the step's
    metadata (``context.step``: positions, lengths, the block table) reaches the attention with the call.
    """

    context: object
    """The ``TreeDynamicInferenceContext`` that stored the keys (asked to ``attend``; never imported here)."""
    layer: int
    """The layer's index in the context's KV cache."""
    block_table: torch.Tensor
    """(padded_tokens, width) int32: this rank's blocks of each packed token row's request (the step's)."""


def _megatron_module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class TreeDotProductAttention(_megatron_module_base()):
    """Exact attention for Megatron's ``core_attention`` slot, at any context-parallel size.

    Takes the keyword arguments Megatron's ``Attention`` passes (config, layer_number,
    attn_mask_type, attention_type, cp_comm_type, softmax_scale, pg_collection) plus
    ``strategy``/``backend`` for the merge (set through :func:`use_tree_attention`).

    forward(query [sq, b, hq, d], key/value [sk, b, hkv, d], attention_mask, ...) -> [sq, b, hq*d]

    * inside :class:`TreeInferenceContext` decoding: ``tree_decode`` of the replicated
      query over this rank's KV shard, merged over the (hierarchical) CP groups;
    * inside its prefill: this rank's 2·CP chunks (queries and keys), exact causal attention over
      every rank's keys by ``decode.prefill.ring_prefill`` (KV blocks round the CP ring, masked
      blocks skipped; counted in ``prefill_work``/``prefill_stats`` when set);
    * otherwise (training layout, no inference context): at CP > 1 the local chunks'
      keys/values are all-gathered and the mask follows global positions; at CP = 1 this is
      plain causal (or unmasked) attention. With gradients enabled the gather has a backward
      (an all-reduce of the gathered gradient) and the attention is the pure-torch
      ``reference.partial_attention``, so a model trains at CP > 1 with the same module that
      then decodes (no second model for rollouts); it is a reference-speed path, not a
      training kernel.
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        *,
        strategy: str = "auto",
        backend: str | None = None,
    ):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        check_megatron_version("TreeDotProductAttention")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
        refuse_unsupported_features(config)  # every rank builds the same config: every rank refuses alike
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "hcp"])
        self.pg_collection = pg_collection
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.strategy = strategy
        self.backend = backend
        self._mask_types = AttnMaskType
        tp = dist.get_world_size(pg_collection.tp) if getattr(pg_collection, "tp", None) is not None else 1
        self.heads_per_partition = config.num_attention_heads // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout

        cp = getattr(pg_collection, "cp", None)
        cp_size = dist.get_world_size(cp) if cp is not None else 1
        if cp_size != config.context_parallel_size:
            raise TopologyError(
                f"config.context_parallel_size={config.context_parallel_size} but the CP process group has "
                f"{cp_size} ranks; they must agree"
            )
        hier = getattr(config, "hierarchical_context_parallel_sizes", None)
        if hier and math.prod(hier) != cp_size:
            raise TopologyError(
                f"config.hierarchical_context_parallel_sizes={list(hier)} multiply to {math.prod(hier)}, "
                f"expected the CP size {cp_size}"
            )
        self.cp_size = cp_size
        self._groups: TreeGroups | None = None
        self.comm_stats = None
        """A :class:`~megatron_tree.comm.CommStats` to record decode merges into (``None``: not recorded)."""
        self.prefill_stats = None
        """A :class:`~megatron_tree.comm.CommStats` the inference prefill's ring records its messages into."""
        self.prefill_work: PrefillWork | None = None
        """A :class:`~megatron_tree.decode.prefill.PrefillWork` the inference prefill's ring adds its counts to."""
        self.replicated_in_inference = False
        """Set by :class:`~.dynamic.TreeDynamicGPTInferenceWrapper` on the core attention of a model's MTP
        layers: while Megatron's ``InferenceMode`` is on, a forward with no inference context here is
        0.19's serial MTP draft step (``compute_mtp_single_step``), whose input is the same on every
        CP rank, so it is attended locally exactly as at CP = 1 (no gather, no CP layout)."""

    @property
    def groups(self) -> TreeGroups:
        """The CP group and its levels (built on first use from ``pg_collection``)."""
        if self._groups is None:
            self._groups = tree_groups_from_megatron(self.pg_collection)
        return self._groups

    # -- the inference KV-cache hook (called by TreeSelfAttention) ----------------------------

    def adjust_key_value_for_inference(
        self, attention, inference_context, query, key, value, rotary_pos_emb, *rest, **kwargs
    ):
        """Ask the context to store this step's keys/values; return what the core attention then needs.

        query: [sq, b, hq, d]; key, value: [sq, b, hkv, d] (static) or [T, 1, h, d] (dynamic, packed)
        for the tokens of this forward on this rank. A context of ours stores them
        (``store_key_value``: the static context's shard, the dynamic context's pages) and returns
        Megatron's tuple ``(query, key, value, rotary_pos_emb, attn_mask_type, block_table)`` with
        RoPE applied at global positions. Returns ``None`` (let Megatron do it) only for Megatron's
        own contexts at CP = 1; at CP > 1 they are refused. The contexts are never imported here:
        the context is asked.
        """
        ctx = inference_context
        store = getattr(ctx, "store_key_value", None)  # TreeInferenceContext's and TreeDynamicInferenceContext's
        if store is not None:
            return store(self, attention, query, key, value, rotary_pos_emb)
        dynamic = ctx is not None and ctx.is_dynamic_batching()
        if self.cp_size == 1 and ctx is not None:
            return None  # Megatron's own context at CP = 1: Megatron's code stores the keys
        if dynamic:
            raise RuntimeError(
                f"TreeDotProductAttention at context_parallel_size={self.cp_size} needs a TreeDynamicInferenceContext "
                f"for dynamic batching (got {type(ctx).__name__}); Megatron's DynamicInferenceContext keeps every "
                "request's whole KV cache on every rank"
            )
        raise RuntimeError(
            f"TreeDotProductAttention at context_parallel_size={self.cp_size} needs a "
            f"TreeInferenceContext (got {type(ctx).__name__}); Megatron's own contexts keep the full "
            "sequence on every rank"
        )

    def dynamic_attention(self, attention, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                          seqlens_k, block_table, is_decode_only):
        """Attention of a dynamic (packed, paged) batch, called by :class:`TreeSelfAttention` with the
        arguments of Megatron's ``flash_decode_and_prefill``: q [T, 1, hq, d] -> [T, 1, hq, d].

        ``block_table`` is what the KV-cache hook returned in that slot of Megatron's tuple: a
        :class:`PagedLayer` when a tree context stored this layer's keys (its context attends over
        them), else Megatron's own block table (CP = 1 with Megatron's context): ``None``, decline.
        """
        if not isinstance(block_table, PagedLayer):
            return None
        return block_table.context.attend(self, q, block_table.layer, block_table.block_table)

    # -- forward --------------------------------------------------------------------------

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query: [sq, b, hq, d]; key, value: [sk, b, hkv, d] -> context [sq, b, hq*d].

        attn_mask_type: Megatron's ``AttnMaskType`` (training, Megatron's own contexts), or the
        :class:`CorePlan` a tree context's KV-cache hook returned for this inference forward.
        """
        if packed_seq_params is not None:
            raise NotImplementedError("packed (THD) sequences are not supported by TreeDotProductAttention")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by TreeDotProductAttention")
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError("attention dropout is not supported by TreeDotProductAttention")
        # A context of ours hands this call's metadata over in Megatron's attn_mask_type slot (CorePlan).
        plan = attn_mask_type if isinstance(attn_mask_type, CorePlan) else None
        q = query.transpose(0, 1)
        k = key.transpose(0, 1)
        v = value.transpose(0, 1)
        b, sq = q.shape[0], q.shape[1]
        if plan is not None and plan.mode == "decode":
            step = plan.attend if plan.attend is not None else DecodeStep(self.strategy, self.comm_stats)
            out = step.attend(self.layer_number, q, k, v, self.groups, cache_seqlens=plan.k_lengths.to(q.device),
                              softmax_scale=self.softmax_scale, q_positions=plan.q_positions.to(q.device),
                              k_positions=plan.k_positions.to(q.device), backend=self.backend)
        elif plan is not None:  # prefill: this rank's chunks, KV round the CP ring (the one prefill)
            out = ring_prefill(q, k, v, plan.q_positions.to(q.device), plan.k_positions.to(q.device),
                               self.groups, softmax_scale=self.softmax_scale, backend=self.backend,
                               stats=self.prefill_stats, work=self.prefill_work)
        else:
            replicated = self.cp_size == 1 or (self.replicated_in_inference and inference_mode_active())
            qpos, kpos = self._training_positions(q, k, attn_mask_type, replicated)
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if not replicated:  # the training layout at CP > 1: this rank's chunks, every rank's keys
                if kpos is None:
                    raise NotImplementedError("unmasked attention at CP > 1 outside inference is not supported")
                gather = _GatherSeq.apply if grad else gather_seq
                k = gather(key, self.groups, "training-layout keys/values").transpose(0, 1)
                v = gather(value, self.groups, "training-layout keys/values").transpose(0, 1)
            if grad:  # training: the pure-torch partial attention, which autograd differentiates
                if qpos is not None and qpos.dim() == 1:
                    qpos = qpos[None, :].expand(b, sq)
                out, _ = reference.partial_attention(
                    q, k, v, softmax_scale=self.softmax_scale,
                    q_positions=None if qpos is None else qpos.to(q.device),
                    k_positions=None if kpos is None else kpos.to(q.device))
                return out.transpose(0, 1).reshape(sq, b, -1)
            if qpos is not None and qpos.dim() == 1:
                qpos = qpos[None, :].expand(b, sq)
            out, _ = ops.flash_decode(
                q, k, v, softmax_scale=self.softmax_scale,
                q_positions=None if qpos is None else qpos.to(q.device),
                k_positions=None if kpos is None else kpos.to(q.device),
                backend=self.backend,
            )
        return out.transpose(0, 1).reshape(sq, b, -1)

    def _training_positions(self, q, k, attn_mask_type, replicated: bool):
        """(query, key) positions of the causal mask, ``(None, None)`` unmasked. replicated: the whole
        sequence is on this rank (CP = 1, or a serial MTP step), else this rank's 2 of 2·CP chunks."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type == self._mask_types.no_mask:
            return None, None
        if mask_type != self._mask_types.causal:
            raise NotImplementedError(
                f"attn_mask_type={mask_type} is not supported; TreeDotProductAttention derives the causal "
                "mask from global positions (causal or no_mask)"
            )
        sq, sk = q.shape[1], k.shape[1]
        if replicated:
            return torch.arange(sk - sq, sk), torch.arange(sk)
        if sq != sk:
            raise NotImplementedError("at CP > 1 the training layout needs equal query and key lengths")
        total = sq * self.cp_size
        qpos = load_balanced_positions(total, self.cp_size, self.groups.rank)
        kpos = torch.cat([load_balanced_positions(total, self.cp_size, r) for r in range(self.cp_size)])
        return qpos, kpos


# --------------------------------------------------------------------------- the self-attention module slot


def _self_attention_base():
    from megatron.core.transformer.attention import SelfAttention

    return SelfAttention


class TreeSelfAttention(_self_attention_base()):
    """``SelfAttention`` whose inference KV-cache update and dynamic attention defer to the core attention.

    Filled into ``ModuleSpec.module`` of the layer's ``self_attention`` by :func:`use_tree_attention`;
    constructed by Megatron with ``SelfAttention``'s own arguments. Training forwards, and inference
    with a core attention that has no hooks or declines (``None``), run Megatron's code unchanged.
    """

    _megatron_tree = SLOT_MARKER

    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                                        sequence_len_offset=None, *, inference_params=None):
        """Megatron's tuple ``(query, key, value, rotary_pos_emb, attn_mask_type, block_table)``.

        query: [sq, b, hq, d]; key, value: [sq, b, hkv, d] (static) or [T, 1, h, d] (dynamic, packed).
        """
        ctx = inference_context if inference_context is not None else inference_params
        hook = getattr(self.core_attention, "adjust_key_value_for_inference", None)
        if hook is not None and ctx is not None:
            result = hook(self, ctx, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                          rotary_pos_cos_sin, sequence_len_offset)
            if result is not None:
                return result
        return super()._adjust_key_value_for_inference(
            inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
            rotary_pos_cos_sin, sequence_len_offset, inference_params=inference_params,
        )

    def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                                 block_table, is_decode_only, softmax_offset=None):
        """Attention of a dynamic (packed, paged) batch: q [T, 1, hq, d] -> [T, 1, hq, d].

        softmax_offset: 0.19's per-head sink logit; refused (``NotImplementedError``) when given,
        because a sink must join the softmax once over the whole CP group, not once per rank.
        """
        if softmax_offset is not None:
            raise NotImplementedError(
                "sink / off-by-one softmax (softmax_offset) is not supported by tree attention yet; "
                "expected softmax_type='vanilla'"
            )
        hook = getattr(self.core_attention, "dynamic_attention", None)
        if hook is not None:
            result = hook(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                          block_table, is_decode_only)
            if result is not None:
                return result
        args = (q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k, block_table, is_decode_only)
        if megatron_api().softmax_offset:
            return super().flash_decode_and_prefill(*args, softmax_offset=softmax_offset)
        return super().flash_decode_and_prefill(*args)


# --------------------------------------------------------------------------- spec swap


def _self_attention_submodules(layer_spec):
    subs = getattr(layer_spec, "submodules", None)
    attn = getattr(subs, "self_attention", None)
    attn_subs = getattr(attn, "submodules", None)
    if attn_subs is None or not hasattr(attn_subs, "core_attention"):
        raise TypeError(
            f"expected a transformer-layer ModuleSpec with submodules.self_attention.submodules.core_attention, "
            f"got {type(layer_spec).__name__}"
        )
    return attn_subs


def _layer_specs(spec):
    layers = getattr(getattr(spec, "submodules", None), "layer_specs", None)
    return list(layers) if layers is not None else [spec]


def _self_attention_spec(layer_spec):
    return layer_spec.submodules.self_attention


def use_tree_attention(spec, *, strategy: str = "auto", backend: str | None = None):
    """Fill both attention slots of ``spec`` with tree attention, in place; applies no patch.

    spec: a transformer-layer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec()``) or a
        block spec with ``submodules.layer_specs``. ``self_attention.submodules.core_attention``
        gets :class:`TreeDotProductAttention` (``strategy``/``backend`` bound) and
        ``self_attention.module`` gets :class:`TreeSelfAttention`, so that with Megatron's own
        inference context at CP > 1 the model fails with "needs a TreeInferenceContext" on every
        rank instead of silently replicating the KV cache. Idempotent: a slot that already holds
        ours (marker ``_megatron_tree``) is left alone. What each slot held is kept (the core
        attention's in ``__wrapped__``, the module's in the spec's ``_megatron_tree_wrapped_module``);
        :func:`restore_core_attention` puts both back. Returns ``spec``.
    """
    from megatron.core.transformer.attention import SelfAttention

    version = check_megatron_version("use_tree_attention")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    layers = _layer_specs(spec)
    for layer in layers:  # check every layer before changing any
        _self_attention_submodules(layer)
        module = _self_attention_spec(layer).module
        if module is not TreeSelfAttention and module is not SelfAttention:
            raise TypeError(
                f"the layer spec's self_attention.module is {getattr(module, '__name__', module)}, expected "
                "Megatron's SelfAttention (which TreeSelfAttention subclasses); a model with an attention module "
                "of its own can apply the same two hooks as source patches instead (patches/README.md, 0.16.1)"
            )
    for layer in layers:
        subs = _self_attention_submodules(layer)
        attn = _self_attention_spec(layer)
        if attn.module is not TreeSelfAttention:
            attn._megatron_tree_wrapped_module = attn.module
            attn.module = TreeSelfAttention
        current = subs.core_attention
        if getattr(current, "_megatron_tree", None) == MARKER:
            log.debug("core_attention slot already holds TreeDotProductAttention; unchanged")
            continue
        slot = functools.partial(TreeDotProductAttention, strategy=strategy, backend=backend)
        slot._megatron_tree = MARKER
        slot.__wrapped__ = current
        subs.core_attention = slot
        log.info(
            "megatron-core %s: core_attention slot %s -> TreeDotProductAttention(strategy=%s)",
            version, getattr(current, "__name__", current), strategy,
        )
    return spec


def restore_core_attention(spec):
    """Undo :func:`use_tree_attention` on ``spec`` (a no-op where a slot is not ours). Returns ``spec``."""
    for layer in _layer_specs(spec):
        subs = _self_attention_submodules(layer)
        attn = _self_attention_spec(layer)
        if attn.module is TreeSelfAttention:
            attn.module = attn.__dict__.pop("_megatron_tree_wrapped_module", _self_attention_base())
        if getattr(subs.core_attention, "_megatron_tree", None) == MARKER:
            subs.core_attention = subs.core_attention.__wrapped__
            log.info("core_attention slot restored to %s", getattr(subs.core_attention, "__name__", subs.core_attention))
    return spec


def get_gpt_layer_tree_spec(*, strategy: str = "auto", backend: str | None = None, **local_spec_kwargs):
    """``get_gpt_layer_local_spec(**local_spec_kwargs)`` with both attention slots filled (:func:`use_tree_attention`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(**local_spec_kwargs))
    return use_tree_attention(spec, strategy=strategy, backend=backend)


def check_tree_slots(model, what: str) -> None:
    """``TypeError`` naming ``what`` unless every layer of ``model`` holds tree attention in both slots.

    Accepted: :class:`TreeSelfAttention` in ``self_attention.module``, or Megatron's ``SelfAttention``
    with both hooks applied as runtime patches (``patches.apply_runtime()``, 0.16.1 only); and
    :class:`TreeDotProductAttention` in ``core_attention``.
    """
    from megatron.core.transformer.attention import Attention
    from megatron.core.utils import unwrap_model

    patched = all(hasattr(Attention.__dict__[n], "_megatron_tree_patch")
                  for n in ("_adjust_key_value_for_inference", "flash_decode_and_prefill"))
    layers = unwrap_model(model).decoder.layers
    bad = [i for i, layer in enumerate(layers)
           if not (isinstance(layer.self_attention, TreeSelfAttention) or patched)
           or not isinstance(layer.self_attention.core_attention, TreeDotProductAttention)]
    if bad:
        first = layers[bad[0]].self_attention
        raise TypeError(
            f"{what}: layers {bad} hold {type(first).__name__} / {type(first.core_attention).__name__}; build the "
            "model with get_gpt_layer_tree_spec() so that TreeSelfAttention and TreeDotProductAttention fill the "
            "self_attention module and core_attention slots"
        )


def check_context_groups(model, groups: TreeGroups, what: str) -> None:
    """``ValueError`` naming ``what`` unless ``groups`` (a context's, or ``MegatronLM``'s) span the ranks of the
    CP group the model's core attention merges over.

    The context places each row's keys over its own groups while every layer merges over the model's
    (``pg_collection.cp``): a context over other ranks (say ``TreeGroups.from_env()``, the whole world,
    beside a model at a smaller CP size) would attend to a part of the sequence, or to copies of it,
    without an error. No collective: each rank compares rank lists it already holds.
    """
    from megatron.core.utils import unwrap_model

    layers = unwrap_model(model).decoder.layers
    if not len(layers):
        return
    mine = layers[0].self_attention.core_attention.groups.cp_ranks
    if tuple(groups.cp_ranks) != tuple(mine):
        raise ValueError(
            f"{what}: the context's groups span ranks {tuple(groups.cp_ranks)}, but the model's core attention "
            f"merges over its CP group {tuple(mine)} (pg_collection.cp); build the context with "
            "groups=tree_groups_from_megatron(model.pg_collection)"
        )


def megatron_attention_fingerprint() -> dict:
    """sha256 of Megatron's installed attention module file and the identity of the methods we override.

    Compared before and after a decode, it shows no source was modified on disk and no function
    replaced in the imported module (a runtime patch would change ``functions`` and ``patched``).
    """
    from megatron.core.transformer import attention

    names = ("_adjust_key_value_for_inference", "flash_decode_and_prefill", "forward")
    with open(attention.__file__, "rb") as f:
        file_sha = hashlib.sha256(f.read()).hexdigest()
    return {
        "file_sha256": file_sha,
        "functions": {n: id(attention.Attention.__dict__[n]) for n in names},
        "source_sha256": {n: hashlib.sha256(inspect.getsource(attention.Attention.__dict__[n]).encode()).hexdigest()
                          for n in names},
        "patched": [n for n in names if hasattr(attention.Attention.__dict__[n], "_megatron_tree_patch")],
    }
