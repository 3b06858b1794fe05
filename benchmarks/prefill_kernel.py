"""Micro-benchmark of one CP prefill step's local attention: the decode path against the fused prefill path.

    python -m benchmarks.prefill_kernel [--sizes 2048 4096 8192] [--threads 1 2] [--repeats 5] [--out FILE]

Invariant: every method of one configuration attends the same tensors, methods are timed
interleaved (round r starts with method r mod M, so the machine's noise hits all alike),
results are medians, and every method's output is checked against ``new`` before it is timed.

A configuration is (chunk, block, case, threads): queries of one rank's chunk over one KV block
of the ring, SmolLM2-135M's attention shape (Hq 9, Hkv 3, D 64), fp32, B = 1:

* ``diagonal``: the rank's own block (the same positions: causal);
* ``full``: a block wholly in the queries' past (every key visible).

Methods:

* ``old``: ``ops.flash_decode(..., q_positions, k_positions, out_dtype=fp32, lse_dtype=fp64)``,
  what ``decode.prefill._local`` runs today;
* ``new``: ``ops.prefill_attention`` (the fused kernel with lse; ``fused_prefill``);
* ``sdpa``: ``F.scaled_dot_product_attention`` with the same mask (``is_causal`` or none,
  ``enable_gqa``), which returns no lse: the floor a fused kernel reaches here;
* ``new_shifted`` (with ``--shifted``): ``new`` forced through its shifted second pass
  (``lse_bound=0``), what a block costs whose |lse| exceeds ``fused_prefill.LSE_BOUND``.

For scale, each chunk also gets ``sdpa_prompt``: causal SDPA over the whole prompt that CP
``--cp`` ranks would hold (``cp * chunk`` tokens) in one process, at the same thread count.

Precision (:func:`precision_rows`, printed and stored as ``precision``): a causal prompt whose
scores are ``magnitude + small integer`` (exact in float32; ``bench.precision.large_score_inputs``)
cut into P uneven KV blocks (one empty), each block's partial formed by one path and the P
partials merged by ``ops.merge_states``; the largest output error against float64 attention on
the whole prompt, for ``new`` (fused, with its shifted pass), ``new_no_shift`` (fused, float32
lse used as it is), ``old`` (decode path, float64 lse) and ``old_lse32`` (decode path, float32 lse).

Output: a table on stdout and, with ``--out``, a JSON file (meta with the command, torch
version and CPU; one row per configuration), rewritten after every row.
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
import torch.nn.functional as F

from megatron_tree.ops import fused_prefill, dispatch as ops

__all__ = ["SHAPE", "inputs", "methods", "time_interleaved", "run", "precision_rows", "main"]

SHAPE = {"heads_q": 9, "heads_kv": 3, "head_dim": 64}
"""SmolLM2-135M's attention: hidden 576 = 9 heads x 64, 3 KV heads."""


