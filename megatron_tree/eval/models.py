"""The eval's model per ``model.source``, and the reference it is held to.

Invariant: whatever the source, the sweep sees one interface -- :class:`EvalModel`: an
``lm`` that :func:`megatron_tree.decode.generate` drives (``prefill``, ``decode_step``,
``new_cache``), its ``groups``, and on global rank 0 a ``reference`` that maps token ids
(batch, seqlen) to full-sequence logits with *no* context parallelism:

* ``megatron`` -- a Megatron-Core ``GPTModel`` at the run's TP x CP layout with
  ``TreeDotProductAttention``; the reference is Megatron's own model at CP = 1, TP = 1 with
  its own ``DotProductAttention``, built on rank 0 with size-1 process groups (Megatron's
  ``parallel_state`` keeps the run's layout) and filled from the same global tensors: the
  seeded TP = 1 model itself (random weights) or the checkpoint, read on rank 0 alone;
* ``hf`` -- transformers' own model class for the checkpoint (any architecture its
  ``AutoModelForCausalLM`` knows whose attention goes through ``AttentionInterface``), with
  tree attention as its attention backend (``integrations.hf``), weights replicated on every
  CP rank; the reference is the same transformers class in one process with the attention
  implementation it had before (``HFTreeModel.unsharded``), sharing the weight tensors;
* ``random`` -- transformers' ``LlamaForCausalLM`` built from the ``model:`` shape fields,
  its random weights drawn after seeding with ``model.seed`` (the same on every rank), run and
  held to its reference exactly as ``hf`` is.

Only this module and :mod:`.launch` know about ``model.source``; each function here takes
the sub-configs it needs, not the whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field

from .config import ConfigError, ModelConfig, TopologyConfig, to_dict

__all__ = ["EvalModel", "HFReference", "gpt_shape", "megatron_layout", "build", "load_hf", "random_llama"]


@dataclass
class EvalModel:
    """What the sweep needs from a model, whatever its source."""

    lm: object
    """Driven by ``generate``: a ``decode.generate.DecodeModel`` (``MegatronLM``, ``HFTreeModel``, the Llama)."""
    groups: object
    """This rank's CP group and levels (``TreeGroups``)."""
    vocab_size: int
    heads: int
    """Query heads of the merge state on this rank (after TP)."""
    head_dim: int
    reference: object | None
    """rank 0 with exactness on: ``ids (batch, seqlen) -> logits (batch, seqlen, vocab)``, no CP."""
    reference_name: str
    bos: list = field(default_factory=list)
    """Token ids put before tokenized text (passkey, perplexity)."""
    info: dict = field(default_factory=dict)
    """Recorded in results.json ``model``."""


def compiled_steps(em: EvalModel) -> dict:
    """What ``model.compile_step`` did in this run (a transformers source), for results.json ``model``:
    ``compiled_steps``, the (batch, cache length bucket) of every decode step compiled (captured, on a GPU
    under ``auto``), empty where the steps ran eagerly; ``compile_failed``, why a compilation the default
    tried failed (its steps then ran eagerly), or None; ``cache_storage_reused``, how many of the run's caches took
    over the storage of the one before (``decode.cache.StoragePool``: a captured step then replays, not records).
    Empty for Megatron sources."""
    binding = getattr(em.lm, "_binding", None)
    compiled = getattr(binding, "compiled", None)
    if compiled is None:
        return {} if binding is None else {"compiled_steps": [], "compile_failed": None, "cache_storage_reused": 0}
    made = sorted(compiled.made, key=lambda m: (m[0], -1 if m[1] is None else m[1]))
    return {"compiled_steps": [list(m) for m in made], "compile_failed": compiled.failed,
            "cache_storage_reused": binding.pool.reused}


def gpt_shape(m: ModelConfig):
    """The Megatron GPT shape of ``model:`` (Hugging Face field names map one to one)."""
    from ..integrations.megatron.model import GPTShape

    names = {f.name for f in dataclasses.fields(GPTShape)}
    return GPTShape(**{k: v for k, v in to_dict(m).items() if k in names})


