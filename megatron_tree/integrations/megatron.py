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
  over the CP group: the prompt in the training CP layout (``get_batch_on_this_cp_rank``'s
  2·CP load-balanced chunks), decoded tokens appended to the shortest shard.
* :class:`TreeGPTInferenceWrapper` is a ``GPTInferenceWrapper`` that hands each CP rank its
  chunks of the prompt and gathers the logits back, so ``TextGenerationController`` and
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

from .. import ops
from ..attention import tree_decode
from ..comm import STRATEGIES
from ..topology import TopologyError, TreeGroups

__all__ = [
    "SUPPORTED_VERSIONS", "megatron_version", "check_megatron_version", "tree_groups_from_megatron",
    "initialize_model_parallel", "TreeDotProductAttention", "use_tree_attention",
    "restore_core_attention", "get_gpt_layer_tree_spec", "TreeInferenceContext",
    "TreeGPTInferenceWrapper", "StepPlan", "load_balanced_positions",
]

log = logging.getLogger("megatron_tree.integrations")

SUPPORTED_VERSIONS = ("0.16.1",)
"""megatron-core releases whose inference internals this module and ``patches/`` were written against."""
MARKER = "megatron_tree.TreeDotProductAttention"


def megatron_version() -> str:
    """Version of the megatron-core that is imported (``megatron.core.package_info``)."""
    from megatron.core import package_info

    return package_info.__shortversion__


def check_megatron_version(what: str) -> str:
    """Raise ``RuntimeError`` naming ``what`` unless the imported megatron-core is supported."""
    version = megatron_version()
    if version not in SUPPORTED_VERSIONS:
        raise RuntimeError(
            f"{what} supports megatron-core {', '.join(SUPPORTED_VERSIONS)}, but {version} is imported; "
            "its inference internals differ (0.19 rejects CP != 1 at inference), so refusing rather than "
            "guessing. Pin megatron-core==0.16.1 or port patches/ to the new release."
        )
    return version


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
    Extra keyword arguments go to ``parallel_state.initialize_model_parallel``.
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


def _gather_seq(t: torch.Tensor, group, size: int) -> torch.Tensor:
    """All-gather ``t`` ([s, ...], equal s on every rank) over ``group``; concatenated along dim 0."""
    if size == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim=0)


# --------------------------------------------------------------------------- core attention


