"""Megatron-Core integration: tree decode in the ``core_attention`` slot and a CP-sharded KV cache.

Invariant: Megatron's tensors cross this boundary in Megatron's layout (``[s, b, h, d]``)
and ours in flash-attention's (``(b, s, h, d)``); every attention computed here is exact
attention over the whole sequence, whatever the context-parallel (CP) size, computed by
``ops.flash_decode`` on local shards and ``comm.merge`` (through ``tree_decode``) across
them. Nothing here falls back to CP = 1: a layout that does not match the launched world
or whose hierarchical sizes do not multiply to the CP size is a :class:`TopologyError`.

Why it lives here: this is the only module that may read ``megatron.core.parallel_state``
(STYLE.md rule 4), and only when no ``pg_collection`` was given.

Pieces, and how they meet inside Megatron's own inference path (megatron-core 0.16.1):

* :class:`TreeDotProductAttention` fills ``SelfAttentionSubmodules.core_attention``
  (:func:`use_tree_attention` swaps the slot, :func:`get_gpt_layer_tree_spec` builds a spec).
* :class:`TreeInferenceContext` is a ``StaticInferenceContext`` whose KV cache is sharded
  over the CP group, each row placed by :mod:`megatron_tree.decode.placement` (the rule every
  cache shares): the prompt in the training CP layout (``get_batch_on_this_cp_rank``'s
  2·CP load-balanced chunks), decoded tokens in blocks, round-robin over the ranks.
* :class:`TreeGPTInferenceWrapper` is a ``GPTInferenceWrapper`` that hands each CP rank its
  chunks of the prompt and assembles the logits the controller asks for on every rank
  (``decode.prefill.assemble_logits``), so ``TextGenerationController`` and
  ``StaticInferenceEngine`` run unchanged.
* Megatron has no slot for the KV-cache update (``Attention._adjust_key_value_for_inference``
  allocates and fills the full sequence on every rank); patch ``0001`` in ``patches/``
  (applied at runtime by :mod:`.patches`) makes it defer to the core attention's
  :meth:`TreeDotProductAttention.adjust_key_value_for_inference` when it has one.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import collectives, ops
from ...decode.generate import DecodeStep
from ...decode.prefill import assemble_logits
from ...comm import STRATEGIES
from ...decode.placement import RowPlacement
from ...decode.plan import StepPlanner
from ...topology import TopologyError, TreeGroups
from .version import SUPPORTED_VERSIONS, check_megatron_version, megatron_version

__all__ = [
    "SUPPORTED_VERSIONS", "megatron_version", "check_megatron_version", "tree_groups_from_megatron",
    "initialize_model_parallel", "TreeDotProductAttention", "use_tree_attention",
    "restore_core_attention", "get_gpt_layer_tree_spec", "TreeInferenceContext",
    "TreeGPTInferenceWrapper", "StepPlan", "load_balanced_positions",
]

log = logging.getLogger("megatron_tree.integrations")

MARKER = "megatron_tree.TreeDotProductAttention"


# --------------------------------------------------------------------------- groups


def _level_groups(hcp) -> list:
    if hcp is None:
        return []
    groups = [g for g in hcp if g is not None]
    return [g for g in groups if dist.get_world_size(g) > 1]


def tree_groups_from_megatron(pg_collection=None) -> TreeGroups:
    """``TreeGroups`` over Megatron-Core's CP group, with ``hcp`` (innermost first) as levels.

    pg_collection: a ``ProcessGroupCollection`` with ``cp`` and optionally ``hcp`` (the
        groups built from ``hierarchical_context_parallel_sizes``). ``None`` reads the same
        two groups from ``parallel_state``; that is the only global this package reads.
    """
    if pg_collection is not None:
        cp = getattr(pg_collection, "cp", None)
        hcp = getattr(pg_collection, "hcp", None)
        source = "pg_collection"
    else:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "no pg_collection given and megatron.core.parallel_state is not initialised; call "
                "initialize_model_parallel(...) first or pass the model's pg_collection"
            )
        cp = parallel_state.get_context_parallel_group(check_initialized=False)
        hcp = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
        source = "parallel_state"
    if cp is None:
        raise TopologyError(f"{source} has no context-parallel group ('cp'); was model parallelism initialised?")
    levels = _level_groups(hcp)
    if len(levels) == 1:
        levels = []  # one non-trivial level is the flat CP group itself
    cp_size = dist.get_world_size(cp)
    if levels:
        sizes = [dist.get_world_size(g) for g in levels]
        if math.prod(sizes) != cp_size:
            raise TopologyError(
                f"hierarchical CP groups from {source} have sizes {sizes} (product {math.prod(sizes)}), "
                f"expected their product to be the CP size {cp_size} (stale groups? megatron-core 0.16.1's "
                "destroy_model_parallel does not clear them; megatron_tree's initialize_model_parallel does)"
            )
    return TreeGroups.from_groups(cp, levels)


def initialize_model_parallel(
    context_parallel_size: int,
    hierarchical_context_parallel_sizes=None,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    **kwargs,
) -> TreeGroups:
    """Validate a CP layout against the launched world, initialise Megatron's groups, return ours.

    Raises :class:`TopologyError` (before any group is created) when the CP size does not
    fit the world or the hierarchical sizes do not multiply to it; never falls back to CP = 1.
    Extra keyword arguments go to ``parallel_state.initialize_model_parallel``; its groups'
    timeout (``distributed_timeout_minutes``) defaults to the default process group's own
    rather than Megatron's fixed 30 minutes.
    """
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before Megatron's model-parallel groups")
    world = dist.get_world_size()
    if not isinstance(context_parallel_size, int) or context_parallel_size < 1:
        raise TopologyError(f"context_parallel_size must be a positive integer, got {context_parallel_size!r}")
    per_replica = context_parallel_size * tensor_model_parallel_size * pipeline_model_parallel_size
    if world % per_replica != 0:
        raise TopologyError(
            f"context_parallel_size={context_parallel_size} x tensor={tensor_model_parallel_size} x "
            f"pipeline={pipeline_model_parallel_size} = {per_replica} ranks per model replica does not divide "
            f"the launched world of {world} ranks; expected a CP size with world % (cp*tp*pp) == 0"
        )
    if hierarchical_context_parallel_sizes:
        sizes = [int(s) for s in hierarchical_context_parallel_sizes]
        if math.prod(sizes) != context_parallel_size or any(s < 1 for s in sizes):
            raise TopologyError(
                f"hierarchical_context_parallel_sizes={sizes} multiply to {math.prod(sizes)}, expected the "
                f"context_parallel_size {context_parallel_size}"
            )
        hierarchical_context_parallel_sizes = sizes
    kwargs.setdefault("distributed_timeout_minutes", collectives.group_timeout().total_seconds() / 60)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
        **kwargs,
    )
    if not hierarchical_context_parallel_sizes and parallel_state.get_hierarchical_context_parallel_groups(
        check_initialized=False
    ) is not None:
        # megatron-core 0.16.1's destroy_model_parallel() leaves the hierarchical CP groups of
        # an earlier initialisation in place; they do not belong to this layout.
        log.info("dropping stale hierarchical CP groups left by an earlier initialize_model_parallel")
        parallel_state._HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None
    groups = tree_groups_from_megatron(None)
    if groups.size != context_parallel_size:
        raise TopologyError(f"Megatron built a CP group of {groups.size} ranks, expected {context_parallel_size}")
    return groups


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by ``cp_rank`` in the training CP layout: chunks r and 2P-1-r of 2P.

    seq_len must be a multiple of 2·cp_size (``get_batch_on_this_cp_rank``'s requirement).
    """
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2*cp_size={2 * cp_size}")
    c = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * c, (cp_rank + 1) * c)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * c, (2 * cp_size - cp_rank) * c)
    return torch.cat([first, second])


