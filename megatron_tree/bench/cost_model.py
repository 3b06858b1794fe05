"""α-β cost model of one decode step for every context-parallel strategy.

Invariant: the byte formulas here are the ones ``comm.CommStats`` and ``baselines`` record
(tests compare them call by call), and every latency is built from the same few parameters
of a :class:`Preset` -- per-level message latency α and bandwidth β, the local kernel's
bandwidth -- so a prediction can be traced to one line of arithmetic. It lives apart from
``comm.py`` because ``strategy="auto"`` calls :func:`choose_strategy` from there; this
module therefore imports no other megatron_tree module at import time (no cycles) and
caches the loaded preset.

Model of a collective over ``p`` ranks spread over ``nodes`` nodes (``k = p / nodes``
ranks per node), payload ``n`` bytes per rank:

* ring algorithm (gloo; NCCL for large messages): all-reduce ``2(p-1)`` steps, all-gather
  ``p-1`` steps; every step waits for the slowest link, so α and β are the inter-node
  ones as soon as ``nodes > 1``. Bandwidth term: all-reduce ``2(p-1)/p * n / β``,
  all-gather ``(p-1) * n / β`` (the bytes ``CommStats`` calls "sent").
* tree algorithm (NCCL's choice for small messages): all-reduce latency
  ``2 * ((k-1) α_intra + ceil(log2 nodes) α_inter)``; same bandwidth term.
* plus ``launch`` seconds per collective (framework and kernel launch overhead).

A point-to-point message costs ``α + n / β``. On a shared host (``shared_host: true``,
CPU processes on one machine) ranks beyond ``host_cores`` time-share the cores: every
per-rank bandwidth is divided, and every α multiplied, by ``max(1, P / host_cores)``,
and a ring hop's compute and transfer do not overlap (both need the CPU).

The local kernel reads the KV shard once and the score matrix about five times
(scores, logsumexp, exp, probs @ V): ``t = kernel_overhead + bytes / kernel_bw``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Literal

__all__ = [
    "Link", "Preset", "Dims", "TREE_STRATEGIES", "ALL_STRATEGIES", "load_preset", "default_preset",
    "sent_bytes", "predict", "predict_all", "peak_memory_bytes", "choose_strategy", "merge_cost",
]

PRESET_DIR = Path(__file__).resolve().parents[1] / "presets"  # megatron_tree/presets, shipped by setup.py
ENV_PRESET = "MEGATRON_TREE_COST_PRESET"
TREE_STRATEGIES = ("allreduce3", "packed", "two_level", "allgather")
ALL_STRATEGIES = TREE_STRATEGIES + ("ring", "passq_ring", "allgather_kv", "single")
SCORE_PASSES = 5  # times the local kernel touches its fp32 score matrix


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
    """Bytes per second the local decode kernel reads (KV and scores) on one rank alone."""
    kernel_overhead: float
    """Fixed seconds per local kernel call (launch, Python)."""
    launch: float
    """Fixed seconds per collective call on top of its α steps."""
    algorithm: Literal["ring", "tree"] = "ring"
    """All-reduce algorithm for small payloads: gloo uses ring, NCCL tree."""
    shared_host: bool = False
    """All ranks share one host's cores (CPU processes): bandwidths divided, α multiplied by oversubscription."""
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
        for key in ("kernel_bw", "kernel_overhead", "launch", "memory_bytes", "collective_beta", "host_cores"):
            if key in kw:
                kw[key] = float(kw[key])
        if kw.get("algorithm", "ring") not in ("ring", "tree"):
            raise ValueError(f"{source}: algorithm must be 'ring' or 'tree', got {kw['algorithm']!r}")
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
    """Bytes per KV element (4 fp32, 2 bf16)."""
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

    def kernel_bytes(self, tokens: int) -> int:
        """Memory traffic of the local kernel over ``tokens`` keys (KV once, fp32 scores SCORE_PASSES times)."""
        return self.kv_shard(tokens) + SCORE_PASSES * self.batch * self.heads_q * self.seqlen_q * tokens * 4


