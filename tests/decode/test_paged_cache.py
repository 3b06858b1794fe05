"""The paged, CP-sharded KV cache: allocator, placement, free/reuse, errors, and exact decode over it.

Single-process tests drive the bookkeeping of every rank at once (each rank's cache makes
the same calls); one 4-rank gloo run checks decode over the paged shards against an fp64
single-process reference at world sizes 2, 3 and 4 = 2 x 2, with GQA, ragged requests,
empty shards (1-token and empty requests), padding rows, and blocks freed and reused.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.ranks import run_ranks
from megatron_tree.ops import reference
from megatron_tree.decode.paged import CacheOverflowError, PagedKVCache, PoolExhaustedError


def _cache(cp=3, rank=0, blocks=6, bs=4, max_len=40, dtype=torch.float32, layers=1, hkv=2, d=4):
    return PagedKVCache(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=bs, blocks_per_rank=blocks,
                        max_seq_len=max_len, cp_size=cp, cp_rank=rank, dtype=dtype)


def test_placement_round_robin_by_block_first_block_on_the_freest_rank():
    c = _cache()
    placed = c.extend("a", 10)
    # Blocks of 4 round-robin from rank 0 (all pools equally free): 0-3 on 0, 4-7 on 1, 8-9 on 2.
    assert placed.positions.tolist() == list(range(10))
    assert placed.owners.tolist() == [0] * 4 + [1] * 4 + [2] * 2
    assert c.shard_lengths("a") == [4, 4, 2] and c.request_blocks("a") == [1, 1, 1]
    c.extend("b", 5)  # pools still equal: starts on rank 0 again
    assert c.shard_lengths("b") == [4, 1, 0]
    assert c.blocks_used() == [2, 2, 1]
    placed = c.extend("c", 1)  # rank 2 has the most free blocks: a short request goes there
    assert placed.owners.tolist() == [2] and c.blocks_used() == [2, 2, 2]
    # Decoded tokens continue the request's round-robin; a chunk and single tokens follow one rule.
    owners = [c.extend("a", 1).owners.item() for _ in range(6)]
    assert owners == [2, 2, 0, 0, 0, 0]
    assert c.positions("a", 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert c.positions("a", 2) == [8, 9, 10, 11]
    # Slots: the token in slot s on a rank lives in block ids[s // 4] at offset s % 4.
    placed = c.extend("a", 1)  # position 16 -> rank 1, its 5th token there
    assert placed.owners.item() == 1
    block = c.rows(["a"], torch.tensor([16]), rank=1)[0][0, 1].item()
    assert placed.slots.item() == block * 4 + 0


def test_free_returns_blocks_and_they_are_reused():
    c = _cache(cp=2, blocks=3, bs=2)
    c.extend("a", 4)  # one block on each rank
    c.extend("b", 4)
    b_blocks = [c.rows(["b"], torch.tensor([3]), rank=r)[0][0, 0].item() for r in range(2)]
    assert c.blocks_used() == [2, 2]
    c.free("b")
    assert c.blocks_used() == [1, 1] and "b" not in c
    c.extend("new", 4)  # the blocks "b" gave back are the next ones handed out
    assert [c.rows(["new"], torch.tensor([3]), rank=r)[0][0, 0].item() for r in range(2)] == b_blocks
    with pytest.raises(KeyError, match="request 'b' is not in the paged cache"):
        c.free("b")
    c.reset()
    assert c.blocks_used() == [0, 0] and c.requests == []


def test_truncate_rewinds_a_request_like_a_shorter_one_and_frees_its_blocks():
    """An engine's rewind (Megatron's stalled chunked prefill): the kept tokens stay where they
    are, the blocks past them go back to their ranks, and growing again places tokens exactly
    as a request that never held the dropped ones."""
    for cp, hist, keep in ((3, [10, 1, 1], 10), (2, [7, 1, 1], 7), (3, [5, 3, 8, 1, 1], 16), (2, [9, 4], 0)):
        c, fresh = _cache(cp=cp, blocks=12), _cache(cp=cp, blocks=12)
        for n in hist:
            c.extend("r", n)
        before = [c.positions("r", rank)[:] for rank in range(cp)]
        c.truncate("r", keep)
        assert c.length("r") == keep and sum(c.shard_lengths("r")) == keep
        if keep:
            fresh.extend("r", keep)
            assert c.shard_lengths("r") == fresh.shard_lengths("r") and c.blocks_used() == fresh.blocks_used()
            for rank in range(cp):
                assert c.positions("r", rank) == before[rank][:len(c.positions("r", rank))]
            a, b = c.extend("r", 6), fresh.extend("r", 6)
            assert a.positions.tolist() == b.positions.tolist() and a.owners.tolist() == b.owners.tolist()
        else:
            assert c.blocks_used() == [0] * cp
        c.free("r")
        assert c.blocks_used() == [0] * cp
    c = _cache()
    c.extend("a", 5)
    for bad in (6, -1, 2.0, True):
        with pytest.raises(ValueError, match="cannot truncate"):
            c.truncate("a", bad)
    assert c.length("a") == 5
    with pytest.raises(KeyError, match="not in the paged cache"):
        c.truncate("b", 0)


def test_pool_exhaustion_names_request_rank_needed_free_and_changes_nothing():
    c = _cache(cp=2, blocks=3, bs=4, max_len=100)
    c.extend("long", 20)  # 5 blocks: 3 on rank 0, 2 on rank 1
    c.extend("short", 3)  # rank 1 is freer: its one block goes there
    assert c.blocks_used() == [3, 3]
    before = (c.blocks_used(), c.length("long"), c.shard_lengths("long"), c.length("short"))
    with pytest.raises(PoolExhaustedError) as err:
        c.extend("short", 6)  # 9 tokens need a second block, on rank 0, which has none free
    e = err.value
    assert (e.request, e.rank, e.needed, e.free, e.total) == ("short", 0, 1, 0, 3)
    msg = str(e)
    for needle in ("KV pool of CP rank 0 is exhausted", "request 'short' needs 1 more block(s) of 4 tokens",
                   "grow from 3 to 9 tokens", "only 0 of 3 blocks are free", "held by 1 other request(s)",
                   "nothing was allocated"):
        assert needle in msg, msg
    assert (c.blocks_used(), c.length("long"), c.shard_lengths("long"), c.length("short")) == before
    with pytest.raises(PoolExhaustedError, match="request 'fresh' needs 1 more block"):
        c.extend("fresh", 1)
    assert "fresh" not in c and c.blocks_used() == [3, 3]
    c.free("long")
    c.extend("short", 6)  # now it fits
    assert c.length("short") == 9


def test_context_window_error_names_request_and_limit():
    c = _cache(cp=2, max_len=12)
    c.extend("x", 10)
    with pytest.raises(CacheOverflowError) as err:
        c.extend("x", 3)
    msg = str(err.value)
    assert "request 'x' would hold 13 tokens (10 cached + 3 new)" in msg
    assert "context window of 12 tokens" in msg and "other requests are unaffected" in msg
    assert c.length("x") == 10
    with pytest.raises(ValueError, match="blocks_per_rank must be a positive integer, got 0"):
        _cache(blocks=0)
    with pytest.raises(ValueError, match=r"cp_rank must lie in \[0, 3\), got 3"):
        _cache(rank=3)
    with pytest.raises(ValueError, match="num_tokens must be a non-negative integer"):
        c.extend("x", -1)


def test_rows_give_causal_prefix_counts_and_block_tables():
    c = _cache(cp=3, blocks=8, bs=2, max_len=40)
    for rid, n in (("a", 13), ("b", 1), ("c", 0)):
        c.extend(rid, n)
    reqs = ["a"] * 13 + ["b", "c", None]
    pos = torch.tensor(list(range(13)) + [0, 0, 0])
    for rank in range(3):
        table, seqlens = c.rows(reqs, pos, rank=rank)
        assert table.dtype == seqlens.dtype == torch.int32
        held = {rid: c.positions(rid, rank) for rid in ("a", "b", "c")}
        want = [sum(1 for x in held[r] if x <= p) if r is not None else 0 for r, p in zip(reqs, pos.tolist())]
        assert seqlens.tolist() == want, rank
        n_blocks = c.request_blocks("a")[rank]
        assert table.shape[1] >= n_blocks
        for i in range(13):  # every row of a request lists the same blocks
            assert table[i, :n_blocks].tolist() == table[0, :n_blocks].tolist()
    with pytest.raises(ValueError, match=r"positions must have shape \(2,\)"):
        c.rows(["a", "a"], torch.tensor([1, 2, 3]))


def test_write_stores_only_this_ranks_tokens_at_their_slots():
    caches = [_cache(cp=2, rank=r, bs=3, d=2, hkv=1) for r in range(2)]
    k = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 1, 2)
    for c in caches:
        placed = c.extend("a", 7)
        c.write(0, k, -k, placed)
    for r, c in enumerate(caches):
        table, seqlens = c.rows(["a"], torch.tensor([6]))
        flat = c.k[0][table[0].long()].reshape(-1, 1, 2)[: seqlens.item()]
        assert flat[:, 0, 0].tolist() == [2.0 * p for p in c.positions("a")]
        assert torch.equal(c.v[0][table[0].long()].reshape(-1, 1, 2)[: seqlens.item()], -flat)
    assert caches[0].positions("a") == [0, 1, 2, 6] and caches[1].positions("a") == [3, 4, 5]


@settings(max_examples=40, deadline=None)
@given(cp=st.integers(1, 4), bs=st.integers(1, 5),
       ops=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 9), st.booleans()), max_size=30))
def test_bookkeeping_invariants_under_random_add_extend_free(cp, bs, ops):
    """Whatever the order of requests growing and finishing: blocks are never shared, pools
    account for every block, each request is spread within one block of even, and no rank
    holds more of a request than ceil(L / (cp * bs)) blocks -- the bound that lets an
    engine's admission control (logical blocks of cp * bs tokens) size every rank's pool."""
    c = _cache(cp=cp, bs=bs, blocks=10_000, max_len=10_000)
    for rid, n, finish in ops:
        if finish and rid in c:
            c.free(rid)
        else:
            c.extend(rid, n)
        ids = [set() for _ in range(cp)]
        for r in c.requests:
            per_rank = c.request_blocks(r)
            assert max(per_rank) - min(per_rank) <= 1
            assert max(per_rank) <= math.ceil(c.length(r) / (cp * bs))
            assert sum(c.shard_lengths(r)) == c.length(r)
            for rank in range(cp):
                mine = set(c.rows([r], torch.tensor([0]), rank=rank)[0][0, : per_rank[rank]].tolist())
                assert len(mine) == per_rank[rank] and not (mine & ids[rank])
                ids[rank] |= mine
        assert c.blocks_used() == [len(s) for s in ids]


# --------------------------------------------------------------------------- distributed exactness

HQ, HKV, D, BS = 4, 2, 8, 3
LENGTHS = {"long": 29, "mid": 11, "one": 1, "two": 2, "empty": 0}


def _decode_errors(groups, dtype, strategy, overlap=False):
    """Paged tree decode over ``groups`` vs single-process fp64 attention; max |error| of each phase.

    ``tree_decode(..., block_table=...)`` over this rank's pool; ``shifted`` takes as its shift
    the lse of a first ``packed`` call (what a decode loop carries); ``overlap`` splits the batch."""
    import megatron_tree as mt

    c = PagedKVCache(num_layers=2, num_kv_heads=HKV, head_dim=D, block_size=BS, blocks_per_rank=12,
                     max_seq_len=64, cp_size=groups.size, cp_rank=groups.rank, dtype=dtype)
    full = {}  # request -> (k, v) of every token, fp64 values of what was stored

    def add(rid, n):
        placed = c.extend(rid, n)
        start = c.length(rid) - n
        g = torch.Generator().manual_seed(1000 * sum(map(ord, rid)) + start)  # the same on every rank
        k = torch.randn(n, HKV, D, generator=g, dtype=torch.float64).to(dtype).double()
        v = torch.randn(n, HKV, D, generator=g, dtype=torch.float64).to(dtype).double()
        old_k, old_v = full.get(rid, (k[:0], v[:0]))
        full[rid] = (torch.cat([old_k, k]), torch.cat([old_v, v]))
        for layer in range(2):
            c.write(layer, (k * (layer + 1)).to(dtype), v.to(dtype), placed)

    def check(rows):
        reqs = [r for r, _ in rows] + [None]  # one padding row
        pos = torch.tensor([p for _, p in rows] + [0])
        q = torch.randn(len(reqs), 1, HQ, D, generator=torch.Generator().manual_seed(len(rows)), dtype=torch.float64)
        q = q.to(dtype).double()
        table, seqlens = c.rows(reqs, pos)
        err = 0.0
        for layer in range(2):
            kw = dict(block_table=table, cache_seqlens=seqlens, overlap=overlap)
            if strategy == "shifted":
                _, lse = mt.tree_decode(q.to(dtype), c.k[layer], c.v[layer], groups, strategy="packed",
                                        return_lse=True, **kw)
                kw["shift"] = (lse + 0.5).float()  # a shift near, not at, the merged lse: still exact
            out = mt.tree_decode(q.to(dtype), c.k[layer], c.v[layer], groups, strategy=strategy, **kw)
            for i, (rid, p) in enumerate(rows):
                k, v = full[rid]
                want = torch.zeros(1, 1, HQ, D, dtype=torch.float64)
                if p < k.shape[0]:
                    want, _ = reference.partial_attention(q[i: i + 1], k[None, : p + 1] * (layer + 1), v[None, : p + 1])
                err = max(err, (out[i: i + 1].double() - want).abs().max().item())
            err = max(err, out[-1].abs().max().item())  # the padding row sees nothing
        return err

    for rid, n in LENGTHS.items():
        add(rid, n)
    rows = [("long", p) for p in (0, 5, 17, 28)] + [("mid", 10), ("mid", 3), ("one", 0), ("two", 1), ("empty", 0)]
    errors = {"prefill": check(rows)}
    for _ in range(4):  # decode steps: every non-empty request grows by one token
        for rid in ("long", "mid", "one"):
            add(rid, 1)
    errors["decode"] = check([(r, c.length(r) - 1) for r in ("long", "mid", "one")] + [("long", 30)])
    c.free("mid")  # its blocks are reused by a new request: stale keys must stay invisible
    add("reused", 7)
    errors["reused"] = check([("reused", 6), ("reused", 2), ("long", 32)])
    errors["blocks"] = c.blocks_used()
    errors["spread"] = [c.request_blocks(r) for r in c.requests]
    return errors


def _large_scores_error(groups, strategy):
    """Large scores over pages: fp32 rows whose scores are ~1e5 and -1e5 (exact in fp32, near
    ties on every rank), sharded contiguously in blocks of 2; max |error| against fp64."""
    import megatron_tree as mt
    from benchmarks import precision

    q, k, v, lens = precision.large_score_inputs([1e5, -1e5], [24, 24], hq=HQ, hkv=HKV)
    want, _ = reference.partial_attention(q, k, v, cache_seqlens=lens)
    p, r, hkv, d = groups.size, groups.rank, k.shape[2], k.shape[3]
    lo, hi = 24 * r // p, 24 * (r + 1) // p
    pool = lambda t: t[:, lo:hi].float().reshape(-1, 2, hkv, d)  # noqa: E731 -- row-major blocks of 2
    table = torch.arange(hi - lo, dtype=torch.int32).reshape(2, -1)
    out = mt.tree_decode(q.float(), pool(k), pool(v), groups, block_table=table,
                         cache_seqlens=torch.full((2,), hi - lo, dtype=torch.int32), strategy=strategy)
    return float((out.double() - want).abs().max())


def paged_rank(rank, world):
    from megatron_tree import TreeGroups

    out = {}
    pairs = TreeGroups.build([[0, 1], [2, 3]])
    triple = TreeGroups.build([[0, 1, 2], [3]])
    two_by_two = TreeGroups.build(intra_size=2)
    for name, groups, strategies in (("p2", pairs, ("packed", "allgather", "shifted")),
                                     ("p3", triple, ("allreduce3", "auto", "shifted")),
                                     ("p2x2", two_by_two, ("two_level", "packed", "shifted"))):
        if groups.size < 2:
            continue
        for strategy in strategies:
            out[(name, strategy, "fp64")] = _decode_errors(groups, torch.float64, strategy)
        # every strategy on paged shards with the batch split in halves, shifted included
        for strategy in (strategies[0], "shifted"):
            out[(name, strategy, "overlap", "fp64")] = _decode_errors(groups, torch.float64, strategy, overlap=True)
        out[(name, "fp32")] = _decode_errors(groups, torch.float32, strategies[0])
        out.setdefault("large", {})[name] = _large_scores_error(groups, strategies[0])
    return out


@pytest.fixture(scope="module")
def paged_results():
    return run_ranks(paged_rank, 4, timeout=240)


def test_paged_tree_decode_exact_at_world_sizes_2_3_and_2x2(paged_results):
    seen = set()
    for rank, out in enumerate(paged_results):
        for name, err in out["large"].items():
            assert err <= 1e-5, f"rank {rank} {name} at |scores| ~1e5: output error {err:.2e} > 1e-5"
        for key, errors in out.items():
            if key == "large":
                continue
            seen.add(key[0])
            tol = 1e-12 if key[-1] == "fp64" else 2e-6
            for phase in ("prefill", "decode", "reused"):
                assert errors[phase] < tol, (rank, key, phase, errors[phase])
            # Balanced: a rank never holds more than one block above another for a request.
            assert all(max(s) - min(s) <= 1 for s in errors["spread"]), (rank, key, errors["spread"])
    assert seen == {"p2", "p3", "p2x2"}
    for name in ("p2", "p3", "p2x2"):  # shifted, and the overlapped split, ran on paged shards at every size
        assert (name, "shifted", "fp64") in paged_results[0] and (name, "shifted", "overlap", "fp64") in paged_results[0]
    assert ("p3", "auto", "fp64") not in paged_results[3]  # rank 3 is alone in the 3+1 split
