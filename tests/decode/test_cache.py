"""The sharded KV cache's placement plan and storage, checked single-process.

The cache never communicates: every CP rank derives the same plan from the same lengths.
So one process can build the caches of all P ranks side by side and check the plan as a
whole: every token stored exactly once, Megatron's layout, balance, capacity, errors.
"""

import itertools
import math

import pytest
import torch

from megatron_tree.decode.cache import CacheConfig, CacheOverflowError, ShardedKVCache, prefill_ranges


def _caches(p, max_len, batch=2, layout="load_balanced", block=4, heads=2, dim=4):
    return [
        ShardedKVCache(num_layers=2, batch_size=batch, max_seq_len=max_len, num_kv_heads=heads, head_dim=dim,
                       cp_size=p, cp_rank=r, config=CacheConfig(layout=layout, block_size=block))
        for r in range(p)
    ]


def _stored_positions(caches, row):
    out = []
    for c in caches:
        n = int(c.seqlens[row])
        assert (c.positions[row, n:] == -1).all()
        out.extend(c.positions[row, :n].tolist())
    return out


def test_load_balanced_matches_megatron_when_divisible():
    # Megatron-Core get_batch_on_this_cp_rank: 2*CP chunks, rank r keeps chunks r and 2*CP-1-r.
    p, chunk = 4, 3
    ranges = prefill_ranges(2 * p * chunk, p, "load_balanced")
    for r in range(p):
        assert ranges[r] == [(r * chunk, (r + 1) * chunk), ((2 * p - 1 - r) * chunk, (2 * p - r) * chunk)]
    assert prefill_ranges(10, 3, "contiguous") == [[(0, 4)], [(4, 7)], [(7, 10)]]


@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
def test_prefill_partitions_prompt_evenly(layout):
    for p in (1, 2, 3, 4, 5, 8):
        for n in range(0, 40):
            ranges = prefill_ranges(n, p, layout)
            covered = sorted(i for rr in ranges for s, e in rr for i in range(s, e))
            assert covered == list(range(n)), (p, n)
            shares = [sum(e - s for s, e in rr) for rr in ranges]
            assert max(shares) <= math.ceil(n / p)
            assert max(shares) - min(shares) <= (2 if layout == "load_balanced" else 1)


@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
@pytest.mark.parametrize("p,block", [(2, 4), (3, 2), (4, 3), (4, 1)])
def test_decode_appends_round_robin_by_block(layout, p, block):
    lengths = [7, 2]
    steps = 4 * p * block + 3
    caches = _caches(p, max_len=max(lengths) + steps + p * block, layout=layout, block=block)
    local = [c.start_prefill(lengths) for c in caches]
    assert len({t.shape for t in local}) == 1  # the same padded width on every rank
    owners = [[], []]
    for step in range(steps):
        results = [c.begin_decode_step() for c in caches]
        for row in range(2):
            assert len({int(pos[row]) for pos, _ in results}) == 1  # every rank agrees on the position
            assert int(results[0][0][row]) == lengths[row] + step
            holders = [r for r, (_, slot) in enumerate(results) if int(slot[row]) >= 0]
            assert len(holders) == 1  # exactly one rank stores the new token
            owners[row].append(holders[0])
    for row in range(2):
        total = lengths[row] + steps
        assert sorted(_stored_positions(caches, row)) == list(range(total))
        counts = caches[0].shard_lengths[row]
        assert counts == [int(c.seqlens[row]) for c in caches]
        assert max(counts) - min(counts) <= max(block, 2)
        assert set(owners[row]) == set(range(p))  # never always the last rank
        # blocks: the owner changes at most once every `block` tokens
        runs = [len(list(g)) for _, g in itertools.groupby(owners[row])]
        assert all(r >= block for r in runs[1:-1])