_NEVER = 2**62
"""Key position of padding: later than every query, so the causal mask never shows it."""


def _gather_seq(t: torch.Tensor, groups: TreeGroups, site: str) -> torch.Tensor:
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


@dataclass(frozen=True)
class _Pending:
    """What the KV-cache hook tells its core attention about the call that follows."""

    mode: str
    """``"prefill"`` (local queries, all-gathered keys) or ``"decode"`` (replicated queries, local shard)."""
    q_positions: torch.Tensor
    """(batch, seqlen_q) global positions of the queries; -1 marks padding (it sees no key)."""
    k_positions: torch.Tensor
    """(batch, seqlen_k) global positions of the keys handed to the core attention; padding
    is never visible (a position past every query, or a slot beyond ``k_lengths``)."""
    k_lengths: torch.Tensor | None = None
    """decode: (batch,) int32 valid keys of each row in this rank's shard."""


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
    * inside its prefill: local queries of the 2·CP chunks against the all-gathered keys;
    * otherwise (training layout, no inference context): at CP > 1 the local chunks'
      keys/values are all-gathered and the mask follows global positions; at CP = 1 this is
      plain causal (or unmasked) attention. Forward-only (no backward through the gather).
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
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise NotImplementedError(f"softmax_type={config.softmax_type!r} is not supported; expected 'vanilla'")
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError("sliding-window attention (config.window_size) is not supported")
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
        self._pending: _Pending | None = None
        self.comm_stats = None
        """A :class:`~megatron_tree.comm.CommStats` to record decode merges into (``None``: not recorded)."""
        self.current_step = None
        """The decode loop's ``decode.generate.DecodeStep`` while ``MegatronLM.decode_step`` runs (its
        ``attend`` is the decode attention; ``None``: a plain step of ``strategy``/``comm_stats``)."""

    @property
    def groups(self) -> TreeGroups:
        """The CP group and its levels (built on first use from ``pg_collection``)."""
        if self._groups is None:
            self._groups = tree_groups_from_megatron(self.pg_collection)
        return self._groups

    # -- the inference KV-cache hook (called by patch 0001 from Attention) -------------------

    def adjust_key_value_for_inference(
        self, attention, inference_context, query, key, value, rotary_pos_emb, *rest, **kwargs
    ):
        """Store this step's keys/values in the CP-sharded cache and return what core attention needs.

        query: [sq, b, hq, d]; key, value: [sq, b, hkv, d] for the tokens of this forward on
        this rank (see :class:`StepPlan`). Returns Megatron's tuple ``(query, key, value,
        rotary_pos_emb, attn_mask_type, block_table)`` with RoPE already applied at global
        positions (so ``rotary_pos_emb`` is ``None``), and key/value either the all-gathered
        prompt (prefill) or this rank's shard of the cache (decode). Returns ``None`` (let
        Megatron do it) only for a plain ``StaticInferenceContext`` at CP = 1.
        """
        ctx = inference_context
        if ctx is not None and ctx.is_dynamic_batching():  # paged, continuous batching: the context stores the keys
            store = getattr(ctx, "store_key_value", None)  # TreeDynamicInferenceContext's (dynamic.py)
            if store is not None:
                return store(self, attention, query, key, value, rotary_pos_emb)
            if self.cp_size == 1:
                return None  # Megatron's own DynamicInferenceContext at CP = 1: Megatron does it
            raise RuntimeError(
                f"TreeDotProductAttention at context_parallel_size={self.cp_size} needs a TreeDynamicInferenceContext "
                f"for dynamic batching (got {type(ctx).__name__}); Megatron's DynamicInferenceContext keeps every "
                "request's whole KV cache on every rank"
            )
        if not isinstance(ctx, TreeInferenceContext):
            if self.cp_size == 1 and ctx is not None and ctx.is_static_batching():
                return None
            raise RuntimeError(
                f"TreeDotProductAttention at context_parallel_size={self.cp_size} needs a "
                f"TreeInferenceContext (got {type(ctx).__name__}); Megatron's own contexts keep the full "
                "sequence on every rank"
            )
        plan = ctx.step
        if plan is None:
            raise RuntimeError(
                "TreeInferenceContext has no planned step; run the model through TreeGPTInferenceWrapper "
                "or call context.plan_step(...) before the forward"
            )
        b0, b1 = plan.rows
        if tuple(query.shape[:2]) != (plan.width, b1 - b0) or key.shape[1] != b1 - b0:
            raise ValueError(
                f"query has [s, b] = {tuple(query.shape[:2])}, but the planned step has {plan.width} tokens of "
                f"{b1 - b0} rows on this rank; pass the tokens from plan.index"
            )
        if rotary_pos_emb is not None:
            query, key = ctx.apply_rope(query, key, plan.positions, self.config, self.pg_collection.cp,
                                        same_positions=plan.same_positions)
        k_buf, v_buf = ctx.buffers(self.layer_number, key, value)
        # Tokens another rank keeps go to the buffers' spare slot (never read; the step planner's
        # one trick): one scatter, no host read of which tokens are this rank's.
        slot = plan.store.to(key.device).t()  # [width, rows]
        rows = torch.arange(b0, b1, device=key.device)[None, :].expand_as(slot)
        k_buf[slot, rows] = key.to(k_buf.dtype)
        v_buf[slot, rows] = value.to(v_buf.dtype)
        if plan.mode == "prefill":
            keys = _gather_seq(key, self.groups, "prefill keys/values")
            values = _gather_seq(value, self.groups, "prefill keys/values")
            kpos = plan.gathered_positions.masked_fill(plan.gathered_positions < 0, _NEVER)
            self._pending = _Pending("prefill", plan.positions, kpos)
        else:
            lengths = plan.k_lengths if plan.k_lengths is not None else ctx.local_lengths(b0, b1)
            n = ctx.local_max(b0, b1)  # host bookkeeping: no read of lengths
            keys, values = k_buf[:n, b0:b1], v_buf[:n, b0:b1]
            self._pending = _Pending("decode", plan.positions, ctx.local_positions[b0:b1, :n], lengths)
        return query, keys, values, None, self.attn_mask_type, None

    def dynamic_attention(self, attention, q, k, v, *megatron_args):
        """Attention of a dynamic (packed, paged) batch, called by patch 0002: the context that stored
        this layer's keys (``TreeDynamicInferenceContext.store_key_value``) attends over them; ``None``
        when no tree context did (Megatron's own context at CP = 1)."""
        pending, self._dynamic_pending = getattr(self, "_dynamic_pending", None), None
        if pending is None:
            return None
        ctx, layer = pending
        return ctx.attend(self, q, layer)

    # -- forward --------------------------------------------------------------------------

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query: [sq, b, hq, d]; key, value: [sk, b, hkv, d] -> context [sq, b, hq*d]."""
        if packed_seq_params is not None:
            raise NotImplementedError("packed (THD) sequences are not supported by TreeDotProductAttention")
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by TreeDotProductAttention")
        if self.training and self.attention_dropout > 0:
            raise NotImplementedError("attention dropout is not supported by TreeDotProductAttention")
        pending, self._pending = self._pending, None
        q = query.transpose(0, 1)
        k = key.transpose(0, 1)
        v = value.transpose(0, 1)
        b, sq = q.shape[0], q.shape[1]
        if pending is not None and pending.mode == "decode":
            step = self.current_step if self.current_step is not None else DecodeStep(self.strategy, self.comm_stats)
            out = step.attend(self.layer_number, q, k, v, self.groups, cache_seqlens=pending.k_lengths.to(q.device),
                              softmax_scale=self.softmax_scale, q_positions=pending.q_positions.to(q.device),
                              k_positions=pending.k_positions.to(q.device), backend=self.backend)
        else:
            if pending is not None:  # prefill: local queries over the gathered prompt
                qpos, kpos = pending.q_positions, pending.k_positions
            else:
                qpos, kpos = self._training_positions(q, k, attn_mask_type)
                if kpos is not None and self.cp_size > 1:
                    k = _gather_seq(key, self.groups, "training-layout keys/values").transpose(0, 1)
                    v = _gather_seq(value, self.groups, "training-layout keys/values").transpose(0, 1)
                elif self.cp_size > 1:
                    raise NotImplementedError("unmasked attention at CP > 1 outside inference is not supported")
            if qpos is not None and qpos.dim() == 1:
                qpos = qpos[None, :].expand(b, sq)
            out, _ = ops.flash_decode(
                q, k, v, softmax_scale=self.softmax_scale,
                q_positions=None if qpos is None else qpos.to(q.device),
                k_positions=None if kpos is None else kpos.to(q.device),
                backend=self.backend,
            )
        return out.transpose(0, 1).reshape(sq, b, -1)

    def _training_positions(self, q, k, attn_mask_type):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type == self._mask_types.no_mask:
            return None, None
        if mask_type != self._mask_types.causal:
            raise NotImplementedError(
                f"attn_mask_type={mask_type} is not supported; TreeDotProductAttention derives the causal "
                "mask from global positions (causal or no_mask)"
            )
        sq, sk = q.shape[1], k.shape[1]
        if self.cp_size == 1:
            return torch.arange(sk - sq, sk), torch.arange(sk)
        if sq != sk:
            raise NotImplementedError("at CP > 1 the training layout needs equal query and key lengths")
        total = sq * self.cp_size
        qpos = load_balanced_positions(total, self.cp_size, self.groups.rank)
        kpos = torch.cat([load_balanced_positions(total, self.cp_size, r) for r in range(self.cp_size)])
        return qpos, kpos


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


def use_tree_attention(spec, *, strategy: str = "auto", backend: str | None = None):
    """Put :class:`TreeDotProductAttention` into the ``core_attention`` slot of ``spec``, in place.

    spec: a transformer-layer ``ModuleSpec`` (e.g. ``get_gpt_layer_local_spec()``) or a
        block spec with ``submodules.layer_specs``. Idempotent: a slot that already holds
        ours (marker ``_megatron_tree``) is left alone. The previous slot content is kept in
        ``__wrapped__``; :func:`restore_core_attention` puts it back. Returns ``spec``.

    Also applies patch 0001 (idempotent), so that with Megatron's own inference context at
    CP > 1 the model fails with "needs a TreeInferenceContext" on every rank instead of
    silently replicating the KV cache, even when our wrapper is never constructed.
    """
    version = check_megatron_version("use_tree_attention")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
    from .patches import apply_runtime

    apply_runtime()
    for layer in _layer_specs(spec):
        subs = _self_attention_submodules(layer)
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
    """Undo :func:`use_tree_attention` on ``spec`` (a no-op where the slot is not ours). Returns ``spec``."""
    for layer in _layer_specs(spec):
        subs = _self_attention_submodules(layer)
        if getattr(subs.core_attention, "_megatron_tree", None) == MARKER:
            subs.core_attention = subs.core_attention.__wrapped__
            log.info("core_attention slot restored to %s", getattr(subs.core_attention, "__name__", subs.core_attention))
    return spec


def get_gpt_layer_tree_spec(*, strategy: str = "auto", backend: str | None = None, **local_spec_kwargs):
    """``get_gpt_layer_local_spec(**local_spec_kwargs)`` with :class:`TreeDotProductAttention` as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(get_gpt_layer_local_spec(**local_spec_kwargs))
    return use_tree_attention(spec, strategy=strategy, backend=backend)


