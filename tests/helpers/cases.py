"""Sharded attention cases and their single-process oracle, shared by the tree_decode and overlap tests."""



import torch
from megatron_tree.ops import reference
from benchmarks import precision


CASES = {
    "gqa_ragged_sq1": ([37, 0, 20], 1, 8, 2, False),
    "mqa_causal_sq4": ([29, 13], 4, 4, 1, True),
    "gqa_sq4_all_visible": ([23, 31], 4, 8, 2, False),
}


HEAD_DIM = 16


def shard_bounds(n: int, world: int) -> list[int]:
    """Uneven contiguous cuts of [0, n): rank r gets a share ~ (r + 1), rank 1 gets nothing."""
    return precision.uneven_cuts(n, world, empty=1 if world > 1 else None)


def make_case(name: str, seed: int = 0):
    lengths, sq, hq, hkv, causal = CASES[name]
    n = max(lengths)
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    q = torch.randn(b, sq, hq, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, HEAD_DIM, generator=g, dtype=torch.float64)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q_pos = (lens[:, None] - sq + torch.arange(sq)[None, :]).long() if causal else None
    return q, k, v, lens, q_pos


def local_view(q, k, v, lens, q_pos, rank, world):
    cuts = shard_bounds(k.shape[1], world)
    lo, hi = cuts[rank], cuts[rank + 1]
    seqlens = (lens - lo).clamp(0, hi - lo).to(torch.int32)
    kw = {"cache_seqlens": seqlens}
    if q_pos is not None:
        kw.update(q_positions=q_pos, k_positions=torch.arange(lo, hi))
    return k[:, lo:hi], v[:, lo:hi], kw


def oracle(q, k, v, lens, q_pos):
    kw = {"cache_seqlens": lens}
    if q_pos is not None:
        kw.update(q_positions=q_pos, k_positions=torch.arange(k.shape[1]))
    return reference.partial_attention(q, k, v, **kw)
