"""The merge policy: machine presets, the α–β price of each merge strategy, ``choose_strategy``.

Why it lives here (comm layer, docs/design.md §2): ``strategy="auto"`` picks a merge in
every process that decodes, so the policy is part of the core. ``comm`` imports this module
and nothing here imports another megatron_tree module (arithmetic and YAML only);
``bench/cost_model.py`` builds whole-step predictions, plots and the calibration check on
top of it.

Invariant: every price is one line of arithmetic over one :class:`Preset` (per-level α and
β, the local kernel's bandwidth and fixed costs), and ``auto`` returns the cheapest of
:data:`MERGES` by exactly these prices, resolved once per (topology, state shape,
dtype, preset) and then served from a cache.

Collectives over ``p`` ranks on ``nodes`` nodes (``k = p / nodes`` per node), ``n`` bytes
per rank. Latencies follow NCCL's own tuning model (``src/graph/tuning.cc``,
``ncclTopoTuneModel``):

* ring all-reduce: ``2(p-1)`` steps, ``2(nodes-1)`` of which cross a node boundary, so
  ``(2(p-1) - 2(nodes-1)) α_intra + 2(nodes-1) α_inter``; ring all-gather: ``p-1`` steps,
  ``nodes-1`` of them between nodes. A small message travels the ring hop after hop and
  pays each hop's own latency.
* tree all-reduce (NCCL's pick for small messages): a chain inside the node and a tree
  across nodes, ``2((k-1) α_intra + floor(log2 nodes) α_inter)``, one formula for one node
  and for many.
* bandwidth: all-reduce ``2(p-1)/p * n / β``, all-gather ``(p-1) * n / β``, with the
  inter-node β as soon as the group spans nodes (a pipelined ring runs at its slowest link);
  ``launch`` seconds per collective on top.

On a shared host (``shared_host: true``: CPU processes on one machine) ranks beyond
``host_cores`` time-share the cores: every bandwidth is divided, and every fixed cost
multiplied, by ``max(1, P / host_cores)``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

from .strategies import MERGES

__all__ = [
    "Link", "Preset", "Dims", "PRESET_DIR", "ENV_PRESET", "UNSHIFTED_CANDIDATES",
    "SHIFTED_FALLBACK", "load_preset", "preset_names", "default_preset", "node_layout", "allreduce_time",
    "allgather_time", "kernel_time", "local_merge_time", "merge_cost", "policy", "choose_strategy",
    "clear_cache",
]

PRESET_DIR = Path(__file__).with_name("presets")
ENV_PRESET = "MEGATRON_TREE_COST_PRESET"

"""Every merge this module prices (docs/design.md §4)."""
"""What ``auto`` may pick (``shifted`` only for a call that passes a shift: without one it is ``packed``)."""
UNSHIFTED_CANDIDATES = tuple(c for c in MERGES if c != "shifted")
"""What ``auto`` may pick for a call without a shift (a first decode step, a single call)."""
SHIFTED_FALLBACK = 0.01
"""Expected fraction of ``shifted`` calls whose weights overflow or all underflow and are
redone with MAX + SUM (an assumption: the shift is the previous step's merged lse, which
moves by far less than the ~88 nats fp32 ``exp`` tolerates)."""


@dataclass(frozen=True)
class Link:
    """One level's links, as seen by one rank."""

    alpha: float
    """Seconds of latency per message / per collective step."""
    beta: float
    """Bytes per second one rank can send at this level."""


