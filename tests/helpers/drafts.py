"""Draft-tree masks and tensors shared by the speculative verification tests (with and without sliding windows)."""

import torch


def parents_mask(parents: list[int]) -> torch.Tensor:
    """The (T, T) ancestor mask of a tree given each row's parent (-1: a root child of the committed cache):
    row i sees itself and its ancestors."""
    t = len(parents)
    m = torch.zeros(t, t, dtype=torch.bool)
    for i, p in enumerate(parents):
        m[i, i] = True
        if p >= 0:
            m[i] |= m[p]
    return m


def draft_masks() -> dict:
    """The trees the verification tests run: a chain, three chains of two, and an uneven tree."""
    from megatron_tree.decode.speculative import tree_mask

    return {
        "chain": tree_mask(1, 4),                       # T = 5, lower triangular
        "tree": tree_mask(3, 2),                        # T = 7: three chains of two
        "irregular": parents_mask([-1, 0, 0, 1, 1, 2, 5, 3]),  # T = 8, uneven branching
    }


def draft_tensors(lengths, t: int, seed: int, hq: int, hkv: int, d: int, d_v: int):
    """Random inputs of a verification over rows holding ``lengths`` committed keys and ``t`` draft rows each:
    q (B, t, hq, d), committed k (B, max(lengths), hkv, d) and v (.., d_v), the drafts' own dk (B, t, hkv, d)
    and dv (B, t, hkv, d_v); keys scaled by 2 (sharper scores). The same draws for the same seed."""
    g = torch.Generator().manual_seed(seed)
    b, n = len(lengths), max(lengths)
    q = torch.randn(b, t, hq, d, generator=g)
    k = torch.randn(b, n, hkv, d, generator=g) * 2
    v = torch.randn(b, n, hkv, d_v, generator=g)
    dk = torch.randn(b, t, hkv, d, generator=g) * 2
    dv = torch.randn(b, t, hkv, d_v, generator=g)
    return q, k, v, dk, dv