def test_tight_capacity_fills_every_slot_and_overflow_is_an_error():
    p, max_len = 4, 10  # ceil(10 / 4) = 3 slots per rank, 12 in all
    caches = _caches(p, max_len=max_len, batch=1, block=8)
    for c in caches:
        c.start_prefill([3])
    for _ in range(max_len - 3):
        for c in caches:
            c.begin_decode_step()
    assert sum(int(c.seqlens[0]) for c in caches) == max_len
    assert all(int(c.seqlens[0]) <= c.capacity == 3 for c in caches)
    assert sorted(_stored_positions(caches, 0)) == list(range(max_len))
    with pytest.raises(CacheOverflowError, match="already holds 10 tokens"):
        caches[0].begin_decode_step()
    with pytest.raises(CacheOverflowError, match="prompt 0 has 11 tokens"):
        caches[0].start_prefill([11])
    with pytest.raises(ValueError, match="at least one token"):
        caches[0].start_prefill([0])
    with pytest.raises(ValueError, match="prefill a prompt"):
        _caches(2, 8, batch=1)[0].begin_decode_step()


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_memory_per_rank_is_one_over_cp(p):
    max_len = 96
    c = _caches(p, max_len=max_len, batch=2, heads=2, dim=8)[p - 1]
    kv = c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size()
    full = c.unsharded_kv_nbytes()
    assert full == 2 * 2 * 2 * max_len * 2 * 8 * 4  # k+v, layers, batch, tokens, heads, dim, fp32
    assert kv == full * math.ceil(max_len / p) // max_len
    assert kv * p <= full * (1 + p / max_len)
    assert c.nbytes < 1.2 * full / p  # positions and lengths add little


def test_storage_write_append_and_trimmed_view():
    caches = _caches(2, max_len=12, batch=2, layout="contiguous", block=2, heads=1, dim=2)
    for c in caches:
        local = c.start_prefill([5, 3])
        # a key tensor that encodes its global position, so storage order can be checked
        k = local.to(torch.float32)[:, :, None, None].expand(-1, -1, 1, 2).clone()
        c.write_prefill(0, k, -k)
    for c in caches:
        pos, slots = c.begin_decode_step()
        k = pos.to(torch.float32)[:, None, None, None].expand(-1, 1, 1, 2)
        c.append(0, k, -k, slots)
    for c in caches:
        k, v = c.layer_kv(0)
        assert k.shape[1] == int(c.seqlens.max())
        for row in range(2):
            n = int(c.seqlens[row])
            assert torch.equal(k[row, :n, 0, 0], c.positions[row, :n].float())
            assert torch.equal(v[row, :n, 0, 1], -c.positions[row, :n].float())


def test_step_write_and_static_view_of_each_layer():
    """The decode step's own write (append_step, at the slots begin_decode_step placed) and the view a step
    reads (layer_kv at the step metadata's kv_len): eager steps read up to the longest local row, static
    (compiled) ones every storage slot -- kv_len = capacity, the same shape each step -- and a view never
    reaches the spare slot that takes other ranks' tokens. Keys and values encode (layer, position), so a
    write to the wrong layer, row, slot or tensor shows; 3 ranks, rows of different lengths."""
    caches = _caches(3, max_len=14, batch=2, layout="contiguous", block=2, heads=1, dim=2)

    def enc(layer, pos):  # (b, s) positions -> (b, s, 1, 2) keys; values are their negatives
        code = (pos + 100 * (layer + 1)).to(torch.float32)
        return torch.stack([code, code + 0.5], -1)[:, :, None]

    for c in caches:
        local = c.start_prefill([5, 2])
        for layer in range(2):
            c.write_prefill(layer, enc(layer, local), -enc(layer, local))
    for step in range(4):
        for c in caches:
            pos, _ = c.begin_decode_step()
            for layer in range(2):
                c.append_step(layer, enc(layer, pos[:, None]), -enc(layer, pos[:, None]))
            for static in (False, True):
                meta = c.step_metadata(static=static)
                assert meta.kv_len == (c.capacity if static else c.local_max)
                for layer in range(2):
                    k, v = c.layer_kv(layer, meta.kv_len)
                    assert k.shape == v.shape == (2, meta.kv_len, 1, 2), (static, k.shape)
                    for row in range(2):
                        n = int(c.seqlens[row])
                        want = enc(layer, c.positions[row : row + 1, :n])[0]
                        assert torch.equal(k[row, :n], want) and torch.equal(v[row, :n], -want), (step, layer, row)
    assert sorted(_stored_positions(caches, 0)) == list(range(9)) and sorted(_stored_positions(caches, 1)) == list(range(6))
    c = caches[0]
    k, _ = c.layer_kv(1, c.capacity + 3)  # past the storage's slots: capacity slots, not the spare one
    assert k.shape[1] == c.capacity and k.data_ptr() == c.layer_kv(1, c.capacity)[0].data_ptr()


