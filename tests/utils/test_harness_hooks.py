"""The harness's additions for the benchmarks, on real gloo groups: ``watch=`` stops a run by the
caller's own judgement (and kills its ranks), ``GROUP_INIT_SECONDS`` is set in every rank, and
``RanksInBackground`` hands values over queues and raises a failed rank's traceback instead of
waiting on a queue that will never fill."""

import time

import pytest
import torch

from megatron_tree.utils import testing


def sleeping_body(rank, world, seconds):
    time.sleep(seconds)
    return rank


def init_seconds_body(rank, world):
    import torch.distributed as dist

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)  # the group the harness made works
    return testing.GROUP_INIT_SECONDS, float(t)


def serving_body(rank, world, commands, results):
    while (cmd := commands[rank].get()) is not None:
        if cmd == "fail" and rank == 1:
            raise ValueError(f"rank {rank} refuses {cmd!r}")
        results.put((rank, cmd * 2))
    return rank


def test_watch_stops_a_run_and_a_quiet_watch_changes_nothing():
    calls = []
    got = testing.run_ranks(init_seconds_body, 2, timeout=120, watch=lambda: calls.append(1))
    assert calls  # it was consulted while the ranks ran, and None left the run alone
    for init_s, total in got:
        assert 0 < init_s < 120 and total == 1.0

    start = time.monotonic()
    polls = []

    def watch():
        polls.append(time.monotonic())
        return "the caller saw no progress" if len(polls) > 3 else None

    with pytest.raises(testing.RankFailure, match="---- harness ----\nthe caller saw no progress"):
        testing.run_ranks(sleeping_body, 2, 300.0, timeout=600, watch=watch)
    assert time.monotonic() - start < 120  # the 300 s sleepers were killed, not waited for


def test_ranks_in_background_serve_a_queue_and_fail_loudly():
    ctx = testing.context()
    commands, results = [ctx.Queue() for _ in range(2)], ctx.Queue()
    ranks = testing.RanksInBackground(serving_body, 2, commands, results, timeout=300)
    for q in commands:
        q.put(21)
    assert sorted(ranks.get(results, timeout=120) for _ in range(2)) == [(0, 42), (1, 42)]
    for q in commands:
        q.put(None)
    assert ranks.result(timeout=120) == [0, 1]

    commands, results = [ctx.Queue() for _ in range(2)], ctx.Queue()
    ranks = testing.RanksInBackground(serving_body, 2, commands, results, timeout=300)
    for q in commands:
        q.put("fail")
    start = time.monotonic()
    with pytest.raises(testing.RankFailure, match="ValueError: rank 1 refuses 'fail'"):
        while True:  # rank 0 answers; then rank 1's failure ends the run, and get() says so
            ranks.get(results, timeout=600)
    assert time.monotonic() - start < 120


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl ranks need one GPU each (2 GPUs)")
def test_nccl_ranks_take_their_own_gpu():
    got = testing.run_ranks(nccl_device_body, 2, backend="nccl", timeout=300)
    assert got == [0, 1]


def nccl_device_body(rank, world):
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    assert float(t) == world
    return torch.cuda.current_device()
