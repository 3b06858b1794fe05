"""The one step planner (``decode/plan.py``), single process: every cache plans a step through it.

Checked here: ``place`` reports the slots the placement rule gives (``RowPlacement.locate``)
on every rank; a step reaches the device in one reused buffer and writes other ranks' tokens
to the spare slot only; ``rewind`` takes a step back so that running it again uses the same
plan and slots (the ``shifted`` redo); and the contiguous, static-Megatron-shaped and paged
caches store every token exactly once through it.
"""

from __future__ import annotations

import random

import pytest
import torch

from megatron_tree.decode.cache import CacheConfig, ShardedKVCache
from megatron_tree.decode.paged import PagedKVCache
from megatron_tree.decode.placement import PlacementError, RowPlacement
from megatron_tree.decode.plan import StepPlanner, place, to_device


@pytest.mark.parametrize("cp,block,layout", [(1, 4, "load_balanced"), (3, 2, "contiguous"), (4, 3, "load_balanced")])
def test_place_reports_the_rules_slots_on_every_rank(cp, block, layout):
    rng = random.Random(cp * 10 + block)
    rows = [RowPlacement(cp, layout=layout, block_size=block) for _ in range(3)]
    for row, n in zip(rows, (7, 1, 12)):
        row.place_prompt(n)
    for _ in range(12):
        n = rng.randint(0, 5)
        per_rank = [place([r.copy() for r in rows], n, rank) for rank in range(cp)]
        host = place(rows, n, 0)
        for b, row in enumerate(rows):
            for i, t in enumerate(host.positions[b]):
                rank, slot = row.locate(t)
                assert host.owners[b][i] == rank and host.owner_slots[b][i] == slot
                for r in range(cp):
                    assert per_rank[r].slots[b][i] == (slot if r == rank else -1)
            for r in range(cp):
                assert per_rank[r].counts[b] == row.counts[r]


def test_undo_append_restores_the_row_so_the_same_tokens_land_on_the_same_slots():
    row = RowPlacement(3, block_size=2, capacity=6)
    row.place_prompt(5)
    row.append(3)
    before = (list(row.counts), row.total, list(row.blocks))
    first = place([row], 4, 1)
    row.undo_append(4)
    assert (list(row.counts), row.total, list(row.blocks)) == before
    again = place([row], 4, 1)
    assert again == first
    with pytest.raises(PlacementError, match="undo_append needs 0 <= n <= 7"):
        row.undo_append(8)  # only appended tokens can be taken back, never the prompt's


def test_to_device_is_one_copy_into_a_reused_buffer():
    views, buf = to_device([[[1, 2], [3, 4]], torch.tensor([5, 6, 7])], "cpu")
    assert [v.tolist() for v in views] == [[[1, 2], [3, 4]], [5, 6, 7]]
    views2, buf2 = to_device([[8, 9]], "cpu", out=buf)
    assert buf2 is buf and views2[0].data_ptr() == buf.data_ptr() and views2[0].tolist() == [8, 9]


def test_planner_writes_others_tokens_to_the_spare_slot_and_replays_a_rewound_step():
    rows = [RowPlacement(2, block_size=1) for _ in range(3)]
    for row, n in zip(rows, (3, 4, 1)):
        row.place_prompt(n)
    planner = StepPlanner(rows, 1, spare=99, device="cpu", reserve=3 * 3 * 2 + 3)  # 3 (rows, n) tensors + counts
    buffer = planner._buffer
    plan = planner.step(0, 3, 2)
    assert planner._buffer is buffer  # the reserved buffer: no allocation that persists
    mine = plan.slots >= 0
    assert torch.equal(plan.store[mine], plan.slots[mine]) and (plan.store[~mine] == 99).all()
    assert plan.counts.tolist() == [row.counts[1] for row in rows]
    lengths = [row.total for row in rows]
    planner.rewind()
    assert [row.total for row in rows] == [n - 2 for n in lengths]  # the step is taken back
    with pytest.raises(RuntimeError, match="rewind\\(\\) twice"):
        planner.rewind()
    assert planner.step(0, 3, 2) is plan  # the same plan, the same slots: nothing new is placed or copied
    assert [row.total for row in rows] == lengths
    planner.rewind()
    other = planner.step(0, 2, 2)  # another step than the rewound one is planned afresh
    assert other is not plan and other.positions.tolist() == plan.positions[:2].tolist()


def test_contiguous_cache_redo_keeps_every_token_once():
    caches = [ShardedKVCache(num_layers=1, batch_size=2, max_seq_len=16, num_kv_heads=1, head_dim=1, cp_size=2,
                             cp_rank=r, config=CacheConfig(block_size=2)) for r in range(2)]
    for c in caches:
        local = c.start_prefill([5, 2]).float()[:, :, None, None]  # keys that say their position
        c.write_prefill(0, local, -local)
    for step in range(6):
        for c in caches:
            pos, slots = c.begin_decode_step()
            c.append(0, pos.float()[:, None, None, None], -pos.float()[:, None, None, None], slots)
            if step % 2 == 1:  # the shifted redo: the same token again, on the same slots
                c.rewind_step()
                assert c.lengths == [5 + step, 2 + step]
                pos2, slots2 = c.begin_decode_step()
                assert torch.equal(pos2, pos) and torch.equal(slots2, slots)
                c.append(0, pos.float()[:, None, None, None], -pos.float()[:, None, None, None], slots2)
    for row, n in ((0, 11), (1, 8)):
        stored = []
        for c in caches:
            k, _ = c.layer_kv(0)
            m = int(c.seqlens[row])
            assert torch.equal(k[row, :m, 0, 0], c.positions[row, :m].float())  # each key where its position says
            stored += c.positions[row, :m].tolist()
        assert sorted(stored) == list(range(n))


def test_paged_cache_writes_through_the_planner_without_reading_owners():
    from megatron_tree.utils.sync_guard import no_host_sync

    c = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=1, block_size=2, blocks_per_rank=4, max_seq_len=16,
                     cp_size=2, cp_rank=1)
    placed = c.extend("a", 7)
    assert torch.equal(placed.store, torch.where(placed.owners == 1, placed.slots, torch.tensor(c.spare)))
    k = placed.positions.float()[:, None, None]
    with no_host_sync("PagedKVCache.write"):  # no nonzero, no host read of which tokens are ours
        c.write(0, k, k, placed)
    table, seqlens = c.rows(["a"], torch.tensor([6]))
    got = c.k[0][table[0].long()].reshape(-1)[: int(seqlens)]
    assert got.tolist() == [float(p) for p in c.positions("a")]