@dataclass(frozen=True)
class Preset:
    """Machine parameters of the model; YAML maps onto it 1:1 (``presets/*.yaml``)."""

    name: str
    """Short name (the YAML file's stem)."""
    description: str
    """What machine this describes and where the numbers come from."""
    ranks_per_node: int
    """Ranks (GPUs or processes) per node: the intra-node level's size by default."""
    intra: Link
    """Links between ranks of one node (NVLink, PCIe, loopback)."""
    inter: Link
    """Links between nodes (InfiniBand; on a simulated topology, the same loopback)."""
    kernel_bw: float
    """Bytes per second the local decode kernel reads (KV and any scores) on one rank alone."""
    kernel_overhead: float
    """Fixed seconds per local kernel call (launch, Python)."""
    launch: float
    """Fixed seconds per collective call on top of its α steps."""
    algorithm: Literal["ring", "tree"] = "ring"
    """All-reduce algorithm for small payloads: gloo uses ring, NCCL tree."""
    score_passes: int = 0
    """Passes the local kernel makes over an fp32 score matrix in memory: 0 for a fused GPU
    kernel (scores stay in registers and shared memory), 5 for the torch path on CPU (scores,
    max, exp, sum, probabilities @ V)."""
    shared_host: bool = False
    """All ranks share one host's cores (CPU processes): bandwidths divided, fixed costs multiplied."""
    host_cores: float = 0.0
    """Parallel lanes of the shared host (used only with ``shared_host``): its cores, or fewer
    when other work occupies them -- ``calibrate`` measures it as the speedup of P concurrent
    kernels over one."""
    overlap: bool = True
    """Whether a ring hop's transfer overlaps the kernel on the shard in hand."""
    collective_beta: float = 0.0
    """Bytes/s per rank of large collectives when it differs from point-to-point β (gloo's
    all-gather stages through extra copies); 0 means the level's β."""
    memory_bytes: float = 0.0
    """Memory per rank (HBM, or the host's RAM); 0 = unknown. Used to say where a strategy fits."""
    cold_start: float = 0.0
    """Seconds a first call pays once before its step: tracing and compiling a jitted
    function and setting up the communicator on first use (0: not modelled). Used by the
    benchmarks' first-call predictions only, never by ``auto``."""

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "Preset":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{source}: unknown preset key(s) {sorted(unknown)}; expected some of {sorted(known)}")
        required = ("name", "description", "ranks_per_node", "intra", "inter", "kernel_bw", "kernel_overhead", "launch")
        missing = [n for n in required if n not in data]
        if missing:
            raise ValueError(f"{source}: missing preset key(s) {sorted(missing)}")
        kw = dict(data)
        for lvl in ("intra", "inter"):
            link = kw[lvl]
            if not isinstance(link, dict) or set(link) != {"alpha", "beta"}:
                raise ValueError(f"{source}: {lvl} must be a mapping with exactly 'alpha' and 'beta', got {link!r}")
            kw[lvl] = Link(float(link["alpha"]), float(link["beta"]))
        for key in ("kernel_bw", "kernel_overhead", "launch", "memory_bytes", "collective_beta", "host_cores",
                    "cold_start"):
            if key in kw:
                kw[key] = float(kw[key])
        if kw.get("algorithm", "ring") not in ("ring", "tree"):
            raise ValueError(f"{source}: algorithm must be 'ring' or 'tree', got {kw['algorithm']!r}")
        passes = kw.get("score_passes", 0)
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 0:
            raise ValueError(f"{source}: score_passes must be a non-negative integer, got {passes!r}")
        return cls(**kw)

    def as_dict(self) -> dict:
        out = {}
        for f in fields(self):
            val = getattr(self, f.name)
            out[f.name] = {"alpha": val.alpha, "beta": val.beta} if isinstance(val, Link) else val
        return out

    def oversub(self, p: int) -> float:
        """Time-sharing factor of p ranks on this machine (1 off a shared host)."""
        if not self.shared_host or self.host_cores <= 0:
            return 1.0
        return max(1.0, p / self.host_cores)


@dataclass(frozen=True)
class Dims:
    """Shapes of one decode step."""

    batch: int
    """Sequences decoded together (B)."""
    heads_q: int
    """Query heads (Hq)."""
    heads_kv: int
    """KV heads (Hkv; Hq % Hkv == 0)."""
    head_dim: int = 128
    """D."""
    seqlen_q: int = 1
    """Query tokens per step (Sq)."""
    kv_bytes: int = 4
    """Bytes per KV element (4 fp32, 2 bf16/fp16)."""
    acc_bytes: int = 4
    """Bytes per element of the partial states that travel (fp32, or 8 for fp64)."""

    def kv_shard(self, tokens: int) -> int:
        """Bytes of K plus V for ``tokens`` tokens."""
        return 2 * self.batch * tokens * self.heads_kv * self.head_dim * self.kv_bytes

    @property
    def out_bytes(self) -> int:
        return self.batch * self.seqlen_q * self.heads_q * self.head_dim * self.acc_bytes

    @property
    def lse_bytes(self) -> int:
        return self.batch * self.heads_q * self.seqlen_q * self.acc_bytes

    def shift_digest_bytes(self, p: int) -> int:
        """Bytes ``shifted`` adds to its SUM: two words per rank, every rank's digest of its shift
        (``comm.shift_digest``), so that shifts that differ between ranks are seen."""
        return 2 * p * self.acc_bytes

    @property
    def lse_wire_bytes(self) -> int:
        """Bytes of partial lse that travel whole (all-gathers, the pass-Q ring): float64, so a
        merge is exact at large score magnitudes (``comm``'s docstring). All-reduces carry the
        weights instead, in ``acc_bytes``."""
        return self.batch * self.heads_q * self.seqlen_q * 8

    def kernel_bytes(self, tokens: int, score_passes: int = 0) -> int:
        """Memory traffic of the local kernel over ``tokens`` keys: KV once, plus
        ``score_passes`` passes over an fp32 score matrix when the kernel materialises one."""
        return self.kv_shard(tokens) + score_passes * self.batch * self.heads_q * self.seqlen_q * tokens * 4


