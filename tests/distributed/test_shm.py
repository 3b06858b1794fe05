"""The shared-memory transport (``TreeGroups.build(transport="shm")``, ``distributed.shm``) on real gloo ranks.

Exact: ``tree_decode`` over it against the single-process reference on the unsharded tensors (GQA,
rows of different lengths, an empty row, uneven and empty shards; CP 2, 3 and 2 x 2 -- four ranks on
two cores, where a waiting rank must yield its core), the same bits on every rank; its collectives
against gloo's (a sum in group-rank order to the bit, a strided ``out``); hundreds of back-to-back
collectives of changing sizes by ranks at uneven speeds, never a torn or overwritten read. Bad input and
faults: ranks passing different sizes or dtypes, a peer that exits, a peer that
never comes, a bad or split ``transport`` setting -- each the same clear error on every rank, within
its bound. Nothing is left in ``/dev/shm``.
"""

from __future__ import annotations

import os
import time

import pytest

from megatron_tree.distributed import shm
from tests.helpers.launching import free_port
from tests.helpers.ranks import outcome, run_ranks

pytestmark = pytest.mark.skipif(not shm.supported(), reason="the shared-memory channel needs x86-64 and /dev/shm")

T = 6.0
"""The groups' collective timeout in the fault runs (seconds)."""


def _shards(rank, world, uneven):
    """This rank's contiguous piece of each row of 37 keys at the given cut points (an empty one included)."""
    cuts = {2: [0, 30, 37], 3: [0, 0, 21, 37], 4: [0, 9, 9, 30, 37]}[world] if uneven else \
        [round(37 * i / world) for i in range(world + 1)]
    return cuts[rank], cuts[rank + 1]


def _decode_over(rank, world, transport, intra):
    import torch

    import megatron_tree as mt
    from megatron_tree.ops import reference

    groups = mt.TreeGroups.build(intra_size=intra, transport=transport)
    attached = [shm.channel_of(g) is not None for g in [groups.cp_group] + [lv.group for lv in groups.levels]]
    torch.manual_seed(0)
    q = torch.randn(3, 1, 8, 16, dtype=torch.float64)
    k, v = torch.randn(3, 37, 2, 16, dtype=torch.float64), torch.randn(3, 37, 2, 16, dtype=torch.float64)
    lens = torch.tensor([37, 12, 0])  # rows of different lengths, one empty
    out = {}
    for uneven in (False, True):
        lo, hi = _shards(rank, world, uneven)
        seqlens = (lens - lo).clamp(0, hi - lo).to(torch.int32)
        for strategy in ("packed", "allgather", "two_level"):
            if strategy == "two_level" and not groups.is_hierarchical:
                continue
            got = mt.tree_decode(q, k[:, lo:hi].contiguous(), v[:, lo:hi].contiguous(), groups,
                                 cache_seqlens=seqlens, strategy=strategy)
            ref, _ = reference.partial_attention(q, k, v, cache_seqlens=lens.to(torch.int32))
            out[(uneven, strategy)] = (float((got - ref).abs().max()), got.reshape(-1).tolist())
    return attached, out


@pytest.mark.parametrize("world,intra", [(2, None), (3, None), (4, 2)])
def test_tree_decode_over_shared_memory_is_exact_and_the_same_on_every_rank(world, intra):
    results = run_ranks(_decode_over, world, "shm", intra, timeout=240)
    for attached, _ in results:
        assert all(attached), attached  # the CP group and every level run on a channel
    for key in results[0][1]:
        for _, out in results:
            err, values = out[key]
            assert err < 1e-12, (key, err)  # float64 against the unsharded reference
            assert values == results[0][1][key][1], key  # bit for bit on every rank