def megatron_layout(topo: TopologyConfig, world: int, cp: int, per_node: int | None) -> list[int] | None:
    """Hierarchical CP sizes ``[intra, inter]`` (``None``: one level) for a TP x CP layout.

    Megatron numbers ranks TP-fastest, so an intra-node CP group spans ``tp * intra``
    consecutive ranks; it must sit inside one (real) node. Pure: checked before launch.
    """
    tp = topo.tp_size
    intra = topo.intra_size
    if intra is None:  # the launcher's nodes: the widest level whose tp x intra consecutive ranks tile a node
        intra = cp if per_node is None else max(1, min(cp, per_node // tp))
        while intra > 1 and (cp % intra or (per_node is not None and per_node % (tp * intra))):
            intra -= 1  # ends at 1 at the latest: a flat group, checked against nothing
    if cp % intra:
        raise ConfigError(f"topology.intra_size: {intra} does not factor the CP size {cp}; expected a divisor of {cp}")
    if per_node is not None and 1 < intra and (tp * intra > per_node or per_node % (tp * intra)):
        raise ConfigError(
            f"topology.intra_size: {intra} disagrees with the real layout: with tp_size {tp} an intra-node CP group "
            f"spans {tp * intra} consecutive ranks, but the launcher puts {per_node} ranks on a node; expected "
            f"tp_size x intra_size to divide {per_node}"
        )
    return [intra, cp // intra] if 1 < intra < cp else None


def build(m: ModelConfig, topo: TopologyConfig, *, cp_size: int, rank: int, device, env, want_reference: bool,
          checkpoint=None, stack: contextlib.ExitStack, allow_beyond_window: bool = False) -> EvalModel:
    """The model of ``m`` on this rank at the layout of ``topo``; collective over every rank.
    allow_beyond_window: ``eval.allow_beyond_max_position``, for a transformers model's prefill (a Megatron
    ``GPTModel``'s RoPE runs past its window as it is)."""
    if m.source == "megatron":
        return _build_megatron(m, topo, cp_size=cp_size, rank=rank, device=device, env=env,
                               want_reference=want_reference, checkpoint=checkpoint, stack=stack)
    return _build_hf(m, topo, cp_size=cp_size, rank=rank, device=device, env=env, want_reference=want_reference,
                     allow_beyond_window=allow_beyond_window)


def _cp_groups(topo: TopologyConfig, cp_size: int, env):
    """This rank's ``TreeGroups``: consecutive blocks of ``cp_size`` ranks, levels from the launcher."""
    import torch.distributed as dist

    from ..integrations.loading import model_groups

    world = dist.get_world_size()
    ranks = [list(range(i, i + cp_size)) for i in range(0, world, cp_size)]
    return model_groups("hf", cp_size, cp_ranks=ranks, intra_size=topo.intra_size, timeout_s=topo.timeout_s, env=env,
                        transport=topo.transport)


def _bos(path: str) -> list:
    import json

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        bos_id = json.load(f).get("bos_token_id")
    return [bos_id] if isinstance(bos_id, int) else []


# --------------------------------------------------------------------------- transformers


class HFReference:
    """The exactness reference of a transformers source: ``model`` (the unmodified class in one
    process, sharing the run's weight tensors) as ``ids (batch, seqlen) -> logits (batch, seqlen, vocab)``."""

    def __init__(self, model):
        self.model = model

    def __call__(self, ids):
        return self.model(input_ids=ids).logits


def load_hf(m: ModelConfig):
    """transformers' model for the checkpoint at ``m.path``, every tensor read from its files.

    The directory is checked first (``integrations.hf.checkpoint``: config.json, the safetensors
    headers, every tensor against the class's weights), alike on every rank of the default group
    when one exists: a weight missing from the files (transformers would re-initialise it), a
    tensor of another shape or one the class has no place for is a ConfigError naming the
    tensors, on every rank. Called before any CP group exists.
    """
    import torch
    import torch.distributed as dist

    from ..integrations.hf.checkpoint import CheckpointError, load_checked

    group, ranks = None, ()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        group, ranks = dist.group.WORLD, tuple(range(dist.get_world_size()))
    try:
        model, _ = load_checked(m.path, getattr(torch, m.dtype), group, ranks, site="model.source hf")
    except CheckpointError as e:
        raise ConfigError(f"model.path: {e}") from None
    return model


def random_llama(m: ModelConfig):
    """transformers' ``LlamaForCausalLM`` of the ``model:`` shape fields, random weights seeded by ``m.seed``.

    Built on the CPU in float32 after ``torch.manual_seed(m.seed)`` and only then cast and moved,
    so every rank (and every device) holds the same weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
              "max_position_embeddings", "tie_word_embeddings", "initializer_range")
    shape = {k: getattr(m, k) for k in fields}
    if shape["head_dim"] is None:
        shape["head_dim"] = m.hidden_size // m.num_attention_heads
    if shape["rope_scaling"] is not None:
        shape["rope_scaling"] = dict(shape["rope_scaling"])
    torch.manual_seed(m.seed)
    return LlamaForCausalLM(LlamaConfig(**shape)).to(getattr(torch, m.dtype))


def _build_hf(m: ModelConfig, topo: TopologyConfig, *, cp_size, rank, device, env, want_reference,
              allow_beyond_window) -> EvalModel:
    from ..integrations.loading import load_model

    if m.source == "random":
        model, bos = random_llama(m), []
    else:
        if rank != 0:  # one loading bar per job, not one per rank
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        # Loaded before any group exists: every rank reads the same files and fails alike.
        model, bos = load_hf(m), _bos(m.path)
    groups = _cp_groups(topo, cp_size, env)
    lm = load_model("hf", groups, model=model, device=device, compile_step=m.compile_step,
                    allow_beyond_window=allow_beyond_window)
    ref, attn = None, "its own"
    if want_reference and rank == 0:
        ref = HFReference(lm.unsharded())  # same weight tensors, the attention the model had before (sdpa/eager)
        attn = repr(ref.model.config._attn_implementation)
    cfg = lm.config
    return EvalModel(lm, groups, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim, ref,
                     f"unmodified transformers {type(lm.hf).__name__} in one process (attn_implementation "
                     f"{attn}), same weight tensors", bos,
                     {"source": m.source, "class": f"transformers.{type(lm.hf).__name__}", "tp_size": 1,
                      "model_type": getattr(lm.hf.config, "model_type", None), "compile_step": m.compile_step})


# --------------------------------------------------------------------------- Megatron-Core


def _build_megatron(m: ModelConfig, topo: TopologyConfig, *, cp_size, rank, device, env, want_reference,
                    checkpoint, stack) -> EvalModel:
    import torch
    import torch.distributed as dist

    from ..integrations.loading import load_model, model_groups
    from ..integrations.megatron import checkpoint as mc
    from ..integrations.megatron import model as mm
    from ..distributed.topology import launcher_local_size

    if device.type == "cpu":
        from ..integrations.megatron.cpu import megatron_on_cpu

        stack.enter_context(megatron_on_cpu())
    from megatron.core import parallel_state

    shape = gpt_shape(m)
    dtype = getattr(torch, m.dtype)
    tp = topo.tp_size
    per_node, _ = launcher_local_size(env)
    hier = megatron_layout(topo, dist.get_world_size(), cp_size, per_node)
    groups = model_groups("megatron", cp_size, hierarchical=hier, tp=tp, timeout_s=topo.timeout_s, per_node=per_node)
    stack.callback(parallel_state.destroy_model_parallel)
    single = mm.single_rank_groups()  # collective: every rank creates every size-1 group
    layout = dict(device=device, dtype=dtype, shape=shape, cp_size=cp_size, hierarchical=hier, tp=tp, seed=m.seed)
    src = None
    if checkpoint is None:
        # Random weights: a seeded TP = 1 model on every rank is the source of truth; the run's
        # model takes its shards from it, rank 0 keeps it as the reference.
        src = mm.build_gpt(shape, tree=False, dtype=dtype, pg_collection=single, seed=m.seed)
        lm = load_model("megatron", groups, global_tensors=mc.global_tensors(src), **layout)
        if not (want_reference and rank == 0):
            src = None
    else:
        lm = load_model("megatron", groups, dist_dir=checkpoint.dist_dir, **layout)
        if want_reference and rank == 0:
            src = mm.build_gpt(shape, tree=False, dtype=dtype, pg_collection=single, seed=m.seed)
            mc.fill_from_global(src, mc.read_global_tensors(checkpoint.dist_dir, mc.expected_tensor_shapes(shape), dtype))
    ref = mm.MegatronReference(src.to(device)) if src is not None else None
    info = {"source": "megatron", "class": "megatron.core.models.gpt.GPTModel", "tp_size": tp, "cp_size": cp_size,
            "hierarchical_context_parallel_sizes": hier, "checkpoint": None if checkpoint is None else {
                "path": checkpoint.path, "dist_dir": checkpoint.dist_dir, "iteration": checkpoint.iteration,
                "training_args": checkpoint.args is not None}}
    return EvalModel(lm, groups, shape.vocab_size, shape.num_attention_heads // tp, shape.kv_channels, ref,
                     "Megatron-Core GPTModel at CP=1, TP=1 with its own DotProductAttention, same weights",
                     [], info)
