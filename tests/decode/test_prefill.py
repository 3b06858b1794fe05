"""Ring and all-gather CP prefill against single-process causal attention, on real gloo ranks.

One 4-rank run covers CP = 4, CP = 3 (beside a CP = 1 group) and CP = 2 x 2 groups, both
cache layouts, GQA, rows of different lengths (one so short that some ranks hold none of
it), and a one-row prompt of exactly P tokens (one per rank: the ring's "skip a block that
is all in the future" test sits on its boundary), in float64 so the comparison is tight.
"""

import itertools

import pytest
import torch

from tests.helpers.ranks import run_ranks
from megatron_tree.decode.cache import prefill_ranges
from megatron_tree.ops.reference import partial_attention

LENGTHS = [11, 2, 7]  # uneven shares; row 1 leaves some ranks of CP >= 3 empty
HQ, HKV, D = 4, 2, 8


def _global_inputs(lengths=LENGTHS):
    g = torch.Generator().manual_seed(0)
    n = max(lengths)
    q = torch.randn(len(lengths), n, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(len(lengths), n, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(len(lengths), n, HKV, D, generator=g, dtype=torch.float64)
    return q, k, v


def _reference(q, k, v, lengths=LENGTHS):
    """Single-process causal attention per row (each row alone, no padding)."""
    outs = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)[None]
        o, _ = partial_attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], q_positions=pos, k_positions=pos)
        outs.append(o[0])
    return outs


VARIANTS = dict(window=3, softcap=2.0)
DV = 5  # the values' head dim, unlike the keys' (MLA)


def _variant_reference(q, k, v, sinks, lengths=LENGTHS):
    """Single-process attention per row with a window of 3, soft-capping and one sink per head."""
    from megatron_tree.ops.reference import add_sink

    outs = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)[None]
        o, lse = partial_attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], q_positions=pos, k_positions=pos,
                                   **VARIANTS)
        outs.append(add_sink(o, lse, sinks)[0][0])
    return outs


def _local(t, positions):
    """This rank's tokens of t (B, N, H, D) at positions (B, S) (-1 = padding -> zeros)."""
    idx = positions.clamp(min=0)
    out = torch.gather(t, 1, idx[:, :, None, None].expand(-1, -1, t.shape[2], t.shape[3]))
    return out * (positions >= 0)[:, :, None, None]