# ---------------------------------------------------------------------------- collectives


def node_layout(preset: Preset, p: int, intra_size: int | None) -> tuple[int, int]:
    """(ranks per node, nodes) of a group of p ranks; ``intra_size=None`` fills nodes of the
    preset's size, 1 puts every rank on a node of its own."""
    k = intra_size or min(p, preset.ranks_per_node)
    if k < 1 or p % k:
        k = p  # a size that does not factor p cannot be a node layout: price one node
    return k, p // k


def _ring_latency(preset: Preset, steps: int, inter_steps: int, p_total: int) -> float:
    s = preset.oversub(p_total)
    return ((steps - inter_steps) * preset.intra.alpha + inter_steps * preset.inter.alpha) * s


def _beta(preset: Preset, nodes: int, p_total: int) -> float:
    """Per-rank bandwidth of a collective: the slowest level it crosses."""
    link = preset.inter if nodes > 1 else preset.intra
    beta = preset.collective_beta if preset.collective_beta > 0 else link.beta
    return beta / preset.oversub(p_total)


def allreduce_time(preset: Preset, p: int, nodes: int, nbytes: int, p_total: int | None = None) -> float:
    """Seconds of one all-reduce of ``nbytes`` per rank over ``p`` ranks on ``nodes`` nodes.

    ``p_total`` ranks share the host (the whole CP group, also when this collective runs on
    one level of it); it only matters on a shared-host preset.
    """
    if p <= 1:
        return 0.0
    p_total = p_total or p
    s = preset.oversub(p_total)
    if preset.algorithm == "tree":
        k = p // nodes
        lat = 2 * ((k - 1) * preset.intra.alpha + int(math.log2(nodes)) * preset.inter.alpha) * s
    else:
        lat = _ring_latency(preset, 2 * (p - 1), 2 * (nodes - 1), p_total)
    return preset.launch * s + lat + 2 * (p - 1) / p * nbytes / _beta(preset, nodes, p_total)


def allgather_time(preset: Preset, p: int, nodes: int, nbytes: int, p_total: int | None = None) -> float:
    """Seconds of one (ring) all-gather of ``nbytes`` per rank over ``p`` ranks on ``nodes`` nodes."""
    if p <= 1:
        return 0.0
    p_total = p_total or p
    lat = _ring_latency(preset, p - 1, nodes - 1, p_total)
    return preset.launch * preset.oversub(p_total) + lat + (p - 1) * nbytes / _beta(preset, nodes, p_total)


def kernel_time(preset: Preset, dims: Dims, tokens: int, p_active: int = 1) -> float:
    """Seconds of the local decode kernel over ``tokens`` keys while ``p_active`` ranks run."""
    s = preset.oversub(p_active)
    return (preset.kernel_overhead + dims.kernel_bytes(tokens, preset.score_passes) / preset.kernel_bw) * s


def local_merge_time(preset: Preset, dims: Dims, states: int, p_active: int) -> float:
    """A local merge of ``states`` partial states: a few passes over them."""
    s = preset.oversub(p_active)
    return (preset.kernel_overhead + 4 * states * (dims.out_bytes + dims.lse_bytes) / preset.kernel_bw) * s


# ---------------------------------------------------------------------------- merges


