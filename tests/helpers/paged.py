"""Test helper: the same KV rows as a contiguous cache and as a paged one with a random block table."""

from __future__ import annotations

import torch


def to_paged(k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor | None, block_size: int, *,
             spare_blocks: int = 3, seed: int = 0):
    """Scatter rows of a contiguous cache into a pool of blocks in random order.

    k, v: (batch, N, heads, headdim); returns (k_pool, v_pool, block_table) with pools
    (num_blocks, block_size, heads, headdim) and block_table (batch, ceil(N / block_size)) int32.
    No block is shared by two rows; ``spare_blocks`` blocks belong to no row. Everything a
    correct kernel must not read is NaN (spare blocks, slots past a row's length) or -1
    (block-table entries past a row's last block), so reading it shows up in the result.
    """
    b, n, h, d = k.shape
    max_blocks = -(-n // block_size)
    lens = cache_seqlens.tolist() if cache_seqlens is not None else [n] * b
    used = [-(-length // block_size) for length in lens]
    num_blocks = sum(used) + spare_blocks
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    k_pool = torch.full((num_blocks, block_size, h, d), float("nan"), dtype=k.dtype)
    v_pool = torch.full_like(k_pool, float("nan"))
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    for row in range(b):
        for j in range(used[row]):
            blk = ids.pop()
            table[row, j] = blk
            lo, hi = j * block_size, min((j + 1) * block_size, lens[row])
            k_pool[blk, : hi - lo] = k[row, lo:hi]
            v_pool[blk, : hi - lo] = v[row, lo:hi]
    return k_pool.to(k.device), v_pool.to(k.device), table.to(k.device)