def _rank_fn(rank, world):
    from megatron_tree.comm import CommStats
    from megatron_tree.decode.prefill import allgather_prefill, assemble_logits, ring_prefill
    from megatron_tree.distributed.topology import TreeGroups

    layouts = {
        "cp4": None,
        "cp3+cp1": [[0, 1, 2], [3]],
        "cp2x2": [[0, 1], [2, 3]],
    }
    worst, ops, assembled, variants = {}, {}, {}, {}
    for name, ranks in layouts.items():
        groups = TreeGroups.build(ranks)
        p, me = groups.size, groups.rank
        # LENGTHS, then one row of P tokens: one token per rank, so the block a rank skips
        # as "all in the future" is decided at its boundary (a key at the last query's position).
        for layout, lengths in itertools.product(("load_balanced", "contiguous"), (LENGTHS, [p])):
            q, k, v = _global_inputs(lengths)
            ref = _reference(q, k, v, lengths)
            plans = [prefill_ranges(n, p, layout)[me] for n in lengths]
            width = max(sum(e - s for s, e in prefill_ranges(n, p, layout)[r]) for n in lengths for r in range(p))
            # ranks pad differently on purpose (the functions pad keys to the CP-wide maximum)
            width = width + (me % 2)
            pos = torch.full((len(lengths), width), -1, dtype=torch.int64)
            for b, ranges in enumerate(plans):
                mine = [i for s, e in ranges for i in range(s, e)]
                pos[b, : len(mine)] = torch.tensor(mine, dtype=torch.int64)
            ql, kl, vl = _local(q, pos), _local(k, pos), _local(v, pos)
            for method, fn in (("ring", ring_prefill), ("allgather", allgather_prefill)):
                stats = CommStats()
                out = fn(ql, kl, vl, pos, pos, groups, stats=stats)
                case = f"{name}/{layout}/{lengths}/{method}"
                ops[case] = (p, stats.as_dict()["levels"])
                err = 0.0
                for b in range(len(lengths)):
                    valid = pos[b] >= 0
                    got = out[b, valid]
                    want = ref[b][pos[b, valid]]
                    err = max(err, float((got - want).abs().max()) if got.numel() else 0.0)
                    assert torch.all(out[b, ~valid] == 0)  # padded queries see nothing
                worst[case] = err
            # the one assembly of prefill logits: last token, every token (pads -> 0), a chosen set
            logits = torch.randn(len(lengths), width, 5, generator=torch.Generator().manual_seed(3))
            full = torch.randn(len(lengths), max(lengths), 5, generator=torch.Generator().manual_seed(4))
            local = torch.where(pos[..., None] >= 0, full.gather(1, pos.clamp(min=0)[..., None].expand(-1, -1, 5)),
                                logits)  # padding slots hold garbage: it must not leak in
            n = max(lengths)
            every = torch.stack([torch.where(torch.arange(n) < m, torch.arange(n), -1) for m in lengths])
            for what, wanted in (("last", torch.tensor(lengths)[:, None] - 1), ("all", every),
                                 ("set", torch.tensor([0, n - 1]))):
                stats = CommStats()
                got = assemble_logits(local, pos, wanted, groups, stats=stats)
                w = wanted if wanted.dim() == 2 else wanted[None].expand(len(lengths), -1)
                want = torch.where(w[..., None] >= 0, full.gather(1, w.clamp(min=0)[..., None].expand(-1, -1, 5)), 0.0)
                for b, m in enumerate(lengths):  # a position beyond a row's prompt is held by no rank: 0
                    want[b][w[b] >= m] = 0.0
                assembled[f"{name}/{layout}/{lengths}/{what}"] = (torch.equal(got, want), p, stats.as_dict()["levels"])
        # sliding window, soft-capping, sinks (joined once, after every block) and K/V of different
        # head dims, over the same uneven shards (row 1 leaves ranks empty)
        q, k, _ = _global_inputs()
        v = torch.randn(len(LENGTHS), max(LENGTHS), HKV, DV, generator=torch.Generator().manual_seed(7),
                        dtype=torch.float64)
        sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
        ref = _variant_reference(q, k, v, sinks)
        p, me = groups.size, groups.rank
        plans = [prefill_ranges(n, p, "load_balanced")[me] for n in LENGTHS]
        width = max(sum(e - s for s, e in prefill_ranges(n, p, "load_balanced")[r]) for n in LENGTHS for r in range(p))
        pos = torch.full((len(LENGTHS), width), -1, dtype=torch.int64)
        for b, ranges in enumerate(plans):
            mine = [i for s, e in ranges for i in range(s, e)]
            pos[b, : len(mine)] = torch.tensor(mine, dtype=torch.int64)
        for method, fn in (("ring", ring_prefill), ("allgather", allgather_prefill)):
            out = fn(_local(q, pos), _local(k, pos), _local(v, pos), pos, pos, groups, sinks=sinks, **VARIANTS)
            assert out.shape[-1] == DV
            err = 0.0
            for b in range(len(LENGTHS)):
                valid = pos[b] >= 0
                if valid.any():
                    err = max(err, float((out[b, valid] - ref[b][pos[b, valid]]).abs().max()))
            variants[f"{name}/{method}"] = err
        if name == "cp4":
            large = _large_and_bf16(groups, ring_prefill)
    return worst, ops, large, assembled, variants


def _large_and_bf16(groups, ring_prefill):
    """Large scores on the ring: fp32 rows whose scores are ~1e5 and -1e5 (exact in fp32, near
    ties on every rank) against fp64; and bf16 partials kept in fp32 until the end (one rounding:
    bitwise the fp32 ring's result rounded to bf16)."""
    from benchmarks import precision

    p, me, n = groups.size, groups.rank, 16
    q, k, v, _ = precision.large_score_inputs([1e5, -1e5], [n, n], sq=n, hq=4, hkv=2)
    pos = torch.arange(n)[None].expand(2, n)
    want, _ = partial_attention(q, k, v, q_positions=pos, k_positions=pos)
    (lo, hi), = prefill_ranges(n, p, "contiguous")[me]
    mine = pos[:, lo:hi]
    out = ring_prefill(q[:, lo:hi].float(), k[:, lo:hi].float(), v[:, lo:hi].float(), mine, mine, groups)
    g = torch.Generator().manual_seed(1)
    qb, kb, vb = (torch.randn(2, n, h, 16, generator=g)[:, lo:hi].bfloat16() for h in (4, 2, 2))
    bf16 = ring_prefill(qb, kb, vb, mine, mine, groups)
    once = ring_prefill(qb.float(), kb.float(), vb.float(), mine, mine, groups).bfloat16()
    return float((out.double() - want[:, lo:hi]).abs().max()), torch.equal(bf16, once)


