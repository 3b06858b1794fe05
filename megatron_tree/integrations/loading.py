"""One way to get a tree-decoding model and its CP groups by ``source``: the eval run and the lm-eval backend both load here.

Invariant: a ``source`` (``hf``: a transformers checkpoint or model; ``megatron``: Megatron-Core's
``GPTModel`` from a distributed checkpoint or from given global tensors) becomes the same two
things on every rank, whoever asks: the CP groups (:func:`model_groups`) and an adapter the one
generation loop drives (:func:`load_model`: ``HFTreeModel`` or ``MegatronLM``). What differs
between the callers stays with them: the eval's sweep over strategies and its exactness reference,
the lm-eval backend's data-parallel groups and its model_args.

Both functions are collective over the ranks that call them (group creation; Megatron's checkpoint
load), so every rank calls them alike.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch

from ..distributed.topology import TreeGroups

__all__ = ["Source", "SOURCES", "model_groups", "load_model", "NAMED_COMPILE_STEPS"]

Source = Literal["hf", "megatron"]
SOURCES = ("hf", "megatron")


def model_groups(source: Source, cp_size: int, *, hierarchical: Sequence[int] | None = None, tp: int = 1,
                 timeout_s: float = 600.0, cp_ranks: Sequence[Sequence[int]] | None = None,
                 intra_size: int | None = None, env=None, transport: str | None = None,
                 per_node: int | None = None) -> TreeGroups | None:
    """This rank's CP groups for ``source``.

    megatron: Megatron-Core's ``parallel_state`` is initialised (TP ``tp``, CP ``cp_size``, its
        ``hierarchical_context_parallel_sizes`` = ``hierarchical``) and its CP groups are returned, named
        by the nodes of ``per_node`` consecutive ranks that hold them (``megatron.groups.megatron_cp_levels``:
        a flat group with one rank per node is ``inter``; ``None``, an unknown layout, leaves Megatron's own);
    hf: ``cp_ranks`` (consecutive blocks of ``cp_size`` ranks) with levels from the launcher's
        environment ``env`` (``TreeGroups.from_env``) when ``env`` is given, else ``intra_size``
        (``TreeGroups.build``); ``None`` for ``cp_size == 1`` without an environment to read.
        ``transport``: as ``TreeGroups.build``'s (``"shm"``: the small collectives of one host's CPU
        ranks through shared memory; Megatron's groups keep their backend).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown model source {source!r}; expected one of {SOURCES}")
    if source == "megatron":
        from .megatron.groups import initialize_model_parallel, megatron_cp_levels

        groups = initialize_model_parallel(cp_size, list(hierarchical) if hierarchical else None,
                                           tensor_model_parallel_size=tp,
                                           distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)))
        return megatron_cp_levels(groups, per_node)
    if cp_ranks is None:
        raise ValueError("model_groups(source='hf') needs cp_ranks, the consecutive blocks of cp_size ranks")
    cp_ranks = [list(r) for r in cp_ranks]
    if env is not None:
        return TreeGroups.from_env(cp_ranks, intra_size=intra_size, timeout=timeout_s, env=env, transport=transport)
    return TreeGroups.build(cp_ranks, intra_size, transport=transport) if cp_size > 1 else None


NAMED_COMPILE_STEPS = {"aot_eager": {"backend": "aot_eager"}, "reduce-overhead": {"mode": "reduce-overhead"}}
"""``compile_step`` settings by the names the eval's config and lm-eval's model_args use (besides true and
false): ``aot_eager`` (Dynamo only, the eager kernels), ``reduce-overhead`` (Inductor with CUDA graphs)."""


def load_model(source: Source, groups: TreeGroups | None, *, device, dtype: torch.dtype = torch.float32,
               path: str | None = None, model=None, shape=None, dist_dir: str | None = None,
               global_tensors: dict | None = None, cp_size: int = 1, hierarchical: Sequence[int] | None = None,
               tp: int = 1, seed: int | None = None, strategy: str = "auto", prefill: str | None = None,
               compile_step="auto", allow_beyond_window: bool = False):
    """The adapter the generation loop drives, for ``source`` on this rank's ``groups``.

    hf: ``model`` (a transformers causal LM already loaded, e.g. after the eval's checkpoint check)
        wrapped as ``HFTreeModel``, or else the checkpoint at ``path`` loaded and checked by
        ``load_hf_model`` (``dtype``); either way with ``strategy``, ``prefill`` and ``compile_step``
        (a setting of ``enable_tree_attention``, ``"auto"`` by default, or a name of :data:`NAMED_COMPILE_STEPS`)
        and ``allow_beyond_window`` (``enable_tree_attention``'s; a Megatron ``GPTModel``'s RoPE runs past its
        window without it);
    megatron: a ``GPTModel`` of ``shape`` with tree attention at CP ``cp_size`` (``hierarchical``,
        TP ``tp``, merge ``strategy``), its weights from the distributed checkpoint ``dist_dir`` or
        from ``global_tensors`` (unsharded tensors by name), wrapped as ``MegatronLM``.
    The model ends on ``device`` in eval mode.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown model source {source!r}; expected one of {SOURCES}")
    if isinstance(compile_step, str) and compile_step != "auto":
        if compile_step not in NAMED_COMPILE_STEPS:
            raise ValueError(f"compile_step {compile_step!r} is not one of {sorted(NAMED_COMPILE_STEPS)} (or auto, a bool, "
                             "or a dict of torch.compile arguments)")
        compile_step = NAMED_COMPILE_STEPS[compile_step]
    if source == "hf":
        from .hf import HFTreeModel, load_hf_model

        if model is not None:
            return HFTreeModel(model.to(device).eval(), groups, strategy=strategy, compile_step=compile_step,
                               allow_beyond_window=allow_beyond_window,
                               **({} if prefill is None else {"prefill": prefill}))
        if path is None:
            raise ValueError("load_model(source='hf') needs path= (a checkpoint directory) or model=")
        return load_hf_model(path, groups, dtype=dtype, device=device, strategy=strategy, prefill=prefill,
                             compile_step=compile_step, allow_beyond_window=allow_beyond_window)
    from .megatron import checkpoint as mc
    from .megatron import model as mm

    if shape is None or (dist_dir is None) == (global_tensors is None):
        raise ValueError("load_model(source='megatron') needs shape= and exactly one of dist_dir= and global_tensors=")
    gpt = mm.build_gpt(shape, tree=True, dtype=dtype, tp=tp, cp=cp_size,
                       hierarchical=list(hierarchical) if hierarchical else None, strategy=strategy, seed=seed)
    if dist_dir is not None:
        mc.load_checkpoint(gpt, dist_dir)
    else:
        mc.fill_from_global(gpt, global_tensors)
    return mm.MegatronLM(gpt.to(device), groups, shape, tp_size=tp)
