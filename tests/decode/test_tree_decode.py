"""Distributed exactness of tree_decode against fp64 single-process attention, on real gloo groups.

Each multi-rank run covers a whole matrix of cases (strategies x layouts x dtypes) so that
ranks are spawned once per world size. Every rank builds the same unsharded tensors from a
seed, keeps its own shard of the sequence (uneven; rank 1 holds no tokens; one batch row has
no keys on any rank), and returns its errors; the parent process asserts on them.
"""

import os
import time

import pytest
import torch

import megatron_tree as mt
from megatron_tree.comm import merge as comm
from megatron_tree.ops import reference
from benchmarks import precision
from tests.helpers.ranks import run_ranks
from tests.helpers.cases import CASES, local_view, make_case, oracle  # noqa: F401

TREE_STRATEGIES = tuple(s for s in mt.STRATEGIES if s != "shifted")  # shifted needs a shift: test_shifted.py

# name: (batch lengths, seqlen_q, Hq, Hkv, causal)



def same_dtype_torch(q, k, v, lens, q_pos, dtype):
    """Unsharded attention computed entirely in ``dtype`` (flash-attention's yardstick)."""
    b, sq, hq, d = q.shape
    n, hkv = k.shape[1], k.shape[2]
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    kd = kd.repeat_interleave(hq // hkv, dim=2)
    vd = vd.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bnhd->bhqn", qd, kd) * (d ** -0.5)
    mask = torch.arange(n)[None, :] < lens[:, None]
    mask = mask[:, None, None, :].expand(b, hq, sq, n)
    if q_pos is not None:
        mask = mask & (torch.arange(n)[None, None, None, :] <= q_pos[:, None, :, None])
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqn,bnhd->bqhd", p, vd)


# One launch per world size serves every test of that size: rank processes cost seconds of
# interpreter and torch start-up each, the cases below a fraction of that. A job that fails on a
# rank fails the launch, so every test of that world size fails with the rank's traceback.
SHARED_LAUNCHES = {
    4: (("exactness_body", 2), ("accounting_body", 2), ("topology_body",)),
    8: (("exactness_body", 4), ("exactness_body", 2), ("accounting_body", 4)),
}
_launched: dict = {}


def shared_body(rank, world, jobs):
    return [globals()[name](rank, world, *args) for name, *args in jobs]


def launch(fn, world, *args):
    """``run_ranks(fn, world, *args)``, taken from the world size's shared launch when it has one."""
    jobs = SHARED_LAUNCHES.get(world, ())
    job = (fn.__name__, *args)
    if job not in jobs:
        return run_ranks(fn, world, *args)
    if world not in _launched:
        try:  # the jobs of 3 launches in one: a timeout for all three
            # (the backend: the accounting test counts torch.distributed calls, which a channel does not make)
            _launched[world] = run_ranks(shared_body, world, jobs, timeout=540, env={"MEGATRON_TREE_TRANSPORT": "backend"})
        except Exception as e:  # noqa: BLE001 -- every test of this size fails with it, none relaunches
            _launched[world] = e
    if isinstance(_launched[world], Exception):
        raise _launched[world]
    return [per_rank[jobs.index(job)] for per_rank in _launched[world]]


def exactness_body(rank, world, intra_size):
    groups = mt.TreeGroups.build(intra_size=intra_size)
    report = {"levels": [(l.name, l.size) for l in groups.levels], "fp32": {}, "agree": {}, "lowp": {}, "large": {},
              "merge_lse": {}}
    for name in CASES:
        q, k, v, lens, q_pos = make_case(name)
        want_out, want_lse = oracle(q, k, v, lens, q_pos)
        kl, vl, kw = local_view(q, k, v, lens, q_pos, rank, world)
        outs = {}
        for strategy in TREE_STRATEGIES:
            out, lse = mt.tree_decode(
                q.float(), kl.float(), vl.float(), groups, strategy=strategy, return_lse=True, **kw
            )
            assert out.dtype == torch.float32 and lse.dtype == torch.float32
            assert not torch.isnan(out).any() and not torch.isnan(lse).any()
            finite = torch.isfinite(want_lse)
            assert torch.equal(torch.isfinite(lse), finite), "lse must be -inf exactly where no key is visible"
            report["fp32"][(name, strategy)] = (
                float((out.double() - want_out).abs().max()),
                float((lse.double()[finite] - want_lse[finite]).abs().max()),
            )
            outs[strategy] = out
        report["agree"][name] = max(float((o - outs["packed"]).abs().max()) for o in outs.values())
        for dtype in (torch.bfloat16, torch.float16):
            ours = mt.tree_decode(q.to(dtype), kl.to(dtype), vl.to(dtype), groups, strategy="auto", **kw)
            assert ours.dtype == dtype
            qr, kr, vr = (t.to(dtype).double() for t in (q, k, v))  # oracle on the rounded inputs
            want = oracle(qr, kr, vr, lens, q_pos)[0]
            yard = same_dtype_torch(qr, kr, vr, lens, q_pos, dtype)
            report["lowp"][(name, str(dtype))] = (
                float((ours.double() - want).abs().max()),
                float((yard.double() - want).abs().max()),
            )
    # Rows with scores ~1e5, -1e5 and 1e4 (exact in fp32, near ties on every
    # shard) and an empty row; the partial lse must travel whole through every level.
    q, k, v, lens = precision.large_score_inputs([1e5, -1e5, 1e4, 0.0], [41, 29, 37, 0], hq=4, hkv=2)
    want_out, want_lse = oracle(q, k, v, lens, None)
    kl, vl, kw = local_view(q, k, v, lens, None, rank, world)
    finite = torch.isfinite(want_lse)
    for strategy in TREE_STRATEGIES:
        for overlap in (False, True) if world <= 4 else (False,):
            out, lse = mt.tree_decode(q.float(), kl.float(), vl.float(), groups, strategy=strategy, overlap=overlap,
                                      return_lse=True, **kw)
            lse_err = (lse.double()[finite] - want_lse[finite]).abs()
            report["large"][(strategy, overlap)] = (
                float((out.double() - want_out).abs().max()),
                bool((lse_err <= precision.lse_tolerance(want_lse[finite])).all()),
                torch.equal(torch.isfinite(lse), finite),
            )
        if world > 4:  # 8 ranks on CI's two cores: the plain merges only (the rest is covered at 1-4 ranks)
            continue
        # the lse kept whole for the caller (lse_dtype=float64): as exact as the output
        _, lse = mt.tree_decode(q.float(), kl.float(), vl.float(), groups, strategy=strategy, return_lse=True,
                                lse_dtype=torch.float64, **kw)
        report["large"][(strategy, "lse64")] = (
            float((lse[finite] - want_lse[finite]).abs().max()) if lse.dtype == torch.float64 else float("inf"),
            True, torch.equal(torch.isfinite(lse), finite))
    # comm.merge itself returns the merged lse whole (float64) from float64 partials, shifted included
    # (worlds 2, 3 and 2 x 2 cover one and two levels; at 8 ranks on CI's CPUs it would cost seconds)
    o, l = mt.flash_decode(q.float(), kl.float(), vl.float(), out_dtype=torch.float32, lse_dtype=torch.float64, **kw)
    for strategy in (*TREE_STRATEGIES, "shifted") if world <= 4 else ():
        shift = want_lse.float() if strategy == "shifted" else None
        _, lse = comm.merge(o, l, groups, strategy, shift=shift)
        report["merge_lse"][strategy] = (lse.dtype, float((lse[finite] - want_lse[finite]).abs().max()),
                                         torch.equal(torch.isfinite(lse), finite))
        if strategy in ("packed", "allreduce3"):  # the stages that normalise (two_level runs packed's), overlapped
            _, lse = comm.merge_overlapped(lambda rows: (o[rows], l[rows]), [slice(0, 2), slice(2, 4)],
                                           tuple(o.shape), groups, strategy)
            err = float((lse[finite] - want_lse[finite]).abs().max())
            report["merge_lse"][(strategy, "overlapped")] = (lse.dtype, err, torch.equal(torch.isfinite(lse), finite))
    return report


@pytest.mark.parametrize("world,intra", [(1, None), (2, None), (3, None), (4, 2), (8, 4), (8, 2)])
def test_tree_decode_exact(world, intra):
    reports = launch(exactness_body, world, intra)
    want_levels = [("intra", intra), ("inter", world // intra)] if intra else [("intra", world)]
    for rank, rep in enumerate(reports):
        assert rep["levels"] == want_levels
        for key, (err_out, err_lse) in rep["fp32"].items():
            assert err_out <= 1e-5, f"rank {rank} {key}: output error {err_out:.2e} > 1e-5"
            assert err_lse <= 1e-5, f"rank {rank} {key}: lse error {err_lse:.2e} > 1e-5"
        for name, diff in rep["agree"].items():
            assert diff <= 1e-6, f"rank {rank} {name}: strategies disagree by {diff:.2e}"
        for key, (ours, yard) in rep["lowp"].items():
            assert ours <= 2 * yard, f"rank {rank} {key}: error {ours:.2e} > 2x same-dtype torch {yard:.2e}"
        assert len(rep["large"]) == (3 if world <= 4 else 1) * len(TREE_STRATEGIES)
        for key, (err_out, lse_ok, empty_ok) in rep["large"].items():
            assert err_out <= 1e-5, f"rank {rank} {key} at |scores| ~1e5: output error {err_out:.2e} > 1e-5"
            assert lse_ok and empty_ok, f"rank {rank} {key} at |scores| ~1e5: lse beyond one fp32 rounding"
        assert len(rep["merge_lse"]) == (len(TREE_STRATEGIES) + 1 + 2 if world <= 4 else 0)
        for strategy, (dtype, lse_err, empty_ok) in rep["merge_lse"].items():
            assert dtype == torch.float64 and lse_err <= 1e-6 and empty_ok, (
                f"rank {rank} comm.merge {strategy} at |scores| ~1e5: lse {dtype}, error {lse_err:.2e} > 1e-6")
    # every rank returns the same answer: compare rank 0's errors with the others'
    for rep in reports[1:]:
        assert rep["fp32"] == reports[0]["fp32"]


def accounting_body(rank, world, intra_size):
    from torch.distributed.tensor.debug import CommDebugMode

    groups = mt.TreeGroups.build(intra_size=intra_size)
    b, sq, hq, hkv, d = 2, 1, 8, 2, 16
    results = {}
    for n_total in (64, 4096):
        torch.manual_seed(n_total)
        n_local = n_total // world
        q = torch.randn(b, sq, hq, d)
        k = torch.randn(b, n_local, hkv, d)
        for strategy in TREE_STRATEGIES[:-1]:
            # A strategy (or shape) different from the previous call's is checked across ranks
            # once (the agreement's own exchange, not merge traffic); count the steady state.
            mt.tree_decode(q, k, k, groups, strategy=strategy)
            stats = mt.CommStats()
            with CommDebugMode() as debug:
                mt.tree_decode(q, k, k, groups, strategy=strategy, stats=stats)
            results[(n_total, strategy)] = (stats.as_dict(), debug.get_total_counts())
    return results


@pytest.mark.parametrize("world,intra", [(4, 2), (8, 4)])
def test_accounting_matches_formulas(world, intra):
    b, sq, hq, d = 2, 1, 8, 16
    o_bytes, lse_bytes = 4 * b * sq * hq * d, 4 * b * hq * sq
    nodes = world // intra

    def ring(p, n):  # all-reduce of n bytes over p ranks, ring algorithm
        return 2 * (p - 1) * n // p

    reports = launch(accounting_body, world, intra)
    for res in reports:
        for n_total in (64, 4096):
            for strategy in TREE_STRATEGIES[:-1]:
                stats, counted = res[(n_total, strategy)]
                levels = stats["levels"]
                total = sum(l["collectives"] for l in levels.values())
                assert counted == total, f"{strategy}: CommDebugMode saw {counted} collectives, stats {total}"
                if strategy == "packed":
                    assert set(levels) == {"cp"} and levels["cp"]["collectives"] == 2
                    assert levels["cp"]["sent_bytes"] == ring(world, lse_bytes) + ring(world, o_bytes + lse_bytes)
                elif strategy == "allreduce3":
                    assert levels["cp"]["collectives"] == 3
                    # the paper's formula: 2(p-1)/p * (b*d + 2*b*n_h) elements
                    assert levels["cp"]["payload_bytes"] == o_bytes + 2 * lse_bytes
                    assert levels["cp"]["sent_bytes"] == 2 * ring(world, lse_bytes) + ring(world, o_bytes)
                elif strategy == "allgather":
                    assert levels["cp"]["collectives"] == 1
                    # the partial lse travels whole: float64, twice an fp32 lse's bytes
                    assert levels["cp"]["sent_bytes"] == (world - 1) * (o_bytes + 2 * lse_bytes)
                elif strategy == "two_level":
                    assert set(levels) == {"intra", "inter"}
                    assert levels["intra"]["collectives"] == levels["inter"]["collectives"] == 2
                    # across nodes: one packed buffer per rank, not one per intra-node peer
                    assert levels["inter"]["payload_bytes"] == lse_bytes + (o_bytes + lse_bytes)
                    assert levels["inter"]["sent_bytes"] == ring(nodes, lse_bytes) + ring(nodes, o_bytes + lse_bytes)
            # bytes per call do not depend on the cache length
            for strategy in TREE_STRATEGIES[:-1]:
                assert res[(64, strategy)] == res[(4096, strategy)]


def topology_body(rank, world):
    """Topology builders and their errors on 4 ranks (hosts: ranks 0,1 on 'a', 2,3 on 'b')."""
    from megatron_tree.distributed.topology import ENV_HOSTNAME, TopologyError

    out = {}

    def expect_error(fn):
        try:
            fn()
        except TopologyError as e:
            return str(e)
        return None

    # several CP groups side by side (CP=2 inside a TP=2 x CP=2 layout)
    side = mt.TreeGroups.build([[0, 2], [1, 3]])
    torch.manual_seed(10 + side.cp_ranks[0])  # each CP group has its own data
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    k = torch.randn(1, 10, 2, 8, dtype=torch.float64)
    lo, hi = (0, 3) if side.rank == 0 else (3, 10)
    got = mt.tree_decode(q, k[:, lo:hi], k[:, lo:hi], side, strategy="packed")
    out["side_by_side"] = (side.cp_ranks, float((got - reference.partial_attention(q, k, k)[0]).abs().max()))

    out["not_factor"] = expect_error(lambda: mt.TreeGroups.build(intra_size=3))
    os.environ[ENV_HOSTNAME] = "a" if rank < 2 else "b"
    out["real_hosts"] = mt.TreeGroups.build().describe()
    out["span_hosts"] = expect_error(lambda: mt.TreeGroups.build(intra_size=4))
    os.environ[ENV_HOSTNAME] = "a" if rank % 2 == 0 else "b"
    out["interleaved"] = expect_error(lambda: mt.TreeGroups.build())
    os.environ[ENV_HOSTNAME] = "a" if rank < 2 else "b"
    # a launcher variable that puts the two hosts' ranks on one node (before: one "intra" level of 4 across hosts)
    out["launcher_node_spans_hosts"] = expect_error(lambda: mt.TreeGroups.from_env(
        env={"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": str(rank)}))
    del os.environ[ENV_HOSTNAME]

    env = lambda **kw: {k: str(v) for k, v in kw.items()}  # noqa: E731
    out["torchrun"] = mt.TreeGroups.from_env(env=env(LOCAL_WORLD_SIZE=2, LOCAL_RANK=rank % 2)).describe()
    out["deepspeed"] = mt.TreeGroups.from_env(env=env(LOCAL_SIZE=4, LOCAL_RANK=rank)).describe()
    out["slurm"] = mt.TreeGroups.from_env(env=env(SLURM_NTASKS_PER_NODE="2(x2)", SLURM_LOCALID=rank % 2)).describe()
    out["simulated"] = mt.TreeGroups.from_env(intra_size=2, env=env(LOCAL_WORLD_SIZE=4)).describe()
    out["bad_local_size"] = expect_error(lambda: mt.TreeGroups.from_env(env=env(LOCAL_WORLD_SIZE=3)))
    out["bad_local_rank"] = expect_error(
        lambda: mt.TreeGroups.from_env(env=env(LOCAL_WORLD_SIZE=2, LOCAL_RANK=(rank + 1) % 2))
    )
    out["intra_too_big"] = expect_error(lambda: mt.TreeGroups.from_env(intra_size=4, env=env(LOCAL_WORLD_SIZE=2)))
    out["overlap"] = expect_error(lambda: mt.TreeGroups.build([[0, 1], [1, 2, 3]]))
    out["out_of_world"] = expect_error(lambda: mt.TreeGroups.build([0, 1, 2, 3, 4]))
    return out


def test_topology_builders_and_errors():
    reports = launch(topology_body, 4)
    for rank, out in enumerate(reports):
        cp_ranks, err = out["side_by_side"]
        assert cp_ranks == ((0, 2) if rank % 2 == 0 else (1, 3))
        assert err < 1e-12
        assert "does not factor the CP size 4" in out["not_factor"]
        assert out["real_hosts"]["intra_size"] == 2 and [l["size"] for l in out["real_hosts"]["levels"]] == [2, 2]
        assert "would span nodes" in out["span_hosts"] and "expected a divisor of 2" in out["span_hosts"]
        assert "visits node" in out["interleaved"]
        assert ("LOCAL_WORLD_SIZE=4 puts ranks 0..3 on one node, but they run on 2 hosts ('a': ranks [0, 1]; "
                "'b': ranks [2, 3])" in (out["launcher_node_spans_hosts"] or "")), out["launcher_node_spans_hosts"]
        assert out["torchrun"]["levels"] == [{"name": "intra", "size": 2}, {"name": "inter", "size": 2}]
        assert out["deepspeed"]["levels"] == [{"name": "intra", "size": 4}]
        assert out["slurm"]["num_nodes"] == 2
        assert out["simulated"]["intra_size"] == 2
        assert "not a multiple of the processes per node 3 (LOCAL_WORLD_SIZE=3)" in out["bad_local_size"]
        assert "ranks must be numbered node by node" in out["bad_local_rank"]
        assert "would span nodes" in out["intra_too_big"]
        assert "appears in more than one CP group" in out["overlap"]
        assert "outside the world of 4 ranks" in out["out_of_world"]


def dying_rank_body(rank, world):
    groups = mt.TreeGroups.build()
    q = torch.randn(1, 1, 4, 8)
    k = torch.randn(1, 5, 2, 8)
    mt.tree_decode(q, k, k, groups, strategy="packed")  # one good step
    if rank == world - 1:
        os._exit(3)  # dies mid-decode, without any cleanup
    start = time.monotonic()
    try:
        mt.tree_decode(q, k, k, groups, strategy="packed")
        mt.tree_decode(q, k, k, groups, strategy="two_level")
    except mt.CommError as e:
        return time.monotonic() - start, str(e)
    return time.monotonic() - start, None


def test_dead_rank_fails_others_within_timeout():
    pg_timeout = 15
    results = run_ranks(dying_rank_body, 3, pg_timeout=pg_timeout, timeout=120, expect_dead=(2,))
    assert results[2] is None
    for elapsed, message in results[:2]:
        assert message is not None, "surviving ranks must raise, not return"
        assert "peer rank may have died or timed out" in message
        assert elapsed < pg_timeout + 10
