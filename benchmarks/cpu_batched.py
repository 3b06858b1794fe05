"""When one set of torch calls for all batch rows beats the per-row loop: the data behind
``megatron_tree.ops.torch_decode.use_batched``.

``ops.flash_decode(backend="torch")`` on CPU runs every row that ATen's fused kernel does not take
(positions, soft-cap, bf16/fp16, a float64 lse as ``tree_decode`` asks for at CP > 1 and in
speculative verification, a paged cache, ...) either through the loop of ``torch_decode.decode``
(per row about a dozen small torch calls, tens of microseconds of host time) or through
``torch_decode._batched``: every row's keys padded to the longest row's span, hidden by -inf scores,
two batched matmuls for all rows and KV heads. The batched path saves the host time of the loop, but
pays for the padding (rows of different lengths) and, for ragged rows, a copy of V with the padded
keys zeroed.

For each batch size B, key count N, GQA group (query heads per KV head), query tokens Sq and
uniform or ragged rows (ragged: row i has N - (N // 2) * i // (B - 1) keys, lengths spread over
[N/2, N], the padded work about 4/3 of the real), this times both paths on the same head-major
float32 cache (the layout of ``decode.cache.ShardedKVCache`` on CPU), lse in float64, ``--threads``
threads, interleaved call by call (batched then loop), and reports the median over the pairs of the
ratio batched time / loop time (< 1: batched faster), next to the path ``use_batched`` chooses, so
that a rule that picks the slower path by a wide margin shows here. Shapes whose cache would pass
``--max-keys`` keys per KV head in all (B x N) are skipped: their memory, not the rule, decides.

    PYTHONPATH=$PWD python -m benchmarks.cpu_batched --out benchmarks/results/cpu_batched.json

Writes JSON and a markdown table beside it. Times are the thread's CPU time (``time.thread_time``),
not wall time: on a shared machine another process's load stretches wall time, not this. Absolute
times still mean little there (caches are shared): the ratio, measured call by call, is what this
measures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

BATCHES = (1, 2, 8, 64, 1500)
KEYS = (16, 64, 256, 1024, 4096)
GROUPS = (1, 4)
QUERIES = (1, 4)
HKV, D = 4, 64
"""KV heads and head dim of every shape; the query heads are ``group * HKV``."""


def _lengths(b: int, n: int, ragged: bool) -> list:
    return [n - (n // 2) * i // (b - 1) for i in range(b)] if ragged and b > 1 else [n] * b


def _pair(q, k, v, lens: list):
    """(batched, loop): the two paths of ``torch_decode.decode`` on the same call, each forced."""
    from megatron_tree.ops import torch_decode as td

    seqlens = torch.tensor(lens, dtype=torch.int32)

    def call():
        return td.decode(q, k, v, None, seqlens, None, None, None, None, torch.float64, None, None, None, lens=lens)

    def batched():
        saved = td.use_batched
        td.use_batched = lambda *a: True
        try:
            return call()
        finally:
            td.use_batched = saved

    def loop():
        saved = td.BATCHED
        td.BATCHED = False
        try:
            return call()
        finally:
            td.BATCHED = saved

    return batched, loop


def measure(b: int, n: int, group: int, sq: int, ragged: bool, budget_s: float, max_reps: int) -> dict:
    """batched/loop time ratio (median of interleaved pairs, at least 3, at most ``max_reps``, fewer once
    ``budget_s`` is spent) for one shape; checks the two paths agree."""
    from megatron_tree.ops import torch_decode as td

    g = torch.Generator().manual_seed(b * 100003 + n * 7 + group * 3 + sq)
    hq = group * HKV
    cap = n + 8
    q = torch.randn(b, sq, hq, D, generator=g)
    k = torch.randn(b, HKV, cap, D, generator=g).transpose(1, 2)  # head-major storage, (b, cap, hkv, d) view
    v = torch.randn(b, HKV, cap, D, generator=g).transpose(1, 2)
    lens = _lengths(b, n, ragged)
    batched, loop = _pair(q, k, v, lens)
    x, y = batched(), loop()
    err = max(float((x[0] - y[0]).abs().max()), float((x[1] - y[1]).abs().max()))
    if err > 1e-4:
        raise AssertionError(f"batched and loop disagree by {err} at B={b} N={n} group={group} Sq={sq}")
    ratios, t_loop, t_batched = [], [], []
    start = time.thread_time()
    while len(ratios) < max_reps and (len(ratios) < 3 or time.thread_time() - start < budget_s):
        t0 = time.thread_time()
        batched()
        t1 = time.thread_time()
        loop()
        t2 = time.thread_time()
        ratios.append((t1 - t0) / (t2 - t1))
        t_batched.append(t1 - t0)
        t_loop.append(t2 - t1)
    span = max(lens)
    keys = sum(lens)
    rule = td.use_batched(b, span, keys, hq * sq, 0)
    return {"b": b, "n": n, "group": group, "sq": sq, "ragged": ragged, "reps": len(ratios),
            "batched_over_loop": statistics.median(ratios), "loop_us": 1e6 * statistics.median(t_loop),
            "batched_us": 1e6 * statistics.median(t_batched), "rule": "batched" if rule else "loop"}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (at least 1)")
    p.add_argument("--reps", type=int, default=15, help="most interleaved batched/loop pairs per shape (at least 3)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds per shape after which no new pair starts "
                   "(each shape gets 3 pairs at least)")
    p.add_argument("--max-keys", type=int, default=1 << 19, help="skip shapes with more than this many keys "
                   "per KV head in all (B x N)")
    p.add_argument("--out", default=None, help="JSON path; the Markdown table goes beside it (.md)")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.reps < 3:
        p.error(f"--reps must be at least 3, got {args.reps}")
    if args.out:  # before the timing: an unwritable --out is found now, not after minutes of it
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    torch.set_num_threads(args.threads)
    rows = []
    for ragged in (False, True):
        for sq in QUERIES:
            for group in GROUPS:
                for b in BATCHES:
                    for n in KEYS:
                        if b * n > args.max_keys or (ragged and b == 1):
                            continue
                        r = measure(b, n, group, sq, ragged, args.budget, args.reps)
                        rows.append(r)
                        print(f"{'ragged' if ragged else 'uniform'} Sq={sq} group={group} B={b} N={n}: batched/loop "
                              f"{r['batched_over_loop']:.2f} (loop {r['loop_us']:.0f} us), rule: {r['rule']}",
                              flush=True)
    out = {"command": " ".join(["python -m benchmarks.cpu_batched", *(argv if argv is not None else sys.argv[1:])]),
           "torch": torch.__version__, "machine": platform.machine(), "threads": args.threads, "hkv": HKV, "d": D,
           "load_average": os.getloadavg()[0], "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        md = os.path.splitext(args.out)[0] + ".md"
        with open(md, "w") as f:
            f.write(f"# Batched CPU decode vs the per-row loop ({args.threads} thread(s))\n\n"
                    f"`{out['command']}`; thread CPU time, median of interleaved pairs (3 to {args.reps}) of the "
                    f"ratio batched time / loop time (< 1: batched faster), {HKV} KV heads of {D}, head-major fp32 cache, float64 lse; "
                    f"ragged: lengths spread over [N/2, N]; load average {out['load_average']:.1f}. In each cell the "
                    f"ratio, the loop's time per call and, in parentheses, the path `torch_decode.use_batched` "
                    f"takes.\n")
            for ragged in (False, True):
                for sq in QUERIES:
                    for group in GROUPS:
                        cells = [r for r in rows if (r["ragged"], r["sq"], r["group"]) == (ragged, sq, group)]
                        if not cells:
                            continue
                        f.write(f"\n## {'ragged' if ragged else 'uniform'} rows, Sq = {sq}, GQA group {group}\n\n"
                                "| B | " + " | ".join(f"N={n}" for n in KEYS) + " |\n|---|" + "---|" * len(KEYS) + "\n")
                        for b in BATCHES:
                            line = []
                            for n in KEYS:
                                r = next((r for r in cells if (r["b"], r["n"]) == (b, n)), None)
                                line.append("" if r is None else f"{r['batched_over_loop']:.2f}, "
                                            f"{_time(r['loop_us'])} ({r['rule']})")
                            if any(line):
                                f.write(f"| {b} | " + " | ".join(line) + " |\n")
    return out


def _time(us: float) -> str:
    return f"{us:.0f} us" if us < 1000 else f"{us / 1000:.1f} ms"


if __name__ == "__main__":
    main()
