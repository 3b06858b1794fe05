"""``TreeGroups``: a context-parallel group and its reduction levels, innermost first.

Invariant: groups are built once, from the launch environment or from explicit sizes, and
then passed down to every function that communicates (no process-group globals; STYLE.md
rule 4). A layout that does not factor, or an "intra-node" level whose ranks are not on one
node, is an error that says what was found and what was expected -- never a silent
fallback to a flat group.

Levels follow Megatron-Core's ``hierarchical_context_parallel_sizes`` order: level 0 is the
group of CP ranks inside one node (NVLink), level 1 the group of CP ranks with the same
index on every node (InfiniBand). A CP group that lives on one node, or has one rank per
node, has a single level.

Every process of the default group must call the builders with the same arguments (like
``torch.distributed.new_group``), also processes that end up in another CP group.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

__all__ = ["Level", "TreeGroups", "TopologyError", "launcher_local_size"]

ENV_HOSTNAME = "MEGATRON_TREE_HOSTNAME"  # override the host name, to test multi-host validation


class TopologyError(ValueError):
    """A CP layout that does not factor or disagrees with where the ranks really are."""


@dataclass(frozen=True)
class Level:
    """One reduction level of a CP group, as seen from this rank."""

    name: str
    """``"intra"`` (ranks inside one node) or ``"inter"`` (one rank per node)."""
    group: object
    """The process group of this rank at this level."""
    ranks: tuple[int, ...]
    """Global ranks of that group, in group-rank order."""

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class TreeGroups:
    """A context-parallel group of this rank and its levels, innermost first."""

    cp_group: object
    """Process group over every rank of this CP group."""
    cp_ranks: tuple[int, ...]
    """Global ranks of the CP group, in CP-rank order (KV shard order)."""
    levels: tuple[Level, ...]
    """Reduction levels, innermost first; one level for a single node or one rank per node."""
    intra_size: int
    """CP ranks per (possibly simulated) node."""

    @property
    def size(self) -> int:
        return len(self.cp_ranks)

    @property
    def rank(self) -> int:
        """This process's rank inside the CP group."""
        return self.cp_ranks.index(dist.get_rank())

    @property
    def num_nodes(self) -> int:
        return self.size // self.intra_size

    @property
    def is_hierarchical(self) -> bool:
        return len(self.levels) == 2

    def level(self, name: str) -> Level:
        for lvl in self.levels:
            if lvl.name == name:
                return lvl
        raise KeyError(f"this CP group has no {name!r} level; it has {[l.name for l in self.levels]}")

    def describe(self) -> dict:
        """Plain-data summary for logs and results files."""
        return {
            "cp_size": self.size,
            "intra_size": self.intra_size,
            "num_nodes": self.num_nodes,
            "levels": [{"name": l.name, "size": l.size} for l in self.levels],
            "cp_ranks": list(self.cp_ranks),
        }

    # ------------------------------------------------------------------ builders

    @classmethod
    def build(
        cls,
        ranks: Sequence[int] | Sequence[Sequence[int]] | None = None,
        intra_size: int | None = None,
        *,
        node_of: Sequence | None = None,
        timeout: float | None = None,
    ) -> "TreeGroups":
        """Build CP groups and their levels; every process calls it with the same arguments.

        ranks: ``None`` (one CP group of the whole world), one list of global ranks (one CP
            group), or a list of disjoint lists (several CP groups side by side, e.g. CP
            inside TP x CP x DP). Returns the group this process belongs to.
        intra_size: CP ranks per node. ``None`` takes the real layout (ranks per host);
            a smaller divisor simulates nodes inside one host (8 processes as 2 x 4).
        node_of: node id of every global rank (default: host names, exchanged once).
        timeout: seconds a collective on these groups may wait before failing.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TreeGroups.build needs torch.distributed to be initialised "
                "(init_process_group, torchrun, the deepspeed launcher or srun)"
            )
        world = dist.get_world_size()
        me = dist.get_rank()
        cp_lists = _normalise_rank_lists(ranks, world)
        if node_of is None:
            node_of = _gather_hostnames(world)
        elif len(node_of) != world:
            raise TopologyError(f"node_of must name a node for each of the {world} ranks, got {len(node_of)}")
        td = datetime.timedelta(seconds=timeout) if timeout is not None else None

        mine = None
        for cp_ranks in cp_lists:
            size_intra = _intra_size_for(cp_ranks, node_of, intra_size)
            cp_group = dist.new_group(list(cp_ranks), timeout=td)
            blocks = [cp_ranks[i : i + size_intra] for i in range(0, len(cp_ranks), size_intra)]
            strides = [tuple(b[j] for b in blocks) for j in range(size_intra)]
            levels: list[Level] = []
            if 1 < size_intra < len(cp_ranks):
                for name, parts in (("intra", blocks), ("inter", strides)):
                    for part in parts:
                        g = dist.new_group(list(part), timeout=td)
                        if me in part:
                            levels.append(Level(name, g, tuple(part)))
            if me in cp_ranks:
                if not levels:
                    name = "inter" if size_intra == 1 and len(cp_ranks) > 1 else "intra"
                    levels = [Level(name, cp_group, tuple(cp_ranks))]
                mine = cls(cp_group, tuple(cp_ranks), tuple(levels), size_intra)
        if mine is None:
            raise TopologyError(f"rank {me} is not in any of the CP groups {cp_lists}")
        return mine

    @classmethod
    def from_env(
        cls,
        ranks: Sequence[int] | Sequence[Sequence[int]] | None = None,
        intra_size: int | None = None,
        *,
        timeout: float | None = None,
        env: dict | None = None,
    ) -> "TreeGroups":
        """Build the groups from the launcher's environment (torchrun, deepspeed, Slurm).

        The launcher's processes-per-node (``LOCAL_WORLD_SIZE``, ``LOCAL_SIZE`` or
        ``SLURM_NTASKS_PER_NODE``) defines the real nodes, assuming the launchers' block
        placement (global rank = node * per_node + local rank), which is checked against
        ``LOCAL_RANK``/``SLURM_LOCALID``. ``intra_size`` may only split real nodes further.
        """
        env = os.environ if env is None else env
        world = dist.get_world_size()
        me = dist.get_rank()
        per_node, source = launcher_local_size(env)
        if per_node is None:
            per_node, source = world, "no launcher variable; one node assumed"
        if world % per_node != 0:
            raise TopologyError(
                f"world size {world} is not a multiple of the processes per node {per_node} ({source})"
            )
        local_rank = env.get("LOCAL_RANK", env.get("SLURM_LOCALID"))
        if local_rank is not None and int(local_rank) != me % per_node:
            raise TopologyError(
                f"rank {me} has local rank {local_rank}, but block placement with {per_node} processes "
                f"per node ({source}) expects {me % per_node}; ranks must be numbered node by node"
            )
        node_of = [r // per_node for r in range(world)]
        return cls.build(ranks, intra_size, node_of=node_of, timeout=timeout)

    @classmethod
    def from_groups(cls, cp_group, level_groups: Sequence = ()) -> "TreeGroups":
        """Wrap existing process groups (e.g. Megatron's ``cp`` and ``hcp``), innermost first.

        level_groups: ``[]`` for a flat group, or ``[intra, inter]`` whose sizes multiply to
        the CP size.
        """
        cp_ranks = tuple(dist.get_process_group_ranks(cp_group))
        level_groups = list(level_groups)
        if len(level_groups) in (0, 1):
            return cls(cp_group, cp_ranks, (Level("intra", cp_group, cp_ranks),), len(cp_ranks))
        if len(level_groups) != 2:
            raise TopologyError(f"expected at most 2 levels (intra, inter), got {len(level_groups)}")
        ranks = [tuple(dist.get_process_group_ranks(g)) for g in level_groups]
        if len(ranks[0]) * len(ranks[1]) != len(cp_ranks):
            raise TopologyError(
                f"level sizes {[len(r) for r in ranks]} multiply to {len(ranks[0]) * len(ranks[1])}, "
                f"expected the CP size {len(cp_ranks)}"
            )
        if not set(ranks[0]) | set(ranks[1]) <= set(cp_ranks):
            raise TopologyError(f"level groups {ranks} are not inside the CP group {cp_ranks}")
        levels = (Level("intra", level_groups[0], ranks[0]), Level("inter", level_groups[1], ranks[1]))
        return cls(cp_group, cp_ranks, levels, len(ranks[0]))


def launcher_local_size(env) -> tuple[int | None, str]:
    """Processes per node announced by the launcher, and which variable said so."""
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = env.get(var)
        if raw:
            # Slurm writes e.g. "4" or "4(x2)" for 4 tasks on each of 2 nodes.
            head = raw.split("(")[0].split(",")[0]
            try:
                value = int(head)
            except ValueError:
                raise TopologyError(f"cannot read processes per node from {var}={raw!r}") from None
            if value < 1:
                raise TopologyError(f"{var}={raw!r} must be a positive integer")
            return value, f"{var}={raw}"
    return None, ""


def _normalise_rank_lists(ranks, world: int) -> list[tuple[int, ...]]:
    if ranks is None:
        lists = [tuple(range(world))]
    else:
        ranks = list(ranks)
        if not ranks:
            raise TopologyError("ranks must not be empty")
        if all(isinstance(r, int) for r in ranks):
            lists = [tuple(ranks)]
        else:
            lists = [tuple(int(x) for x in r) for r in ranks]
    seen: set[int] = set()
    for group in lists:
        if not group:
            raise TopologyError("a CP group must have at least one rank")
        for r in group:
            if not 0 <= r < world:
                raise TopologyError(f"rank {r} in CP group {list(group)} is outside the world of {world} ranks")
            if r in seen:
                raise TopologyError(f"rank {r} appears in more than one CP group (or twice in one): {lists}")
            seen.add(r)
    return lists


def _intra_size_for(cp_ranks: Sequence[int], node_of: Sequence, intra_size: int | None) -> int:
    """CP ranks per node for one CP group, validated against the real node layout."""
    size = len(cp_ranks)
    nodes: list = []
    count: dict = {}
    for r in cp_ranks:
        n = node_of[r]
        if n not in count:
            nodes.append(n)
            count[n] = 0
        elif nodes[-1] != n:
            raise TopologyError(
                f"CP group {list(cp_ranks)} visits node {n!r} twice with other nodes in between; "
                "the ranks of one node must be consecutive in the CP group"
            )
        count[n] += 1
    per_node = set(count.values())
    if len(per_node) != 1:
        raise TopologyError(
            f"CP group {list(cp_ranks)} has unequal ranks per node {dict(count)}; expected the same on every node"
        )
    real = per_node.pop()
    if intra_size is None:
        return real
    if not isinstance(intra_size, int) or intra_size < 1:
        raise TopologyError(f"intra_size must be a positive integer, got {intra_size!r}")
    if size % intra_size != 0:
        raise TopologyError(
            f"intra_size {intra_size} does not factor the CP size {size}; expected a divisor of {size}"
        )
    if real % intra_size != 0:
        raise TopologyError(
            f"intra_size {intra_size} disagrees with the real layout: the CP group {list(cp_ranks)} has "
            f"{real} ranks on each of its {len(nodes)} node(s), so an intra-node level of {intra_size} "
            f"would span nodes; expected a divisor of {real}"
        )
    return intra_size


def _gather_hostnames(world: int) -> list[str]:
    name = os.environ.get(ENV_HOSTNAME) or socket.gethostname()
    names: list = [None] * world
    dist.all_gather_object(names, name)
    return names
