"""The eval's attention-only comparison: tree decode beside the ring and all-gather baselines.

Invariant: every method runs in the same process groups on the same shards of the same seeded
tensors, in interleaved rounds (round r times each method once, in a rotated order), after two
untimed calls each; the reported time is the median over rounds of global rank 0's wall time of
one call (every call starts after a barrier), times the model's layer count: the attention of one
decode step of the whole model. It measures what the decode step's attention costs with each
data movement; the model sweep (:mod:`.run`) measures the whole step with each merge strategy.

Methods: ``tree`` (``tree_decode`` with ``two_level`` on a two-level group, else ``packed``),
``allgather`` (``tree_decode``'s all-gather merge of the partial states), ``ring``
(``baselines.ring_decode``: the KV shards travel P-1 hops, transfers overlapped with compute) and
``allgather_kv`` (``baselines.allgather_kv_decode``: every rank gathers the whole cache).
Outputs are checked against each other (they must agree to fp32 rounding) so a timing of a wrong
answer is never reported.
"""

from __future__ import annotations

import statistics
import time

__all__ = ["METHODS", "attention_sweep", "crossover"]

METHODS = ("tree", "allgather", "ring", "allgather_kv")


def attention_sweep(groups, contexts, *, batch: int, heads_q: int, heads_kv: int, head_dim: int, layers: int,
                    device, dtype, rounds: int = 7, seed: int = 0) -> list[dict]:
    """``[{"context_length", "method", "strategy", "step_ms", "rounds"}]`` for every context and method.

    Collective: every rank of ``groups`` calls it with the same arguments.
    """
    import torch

    from ..comm import baselines
    from ..decode import tree_decode
    from ..distributed import collectives

    tree_strategy = "two_level" if groups.is_hierarchical else "packed"
    out = []
    for ctx in contexts:
        gen = torch.Generator().manual_seed(seed + ctx)
        q = torch.randn(batch, 1, heads_q, head_dim, generator=gen).to(device, dtype)
        lo = ctx * groups.rank // groups.size
        hi = ctx * (groups.rank + 1) // groups.size
        k = torch.randn(batch, hi - lo, heads_kv, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(batch, hi - lo, heads_kv, head_dim, generator=gen).to(device, dtype)
        plan = baselines.ShardPlan.build(k, groups)
        calls = {
            "tree": lambda: tree_decode(q, k, v, groups, strategy=tree_strategy),
            "allgather": lambda: tree_decode(q, k, v, groups, strategy="allgather"),
            "ring": lambda: baselines.ring_decode(q, k, v, groups, plan=plan),
            "allgather_kv": lambda: baselines.allgather_kv_decode(q, k, v, groups, plan=plan),
        }
        results = {m: [calls[m]() for _ in range(2)][-1] for m in METHODS}  # untimed: first calls, buffers
        for m in METHODS[1:]:
            err = float((results[m].float() - results["tree"].float()).abs().max())
            if err > 1e-3:
                raise RuntimeError(f"attention baselines disagree at {ctx} tokens: {m} differs from tree by {err:.3g}")
        times: dict = {m: [] for m in METHODS}
        for r in range(rounds):
            order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
            for m in order:
                collectives.barrier(groups.cp_group, what="attention baselines: the CP barrier before a timed call")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                calls[m]()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times[m].append(time.perf_counter() - t0)
        for m in METHODS:
            out.append({"context_length": ctx, "method": m, "strategy": tree_strategy if m == "tree" else m,
                        "step_ms": statistics.median(times[m]) * 1e3 * layers, "rounds": rounds})
    return out


def crossover(points: list[dict], method: str, against: str) -> dict:
    """Where ``method`` becomes faster than ``against`` over the measured contexts.

    Returns ``{"against", "from_context"}``: the smallest measured context from which ``method``
    is faster at every larger measured context too (``None``: not within the range), and
    ``"always"``: faster at every measured context.
    """
    by = {}
    for p in points:
        by.setdefault(p["context_length"], {})[p["method"]] = p["step_ms"]
    ctxs = sorted(c for c, ms in by.items() if method in ms and against in ms)
    wins = [by[c][method] < by[c][against] for c in ctxs]
    start = None
    for i in range(len(ctxs) - 1, -1, -1):
        if not wins[i]:
            break
        start = ctxs[i]
    return {"against": against, "from_context": start, "always": bool(ctxs) and all(wins),
            "contexts": ctxs}
