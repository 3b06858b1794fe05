"""Megatron-Core GPT models for the eval and generation: build, check, load, decode, compare.

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

import math
import os
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ... import collectives
from ...decode.prefill import assemble_logits

__all__ = [
    "GPTShape", "CheckpointInfo", "resolve_checkpoint", "check_checkpoint", "expected_tensor_shapes",
    "transformer_config", "build_gpt", "single_rank_groups", "global_tensors", "fill_from_global",
    "read_global_tensors", "load_checkpoint", "MegatronLM", "MegatronReference", "CheckpointError", "IdTokenizer",
]


class CheckpointError(ValueError):
    """A checkpoint path that does not describe the model the config asks for (the message names the file)."""


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


@dataclass(frozen=True)
class CheckpointInfo:
    """Where a distributed checkpoint's tensors are and what it says about itself."""

    path: str
    """The directory the user named."""
    dist_dir: str
    """The ``dist_checkpointing`` directory (``path`` itself, or ``path/iter_XXXXXXX``)."""
    iteration: int | None
    """Megatron-LM's iteration, when ``path`` is a ``--save`` directory."""
    tensors: dict
    """Global shape of every tensor in the checkpoint: ``{key: tuple}``."""
    args: object | None
    """Megatron-LM's training arguments (an ``argparse.Namespace``), when stored."""


def resolve_checkpoint(path: str) -> tuple[str, int | None]:
    """``(dist_dir, iteration)`` of a checkpoint path; :class:`CheckpointError` naming the path otherwise."""
    if not os.path.isdir(path):
        raise CheckpointError(f"model.path: checkpoint directory {path!r} does not exist")
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.isfile(tracker):
        data = open(tracker, "rb").read()
        try:
            raw = data.decode("utf-8").strip()
        except UnicodeDecodeError as e:
            raise CheckpointError(
                f"{tracker} is not UTF-8 text: byte {e.start} is {data[e.start:e.start + 1]!r}; it must hold an "
                "iteration number or 'release' (Megatron-LM writes it)"
            ) from None
        if raw == "release":
            sub, iteration = os.path.join(path, "release"), None
        else:
            try:
                iteration = int(raw)
            except ValueError:
                raise CheckpointError(f"{tracker} holds {raw!r}, expected an iteration number or 'release'") from None
            sub = os.path.join(path, f"iter_{iteration:07d}")
        if not os.path.isdir(sub):
            raise CheckpointError(f"{tracker} names iteration {raw}, but {sub} does not exist")
        path, found = sub, iteration
    else:
        found = None
    if not (os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, ".metadata"))):
        raise CheckpointError(
            f"model.path: {path!r} is not a Megatron distributed checkpoint: expected metadata.json and .metadata "
            "(what dist_checkpointing.save writes) or a Megatron-LM --save directory with "
            "latest_checkpointed_iteration.txt and iter_XXXXXXX/"
        )
    return path, found