def test_ring_and_allgather_prefill_equal_single_process():
    results = run_ranks(_rank_fn, 4, timeout=240)
    for rank, (worst, ops, (large_err, bf16_once), assembled, variants) in enumerate(results):
        assert len(variants) == 3 * 2
        for case, err in variants.items():
            assert err < 1e-12, f"rank {rank} {case}: window/softcap/sinks/Dv prefill off by {err}"
        assert len(assembled) == 3 * 2 * 2 * 3
        for case, (exact, p, levels) in assembled.items():
            assert exact, f"rank {rank} {case}: assembled prefill logits are not bitwise the unsharded ones"
            # one all-reduce SUM (the owner's logits, zeros elsewhere), none without a CP group
            assert levels == ({} if p == 1 else {"cp": levels["cp"]}), case
            if p > 1:
                assert levels["cp"]["ops"] == {"all_reduce_sum": 1}, case
        assert large_err <= 1e-5, f"rank {rank}: ring prefill at |scores| ~1e5 off by {large_err:.2e} > 1e-5"
        assert bf16_once, f"rank {rank}: bf16 ring prefill rounded its partials before the merge"
        assert len(worst) == 3 * 2 * 2 * 2
        for case, err in worst.items():
            assert err < 1e-12, f"rank {rank} {case}: max error {err}"
        # collectives are counted, not assumed: one exchange of shapes and lengths, then
        # ring = P-1 rounds of three messages (k, v, positions) each
        for case, (p, levels) in ops.items():
            if p == 1:
                assert levels == {}, case
            elif case.endswith("ring"):
                assert levels["cp"]["ops"] == {"all_gather": 1, "send": 3 * (p - 1)}, case
            else:
                assert levels["cp"]["ops"] == {"all_gather": 1 + 3}, case


def test_single_process_prefill_is_plain_causal_attention():
    from megatron_tree.decode.prefill import allgather_prefill, cp_prefill, ring_prefill

    q, k, v = _global_inputs()
    ref = _reference(q, k, v)
    n = max(LENGTHS)
    pos = torch.stack([torch.where(torch.arange(n) < m, torch.arange(n), -1) for m in LENGTHS])
    for fn in (ring_prefill, allgather_prefill):
        out = fn(q, k, v, pos, pos, None)
        for b, m in enumerate(LENGTHS):
            torch.testing.assert_close(out[b, :m], ref[b], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="unknown prefill method 'zigzag'"):
        cp_prefill(q, k, v, pos, pos, None, method="zigzag")


# --------------------------------------------------------------------------- fp32 on the fused kernels

FP32_LENGTHS = [37, 5, 64]  # none divisible by 2, 3 or 4 * 2 except 64; row 1 leaves ranks empty
FP32_HQ, FP32_HKV, FP32_D = 6, 2, 16
BALANCE_LEN = 301  # one causal prompt whose per-rank work is counted


def _fp32_rank_fn(rank, world):
    from megatron_tree.decode.prefill import PrefillWork, allgather_prefill, ring_prefill
    from megatron_tree.distributed.topology import TreeGroups

    layouts = {
        "cp2": ([[0, 1], [2, 3]], None),
        "cp3+cp1": ([[0, 1, 2], [3]], None),
        "cp4=2x2": (None, 2),  # one CP group of 4 over two simulated nodes of 2
    }
    g = torch.Generator().manual_seed(5)
    n = max(FP32_LENGTHS)
    q = torch.randn(len(FP32_LENGTHS), n, FP32_HQ, FP32_D, generator=g, dtype=torch.float64)
    k = torch.randn(len(FP32_LENGTHS), n, FP32_HKV, FP32_D, generator=g, dtype=torch.float64)
    v = torch.randn(len(FP32_LENGTHS), n, FP32_HKV, FP32_D, generator=g, dtype=torch.float64)
    ref = _reference(q, k, v, FP32_LENGTHS)
    gb = torch.Generator().manual_seed(6)
    qb, kb, vb = (torch.randn(1, BALANCE_LEN, h, FP32_D, generator=gb) for h in (FP32_HQ, FP32_HKV, FP32_HKV))
    worst, counts = {}, {}
    for name, (ranks, intra) in layouts.items():
        groups = TreeGroups.build(ranks, intra_size=intra)
        p, me = groups.size, groups.rank
        for layout in ("load_balanced", "contiguous"):
            plans = [prefill_ranges(m, p, layout)[me] for m in FP32_LENGTHS]
            width = max(sum(e - s for s, e in prefill_ranges(m, p, layout)[r]) for m in FP32_LENGTHS
                        for r in range(p)) + (me % 2)  # uneven padding across ranks
            pos = torch.full((len(FP32_LENGTHS), width), -1, dtype=torch.int64)
            for b, ranges in enumerate(plans):
                mine = [i for s, e in ranges for i in range(s, e)]
                pos[b, : len(mine)] = torch.tensor(mine, dtype=torch.int64)
            ql, kl, vl = (_local(t, pos).float() for t in (q, k, v))
            for method, fn in (("ring", ring_prefill), ("allgather", allgather_prefill)):
                work = PrefillWork()
                out = fn(ql, kl, vl, pos, pos, groups, work=work)
                err = 0.0
                for b in range(len(FP32_LENGTHS)):
                    valid = pos[b] >= 0
                    got, want = out[b, valid].double(), ref[b][pos[b, valid]]
                    err = max(err, float((got - want).abs().max()) if got.numel() else 0.0)
                    assert torch.all(out[b, ~valid] == 0)
                worst[f"{name}/{layout}/{method}"] = (err, out.dtype == torch.float32, dict(work.kernels))
            # the work of one causal prompt, counted on each rank
            (mine,) = [[i for s, e in prefill_ranges(BALANCE_LEN, p, layout)[me] for i in range(s, e)]]
            bp = torch.tensor(mine, dtype=torch.int64)[None]
            work = PrefillWork()
            ring_prefill(qb[:, bp[0]], kb[:, bp[0]], vb[:, bp[0]], bp, bp, groups, work=work)
            counts[f"{name}/{layout}"] = (p, work.pairs, work.blocks, work.skipped, work.compute_s, work.wait_s)
    return worst, counts