def inputs(chunk: int, block: int, case: str, seed: int = 0):
    """q (1, chunk, 9, 64), k, v (1, block, 3, 64) fp32 and their positions for ``case``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, chunk, SHAPE["heads_q"], SHAPE["head_dim"], generator=g)
    k = torch.randn(1, block, SHAPE["heads_kv"], SHAPE["head_dim"], generator=g)
    v = torch.randn(1, block, SHAPE["heads_kv"], SHAPE["head_dim"], generator=g)
    if case == "diagonal":
        if chunk != block:
            raise ValueError(f"a diagonal block has as many keys as queries, got chunk {chunk}, block {block}")
        qp = torch.arange(chunk)[None]
        kp = qp.clone()
    elif case == "full":
        kp = torch.arange(block)[None]
        qp = block + torch.arange(chunk)[None]
    else:
        raise ValueError(f"unknown case {case!r}; expected 'diagonal' or 'full'")
    return q, k, v, qp, kp


def methods(q, k, v, qp, kp, case: str, shifted: bool = False) -> dict:
    """name -> call() -> out (B, Sq, Hq, D)."""
    causal = case == "diagonal"
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    extra = {}
    if shifted:
        extra["new_shifted"] = lambda: fused_prefill.prefill_attention(q, k, v, q_positions=qp, k_positions=kp,
                                                                       lse_bound=0.0, exact_attention=ops.flash_decode)[0]
    return extra | {
        "old": lambda: ops.flash_decode(q, k, v, q_positions=qp, k_positions=kp, out_dtype=torch.float32,
                                        lse_dtype=torch.float64, backend="torch")[0],
        "new": lambda: ops.prefill_attention(q, k, v, q_positions=qp, k_positions=kp)[0],
        "sdpa": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=True).transpose(1, 2),
    }


def time_interleaved(calls: dict, repeats: int) -> dict:
    """Median seconds per call of each method, rounds interleaved (round r starts at method r mod M)."""
    names = list(calls)
    times = {n: [] for n in names}
    for r in range(repeats):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            t0 = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(ts) for n, ts in times.items()}


def run(sizes=(2048, 4096, 8192), threads=(1, 2), cases=("diagonal", "full"), repeats: int = 5, cp: int = 2,
        log=print, on_row=None, shifted: bool = False) -> list[dict]:
    """One row per (chunk, case, threads), plus the ``sdpa_prompt`` reference per (chunk, threads)."""
    rows = []
    before = torch.get_num_threads()
    try:
        for n in sizes:
            for t in threads:
                torch.set_num_threads(t)
                for case in cases:
                    q, k, v, qp, kp = inputs(n, n, case)
                    calls = methods(q, k, v, qp, kp, case, shifted)
                    want = calls["new"]()
                    errs = {}
                    for name, call in calls.items():  # checked before timing (and warmed up)
                        errs[name] = float((call() - want).abs().max())
                        if errs[name] > 1e-4:
                            raise AssertionError(f"{name} differs from new by {errs[name]:.2e} at chunk {n} {case}")
                    sec = time_interleaved(calls, repeats)
                    kernel = fused_prefill.select_kernel(q.device, q.dtype, q.shape[-1])
                    row = {"chunk": n, "block": n, "case": case, "threads": t, "seconds": sec,
                           "old_over_new": sec["old"] / sec["new"], "new_over_sdpa": sec["new"] / sec["sdpa"],
                           "max_abs_diff_vs_new": errs, "kernel": kernel}
                    rows.append(row)
                    log(f"chunk {n:6d} {case:8s} threads {t}: old {sec['old']:.4f}s  new {sec['new']:.4f}s  "
                        f"sdpa {sec['sdpa']:.4f}s  old/new {row['old_over_new']:.2f}x  "
                        f"new/sdpa {row['new_over_sdpa']:.2f}x"
                        + (f"  new_shifted {sec['new_shifted']:.4f}s" if shifted else ""))
                    if on_row:
                        on_row(rows)
                total = cp * n
                g = torch.Generator().manual_seed(1)
                qw = torch.randn(1, SHAPE["heads_q"], total, SHAPE["head_dim"], generator=g)
                kw = torch.randn(1, SHAPE["heads_kv"], total, SHAPE["head_dim"], generator=g)
                vw = torch.randn(1, SHAPE["heads_kv"], total, SHAPE["head_dim"], generator=g)
                whole = {"sdpa_prompt": lambda: F.scaled_dot_product_attention(qw, kw, vw, is_causal=True,
                                                                               enable_gqa=True)}
                whole["sdpa_prompt"]()
                sec = time_interleaved(whole, repeats)
                rows.append({"chunk": n, "case": f"whole prompt of cp * chunk = {total} tokens", "threads": t,
                             "tokens": total, "seconds": sec})
                log(f"chunk {n:6d} whole prompt ({total} tokens, causal SDPA) threads {t}: "
                    f"{sec['sdpa_prompt']:.4f}s")
                if on_row:
                    on_row(rows)
    finally:
        torch.set_num_threads(before)
    return rows


def precision_rows(magnitudes=(1.0, 30.0, 100.0, 1e3, 1e4, 1e5, -1e5), tokens: int = 96, p: int = 4) -> list[dict]:
    """One row per magnitude: the merged output's largest error against fp64 for each path (module docstring)."""
    from megatron_tree.ops import reference
    from . import precision

    rows = []
    pos = torch.arange(tokens)[None]
    cuts = precision.uneven_cuts(tokens, p, empty=1)
    for mag in magnitudes:
        q, k, v, _ = precision.large_score_inputs([mag], [tokens], sq=tokens, hq=4, hkv=2)
        want, _ = reference.partial_attention(q, k, v, q_positions=pos, k_positions=pos)
        qf, kf, vf = q.float(), k.float(), v.float()
        paths = {
            "new": lambda a, b: ops.prefill_attention(qf, kf[:, a:b], vf[:, a:b], q_positions=pos,
                                                      k_positions=pos[0, a:b]),
            "new_no_shift": lambda a, b: fused_prefill.prefill_attention(
                qf, kf[:, a:b], vf[:, a:b], q_positions=pos, k_positions=pos[0, a:b], lse_bound=float("inf"),
                exact_attention=ops.flash_decode),
            "old": lambda a, b: ops.flash_decode(qf, kf[:, a:b], vf[:, a:b], q_positions=pos, k_positions=pos[:, a:b],
                                                 out_dtype=torch.float32, lse_dtype=torch.float64, backend="torch"),
            "old_lse32": lambda a, b: ops.flash_decode(qf, kf[:, a:b], vf[:, a:b], q_positions=pos,
                                                       k_positions=pos[:, a:b], out_dtype=torch.float32,
                                                       lse_dtype=torch.float32, backend="torch"),
        }
        row = {"magnitude": mag, "P": p, "tokens": tokens}
        for name, part in paths.items():
            parts = [part(a, b) for a, b in zip(cuts, cuts[1:])]
            out, _ = ops.merge_states(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]))
            row[name] = float((out.double() - want).abs().max())
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192],
                   help="chunk = block sizes in tokens (default 2048 4096 8192)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts (default 1 2)")
    p.add_argument("--cases", nargs="+", default=["diagonal", "full"], choices=("diagonal", "full"))
    p.add_argument("--repeats", type=int, default=5, help="timed interleaved rounds per configuration (default 5)")
    p.add_argument("--cp", type=int, default=2, help="ranks of the whole-prompt reference (cp * chunk tokens)")
    p.add_argument("--shifted", action="store_true", help="also time new forced through its shifted second pass")
    p.add_argument("--no-precision", action="store_true", help="skip the precision table")
    p.add_argument("--out", default=None, help="JSON file to write")
    a = p.parse_args(argv)
    if min(a.sizes) < 1 or min(a.threads) < 1 or a.repeats < 1 or a.cp < 1:
        p.error("--sizes, --threads, --repeats and --cp must be positive")
    meta = {"command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.prefill_kernel",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "shape": SHAPE, "dtype": "float32", "batch": 1, "repeats": a.repeats,
            "statistic": "median of interleaved rounds, seconds per call"}

    def save(rows):
        if a.out:
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)

    prec = [] if a.no_precision else precision_rows()
    meta["precision"] = prec
    if prec:
        print("| scores ~ | P | new | new, no shift | old (fp64 lse) | old, fp32 lse |\n|---|---|---|---|---|---|")
    for r in prec:
        print(f"| {r['magnitude']:g} | {r['P']} | {r['new']:.1e} | {r['new_no_shift']:.1e} | {r['old']:.1e} "
              f"| {r['old_lse32']:.1e} |", flush=True)
    rows = run(tuple(a.sizes), tuple(a.threads), tuple(a.cases), a.repeats, a.cp,
               log=lambda s: print(s, flush=True), on_row=save, shifted=a.shifted)
    save(rows)
    if a.out:
        print(f"# wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
