"""``tree_decode(..., overlap=True)``: the batch in two halves, one half's merge in flight while
the other half's local attention computes -- exact, scheduled as claimed, and failing loudly;
``shifted`` too (one SUM per half, the MAX + SUM redo of the whole call when its check fails).

One 4-rank gloo launch serves every check: a flat CP group of 3 ranks (ranks 0-2; rank 3 alone)
and a 2 x 2 two-level group over all four. Each rank returns what it saw; the parent asserts.
The shards are test_tree_decode's: uneven, rank 1 of each group empty, one batch row with no
key on any rank, GQA/MQA, causal rows of different lengths, B = 3 (halves 2 + 1) and B = 2.
"""

import os
import time

import torch

import megatron_tree as mt
from megatron_tree.comm import merge as comm
from tests.helpers.ranks import run_ranks
from tests.helpers.cases import CASES, local_view, make_case, oracle

PG_TIMEOUT = 20


def _decode_pair(q, k, v, groups, strategy, kw, dtype=torch.float32):
    """(unsplit, split) results and what each issued: out, lse, CommStats, collectives counted by torch."""
    from torch.distributed.tensor.debug import CommDebugMode

    res = []
    for overlap in (False, True):
        mt.tree_decode(q.to(dtype), k.to(dtype), v.to(dtype), groups, strategy=strategy, overlap=overlap, **kw)
        stats = mt.CommStats()  # the steady state (a changed signature is checked once, through the store)
        with CommDebugMode() as debug:
            out, lse = mt.tree_decode(q.to(dtype), k.to(dtype), v.to(dtype), groups, strategy=strategy,
                                      overlap=overlap, return_lse=True, stats=stats, **kw)
        res.append((out, lse, stats.as_dict(), debug.get_total_counts()))
    return res


def _check_group(groups, tag, strategies, report):
    for name in CASES:
        q, k, v, lens, q_pos = make_case(name)
        cases = {name: (q, k, v, lens, q_pos)}
        if name == "gqa_ragged_sq1":  # B = 1: overlap falls back to the unsplit call
            cases["b1"] = (q[:1], k[:1], v[:1], lens[:1], None)
        for case, (q, k, v, lens, q_pos) in cases.items():
            want_out, want_lse = oracle(q, k, v, lens, q_pos)
            finite = torch.isfinite(want_lse)
            kl, vl, kw = local_view(q, k, v, lens, q_pos, groups.rank, groups.size)
            for strategy in strategies:
                (uo, ul, us, uc), (so, sl, ss, sc) = _decode_pair(q, kl, vl, groups, strategy, kw)
                report[(tag, case, strategy)] = {
                    "err_out": float((so.double() - want_out).abs().max()),
                    "err_lse": float((sl.double()[finite] - want_lse[finite]).abs().max()),
                    "inf_where_empty": bool(torch.equal(torch.isfinite(sl), finite)),
                    "vs_unsplit": max(float((so - uo).abs().max()), float((sl - ul)[finite].abs().max())),
                    "bitwise": bool(torch.equal(so, uo) and torch.equal(sl, ul)),
                    "stats": (us, ss), "counted": (uc, sc), "batch": q.shape[0],
                }
            if case == name == "gqa_ragged_sq1":  # float64 in, float64 partials and merge
                (_, _, _, _), (so, _, _, _) = _decode_pair(q, kl, vl, groups, strategies[0], kw, torch.float64)
                report[(tag, "fp64", strategies[0])] = {"err_out": float((so - want_out).abs().max()),
                                                        "dtype": str(so.dtype)}