def merge_cost(strategy: str, preset: Preset, dims: Dims, p: int, intra_size: int | None = None,
               fallback: float = SHIFTED_FALLBACK) -> float:
    """Seconds of one merge (collectives + local work) of ``strategy`` over ``p`` ranks.

    intra_size: ranks per node (1 for one rank per node; ``None`` fills nodes of the preset's
    size). ``shifted`` is flat on every layout -- one SUM of cat[w*o, w, nonempty count, shift digests] over the
    whole CP group, since one
    collective per call is its point and NCCL's all-reduce already follows the node
    hierarchy -- plus, with probability ``fallback``, the MAX + SUM redo.
    """
    if strategy not in MERGES:
        raise ValueError(f"unknown merge strategy {strategy!r}; expected one of {MERGES}")
    if p <= 1:
        return 0.0
    k, nodes = node_layout(preset, p, intra_size)
    o, l = dims.out_bytes, dims.lse_bytes

    def ar(n, ranks=p, spread=nodes):
        return allreduce_time(preset, ranks, spread, n, p)

    if strategy == "packed":
        return ar(l) + ar(o + l) + local_merge_time(preset, dims, 2, p)
    if strategy == "allreduce3":
        return ar(l) + ar(l) + ar(o) + local_merge_time(preset, dims, 2, p)
    if strategy == "allgather":
        return allgather_time(preset, p, nodes, o + dims.lse_wire_bytes, p) + local_merge_time(preset, dims, p, p)
    if strategy == "shifted":
        redo = ar(l) + ar(o + l) + local_merge_time(preset, dims, 2, p)
        # cat[w*o, w, count, digests]
        return ar(o + 2 * l + dims.shift_digest_bytes(p)) + local_merge_time(preset, dims, 2, p) + fallback * redo
    # two_level: a packed merge inside each node, then one among the node peers
    if nodes == 1 or k == 1:
        return merge_cost("packed", preset, dims, p, k)
    t = ar(l, k, 1) + ar(o + l, k, 1) + ar(l, nodes, nodes) + ar(o + l, nodes, nodes)
    return t + 2 * local_merge_time(preset, dims, 2, p)


def policy(preset: Preset, p: int, intra_size: int, hierarchical: bool, out_shape: tuple, dtype_bytes: int,
           candidates: tuple = UNSHIFTED_CANDIDATES) -> str:
    """The cheapest of ``candidates`` for a merge state of ``out_shape`` (B, Sq, Hq, D); ties go
    to the earlier candidate. ``two_level`` is a candidate only on hierarchical groups."""
    if p <= 1:
        return "packed"
    b, sq, hq, d = out_shape
    dims = Dims(batch=b, heads_q=hq, heads_kv=hq, head_dim=d, seqlen_q=sq, acc_bytes=dtype_bytes)
    cands = [c for c in candidates if hierarchical or c != "two_level"]
    return min(cands, key=lambda c: (merge_cost(c, preset, dims, p, intra_size), cands.index(c)))


# ---------------------------------------------------------------------------- presets


def preset_names() -> list[str]:
    """Names of the presets shipped with the package."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (``dgx_h100``, ``pcie_4090``, ``cpu_gloo``) or by YAML path."""
    from ..utils import yaml_files

    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"no cost-model preset {name_or_path!r} (looked for {path}); available: {preset_names()}")
    with open(path) as f:
        try:
            data = yaml_files.load(f)
        except yaml_files.DuplicateKeyError as e:  # plain YAML would keep the last one silently
            raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset must be a YAML mapping, got {type(data).__name__}")
    return Preset.from_dict(data, str(path))


@functools.lru_cache(maxsize=8)
def _cached_preset(name: str) -> Preset:
    return load_preset(name)


@functools.lru_cache(maxsize=1)
def _device_default() -> str:
    import torch

    return "dgx_h100" if torch.cuda.is_available() else "cpu_gloo"


def _preset_name(device_type: str | None = None) -> str:
    name = os.environ.get(ENV_PRESET)
    if name:
        return name
    if device_type is None:
        return _device_default()
    return "dgx_h100" if device_type == "cuda" else "cpu_gloo"


def default_preset(device_type: str | None = None) -> Preset:
    """``$MEGATRON_TREE_COST_PRESET`` if set, else ``dgx_h100`` for CUDA and ``cpu_gloo`` otherwise."""
    return _cached_preset(_preset_name(device_type))


_RESOLVED: dict = {}