def _read_tensor_shapes(dist_dir: str) -> dict:
    """Global shapes from the checkpoint's ``.metadata`` (torch's DCP format), read locally."""
    import json

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta_json = os.path.join(dist_dir, "metadata.json")
    try:
        backend = json.load(open(meta_json, encoding="utf-8")).get("sharded_backend")
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{meta_json} is not readable JSON: {e}") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{meta_json} names sharded_backend {backend!r}; only 'torch_dist' is supported")
    try:
        meta = FileSystemReader(dist_dir).read_metadata()
    except Exception as e:  # noqa: BLE001 -- truncated or foreign file: say which one
        raise CheckpointError(f"{os.path.join(dist_dir, '.metadata')} cannot be read: {type(e).__name__}: {e}") from None
    _check_data_files(dist_dir, meta)
    return {k: tuple(v.size) for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def _check_data_files(dist_dir: str, meta) -> None:
    """Every data file ``.metadata`` names (``__0_0.distcp``, ...) exists and is as long as the data it
    says it holds: a truncated file is named here, from sizes alone, before any rank starts the load."""
    ends: dict = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        ends[rel] = max(ends.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(ends.items()):
        file = os.path.join(dist_dir, rel)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {dist_dir}: {rel} is missing; .metadata says it holds {end} bytes of "
                                  "tensors")
        size = os.path.getsize(file)
        if size < end:
            raise CheckpointError(f"checkpoint {dist_dir}: {rel} is truncated: .metadata says its data ends at byte "
                                  f"{end}, the file has {size}")


def _read_args(dist_dir: str):
    common = os.path.join(dist_dir, "common.pt")
    if not os.path.isfile(common):
        return None
    try:
        state = torch.load(common, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{common} cannot be read: {type(e).__name__}: {e}") from None
    return state.get("args") if isinstance(state, dict) else None


def expected_tensor_shapes(shape: GPTShape) -> dict:
    """Global shape of every model tensor in a checkpoint of ``shape`` (layers stacked on axis 0)."""
    L, h, d = shape.num_hidden_layers, shape.hidden_size, shape.kv_channels
    hq, hkv, ffn = shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size
    out = {
        "embedding.word_embeddings.weight": (shape.vocab_size, h),
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (L, h),
        "decoder.layers.self_attention.linear_qkv.weight": (L, (hq + 2 * hkv) * d, h),
        "decoder.layers.self_attention.linear_proj.weight": (L, h, hq * d),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight": (L, h),
        "decoder.layers.mlp.linear_fc1.weight": (L, 2 * ffn, h),
        "decoder.layers.mlp.linear_fc2.weight": (L, h, ffn),
        "decoder.final_layernorm.weight": (h,),
    }
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = (shape.vocab_size, h)
    return out


_ARGS = (  # (GPTShape field, Megatron-LM argument, how to read it)
    ("num_hidden_layers", "num_layers", lambda a: a.num_layers),
    ("hidden_size", "hidden_size", lambda a: a.hidden_size),
    ("intermediate_size", "ffn_hidden_size", lambda a: a.ffn_hidden_size),
    ("num_attention_heads", "num_attention_heads", lambda a: a.num_attention_heads),
    ("num_key_value_heads", "num_query_groups",
     lambda a: a.num_query_groups if getattr(a, "group_query_attention", False) else a.num_attention_heads),
    ("head_dim", "kv_channels", lambda a: a.kv_channels),
    ("vocab_size", "padded_vocab_size", lambda a: a.padded_vocab_size),
    ("rope_theta", "rotary_base", lambda a: float(a.rotary_base)),
    ("rms_norm_eps", "norm_epsilon", lambda a: float(a.norm_epsilon)),
    ("tie_word_embeddings", "untie_embeddings_and_output_weights", lambda a: not a.untie_embeddings_and_output_weights),
)


def _check_args(args, shape: GPTShape, where: str) -> None:
    """Megatron-LM's training arguments against the configured shape: one error naming both values."""
    arch = {"normalization": "RMSNorm", "swiglu": True, "add_bias_linear": False, "position_embedding_type": "rope"}
    for name, want in arch.items():
        if hasattr(args, name) and getattr(args, name) != want:
            raise CheckpointError(
                f"{where}: unsupported architecture: training argument {name}={getattr(args, name)!r}, expected "
                f"{want!r} (a Llama-style GPT: RMSNorm, SwiGLU, no linear biases, RoPE)"
            )
    wrong = []
    for field_name, arg, read in _ARGS:
        try:
            theirs = read(args)
        except AttributeError:
            continue
        if theirs is None:
            continue
        ours = shape.kv_channels if field_name == "head_dim" else getattr(shape, field_name)
        if (ours != theirs) if not isinstance(ours, float) else not math.isclose(ours, theirs, rel_tol=1e-9):
            raw = getattr(args, arg, theirs)  # the argument as trained (tie_word_embeddings is its negation)
            given = f"{arg}={raw!r}" if raw == theirs else f"{arg}={raw!r} (model.{field_name}={theirs!r})"
            wrong.append(f"model.{field_name}={ours!r} but the checkpoint was trained with {given}")
    if wrong:
        raise CheckpointError(f"{where}: the config disagrees with the training arguments: " + "; ".join(wrong))


def check_checkpoint(path: str, shape: GPTShape) -> CheckpointInfo:
    """Find and check a checkpoint against ``shape`` by reading its metadata only (no collective).

    Raises :class:`CheckpointError` naming the file: not a distributed checkpoint, a
    training argument or a tensor shape that disagrees with the config, a missing tensor, a
    model tensor the config has no place for (e.g. an untied ``output_layer.weight`` under
    ``model.tie_word_embeddings: true``).
    """
    dist_dir, iteration = resolve_checkpoint(path)
    tensors = _read_tensor_shapes(dist_dir)
    args = _read_args(dist_dir)
    if args is not None:
        _check_args(args, shape, os.path.join(dist_dir, "common.pt"))
    expected = expected_tensor_shapes(shape)
    missing = sorted(k for k in expected if k not in tensors)
    if missing:
        raise CheckpointError(
            f"checkpoint {dist_dir} has no tensors {missing}; it holds {sorted(tensors)[:12]} "
            "(a Llama-style GPTModel checkpoint was expected)"
        )
    wrong = [f"{k}: {tensors[k]} (the config gives {v})" for k, v in expected.items() if tensors[k] != v]
    if wrong:
        raise CheckpointError(f"checkpoint {dist_dir} has tensors whose shapes disagree with model.*: " + "; ".join(wrong))
    # A model tensor the config has no place for would be dropped at load, silently: refuse it.
    # (Optimizer states, saved beside the model by Megatron-LM, are not the model's.)
    extra = sorted(k for k in tensors if k not in expected and not k.startswith("optimizer."))
    if "output_layer.weight" in extra:
        raise CheckpointError(
            f"checkpoint {dist_dir} has output_layer.weight (an untied output layer) but model.tie_word_embeddings "
            "is true: the trained output layer would be dropped; set model.tie_word_embeddings=false"
        )
    if extra:
        raise CheckpointError(
            f"checkpoint {dist_dir} has tensors the config has no place for: {extra[:8]} (a Llama-style GPTModel "
            "of model.*'s shape was expected: RMSNorm, SwiGLU, RoPE, no biases, no QK norm)"
        )
    return CheckpointInfo(path, dist_dir, iteration, tensors, args)


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


def _sharded_tensors(model) -> list:
    """The model's ``ShardedTensor`` views of its parameters (SwiGLU factories expanded)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    ssd = model.sharded_state_dict()
    apply_factories(ssd)
    return [sh for sh in nested_values(ssd) if isinstance(sh, ShardedTensor)]


def global_tensors(model) -> dict:
    """``{checkpoint key: global tensor}`` of a TP = 1 model (copies)."""
    out: dict = {}
    for sh in _sharded_tensors(model):
        if sh.key not in out:
            out[sh.key] = torch.zeros(sh.global_shape, dtype=sh.data.dtype)
        out[sh.key][sh.global_slice()] = sh.data.detach().cpu()
    return out


@torch.no_grad()
def fill_from_global(model, tensors: dict) -> None:
    """Copy each parameter's shard out of ``tensors`` (``{key: global tensor}``), at the model's own layout."""
    done = set()
    for sh in _sharded_tensors(model):
        if sh.key not in tensors:
            raise CheckpointError(f"no global tensor {sh.key!r} to fill the model from")
        src = tensors[sh.key][sh.global_slice()]
        if tuple(src.shape) != tuple(sh.data.shape):
            raise CheckpointError(f"{sh.key}: slice {tuple(src.shape)} does not fit the shard {tuple(sh.data.shape)}")
        sh.data.copy_(src)
        done.add(sh.key)
    # The views above alias the parameters; check nothing was copied into a temporary instead.
    for sh in _sharded_tensors(model):
        if not torch.equal(sh.data.cpu(), tensors[sh.key][sh.global_slice()].to(sh.data.dtype)):
            raise RuntimeError(f"{sh.key}: the shard did not take the global tensor's values")


def read_global_tensors(dist_dir: str, shapes: dict, dtype=torch.float32) -> dict:
    """Read whole tensors ``{key: shape}`` from a checkpoint on this rank alone (no collective)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    state = {k: torch.empty(s, dtype=dtype) for k, s in shapes.items()}
    dcp_load(state, storage_reader=FileSystemReader(dist_dir), no_dist=True)
    return state


def load_checkpoint(model, dist_dir: str) -> None:
    """Load ``dist_dir`` into ``model`` at its own TP x CP layout (collective over every rank)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import StrictHandling

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, dist_dir,
                                     strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    model.load_state_dict(loaded["model"], strict=False)


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

        self.model = model
        self.groups = groups
        self.shape = shape
        self.config = _Config(shape.vocab_size, shape.num_attention_heads // tp_size, shape.kv_channels)
        self._attention = [layer.self_attention.core_attention for layer in unwrap_model(model).decoder.layers]
        self._last: list | None = None
        unwrap_model(model).decoder.register_forward_hook(self._keep_last_token)
        from .attention import check_tree_slots

        check_tree_slots(model, "MegatronLM")

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
        """Decoder output [s, b, h] -> [1, b, h] at local index ``self._last`` (prefill only; rows share it)."""
        if self._last is None:
            return None
        return output[self._last : self._last + 1]

    def _run(self, tokens, positions, ctx):
        return self.model(tokens, positions, None, inference_context=ctx, runtime_gather_output=True)

    @torch.no_grad()
    def prefill(self, prompts, cache, method: str = "allgather", stats=None) -> torch.Tensor:
        """Every prompt's full length CP-sharded, rows of equal length in one forward each.

        method: only ``"allgather"`` (the core attention all-gathers the prompt's keys/values).
        """
        if method not in ("allgather", None):
            raise ValueError(f"prefill method {method!r} is not available for Megatron models; use 'allgather'")
        cache.reset()
        cache.enable_prefill_mode()
        lengths = [len(p) for p in prompts]
        out = None
        b0 = 0
        while b0 < len(prompts):
            b1 = b0
            while b1 < len(prompts) and lengths[b1] == lengths[b0]:
                b1 += 1
            plan = cache.plan_prefill(b0, b1, lengths[b0])
            tokens = torch.tensor([list(p) for p in prompts[b0:b1]], dtype=torch.long, device=self.device)
            local = tokens.index_select(1, plan.index.to(self.device))
            last = (plan.positions[0] == lengths[b0] - 1).nonzero().flatten().tolist()
            self._last = last[0] if last else 0
            cache.batch_size_offset = b0
            try:
                logits = self._run(local, plan.positions.clamp(min=0).to(self.device), cache)[:, -1]
            finally:
                self._last = None
                cache.batch_size_offset = 0
                cache.step = None
            # The kept token's logits (rows, 1, vocab) -> the last prompt token's on every rank (exact).
            held = plan.positions[:, last[0]:last[0] + 1] if last else torch.full((b1 - b0, 1), -1)
            logits = assemble_logits(logits[:, None], held, torch.tensor([lengths[b0] - 1]), self.groups,
                                     stats=stats, signature=("MegatronLM.prefill", ("batch", "vocab", "prompt_length"),
                                                             (b1 - b0, logits.shape[-1], lengths[b0])))[:, 0]
            if out is None:
                out = torch.empty(len(prompts), logits.shape[-1], dtype=torch.float32, device=logits.device)
            out[b0:b1] = logits
            b0 = b1
        cache.enable_decode_mode()
        return out

    @torch.no_grad()
    def decode_step(self, next_ids, cache, step=None, *, strategy: str = "auto", stats=None) -> torch.Tensor:
        """One new token per row (rows may hold different lengths) -> next-token logits (batch, vocab).

        step: the loop's ``decode.generate.DecodeStep``: every layer's core attention runs its
        ``attend`` (``generate``'s ``shifted`` redo rewinds the cache and calls this again); without
        one, a plain step of ``strategy``/``stats``.
        """
        from ...decode.generate import DecodeStep

        step = step if step is not None else DecodeStep(strategy, stats)
        ids = torch.as_tensor(next_ids, dtype=torch.long, device=self.device).reshape(-1, 1)
        for attn in self._attention:
            attn.current_step = step
        plan = cache.plan_decode(0, ids.shape[0], 1)
        try:
            logits = self._run(ids, plan.positions.to(self.device), cache)[:, -1]
        finally:
            cache.step = None
            for attn in self._attention:
                attn.current_step = None
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
