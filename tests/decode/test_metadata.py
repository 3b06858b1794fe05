"""``StepMetadata``: a decode step's metadata in the cache's buffers, updated in place, and each sliding
window's first slots against a count made key by key."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.decode import CacheConfig, ShardedKVCache


def _cache(rank, cp=3, lengths=(11, 4, 1), steps=9):
    cache = ShardedKVCache(num_layers=1, batch_size=len(lengths), max_seq_len=40, num_kv_heads=1, head_dim=4,
                           cp_size=cp, cp_rank=rank, config=CacheConfig(block_size=2))
    cache.start_prefill(list(lengths))
    metas = []
    for _ in range(steps):
        cache.begin_decode_step()
        metas.append(cache.step_metadata(static=True))
    return cache, metas


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_window_starts_count_the_keys_that_left_the_window(rank, window):
    """starts[w][b] = this rank's stored keys of row b at positions <= q - w (the new token at q sees
    q - w < j <= q), counted one key at a time on the host; ragged rows, a row of one prompt token,
    tokens moving across 3 ranks in blocks of 2."""
    cache, metas = _cache(rank)
    meta = metas[-1]
    meta.update_starts([None, window, window])
    got = meta.starts[window].tolist()
    positions, lengths, q = cache.positions.tolist(), cache.seqlens.tolist(), meta.q_positions[:, 0].tolist()
    want = [sum(1 for j in range(lengths[b]) if positions[b][j] <= q[b] - window) for b in range(len(q))]
    assert got == want
    # the slots before the start are exactly the keys out of the window (positions ascend along a row)
    for b in range(len(q)):
        assert all(p <= q[b] - window for p in positions[b][:got[b]])
        assert all(p > q[b] - window for p in positions[b][got[b]:lengths[b]])


def test_metadata_is_one_set_of_buffers_updated_in_place():
    """Every static step hands back the same object over the same storage (what a compiled step or a CUDA
    graph holds), its values the step's: the new tokens' positions are the rows' lengths before it."""
    cache, metas = _cache(0, steps=4)
    assert all(m is metas[0] for m in metas)
    first = metas[0]
    for t in (first.seqlens, first.q_positions, first.store, first.k_positions):
        assert any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in cache.step_buffers())
    assert first.q_positions[:, 0].tolist() == [11 + 3, 4 + 3, 1 + 3]
    assert first.k_positions.shape[1] == cache.capacity and first.kv_len == cache.capacity
    cache.begin_decode_step()
    dynamic = cache.step_metadata(static=False)
    assert dynamic.kv_len == cache.local_max and dynamic.q_positions is first.q_positions