# ---------------------------------------------------------------------------- bytes


def _ar(p: int, n: int) -> int:
    return 2 * (p - 1) * n // p  # integer, exactly as comm._all_reduce records it


def sent_bytes(strategy: str, dims: Dims, p: int, intra_size: int | None = None,
               shard_tokens: int = 0) -> dict:
    """Bytes one rank sends per decode step, by level, as ``CommStats``/``baselines`` record them.

    Even shards of ``shard_tokens`` tokens are assumed for the KV-moving baselines.
    Levels: ``cp`` for flat collectives and the baselines, ``intra``/``inter`` for two_level.
    """
    o, l = dims.out_bytes, dims.lse_bytes
    if p == 1:
        return {}
    if strategy == "packed":
        return {"cp": _ar(p, l) + _ar(p, o + l)}
    if strategy == "allreduce3":
        return {"cp": _ar(p, l) + _ar(p, l) + _ar(p, o)}
    if strategy == "allgather":
        return {"cp": (p - 1) * (o + l)}
    if strategy == "two_level":
        k = intra_size if intra_size else p
        if not 1 < k < p:  # one level only: TreeGroups names it intra (or inter with one rank per node)
            return {"intra" if k > 1 else "inter": _ar(p, l) + _ar(p, o + l)}
        n = p // k
        return {"intra": _ar(k, l) + _ar(k, o + l), "inter": _ar(n, l) + _ar(n, o + l)}
    if strategy == "ring":
        return {"cp": (p - 1) * (dims.kv_shard(shard_tokens) + dims.batch * 4)}
    if strategy == "passq_ring":
        return {"cp": (p - 1) * (o + l)}
    if strategy == "allgather_kv":
        return {"cp": (p - 1) * (dims.kv_shard(shard_tokens) + dims.batch * 4)}
    if strategy == "single":
        return {}
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")


