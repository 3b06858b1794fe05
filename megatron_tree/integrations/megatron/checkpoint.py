"""Megatron distributed checkpoints: find, check before any process group, load at any layout.

A checkpoint is a ``dist_checkpointing`` directory (``metadata.json`` + ``.metadata``: what
``dist_checkpointing.save({"model": model.sharded_state_dict()}, dir)`` writes) or a Megatron-LM
``--save`` directory (``latest_checkpointed_iteration.txt`` + ``iter_XXXXXXX/``). The checks read
only metadata, headers and file sizes (no tensor), so a bad path, a truncated data file or training
arguments that disagree with the configured shape fail on every rank alike, before any collective.
Loading reshards in memory through each model's own ``sharded_state_dict``: a checkpoint saved at
one TP x CP layout loads at another. ``shape`` arguments are :class:`.model.GPTShape`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

__all__ = [
    "CheckpointError", "CheckpointInfo", "resolve_checkpoint", "check_checkpoint", "expected_tensor_shapes",
    "global_tensors", "fill_from_global", "read_global_tensors", "load_checkpoint", "shape_from_checkpoint",
]


class CheckpointError(ValueError):
    """A checkpoint path that does not describe the model the config asks for (the message names the file)."""



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


def shape_from_checkpoint(path: str):
    """The :class:`.model.GPTShape` a Megatron-LM checkpoint was trained with, from its stored arguments.

    For callers with no shape of their own (the lm-eval backend): ``common.pt``'s ``args``
    name every field (Megatron-LM's names, :data:`_ARGS`). Reads metadata only (no collective);
    :class:`CheckpointError` naming the file when the arguments are absent or incomplete.
    """
    from .model import GPTShape

    dist_dir, _ = resolve_checkpoint(path)
    args = _read_args(dist_dir)
    where = os.path.join(dist_dir, "common.pt")
    if args is None:
        raise CheckpointError(
            f"{where}: no training arguments stored with the checkpoint (Megatron-LM's --save writes them as "
            "common.pt's 'args'); the model's shape cannot be read from it"
        )
    fields, missing = {}, []
    for field_name, arg, read in _ARGS:
        try:
            fields[field_name] = read(args)
        except AttributeError:
            missing.append(arg)
    if missing:
        raise CheckpointError(f"{where}: the training arguments lack {missing}; the model's shape cannot be read")
    max_pos = getattr(args, "max_position_embeddings", None) or getattr(args, "seq_length", None)
    if max_pos:
        fields["max_position_embeddings"] = int(max_pos)
    shape = GPTShape(**fields)
    _check_args(args, shape, where)  # the architecture (RMSNorm, SwiGLU, RoPE, no biases)
    return shape


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
    """Copy each parameter's shard out of ``tensors`` (``{key: global tensor}``), at the model's own layout.

    Every tensor must have a parameter to go to: one the model has no place for (say an untied
    ``output_layer.weight`` given to a model built with ``tie_word_embeddings=True``) would be
    dropped, silently, so it is a :class:`CheckpointError` before anything is copied, as in
    :func:`check_checkpoint`.
    """
    keys = {sh.key for sh in _sharded_tensors(model)}
    extra = sorted(k for k in tensors if k not in keys)
    if "output_layer.weight" in extra:
        raise CheckpointError(
            "the tensors hold output_layer.weight (an untied output layer) but the model ties its output layer to "
            "the embedding (tie_word_embeddings=True / share_embeddings_and_output_weights): it would be dropped; "
            "build the model untied, or leave output_layer.weight out if it equals the embedding"
        )
    if extra:
        raise CheckpointError(
            f"the model has no parameter for the tensors {extra[:8]}; they would be dropped (a tensor named as in "
            f"the model's sharded_state_dict was expected: {sorted(keys)[:4]} ...)"
        )
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
