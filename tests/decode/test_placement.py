"""The one placement planner (megatron_tree.placement): prompt chunks, appended blocks, lookups.

Pure Python and single-process: every CP rank derives the same plan, so one object stands
for all of them. The caches that use it (cache.py, the Megatron context) are checked
against it in test_cache.py and test_megatron.py.
"""

import itertools

import pytest

from megatron_tree.decode.placement import LAYOUTS, PlacementError, RowPlacement, prefill_ranges


def _check_consistent(row: RowPlacement):
    """Every token is held exactly once, and locate() agrees with positions()."""
    held = {r: row.positions(r) for r in range(row.cp_size)}
    assert [len(held[r]) for r in range(row.cp_size)] == row.counts
    assert sorted(t for ts in held.values() for t in ts) == list(range(row.total))
    for t in range(row.total):
        rank, slot = row.locate(t)
        assert held[rank][slot] == t and row.owner(t) == rank


def test_hand_computed_plan():
    # 10 tokens in 8 chunks (2,2,1,1,1,1,1,1): rank r keeps chunks r and 7-r.
    row = RowPlacement(4, block_size=4)
    assert row.place_prompt(10) == [[(0, 2), (9, 10)], [(2, 4), (8, 9)], [(4, 5), (7, 8)], [(5, 6), (6, 7)]]
    assert row.counts == [3, 3, 2, 2]
    # Ranks 2 and 3 hold the fewest; the first block opens on the first of them (round-robin from 0).
    assert row.append(6) == [2, 2, 2, 2, 3, 3]
    assert row.append(7) == [3, 3, 0, 0, 0, 0, 1]  # block of rank 3 fills, then 0 and 1 (3 tokens each)
    assert [(b.rank, b.start, b.length, b.slot) for b in row.blocks] == [
        (2, 10, 4, 2), (3, 14, 4, 2), (0, 18, 4, 3), (1, 22, 1, 3)]
    assert row.locate(12) == (2, 4) and row.locate(9) == (0, 2) and row.locate(22) == (1, 3)
    assert [row.block_owner(j) for j in range(row.num_blocks)] == [2, 3, 0, 1]
    _check_consistent(row)
    # Contiguous prompt: rank r keeps chunk r; a tie between all ranks opens on rank 0 first.
    row = RowPlacement(3, layout="contiguous", block_size=2)
    assert row.place_prompt(6) == [[(0, 2)], [(2, 4)], [(4, 6)]]
    assert row.append(7) == [0, 0, 1, 1, 2, 2, 0]


@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
@pytest.mark.parametrize("p,block", [(1, 3), (2, 4), (3, 2), (4, 1), (5, 3), (8, 16)])
def test_blocks_round_robin_and_balanced(layout, p, block):
    for prompt in (1, 7, 2 * p, 33):
        row = RowPlacement(p, layout=layout, block_size=block)
        row.place_prompt(prompt)
        owners = []
        for _ in range(3 * p * block + 5):
            owners += row.append(1)
            assert max(row.counts) - min(row.counts) <= block + 2
        _check_consistent(row)
        # a block stays on one rank for block_size tokens, and consecutive blocks change rank
        runs = [(r, len(list(g))) for r, g in itertools.groupby(owners)]
        assert all(n == block for _, n in runs[:-1]) or p == 1
        assert set(owners) == set(range(p))


def test_one_step_at_a_time_equals_bulk():
    a, b = RowPlacement(3, block_size=3), RowPlacement(3, block_size=3)
    a.place_prompt(11)
    b.place_prompt(11)
    one = [a.append(1)[0] for _ in range(20)]
    assert b.append(7) + b.append(13) == one
    assert a.blocks == b.blocks and a.counts == b.counts
    c = a.copy()
    c.append(5)
    assert a.total == 31 and c.total == 36  # the copy is independent


def test_rows_of_different_lengths_are_independent():
    rows = [RowPlacement(4, block_size=2) for _ in range(2)]
    rows[0].place_prompt(8)
    rows[1].place_prompt(512)
    assert rows[0].counts == [2, 2, 2, 2] and rows[1].counts == [128] * 4
    for _ in range(5):
        for row in rows:
            row.append(1)
    assert rows[0].total == 13 and rows[1].total == 517
    for row in rows:
        _check_consistent(row)


def test_capacity_closes_a_block_early_and_overflow_is_an_error():
    row = RowPlacement(2, block_size=8, capacity=5)
    row.place_prompt(4)  # 2 + 2
    assert row.append(6) == [0, 0, 0, 1, 1, 1]  # rank 0 is full after 3: its block closes early
    assert row.counts == [5, 5]
    with pytest.raises(PlacementError, match="every rank holds its capacity of 5"):
        row.append(1)
    with pytest.raises(PlacementError, match="beyond its capacity of 5"):
        RowPlacement(2, capacity=5).place_prompt(12)


def test_bad_arguments():
    with pytest.raises(PlacementError, match="unknown cache layout 'zigzag'"):
        RowPlacement(2, layout="zigzag")
    with pytest.raises(PlacementError, match="block_size must be a positive integer"):
        RowPlacement(2, block_size=0)
    with pytest.raises(PlacementError, match="cp_size must be a positive integer"):
        prefill_ranges(4, 0, "contiguous")
    row = RowPlacement(2)
    row.place_prompt(3)
    with pytest.raises(PlacementError, match="already holds 3 tokens"):
        row.place_prompt(3)
    with pytest.raises(PlacementError, match="token 3 is outside the row's 3 tokens"):
        row.locate(3)
    with pytest.raises(PlacementError, match="block 0 does not exist"):
        row.block_owner(0)


def _imports(module_file):
    import ast

    tree = ast.parse(open(module_file, encoding="utf-8").read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            out.add("." * node.level + (node.module or ""))
    return out


def test_layers_import_one_way():
    """placement is pure (no torch, no torch.distributed); topology never reaches up to integrations."""
    import megatron_tree.decode.placement as placement
    import megatron_tree.distributed.topology as topology

    assert not {m for m in _imports(placement.__file__) if m.startswith(("torch", "."))}
    assert not {m for m in _imports(topology.__file__) if "integrations" in m}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_chunked_prompt_is_laid_out_window_by_window(layout):
    """prefill_ranges(chunk=T): every position kept once, by windows of T in order, each window laid
    out by the layout on its own (so each forward's tokens are balanced), ascending per rank; a
    chunk at least the prompt's length is the unchunked layout; a bad chunk is refused."""
    for length, cp, chunk in ((37, 2, 8), (37, 3, 12), (100, 4, 16), (5, 4, 2)):
        got = prefill_ranges(length, cp, layout, chunk)
        held = sorted(t for ranges in got for s, e in ranges for t in range(s, e))
        assert held == list(range(length)), (length, cp, chunk)
        for ranges in got:
            flat = [t for s, e in ranges for t in range(s, e)]
            assert flat == sorted(flat)
        for start in range(0, length, chunk):
            window = prefill_ranges(min(chunk, length - start), cp, layout)
            for rank in range(cp):
                mine = {t for s, e in got[rank] for t in range(s, e) if start <= t < start + chunk}
                assert mine == {start + t for s, e in window[rank] for t in range(s, e)}, (rank, start)
    assert prefill_ranges(37, 2, layout, 37) == prefill_ranges(37, 2, layout)
    assert prefill_ranges(37, 2, layout, 100) == prefill_ranges(37, 2, layout)
    for bad in (0, -3, 2.5, True):
        with pytest.raises(PlacementError, match="chunk"):
            prefill_ranges(37, 2, layout, bad)
