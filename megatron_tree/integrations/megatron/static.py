"""Megatron-Core's static inference engine at context parallelism > 1: a KV cache sharded along the sequence.

Invariant: every attention is exact attention over the whole sequence, whatever the CP size;
the KV cache of each row is split over the CP group by :mod:`megatron_tree.decode.placement`
(the rule every cache shares): the prompt in the training CP layout
(``get_batch_on_this_cp_rank``'s 2·CP load-balanced chunks), decoded tokens in blocks,
round-robin over the ranks. Nothing falls back to CP = 1.

Pieces, and how they meet inside Megatron's own inference path (0.16.1 and 0.19.x alike):

* :class:`TreeInferenceContext` is a ``StaticInferenceContext`` whose KV cache is sharded over
  the CP group; the core attention asks it to store each layer's keys
  (:meth:`TreeInferenceContext.store_key_value`).
* :class:`TreeGPTInferenceWrapper` is a ``GPTInferenceWrapper`` that hands each CP rank its
  chunks of the prompt and assembles the logits the controller asks for on every rank
  (``decode.prefill.assemble_logits``), so ``TextGenerationController`` and
  ``StaticInferenceEngine`` run unchanged.
* The model's layers hold tree attention in both slots (:mod:`.attention`); no Megatron
  source is patched.

Why a module of its own: the static engine's context and wrapper; the dynamic engine's live
in :mod:`.dynamic`, the attention in :mod:`.attention`, the groups in :mod:`.groups`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...distributed import agreement
from ...decode.placement import RowPlacement
from ...decode.plan import StepPlanner, place_prompts
from ...decode.generate import tokens_digest
from ...decode.prefill import assemble_logits
from ...distributed.topology import TreeGroups
from .attention import CorePlan, check_context_groups, check_tree_slots
from .groups import tree_groups_from_megatron
from .version import (check_megatron_version, get_only_last_token_logits, init_gpt_wrapper, megatron_api,
                      prep_model_for_inference, set_only_last_token_logits)

__all__ = ["TreeInferenceContext", "TreeGPTInferenceWrapper", "ForwardPlan", "unsharded_rope_table"]


# --------------------------------------------------------------------------- inference context


@dataclass(frozen=True)
class ForwardPlan:
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
    k_lengths: torch.Tensor | None = None
    """decode: (batch,) int32 tokens of each row this rank holds after the step, on the cache's device."""
    same_positions: bool | None = None
    """Every row's tokens sit at the same positions (known on the host; ``None``: not known)."""
    attend: object | None = None
    """decode: the decode loop's ``decode.generate.DecodeStep`` whose ``attend`` every layer runs
    (``None``: a plain step of the core attention's ``strategy``)."""

    @property
    def width(self) -> int:
        """Tokens per row this rank feeds to the forward (the same on every CP rank)."""
        return int(self.index.numel())


