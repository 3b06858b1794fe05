"""One tree decode under a launcher with no ``init_process_group`` of its own: ``TreeGroups.from_env()``
creates the default group from the launcher's variables (torchrun, the deepspeed launcher, srun).

``python from_env_decode.py OUT_DIR``: every rank decodes one step over its uneven shard of a
seeded GQA KV cache (rows of different lengths; with 3 ranks the last shard is empty for the
short row) and writes ``OUT_DIR/rank<R>.pt`` (its output) and ``OUT_DIR/rank<R>.json`` (what it
saw); tests/distributed/test_from_env.py compares every rank's output with a single-process reference.
"""

from __future__ import annotations

import json
import os
import sys

import torch

SEQ, BATCH, HQ, HKV, D = 29, 2, 4, 2, 8


def make_inputs():
    """q (B, 1, HQ, D), k, v (B, SEQ, HKV, D), cache_seqlens (B,): the same on every rank."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(BATCH, 1, HQ, D, generator=gen)
    k = torch.randn(BATCH, SEQ, HKV, D, generator=gen)
    v = torch.randn(BATCH, SEQ, HKV, D, generator=gen)
    return q, k, v, torch.tensor([SEQ, 17], dtype=torch.int32)


def bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """Shard ``index`` of ``parts``: the first shard takes half, the rest split the remainder."""
    cuts = [0] + [n // 2 + (n - n // 2) * i // max(parts - 1, 1) for i in range(parts - 1)] + [n]
    if parts == 1:
        cuts = [0, n]
    return cuts[index], cuts[index + 1]


def main() -> int:
    out_dir = [a for a in sys.argv[1:] if not a.startswith("--local")][0]  # deepspeed adds --local_rank=N
    import torch.distributed as dist

    import megatron_tree as mt

    torch.set_num_threads(1)
    assert not dist.is_initialized()
    groups = mt.TreeGroups.from_env()
    q, k, v, lens = make_inputs()
    lo, hi = bounds(SEQ, groups.size, groups.rank)
    local = (lens - lo).clamp(0, hi - lo).to(torch.int32)
    out = mt.tree_decode(q, k[:, lo:hi], v[:, lo:hi], groups, cache_seqlens=local, strategy="auto")
    rank = dist.get_rank()
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    seen = {"rank": rank, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "levels": [[lvl.name, lvl.size] for lvl in groups.levels], "shard": [lo, hi],
            "timeout_s": groups.timeout}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