def peak_memory_bytes(strategy: str, dims: Dims, p: int, context: int) -> int:
    """Analytic peak of tensor bytes held by one rank during a step (the busiest rank).

    Resident: q and the KV shard. Workspaces: the kernel's fp32 scores and probabilities
    (2 * B*Hq*Sq*n*4) and its output; per strategy the buffers it adds (ring: min(2, P-1)
    receive buffers of a shard, double buffering; all-gather-KV: P shards plus the kernel's workspace for
    one; pass-Q ring / allgather merge: P partial states; single rank: the whole cache).
    """
    shard = -(-context // p)
    q = dims.batch * dims.seqlen_q * dims.heads_q * dims.head_dim * dims.kv_bytes
    state = dims.out_bytes + dims.lse_bytes

    def kernel_ws(tokens):
        return 2 * dims.batch * dims.heads_q * dims.seqlen_q * tokens * 4 + state

    base = q + dims.kv_shard(shard)
    if strategy in ("packed", "allreduce3", "two_level"):
        return base + kernel_ws(shard) + 2 * state
    if strategy == "allgather":
        return base + kernel_ws(shard) + (p + 1) * state
    if strategy == "ring":
        return base + min(2, p - 1) * dims.kv_shard(shard) + kernel_ws(shard) + (p + 1) * state
    if strategy == "passq_ring":
        return base + kernel_ws(shard) + (p + 1) * state
    if strategy == "allgather_kv":
        return base + p * dims.kv_shard(shard) + kernel_ws(shard) + (p + 1) * state
    if strategy == "single":
        return q + dims.kv_shard(context) + kernel_ws(context)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")


# ---------------------------------------------------------------------------- time


def _links(preset: Preset, p: int, nodes: int) -> Link:
    s = preset.oversub(p)
    link = preset.inter if nodes > 1 else preset.intra
    return Link(link.alpha * s, link.beta / s)


def _allreduce(preset: Preset, p: int, nodes: int, n: int, p_total: int) -> float:
    if p <= 1:
        return 0.0
    s = preset.oversub(p_total)
    link = _links(preset, p_total, nodes)
    if preset.algorithm == "tree":
        k = p // nodes
        lat = 2 * ((k - 1) * preset.intra.alpha + math.ceil(math.log2(nodes)) * preset.inter.alpha) * s if nodes > 1 \
            else 2 * math.ceil(math.log2(p)) * preset.intra.alpha * s
    else:
        lat = 2 * (p - 1) * link.alpha
    return preset.launch * s + lat + 2 * (p - 1) / p * n / _coll_beta(preset, link, p_total)


def _coll_beta(preset: Preset, link: Link, p_total: int) -> float:
    return preset.collective_beta / preset.oversub(p_total) if preset.collective_beta > 0 else link.beta


def _allgather(preset: Preset, p: int, nodes: int, n: int, p_total: int) -> float:
    if p <= 1:
        return 0.0
    link = _links(preset, p_total, nodes)
    return (preset.launch * preset.oversub(p_total) + (p - 1) * link.alpha
            + (p - 1) * n / _coll_beta(preset, link, p_total))


def _kernel(preset: Preset, dims: Dims, tokens: int, p_active: int) -> float:
    s = preset.oversub(p_active)
    return (preset.kernel_overhead + dims.kernel_bytes(tokens) / preset.kernel_bw) * s


def _merge_local(preset: Preset, dims: Dims, states: int, p_active: int) -> float:
    """A local merge of ``states`` partial states: a few passes over them."""
    s = preset.oversub(p_active)
    return (preset.kernel_overhead + 4 * states * (dims.out_bytes + dims.lse_bytes) / preset.kernel_bw) * s


def merge_cost(strategy: str, preset: Preset, dims: Dims, p: int, intra_size: int | None = None) -> float:
    """Seconds of the merge alone (collectives + local merge work) for one tree strategy."""
    k = intra_size or min(p, preset.ranks_per_node)
    k = k if p % k == 0 else p
    nodes = p // k
    o, l = dims.out_bytes, dims.lse_bytes
    if p <= 1:
        return 0.0
    if strategy == "packed":
        return _allreduce(preset, p, nodes, l, p) + _allreduce(preset, p, nodes, o + l, p) + _merge_local(preset, dims, 2, p)
    if strategy == "allreduce3":
        return (_allreduce(preset, p, nodes, l, p) + _allreduce(preset, p, nodes, l, p)
                + _allreduce(preset, p, nodes, o, p) + _merge_local(preset, dims, 2, p))
    if strategy == "allgather":
        return _allgather(preset, p, nodes, o + l, p) + _merge_local(preset, dims, p, p)
    if strategy == "two_level":
        if nodes == 1 or k == 1:
            return merge_cost("packed", preset, dims, p, intra_size=k)
        t = _allreduce(preset, k, 1, l, p) + _allreduce(preset, k, 1, o + l, p)
        t += _allreduce(preset, nodes, nodes, l, p) + _allreduce(preset, nodes, nodes, o + l, p)
        return t + 2 * _merge_local(preset, dims, 2, p)
    raise ValueError(f"unknown tree strategy {strategy!r}; expected one of {TREE_STRATEGIES}")


def predict(strategy: str, preset: Preset, dims: Dims, p: int, context: int,
            intra_size: int | None = None) -> float:
    """Predicted seconds of one decode step of ``strategy`` over ``context`` tokens on ``p`` ranks."""
    shard = -(-context // p)
    k = intra_size or min(p, preset.ranks_per_node)
    nodes = p // k if p % k == 0 else 1
    if strategy in TREE_STRATEGIES:
        return _kernel(preset, dims, shard, p) + merge_cost(strategy, preset, dims, p, k)
    if strategy == "single":
        return _kernel(preset, dims, context, 1)
    if p == 1:
        return _kernel(preset, dims, context, 1)
    link = _links(preset, p, nodes)
    if strategy == "ring":
        c = _kernel(preset, dims, shard, p)
        m = 3 * link.alpha + (dims.kv_shard(shard) + dims.batch * 4) / link.beta
        hop = max(c, m) if preset.overlap else c + m
        return (p - 1) * hop + c + _merge_local(preset, dims, p, p)
    if strategy == "passq_ring":
        m = link.alpha + (dims.out_bytes + dims.lse_bytes) / link.beta
        return _kernel(preset, dims, shard, p) + (p - 1) * m + _merge_local(preset, dims, p, p)
    if strategy == "allgather_kv":
        kv = dims.kv_shard(shard)
        t = 2 * _allgather(preset, p, nodes, kv // 2, p) + _allgather(preset, p, nodes, dims.batch * 4, p)
        return t + _kernel(preset, dims, context, p) + _merge_local(preset, dims, p, p)
    raise ValueError(f"unknown strategy {strategy!r}; expected one of {ALL_STRATEGIES}")


def predict_all(preset: Preset, dims: Dims, p: int, context: int, intra_size: int | None = None) -> dict:
    """``{strategy: seconds}`` for every strategy of :data:`ALL_STRATEGIES`."""
    return {s: predict(s, preset, dims, p, context, intra_size) for s in ALL_STRATEGIES}


# ---------------------------------------------------------------------------- presets


def load_preset(name_or_path: str) -> Preset:
    """A preset by name (``dgx_h100``, ``pcie_4090``, ``cpu_gloo``) or by YAML path."""
    import yaml  # imported here: this module is imported by comm.py

    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        avail = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"no cost-model preset {name_or_path!r} (looked for {path}); available: {avail}")
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset must be a YAML mapping, got {type(data).__name__}")
    return Preset.from_dict(data, str(path))


@functools.lru_cache(maxsize=8)
def _cached_preset(name: str) -> Preset:
    return load_preset(name)


def default_preset(device_type: str | None = None) -> Preset:
    """``$MEGATRON_TREE_COST_PRESET`` if set, else ``dgx_h100`` for CUDA and ``cpu_gloo`` otherwise."""
    name = os.environ.get(ENV_PRESET)
    if not name:
        if device_type is None:
            import torch

            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        name = "dgx_h100" if device_type == "cuda" else "cpu_gloo"
    return _cached_preset(name)


@functools.lru_cache(maxsize=1024)
def _choose(preset: Preset, p: int, k: int, hierarchical: bool, out_shape: tuple, dtype_bytes: int) -> str:
    b, sq, hq, d = out_shape
    dims = Dims(batch=b, heads_q=hq, heads_kv=hq, head_dim=d, seqlen_q=sq, acc_bytes=dtype_bytes)
    cands = TREE_STRATEGIES if hierarchical else ("allreduce3", "packed", "allgather")
    return min(cands, key=lambda s: (merge_cost(s, preset, dims, p, k), cands.index(s)))


def choose_strategy(groups, out_shape, dtype_bytes: int = 4) -> str:
    """The merge strategy the model predicts fastest for ``groups`` and a state of ``out_shape``.

    groups: a ``TreeGroups`` (``.size``, ``.intra_size``, ``.is_hierarchical``);
    out_shape: (batch, seqlen_q, nheads_q, headdim). Returns one of
    ``"allreduce3"``, ``"packed"``, ``"two_level"``, ``"allgather"``. Cached per shape.
    """
    preset = default_preset()
    k = groups.intra_size if groups.is_hierarchical else groups.size
    return _choose(preset, groups.size, k, bool(groups.is_hierarchical), tuple(int(x) for x in out_shape), int(dtype_bytes))


# ---------------------------------------------------------------------------- CLI: predictions + plots


def _paper_dims(kv_bytes: int = 2) -> Dims:
    """The paper's microbenchmark block: B=1, 16 heads x 128, no GQA, bf16 (PAPER.md)."""
    return Dims(batch=1, heads_q=16, heads_kv=16, head_dim=128, kv_bytes=kv_bytes)


def speedup_table(preset: Preset, dims: Dims, gpus, contexts, intra_size: int | None = None) -> list[dict]:
    """Rows of predicted step times and ring/tree speedups over a grid of (P, context)."""
    rows = []
    for p in gpus:
        for n in contexts:
            t = predict_all(preset, dims, p, n, intra_size)
            best_tree = min(TREE_STRATEGIES, key=lambda s: t[s])
            rows.append({
                "gpus": p, "context": n, **{f"t_{s}": t[s] for s in ALL_STRATEGIES},
                "best_tree": best_tree, "speedup_vs_ring": t["ring"] / t[best_tree],
                "speedup_vs_passq": t["passq_ring"] / t[best_tree],
                "two_level_over_packed": t["packed"] / t["two_level"],
            })
    return rows


def plot_predictions(preset: Preset, dims: Dims, out_dir: str, tag: str | None = None) -> list[str]:
    """PNG plots of predicted speedup over ring vs #GPUs and vs context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tag = tag or preset.name
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    gpus = [8, 16, 32, 64, 128, 256, 512, 1024]
    contexts = [80_000, 320_000, 1_280_000, 5_120_000, 10_000_000]
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in contexts:
        rows = speedup_table(preset, dims, gpus, [n])
        ax.plot(gpus, [r["speedup_vs_ring"] for r in rows], marker="o", label=f"{n/1e6:g}M tokens")
    ax.set_xscale("log", base=2)
    paths.append(_save_speedup_plot(plt, fig, ax, "GPUs (P)", preset.name,
                                    os.path.join(out_dir, f"cost_speedup_vs_gpus_{tag}.png")))
    fig, ax = plt.subplots(figsize=(6, 4))
    ctx = [16_000 * 2 ** i for i in range(10)]
    for p in (8, 32, 128, 1024):
        rows = speedup_table(preset, dims, [p], ctx)
        ax.plot(ctx, [r["speedup_vs_ring"] for r in rows], marker="o", label=f"P={p}")
    ax.set_xscale("log")
    paths.append(_save_speedup_plot(plt, fig, ax, "context length (tokens)", preset.name,
                                    os.path.join(out_dir, f"cost_speedup_vs_context_{tag}.png")))
    return paths


def _save_speedup_plot(plt, fig, ax, xlabel: str, preset_name: str, path: str) -> str:
    """Shared styling of the predicted-speedup plots (log y, labels, grid, legend); returns path."""
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("predicted ring / tree step time")
    ax.set_title(f"Tree vs ring decode, predicted ({preset_name})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_with_bench(rows: list[dict], preset: Preset, use_run_lanes: bool = True) -> list[dict]:
    """Predicted vs measured median step time for every measured row of a ``bench.decode`` JSON.

    With ``use_run_lanes`` and a shared-host preset, ``host_cores`` is replaced by the parallel
    lanes the benchmark probed right before each configuration (``host_lanes``), so the model
    sees the machine as the run saw it (other users' load varies minute to minute).
    """
    import dataclasses

    out = []
    for r in rows:
        if "skipped" in r:
            continue
        lanes = r.get("host_lanes")
        pr = dataclasses.replace(preset, host_cores=lanes) if (use_run_lanes and lanes and preset.shared_host) else preset
        kind = r["strategy"].split(":")[-1]
        name = r.get("resolved") or kind if kind == "auto" else kind
        dims = Dims(r["batch"], r["heads_q"], r["heads_kv"], r["head_dim"], kv_bytes=4)
        intra = r["intra"] if r["intra"] < r["ranks"] else r["ranks"]
        pred = predict(name, pr, dims, r["ranks"], r["context"], intra) * 1e3
        out.append({"ranks": r["ranks"], "intra": r["intra"], "context": r["context"], "batch": r["batch"],
                    "heads": f"{r['heads_q']}/{r['heads_kv']}", "strategy": r["strategy"],
                    "measured_ms": r["median_ms"], "predicted_ms": pred, "ratio": pred / r["median_ms"],
                    "host_lanes": pr.host_cores})
    return out


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m megatron_tree.bench.cost_model",
                                 description="Predict decode-step latency of every strategy from a preset.")
    ap.add_argument("--preset", default="dgx_h100", help="preset name or YAML path")
    ap.add_argument("--gpus", default="8,16,32,64,128,256,512,1024")
    ap.add_argument("--contexts", default="80000,320000,1280000,5120000,10000000")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads-q", type=int, default=16)
    ap.add_argument("--heads-kv", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-bytes", type=int, default=2, help="2 for bf16, 4 for fp32")
    ap.add_argument("--plot-dir", default=None, help="write the two speedup plots here")
    ap.add_argument("--json", default=None, help="write the prediction rows here")
    ap.add_argument("--compare", default=None, metavar="JSON",
                    help="compare predictions with a bench.decode results JSON instead (use --preset cpu_gloo)")
    ap.add_argument("--min-context", type=int, default=0, help="with --compare: only rows with at least this context")
    ap.add_argument("--preset-lanes", action="store_true",
                    help="with --compare: keep the preset's host_cores instead of the lanes probed by the run")
    args = ap.parse_args(argv)
    preset = load_preset(args.preset)
    if args.compare:
        with open(args.compare) as f:
            rows = [r for r in json.load(f)["rows"] if r["context"] >= args.min_context]
        cmp_rows = compare_with_bench(rows, preset, use_run_lanes=not args.preset_lanes)
        print(f"{'P':>3} {'ctx':>7} {'B':>2} {'H':>5} {'strategy':>16} {'measured':>9} {'predicted':>9} {'pred/meas':>9} {'lanes':>5}")
        for c in cmp_rows:
            print(f"{c['ranks']:>3} {c['context']:>7} {c['batch']:>2} {c['heads']:>5} {c['strategy']:>16} "
                  f"{c['measured_ms']:>9.1f} {c['predicted_ms']:>9.1f} {c['ratio']:>9.2f} {c['host_lanes']:>5.2f}")
        within = [c for c in cmp_rows if 0.7 <= c["ratio"] <= 1.3]
        print(f"within ±30%: {len(within)} of {len(cmp_rows)} rows")
        by = {}
        for c in cmp_rows:
            by.setdefault(c["strategy"], []).append(c["ratio"])
        for k, v in by.items():
            inside = sum(0.7 <= x <= 1.3 for x in v)
            print(f"  {k:>16}: median pred/meas {sorted(v)[len(v) // 2]:.2f}, within ±30% {inside}/{len(v)}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preset": preset.as_dict(), "rows": cmp_rows}, f, indent=1)
        return 0
    dims = Dims(args.batch, args.heads_q, args.heads_kv, args.head_dim, kv_bytes=args.kv_bytes)
    rows = speedup_table(preset, dims, [int(x) for x in args.gpus.split(",")], [int(x) for x in args.contexts.split(",")])
    print(f"preset {preset.name}: B={dims.batch} Hq={dims.heads_q} Hkv={dims.heads_kv} D={dims.head_dim} "
          f"kv_bytes={dims.kv_bytes}")
    print(f"{'P':>5} {'context':>9} {'ring ms':>10} {'passQ ms':>9} {'tree ms':>9} {'best tree':>10} "
          f"{'ring/tree':>9} {'flat/2lvl':>9}")
    for r in rows:
        print(f"{r['gpus']:>5} {r['context']:>9} {r['t_ring']*1e3:>10.3f} {r['t_passq_ring']*1e3:>9.3f} "
              f"{r['t_' + r['best_tree']]*1e3:>9.3f} {r['best_tree']:>10} {r['speedup_vs_ring']:>9.1f} "
              f"{r['two_level_over_packed']:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": preset.as_dict(), "dims": dims.__dict__, "rows": rows}, f, indent=1)
    if args.plot_dir:
        for p in plot_predictions(preset, dims, args.plot_dir):
            print("wrote", p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
