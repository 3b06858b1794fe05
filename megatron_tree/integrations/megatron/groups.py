"""Megatron-Core's process groups as ``TreeGroups``, and the CP layouts Megatron's training uses.

Invariant: this is the only module of the package that reads ``megatron.core.parallel_state``
(docs/design.md, "How the code is written"), and only when no ``pg_collection`` was given. A CP layout that does not fit
the launched world, or whose hierarchical sizes do not multiply to the CP size, is a
:class:`TopologyError` raised on every rank before any group is created; nothing falls back
to CP = 1.

Why a module of its own: the core attention, both inference contexts and the model helpers
need the groups; none of them should import another for it.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
import torch.distributed as dist

from ...distributed import collectives
from ...distributed.topology import Level, TopologyError, TreeGroups

__all__ = ["tree_groups_from_megatron", "initialize_model_parallel", "load_balanced_positions", "megatron_cp_levels"]

log = logging.getLogger("megatron_tree.integrations")


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


def megatron_cp_levels(groups, per_node: int | None):
    """Megatron's CP ``groups`` named as the launcher's nodes (``per_node`` consecutive ranks each) hold them.

    Megatron's groups carry no node layout, so a flat one (no hierarchical sizes) comes as one node's group
    (level ``"intra"``, ``intra_size`` = the CP size). A flat group whose ranks sit one per node (TP 2 x CP 3 on
    3 nodes x 2: CP group [0, 2, 4]) is ``"inter"`` with ``intra_size`` 1, as ``TreeGroups.build`` names it: what
    results.json and the verdict report, and what merge ``auto``'s cost model prices (inter-node links). A group
    inside one node, a hierarchical one, or an unknown layout (``per_node`` None) is returned as it is.
    """
    if groups is None or per_node is None or groups.is_hierarchical or groups.size < 2:
        return groups
    if len({r // per_node for r in groups.cp_ranks}) != groups.size:
        return groups
    return dataclasses.replace(groups, levels=(Level("inter", groups.cp_group, groups.cp_ranks),), intra_size=1)