# --------------------------------------------------------------------------- inference context


@dataclass(frozen=True)
class StepPlan:
    """Which tokens of one forward this CP rank processes and where it stores them.

    The forward covers rows ``rows[0]:rows[1]`` of the context's batch and a window of
    tokens per row (prefill: the whole prompt, the same length for every row of the step;
    decode: the newest token(s) of every row, replicated on every rank).
    """

    mode: str
    """``"prefill"`` (this rank's prompt chunks) or ``"decode"`` (tokens replicated on every rank)."""
    rows: tuple[int, int]
    """Batch rows ``[start, end)`` of the forward."""
    index: torch.Tensor
    """(width,) indices into the window of tokens given to the forward (padding repeats index 0)."""
    positions: torch.Tensor
    """(batch, width) int64 global positions of those tokens; -1 marks padding."""
    slots: torch.Tensor
    """(batch, width) int64 slot of each token in this rank's shard; -1 where it is not stored here."""
    store: torch.Tensor
    """(batch, width) int64 where this rank writes each token: its slot, or the spare slot ``capacity``."""
    gathered_positions: torch.Tensor | None
    """prefill: (batch, width * cp) positions of the all-gathered window, in gather order (-1 = padding)."""
    k_lengths: torch.Tensor | None = None
    """decode: (batch,) int32 tokens of each row this rank holds after the step, on the cache's device."""
    same_positions: bool | None = None
    """Every row's tokens sit at the same positions (known on the host; ``None``: not known)."""

    @property
    def width(self) -> int:
        """Tokens per row this rank feeds to the forward (the same on every CP rank)."""
        return int(self.index.numel())


