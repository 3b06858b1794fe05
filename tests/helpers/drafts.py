"""Draft-tree masks shared by the speculative verification tests (with and without sliding windows)."""

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