def test_fp32_ring_on_fused_kernels_is_exact_and_balanced():
    """fp32 ring and all-gather prefill on the fused CPU kernel within 1e-5 of fp64 single-process
    attention (CP 2, 3 and 2 x 2, both layouts, GQA, ragged and padded rows, lengths not divisible
    by CP); the causal work of a prompt, counted on every rank, is balanced by the load-balanced
    layout (and visibly not by the contiguous one, so the count can fail)."""
    results = run_ranks(_fp32_rank_fn, 4, timeout=300)
    for rank, (worst, _) in enumerate(results):
        assert len(worst) == 3 * 2 * 2
        for case, (err, fp32, kernels) in worst.items():
            assert fp32, case
            assert err <= 1e-5, f"rank {rank} {case}: max error {err:.2e} > 1e-5"
            assert set(kernels) <= {"cpu_flash"}, f"rank {rank} {case}: ran {kernels}, expected the fused CPU kernel"
    for case in results[0][1]:
        rows = [r[1][case] for r in results if case in r[1]]
        p = rows[0][0]
        group = rows[:p] if not case.startswith("cp3") else rows[:3]
        pairs = [row[1] for row in group]
        assert sum(pairs) == BALANCE_LEN * (BALANCE_LEN + 1) // 2, (case, pairs)  # every pair exactly once
        spread = (max(pairs) - min(pairs)) / (sum(pairs) / len(pairs))
        if case.endswith("load_balanced"):
            assert spread <= 0.10, f"{case}: per-rank attention work {pairs} differs by {spread:.1%} > 10%"
            assert all(row[3] == 0 for row in group), case  # every rank's tail chunk sees every block
        else:
            assert spread > 0.5, f"{case}: contiguous chunks should be unbalanced, got {pairs}"
            # rank r skips the P-1-r blocks after its own, and attends the rest
            assert [row[3] for row in group] == [p - 1 - r for r in range(p)], (case, [row[3] for row in group])
        assert all(row[2] + row[3] == p for row in group), case
        assert all(row[4] > 0 and row[5] >= 0 for row in group), case


