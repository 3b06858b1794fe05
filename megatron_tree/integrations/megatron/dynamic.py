"""Megatron-Core's dynamic inference engine at context parallelism > 1: a paged KV cache sharded over CP.

Invariant: Megatron's scheduler runs unchanged and identically on every CP rank (same
requests, same steps, same sampled tokens), every rank computes every token of a step
(embeddings, projections, MLP), and only the KV cache and the attention over it are split:
each rank stores the keys/values of its own blocks (:class:`~megatron_tree.decode.paged.PagedKVCache`)
and attends every query of the step to them; ``comm.merge`` (the tree merge) makes the
result exact and identical on every rank. Prefill chunks and decode tokens take the same
path: each token is one query row whose causal window on a rank is a prefix of that
rank's slots (``cache_seqlens``), so a chunk's attention is split over the ranks and each
rank stores only its blocks of the chunk.

Why it lives here: Megatron's dynamic context, engine and attention are private
territory (``integrations/megatron/static.py`` holds the static-batching integration and the
core-attention slot we fill); this module adds the dynamic pieces beside it:

* :class:`TreeDynamicInferenceContext` -- a ``DynamicInferenceContext`` whose scheduling
  (request slots, block accounting, chunked prefill, pausing, eviction) is Megatron's own,
  with a logical block of ``CP * block_size_tokens`` tokens, and whose KV storage is a
  :class:`PagedKVCache` of blocks of ``block_size_tokens`` per rank (Megatron's own
  ``memory_buffer`` is allocated empty). A request of L tokens holds
  ``ceil(L / (CP * block_size))`` logical blocks and at most as many blocks on any rank (the
  placement is round-robin by block), so Megatron's admission control guarantees every
  rank's pool has room: no rank runs out while Megatron believes there is space.
* :class:`TreeDynamicGPTInferenceWrapper` -- a ``GPTInferenceWrapper`` that checks the model's
  attention slots and binds the model's unsharded RoPE table.
* :meth:`TreeDynamicInferenceContext.store_key_value` and :meth:`~TreeDynamicInferenceContext.attend`
  -- what ``TreeDotProductAttention`` asks a dynamic context to do (it never imports this
  module), reached through ``TreeSelfAttention``'s two hooks (``_adjust_key_value_for_inference``
  and ``flash_decode_and_prefill``): RoPE at global positions, store this rank's tokens, then
  ``tree_decode`` over this rank's pages (the tree merge).
  :func:`adjust_key_value_dynamic` and :func:`dynamic_attention` are the same as functions.

Both releases: 0.16.1 builds the context from keywords, 0.19 from ``(model_config,
inference_config)``; what else differs (the block allocator's name, the KV buffer's allocation
hook, the bookkeeping keywords) is asked of :mod:`.version`.
* :func:`build_dynamic_engine` / :func:`generate_dynamic` -- the engine for a model built
  with either Megatron's or our layer spec, and a greedy run with requests arriving at
  given steps (what the eval and the tests call).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...distributed import agreement
from ...decode.generate import DecodeStep, row_digest, tokens_digest
from ...decode.paged import PagedKVCache, TokenSlots
from ...distributed.topology import TreeGroups
from .attention import PagedLayer, check_context_groups, check_tree_slots
from .groups import tree_groups_from_megatron
from .static import unsharded_rope_table
from .version import check_supported, init_gpt_wrapper, kv_block_allocator, refuse_unsupported_features

__all__ = [
    "TreeDynamicInferenceContext", "TreeDynamicGPTInferenceWrapper", "adjust_key_value_dynamic",
    "dynamic_attention", "build_dynamic_engine", "generate_dynamic", "DynamicRun", "dynamic_kv_bytes",
]


def _dynamic_context_base():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    return DynamicInferenceContext


@dataclass(frozen=True)
class DynamicStep:
    """One forward of the dynamic batch, as this CP rank sees it."""

    num_tokens: int
    """Real tokens in the step (Megatron's ``active_token_count``)."""
    padded_tokens: int
    """Rows of the forward (``padded_active_token_count``); rows past ``num_tokens`` are padding."""
    positions: torch.Tensor
    """(padded_tokens,) int64 global position of each row's token in its request (0 for padding),
    on the cache's device."""
    placed: TokenSlots
    """Owner rank and storage slot of each real token (rows ``0 .. num_tokens - 1``), and where this
    rank writes it (the spare slot for other ranks' tokens)."""
    block_table: torch.Tensor
    """(padded_tokens, width) int32 this rank's blocks of each row's request."""
    cache_seqlens: torch.Tensor
    """(padded_tokens,) int32 keys on this rank each row may see (causal); 0 for padding."""


class TreeDynamicInferenceContext(_dynamic_context_base()):
    """A ``DynamicInferenceContext`` whose paged KV cache is sharded over the CP group.

    Built as the release builds Megatron's: 0.16.1 ``TreeDynamicInferenceContext(**keywords)``
    (``DynamicInferenceContext``'s keyword arguments), 0.19 ``TreeDynamicInferenceContext(model_config,
    inference_config)``; both take ``groups`` (a :class:`TreeGroups`) or ``pg_collection`` to take
    them from. Two meanings change:

    block_size_tokens: tokens per KV block on one rank (Megatron schedules in logical
        blocks of ``cp_size * block_size_tokens`` tokens, one block on every rank)
    buffer_size_gb: KV memory of *one* CP rank (Megatron's own argument is the whole cache)

    The KV cache is :attr:`kv_cache` (``PagedKVCache``: ``(layers, blocks, block_size, kv_heads,
    head_dim)`` per rank); Megatron's own ``memory_buffer`` is allocated with no token slots (its
    allocation hook is overridden: ``allocate_all_tensors`` in 0.16.1, ``_allocate_memory_buffer``
    in 0.19; the constructor checks that it ran). ``max_sequence_length`` is rounded up to an even
    number (Megatron slices its RoPE table into 2·CP chunks at CP > 1).

    0.19's speculative decoding (``num_speculative_tokens``, MTP drafts) runs through the same
    path: a decode request's 1 + k query rows are placed and attended like a prefill chunk's, the
    draft tokens the model rejects are dropped where Megatron rewinds them (``rewind_kv_cache``:
    the next step's plan truncates the paged rows to Megatron's counts before any row grows), and
    the MTP layers' draft step runs replicated on every rank (see
    ``TreeDotProductAttention.replicated_in_inference``).

    Unsupported (refused): CUDA graphs, MLA latent caches, hybrid (Mamba) models, unified
    memory, flashinfer RoPE, suspending the engine, and 0.19's prefix caching, asynchronous
    scheduling and KV offload.
    """

    def __init__(self, model_config=None, inference_config=None, *, groups: TreeGroups | None = None,
                 pg_collection=None, **kwargs):
        api = check_supported("TreeDynamicInferenceContext")
        self.groups = groups if groups is not None else tree_groups_from_megatron(pg_collection)
        self.cp_size, self.cp_rank = self.groups.size, self.groups.rank
        if api.inference_config:
            if kwargs or model_config is None or inference_config is None:
                raise TypeError(
                    f"megatron-core {api.version}: TreeDynamicInferenceContext(model_config, inference_config, "
                    f"groups=..., pg_collection=...), got keywords {sorted(kwargs)}"
                )
            refuse_unsupported_features(model_config, inference_config)
            per_rank_block = self._check_block(inference_config.block_size_tokens)
            per_rank_gb = inference_config.buffer_size_gb
            logical = dataclasses.replace(
                inference_config, block_size_tokens=self.cp_size * per_rank_block,
                buffer_size_gb=per_rank_gb * self.cp_size,  # Megatron divides by its (logical) block bytes
                max_sequence_length=self._even(inference_config.max_sequence_length), use_flashinfer_fused_rope=False,
            )
            super().__init__(model_config, logical)
        else:
            if model_config is not None or inference_config is not None:
                raise TypeError(
                    f"megatron-core {api.version}: TreeDynamicInferenceContext takes DynamicInferenceContext's "
                    "keyword arguments (there is no InferenceConfig in this release)"
                )
            for key in ("cache_mla_latent", "mamba_inference_state_config", "use_flashinfer_fused_rope",
                        "unified_memory_level"):
                if kwargs.get(key):
                    raise NotImplementedError(f"TreeDynamicInferenceContext does not support {key}={kwargs[key]!r}")
            for key in ("buffer_size_gb", "max_sequence_length"):
                if key not in kwargs:
                    raise TypeError(f"TreeDynamicInferenceContext needs the keyword argument {key}")
            per_rank_block = self._check_block(kwargs.pop("block_size_tokens", 16))
            per_rank_gb = kwargs.pop("buffer_size_gb")
            kwargs["use_flashinfer_fused_rope"] = False
            super().__init__(
                block_size_tokens=self.cp_size * per_rank_block,
                buffer_size_gb=per_rank_gb * self.cp_size,  # Megatron divides by its (logical) block bytes
                max_sequence_length=self._even(kwargs.pop("max_sequence_length")),
                **kwargs,
            )
        buffer = getattr(self, "memory_buffer", None)
        if buffer is not None and buffer.numel() != 0:
            raise RuntimeError(
                f"megatron-core {api.version} allocated a {tuple(buffer.shape)} KV buffer on every rank: "
                f"its allocation hook is not {api.kv_buffer_hook}, which TreeDynamicInferenceContext overrides to "
                "keep each rank's KV memory at 1/CP"
            )
        usable = kv_block_allocator(self).total_count - 1  # Megatron keeps one dummy block
        if usable * self.block_size_tokens < self.max_sequence_length:
            raise ValueError(
                f"buffer_size_gb={per_rank_gb} per rank holds {usable} blocks of {per_rank_block} tokens per "
                f"rank = {usable * self.block_size_tokens} tokens over the {self.cp_size} CP ranks, fewer than "
                f"max_sequence_length={self.max_sequence_length}: a request of the full context window could never "
                "be scheduled; give each rank more KV memory or shorten the context window"
            )
        self.kv_cache = PagedKVCache(
            num_layers=self.num_attention_layers, num_kv_heads=self.num_attention_heads_per_partition,
            head_dim=self.hidden_size_per_attention_head, block_size=per_rank_block, blocks_per_rank=usable,
            max_seq_len=self.max_sequence_length, cp_size=self.cp_size, cp_rank=self.cp_rank,
            dtype=self.params_dtype, device=torch.cuda.current_device(),
        )
        self.step: DynamicStep | None = None
        self.rewound_tokens = 0
        """Tokens dropped where Megatron rewound a request (see initialize_attention_state): placeholders
        of a stalled chunked prefill, and draft tokens the target rejected in speculative decoding."""
        self.broken_requests: dict = {}
        """Request id -> why it failed: its paged cache could not follow Megatron's (see _break_request)."""
        self.rope_table: torch.Tensor | None = None

    @staticmethod
    def _check_block(block_size_tokens) -> int:
        if not isinstance(block_size_tokens, int) or block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be a positive integer, got {block_size_tokens!r}")
        return block_size_tokens

    @staticmethod
    def _even(max_sequence_length) -> int:
        return int(max_sequence_length) + int(max_sequence_length) % 2

    # -- storage: Megatron's buffer stays empty, the paged cache holds this rank's blocks ----------

    def _without_token_slots(self, allocate):
        # Megatron sizes memory_buffer [2, layers, blocks, block_size_tokens, heads, dim] by
        # block_size_tokens and uses it nowhere else here; the KV lives in self.kv_cache.
        logical = self.block_size_tokens
        self.block_size_tokens = 0
        try:
            return allocate()
        finally:
            self.block_size_tokens = logical

    def allocate_all_tensors(self, *, is_init: bool) -> None:
        """0.16.1's KV allocation hook (absent from 0.19, so never called there)."""
        self._without_token_slots(lambda: super(TreeDynamicInferenceContext, self).allocate_all_tensors(is_init=is_init))

    def _allocate_memory_buffer(self, *args, **kwargs):
        """0.19's KV allocation hook (absent from 0.16.1, so never called there)."""
        return self._without_token_slots(
            lambda: super(TreeDynamicInferenceContext, self)._allocate_memory_buffer(*args, **kwargs))

    def deallocate_all_tensors(self):
        raise NotImplementedError("TreeDynamicInferenceContext does not support suspending the engine")

    def append_key_value_cache(self, layer_number: int, key, value) -> None:
        raise RuntimeError(
            "TreeDynamicInferenceContext keeps the KV cache sharded over the CP group in .kv_cache; the model's "
            "layers must hold TreeSelfAttention and TreeDotProductAttention (get_gpt_layer_tree_spec)"
        )

    key_value_cache = append_key_value_cache

    def reset(self, *args, **kwargs) -> None:
        super().reset(*args, **kwargs)
        if hasattr(self, "kv_cache"):
            self.kv_cache.reset()
        self.step = None

    def release_memory_blocks_from_request_indexes(self, request_indexes) -> None:
        # Megatron calls this for finished and evicted requests: their blocks go back on every rank.
        for rid in self.request_ids[request_indexes].reshape(-1).tolist():
            if rid in self.kv_cache:
                self.kv_cache.free(rid)
        super().release_memory_blocks_from_request_indexes(request_indexes)

    def _break_request(self, rid, offset: int, message: str) -> None:
        """Fail one request whose paged cache cannot follow Megatron's count (every rank alike: the
        bookkeeping is identical): it gets ``offset`` slots of stale keys/values so the step runs,
        and :func:`generate_dynamic` reports it FAILED with ``message`` and no tokens."""
        if rid in self.kv_cache:
            self.kv_cache.free(rid)
        try:
            self.kv_cache.extend_host(rid, offset)
        except Exception as err:  # noqa: BLE001 -- no room even for that: the step cannot run
            raise RuntimeError(f"{message}; and no blocks to keep it running: {err}") from err
        self.broken_requests.setdefault(rid, message)

    # -- one step: where this step's tokens go and what each query row sees -------------------

    def initialize_attention_state(self, *, construct_graph_dimensions=None, **kwargs):
        """Megatron's bookkeeping (0.19's keywords passed on, its returned event returned), then the plan."""
        if construct_graph_dimensions is not None:
            raise NotImplementedError("TreeDynamicInferenceContext does not support CUDA graphs")
        event = super().initialize_attention_state(**kwargs)
        n, padded = self.active_token_count, self.padded_active_token_count
        active = slice(self.paused_request_count, self.total_request_count)
        rids = self.request_ids[active].tolist()
        offsets = self.request_kv_length_offsets[active].tolist()
        lengths = self.request_query_lengths[active].tolist()
        if self.cp_size > 1 and any(o == 0 for o in offsets):
            self._agree_on_new_requests(n, rids, offsets, lengths)
        # Follow Megatron's rewinds first, for every request (paused ones too), so that the blocks it
        # took back are back in every rank's pool before any request grows: a chunked prefill that got
        # no chunk ran a placeholder token, which the next chunk overwrites (add_request resets its kv
        # offset); with speculative decoding, the draft tokens the target rejected (rewind_kv_cache).
        # Drop the tokens past Megatron's count, free the blocks alike on every rank.
        held = slice(0, self.total_request_count)
        whys: dict = {}
        for rid, offset in zip(self.request_ids[held].tolist(), self.request_kv_length_offsets[held].tolist()):
            have = self.kv_cache.length(rid) if rid in self.kv_cache else 0
            if have > offset:
                try:
                    self.kv_cache.truncate(rid, offset)
                    self.rewound_tokens += have - offset
                except ValueError as err:
                    whys[rid] = f" ({err})"
        placed: dict = {}
        for rid, offset, q_len in zip(rids, offsets, lengths):
            have = self.kv_cache.length(rid) if rid in self.kv_cache else 0
            why = whys.get(rid, "")
            if have != offset:
                self._break_request(rid, offset, f"request {rid}: Megatron's context has {offset} cached tokens but "
                                             f"the paged cache holds {have}{why}; its tokens are not computed "
                                             "exactly, so it fails (the other requests are unaffected)")
            placed[rid] = [torch.as_tensor(x, dtype=torch.int64) for x in self.kv_cache.extend_host(rid, q_len)]
        req_of_token = self.request_ids[self.token_to_request_idx[:n]].tolist()
        positions = torch.zeros(padded, dtype=torch.int64)
        positions[:n] = self.token_to_pos_ids[:n].cpu()
        owners = torch.empty(n, dtype=torch.int64)
        slots = torch.empty(n, dtype=torch.int64)
        for rid, (p_pos, p_owners, p_slots) in placed.items():
            rows = torch.tensor([i for i, r in enumerate(req_of_token) if r == rid], dtype=torch.int64)
            if rows.numel() != p_pos.numel():
                raise RuntimeError(f"request {rid}: {rows.numel()} tokens in the step, {p_pos.numel()} placed")
            index = positions[rows] - p_pos[0]
            owners[rows], slots[rows] = p_owners[index], p_slots[index]
        table, seqlens = self.kv_cache.rows_host(req_of_token + [None] * (padded - n), positions)
        # The step's write indices, block table, visible key counts and positions: one copy to the device.
        step_slots, (table, seqlens, device_positions) = self.kv_cache.token_slots(
            positions[:n], owners, slots, extra=[table, seqlens, positions])
        self.step = DynamicStep(n, padded, device_positions, step_slots, table.to(torch.int32),
                                seqlens.to(torch.int32))
        return event

    def _agree_on_new_requests(self, n: int, rids, offsets, lengths) -> None:
        """A step that starts requests: every CP rank must run the same ones, else all raise one error.

        Each rank's engine schedules its own requests; ranks given different prompts through Megatron's own
        API (``add_request``, ``MegatronLLM.generate``; ``generate_dynamic`` checks its arguments before)
        would place and attend the tokens of different sequences as one. Steps that start a request only
        (never a decode-only step): one fixed-size all-gather of the step's token count and a digest of its
        request ids, offsets, query lengths and token ids.
        """
        digest = tokens_digest(self.token_to_input_ids[:n], repr((rids, offsets, lengths)).encode())
        agreement.agree("TreeDynamicInferenceContext (a step that starts new requests)",
                        ("step tokens", "digest of the step's requests, offsets, query lengths and token ids"),
                        (n, digest), self.groups.cp_group, self.groups.cp_ranks, device=self.kv_cache.k.device)

    # -- what the core attention asks of the context -----------------------------------------

    def store_key_value(self, core, attention, query, key, value, rotary_pos_emb):
        """The KV-cache hook, asked by ``TreeDotProductAttention``: see :func:`adjust_key_value_dynamic`."""
        return adjust_key_value_dynamic(core, attention, self, query, key, value, rotary_pos_emb)

    def attend(self, core, q, layer: int, block_table: torch.Tensor):
        """The dynamic-attention hook, asked by ``TreeDotProductAttention`` for ``layer`` (whose keys it stored):
        q [T, 1, hq, d] -> out [T, 1, hq, d], exact over the CP group (``tree_decode`` over the pages).
        block_table: (T, width) int32, the step's, as the KV-cache hook handed it over (``PagedLayer``)."""
        step = self.step
        # The one attention call of every integration (``tree_decode`` over this rank's pages). Megatron's
        # engine has no place to run a step again, so ``shifted`` runs as ``packed`` here.
        return DecodeStep(core.strategy, core.comm_stats).attend(
            layer, q, self.kv_cache.k[layer], self.kv_cache.v[layer], self.groups, block_table=block_table,
            cache_seqlens=step.cache_seqlens, softmax_scale=core.softmax_scale, backend=core.backend,
        )

    # -- RoPE at global positions ------------------------------------------------------------

    def bind_rope(self, model) -> None:
        """Keep the model's unsharded RoPE table (Megatron's own is sliced per CP rank at CP > 1)."""
        self.rope_table = unsharded_rope_table(model, self.max_sequence_length)

    def apply_rope(self, query, key, positions, config, cp_group):
        """Rotate query/key ([T, 1, h, d]) at the step's global ``positions`` with Megatron's RoPE."""
        from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

        if self.rope_table is None:
            raise RuntimeError("the model uses RoPE but TreeDynamicInferenceContext.bind_rope(model) was not called")
        emb = self.rope_table.index_select(0, positions.to(self.rope_table.device))
        return (apply_rotary_pos_emb(query, emb, config=config, cp_group=cp_group),
                apply_rotary_pos_emb(key, emb, config=config, cp_group=cp_group))


# --------------------------------------------------------------------------- core-attention hooks


def adjust_key_value_dynamic(core, attention, ctx, query, key, value, rotary_pos_emb):
    """The KV-cache hook for a dynamic context: RoPE, store this rank's tokens, hand back the layer's pages.

    query: [T, 1, hq, d]; key, value: [T, 1, hkv, d] (T = padded tokens of the step).
    Returns Megatron's tuple ``(query, key, value, rotary_pos_emb=None, attn_mask_type,
    block_table)`` with ``block_table`` a :class:`~.attention.PagedLayer` (Megatron passes it unread
    to the dynamic attention, :func:`dynamic_attention`), or ``None`` for Megatron's own
    ``DynamicInferenceContext`` at CP = 1.
    """
    from megatron.core.transformer.enums import AttnMaskType

    if not isinstance(ctx, TreeDynamicInferenceContext):
        if core.cp_size == 1:
            return None
        raise RuntimeError(
            f"TreeDotProductAttention at context_parallel_size={core.cp_size} needs a TreeDynamicInferenceContext "
            f"for dynamic batching (got {type(ctx).__name__}); Megatron's DynamicInferenceContext keeps every "
            "request's whole KV cache on every rank"
        )
    step = ctx.step
    if step is None:
        raise RuntimeError(
            "TreeDynamicInferenceContext has no planned step; initialize_attention_state() was not called"
        )
    if query.shape[0] != step.padded_tokens or query.shape[1] != 1:
        raise ValueError(
            f"query has [s, b] = {tuple(query.shape[:2])}, but the step has {step.padded_tokens} packed tokens"
        )
    if rotary_pos_emb is not None:
        query, key = ctx.apply_rope(query, key, step.positions, attention.config, core.pg_collection.cp)
    layer = ctx.layer_map[attention.layer_number - 1]
    n = step.num_tokens
    ctx.kv_cache.write(layer, key[:n, 0], value[:n, 0], step.placed)
    return query, key, value, None, AttnMaskType.no_mask, PagedLayer(ctx, layer, step.block_table)


def dynamic_attention(core, attention, q, k, v, *megatron_args):
    """The dynamic-attention hook: attention of every row of the packed batch, exact over the CP group.

    q: [T, 1, hq, d] -> out [T, 1, hq, d] (Megatron's ``s b h d``). ``None`` when the preceding
    cache hook did not take over (Megatron's own context at CP = 1).
    """
    return core.dynamic_attention(attention, q, k, v, *megatron_args)


# --------------------------------------------------------------------------- wrapper


def _gpt_wrapper_base():
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    return GPTInferenceWrapper


def _core_attentions(model):
    from megatron.core.utils import unwrap_model

    return [layer.self_attention.core_attention for layer in unwrap_model(model).decoder.layers]


def _mtp_core_attentions(model) -> list:
    """The core attention of each multi-token-prediction (MTP) layer of a GPT model (``[]``: no MTP block)."""
    from megatron.core.utils import unwrap_model

    mtp = getattr(unwrap_model(model), "mtp", None)
    if mtp is None:
        return []
    return [layer.mtp_model_layer.self_attention.core_attention for layer in mtp.layers]


class TreeDynamicGPTInferenceWrapper(_gpt_wrapper_base()):
    """``GPTInferenceWrapper`` for a tree-spec model and a :class:`TreeDynamicInferenceContext`.

    ``TreeDynamicGPTInferenceWrapper(model, inference_context, pg_collection=None)`` on every
    supported release (0.16.1's form with an ``InferenceWrapperConfig`` second is accepted there
    too). Checks that the model's layers hold tree attention in both slots (no patch is applied)
    and binds the model's unsharded RoPE table to the context. Every CP rank runs the whole packed
    batch, so Megatron's controller and ``DynamicInferenceEngine`` run unchanged and sample the
    same tokens on every rank.
    """

    def __init__(self, model, *args, pg_collection=None):
        from megatron.core.utils import unwrap_model

        args = list(args)
        if len(args) >= 2 and not isinstance(args[0], TreeDynamicInferenceContext):
            args.pop(0)  # 0.16.1's InferenceWrapperConfig: its sizes come from the context
        if not args or len(args) > 2:
            raise TypeError("TreeDynamicGPTInferenceWrapper(model, inference_context, pg_collection=None)")
        inference_context = args[0]
        if len(args) == 2:
            pg_collection = args[1]
        if not isinstance(inference_context, TreeDynamicInferenceContext):
            raise TypeError(
                "TreeDynamicGPTInferenceWrapper needs a TreeDynamicInferenceContext, got "
                f"{type(inference_context).__name__}"
            )
        cores = _core_attentions(model)
        if not all(hasattr(c, "dynamic_attention") for c in cores):
            raise TypeError(
                f"the model's core attention is {type(cores[0]).__name__}; build it with get_gpt_layer_tree_spec() "
                "so that TreeDotProductAttention fills the core_attention slot"
            )
        check_tree_slots(model, "TreeDynamicGPTInferenceWrapper")
        inner = unwrap_model(model)
        config = inner.config
        refuse_unsupported_features(config, getattr(inference_context, "config", None))
        if getattr(config, "flash_decode", False) or getattr(config, "cuda_graph_impl", "none") == "local":
            raise NotImplementedError(
                "flash_decode=True and CUDA graphs are not supported with the dynamic tree engine"
            )
        init_gpt_wrapper(self, model, inference_context, hidden_size=config.hidden_size,
                         params_dtype=inference_context.params_dtype, padded_vocab_size=inner.vocab_size,
                         pg_collection=pg_collection)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            raise NotImplementedError("TreeDynamicGPTInferenceWrapper does not support pipeline parallelism")
        if cores[0].cp_size != inference_context.cp_size:
            raise ValueError(
                f"the model runs at context_parallel_size={cores[0].cp_size} but the context was built for "
                f"{inference_context.cp_size} CP ranks"
            )
        check_context_groups(model, inference_context.groups, "TreeDynamicGPTInferenceWrapper")
        inference_context.bind_rope(inner)
        # 0.19 speculative decoding: after each verify step the controller runs every MTP layer
        # (compute_mtp_single_step) on the accepted positions' hidden states -- one row per request,
        # no inference context, no RoPE, causal over the rows -- identically on every CP rank.
        drafts = getattr(getattr(inference_context, "config", None), "num_speculative_tokens", 0) or 0
        for core in _mtp_core_attentions(model):
            if not hasattr(core, "replicated_in_inference"):
                if not drafts or cores[0].cp_size == 1:
                    continue  # no draft step to run, or Megatron's own attention runs it as it is
                raise TypeError(
                    f"the model's MTP layers hold {type(core).__name__} in the core_attention slot; at "
                    f"context_parallel_size={cores[0].cp_size} its serial draft step would treat the requests' "
                    "rows as a CP-sharded sequence: build the MTP block from get_gpt_layer_tree_spec() too"
                )
            core.replicated_in_inference = True


# --------------------------------------------------------------------------- engine and a greedy run


def build_dynamic_engine(model, tokenizer, *, max_sequence_length: int, buffer_size_gb: float,
                         block_size_tokens: int = 16, max_tokens: int | None = None, max_requests: int | None = None,
                         params_dtype: torch.dtype | None = None, random_seed: int = 0,
                         enable_chunked_prefill: bool = True, num_speculative_tokens: int = 0,
                         groups: TreeGroups | None = None):
    """Megatron's ``DynamicInferenceEngine`` for ``model``, tree-sharded when its spec is the tree spec.

    A model built with ``get_gpt_layer_tree_spec`` gets a :class:`TreeDynamicInferenceContext`
    over its CP groups (``buffer_size_gb`` and ``block_size_tokens`` per rank) and a
    :class:`TreeDynamicGPTInferenceWrapper`; any other model gets Megatron's own
    ``DynamicInferenceContext`` and ``GPTInferenceWrapper`` (CP must then be 1), with
    ``buffer_size_gb`` and ``block_size_tokens`` as Megatron means them. Where the release puts
    each knob (0.19: one ``InferenceConfig``; 0.16.1: context and engine keywords) is this
    function's business. num_speculative_tokens: 0.19's speculative decoding, that many MTP draft
    tokens per decode step verified by the model (it needs ``mtp_num_layers``; 0.16.1 has none).
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.utils import unwrap_model

    api = check_supported("build_dynamic_engine")
    inner = unwrap_model(model)
    config = inner.config
    dtype = params_dtype or config.params_dtype
    tree = all(hasattr(c, "dynamic_attention") for c in _core_attentions(model))
    if not tree and config.context_parallel_size != 1:
        raise ValueError(
            f"Megatron's own attention at context_parallel_size={config.context_parallel_size}: its dynamic "
            "context keeps the whole KV cache on every rank; build the model with get_gpt_layer_tree_spec()"
        )
    if api.inference_config:
        from megatron.core.inference.config import InferenceConfig

        knobs = dict(max_sequence_length=max_sequence_length, buffer_size_gb=buffer_size_gb,
                     block_size_tokens=block_size_tokens, enable_chunked_prefill=enable_chunked_prefill,
                     use_flashinfer_fused_rope=False, num_speculative_tokens=num_speculative_tokens)
        if max_tokens is not None:
            knobs["max_tokens"] = max_tokens
        if max_requests is not None:
            knobs["max_requests"] = max_requests
        if params_dtype is not None and params_dtype != config.params_dtype:
            raise ValueError(
                f"megatron-core {api.version} keeps the KV cache in the model's params_dtype={config.params_dtype}; "
                f"params_dtype={params_dtype} cannot be set apart from it"
            )
        icfg = InferenceConfig(**knobs)
        if tree:
            context = TreeDynamicInferenceContext(config, icfg, groups=groups, pg_collection=inner.pg_collection)
            wrapper = TreeDynamicGPTInferenceWrapper(model, context)
        else:
            context = DynamicInferenceContext(config, icfg)
            wrapper = GPTInferenceWrapper(model, context)
        engine_kwargs = {}
    else:
        if num_speculative_tokens:
            raise NotImplementedError(
                f"megatron-core {api.version}'s dynamic engine has no speculative decoding "
                f"(num_speculative_tokens={num_speculative_tokens}); it came with 0.19's InferenceConfig"
            )
        dims = dict(
            params_dtype=dtype, num_layers=config.num_layers // config.pipeline_model_parallel_size,
            kv_channels=config.kv_channels, num_attention_heads=config.num_query_groups or config.num_attention_heads,
            tensor_model_parallel_size=config.tensor_model_parallel_size, max_sequence_length=max_sequence_length,
            buffer_size_gb=buffer_size_gb, block_size_tokens=block_size_tokens, max_requests=max_requests,
        )
        if max_tokens is not None:
            dims["max_tokens"] = max_tokens
        if tree:
            context = TreeDynamicInferenceContext(groups=groups, pg_collection=inner.pg_collection, **dims)
            wrapper = TreeDynamicGPTInferenceWrapper(model, context)
        else:
            context = DynamicInferenceContext(**dims)
            wrapper = GPTInferenceWrapper.__new__(GPTInferenceWrapper)
            init_gpt_wrapper(wrapper, model, context, hidden_size=config.hidden_size, params_dtype=dtype,
                             padded_vocab_size=inner.vocab_size)
        engine_kwargs = dict(random_seed=random_seed, enable_chunked_prefill=enable_chunked_prefill)
    controller = TextGenerationController(wrapper, tokenizer)
    return DynamicInferenceEngine(controller, context, **engine_kwargs)


def dynamic_kv_bytes(ctx) -> dict:
    """KV bytes this rank holds in a dynamic context: Megatron's ``memory_buffer`` and, for ours, ``kv_cache``."""
    mb = getattr(ctx, "memory_buffer", None)
    out = {"megatron_memory_buffer": 0 if mb is None else mb.numel() * mb.element_size()}
    if isinstance(ctx, TreeDynamicInferenceContext):
        out["tree_kv_cache"] = sum(t.numel() * t.element_size() for t in (ctx.kv_cache.k, ctx.kv_cache.v))
    return out


@dataclass
class DynamicRun:
    """What :func:`generate_dynamic` saw."""

    tokens: dict = field(default_factory=dict)
    """Request id -> generated token ids."""
    log_probs: dict = field(default_factory=dict)
    """Request id -> log-probabilities of the generated tokens."""
    status: dict = field(default_factory=dict)
    """Request id -> Megatron's final status name (``COMPLETED``, ``FAILED``)."""
    errors: dict = field(default_factory=dict)
    """Request id -> why a failed request failed."""
    finished_step: dict = field(default_factory=dict)
    """Request id -> engine step at which it finished."""
    steps: int = 0
    """Engine steps run."""
    step_times: list = field(default_factory=list)
    """Seconds of each engine step, as Megatron timed it (its step events)."""
    blocks_per_rank: list = field(default_factory=list)
    """Per step, KV blocks in use on each CP rank (tree context only)."""
    max_blocks_per_rank: list = field(default_factory=list)
    """Per step, most blocks any one request held on any rank minus the fewest (tree context only)."""
    live_requests: list = field(default_factory=list)
    """Per step, requests holding KV blocks (tree context only)."""
    evicted: int = 0
    """Requests Megatron evicted (to be prefilled again) for lack of KV blocks."""
    rewound_tokens: int = 0
    """Tokens the paged cache dropped to follow Megatron's rewinds: placeholders of stalled chunked
    prefills and rejected draft tokens (tree context only)."""
    drafts_proposed: list = field(default_factory=list)
    """Speculative decoding (0.19): per draft position, MTP draft tokens proposed (Megatron's count)."""
    drafts_accepted: list = field(default_factory=list)
    """Per draft position, draft tokens the model accepted (Megatron's count)."""


DYNAMIC_SIGNATURE = ("requests", "prompt_lengths", "prompt_ids", "num_tokens_to_generate", "arrivals",
                     "termination_id", "max_steps", "sampling")
"""What every CP rank of one :func:`generate_dynamic` call must pass alike (checked once, before any request)."""


def _agree_on_run(context, prompts, num_tokens_to_generate, arrivals, termination_id, max_steps):
    """This rank's checks, then every CP rank must run the same requests; else all raise the same error.

    Each rank runs Megatron's scheduler on its own arguments: ranks handed different prompts,
    budgets, arrivals or stop token would schedule alike-sized steps (so the merges still match
    in size) and return tokens that neither rank's requests give. One fixed-size all-gather
    (``agreement.agree``) before any request is added; a rank whose own arguments are bad
    fails every rank with its message. Returns (prompts, counts, arrivals) as lists.
    """
    checked = {}

    def values():
        rows = [[int(t) for t in p] for p in prompts]
        n = len(rows)
        arr = [int(a) for a in arrivals] if arrivals is not None else [0] * n
        if isinstance(num_tokens_to_generate, int):
            cnt = [int(num_tokens_to_generate)] * n
        else:
            cnt = [int(c) for c in num_tokens_to_generate]
        if len(arr) != n or len(cnt) != n:
            raise ValueError(f"{n} prompts but {len(arr)} arrival steps and {len(cnt)} token counts")
        if any(a < 0 for a in arr) or any(c < 1 for c in cnt):
            raise ValueError(f"arrival steps must be >= 0 and token counts >= 1, got {arr} and {cnt}")
        checked.update(prompts=rows, counts=cnt, arrivals=arr)
        return (n, tuple(len(r) for r in rows), tuple(row_digest(r) for r in rows), tuple(cnt), tuple(arr),
                int(termination_id), int(max_steps), "greedy top_k=1")

    groups = getattr(context, "groups", None)
    group, ranks = (None, ()) if groups is None else (groups.cp_group, groups.cp_ranks)
    kv = getattr(context, "kv_cache", None)
    device = kv.k.device if kv is not None else None
    agreement.agree("generate_dynamic", DYNAMIC_SIGNATURE, values, group, ranks, device=device)
    return checked["prompts"], checked["counts"], checked["arrivals"]


def generate_dynamic(engine, prompts, *, num_tokens_to_generate, arrivals=None, termination_id: int = -1,
                     max_steps: int = 10_000, hook=None) -> DynamicRun:
    """Greedy continuous batching: request i (``prompts[i]``, token ids) joins before step ``arrivals[i]``.

    num_tokens_to_generate: one int, or one per request. Returns a :class:`DynamicRun`;
    every CP rank must call it with the same arguments (each runs the same scheduler).
    hook: optional, with ``before_step(step)`` and ``after_step(step)`` called around each
    engine step (the eval times steps between a CP barrier and a device sync this way).
    """
    from megatron.core.inference.sampling_params import SamplingParams

    context = engine.context
    if isinstance(context, TreeDynamicInferenceContext):
        context.broken_requests.clear()
    prompts, counts, arrivals = _agree_on_run(context, prompts, num_tokens_to_generate, arrivals, termination_id,
                                              max_steps)
    n = len(prompts)
    run = DynamicRun()
    step = 0
    while True:
        for i in range(n):
            if arrivals[i] != step:
                continue
            if len(prompts[i]) + counts[i] > context.max_sequence_length:
                run.errors[i] = (
                    f"request {i}: {len(prompts[i])} prompt + {counts[i]} new tokens exceed the context window "
                    f"of {context.max_sequence_length} tokens (max_sequence_length)"
                )
            params = SamplingParams(top_k=1, num_tokens_to_generate=counts[i], termination_id=termination_id,
                                    return_log_probs=True, skip_prompt_log_probs=True)
            engine.add_request(i, list(prompts[i]), params)
        if not engine.has_unfinished_requests() and not engine.failed_request_ids:
            later = [a for a in arrivals if a > step]
            if not later:
                break
            step = min(later)  # nothing to run until the next arrival
            continue
        if step >= max_steps:
            raise RuntimeError(f"the dynamic engine did not finish within {max_steps} steps")
        if hook is not None:
            hook.before_step(step)
        result = engine.step_modern()
        if hook is not None:
            hook.after_step(step)
        step += 1
        run.step_times.append(float(result["step_time"]))
        for record in result["finished_request_records"]:
            req = record.merge()
            rid = req.request_id
            run.tokens[rid] = [int(t) for t in req.generated_tokens]
            run.log_probs[rid] = list(req.generated_log_probs or [])
            run.status[rid] = req.status.name
            run.finished_step[rid] = step
            if req.status.name == "FAILED":
                run.errors.setdefault(rid, f"request {rid} failed: {[str(e) for e in req.events]}")
            broken = getattr(context, "broken_requests", {}).pop(rid, None)
            if broken is not None:
                run.tokens[rid], run.log_probs[rid], run.status[rid] = [], [], "FAILED"
                run.errors[rid] = broken
        if isinstance(context, TreeDynamicInferenceContext):
            run.blocks_per_rank.append(context.kv_cache.blocks_used())
            spread = [max(b) - min(b) for b in (context.kv_cache.request_blocks(r) for r in context.kv_cache.requests)]
            run.max_blocks_per_rank.append(max(spread, default=0))
            run.live_requests.append(len(context.kv_cache.requests))
    run.steps = step
    run.evicted = engine.evicted_request_count
    run.rewound_tokens = getattr(context, "rewound_tokens", 0)
    if getattr(engine, "num_speculative_tokens", 0):  # the engine's own acceptance counters
        run.drafts_proposed = [int(x) for x in engine._spec_tokens_proposed_per_pos.tolist()]
        run.drafts_accepted = [int(x) for x in engine._spec_tokens_accepted_per_pos.tolist()]
    return run
