"""A peer whose process is gone is named at once: ``CommError`` naming the rank, its host and pid.

Three real gloo ranks; rank 2 leaves with ``os._exit`` (no cleanup, no goodbye) at five points:
before ``TreeGroups.build``, inside it or ``TreeGroups.from_env`` (as it starts creating the process groups), after it
and before the first merge (``mt.tree_decode``: the merge's first agreement check waits in the
store), and in steady state (after an agreed merge: the next merge goes straight to gloo's
collectives). The survivors must raise ``CommError`` naming rank 2 -- never a raw backend
``RuntimeError``, never another survivor -- well before the group's timeout ``T``. Before the
liveness records (``megatron_tree.distributed.liveness``) the inside-build case was a raw ``RuntimeError:
Wait timeout`` after T, and the first-merge case a CommError naming no rank after 1.35 T.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers.ranks import outcome, run_ranks

T = 10.0
"""The groups' collective timeout in these runs (seconds); the default group's is twice that."""
HOST = "node-a"


def _rank_2_dies_once_the_others_reach(point: str, rank: int) -> None:
    """Ranks 0 and 1 say (through the default store, no collective) that they reached ``point``; rank 2 waits
    for both, then exits without a goodbye."""
    import torch

    store = torch.distributed.distributed_c10d._get_default_store()
    if rank != 2:
        store.set(f"dead_peer_test_{point}_{rank}", "1")
    else:
        store.wait([f"dead_peer_test_{point}_0", f"dead_peer_test_{point}_1"])
        os._exit(0)


def _survivors_see(rank, world, where):
    import torch

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    if where == "before_build":
        # rank 2 dies once every rank's default group is connected (an exit while another rank's gloo still
        # connects its mesh fails that rank's init_process_group, inside the harness: a CI run saw it)
        _rank_2_dies_once_the_others_reach("default_group", rank)
    if where in ("inside_build", "inside_from_env") and rank == 2:
        def die(*args, **kwargs):
            os._exit(0)

        collectives.new_group = die  # rank 2 dies as it starts creating the first process group
    if where in ("before_build", "inside_build"):
        return outcome(lambda: mt.TreeGroups.build(timeout=T))
    if where == "inside_from_env":
        env = {"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": str(rank)}
        return outcome(lambda: mt.TreeGroups.from_env(timeout=T, env=env))
    groups = mt.TreeGroups.build(timeout=T)
    torch.manual_seed(rank)
    q = torch.randn(2, 1, 4, 8)
    k, v = torch.randn(2, 5 + rank, 2, 8), torch.randn(2, 5 + rank, 2, 8)
    if where == "steady_merge":
        mt.tree_decode(q, k, v, groups)  # the merge's signature is agreed: the next call goes straight to gloo
        collectives.all_reduce(torch.ones(1), groups.cp_group, what="test: every rank past the first merge")
    # rank 2 dies only once every rank has built its groups (through the store: no collective on the groups
    # before the merge under test); an exit while another rank still creates a group is "inside_build"'s case
    _rank_2_dies_once_the_others_reach("groups_built", rank)
    return outcome(lambda: mt.tree_decode(q, k, v, groups))


@pytest.mark.parametrize("where,bound,needles", [
    ("before_build", 5.0, ["TreeGroups: exchanging topology facts: rank 2 (host unknown) never checked in"]),
    ("inside_build", 3.0, ["TreeGroups: creating the process group of ranks [0, 1, 2]: rank 2 (host node-a, pid "]),
    ("inside_from_env", 3.0, ["TreeGroups: creating the process group of ranks [0, 1, 2]: rank 2 (host node-a, pid "]),
    ("first_merge", 3.0, ["merge: rank ", "compared its arguments with the other 2 rank(s): rank 2 (host node-a, pid "]),
    ("steady_merge", 3.0, ["tree merge", "rank 2 (host node-a, pid "]),
])
def test_dead_peer_is_a_comm_error_naming_it_at_once(where, bound, needles):
    start = time.monotonic()
    results = run_ranks(_survivors_see, 3, where, timeout=120, pg_timeout=2 * T, expect_dead=(2,),
                        env={"MEGATRON_TREE_HOSTNAME": HOST})
    assert results[2] is None  # rank 2 died as planned
    for rank in (0, 1):
        kind, message, seconds = results[rank]
        assert kind == "CommError", (rank, kind, message)
        for needle in needles:
            assert needle in message, (rank, message)
        assert "is gone: its process has exited" in message or "never checked in" in message, message
        assert "rank 0 (" not in message and "rank 1 (" not in message, message  # the survivors are not blamed
        assert seconds < bound, (where, rank, seconds, message)  # T is 10 s; before: T (build) and 1.35 T (merge)
    assert time.monotonic() - start < 120


def _late_rank_sees(rank, world):
    import torch.distributed as dist

    import megatron_tree as mt

    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        os._exit(0)  # never checks in
    if rank == 1:  # sees rank 2 missing, reports it (the store notice), and exits on its error
        outcome(lambda: mt.TreeGroups.build(timeout=T))
        store.set("test/reported", "1")
        os._exit(0)
    store.wait(["test/reported"])
    time.sleep(1.0)  # rank 1's process is gone by now: only its record and notice are left
    return outcome(lambda: mt.TreeGroups.build(timeout=T))


def test_a_late_rank_names_the_peer_that_never_checked_in_not_the_ones_that_reported_it():
    """Rank 2 never checks in; rank 1 reports it and exits; rank 0 arrives late. The soak found rank 0
    (CP 4, seed 0, case 298) blaming the exited reporter ("rank 1 ... is gone: its process has
    exited") and not naming rank 2 at all."""
    results = run_ranks(_late_rank_sees, 3, timeout=120, pg_timeout=2 * T, expect_dead=(1, 2),
                        env={"MEGATRON_TREE_HOSTNAME": HOST})
    kind, message, seconds = results[0]
    assert kind == "CommError", (kind, message)
    assert "rank 2 (host unknown) never checked in" in message, message
    assert "rank 1 (" not in message, message
    assert seconds < 5.0, (seconds, message)


def _store_host_dies(rank, world, port, where, transport, meeting):
    """The groups' default store is a TCP store that rank 0 serves -- a ``MASTER_ADDR`` rendezvous (srun, the
    deepspeed launcher, ``init_method="tcp://..."``), not the harness's file store -- and rank 0 dies: the
    store dies with it. The survivors' stderr (fd 2, torch's C++ warnings included) is kept while they find out."""
    import datetime
    import tempfile

    import torch
    import torch.distributed as dist

    import megatron_tree as mt
    from megatron_tree.distributed import collectives

    # the harness's group (a file store) makes way for a launcher's, once every rank has connected it (a rank
    # that tore its group down while another still connected the mesh failed that rank's init)
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=2 * T))
    groups = mt.TreeGroups.build(timeout=T, transport=transport)
    torch.manual_seed(rank)
    q = torch.randn(2, 1, 4, 8)
    k, v = torch.randn(2, 5 + rank, 2, 8), torch.randn(2, 5 + rank, 2, 8)
    if where == "steady_merge":
        mt.tree_decode(q, k, v, groups)
        collectives.all_reduce(torch.ones(1), groups.cp_group, what="test: every rank past the first merge")
    _rank_dies_once_the_others_reach(0, where, rank)
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            result = outcome(lambda: mt.tree_decode(q, k, v, groups))
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        stderr = log.read().decode(errors="replace")
    # the survivors leave together (through files: the store is gone): one that exits while the other still
    # probes would be a second exited rank, whose notice the dead store can no longer carry
    open(os.path.join(meeting, str(rank)), "w").close()
    deadline = time.monotonic() + 20
    while len(os.listdir(meeting)) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return (*result, stderr.count("TCPStore.cpp"))