def test_config_errors():
    with pytest.raises(ValueError, match="unknown cache layout 'zigzag'"):
        CacheConfig(layout="zigzag")
    with pytest.raises(ValueError, match="block_size"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="cp_rank"):
        _caches(2, 8)[0].__class__(num_layers=1, batch_size=1, max_seq_len=4, num_kv_heads=1, head_dim=2,
                                   cp_size=2, cp_rank=2)


def test_static_length_buckets_four_per_octave():
    """A static cache's length: the smallest of 64, 80, 96, 112, 128, 160, ... holding the tokens; never more
    than 1.25x them (past the minimum); a count that is not an int >= 0 is refused."""
    from megatron_tree.decode.cache import static_length

    assert [static_length(n) for n in (0, 1, 64, 65, 80, 81, 128, 129, 32768, 32800, 131072 + 64)] == \
        [64, 64, 64, 80, 80, 96, 128, 160, 32768, 40960, 163840]
    sizes = sorted({static_length(n) for n in range(1, 70000)})
    assert sizes[:10] == [64, 80, 96, 112, 128, 160, 192, 224, 256, 320]
    for octave in range(6, 16):  # four lengths in each octave [2**k, 2**(k+1)), evenly spaced
        inside = [n for n in sizes if 2 ** octave <= n < 2 ** (octave + 1)]
        assert inside == [2 ** octave + j * 2 ** (octave - 2) for j in range(4)], octave
    assert all(n <= static_length(n) <= max(64, 1.25 * n) for n in range(1, 70000, 7))
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="static_length: expected a token count"):
            static_length(bad)


def test_storage_pool_hands_its_one_storage_to_the_next_take_of_the_same_key_only():
    """StoragePool keeps the last storage handed back and gives it to the next cache of exactly its shape: any
    constructor argument that differs (dtype, batch, device, length, heads, CP rank, layout, ...) is another key,
    whose take drops the kept storage (its cache allocates next: never two storages at once). "cpu" and
    torch.device("cpu") are one device."""
    from megatron_tree.decode.cache import StoragePool

    shape = dict(num_layers=2, batch_size=3, max_seq_len=64, num_kv_heads=2, head_dim=4, head_dim_v=4, cp_size=2,
                 cp_rank=0, config=CacheConfig(), dtype=torch.float32, device=torch.device("cpu"))
    key = StoragePool.key(**shape)
    assert StoragePool.key(**{**shape, "device": "cpu"}) == key
    assert StoragePool.key(**{**shape, "config": CacheConfig()}) == key
    others = dict(num_layers=3, batch_size=2, max_seq_len=80, num_kv_heads=1, head_dim=8, head_dim_v=2, cp_size=3,
                  cp_rank=1, config=CacheConfig(layout="contiguous"), dtype=torch.bfloat16, device="meta")
    keys = {name: StoragePool.key(**{**shape, name: value}) for name, value in others.items()}
    keys["block_size"] = StoragePool.key(**{**shape, "config": CacheConfig(block_size=8)})
    assert all(k != key for k in keys.values()) and len(set(keys.values())) == len(keys), keys
    if torch.cuda.is_available():  # "cuda" names the current device
        cuda = f"cuda:{torch.cuda.current_device()}"
        assert StoragePool.key(**{**shape, "device": "cuda"}) == StoragePool.key(**{**shape, "device": cuda})

    s1, s2 = (ShardedKVCache(**{**shape, "cp_size": 1}) for _ in range(2))
    pool = StoragePool()
    assert pool.take(key) is None and pool.holds == 0 and pool.reused == 0
    pool.give(key, s1)
    assert pool.holds == s1.kv_nbytes > 0
    for name, other in keys.items():  # another shape: nothing, and the kept storage is dropped
        pool.give(key, s1)
        assert pool.take(other) is None and pool.holds == 0, name
        assert pool.take(key) is None, name
    assert pool.reused == 0
    pool.give(key, s1)
    pool.give(key, s2)  # one storage kept: the last one handed back
    assert pool.take(key) is s2 and pool.reused == 1 and pool.holds == 0
    assert pool.take(key) is None and pool.reused == 1  # taken once only
    pool.give(key, s1)
    pool.clear()
    assert pool.holds == 0 and pool.take(key) is None and pool.reused == 1
