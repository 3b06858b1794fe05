"""``TreeGroups``: a context-parallel group and its reduction levels, innermost first.

Invariant: groups are built once, from the launch environment or from explicit sizes, and
then passed down to every function that communicates (no process-group globals;
docs/design.md, "How the code is written"). A layout that does not factor, or an "intra-node" level whose ranks are not on one
node, is an error that says what was found and what was expected -- never a silent
fallback to a flat group.

Levels follow Megatron-Core's ``hierarchical_context_parallel_sizes`` order: level 0 is the
group of CP ranks inside one node (NVLink), level 1 the group of CP ranks with the same
index on every node (InfiniBand). A CP group that lives on one node, or has one rank per
node, has a single level.

Every process of the default group must call the builders with the same arguments (like
``torch.distributed.new_group``), also processes that end up in another CP group. The
builders exchange what each rank sees (arguments, host name, launcher variables) once, in
one all-gather over the default group, and validate the gathered facts with the same code
on every rank: a bad layout is the same :class:`TopologyError` on every rank, never an
error on some and a timeout on the others.

Every group built here has a finite collective timeout: ``timeout=`` seconds, else the
default group's own (what ``init_process_group(timeout=...)`` was given; torch's default
is 30 minutes for gloo, 10 for NCCL), never ``None``.
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from . import collectives, liveness, shm
from .agreement import Agreement, agreement_for

__all__ = ["Level", "TreeGroups", "TopologyError", "launcher_local_size", "LAUNCHER_VARIABLES", "slurm_torch_env",
           "init_from_launcher", "LauncherEnvError", "DEFAULT_INIT_TIMEOUT_S"]

ENV_HOSTNAME = "MEGATRON_TREE_HOSTNAME"  # override the host name, to test multi-host validation


LAUNCHER_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LOCAL_RANK",
                      "SLURM_LOCALID")
"""Launcher variables :meth:`TreeGroups.from_env` reads (processes per node, then local rank)."""


class TopologyError(ValueError):
    """A CP layout that does not factor or disagrees with where the ranks really are."""


class LauncherEnvError(TopologyError):
    """The launcher's variables are half set or unreadable, or there are none and no process group."""


def rendezvous_error(e: Exception, where: str, within: str, world: str) -> LauncherEnvError:
    """The :class:`LauncherEnvError` for ``init_process_group``'s rendezvous failure ``e`` (a rank that never
    came, or a wrong address): ``where`` (the address and this rank), ``within`` (the timeout, as the caller's
    setting names it) and ``world`` (what gives the world size) around the first line of torch's own words
    ("Timed out after 7 seconds waiting for clients. 2/3 clients joined." on rank 0, "wait timeout after
    6000ms, keys: /default_pg/0//cpu//0/0" on the others)."""
    text = str(e).strip()
    first = (text.splitlines()[0] if text else type(e).__name__).rstrip(".")
    return LauncherEnvError(
        f"{where} failed within {within}: {first}; every rank must be started with the same MASTER_ADDR, MASTER_PORT "
        f"and {world}, and a rank that failed before it (a bad argument, an import error) never joins: see the "
        "other ranks' output")


