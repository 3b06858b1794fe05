"""A small multi-process demonstration of ``tree_decode`` on CPU (gloo).

Run it under any launcher, e.g. ``torchrun --standalone --nproc_per_node 4 -m megatron_tree.eval.demo``:
every rank holds an uneven shard of one long KV cache, decodes one query with every merge
strategy, and rank 0 prints each strategy's error against attention over the unsharded
cache and the bytes each rank sent per level.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from ..comm import STRATEGIES
from ..decode.attention import tree_decode
from ..distributed import CommStats, TreeGroups
from ..ops import reference


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=50_000, help="total context length")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--intra-size", type=int, default=None, help="simulate nodes of this many ranks")
    args, unknown = parser.parse_known_args(argv)
    stray = [a for a in unknown if not a.startswith("--local_rank")]  # the deepspeed launcher appends --local_rank
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        parser.error("run it under a launcher, e.g. torchrun --standalone --nproc_per_node 4 -m megatron_tree.eval.demo")

    dist.init_process_group("gloo")
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        groups = TreeGroups.from_env(intra_size=args.intra_size)
        g = torch.Generator().manual_seed(0)
        b, n = args.batch, args.tokens
        q = torch.randn(b, 1, args.q_heads, args.head_dim, generator=g)
        k = torch.randn(b, n, args.kv_heads, args.head_dim, generator=g)
        v = torch.randn(b, n, args.kv_heads, args.head_dim, generator=g)
        lens = torch.tensor([n - 7 * i for i in range(b)], dtype=torch.int32)  # rows of different lengths
        cuts = [round(n * (r * (r + 1) / 2) / (groups.size * (groups.size + 1) / 2)) for r in range(groups.size + 1)]
        lo, hi = cuts[groups.rank], cuts[groups.rank + 1]  # uneven shards, rank r holds ~ (r + 1) parts
        local_lens = (lens - lo).clamp(0, hi - lo).to(torch.int32)
        want = reference.partial_attention(q.double(), k.double(), v.double(), cache_seqlens=lens)[0]
        rows = []
        for strategy in STRATEGIES:
            stats = CommStats()
            out = tree_decode(q, k[:, lo:hi], v[:, lo:hi], groups, cache_seqlens=local_lens,
                              strategy=strategy, stats=stats)
            err = float((out.double() - want).abs().max())
            per_level = ", ".join(f"{name}: {s.collectives} coll / {s.sent_bytes} B"
                                  for name, s in stats.levels.items())
            rows.append(f"  {strategy:<11} max|err| = {err:.2e}   {per_level}")
        if dist.get_rank() == 0:
            desc = groups.describe()
            print(f"tree_decode on {desc['cp_size']} ranks, levels {[(l['name'], l['size']) for l in desc['levels']]}, "
                  f"{n} tokens x batch {b}, Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim}")
            print("\n".join(rows))
            kv_bytes = 2 * k.numel() * k.element_size()
            print(f"  (the whole KV cache is {kv_bytes / 1e6:.1f} MB; tree decode sends only partial states)")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