def _static_context_base():
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext


def unsharded_rope_table(model, max_sequence_length: int):
    """The model's RoPE table for every position ``[S, 1, 1, rot_dim]``, or None for a model without RoPE.

    Megatron slices its own table per CP rank at CP > 1; tree attention rotates at *global*
    positions, so the inference contexts (static and dynamic) keep the whole table.
    """
    rotary = getattr(model, "rotary_pos_emb", None)
    if rotary is None or not hasattr(rotary, "get_emb"):
        return None
    if getattr(model, "position_embedding_type", "rope") != "rope":
        raise NotImplementedError(f"position_embedding_type={model.position_embedding_type!r}; only 'rope' is supported")
    return rotary.get_emb(max_sequence_length)


class TreeInferenceContext(_static_context_base()):
    """A ``StaticInferenceContext`` whose KV cache is sharded along the sequence over the CP group.

    Per layer, this rank holds ``k, v: [capacity, max_batch, hkv, d]`` with
    ``capacity = ceil(max_sequence_length / cp)`` (not the full sequence), and the global
    position of every stored token in ``local_positions: [max_batch, capacity]`` (-1 where
    free; one spare slot past ``capacity`` in both takes the tokens other ranks keep, so a
    step stores without reading which tokens are this rank's). Each row has its own
    :class:`~megatron_tree.decode.placement.RowPlacement` (``rows``), the rule every
    sequence-sharded cache shares, and decode steps are planned by ``decode.plan`` (the one step
    planner): the prompt in the training CP layout (rank r keeps chunks r and 2·CP-1-r of 2·CP,
    ``layout="load_balanced"``), decoded tokens in blocks of ``block_size`` that move
    round-robin over the ranks. Rows may hold different lengths.

    Two ways to drive it: Megatron's controller through :class:`TreeGPTInferenceWrapper`
    (:meth:`plan_step`, every row the same length), or per-row prefill then batched decode
    (:meth:`plan_prefill`, :meth:`plan_decode`; ``megatron_tree.integrations.megatron.model``).

    ``max_sequence_length`` is rounded up to an even number: Megatron slices its RoPE table
    of ``max_sequence_length * cp`` rows into 2·CP chunks on every forward.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, *, groups: TreeGroups | None = None,
                 pg_collection=None, layout: str = "load_balanced", block_size: int = 16,
                 use_flashinfer_fused_rope=None):
        max_sequence_length = int(max_sequence_length) + int(max_sequence_length) % 2
        super().__init__(max_batch_size, max_sequence_length)
        self.groups = groups if groups is not None else tree_groups_from_megatron(pg_collection)
        self.cp_size = self.groups.size
        self.cp_rank = self.groups.rank
        self.layout = layout
        self.block_size = block_size
        self.capacity = -(-max_sequence_length // self.cp_size)
        self.local_positions = torch.full((max_batch_size, self.capacity + 1), -1, dtype=torch.long)  # + a spare
        self.rows: list[RowPlacement] = []
        self.step: StepPlan | None = None
        self.rope_table: torch.Tensor | None = None
        self._planner = StepPlanner([], self.cp_rank, spare=self.capacity, device="cpu")
        self._decode: tuple | None = None  # (the planner's plan, the StepPlan made from it)
        self._new_rows()

    def _new_rows(self) -> None:
        self.rows = [RowPlacement(self.cp_size, layout=self.layout, block_size=self.block_size,
                                  capacity=self.capacity) for _ in range(self.max_batch_size)]
        self._planner.reset(self.rows)
        self._decode = None

    def reset(self):
        super().reset()
        self.local_positions.fill_(-1)
        self._new_rows()
        self.step = None

    @property
    def batch_size(self) -> int:
        """Rows of the cache (the interface ``generate`` checks, as ``ShardedKVCache``'s)."""
        return self.max_batch_size

    @property
    def max_seq_len(self) -> int:
        """Longest row the cache holds."""
        return self.max_sequence_length

    def lengths(self, start: int = 0, end: int | None = None) -> list[int]:
        """Global tokens cached in each row of ``[start, end)``."""
        return [row.total for row in self.rows[start:end]]

    def shard_lens(self, row: int) -> list[int]:
        """Tokens of ``row`` held by each CP rank (the same on every rank)."""
        return list(self.rows[row].counts)

    def local_lengths(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """(rows,) int32: tokens this rank holds of each row in ``[start, end)``."""
        return torch.tensor([row.counts[self.cp_rank] for row in self.rows[start:end]], dtype=torch.int32)

    def local_max(self, start: int = 0, end: int | None = None) -> int:
        """Most tokens this rank holds of any row in ``[start, end)`` (host bookkeeping, no device read)."""
        return max((row.counts[self.cp_rank] for row in self.rows[start:end]), default=0)

    @property
    def device(self) -> torch.device:
        """Where the KV buffers live (CPU until the first layer stored keys)."""
        return self.local_positions.device

    def bind_rope(self, model) -> None:
        """Keep the model's un-sharded RoPE table so layers can rotate at global positions."""
        self.rope_table = unsharded_rope_table(model, self.max_sequence_length)

    def apply_rope(self, query, key, positions, config, cp_group, same_positions: bool | None = None):
        """Rotate query/key ([s, b, h, d]) at their global ``positions`` ((b, s); -1 = padding).

        same_positions: whether every row is at the same positions, if the caller knows it on
        the host (a step's plan does); ``None`` reads ``positions`` to find out (a host sync).
        """
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if self.rope_table is None:
            raise RuntimeError("the model uses RoPE but TreeInferenceContext.bind_rope(model) was not called")
        s, b = query.shape[:2]
        pos = positions.clamp(min=0).to(self.rope_table.device)
        if same_positions is None:
            same_positions = bool((pos == pos[:1]).all())
        if same_positions:  # every row at the same positions: Megatron's [s, 1, 1, rot]
            emb = self.rope_table.index_select(0, pos[0])
            query = apply_rotary_pos_emb(query, emb, config=config, cp_group=cp_group)
            key = apply_rotary_pos_emb(key, emb, config=config, cp_group=cp_group)
            return query, key
        # Rows at different positions: fold the batch into the sequence ([s*b, 1, h, d]).
        emb = self.rope_table.index_select(0, pos.t().reshape(-1))
        query = apply_rotary_pos_emb(query.reshape(s * b, 1, *query.shape[2:]), emb, config=config, cp_group=cp_group)
        key = apply_rotary_pos_emb(key.reshape(s * b, 1, *key.shape[2:]), emb, config=config, cp_group=cp_group)
        return query.reshape(s, b, *query.shape[2:]), key.reshape(s, b, *key.shape[2:])

    def buffers(self, layer_number: int, key, value):
        """This layer's shard buffers ``[capacity + 1, max_batch, hkv, d]``, allocated at the prefill.

        Slot ``capacity`` is a spare that takes the tokens other ranks keep (written, never read).
        The first allocation also moves ``local_positions`` to the buffers' device.
        """
        if self.local_positions.device != key.device:
            self.local_positions = self.local_positions.to(key.device)
        if layer_number not in self.key_value_memory_dict:
            shape = (self.capacity + 1, self.max_batch_size, key.shape[2], key.shape[3])
            self.key_value_memory_dict[layer_number] = (
                torch.empty(shape, dtype=key.dtype, device=key.device),
                torch.empty(shape, dtype=value.dtype, device=value.device),
            )
        return self.key_value_memory_dict[layer_number]

    def _check_rows(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.max_batch_size:
            raise ValueError(f"rows [{start}, {end}) are outside the context's batch of {self.max_batch_size}")

    def plan_prefill(self, start: int, end: int, length: int) -> StepPlan:
        """Plan the prefill of rows ``[start, end)``, each an empty row receiving a ``length``-token prompt."""
        self._check_rows(start, end)
        if length > self.max_sequence_length:
            raise ValueError(f"a {length}-token prompt exceeds max_sequence_length={self.max_sequence_length}")
        for b in range(start, end):
            if self.rows[b].total:
                raise RuntimeError(f"row {b} already holds {self.rows[b].total} tokens; prefill needs an empty row")
        ranges = [self.rows[b].place_prompt(length) for b in range(start, end)][0]
        per_rank = [[t for s, e in rr for t in range(s, e)] for rr in ranges]
        width = max(len(p) for p in per_rank)
        padded = torch.tensor([p + [-1] * (width - len(p)) for p in per_rank], dtype=torch.long)  # [cp, width]
        mine = padded[self.cp_rank]
        n_mine = len(per_rank[self.cp_rank])
        slots = torch.where(mine >= 0, torch.arange(width), torch.full_like(mine, -1))
        store = torch.where(slots >= 0, slots, torch.full_like(slots, self.capacity))  # padding: the spare slot
        rows = end - start
        self.local_positions[start:end, :n_mine] = mine[:n_mine]
        plan = StepPlan("prefill", (start, end), mine.clamp(min=0), mine[None].expand(rows, -1),
                        slots[None].expand(rows, -1), store[None].expand(rows, -1),
                        padded.reshape(1, -1).expand(rows, -1), same_positions=True)
        self.step = plan
        return plan

    def plan_decode(self, start: int, end: int, num_tokens: int = 1) -> StepPlan:
        """Plan ``num_tokens`` new tokens at the end of every row in ``[start, end)`` (rows may differ in length).

        The step planner (``decode.plan``) places them and sends the plan to the device in one
        copy; after :meth:`rewind_step` the same call gets the same plan back.
        """
        self._check_rows(start, end)
        for b in range(start, end):
            row = self.rows[b]
            if row.total == 0:
                raise RuntimeError(f"row {b} is empty: prefill it before decoding")
            if row.total + num_tokens > self.max_sequence_length:
                raise ValueError(
                    f"row {b}: {row.total + num_tokens} tokens exceed max_sequence_length={self.max_sequence_length}"
                )
        self._planner.device = self.device
        step = self._planner.step(start, end, num_tokens)
        if self._decode is None or self._decode[0] is not step:
            # local_positions[b, slot] = position where this rank keeps the token; the others go to
            # the spare column ``capacity`` (never read), so no host read of which tokens are ours.
            index = torch.arange(start, end, device=self.device)[:, None].expand(end - start, num_tokens)
            self.local_positions[index, step.store] = step.positions
            plan = StepPlan("decode", (start, end), torch.arange(num_tokens, device=self.device), step.positions,
                            step.slots, step.store, None, k_lengths=step.counts.to(torch.int32),
                            same_positions=step.host.same_positions)
            self._decode = (step, plan)
        self.step = self._decode[1]
        return self.step

    def rewind_step(self) -> None:
        """Take the last decode step back so that it runs again on the same slots (``generate``'s redo
        of a ``shifted`` step): row lengths are as before it, the next :meth:`plan_decode` of the same
        rows returns its plan again; the stored keys stay (rewriting them is idempotent)."""
        self._planner.rewind()

    def plan_step(self, start: int, num_tokens: int, batch_size: int | None = None) -> StepPlan:
        """Plan the forward of tokens at global positions ``[start, start + num_tokens)`` of every row.

        Megatron's controller path: rows ``batch_size_offset .. + batch_size`` (default: the
        rest of the batch), all of the same length. ``start == 0`` is the prefill.
        """
        b0 = self.batch_size_offset
        b1 = self.max_batch_size if batch_size is None else b0 + batch_size
        lengths = set(self.lengths(b0, b1))
        if lengths != {start}:
            raise RuntimeError(
                f"step starts at position {start} but the rows hold {sorted(lengths)} tokens; the CP-sharded cache "
                "appends in order"
            )
        if start + num_tokens > self.max_sequence_length:
            raise ValueError(f"{start + num_tokens} tokens exceed max_sequence_length={self.max_sequence_length}")
        if start == 0:
            return self.plan_prefill(b0, b1, num_tokens)
        return self.plan_decode(b0, b1, num_tokens)

    def commit_step(self) -> None:
        """Close the planned step (after every layer has stored its keys/values)."""
        if self.step is None:
            raise RuntimeError("commit_step() without plan_step()")
        self.step = None


# --------------------------------------------------------------------------- inference wrapper


def _gpt_wrapper_base():
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    return GPTInferenceWrapper


class TreeGPTInferenceWrapper(_gpt_wrapper_base()):
    """``GPTInferenceWrapper`` for a model with :class:`TreeDotProductAttention` and a :class:`TreeInferenceContext`.

    Megatron's controller hands every rank the whole window of tokens; this wrapper gives
    each CP rank its part (prefill: its 2·CP chunks; decode: the replicated new tokens),
    runs the model, and returns logits ``[b, s or 1, vocab]`` identical on every CP rank.
    The causal mask comes from global positions, so no attention-mask tensor is built.
    """

    def __init__(self, model, inference_wrapper_config, inference_context: TreeInferenceContext, pg_collection=None):
        if not isinstance(inference_context, TreeInferenceContext):
            raise TypeError(
                f"TreeGPTInferenceWrapper needs a TreeInferenceContext, got {type(inference_context).__name__}"
            )
        from .patches import apply_runtime

        apply_runtime()  # the KV-cache hook has no slot in megatron-core; idempotent
        super().__init__(model, inference_wrapper_config, inference_context, pg_collection)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            raise NotImplementedError(
                "TreeGPTInferenceWrapper does not support pipeline parallelism (the CP logits gather "
                "assumes every rank runs the last stage); use pipeline_model_parallel_size=1"
            )

    def prep_model_for_inference(self, prompts_tokens=None):
        super().prep_model_for_inference(prompts_tokens)
        from megatron.core.utils import unwrap_model

        self.inference_context.bind_rope(unwrap_model(self.model))

    def _build_attention_mask_and_position_ids(self, prompts_tokens):
        seq_length = prompts_tokens.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=prompts_tokens.device)
        return None, position_ids.unsqueeze(0).expand_as(prompts_tokens)

    def _forward(self, inference_input):
        """tokens: [b, s] (the controller's window) -> logits [b, s, vocab] or [b, 1, vocab]."""
        ctx: TreeInferenceContext = self.inference_context
        tokens = inference_input["tokens"]
        b, s = tokens.shape
        start = ctx.sequence_len_offset
        plan = ctx.plan_step(start, s, b)
        index = plan.index.to(tokens.device)
        local_tokens = tokens.index_select(1, index)
        local_pos = plan.positions.clamp(min=0).to(tokens.device)
        only_last = ctx.materialize_only_last_token_logits
        if plan.mode == "prefill":
            ctx.materialize_only_last_token_logits = False
        try:
            logits = self.model(
                local_tokens, local_pos, None, inference_context=ctx, runtime_gather_output=True
            )
        finally:
            ctx.materialize_only_last_token_logits = only_last
        if plan.mode == "prefill":  # this rank's chunk's logits -> the window's, on every rank (exact)
            wanted = torch.arange(s - 1 if only_last else 0, s, device=logits.device)
            logits = assemble_logits(logits, plan.positions, wanted, ctx.groups).to(logits.dtype)
        ctx.commit_step()
        return logits