@dataclass(frozen=True)
class _Pending:
    """What the KV-cache hook tells its core attention about the call that follows."""

    mode: str
    """``"prefill"`` (local queries, all-gathered keys) or ``"decode"`` (replicated queries, local shard)."""
    q_positions: torch.Tensor
    """(seqlen_q,) global positions of the queries."""
    k_positions: torch.Tensor
    """(seqlen_k,) global positions of the keys handed to the core attention."""


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
        if ctx is not None and ctx.is_dynamic_batching():  # paged, continuous batching: megatron_dynamic.py
            from .megatron_dynamic import adjust_key_value_dynamic

            return adjust_key_value_dynamic(self, attention, ctx, query, key, value, rotary_pos_emb)
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
        if tuple(query.shape[:2]) != (len(plan.positions), key.shape[1]):
            raise ValueError(
                f"query has [s, b] = {tuple(query.shape[:2])}, but the planned step has {len(plan.positions)} "
                "tokens on this rank; pass the tokens from plan.index"
            )
        if rotary_pos_emb is not None:
            query, key = ctx.apply_rope(query, key, plan.positions, self.config, self.pg_collection.cp)
        k_buf, v_buf = ctx.buffers(self.layer_number, key, value)
        b0, b1 = ctx.batch_size_offset, ctx.batch_size_offset + key.shape[1]
        start = ctx.local_len
        stored = plan.store.nonzero().flatten()
        end = start + stored.numel()
        if stored.numel():
            k_buf[start:end, b0:b1] = key.index_select(0, stored)
            v_buf[start:end, b0:b1] = value.index_select(0, stored)
        if plan.mode == "prefill":
            keys = _gather_seq(key, self.groups.cp_group, self.cp_size)
            values = _gather_seq(value, self.groups.cp_group, self.cp_size)
            self._pending = _Pending("prefill", plan.positions, plan.gathered_positions)
        else:
            keys, values = k_buf[:end, b0:b1], v_buf[:end, b0:b1]
            self._pending = _Pending("decode", plan.positions, ctx.local_positions[:end])
        return query, keys, values, None, self.attn_mask_type, None

    def dynamic_attention(self, attention, q, k, v, *megatron_args):
        """Attention of a dynamic (packed, paged) batch, called by patch 0002; see ``megatron_dynamic``."""
        from .megatron_dynamic import dynamic_attention

        return dynamic_attention(self, attention, q, k, v, *megatron_args)

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
            qp = pending.q_positions.to(q.device)[None, :].expand(b, sq)
            out = tree_decode(
                q, k, v, self.groups, softmax_scale=self.softmax_scale, strategy=self.strategy,
                q_positions=qp, k_positions=pending.k_positions.to(q.device), backend=self.backend,
                stats=self.comm_stats,
            )
        else:
            if pending is not None:  # prefill: local queries over the gathered prompt
                qpos, kpos = pending.q_positions, pending.k_positions
            else:
                qpos, kpos = self._training_positions(q, k, attn_mask_type)
                if kpos is not None and self.cp_size > 1:
                    k = _gather_seq(key, self.groups.cp_group, self.cp_size).transpose(0, 1)
                    v = _gather_seq(value, self.groups.cp_group, self.cp_size).transpose(0, 1)
                elif self.cp_size > 1:
                    raise NotImplementedError("unmasked attention at CP > 1 outside inference is not supported")
            out, _ = ops.flash_decode(
                q, k, v, softmax_scale=self.softmax_scale,
                q_positions=None if qpos is None else qpos.to(q.device)[None, :].expand(b, sq),
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
    """
    version = check_megatron_version("use_tree_attention")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {STRATEGIES}")
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
    """Which tokens of one forward this CP rank processes and which of them it stores."""

    mode: str
    """``"prefill"`` (cache empty: the prompt in 2·CP chunks) or ``"decode"`` (tokens replicated)."""
    index: torch.Tensor
    """(n_local,) indices into the (padded) window of tokens given to the forward."""
    positions: torch.Tensor
    """(n_local,) global positions of those tokens."""
    store: torch.Tensor
    """(n_local,) bool: keep this token's key/value in this rank's shard."""
    gathered_positions: torch.Tensor | None
    """prefill: (n_local * cp,) positions of the all-gathered window, in gather order."""
    padded_len: int
    """Window length after padding to a multiple of 2·CP (prefill) or the window length (decode)."""


def _static_context_base():
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext


class TreeInferenceContext(_static_context_base()):
    """A ``StaticInferenceContext`` whose KV cache is sharded along the sequence over the CP group.

    Per layer, this rank holds ``k, v: [capacity, max_batch, hkv, d]`` with
    ``capacity = ceil(max_sequence_length / cp) + 2`` (not the full sequence), and the
    global position of each stored token in ``local_positions``. The prompt is stored in
    the training CP layout (rank r keeps chunks r and 2·CP-1-r of 2·CP); each decoded
    token goes to the shard with the fewest tokens (lowest rank on ties), so shards stay
    balanced and no rank (in particular not the last one) takes every new token.

    ``max_sequence_length`` is rounded up to an even number: Megatron slices its RoPE table
    of ``max_sequence_length * cp`` rows into 2·CP chunks on every forward.
    """

    def __init__(self, max_batch_size: int, max_sequence_length: int, *, groups: TreeGroups | None = None,
                 pg_collection=None, use_flashinfer_fused_rope=None):
        max_sequence_length = int(max_sequence_length) + int(max_sequence_length) % 2
        super().__init__(max_batch_size, max_sequence_length)
        self.groups = groups if groups is not None else tree_groups_from_megatron(pg_collection)
        self.cp_size = self.groups.size
        self.cp_rank = self.groups.rank
        self.capacity = -(-max_sequence_length // self.cp_size) + 2
        self.local_positions = torch.full((self.capacity,), -1, dtype=torch.long)
        self.local_len = 0
        self.shard_lens = [0] * self.cp_size
        self.step: StepPlan | None = None
        self._new_counts: list[int] = [0] * self.cp_size
        self.rope_table: torch.Tensor | None = None

    def reset(self):
        super().reset()
        self.local_positions.fill_(-1)
        self.local_len = 0
        self.shard_lens = [0] * self.cp_size
        self.step = None

    @property
    def total_len(self) -> int:
        """Tokens cached over the whole CP group."""
        return sum(self.shard_lens)

    def bind_rope(self, model) -> None:
        """Keep the model's un-sharded RoPE table so layers can rotate at global positions."""
        rotary = getattr(model, "rotary_pos_emb", None)
        if rotary is None or not hasattr(rotary, "get_emb"):
            self.rope_table = None
            return
        if getattr(model, "position_embedding_type", "rope") != "rope":
            raise NotImplementedError(f"position_embedding_type={model.position_embedding_type!r}; only 'rope' is supported")
        self.rope_table = rotary.get_emb(self.max_sequence_length)  # [S, 1, 1, rot_dim]

    def apply_rope(self, query, key, positions, config, cp_group):
        """Rotate query/key ([s, b, h, d]) at their global ``positions`` with Megatron's own RoPE."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if self.rope_table is None:
            raise RuntimeError("the model uses RoPE but TreeInferenceContext.bind_rope(model) was not called")
        emb = self.rope_table.index_select(0, positions.to(self.rope_table.device))
        query = apply_rotary_pos_emb(query, emb, config=config, cp_group=cp_group)
        key = apply_rotary_pos_emb(key, emb, config=config, cp_group=cp_group)
        return query, key

    def buffers(self, layer_number: int, key, value):
        """This layer's shard buffers ``[capacity, max_batch, hkv, d]``, allocated on first use."""
        if layer_number not in self.key_value_memory_dict:
            shape = (self.capacity, self.max_batch_size, key.shape[2], key.shape[3])
            self.key_value_memory_dict[layer_number] = (
                torch.empty(shape, dtype=key.dtype, device=key.device),
                torch.empty(shape, dtype=value.dtype, device=value.device),
            )
        return self.key_value_memory_dict[layer_number]

    def plan_step(self, start: int, num_tokens: int) -> StepPlan:
        """Plan the forward of tokens at global positions ``[start, start + num_tokens)``."""
        if start != self.total_len:
            raise RuntimeError(
                f"step starts at position {start} but {self.total_len} tokens are cached; the CP-sharded cache "
                "appends in order"
            )
        if start + num_tokens > self.max_sequence_length:
            raise ValueError(
                f"{start + num_tokens} tokens exceed max_sequence_length={self.max_sequence_length}"
            )
        p = self.cp_size
        if self.total_len == 0:
            padded = -(-num_tokens // (2 * p)) * 2 * p
            index = load_balanced_positions(padded, p, self.cp_rank)
            positions = index + start
            store = index < num_tokens
            gathered = torch.cat([load_balanced_positions(padded, p, r) for r in range(p)]) + start
            counts = [int((load_balanced_positions(padded, p, r) < num_tokens).sum()) for r in range(p)]
            plan = StepPlan("prefill", index, positions, store, gathered, padded)
        else:
            counts = list(self.shard_lens)
            owners = []
            for _ in range(num_tokens):
                owner = min(range(p), key=lambda r: (counts[r], r))
                owners.append(owner)
                counts[owner] += 1
            counts = [c - s for c, s in zip(counts, self.shard_lens)]
            index = torch.arange(num_tokens)
            store = torch.tensor([o == self.cp_rank for o in owners], dtype=torch.bool)
            plan = StepPlan("decode", index, index + start, store, None, num_tokens)
        n_new = int(plan.store.sum())
        if self.local_len + n_new > self.capacity:
            raise RuntimeError(f"CP shard overflow: {self.local_len + n_new} tokens > capacity {self.capacity}")
        self.local_positions[self.local_len : self.local_len + n_new] = plan.positions[plan.store]
        self._new_counts = counts
        self.step = plan
        return plan

    def commit_step(self) -> None:
        """Account the planned step's stored tokens (after every layer has written them)."""
        if self.step is None:
            raise RuntimeError("commit_step() without plan_step()")
        self.local_len += int(self.step.store.sum())
        self.shard_lens = [a + b for a, b in zip(self.shard_lens, self._new_counts)]
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
        plan = ctx.plan_step(start, s)
        if plan.padded_len > s:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(b, plan.padded_len - s)], dim=1)
        index = plan.index.to(tokens.device)
        local_tokens = tokens.index_select(1, index)
        local_pos = plan.positions.to(tokens.device)[None, :].expand(b, -1)
        only_last = ctx.materialize_only_last_token_logits
        if plan.mode == "prefill":
            ctx.materialize_only_last_token_logits = False
        try:
            logits = self.model(
                local_tokens, local_pos, None, inference_context=ctx, runtime_gather_output=True
            )
        finally:
            ctx.materialize_only_last_token_logits = only_last
        if plan.mode == "prefill":
            gathered = _gather_seq(logits.transpose(0, 1), ctx.groups.cp_group, ctx.cp_size).transpose(0, 1)
            order = torch.argsort(plan.gathered_positions).to(gathered.device)
            logits = gathered.index_select(1, order)[:, :s]
            if only_last:
                logits = logits[:, -1:]
        ctx.commit_step()
        return logits
