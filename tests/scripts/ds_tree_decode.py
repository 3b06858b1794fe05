"""A tree-decode run under the real deepspeed launcher: ``deepspeed --num_gpus 4 ds_tree_decode.py --out DIR``.

Each rank initialises through ``megatron_tree.integrations.deepspeed.init_distributed``
(the launcher's environment, gloo on CPU), builds ``TreeGroups`` from the launcher's
``LOCAL_SIZE`` (optionally split into simulated nodes with ``--intra-size``), decodes
one step over its uneven shard of a seeded KV cache (sequence length 37: shards of
10/9/9/9, and a row with fewer valid keys) and rank 0 writes the merged output plus what
it saw to ``DIR``; the test compares that with a single-process ``flash_decode``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

SEQ, BATCH, HQ, HKV, D = 37, 2, 4, 2, 16


def make_inputs():
    """q (B, 1, HQ, D), k, v (B, SEQ, HKV, D), cache_seqlens (B,): the same on every rank."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(BATCH, 1, HQ, D, generator=gen)
    k = torch.randn(BATCH, SEQ, HKV, D, generator=gen)
    v = torch.randn(BATCH, SEQ, HKV, D, generator=gen)
    seqlens = torch.tensor([SEQ, 23], dtype=torch.int32)
    return q, k, v, seqlens


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous, uneven split of n tokens into parts (the first n % parts shards get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--intra-size", type=int, default=None)
    from megatron_tree.comm import STRATEGIES

    parser.add_argument("--strategy", default="auto", choices=STRATEGIES)
    parser.add_argument("--ds-config", default=None)
    args, _unknown = parser.parse_known_args()  # the launcher appends --local_rank=N

    import torch.distributed as dist

    from megatron_tree import TreeGroups, tree_decode
    from megatron_tree.comm import CommStats
    from megatron_tree.integrations.deepspeed import init_distributed, wandb_settings

    torch.set_num_threads(1)
    backend = init_distributed()
    groups = TreeGroups.from_env(intra_size=args.intra_size)
    q, k, v, seqlens = make_inputs()
    lo, hi = shard_bounds(SEQ, groups.size, groups.rank)
    local_valid = (seqlens.to(torch.int64) - lo).clamp(0, hi - lo).to(torch.int32)
    stats = CommStats()
    out = tree_decode(q, k[:, lo:hi], v[:, lo:hi], groups, cache_seqlens=local_valid,
                      strategy=args.strategy, stats=stats)
    outs = [torch.empty_like(out) for _ in range(groups.size)]
    dist.all_gather(outs, out.contiguous(), group=groups.cp_group)
    if dist.get_rank() == 0:
        os.makedirs(args.out, exist_ok=True)
        torch.save(out, os.path.join(args.out, "out.pt"))
        info = {
            "backend": backend,
            "world_size": dist.get_world_size(),
            "local_size": os.environ.get("LOCAL_SIZE"),
            "levels": [[lvl.name, lvl.size] for lvl in groups.levels],
            "ranks_agree": all(torch.equal(o, outs[0]) for o in outs),
            "collectives": {name: s.collectives for name, s in stats.levels.items()},
            "wandb": wandb_settings(args.ds_config).__dict__ if args.ds_config else None,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(info, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
