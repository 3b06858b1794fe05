"""Megatron-Core GPT models for the eval and generation: build, decode, compare (checkpoints: :mod:`.checkpoint`).

Invariant: the model at the run's TP x CP layout (``TreeDotProductAttention`` in the
``core_attention`` slot, KV cache sharded over CP) and the CP = 1 reference (Megatron's own
``DotProductAttention``, TP = 1, no megatron_tree code in its attention) hold the same
weights *by construction*: both are filled from one set of global tensors -- a seeded
TP = 1 model for random weights, the distributed checkpoint otherwise -- each model slicing
out its own shards through its own ``sharded_state_dict`` (the metadata Megatron's
``dist_checkpointing`` reshards with). A checkpoint is loaded at the run's layout with
``dist_checkpointing.load``, whatever layout it was saved with.

Why a module of its own: ``integrations/megatron/static.py`` holds the slots (core attention,
inference context, wrapper); this one holds what a *job* needs around them -- a Llama-style
``TransformerConfig`` from plain shape fields, checkpoint discovery and checks that run
before any process group exists (so a bad path fails on every rank alike), and
:class:`MegatronLM`, the adapter that gives a ``GPTModel`` the ``prefill`` / ``decode_step``
/ ``new_cache`` interface :func:`megatron_tree.decode.generate` drives. Its prefill runs
every prompt's full length CP-sharded, grouping rows of equal length, so a long prompt
beside a short one is not fed one token per step (as Megatron's static controller does).

Checkpoints: a ``dist_checkpointing`` directory (``metadata.json`` + ``.metadata``: what
``dist_checkpointing.save({"model": model.sharded_state_dict()}, dir)`` writes), or a
Megatron-LM ``--save`` directory (``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/``);
training arguments stored with it (``common.pt``'s ``args``) must agree with the shape given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...distributed import collectives
from ...decode.prefill import assemble_logits

__all__ = [
    "GPTShape", "transformer_config", "build_gpt", "single_rank_groups", "MegatronLM", "MegatronReference",
    "IdTokenizer",
]



class IdTokenizer:
    """Token ids as whitespace-separated text ("5 17 3"): all Megatron's controllers and engines
    ask of a tokenizer when prompts are already ids.

    eod: the end-of-document id (Megatron stops a row on it; -1 for none)
    """

    bos = None

    def __init__(self, eod: int = -1):
        self.eod = eod

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def detokenize(self, tokens) -> str:
        return " ".join(str(int(t)) for t in tokens)


@dataclass(frozen=True)
class GPTShape:
    """A Llama-style GPT: RMSNorm, SwiGLU, no linear biases, RoPE, GQA (Hugging Face field names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None
    """``None``: hidden_size / num_attention_heads."""
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    """Std of the normal init of random weights (Megatron's ``init_method_std``)."""

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


# --------------------------------------------------------------------------- checkpoints (no collectives)




# --------------------------------------------------------------------------- models


def transformer_config(shape: GPTShape, *, dtype=torch.float32, tp: int = 1, cp: int = 1, hierarchical=None):
    """The Llama-style ``TransformerConfig`` of ``shape`` at a TP x CP layout."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    import torch.nn.functional as F

    return TransformerConfig(
        num_layers=shape.num_hidden_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_key_value_heads,
        kv_channels=shape.kv_channels, normalization="RMSNorm", layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        bias_activation_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=shape.initializer_range,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        hierarchical_context_parallel_sizes=list(hierarchical) if hierarchical else None,
        attention_backend=AttnBackend.local,  # Megatron's own attention on the reference: no TE needed
    )


def single_rank_groups():
    """A ``ProcessGroupCollection`` whose groups hold this rank alone (a TP = CP = PP = 1 model).

    Collective: every rank of the default group must call it (it creates one group per rank).
    """
    from megatron.core.process_groups_config import ProcessGroupCollection

    mine = None
    for r in range(dist.get_world_size()):
        g = collectives.new_group([r], timeout=collectives.group_timeout())
        if r == dist.get_rank():
            mine = g
    pgs = ProcessGroupCollection()
    for name in ("tp", "cp", "pp", "mp", "embd", "pos_embd", "tp_cp", "dp", "dp_cp", "ep", "expt_tp", "tp_ep",
                 "tp_ep_pp", "expt_dp"):
        setattr(pgs, name, mine)
    pgs.hcp = None
    return pgs


def build_gpt(shape: GPTShape, *, tree: bool, dtype=torch.float32, tp: int = 1, cp: int = 1, hierarchical=None,
              strategy: str = "auto", pg_collection=None, seed: int | None = None):
    """A ``GPTModel`` of ``shape``; ``tree``: our core attention (any CP), else Megatron's own (CP = 1).

    Without ``pg_collection`` the model takes Megatron's ``parallel_state`` groups. ``seed``
    seeds torch's generator first (CPU initialisation: identical weights on every rank).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from .attention import get_gpt_layer_tree_spec

    if seed is not None:
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    config = transformer_config(shape, dtype=dtype, tp=tp, cp=cp, hierarchical=hierarchical)
    spec = (get_gpt_layer_tree_spec(strategy=strategy, normalization="RMSNorm") if tree
            else get_gpt_layer_local_spec(normalization="RMSNorm"))
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    model = GPTModel(
        config, spec, vocab_size=shape.vocab_size, max_sequence_length=shape.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer()
        else shape.rope_theta, share_embeddings_and_output_weights=shape.tie_word_embeddings, **kwargs,
    )
    return model.eval()



# --------------------------------------------------------------------------- decoding


@dataclass(frozen=True)
class _Config:
    vocab_size: int
    num_attention_heads: int
    """Query heads on this TP rank (the merge state's head count)."""
    head_dim: int


class MegatronLM:
    """A ``GPTModel`` with tree attention behind the interface :func:`megatron_tree.decode.generate` drives.

    prefill(prompts, cache) -> logits (batch, vocab) of each prompt's last token;
    decode_step(next_ids (batch,), cache) -> logits (batch, vocab); both identical on every
    rank of the CP group (and of the TP group: Megatron gathers the vocabulary shards).
    The cache is a :class:`~megatron_tree.integrations.megatron.TreeInferenceContext`.
    """

    def __init__(self, model, groups, shape: GPTShape, *, tp_size: int = 1):
        from megatron.core.utils import unwrap_model

        from .attention import check_context_groups, check_tree_slots

        check_tree_slots(model, "MegatronLM")
        check_context_groups(model, groups, "MegatronLM")  # its caches are placed over these groups
        self.model = model
        self.groups = groups
        self.shape = shape
        self.config = _Config(shape.vocab_size, shape.num_attention_heads // tp_size, shape.kv_channels)
        self._last: torch.Tensor | None = None
        unwrap_model(model).decoder.register_forward_hook(self._keep_last_token)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def new_cache(self, batch_size: int, max_seq_len: int, layout: str = "load_balanced", block_size: int = 16):
        from megatron.core.utils import unwrap_model

        from .static import TreeInferenceContext

        ctx = TreeInferenceContext(batch_size, max_seq_len, groups=self.groups, layout=layout, block_size=block_size)
        ctx.bind_rope(unwrap_model(self.model))
        return ctx

    def _keep_last_token(self, module, args, output):
        """Decoder output [s, b, h] -> [n, b, h] at the local indices ``self._last`` (prefill only; rows share them)."""
        if self._last is None:
            return None
        return output.index_select(0, self._last.to(output.device))

    def _run(self, tokens, positions, ctx):
        return self.model(tokens, positions, None, inference_context=ctx, runtime_gather_output=True)

    @torch.no_grad()
    def prefill(self, prompts, cache, method: str = "ring", stats=None) -> torch.Tensor:
        """Every prompt's full length CP-sharded, rows of equal length in one forward each.

        method: only ``"ring"`` (the core attention runs ``decode.prefill.ring_prefill`` over every
        rank's chunks of the prompt; no rank holds another's keys/values).
        returns (batch, vocab) float32: the logits after each prompt's last token, on every rank.
        """
        return self.prefill_logits(prompts, cache, 1, method=method, stats=stats)[:, 0]

    @torch.no_grad()
    def prefill_logits(self, prompts, cache, keep: int, method: str = "ring", stats=None) -> torch.Tensor:
        """:meth:`prefill`, returning the logits of each prompt's last ``keep`` positions (scoring).

        returns (batch, keep, vocab) float32, identical on every CP rank; a prompt shorter than
        ``keep`` gets zeros at the positions before its first token. The decoder's output is
        cut to the local tokens holding those positions before the output layer (a hook), so
        only ``keep`` positions' logits are computed and assembled, never the whole prompt's.
        The cache is left in decode mode holding every prompt (``decode_step`` may continue it).
        """
        if method not in ("ring", None):
            raise ValueError(f"prefill method {method!r} is not available for Megatron models; use 'ring'")
        cache.reset()
        cache.enable_prefill_mode()
        lengths = [len(p) for p in prompts]
        out = None
        b0 = 0
        while b0 < len(prompts):
            b1 = b0
            while b1 < len(prompts) and lengths[b1] == lengths[b0]:
                b1 += 1
            n = lengths[b0]
            plan = cache.plan_prefill(b0, b1, n)
            tokens = torch.tensor([list(p) for p in prompts[b0:b1]], dtype=torch.long, device=self.device)
            local = tokens.index_select(1, plan.index.to(self.device))
            wanted = torch.arange(n - keep, n)  # negative: before the prompt (a pad, zeros)
            held_idx = ((plan.positions[0][:, None] == wanted[None, :]) & (wanted[None, :] >= 0)).any(1)
            idx = held_idx.nonzero().flatten()
            if idx.numel() == 0:
                idx = torch.zeros(1, dtype=torch.long)  # this rank holds none: one token, masked out below
            self._last = idx
            cache.batch_size_offset = b0
            only_last = cache.materialize_only_last_token_logits  # the hook already cut to the kept tokens
            cache.materialize_only_last_token_logits = False
            try:
                logits = self._run(local, plan.positions.clamp(min=0).to(self.device), cache)
            finally:
                self._last = None
                cache.materialize_only_last_token_logits = only_last
                cache.batch_size_offset = 0
                cache.step = None
            # Each kept token's logits -> the wanted positions' on every rank (exact: one holder each).
            held = plan.positions.index_select(1, idx) if held_idx.any() else torch.full((b1 - b0, 1), -1)
            logits = assemble_logits(logits, held, wanted, self.groups, stats=stats,
                                     signature=("MegatronLM.prefill", ("batch", "keep", "vocab", "prompt_length"),
                                                (b1 - b0, keep, logits.shape[-1], n)))
            if out is None:
                out = torch.empty(len(prompts), keep, logits.shape[-1], dtype=torch.float32, device=logits.device)
            out[b0:b1] = logits
            b0 = b1
        cache.enable_decode_mode()
        return out

    @torch.no_grad()
    def decode_step(self, next_ids, cache, step=None, *, strategy: str = "auto", stats=None) -> torch.Tensor:
        """One new token per row (rows may hold different lengths) -> next-token logits (batch, vocab).

        step: the loop's ``decode.generate.DecodeStep``: every layer's core attention runs its
        ``attend`` (``generate``'s ``shifted`` redo rewinds the cache and calls this again); without
        one, a plain step of ``strategy``/``stats``. A forward that raises leaves the cache as before
        the call (the step is rewound).
        """
        from ...decode.generate import DecodeStep

        step = step if step is not None else DecodeStep(strategy, stats)
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=self.device).reshape(-1, 1)
        plan = cache.plan_decode(0, ids.shape[0], 1, attend=step)  # the step's metadata carries the loop's step
        try:
            logits = self._run(ids, plan.positions.to(self.device), cache)[:, -1]
        except BaseException:
            # The forward raised (in a layer, or a hook of the caller's): the step never happened, so its
            # placement is taken back (the redo's path); the next step places its tokens on the same slots.
            cache.rewind_step()
            raise
        finally:
            cache.step = None
        return logits.float()


class MegatronReference:
    """Megatron's own model at CP = 1 and TP = 1 (``DotProductAttention``), for exactness checks.

    __call__(ids (batch, seqlen)) -> logits (batch, seqlen, vocab): one full causal forward.
    """

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        pos = torch.arange(s, device=ids.device)[None].expand(b, s)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), 1)[None, None]  # True = hidden
        return self.model(ids, pos, mask)