def choose_strategy(groups, out_shape, dtype_bytes: int = 4, shifted: bool = False) -> str:
    """The merge ``auto`` runs for a state of ``out_shape`` on ``groups``.

    groups: a ``TreeGroups`` (``.size``, ``.intra_size``, ``.is_hierarchical``);
    out_shape: (batch, seqlen_q, nheads_q, headdim). Returns one of :data:`MERGES`;
    ``shifted`` only when ``shifted`` is true (the call has a shift to pass).
    The :func:`policy` runs once per (layout, shape, dtype, preset); every later call, e.g.
    every layer of every decode step, is a dictionary lookup.
    """
    name = _preset_name()
    shape = tuple(int(x) for x in out_shape)
    key = (name, groups.size, groups.intra_size, bool(groups.is_hierarchical), shape, int(dtype_bytes), bool(shifted))
    choice = _RESOLVED.get(key)
    if choice is None:
        cands = MERGES if shifted else UNSHIFTED_CANDIDATES
        choice = policy(_cached_preset(name), groups.size, groups.intra_size, bool(groups.is_hierarchical),
                        shape, int(dtype_bytes), cands)
        _RESOLVED[key] = choice
    return choice


def clear_cache() -> None:
    """Forget resolved choices and loaded presets (after editing a preset file in place)."""
    _RESOLVED.clear()
    _cached_preset.cache_clear()


# ---------------------------------------------------------------------------- overlapped decode
#
# ``tree_decode(..., overlap=True)`` splits the batch in halves; half A's last merge collective
# (the SUM that carries w*o, the bulk of the bytes) travels while half B's local kernel runs.
# Priced by replaying ``comm.merge_overlapped``'s schedule on lanes: one compute lane (kernels,
# local merge work; a stage's inputs wait for the previous stage there, as on an in-order CUDA
# stream) and one lane per level for collectives, each in issue order (a NCCL communicator's
# stream: the NIC and copy engines work while the SMs compute). On a shared host
# (``shared_host``) gloo's collectives need the same cores as the kernels: one lane, no overlap.

__all__ += ["merge_stages", "overlap_step_times"]


def merge_stages(strategy: str, preset: Preset, dims: Dims, p: int,
                 intra_size: int | None = None) -> tuple[list, float]:
    """One merge as dependent stages plus its local work: ``([[(lane, seconds), ...], ...], local_seconds)``.

    A stage's collectives start together and the next stage needs their results; lanes are
    level names (``cp``, ``intra``, ``inter``). The stages' seconds plus the local work add
    up to :func:`merge_cost` -- for ``shifted`` its common case, one SUM (the rare MAX + SUM redo
    runs unsplit after the step and is left out here).
    """
    if strategy not in MERGES:
        raise ValueError(f"merge_stages prices the merges {MERGES}, got {strategy!r}")
    if p <= 1:
        return [], 0.0
    k, nodes = node_layout(preset, p, intra_size)
    o, l = dims.out_bytes, dims.lse_bytes

    def ar(n, ranks=p, spread=nodes):
        return allreduce_time(preset, ranks, spread, n, p)

    local = local_merge_time(preset, dims, 2, p)
    if strategy == "packed" or (strategy == "two_level" and (nodes == 1 or k == 1)):
        return [[("cp", ar(l))], [("cp", ar(o + l))]], local
    if strategy == "allreduce3":
        return [[("cp", ar(l))], [("cp", ar(l)), ("cp", ar(o))]], local
    if strategy == "shifted":  # cat[w*o, w, nonempty count, shift digests]
        return [[("cp", ar(o + 2 * l + dims.shift_digest_bytes(p)))]], local
    if strategy == "allgather":
        return [[("cp", allgather_time(preset, p, nodes, o + dims.lse_wire_bytes, p))]], local_merge_time(preset, dims, p, p)
    return ([[("intra", ar(l, k, 1))], [("intra", ar(o + l, k, 1))],
             [("inter", ar(l, nodes, nodes))], [("inter", ar(o + l, nodes, nodes))]], 2 * local)


