"""Baselines (ring, pass-Q ring, all-gather-KV) are exact: equal to the single-device reference
and to tree_decode on the same shards, identical on every rank, with the traffic they claim."""

import torch

from tests.helpers.ranks import run_ranks

# (shard lengths per rank, cache_seqlens per rank) for P=3, batch 2: uneven, one empty shard,
# ragged rows (row 1 of rank 0 has fewer valid keys than row 0; rank 2 row 0 is empty).
LENS = (7, 0, 5)
SEQLENS = ((7, 4), (0, 0), (0, 5))
B, SQ, D = 2, 2, 16


def _shard(rank, hkv, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    n = LENS[rank]
    k = torch.randn(B, n, hkv, D, generator=g, dtype=dtype)
    v = torch.randn(B, n, hkv, D, generator=g, dtype=dtype)
    return k, v, torch.tensor(SEQLENS[rank], dtype=torch.int32)


def _query(hq, dtype):
    return torch.randn(B, SQ, hq, D, generator=torch.Generator().manual_seed(7), dtype=dtype)


def _oracle(hq, hkv, dtype):
    """Reference attention row by row over the concatenation of every shard's valid keys."""
    from megatron_tree.ops import reference

    q = _query(hq, dtype)
    shards = [_shard(r, hkv, dtype) for r in range(len(LENS))]
    outs, lses = [], []
    for b in range(B):
        k = torch.cat([s[0][b, : s[2][b]] for s in shards])[None]
        v = torch.cat([s[1][b, : s[2][b]] for s in shards])[None]
        o, l = reference.partial_attention(q[b : b + 1], k, v)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _np(pair):
    """Tensors as numpy arrays: torch tensors through the harness queue use shared-memory
    handles that vanish when the rank exits."""
    return tuple(t.numpy() for t in pair)


def _cases_on_rank(rank, world):
    from megatron_tree import CommStats, TreeGroups, tree_decode
    from megatron_tree.comm.baselines import ShardPlan, allgather_kv_decode, passq_ring_decode, ring_decode

    groups = TreeGroups.build()
    results = {}
    for hq, hkv, dtype in ((4, 4, torch.float64), (8, 2, torch.float64), (8, 2, torch.float32)):
        q = _query(hq, dtype)
        k, v, seq = _shard(rank, hkv, dtype)
        plan = ShardPlan.build(k, groups)
        tree = tree_decode(q, k, v, groups, cache_seqlens=seq, strategy="packed", return_lse=True)
        res = {"tree": _np(tree)}
        for name, fn in (("ring", ring_decode), ("passq_ring", passq_ring_decode), ("allgather_kv", allgather_kv_decode)):
            stats = CommStats()
            for _ in range(2):  # the second step reuses the plan's workspaces
                out = fn(q, k, v, groups, plan=plan, cache_seqlens=seq, return_lse=True, stats=stats)
            res[name] = _np(out)
            res[name + "_stats"] = stats.as_dict()
        res["plan_lengths"] = plan.lengths
        results[(hq, hkv, str(dtype))] = res
    # Rows whose scores are ~1e5, -1e5 and 1e4 (exact in fp32, near ties on every
    # shard; rank 1 empty): every baseline merges partials whose lse must travel whole (float64).
    from megatron_tree.ops import reference
    from benchmarks import precision

    qg, kg, vg, lens = precision.large_score_inputs([1e5, -1e5, 1e4], [30, 30, 26], hq=4, hkv=2)
    lo, hi = (0, 13, 13, 30)[rank: rank + 2]
    kl, vl = kg[:, lo:hi].float(), vg[:, lo:hi].float()
    seq = (lens - lo).clamp(0, hi - lo).to(torch.int32)
    plan = ShardPlan.build(kl, groups)
    baselines = (("ring", ring_decode), ("passq_ring", passq_ring_decode), ("allgather_kv", allgather_kv_decode))
    want, want_lse = reference.partial_attention(qg, kg, vg, cache_seqlens=lens)
    results["large"] = {}
    for name, fn in baselines:  # the merged lse returned whole on request, as tree_decode does
        out, lse = fn(qg.float(), kl, vl, groups, plan=plan, cache_seqlens=seq, return_lse=True,
                      lse_dtype=torch.float64)
        fin = torch.isfinite(want_lse)
        assert lse.dtype == torch.float64 and torch.equal(torch.isfinite(lse), fin), name
        results["large"][name] = max(float((out.double() - want).abs().max()),
                                     float((lse[fin] - want_lse[fin]).abs().max()))
    # A stale plan is refused with a message naming the fix.
    try:
        ring_decode(q, k[:, :0], v[:, :0], groups, plan=ShardPlan((1, 1, 1), rank))
        results["stale"] = None
    except ValueError as e:
        results["stale"] = str(e)
    return results


def test_baselines_exact_p3_uneven_empty_gqa_ragged():
    per_rank = run_ranks(_cases_on_rank, 3, timeout=120)
    p = 3
    for key, res0 in per_rank[0].items():
        if key in ("stale", "large"):
            continue
        hq, hkv, dtype_name = key
        dtype = torch.float64 if "64" in dtype_name else torch.float32
        ref_o, ref_l = _oracle(hq, hkv, dtype)
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for rank in range(p):
            res = per_rank[rank][key]
            assert res["plan_lengths"] == LENS
            for name in ("tree", "ring", "passq_ring", "allgather_kv"):
                o, l = (torch.from_numpy(a) for a in res[name])
                assert o.dtype == dtype and o.shape == (B, SQ, hq, D), (name, o.dtype, o.shape)
                torch.testing.assert_close(o, ref_o, atol=tol, rtol=tol, msg=f"{name} out {key} rank {rank}")
                torch.testing.assert_close(l.to(ref_l.dtype), ref_l, atol=tol, rtol=tol, msg=f"{name} lse {key}")
                # every rank gets bit-identical outputs (merged in shard order)
                assert (res[name][0] == per_rank[0][key][name][0]).all(), (name, rank)
            # traffic per rank, 2 calls: exact byte counts
            el = torch.tensor([], dtype=dtype).element_size()
            ring = res["ring_stats"]["levels"]["cp"]
            my_sent = sum(B * LENS[(rank - h) % p] * hkv * D * el * 2 + B * 4 for h in range(p - 1))
            assert ring["sent_bytes"] == 2 * my_sent, (rank, ring)
            assert ring["collectives"] == 2 * 3 * (p - 1)
            passq = res["passq_ring_stats"]["levels"]["cp"]
            acc = 8 if dtype == torch.float64 else 4
            state = B * SQ * hq * D * acc + B * hq * SQ * 8  # the partial lse travels in float64
            assert passq["sent_bytes"] == 2 * (p - 1) * state
            assert passq["collectives"] == 2 * (p - 1)
            ag = res["allgather_kv_stats"]["levels"]["cp"]
            payload = 2 * B * max(LENS) * hkv * D * el + B * 4
            assert ag["payload_bytes"] == 2 * payload and ag["sent_bytes"] == 2 * (p - 1) * payload
            assert ag["ops"] == {"all_gather": 6}
    assert "rebuild the plan" in per_rank[0]["stale"]
    for rank in range(p):
        for name, err in per_rank[rank]["large"].items():
            assert err <= 1e-5, f"rank {rank} {name} at |scores| ~1e5: output error {err:.2e} > 1e-5"