DEFAULT_INIT_TIMEOUT_S = 300.0
"""Rendezvous and collective timeout of a default group :meth:`TreeGroups.from_env` creates itself."""


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
    timeout: float | None = None
    """Collective timeout of these groups in seconds (``None``: read from the CP group)."""

    def __post_init__(self):
        collectives.give_op_name(self)  # sets self.op_name

    @property
    def agreement(self) -> Agreement:
        """The CP group's cross-rank signature check (shared by every ``TreeGroups`` of that group)."""
        ag = self.__dict__.get("_agreement")
        if ag is None:
            ag = agreement_for(self.cp_group, self.cp_ranks, self.timeout)
            object.__setattr__(self, "_agreement", ag)
        return ag

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
    def process_groups(self) -> tuple:
        """Every process group a merge over these groups may use: the CP group, then each level's."""
        return (self.cp_group, *(lv.group for lv in self.levels))

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
            # what the small collectives go through: "shm" where a channel was attached (transport="shm" on
            # gloo ranks of one x86-64 host), else the groups' backend
            "transport": "shm" if any(shm.channel_of(g) is not None for g in self.process_groups) else "backend",
        }

    # ------------------------------------------------------------------ builders

    @classmethod
    def build(
        cls,
        ranks: Sequence[int] | Sequence[Sequence[int]] | None = None,
        intra_size: int | None = None,
        *,
        node_of: Sequence | None = None,
        timeout: float | datetime.timedelta | None = None,
        transport: str | None = None,
    ) -> "TreeGroups":
        """Build CP groups and their levels; every process calls it with the same arguments.

        ranks: ``None`` (one CP group of the whole world), one list of global ranks (one CP
            group), or a list of disjoint lists (several CP groups side by side, e.g. CP
            inside TP x CP x DP). Returns the group this process belongs to.
        intra_size: CP ranks per node. ``None`` takes the real layout (ranks per host);
            a smaller divisor simulates nodes inside one host (8 processes as 2 x 4).
        node_of: node id of every global rank (default: host names, exchanged once).
        timeout: seconds (or a ``timedelta``) a collective on these groups may wait before
            failing with ``CommError``; default: the default process group's own timeout.
        transport: ``"auto"`` (the default, also spelt ``"shm"``): the small collectives of a gloo
            group whose ranks share an x86-64 host go through a shared-memory channel
            (``distributed.shm``: no thread hand-off, what CPU decoding needs when every core
            computes), every other group (NCCL, ranks on several hosts) through its backend;
            ``"backend"``: every collective through the backend. Default: ``$MEGATRON_TREE_TRANSPORT``,
            else ``"auto"``; ``describe()["transport"]`` says what runs.

        Collectives: one all-gather of this rank's facts (arguments, host name) over the
        default group, then ``new_group`` for every CP group and level.

        A peer that is gone is a ``CommError`` naming it: each rank first writes its liveness
        record (rank, host, pid) to the default store (:mod:`megatron_tree.distributed.liveness`), and the
        waits here probe the others' -- a rank that exited is named at once, one that never
        wrote its record once the exchange fails.
        """
        _require_initialised("TreeGroups.build")
        facts = _exchange_facts(ranks, intra_size, node_of, timeout, transport=transport)
        return cls._assemble(facts, ranks, intra_size, node_of, timeout)

    @classmethod
    def _assemble(cls, facts: list[dict], ranks, intra_size, node_of, timeout) -> "TreeGroups":
        """Validate the gathered facts (the same on every rank) and create the groups."""
        world = dist.get_world_size()
        me = dist.get_rank()
        cp_lists = _normalise_rank_lists(ranks, world)
        if node_of is None:
            node_of = [f["host"] for f in facts]
        elif len(node_of) != world:
            raise TopologyError(f"node_of must name a node for each of the {world} ranks, got {len(node_of)}")
        td = collectives.as_timedelta(timeout) or collectives.group_timeout()
        layouts = [(cp_ranks, _intra_size_for(cp_ranks, node_of, intra_size)) for cp_ranks in cp_lists]

        mine = None
        new_group = functools.partial(_new_group_watched, world, td)
        for cp_ranks, size_intra in layouts:
            cp_group = new_group(cp_ranks)
            blocks = [cp_ranks[i : i + size_intra] for i in range(0, len(cp_ranks), size_intra)]
            strides = [tuple(b[j] for b in blocks) for j in range(size_intra)]
            levels: list[Level] = []
            if 1 < size_intra < len(cp_ranks):
                for name, parts in (("intra", blocks), ("inter", strides)):
                    for part in parts:
                        g = new_group(part)
                        if me in part:
                            levels.append(Level(name, g, tuple(part)))
            if me in cp_ranks:
                if not levels:
                    name = "inter" if size_intra == 1 and len(cp_ranks) > 1 else "intra"
                    levels = [Level(name, cp_group, tuple(cp_ranks))]
                mine = cls(cp_group, tuple(cp_ranks), tuple(levels), size_intra, td.total_seconds())
                # every rank wrote its liveness record before the facts exchange: read the peers' now, while
                # the store is up -- a peer that serves it (rank 0 under a MASTER_ADDR rendezvous: srun, the
                # deepspeed launcher) takes it down when it dies, and is named only from a record read before
                liveness.remember(cp_ranks)
                if facts[0]["transport"] in ("auto", "shm"):
                    _attach_channels(mine, [f["host"] for f in facts])
        if mine is None:
            raise TopologyError(f"rank {me} is not in any of the CP groups {cp_lists}")
        return mine

    @classmethod
    def from_env(
        cls,
        ranks: Sequence[int] | Sequence[Sequence[int]] | None = None,
        intra_size: int | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        env: dict | None = None,
        transport: str | None = None,
    ) -> "TreeGroups":
        """Build the groups from the launcher's environment (torchrun, deepspeed, Slurm).

        The launcher's processes-per-node (``LOCAL_WORLD_SIZE``, ``LOCAL_SIZE`` or
        ``SLURM_NTASKS_PER_NODE``) defines the real nodes, assuming the launchers' block
        placement (global rank = node * per_node + local rank), which is checked against
        ``LOCAL_RANK``/``SLURM_LOCALID``. ``intra_size`` may only split real nodes further.
        timeout, transport: as :meth:`build`.

        Without a default process group, a launcher's variables create one first
        (:func:`init_from_launcher`: torchrun's or the deepspeed launcher's ``RANK``,
        ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; srun's ``SLURM_PROCID``,
        ``SLURM_NTASKS``, ``SLURM_LOCALID`` and the job's first host), so a script needs no
        ``init_process_group`` of its own. Half-set variables are a :class:`LauncherEnvError`
        naming the variable, raised before any rendezvous wait.

        Every rank's launcher variables are gathered once and checked on every rank, so a
        variable that differs between ranks, is not an integer, or numbers ranks
        round-robin across nodes is the same :class:`TopologyError` everywhere.
        """
        env = os.environ if env is None else env
        init_from_launcher(env, timeout)
        launcher = {v: env.get(v) for v in LAUNCHER_VARIABLES}
        facts = _exchange_facts(ranks, intra_size, "launcher", timeout, launcher=launcher, transport=transport)
        world = dist.get_world_size()
        per_node, source = _per_node_from_facts(facts, world)
        _check_local_ranks(facts, per_node, source)
        _check_nodes_on_one_host(facts, per_node, source)
        node_of = [r // per_node for r in range(world)]
        return cls._assemble(facts, ranks, intra_size, node_of, timeout)

    @classmethod
    def from_groups(cls, cp_group, level_groups: Sequence = ()) -> "TreeGroups":
        """Wrap existing process groups (e.g. Megatron's ``cp`` and ``hcp``), innermost first.

        level_groups: ``[]`` for a flat group, or ``[intra, inter]`` whose sizes multiply to
        the CP size.
        """
        cp_ranks = tuple(dist.get_process_group_ranks(cp_group))
        liveness.register()
        level_groups = list(level_groups)
        timeout = max(collectives.group_timeout(g).total_seconds() for g in [cp_group, *level_groups])
        if len(level_groups) in (0, 1):
            return cls(cp_group, cp_ranks, (Level("intra", cp_group, cp_ranks),), len(cp_ranks), timeout)
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
        return cls(cp_group, cp_ranks, levels, len(ranks[0]), timeout)


def launcher_local_size(env) -> tuple[int | None, str]:
    """Processes per node announced by the launcher, and which variable said so."""
    # SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node; SLURM_TASKS_PER_NODE always (srun -N2 -n8)
    for var in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        raw = env.get(var)
        if raw:
            # Slurm writes e.g. "4" or "4(x2)" for 4 tasks on each of 2 nodes ("4,3" for uneven nodes: the
            # first node's count, which the local-rank check then holds every rank to).
            head = raw.split("(")[0].split(",")[0]
            try:
                value = int(head)
            except ValueError:
                raise LauncherEnvError(f"cannot read processes per node from {var}={raw!r}; expected a positive "
                                       "integer (Slurm's form \"4(x2)\" is read too)") from None
            if value < 1:
                raise LauncherEnvError(f"{var}={raw!r} must be a positive integer (processes per node)")
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


def _require_initialised(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs the default process group: call torch.distributed.init_process_group(...) first "
            "(a launcher such as torchrun only sets variables, it does not create the group), or use "
            "TreeGroups.from_env(), which creates it from torchrun's, the deepspeed launcher's or srun's variables"
        )


def slurm_torch_env(env) -> dict:
    """torch's variables from Slurm's for a task that ``srun`` started without torchrun.

    Returns the variables to add (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); empty
    when RANK is already set (torchrun inside srun) or this is not a Slurm task. The
    rendezvous address is not among them (see :func:`init_from_launcher`).
    """
    if "RANK" in env or "SLURM_PROCID" not in env:
        return {}
    out = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
    }
    per_node = env.get("SLURM_NTASKS_PER_NODE")
    if per_node:
        out["LOCAL_WORLD_SIZE"] = per_node.split("(")[0].split(",")[0]
    return out