def _rank_dies_once_the_others_reach(victim: int, point: str, rank: int) -> None:
    import torch

    store = torch.distributed.distributed_c10d._get_default_store()
    others = [r for r in range(torch.distributed.get_world_size()) if r != victim]
    if rank != victim:
        store.set(f"store_host_test_{point}_{rank}", "1")
    else:
        store.wait([f"store_host_test_{point}_{r}" for r in others])
        time.sleep(0.2)  # the others read their go-ahead before the store goes
        os._exit(0)


@pytest.mark.parametrize("where,transport", [("steady_merge", "backend"), ("first_merge", "shm")])
def test_a_dead_rank_that_served_the_store_is_named_without_a_flood_of_store_warnings(where, transport, tmp_path):
    """Before: over the backend transport the survivors' CommError named no rank ("a peer's connection
    closed: it most likely died ...": the dead rank's liveness record, never read while the store was up, went
    with it), before the first merge it said "got no answer within 13.5 s" after 0.1 s, and every
    probe of the dead store (every 0.1 s for a second) printed torch's warning with a C++ stack trace: 21
    warnings, ~350 lines on each survivor's stderr around the one line that mattered."""
    from tests.helpers.launching import free_port

    results = run_ranks(_store_host_dies, 3, free_port(), where, transport, str(tmp_path), timeout=120,
                        pg_timeout=2 * T, expect_dead=(0,), env={"MEGATRON_TREE_HOSTNAME": HOST})
    assert results[0] is None  # rank 0 died as planned
    for rank in (1, 2):
        kind, message, seconds, warnings = results[rank]
        assert kind == "CommError", (rank, kind, message)
        assert "rank 0 (host node-a, pid " in message and "is gone: its process has exited" in message, message
        assert "rank 1 (" not in message and "rank 2 (" not in message, message
        # with the store gone no rank's notice can be read: an exited rank might be a reporter, and it says so
        assert "the rendezvous store is gone too" in message and "see rank 0's log" in message, message
        assert seconds < 3.0, (rank, seconds, message)
        assert warnings <= 1, (rank, warnings)  # the first failed store operation's, then the store is left alone