def _collectives(rank, world, transport):
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    groups = mt.TreeGroups.build(transport=transport)
    g = groups.cp_group
    torch.manual_seed(rank)
    out = {}
    for dtype in (torch.float32, torch.float64, torch.int64):
        x = (torch.randn(5, 7) * 100).to(dtype)
        gathered = collectives.all_gather(x, g)
        out[("gather", dtype)] = gathered.tolist()
        for op in ("sum", "max", "min"):
            out[(op, dtype)] = collectives.all_reduce(x.clone(), g, op=op).tolist()
        if transport == "shm":  # the channel's sum: rank 0's + rank 1's + ..., in that order, to the bit
            ordered = gathered[0].clone()
            for r in range(1, world):
                ordered += gathered[r]
            out[("ordered sum", dtype)] = bool(collectives.all_reduce(x.clone(), g).equal(ordered))
    xf = torch.randn(5, 7)
    strided = torch.empty(7, 5, world).permute(2, 1, 0)  # a (P, 5, 7) buffer that is not contiguous
    out["strided out"] = collectives.all_gather(xf, g, out=strided).tolist()
    strided = torch.empty(7, 5, world).permute(2, 1, 0)
    collectives.all_gather_async(xf, g, out=strided).wait()
    out["strided out, async"] = strided.tolist()
    big = torch.full((shm.DEFAULT_SLOT_BYTES // 4 + 1,), float(rank))  # larger than a slot: through gloo
    out["big"] = collectives.all_reduce(big, g).unique().tolist()
    cols = torch.arange(12).reshape(2, 6) + rank  # a column (stride 6), one element of it, bools
    out["column"] = collectives.all_gather(cols[:, -1], g).tolist()  # (transformers' input_ids[:, -1])
    out["one"] = collectives.all_gather(cols[:1, -1], g).tolist()
    out["bool"] = collectives.all_gather(torch.tensor([rank == 1, True]), g).tolist()
    empty = torch.empty(0, 3)
    out["empty"] = list(collectives.all_gather(empty, g).shape)
    # one size in other shapes, back to back and on both slots: each collective reads its own shape
    x = torch.arange(6.0) + 10 * rank
    shapes = [(2, 3), (3, 2), (6,), (1, 6)] * 2
    out["reshaped"] = [(collectives.all_gather(x.reshape(s), g).tolist(),
                        collectives.all_reduce(x.reshape(s).clone(), g).tolist()) for s in shapes]
    for src in range(world):  # each rank the source once: every rank ends with the source's tensor, in place
        for dtype in (torch.int64, torch.float32, torch.uint8):
            x = (torch.arange(6) * 7 + 100 * rank).to(dtype)
            same = collectives.broadcast(x, groups.cp_ranks[src], g)
            out[("broadcast", src, dtype)] = (x.tolist(), same is x)
    channel = shm.channel_of(g)
    if channel is not None:  # the broadcast rides the channel (one collective on it), not gloo
        before = channel._seq
        collectives.broadcast(torch.ones(3), groups.cp_ranks[0], g)
        out["broadcasts on the channel"] = channel._seq - before
    return out


def test_collectives_over_shared_memory_give_what_gloo_gives():
    import torch

    world = 3
    over_shm = run_ranks(_collectives, world, "shm", timeout=120)
    over_gloo = run_ranks(_collectives, world, "backend", timeout=120)
    for rank in range(world):
        for key, value in over_gloo[rank].items():
            if key[0] == "sum" and key[1] != "int64":
                got, want = over_shm[rank][key], value  # another summation order: equal within a rounding
                assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for ra, rb in zip(got, want) for a, b in zip(ra, rb))
            else:
                assert over_shm[rank][key] == value, (rank, key)
        assert over_shm[rank] == over_shm[0], rank  # every collective's result is the same on every rank
    assert over_shm[0]["big"] == [float(sum(range(world)))]
    ordered = {key[1]: value for key, value in over_shm[0].items() if key[0] == "ordered sum"}
    assert len(ordered) == 3 and all(ordered.values()), ordered  # the sum is taken in group-rank order
    assert over_shm[0]["empty"] == [world, 0, 3]
    assert over_shm[0]["broadcasts on the channel"] == 1 and "broadcasts on the channel" not in over_gloo[0]
    for src in range(world):
        for dtype in (torch.int64, torch.float32, torch.uint8):  # (uint8: 100 * src wraps at 256, as the tensor did)
            want = (torch.arange(6) * 7 + 100 * src).to(dtype).tolist()
            assert over_shm[0][("broadcast", src, dtype)] == (want, True), (src, dtype)



def _broadcast_beside(rank, world, transport):
    """Broadcasts inside CP groups laid side by side ([0, 2] and [1, 3]), whose group ranks are not the
    global ranks: the source is named by its global rank, as the decode loops do (``cp_ranks[0]``)."""
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    groups = mt.TreeGroups.build([[0, 2], [1, 3]], transport=transport)
    out = {"channel": shm.channel_of(groups.cp_group) is not None}
    for src in groups.cp_ranks:
        x = torch.arange(5) * 3 + 100 * rank
        collectives.broadcast(x, src, groups.cp_group)
        out[("from", groups.cp_ranks.index(src))] = x.tolist()
    return out


def test_broadcast_in_groups_side_by_side_takes_the_source_by_its_global_rank():
    """Four ranks as two CP groups of two, interleaved: every member of a group ends with its source's
    tensor (the source a global rank, its slot the group rank), over the channel as over gloo."""
    over_shm = run_ranks(_broadcast_beside, 4, "shm", timeout=120)
    over_gloo = run_ranks(_broadcast_beside, 4, "backend", timeout=120)
    for rank in range(4):
        members = [rank % 2, rank % 2 + 2]  # this rank's group, in group-rank order
        assert over_shm[rank]["channel"] and not over_gloo[rank]["channel"], rank
        for i, src in enumerate(members):
            want = [3 * j + 100 * src for j in range(5)]
            assert over_shm[rank][("from", i)] == want == over_gloo[rank][("from", i)], (rank, src)

def _mismatch(rank, world, differ):
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    groups = mt.TreeGroups.build(transport="shm", timeout=T)
    if differ == "size":
        x = torch.zeros(4 + (rank == 1), dtype=torch.float32)
    else:  # the same bytes, another dtype
        x = torch.zeros(4, dtype=torch.int32 if rank == 1 else torch.float32)
    return outcome(lambda: collectives.all_gather(x, groups.cp_group, what="test gather"))


@pytest.mark.parametrize("differ,rank1", [("size", "rank 1: 20 bytes of torch.float32"),
                                          ("dtype", "rank 1: 16 bytes of torch.int32")])
def test_ranks_passing_different_sizes_or_dtypes_get_the_same_disagreement_error(differ, rank1):
    results = run_ranks(_mismatch, 3, differ, timeout=120)
    messages = {r[1] for r in results}
    assert len(messages) == 1, results  # the same words on every rank
    kind, message, seconds = results[0]
    assert kind == "DisagreementError", results[0]
    assert "test gather" in message and "rank 0: 16 bytes of torch.float32" in message, message
    assert rank1 in message, message
    assert seconds < 2.0, seconds


def _stress(rank, world, rounds):
    import random

    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    groups = mt.TreeGroups.build(transport="shm")
    g = groups.cp_group
    rng = random.Random(rank)
    bad = []
    for i in range(rounds):
        # ranks at different speeds, changing every round: one sleeps, one computes, the others go straight on
        pause = rng.random()
        if pause < 0.15:
            time.sleep(0.0005 * (rank + 1))
        elif pause < 0.3:
            torch.randn(64, 64) @ torch.randn(64, 64)
        n = 65536 * (1 + i % 3) - 8 * (i % 2)  # 256 to 768 KiB, changing: copies long enough to be overtaken
        x = torch.full((n,), float(1000 * i + rank))
        out = collectives.all_gather(x, g, what="stress gather")
        for r in range(world):
            if not bool((out[r] == 1000 * i + r).all()):
                bad.append(("gather", i, r, out[r].unique()[:4].tolist()))
        y = torch.full((n // 2 + 4,), float(i + rank))
        collectives.all_reduce(y, g, op="max", what="stress max")
        if not bool((y == i + world - 1).all()):
            bad.append(("max", i, y.unique()[:4].tolist()))
    return bad


def test_back_to_back_collectives_at_uneven_speeds_never_read_a_torn_or_reused_slot():
    # The two parities (with one, a fast rank writes collective s + 1 into the slot, or the size word, a slow
    # peer still reads for s), the order of publishing (slot first, sequence number last) and the per-parity
    # size words: collectives of changing sizes and values, back to back, by ranks that overtake each other.
    results = run_ranks(_stress, 3, 200, timeout=120)
    assert results == [[], [], []], [r[:3] for r in results]


def _peer_fault(rank, world, fault):
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    groups = mt.TreeGroups.build(transport="shm", timeout=T)
    collectives.all_reduce(torch.ones(2), groups.cp_group)  # one good collective first
    if rank == 2:
        if fault == "exits":
            os._exit(0)
        time.sleep(T + 8)  # never comes to the next one (alive: only the timeout can tell)
        return None
    return outcome(lambda: collectives.all_reduce(torch.ones(2), groups.cp_group, what="test sum"))


@pytest.mark.parametrize("fault,bound,needles", [
    ("exits", 2.0, ["test sum: all_reduce(SUM) over the 'cp' level (3 ranks) failed; a peer rank may have died or "
                    "timed out -- rank 2 (host ", "is gone: its process has exited"]),
    ("stuck", T + 3.0, ["test sum: all_reduce(SUM) over the 'cp' level (3 ranks) failed; a peer rank may have died or "
                        "timed out -- no answer within the group's timeout of 6 s",
                        "no answer from rank(s) [2] over shared memory within the group's timeout of 6 s"]),
])
def test_a_peer_that_exits_or_never_comes_is_a_comm_error_naming_it(fault, bound, needles):
    results = run_ranks(_peer_fault, 3, fault, timeout=120, pg_timeout=4 * T,
                        expect_dead=(2,) if fault == "exits" else ())
    for rank in (0, 1):
        kind, message, seconds = results[rank]
        assert kind == "CommError", (rank, kind, message)
        for needle in needles:
            assert needle in message, (rank, message)
        assert "rank 0 (" not in message and "rank 1 (" not in message, message
        assert seconds < bound, (fault, rank, seconds)
        if fault == "stuck":
            assert seconds > T - 0.5, seconds  # not before the timeout: a slow peer is not a dead one


def _bad_setting(rank, world, settings):
    import megatron_tree as mt

    return outcome(lambda: mt.TreeGroups.build(transport=settings[rank]))


@pytest.mark.parametrize("settings,needle", [
    (["tcp", "tcp"], ("transport must be one of ('auto', 'backend', 'shm') (from the argument or $MEGATRON_TREE_TRANSPORT), "
                      "got 'tcp'")),
    (["shm", "backend"], "ranks built TreeGroups with different arguments"),
])
def test_a_bad_or_split_transport_is_the_same_topology_error_on_every_rank(settings, needle):
    results = run_ranks(_bad_setting, 2, settings, timeout=120)
    assert results[0][1] == results[1][1], results
    assert results[0][0] == "TopologyError" and needle in results[0][1], results[0]


def _env_setting(rank, world):
    import megatron_tree as mt

    import torch

    from megatron_tree.distributed import collectives

    groups = mt.TreeGroups.build()
    collectives.all_reduce(torch.ones(1), groups.cp_group)  # every rank is past build (its creator unlinked)
    channel = shm.channel_of(groups.cp_group)
    assert groups.describe()["transport"] == ("shm" if channel is not None else "backend")
    return channel is not None, channel is not None and os.path.exists(channel.path)


def test_the_environment_chooses_the_transport_and_nothing_is_left_in_dev_shm():
    results = run_ranks(_env_setting, 2, timeout=120, env={"MEGATRON_TREE_TRANSPORT": "shm"})
    assert [r[0] for r in results] == [True, True]
    for _, left in results:  # the channel's file was unlinked once every member mapped it, while the ranks run
        assert left is False
    plain = run_ranks(_env_setting, 2, timeout=120, env={"MEGATRON_TREE_TRANSPORT": "backend"})
    assert [r[0] for r in plain] == [False, False]
    default = run_ranks(_env_setting, 2, timeout=120, env={"MEGATRON_TREE_TRANSPORT": ""})
    assert [r[0] for r in default] == [True, True]  # the default, auto: a channel for gloo ranks on one host


_STORE_HOST_DIES = r"""
import os, sys, time, torch
import megatron_tree as mt
from megatron_tree.distributed import collectives
groups = mt.TreeGroups.from_env(transport="shm", timeout=60)
collectives.all_reduce(torch.ones(2), groups.cp_group)
if groups.rank == 0:
    os._exit(0)  # rank 0 hosts the TCPStore: the liveness records go with it
start = time.monotonic()
try:
    collectives.all_reduce(torch.ones(2), groups.cp_group, what="test sum")
except Exception as e:
    print(f"RESULT {type(e).__name__} {time.monotonic() - start:.2f} {e}", flush=True)
"""


def test_a_dead_peer_that_hosted_the_store_is_still_named_at_once(tmp_path):
    # Outside torchrun rank 0 hosts the TCPStore (MASTER_ADDR/PORT): its death took the peers' records with it,
    # and the survivors spun for the whole group timeout, the dead rank unnamed.
    import subprocess
    import sys

    port = free_port()
    script = tmp_path / "store_host_dies.py"
    script.write_text(_STORE_HOST_DIES)
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                                   "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "OMP_NUM_THREADS": "1"})
             for r in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for r in (1, 2):
        line = next((l for l in outs[r].splitlines() if l.startswith("RESULT")), outs[r])
        kind, seconds, message = line.split(" ", 3)[1:]
        assert kind == "CommError", line
        assert "rank 0 (host " in message and "its process has exited" in message, line
        assert float(seconds) < 5.0, line


def _built_in_inference_mode(rank, world):
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    with torch.inference_mode():  # e.g. groups made lazily inside a generation loop
        groups = mt.TreeGroups.build(transport="shm")
        # twice: both parities' slots, whose views the channel keeps per shape, are first made in inference mode
        inside = [collectives.all_gather(torch.tensor([rank]), groups.cp_group).tolist() for _ in range(2)]
        collectives.all_reduce(torch.ones(2), groups.cp_group)
        collectives.all_reduce(torch.ones(2), groups.cp_group)
    # e.g. a training step after: the same shapes again, through the kept views
    outside = [collectives.all_gather(torch.tensor([rank]), groups.cp_group).tolist() for _ in range(2)]
    ch = shm.channel_of(groups.cp_group)  # an inference-tensor buffer (or view) refuses a copy outside inference mode
    totals = [collectives.all_reduce(torch.ones(2), groups.cp_group).tolist() for _ in range(2)]
    return inside, outside, totals, ch._mem.is_inference()


def test_a_channel_made_in_inference_mode_serves_collectives_outside_it():
    for inside, outside, totals, inference in run_ranks(_built_in_inference_mode, 2, timeout=120):
        assert inside == outside == [[[0], [1]]] * 2 and totals == [[2.0, 2.0]] * 2 and not inference


def _cannot_map(rank, world):
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    if rank == 1:  # as in a container whose /dev/shm is not the creator's (the same host name, another tmpfs)
        def refuse(self, path, *args):
            raise RuntimeError(f"unable to open shared memory object <{path}>")

        shm.Channel.__init__ = refuse
    groups = mt.TreeGroups.build(transport="shm")
    total = collectives.all_reduce(torch.ones(3), groups.cp_group).tolist()
    return groups.describe()["transport"], total


def test_a_member_that_cannot_map_the_file_leaves_every_member_on_the_backend():
    assert run_ranks(_cannot_map, 3, timeout=120) == [("backend", [3.0, 3.0, 3.0])] * 3
