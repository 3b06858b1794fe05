"""Calibrate the cost model on this machine and write a preset YAML.

Invariant: every parameter written is measured here, by the same operations the model
prices (``ops.flash_decode`` for the kernel; gloo point-to-point and all-reduce for the
links), each the median of repeated runs; nothing is copied from another preset. The
fitted values are the model's own parameters (see ``megatron_tree.comm.cost``'s docstring), so a
prediction made with the written preset uses them with no further correction.

Measured on ``--ranks`` local processes (default 4):

* kernel: rank 0 alone runs the decode kernel on a tiny and a large shard: the fixed cost
  ``kernel_overhead`` and the bandwidth ``kernel_bw``. Then all ranks run it at once; P times
  the lone time over the concurrent time is the number of ranks that truly run in parallel
  (``host_cores``: the cores, or fewer while other work occupies the machine).
* α and launch: 4-byte all-reduces over 2 ranks and over all ranks; the model's
  ``s(p) * (launch + 2(p-1) α)`` through both points (a 4-byte ping-pong is recorded too,
  and gives α when only 2 ranks are used).
* β: every rank sends a large message to its ring neighbour at once (as ring decode
  does), corrected for the time-sharing of ranks beyond ``host_cores``.
* collective β: a large all-gather over all ranks (gloo's all-gather is much slower per
  byte than its point-to-point sends; all-gather-KV decode pays it).

Usage: ``python -m megatron_tree.comm.calibrate [--ranks 4] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

SCORE_PASSES = 5  # the torch decode path on CPU materialises its fp32 scores (written into the preset)


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _rank_main(rank: int, world: int, opts: dict) -> list | None:
    """One rank's measurements (``run_ranks`` made the gloo group); rank 0 returns every rank's."""
    import torch
    import torch.distributed as dist

    from ..ops.dispatch import flash_decode

    res = {}
    reps = opts["reps"]
    # Kernel on rank 0 alone (the others wait in a barrier).
    if rank == 0:
        q = torch.randn(1, 1, 8, 128)
        pts = []
        for n in opts["kernel_tokens"]:
            k = torch.randn(1, n, 8, 128)
            v = torch.randn(1, n, 8, 128)
            flash_decode(q, k, v)
            t = _median_time(lambda: flash_decode(q, k, v), reps)
            # KV once + the torch path's fp32 score passes (cost.Dims.kernel_bytes)
            nbytes = 2 * k.numel() * 4 + SCORE_PASSES * 8 * n * 4
            pts.append((nbytes, t))
        (b1, t1), (b2, t2) = pts  # a tiny shard gives the fixed cost, a large one the bandwidth
        res["kernel_overhead"] = t1
        res["kernel_bw"] = (b2 - b1) / max(t2 - t1, 1e-9)
        res["kernel_points"] = pts
    dist.barrier()
    # Every rank runs the kernel on the large shard at once: how many run truly in parallel.
    n_big = opts["kernel_tokens"][-1]
    qc = torch.randn(1, 1, 8, 128)
    kc, vc = torch.randn(1, n_big, 8, 128), torch.randn(1, n_big, 8, 128)
    flash_decode(qc, kc, vc)

    def concurrent():
        dist.barrier()
        t0 = time.perf_counter()
        flash_decode(qc, kc, vc)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    res["kernel_concurrent"] = statistics.median([concurrent() for _ in range(reps)])
    del kc, vc
    # α: ping-pong 0 <-> 1.
    x = torch.zeros(1, dtype=torch.float32)
    if rank in (0, 1):
        def pingpong():
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
        pingpong()
        res["rtt"] = _median_time(pingpong, 10 * reps)
    dist.barrier()
    # Small all-reduce over ranks {0, 1} (the others idle), then over everyone.
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(x, group=pair)
        res["allreduce_small_2"] = _median_time(lambda: dist.all_reduce(x, group=pair), 10 * reps)
    dist.barrier()

    def ar():
        dist.all_reduce(x)
    ar()
    dist.barrier()
    res["allreduce_small"] = _median_time(ar, 10 * reps)
    # Ring send of a large message by every rank at once.
    n = opts["ring_bytes"] // 4
    buf_s = torch.randn(n)
    buf_r = torch.empty(n)
    nxt, prv = (rank + 1) % world, (rank - 1) % world

    def ring():
        dist.barrier()
        t0 = time.perf_counter()
        w = [dist.isend(buf_s, nxt), dist.irecv(buf_r, prv)]
        for h in w:
            h.wait()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    ring()
    res["ring_send"] = statistics.median([ring() for _ in range(reps)])
    # A large all-gather over everyone (all-gather-KV decode's collective).
    parts = [torch.empty(n // world) for _ in range(world)]
    src = buf_s[: n // world]

    def gather():
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather(parts, src)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    gather()
    res["allgather_large"] = statistics.median([gather() for _ in range(reps)])
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    return gathered if rank == 0 else None


def fit(measured: list[dict], world: int, host_cores: int, ring_bytes: int) -> dict:
    """Model parameters from the raw measurements of every rank (see the module docstring)."""
    r0 = measured[0]
    # Effective parallel lanes: P kernels at once take P / lanes times one kernel alone.
    t_alone = r0["kernel_points"][-1][1]
    lanes = min(float(host_cores), max(1.0, world * t_alone / r0["kernel_concurrent"]))
    s = max(1.0, world / lanes)
    # Two small all-reduces, t(p) = s(p) * (launch + 2(p-1) alpha), at p = 2 (s = 1) and p = world:
    # two equations for launch and alpha. With world == 2, alpha comes from the ping-pong instead.
    t2, tw = r0["allreduce_small_2"], r0["allreduce_small"] / s
    if world > 2 and tw > t2:
        alpha = (tw - t2) / (2 * (world - 1) - 2)
    else:
        alpha = r0["rtt"] / 2
    launch = max(t2 - 2 * alpha, 0.0)
    t_ring = r0["ring_send"]
    beta = ring_bytes / max(t_ring / s - alpha, 1e-9)
    # all-gather of ring_bytes/world per rank: s * (launch + (p-1) alpha + (p-1) n / beta_c)
    n_g = (ring_bytes // 4 // world) * 4
    t_g = r0["allgather_large"] / s - launch - (world - 1) * alpha
    coll_beta = (world - 1) * n_g / max(t_g, 1e-9)
    return {
        "alpha": alpha, "launch": launch, "beta": beta, "collective_beta": coll_beta, "lanes": lanes,
        "kernel_bw": r0["kernel_bw"], "kernel_overhead": r0["kernel_overhead"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_tree.comm.calibrate",
                                 description="Measure α, β and kernel bandwidth here; write a cost-model preset.")
    ap.add_argument("--ranks", type=int, default=4, help="local gloo processes to measure with")
    ap.add_argument("--host-cores", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=3, help="independent calibration runs; medians are kept")
    ap.add_argument("--ring-mb", type=float, default=64.0, help="message size of the β measurement")
    ap.add_argument("--kernel-tokens", default="16,65536",
                    help="a tiny and a large shard length: fixed cost and bandwidth of the kernel")
    ap.add_argument("--name", default="cpu_gloo")
    ap.add_argument("--out", default=None, help="YAML to write (default: megatron_tree/comm/presets/NAME.yaml)")
    args = ap.parse_args(argv)
    import yaml

    from ..utils.testing import run_ranks
    from .cost import PRESET_DIR, Preset

    opts = {"reps": args.reps, "ring_bytes": int(args.ring_mb * 2**20),
            "kernel_tokens": [int(x) for x in args.kernel_tokens.split(",")]}
    runs = []
    for _ in range(args.repeat):  # a shared machine is noisy: the median of several runs per quantity
        gathered = run_ranks(_rank_main, args.ranks, opts, timeout=float("inf"), pg_timeout=600)[0]
        runs.append(gathered[0])
    measured = [{k: (statistics.median(r[k] for r in runs) if k != "kernel_points" else
                     [[runs[0][k][i][0], statistics.median(r[k][i][1] for r in runs)] for i in range(2)])
                 for k in runs[0]}]
    p = fit(measured, args.ranks, args.host_cores, opts["ring_bytes"])
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    data = {
        "name": args.name,
        "description": (f"local gloo processes on one {args.host_cores}-core host (loopback TCP; host_cores = "
                        f"measured parallel lanes), calibrated "
                        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC with {args.ranks} ranks "
                        f"by python -m megatron_tree.comm.calibrate"),
        "ranks_per_node": 8,
        "intra": {"alpha": float(f"{p['alpha']:.4g}"), "beta": float(f"{p['beta']:.4g}")},
        "inter": {"alpha": float(f"{p['alpha']:.4g}"), "beta": float(f"{p['beta']:.4g}")},
        "kernel_bw": float(f"{p['kernel_bw']:.4g}"),
        "kernel_overhead": float(f"{p['kernel_overhead']:.4g}"),
        "launch": float(f"{p['launch']:.4g}"),
        "algorithm": "ring",
        "score_passes": SCORE_PASSES,
        "shared_host": True,
        "host_cores": float(f"{p['lanes']:.3g}"),
        "overlap": False,
        "collective_beta": float(f"{p['collective_beta']:.4g}"),
        "memory_bytes": float(mem),
    }
    Preset.from_dict(data, "calibration")  # the written file must load
    path = args.out or str(PRESET_DIR / f"{args.name}.yaml")
    with open(path, "w") as f:
        f.write("# Written by `python -m megatron_tree.comm.calibrate`; simulated nodes share one host, so\n"
                "# the intra and inter levels are the same loopback links. Raw measurements (rank 0,\n"
                f"# median of {args.repeat} runs):\n")
        for key in ("rtt", "allreduce_small_2", "allreduce_small", "ring_send", "allgather_large", "kernel_points",
                    "kernel_concurrent"):
            f.write(f"#   {key}: {measured[0][key]}\n")
        yaml.safe_dump(data, f, sort_keys=False)
    print(yaml.safe_dump(data, sort_keys=False))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