@dataclass(frozen=True, eq=False)
class _StepLayers:
    """What every layer of one planned forward shares in :meth:`TreeInferenceContext.store_key_value`."""

    slot: torch.Tensor
    """[width, rows] int64: where this rank writes each token of the forward (its slot, or the spare slot)."""
    rows: torch.Tensor
    """[width, rows] int64: the batch row of each of those writes."""
    n: int | None
    """decode: the key slots the attention reads (the longest row this rank holds); prefill: None."""
    meta: CorePlan
    """The core attention's metadata for the forward (handed over in Megatron's ``attn_mask_type`` slot)."""


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

    materialize_only_last_token_logits = property(get_only_last_token_logits, set_only_last_token_logits)
    """Megatron's flag, wherever the release keeps it (the context in 0.16.1, ``context.config`` in 0.19),
    so the wrapper's ``_forward`` and Megatron's controller read and write one value."""

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
        self.step: ForwardPlan | None = None
        self.rope_table: torch.Tensor | None = None
        self._planner = StepPlanner([], self.cp_rank, spare=self.capacity, device="cpu")
        self._decode: tuple | None = None  # (the planner's plan, the ForwardPlan made from it)
        self._layers: tuple | None = None  # (the ForwardPlan, what every layer of its step shares: _StepLayers)
        self._new_rows()

    def _empty_row(self) -> RowPlacement:
        return RowPlacement(self.cp_size, layout=self.layout, block_size=self.block_size, capacity=self.capacity)

    def _new_rows(self) -> None:
        self.rows = [self._empty_row() for _ in range(self.max_batch_size)]
        self._planner.reset(self.rows)
        self._decode = None
        self._layers = None

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

    def plan_prefill(self, start: int, end: int, length: int) -> ForwardPlan:
        """Plan the prefill of rows ``[start, end)``, each an empty row receiving a ``length``-token prompt."""
        self._check_rows(start, end)
        if length > self.max_sequence_length:
            raise ValueError(f"a {length}-token prompt exceeds max_sequence_length={self.max_sequence_length}")
        for b in range(start, end):
            if self.rows[b].total:
                raise RuntimeError(f"row {b} already holds {self.rows[b].total} tokens; prefill needs an empty row")
        # Every row gets the same prompt length, so every row's positions on this rank are the same.
        mine = place_prompts(self.rows[start:end], [length] * (end - start), self.cp_rank)[0]
        width = mine.shape[0]
        n_mine = int((mine >= 0).sum())
        slots = torch.where(mine >= 0, torch.arange(width), torch.full_like(mine, -1))
        store = torch.where(slots >= 0, slots, torch.full_like(slots, self.capacity))  # padding: the spare slot
        rows = end - start
        self.local_positions[start:end, :n_mine] = mine[:n_mine]
        plan = ForwardPlan("prefill", (start, end), mine.clamp(min=0), mine[None].expand(rows, -1),
                        slots[None].expand(rows, -1), store[None].expand(rows, -1), same_positions=True)
        self.step = plan
        return plan

    def plan_decode(self, start: int, end: int, num_tokens: int = 1, attend=None) -> ForwardPlan:
        """Plan ``num_tokens`` new tokens at the end of every row in ``[start, end)`` (rows may differ in length).

        The step planner (``decode.plan``) places them and sends the plan to the device in one
        copy; after :meth:`rewind_step` the same call gets the same plan back. attend: the decode
        loop's ``DecodeStep``, carried by the plan to every layer's core attention (``None``: a plain step).
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
            plan = ForwardPlan("decode", (start, end), torch.arange(num_tokens, device=self.device), step.positions,
                            step.slots, step.store, k_lengths=step.counts.to(torch.int32),
                            same_positions=step.host.same_positions)
            self._decode = (step, plan)
        plan = self._decode[1]
        self.step = plan if plan.attend is attend else dataclasses.replace(plan, attend=attend)
        return self.step

    def rewind_step(self) -> None:
        """Take the last decode step back so that it runs again on the same slots (``generate``'s redo
        of a ``shifted`` step): row lengths are as before it, the next :meth:`plan_decode` of the same
        rows returns its plan again; the stored keys stay (rewriting them is idempotent)."""
        self._planner.rewind()

    def plan_step(self, start: int, num_tokens: int, batch_size: int | None = None) -> ForwardPlan:
        """Plan the forward of tokens at global positions ``[start, start + num_tokens)`` of every row.

        Megatron's controller path: rows ``batch_size_offset .. + batch_size`` (default: the
        rest of the batch), all of the same length. ``start == 0`` is the prefill.
        """
        b0 = self.batch_size_offset
        b1 = self.max_batch_size if batch_size is None else b0 + batch_size
        lengths = set(self.lengths(b0, b1))
        if lengths != {start}:
            # (a decode step planned and never committed: its forward raised, or commit_step was not called)
            open_step = self.step is not None and self.step.mode == "decode"
            raise RuntimeError(
                f"step starts at position {start} but the rows hold {sorted(lengths)} tokens; the CP-sharded cache "
                "appends in order" + ("; the last planned decode step was never committed (commit_step): if its "
                                      "forward raised, take it back with rewind_step() and plan it again"
                                      if open_step else "")
            )
        if start + num_tokens > self.max_sequence_length:
            raise ValueError(f"{start + num_tokens} tokens exceed max_sequence_length={self.max_sequence_length}")
        if start == 0:
            return self.plan_prefill(b0, b1, num_tokens)
        return self.plan_decode(b0, b1, num_tokens)

    # -- what the core attention asks of the context -----------------------------------------

    def store_key_value(self, core, attention, query, key, value, rotary_pos_emb):
        """Store this step's keys/values in this rank's shard; return what the core attention needs.

        Asked by :class:`~.attention.TreeDotProductAttention` (from ``TreeSelfAttention``'s KV-cache
        hook). query: [sq, b, hq, d]; key, value: [sq, b, hkv, d] for the tokens of this forward on
        this rank (see :class:`ForwardPlan`). Returns Megatron's tuple ``(query, key, value,
        rotary_pos_emb, attn_mask_type, block_table)`` with RoPE already applied at global
        positions (so ``rotary_pos_emb`` is ``None``), and key/value either this rank's chunks of the
        prompt (prefill: the core attention passes them round the CP ring, ``decode.prefill.ring_prefill``)
        or this rank's shard of the cache (decode), and ``attn_mask_type`` the step's
        :class:`~.attention.CorePlan` (Megatron hands it to the core attention's forward unread).
        """
        plan = self.step
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
            query, key = self.apply_rope(query, key, plan.positions, core.config, core.pg_collection.cp,
                                        same_positions=plan.same_positions)
        k_buf, v_buf = self.buffers(core.layer_number, key, value)
        shared = self._step_layers(plan, key.device)
        # Tokens another rank keeps go to the buffers' spare slot (never read; the step planner's
        # one trick): one scatter, no host read of which tokens are this rank's.
        k_buf[shared.slot, shared.rows] = key.to(k_buf.dtype)
        v_buf[shared.slot, shared.rows] = value.to(v_buf.dtype)
        if plan.mode == "prefill":  # this rank's chunks only: the core attention runs decode.prefill's ring
            keys, values = key, value
        else:
            keys, values = k_buf[:shared.n, b0:b1], v_buf[:shared.n, b0:b1]
        return query, keys, values, None, shared.meta, None

    def _step_layers(self, plan: ForwardPlan, device) -> _StepLayers:
        """What every layer of ``plan``'s step shares, made by its first layer (once per step, not per layer)."""
        if self._layers is not None and self._layers[0] is plan and self._layers[1].slot.device == device:
            return self._layers[1]
        b0, b1 = plan.rows
        slot = plan.store.to(device).t()  # [width, rows]
        rows = torch.arange(b0, b1, device=device)[None, :].expand_as(slot)
        if plan.mode == "prefill":
            n, meta = None, CorePlan("prefill", plan.positions, plan.positions)
        else:
            lengths = plan.k_lengths if plan.k_lengths is not None else self.local_lengths(b0, b1)
            n = self.local_max(b0, b1)  # host bookkeeping: no read of lengths
            meta = CorePlan("decode", plan.positions, self.local_positions[b0:b1, :n], lengths, plan.attend)
        shared = _StepLayers(slot, rows, n, meta)
        self._layers = (plan, shared)
        return shared

    def abandon_step(self) -> None:
        """Take back the planned step whose forward raised, so that planning it again starts over: a decode
        step is rewound (:meth:`rewind_step`: the same slots next time), a prefill's rows are emptied. The
        keys some layers stored stay; the step run again overwrites them. No-op without a planned step."""
        plan, self.step = self.step, None
        if plan is None:
            return
        if plan.mode == "decode":
            self.rewind_step()
            return
        b0, b1 = plan.rows
        for b in range(b0, b1):  # (the step planner shares this list: it sees the empty rows)
            self.rows[b] = self._empty_row()
        self.local_positions[b0:b1].fill_(-1)
        self._decode = None
        self._layers = None

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
    """``GPTInferenceWrapper`` for a model with tree attention in both slots and a :class:`TreeInferenceContext`.

    ``TreeGPTInferenceWrapper(model, inference_context, pg_collection=None)`` on every supported
    release; 0.16.1's ``(model, inference_wrapper_config, inference_context, pg_collection=None)``
    is accepted there too. Megatron's controller hands every rank the whole window of tokens;
    this wrapper gives each CP rank its part (prefill: its 2·CP chunks; decode: the replicated
    new tokens), runs the model, and returns logits ``[b, s or 1, vocab]`` identical on every CP
    rank. The causal mask comes from global positions, so no attention-mask tensor is built.
    Applies no patch: the model's layers must hold ``TreeSelfAttention`` (``get_gpt_layer_tree_spec``).
    """

    def __init__(self, model, *args, pg_collection=None):
        from megatron.core.utils import unwrap_model

        args = list(args)
        if args and not isinstance(args[0], TreeInferenceContext) and len(args) >= 2:
            wrapper_config = args.pop(0)  # 0.16.1's InferenceWrapperConfig: its sizes come from the context
            if not megatron_api().wrapper_config:
                raise TypeError(
                    f"megatron-core {megatron_api().version} has no InferenceWrapperConfig; call "
                    "TreeGPTInferenceWrapper(model, inference_context)"
                )
            del wrapper_config
        if not args or len(args) > 2:
            raise TypeError("TreeGPTInferenceWrapper(model, inference_context, pg_collection=None)")
        inference_context = args[0]
        if len(args) == 2:
            pg_collection = args[1]
        if not isinstance(inference_context, TreeInferenceContext):
            raise TypeError(
                f"TreeGPTInferenceWrapper needs a TreeInferenceContext, got {type(inference_context).__name__}"
            )
        check_megatron_version("TreeGPTInferenceWrapper")
        check_tree_slots(model, "TreeGPTInferenceWrapper")
        check_context_groups(model, inference_context.groups, "TreeGPTInferenceWrapper")
        inner = unwrap_model(model)
        init_gpt_wrapper(self, model, inference_context, hidden_size=inner.config.hidden_size,
                         params_dtype=inner.config.params_dtype, padded_vocab_size=inner.vocab_size,
                         pg_collection=pg_collection)
        if self.pp_group is not None and dist.get_world_size(self.pp_group) > 1:
            raise NotImplementedError(
                "TreeGPTInferenceWrapper does not support pipeline parallelism (the CP logits gather "
                "assumes every rank runs the last stage); use pipeline_model_parallel_size=1"
            )

    def prep_model_for_inference(self, prompts_tokens=None):
        from megatron.core.utils import unwrap_model

        prep_model_for_inference(self, prompts_tokens)
        self.inference_context.bind_rope(unwrap_model(self.model))

    def prep_inference_input(self, prompts_tokens):
        """Megatron's, after every CP rank has checked that it runs the same batch.

        Each rank's controller prepares its own batch (prompts padded to the longest prompt plus the
        tokens to generate); ranks handed different prompts, lengths or token budgets would feed their
        chunks of different sequences to one attention (tokens that neither batch gives) or run
        different numbers of steps (a collective mismatch). One fixed-size all-gather per batch;
        ranks that differ all raise the same ``DisagreementError`` naming each rank's values.
        """
        groups = self.inference_context.groups

        def values():
            return int(prompts_tokens.shape[0]), int(prompts_tokens.shape[1]), tokens_digest(prompts_tokens)

        agreement.agree("TreeGPTInferenceWrapper (the static engine's batch)",
                        ("batch", "prompt_tokens (prompt + tokens to generate)", "prompt_tokens digest"), values,
                        groups.cp_group, groups.cp_ranks, device=prompts_tokens.device)
        return super().prep_inference_input(prompts_tokens)

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
        only_last = ctx.materialize_only_last_token_logits
        try:
            local_tokens = tokens.index_select(1, plan.index.to(tokens.device))
            local_pos = plan.positions.clamp(min=0).to(tokens.device)
            if plan.mode == "prefill":
                ctx.materialize_only_last_token_logits = False
            logits = self.model(
                local_tokens, local_pos, None, inference_context=ctx, runtime_gather_output=True
            )
            if plan.mode == "prefill":  # this rank's chunk's logits -> the window's, on every rank (exact)
                wanted = torch.arange(s - 1 if only_last else 0, s, device=logits.device)
                logits = assemble_logits(logits, plan.positions, wanted, ctx.groups).to(logits.dtype)
        except BaseException:
            # the step never happened: its placement is taken back, so the controller's next call (the same
            # window: Megatron advances its offset only after a forward returns) plans it afresh
            ctx.abandon_step()
            raise
        finally:
            ctx.materialize_only_last_token_logits = only_last
        ctx.commit_step()
        return logits