def _replay(parts: list, shared: bool) -> float:
    """Seconds until every part is merged. parts: [(kernel_s, stages, local_s)] in batch order,
    run as ``comm.merge_overlapped`` does: each part's kernel, then its stages up to its last
    collective (started, not waited for), then the next part; at the end every part's last
    collective is waited for and its local work done."""
    free: dict = {}

    def occupy(lane: str, ready: float, seconds: float) -> float:
        lane = "compute" if shared else lane
        begin = max(ready, free.get(lane, 0.0))
        free[lane] = begin + seconds
        return begin + seconds

    def start(stage, ready: float) -> float:
        return max((occupy(lane, ready, s) for lane, s in stage), default=ready)

    last = []
    for kernel, stages, _ in parts:
        done = occupy("compute", 0.0, kernel)
        for j, stage in enumerate(stages):
            done = start(stage, done)
            if j + 1 < len(stages):  # the next stage's inputs are computed once this one is back
                free["compute"] = max(free.get("compute", 0.0), done)
        last.append(done)
    return max(occupy("compute", done, local) for done, (_, _, local) in zip(last, parts))


def overlap_step_times(strategy: str, preset: Preset, dims: Dims, p: int, intra_size: int | None,
                       tokens: int) -> tuple[float, float]:
    """(unsplit, split) seconds of one decode step -- the local kernel over ``tokens`` keys per
    rank, then the merge -- for the whole batch and for halves of ceil(B/2) and floor(B/2) rows."""
    from dataclasses import replace

    def part(rows: int):
        d = replace(dims, batch=rows)
        return (kernel_time(preset, d, tokens, p), *merge_stages(strategy, preset, d, p, intra_size))

    whole = _replay([part(dims.batch)], preset.shared_host)
    if dims.batch < 2:
        return whole, whole
    return whole, _replay([part((dims.batch + 1) // 2), part(dims.batch // 2)], preset.shared_host)


# ---------------------------------------------------------------------------- a whole step, every method

BASELINES = ("ring", "paper_ring", "passq_ring", "allgather_kv", "single")
"""The comparisons priced beside the merges: ring decode (KV rotated, send overlapped where the preset
overlaps), the paper's ring harness, pass-Q ring, all-gather-KV, and one rank over the whole context."""
ALL_STRATEGIES = MERGES + BASELINES

__all__ += ["BASELINES", "ALL_STRATEGIES", "predict"]


def _p2p_link(preset: Preset, p: int, nodes: int) -> Link:
    """The link a ring step waits for: the slowest pair's (inter-node once the group spans nodes)."""
    s = preset.oversub(p)
    link = preset.inter if nodes > 1 else preset.intra
    return Link(link.alpha * s, link.beta / s)


def predict(strategy: str, preset: Preset, dims: Dims, p: int, context: int,
            intra_size: int | None = None, cold: bool = False) -> float:
    """Predicted seconds of one decode step of ``strategy`` over ``context`` tokens on ``p`` ranks.

    intra_size: ranks per node (``None`` fills nodes of the preset's size, 1 puts each rank
    on its own node). cold: a first call, which pays the preset's ``cold_start`` once.
    """
    first = preset.cold_start if cold else 0.0
    shard = -(-context // p)
    k, nodes = node_layout(preset, p, intra_size)
    if strategy in MERGES:
        return first + kernel_time(preset, dims, shard, p) + merge_cost(strategy, preset, dims, p, k)
    if strategy == "single" or p == 1:
        if strategy not in ALL_STRATEGIES:
            raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")
        return first + kernel_time(preset, dims, context, 1)
    link = _p2p_link(preset, p, nodes)
    c = kernel_time(preset, dims, shard, p)
    if strategy == "ring":
        m = 3 * link.alpha + (dims.kv_shard(shard) + dims.batch * 4) / link.beta
        hop = max(c, m) if preset.overlap else c + m
        return first + (p - 1) * hop + c + local_merge_time(preset, dims, p, p)
    if strategy == "paper_ring":
        s = preset.oversub(p)
        move = 3 * (preset.launch * s + link.alpha) + (dims.kv_shard(shard) + 4) / link.beta
        return first + p * (c + local_merge_time(preset, dims, 2, p) + move)
    if strategy == "passq_ring":
        m = link.alpha + (dims.out_bytes + dims.lse_wire_bytes) / link.beta
        return first + c + (p - 1) * m + local_merge_time(preset, dims, p, p)
    if strategy == "allgather_kv":
        kv = dims.kv_shard(shard)
        t = 2 * allgather_time(preset, p, nodes, kv // 2) + allgather_time(preset, p, nodes, dims.batch * 4)
        return first + t + kernel_time(preset, dims, context, p) + local_merge_time(preset, dims, p, p)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")