def _check_shifted(groups, tag, report):
    """``shifted`` split in halves: exact for shifts in and out of range, one SUM per half when in range,
    the whole call redone with MAX + SUM when not (or the flag left for the caller with ``deferred``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    q, k, v, lens, q_pos = make_case("gqa_ragged_sq1")  # B = 3: halves of 2 and 1 rows; one empty row
    want_out, want_lse = oracle(q, k, v, lens, q_pos)
    kl, vl, kw = local_view(q, k, v, lens, q_pos, groups.rank, groups.size)
    args = (q.float(), kl.float(), vl.float(), groups)
    mt.tree_decode(*args, strategy="shifted", shift=want_lse.float(), overlap=True, **kw)  # signature check
    for delta in (0.0, 30.0, -200.0):
        stats = mt.CommStats()
        with CommDebugMode() as debug:
            out, lse = mt.tree_decode(*args, strategy="shifted", shift=(want_lse + delta).float(), overlap=True,
                                      return_lse=True, stats=stats, **kw)
        finite = torch.isfinite(want_lse)
        report[(tag, delta)] = {
            "err_out": float((out.double() - want_out).abs().max()),
            "err_lse": float((lse.double()[finite] - want_lse[finite]).abs().max()),
            "counted": debug.get_total_counts(), "ops": stats.as_dict()["levels"]["cp"]["ops"],
            "fallbacks": stats.fallbacks,
        }
    flags = []
    for delta in (-200.0, 0.0):
        mt.tree_decode(*args, strategy="shifted", shift=(want_lse + delta).float(), overlap=True, deferred=flags, **kw)
    report[(tag, "deferred")] = [bool(f) for f in flags]


def _schedule(groups):
    """What part 1's local attention sees of part 0's merge: started (torch counted it), finished (stats)."""
    from torch.distributed.tensor.debug import CommDebugMode

    seen = []
    stats = mt.CommStats()
    o = torch.randn(3, 1, 4, 8)
    lse = torch.randn(3, 4, 1)

    def local(rows):
        seen.append((debug.get_total_counts(), stats.collectives))
        return o[rows], lse[rows]

    with CommDebugMode() as debug:
        comm.merge_overlapped(local, [slice(0, 2), slice(2, 3)], tuple(o.shape), groups, "two_level", stats)
    return seen, stats.collectives


def overlap_body(rank, world):
    flat = mt.TreeGroups.build([[0, 1, 2], [3]])
    tree = mt.TreeGroups.build(intra_size=2)
    report = {}
    if rank < 3:
        _check_group(flat, "flat3", ("packed", "allreduce3", "allgather", "auto"), report)
        _check_shifted(flat, "flat3", report.setdefault("shifted", {}))
    _check_group(tree, "2x2", ("two_level", "packed"), report)
    _check_shifted(tree, "2x2", report.setdefault("shifted", {}))
    report["schedule"] = _schedule(tree)

    errors = {}
    try:
        mt.tree_decode(torch.randn(2, 1, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), tree,
                       strategy="bogus", overlap=True)
    except ValueError as e:
        errors["unknown"] = str(e)
    try:
        comm.merge_overlapped(None, [slice(0, 1), slice(1, 2)], (2, 1, 4, 8), tree, "bogus")
    except ValueError as e:
        errors["merge_bogus"] = str(e)
    # Bad input in the second half only: refused before any collective starts (on every rank).
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as debug:
        try:
            mt.tree_decode(torch.randn(2, 1, 4, 8), torch.randn(2, 3, 2, 8), torch.randn(2, 3, 2, 8), tree,
                           cache_seqlens=torch.tensor([3, 9], dtype=torch.int32), overlap=True)
            errors["bad_lens"] = None
        except ValueError as e:
            errors["bad_lens"] = (str(e), debug.get_total_counts())
    # Ranks that disagree on overlap (a shape none has used, so every rank checks at once).
    try:
        mt.tree_decode(torch.randn(4, 1, 4, 8), torch.randn(4, 3, 2, 8), torch.randn(4, 3, 2, 8), tree,
                       strategy="packed", overlap=rank == 0)
        errors["disagree"] = None
    except mt.DisagreementError as e:
        errors["disagree"] = str(e)
    report["errors"] = errors

    # A dead peer while both halves' collectives are in flight: CommError from the async wait.
    q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 5, 2, 8)
    mt.tree_decode(q, k, k, tree, strategy="packed", overlap=True)  # one good step
    if rank == world - 1:
        _assert_rank(report, rank)  # its report never reaches the parent: check it here
        os._exit(3)
    start = time.monotonic()
    try:
        mt.tree_decode(q, k, k, tree, strategy="packed", overlap=True)
        report["dead"] = (time.monotonic() - start, None)
    except mt.CommError as e:
        report["dead"] = (time.monotonic() - start, str(e))
    return report


def _assert_rank(report, rank):
    checked = 0
    for key, r in report.items():
        if not isinstance(key, tuple):
            continue
        tag, case, strategy = key
        checked += 1
        if case == "fp64":
            assert r["dtype"] == "torch.float64" and r["err_out"] <= 1e-12, f"rank {rank} {key}: {r}"
            continue
        assert r["err_out"] <= 1e-5 and r["err_lse"] <= 1e-5, f"rank {rank} {key}: {r}"
        assert r["inf_where_empty"], f"rank {rank} {key}: lse must be -inf exactly where no key is visible"
        # Same arithmetic row for row; only a sum's order may change with the buffer's length.
        assert r["vs_unsplit"] <= 1e-6, f"rank {rank} {key}: split differs from unsplit by {r['vs_unsplit']:.2e}"
        (us, ss), (uc, sc) = r["stats"], r["counted"]
        assert ss["calls"] == us["calls"] == 1, f"rank {rank} {key}: {ss['calls']} merge calls recorded"
        split = r["batch"] >= 2
        if tag == "2x2" and strategy == "two_level" or r["batch"] == 1:
            # every sum adds two terms (levels of 2 ranks), or nothing was split: bit for bit
            assert r["bitwise"], f"rank {rank} {key}: not bitwise equal to the unsplit call"
        for lvl, u in us["levels"].items():
            s = ss["levels"][lvl]
            assert s["collectives"] == (2 if split else 1) * u["collectives"], f"rank {rank} {key} {lvl}: {s} vs {u}"
            assert s["payload_bytes"] == u["payload_bytes"], f"rank {rank} {key} {lvl}: halves move the same bytes"
            assert {op: n // (2 if split else 1) for op, n in s["ops"].items()} == u["ops"]
        assert set(ss["levels"]) == set(us["levels"])
        assert sc == sum(l["collectives"] for l in ss["levels"].values()), f"rank {rank} {key}: torch saw {sc}"
        assert uc == sum(l["collectives"] for l in us["levels"].values())
    assert checked == (26 if rank < 3 else 9), f"rank {rank}: {checked} cases checked"
    seen, total = report["schedule"]
    # part 0's local ran before any collective; part 1's ran with part 0's four collectives
    # (intra MAX, SUM, inter MAX, SUM) started and all but the last (inter SUM) finished --
    # the overlap -- and then 8 collectives in all.
    assert seen == [(0, 0), (4, 3)] and total == 8, f"rank {rank}: schedule {seen}, {total} collectives"
    errors = report["errors"]
    assert "unknown merge strategy 'bogus'" in errors["unknown"], errors["unknown"]
    assert "an overlapped merge supports the strategies" in errors["merge_bogus"], errors["merge_bogus"]
    assert errors["bad_lens"] is not None and "cache_seqlens" in errors["bad_lens"][0], errors["bad_lens"]
    assert errors["bad_lens"][1] == 0, f"rank {rank}: bad input started {errors['bad_lens'][1]} collective(s)"
    assert errors["disagree"] is not None and "split" in errors["disagree"], errors["disagree"]
    shifted = report["shifted"]
    assert len(shifted) == (8 if rank < 3 else 4), f"rank {rank}: {sorted(shifted, key=str)}"
    for key, r in shifted.items():
        if key[1] == "deferred":
            assert r == [True, False], f"rank {rank} {key}: {r}"
            continue
        assert r["err_out"] <= 1e-5 and r["err_lse"] <= 1e-5, f"rank {rank} {key}: {r}"
        if key[1] == -200.0:  # both halves' SUMs, then the whole batch again with MAX + SUM
            assert r["ops"] == {"all_reduce_sum": 3, "all_reduce_max": 1} and r["fallbacks"] == 1, (key, r)
            assert r["counted"] == 4, f"rank {rank} {key}: torch saw {r['counted']} collectives"
        else:  # one SUM per half and nothing else
            assert r["ops"] == {"all_reduce_sum": 2} and r["fallbacks"] == 0, (key, r)
            assert r["counted"] == 2, f"rank {rank} {key}: torch saw {r['counted']} collectives"


def test_overlap_exact_scheduled_and_loud():
    reports = run_ranks(overlap_body, 4, pg_timeout=PG_TIMEOUT, timeout=240, expect_dead=(3,),
                        env={"MEGATRON_TREE_TRANSPORT": "backend"})  # (counts torch.distributed calls)
    assert reports[3] is None
    for rank, report in enumerate(reports[:3]):
        _assert_rank(report, rank)
        elapsed, message = report["dead"]
        assert message is not None, f"rank {rank}: a dead peer must raise, not return"
        assert "peer rank may have died or timed out" in message, message
        assert elapsed < 2 * PG_TIMEOUT + 10, f"rank {rank}: took {elapsed:.0f} s to notice the dead peer"
    # every rank returns the same answer
    for report in reports[1:3]:
        assert {k: v["err_out"] for k, v in report.items() if isinstance(k, tuple)} == \
            {k: v["err_out"] for k, v in reports[0].items() if isinstance(k, tuple)}


def test_overlap_cost_model():
    """cost.overlap_step_times: the staged merge adds up to merge_cost, and the replayed schedule
    hides half A's last collective behind half B's kernel only where lanes are separate."""
    from megatron_tree.comm import cost

    gpu, cpu = cost.load_preset("dgx_h100"), cost.load_preset("cpu_gloo")
    for preset in (gpu, cpu):
        for strategy, p, intra in (("packed", 8, None), ("allreduce3", 3, None), ("allgather", 8, None),
                                   ("two_level", 16, 8), ("two_level", 4, None), ("shifted", 8, None)):
            dims = cost.Dims(6, 32, 8, 128)
            stages, local = cost.merge_stages(strategy, preset, dims, p, intra)
            staged = sum(s for stage in stages for _, s in stage) + local
            whole = cost.merge_cost(strategy, preset, dims, p, intra, fallback=0.0)  # shifted: its common case
            assert abs(staged - whole) < 1e-12, (preset.name, strategy)
            unsplit, split = cost.overlap_step_times(strategy, preset, dims, p, intra, 4096)
            assert abs(unsplit - cost.kernel_time(preset, dims, 4096, p) - staged) < 1e-12
            if preset.shared_host:  # one lane: the split only adds kernel calls and collectives
                assert split > unsplit, (strategy, unsplit, split)
    # NCCL, bandwidth-bound merge (B=128, Hq=64, 2 nodes): half A's SUM hides behind half B's kernel
    unsplit, split = cost.overlap_step_times("packed", gpu, cost.Dims(128, 64, 8, 128), 16, None, 4096)
    assert split < 0.98 * unsplit, (unsplit, split)
    # latency-bound merge (B=4, Hq=8): twice the collectives, each as slow as the whole one
    unsplit, split = cost.overlap_step_times("packed", gpu, cost.Dims(4, 8, 8, 128), 8, None, 4096)
    assert split > 1.1 * unsplit, (unsplit, split)
    assert cost.overlap_step_times("packed", gpu, cost.Dims(1, 8, 8, 128), 8, None, 4096)[1] == \
        cost.overlap_step_times("packed", gpu, cost.Dims(1, 8, 8, 128), 8, None, 4096)[0]
    # The replayed order, by hand (not only the sum): packed halves A, B of 64 rows, separate lanes.
    # compute: kA | kB (after A's MAX is back) | A's local | B's local; cp lane: MAX_A, SUM_A, MAX_B, SUM_B.
    half = cost.Dims(64, 64, 8, 128)
    (max_stage, sum_stage), local = cost.merge_stages("packed", gpu, half, 16, None)
    k, m, s = cost.kernel_time(gpu, half, 4096, 16), max_stage[0][1], sum_stage[0][1]
    max_b_done = max(2 * k + m, k + m + s) + m  # B's MAX waits for B's kernel and for A's SUM on the lane
    a_local_done = max(k + m + s, max_b_done) + local
    want = max(max_b_done + s, a_local_done) + local
    got = cost.overlap_step_times("packed", gpu, cost.Dims(128, 64, 8, 128), 16, None, 4096)[1]
    assert abs(got - want) < 1e-12, (got, want)