def test_cuda_dispatch_of_a_prefill_step_without_a_gpu(monkeypatch):
    """Which kernel each piece of a prefill step launches on CUDA, asserted on CPU tensors: the CUDA
    launchers are replaced by recorders that compute with the CPU kernel (same contract), so the
    dispatch -- flash for causal and unmasked pieces, memory-efficient for masked (ragged) ones, the
    exact decode path for a piece past the float32 lse bound -- is what the fused prefill decides."""
    from megatron_tree.ops import fused_prefill
    from megatron_tree.decode.prefill import PrefillWork, ring_prefill

    launched = []
    for name in ("cuda_flash", "cuda_efficient", "flash_attn"):
        def record(q, k, v, scale, causal, mask, name=name):
            launched.append((name, causal, mask is not None))
            return fused_prefill._cpu_flash(q, k, v, scale, causal, mask)
        monkeypatch.setitem(fused_prefill._LAUNCH, name, record)

    assert fused_prefill.select_kernel("cuda", torch.bfloat16, 64, flash_attn_importable=False,
                                       capability=(8, 0)) == "cuda_flash"
    assert fused_prefill.select_kernel("cuda", torch.float32, 64) == "cuda_efficient"
    # the one choice also routes what no fused kernel takes to the exact path, on every device
    for device in ("cpu", "cuda"):
        assert fused_prefill.select_kernel(device, torch.bfloat16, 64, window=8) == "decode"
        assert fused_prefill.select_kernel(device, torch.bfloat16, 64, softcap=30.0) == "decode"
        assert fused_prefill.select_kernel(device, torch.bfloat16, 192, head_dim_v=128) == "decode"  # MLA
        assert fused_prefill.select_kernel(device, torch.bfloat16, 64, head_dim_v=64) != "decode"
    g = torch.Generator().manual_seed(2)
    n = 48
    q, k, v = (torch.randn(1, n, h, 16, generator=g) for h in (4, 2, 2))
    # one rank's load-balanced share at CP 2 (chunks 0 and 3 of 4) over the whole prompt's keys
    (a, b), (c, d) = prefill_ranges(n, 2, "load_balanced")[0]
    qpos = torch.cat([torch.arange(a, b), torch.arange(c, d)])[None]
    kpos = torch.arange(n)[None]
    want, _ = partial_attention(q.double(), k.double(), v.double(), q_positions=kpos, k_positions=kpos)
    for kernel in ("cuda_flash", "flash_attn"):
        launched.clear()
        work = PrefillWork()
        out = ring_prefill(q[:, qpos[0]], k, v, qpos, kpos, None, kernel=kernel, work=work)
        assert float((out.double() - want[:, qpos[0]]).abs().max()) <= 1e-5
        assert launched and {name for name, _, _ in launched} == {kernel}, launched
        assert all(not masked for _, _, masked in launched), launched  # flash takes no mask: none needed
        assert any(causal for _, causal, _ in launched), launched
        assert work.kernels == {kernel: len(launched)}
    # an irregular position set needs explicit masks: those pieces go to the memory-efficient kernel
    launched.clear()
    work = PrefillWork()
    perm = torch.randperm(n, generator=g)[:20].sort().values
    out = ring_prefill(q[:, perm], k, v, perm[None], kpos, None, kernel="cuda_flash", work=work)
    want, _ = partial_attention(q.double(), k.double(), v.double(), q_positions=kpos, k_positions=kpos)
    assert float((out.double() - want[:, perm]).abs().max()) <= 1e-5
    assert ("cuda_efficient", False, True) in launched, launched
    # past the float32 lse bound a CUDA kernel cannot take the shifted pass: the exact decode path
    launched.clear()
    work = PrefillWork()
    big = q * 40.0
    out = ring_prefill(big, k, v, kpos, kpos, None, kernel="cuda_flash", work=work)
    want, _ = partial_attention(big.double(), k.double(), v.double(), q_positions=kpos, k_positions=kpos)
    assert float((out.double() - want).abs().max()) <= 1e-5
    assert work.kernels.get("decode", 0) >= 1 and work.kernels.get("cuda_flash", 0) >= 1, work.kernels


def _fail_then_retry(rank, world):
    import datetime

    import megatron_tree as mt
    from megatron_tree.decode import prefill

    groups = mt.TreeGroups.build(timeout=datetime.timedelta(seconds=20))
    n = 12
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, n, h, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    pos = torch.arange(n)[None].expand(2, n)
    (lo, hi), = prefill_ranges(n, world, "contiguous")[groups.rank]
    mine = pos[:, lo:hi]
    local = prefill._local

    def failing(*args, **kwargs):
        raise MemoryError("the local attention ran out of memory")  # the same on every rank, after round 0 posted

    prefill._local = failing
    try:
        prefill.ring_prefill(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], mine, mine, groups)
        failed = None
    except MemoryError as e:
        failed = str(e)
    finally:
        prefill._local = local
    out = prefill.ring_prefill(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], mine, mine, groups)  # the next call
    want, _ = partial_attention(q, k, v, q_positions=pos, k_positions=pos)
    return failed, float((out - want[:, lo:hi]).abs().max())


def test_a_ring_prefill_that_fails_alike_on_every_rank_leaves_the_next_call_in_step():
    """The local attention raising on every rank (e.g. out of memory) after a round's blocks are posted: the error
    reaches the caller, and the next ring prefill on the same groups runs exact instead of meeting the old round's
    messages and timing out."""
    for failed, err in run_ranks(_fail_then_retry, 3, timeout=120):
        assert failed == "the local attention ran out of memory"
        assert err < 1e-12, err
