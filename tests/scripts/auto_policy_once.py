"""strategy="auto" on real gloo ranks: the policy runs once per shape, the merge is exact, and
no ``benchmarks`` module is ever imported.

Run by tests/comm/test_cost_model.py in a fresh interpreter (pytest itself imports bench/); prints
one JSON line with every rank's report. 2 ranks: a flat group (the policy is the same
arithmetic on any layout; tests/comm/test_cost_model.py checks layouts without processes).
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository

from tests.helpers.ranks import run_ranks  # noqa: E402

SHAPES = ((2, 1, 4, 16), (3, 2, 8, 8))  # (B, Sq, Hq, D)
CALLS = 20


def _states(shape, world, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    b, sq, hq, d = shape
    outs = torch.randn(world, b, sq, hq, d, generator=g)
    lses = torch.randn(world, b, hq, sq, generator=g) * 3
    lses[1, 0] = float("-inf")  # an empty shard on rank 1 for batch row 0
    return outs, lses


def rank_fn(rank, world):
    import megatron_tree  # noqa: F401 -- the package import path a user takes
    from megatron_tree.comm import merge as comm, cost
    from megatron_tree.ops import reference
    from megatron_tree.distributed.topology import TreeGroups

    calls = []
    real = cost.policy

    def counting(*args, **kwargs):
        calls.append(args[1:])
        return real(*args, **kwargs)

    cost.policy = counting
    groups = TreeGroups.build()
    err, chosen = 0.0, []
    for i, shape in enumerate(SHAPES):
        outs, lses = _states(shape, world, seed=i)
        want_o, want_l = reference.merge_states(outs, lses)
        for _ in range(CALLS):
            o, l = comm.merge(outs[rank], lses[rank], groups, strategy="auto")
            err = max(err, float((o - want_o).abs().max()), float((l - want_l).abs().max()))
        chosen.append(comm.choose_strategy(groups, shape, 4))
    return {"rank": rank, "policy_calls": len(calls), "max_err": err, "chosen": chosen,
            "bench_modules": sorted(m for m in sys.modules if m.startswith("benchmarks"))}


if __name__ == "__main__":
    print(json.dumps(run_ranks(rank_fn, 2, timeout=200)))