_ANNOUNCED = False


def _int_var(env, name: str, low: int, high: int | None, what: str) -> int:
    raw = env.get(name)
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise LauncherEnvError(f"{name}={raw!r} is not an integer; expected {what}") from None
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise LauncherEnvError(f"{name}={raw!r} is out of range; expected {what} ({bound})")
    return value


def _first_slurm_host(env) -> str:
    """The first host of the job's node list, as ``scontrol show hostnames`` expands it."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise LauncherEnvError(
            "SLURM_PROCID is set but MASTER_ADDR and SLURM_JOB_NODELIST are not; set MASTER_ADDR to the job's "
            "first host (the sbatch scripts in launch/slurm do: scontrol show hostnames | head -n 1)")
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol is None:
        raise LauncherEnvError(
            f"MASTER_ADDR is not set and scontrol is not on PATH to expand SLURM_JOB_NODELIST={nodelist!r}; "
            "set MASTER_ADDR to the job's first host")
    try:
        p = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise LauncherEnvError(f"scontrol show hostnames {nodelist} did not answer in 30 s; set MASTER_ADDR") from None
    hosts = p.stdout.split()
    if p.returncode != 0 or not hosts:
        raise LauncherEnvError(f"scontrol show hostnames {nodelist} failed (exit {p.returncode}: "
                               f"{p.stderr.strip()[:200]}); set MASTER_ADDR to the job's first host")
    return hosts[0]


def launcher_rendezvous(env) -> dict | None:
    """The default group's rendezvous from the launcher's variables, checked; ``None``: no launcher.

    Returns ``{"rank", "world_size", "master_addr", "master_port", "local_rank", "launcher"}``
    (``master_addr``/``master_port`` ``None`` for a world of one without ``MASTER_ADDR``: an
    in-process group; with it, both are checked as for any world). Every half-set or unreadable
    variable is a :class:`LauncherEnvError` naming it; nothing here waits on another process
    (under Slurm without MASTER_ADDR, ``scontrol show hostnames`` is run, bounded to 30 s).
    """
    slurm = slurm_torch_env(env)
    launcher = "slurm" if slurm else ("deepspeed" if "CROSS_RANK" in env and "LOCAL_SIZE" in env else "torchrun")
    if slurm and "SLURM_NTASKS" not in env:
        raise LauncherEnvError("SLURM_PROCID is set but SLURM_NTASKS is not; expected both from srun "
                               "(the number of tasks of the job step)")
    merged = {**env, **slurm}
    present = [v for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if merged.get(v) not in (None, "")]
    if not present:
        return None
    for var in ("RANK", "WORLD_SIZE"):
        if merged.get(var) in (None, ""):
            raise LauncherEnvError(
                f"{var} is not set but {', '.join(v for v in present)} is; a launcher sets RANK and WORLD_SIZE "
                "together (torchrun, the deepspeed launcher), or srun sets SLURM_PROCID and SLURM_NTASKS")
    src = {"RANK": "SLURM_PROCID", "WORLD_SIZE": "SLURM_NTASKS", "LOCAL_RANK": "SLURM_LOCALID"} if slurm else {}
    world = _int_var({src.get("WORLD_SIZE", "WORLD_SIZE"): merged["WORLD_SIZE"]}, src.get("WORLD_SIZE", "WORLD_SIZE"),
                     1, None, "the number of processes of the job")
    rank = _int_var({src.get("RANK", "RANK"): merged["RANK"]}, src.get("RANK", "RANK"), 0, world - 1,
                    f"this process's rank in the world of {world}")
    per_node, source = launcher_local_size(merged)
    if per_node is not None and world % per_node:
        raise LauncherEnvError(f"{source} does not divide WORLD_SIZE={world}; expected the processes per node, "
                               f"a divisor of the world size")
    local_rank = None
    if merged.get("LOCAL_RANK") not in (None, ""):
        name = src.get("LOCAL_RANK", "LOCAL_RANK")
        local_rank = _int_var({name: merged["LOCAL_RANK"]}, name, 0, (per_node or world) - 1,
                              "this process's index on its node")
    addr, port = env.get("MASTER_ADDR") or None, env.get("MASTER_PORT") or None
    # A world of one rendezvous in process, unless MASTER_ADDR names a host: then it goes through TCP
    # like any world, so its port is checked the same way (else torch's own cast error, naming None).
    if world > 1 or addr is not None:
        if addr is None:
            if not slurm:
                raise LauncherEnvError(f"MASTER_ADDR is not set but RANK={rank} and WORLD_SIZE={world} are; "
                                       "expected the rendezvous host (torchrun and the deepspeed launcher set it)")
        if port is None:
            if not slurm:
                alone = (f" (MASTER_ADDR={addr} is set, so even a world of 1 rendezvous over TCP; unset "
                         "MASTER_ADDR for an in-process group)") if world == 1 else ""
                raise LauncherEnvError(f"MASTER_PORT is not set but RANK={rank} and WORLD_SIZE={world} are; "
                                       "expected the rendezvous port (torchrun and the deepspeed launcher set it)"
                                       + alone)
            job = env.get("SLURM_JOB_ID")
            if job is None:
                raise LauncherEnvError("MASTER_PORT is not set and SLURM_JOB_ID is not either; set MASTER_PORT")
            port = str(20000 + _int_var(env, "SLURM_JOB_ID", 0, None, "the Slurm job id") % 20000)
        port = str(_int_var({"MASTER_PORT": port}, "MASTER_PORT", 1, 65535, "a TCP port"))
        if addr is None:
            addr = _first_slurm_host(env)
    else:
        port = None  # in process: no port is read
    return {"rank": rank, "world_size": world, "master_addr": addr, "master_port": port,
            "local_rank": local_rank, "launcher": launcher}


def init_from_launcher(env=None, timeout: float | datetime.timedelta | None = None) -> bool:
    """Create the default process group from the launcher's variables when none exists.

    Returns ``True`` when it created one, ``False`` when one existed. Backend: ``nccl`` when
    CUDA is available (this process's device set to its local rank), else ``gloo``; timeout:
    ``timeout`` else :data:`DEFAULT_INIT_TIMEOUT_S` (the rendezvous and every collective of the
    default group). Global rank 0 says what it created, once, on stderr. Without a launcher
    and without a group: a :class:`LauncherEnvError` that says what to do.
    """
    if dist.is_available() and dist.is_initialized():
        return False
    env = os.environ if env is None else env
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build; TreeGroups needs it")
    rdv = launcher_rendezvous(env)
    if rdv is None:
        raise LauncherEnvError(
            "TreeGroups.from_env found no process group and no launcher variables (RANK and WORLD_SIZE, or "
            "SLURM_PROCID and SLURM_NTASKS). Start the script under a launcher, e.g. "
            "`torchrun --nproc_per_node 2 script.py`, `deepspeed --num_gpus 2 script.py` or `srun python script.py` "
            "(from_env then creates the group), or call torch.distributed.init_process_group(...) before it")
    import torch

    td = collectives.as_timedelta(timeout) or datetime.timedelta(seconds=DEFAULT_INIT_TIMEOUT_S)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and rdv["local_rank"] is not None:
        torch.cuda.set_device(rdv["local_rank"])
    world, rank = rdv["world_size"], rdv["rank"]
    if world == 1 and rdv["master_addr"] is None:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)
    else:
        url = f"tcp://{_url_host(rdv['master_addr'])}:{rdv['master_port']}"
        try:
            dist.init_process_group(backend, init_method=url, rank=rank, world_size=world, timeout=td)
        except (dist.DistStoreError, dist.DistNetworkError) as e:  # a rank that never came, or a wrong address
            raise rendezvous_error(
                e, f"the rendezvous at {rdv['master_addr']}:{rdv['master_port']} ({rdv['launcher']} launcher's "
                f"variables; this is rank {rank} of {world})", f"the timeout of {td.total_seconds():g} s",
                "world size") from None
    global _ANNOUNCED
    if rank == 0 and not _ANNOUNCED:
        _ANNOUNCED = True
        where = f"{rdv['master_addr']}:{rdv['master_port']}" if rdv["master_addr"] else "in process"
        sys.stderr.write(f"megatron_tree: created the default process group from the {rdv['launcher']} launcher's "
                         f"variables: {backend}, world {world}, rendezvous {where}, timeout "
                         f"{td.total_seconds():g} s\n")
        sys.stderr.flush()
    return True


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


TRANSPORTS = ("auto", "backend", "shm")
"""What :meth:`TreeGroups.build`'s ``transport`` takes (``auto`` and ``shm`` attach the same channels)."""
ENV_TRANSPORT = "MEGATRON_TREE_TRANSPORT"


def _attach_channels(groups: "TreeGroups", hosts: list) -> None:
    """A shared-memory channel (``shm.attach``) for each of this rank's gloo groups whose ranks share a host:
    the CP group, then its levels (the same order on every member)."""
    seen = set()
    for g, ranks in [(groups.cp_group, groups.cp_ranks)] + [(lv.group, lv.ranks) for lv in groups.levels]:
        if id(g) in seen or len(ranks) < 2 or len({hosts[r] for r in ranks}) != 1:
            continue
        seen.add(id(g))
        if dist.get_backend(g) != "gloo":
            continue
        shm.attach(g, ranks, collectives.exchange_objects, timeout=groups.timeout or DEFAULT_INIT_TIMEOUT_S)


def _exchange_facts(ranks, intra_size, node_of, timeout, launcher: dict | None = None,
                    transport: str | None = None) -> list[dict]:
    """Every rank's view of the build, gathered once over the default group (rank order).

    Nothing is validated before the exchange, so that no rank raises while the others wait;
    :func:`_check_same_call` is the first check on the gathered facts.
    """
    try:
        td = collectives.as_timedelta(timeout) or collectives.group_timeout()
        timeout_s, timeout_error = td.total_seconds(), None
    except (TypeError, ValueError) as e:
        timeout_s, timeout_error = repr(timeout), f"timeout must be a positive number of seconds or a timedelta: {e}"
    shown_nodes = "from the launcher" if isinstance(node_of, str) else _plain_ranks(node_of)
    if transport is None:
        transport = os.environ.get(ENV_TRANSPORT) or "auto"
    if transport not in TRANSPORTS and timeout_error is None:
        timeout_error = (f"transport must be one of {TRANSPORTS} (from the argument or ${ENV_TRANSPORT}), got "
                         f"{transport!r}")
    call = (f"(ranks={_plain_ranks(ranks)!r}, intra_size={intra_size!r}, node_of={shown_nodes!r}, "
            f"timeout_s={timeout_s!r}, transport={transport!r})")
    mine = {"call": call, "timeout_error": timeout_error, "launcher": launcher, "transport": transport,
            "host": os.environ.get(ENV_HOSTNAME) or socket.gethostname()}
    liveness.register()  # before the first collective: a peer that dies from here on is named
    what = "TreeGroups: exchanging topology facts"
    world = range(dist.get_world_size())
    try:
        facts = liveness.watched(lambda: collectives.exchange_objects(mine, None, what=what), world)
    except liveness.PeerGone as e:
        raise collectives.peer_gone(what, e.gone) from None
    except collectives.CommError as e:
        # who is gone: exited, or never checked in (a live rank gets a moment to write its record)
        found = liveness.gone(world, grace=min(1.0, 0.25 * (_timeout_s(timeout) or 4.0)))
        if found:
            raise collectives.peer_gone(what, found, e) from e
        raise
    _check_same_call(facts)
    return facts


def _timeout_s(timeout) -> float | None:
    try:
        return (collectives.as_timedelta(timeout) or collectives.group_timeout()).total_seconds()
    except (TypeError, ValueError):
        return None


def _new_group_watched(world: int, td: datetime.timedelta, ranks):
    """``collectives.new_group(ranks)`` with every rank of the world probed while it waits: a peer that
    has exited is a CommError naming it at once, not a raw "Wait timeout" after ``td``."""
    what = f"TreeGroups: creating the process group of ranks {list(ranks)}"
    try:
        return liveness.watched(lambda: collectives.new_group(ranks, timeout=td), range(world))
    except liveness.PeerGone as e:
        raise collectives.peer_gone(what, e.gone) from None
    except RuntimeError as e:  # torch's store wait ("Wait timeout") or the backend's connect
        if isinstance(e, collectives.CommError):
            raise
        found = liveness.gone(range(world))
        if found:
            raise collectives.peer_gone(what, found, e) from e
        raise collectives.CommError(
            f"{what}: torch.distributed.new_group failed within the groups' timeout of {td.total_seconds():g} s: a "
            f"peer is stuck or died before creating it. Error seen: {str(e).strip() or type(e).__name__}"
        ) from e


def _check_same_call(facts: list[dict]) -> None:
    calls: dict = {}
    for r, f in enumerate(facts):
        calls.setdefault(f["call"], []).append(r)
    if len(calls) > 1:
        listed = "; ".join(f"{call} on ranks {rs}" for call, rs in calls.items())
        bad = "".join(f" (rank {r}: {f['timeout_error']})" for r, f in enumerate(facts) if f["timeout_error"])
        raise TopologyError(f"ranks built TreeGroups with different arguments: {listed}; every rank must pass the "
                            f"same{bad}")
    if facts[0]["timeout_error"]:
        raise TopologyError(facts[0]["timeout_error"])


def _plain_ranks(value):
    if value is None or isinstance(value, (str, int)):
        return value
    try:
        return [_plain_ranks(v) for v in value]
    except TypeError:
        return repr(value)


def _per_node_from_facts(facts: list[dict], world: int) -> tuple[int, str]:
    """Processes per node from every rank's launcher variables; the same verdict on every rank."""
    seen: dict = {}
    for r, f in enumerate(facts):
        try:
            value, source = launcher_local_size(f["launcher"])
        except TopologyError as e:
            raise TopologyError(f"rank {r}: {e}") from None
        seen.setdefault((value, source), []).append(r)
    if len(seen) > 1:
        listed = "; ".join(f"{src or 'no launcher variable'} on ranks {rs}" for (_, src), rs in seen.items())
        raise TopologyError(
            f"ranks see different processes per node: {listed}; every rank of one launch must see the same"
        )
    (per_node, source), = seen
    if per_node is None:
        per_node, source = world, "no launcher variable; one node assumed"
    if world % per_node != 0:
        raise TopologyError(
            f"world size {world} is not a multiple of the processes per node {per_node} ({source})"
        )
    return per_node, source


def _check_nodes_on_one_host(facts: list[dict], per_node: int, source: str) -> None:
    """The ranks the launcher puts on one node run on one host (several launcher nodes on one host -- simulated
    nodes -- are fine): else the "intra" level, or a flat group taken for one node, would span hosts."""
    for first in range(0, len(facts), per_node):
        block = range(first, first + per_node)
        hosts: dict = {}
        for r in block:
            hosts.setdefault(facts[r]["host"], []).append(r)
        if len(hosts) > 1:
            seen = "; ".join(f"{h!r}: ranks {rs}" for h, rs in hosts.items())
            if source.startswith("no launcher variable"):
                raise TopologyError(
                    f"no launcher variable gives the processes per node ({', '.join(LAUNCHER_VARIABLES[:3])}), so "
                    f"from_env took the {len(facts)} ranks for one node, but they run on {len(hosts)} hosts "
                    f"({seen}); set LOCAL_WORLD_SIZE to the processes per host, or use TreeGroups.build(), which "
                    "reads the host names")
            raise TopologyError(
                f"{source} puts ranks {first}..{first + per_node - 1} on one node, but they run on "
                f"{len(hosts)} hosts ({seen}); expected the processes per node the launcher really started on "
                f"each host (an intra-node level would span hosts). Unset or correct the variable, or pass "
                "intra_size to TreeGroups.build instead of from_env"
            )


def _check_local_ranks(facts: list[dict], per_node: int, source: str) -> None:
    """LOCAL_RANK / SLURM_LOCALID of every rank must be an integer equal to rank % per_node."""
    found, var = [], None
    for r, f in enumerate(facts):
        env = f["launcher"]
        var = "LOCAL_RANK" if env.get("LOCAL_RANK") is not None else "SLURM_LOCALID"
        raw = env.get(var)
        if raw is None:
            found.append(None)
            continue
        try:
            found.append(int(raw))
        except (TypeError, ValueError):
            raise TopologyError(
                f"rank {r} has {var}={raw!r}, which is not an integer; expected its index on its node "
                f"(0..{per_node - 1})"
            ) from None
    given = [(r, lr) for r, lr in enumerate(found) if lr is not None]
    bad = [(r, lr) for r, lr in given if lr != r % per_node]
    if bad:
        r, lr = bad[0]
        shown = [lr for _, lr in given][:16]
        raise TopologyError(
            f"rank {r} has local rank {lr}, but block placement with {per_node} processes per node ({source}) "
            f"expects {r % per_node}; local ranks of ranks 0..{len(found) - 1} are {shown}"
            f"{' ...' if len(given) > 16 else ''}, expected {[x % per_node for x, _ in given][:16]}; "
            "ranks must be numbered node by node (round-robin numbering across nodes is not supported)"
        )
