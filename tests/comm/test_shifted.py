"""``strategy="shifted"``: one all-reduce SUM per merge, exact whatever the shift, on real gloo ranks.

One 8-process launch runs every check, on CP groups of 2, 3, 2 x 2 and 2 x 4 built side
by side (every rank is in one group of each layout; a layout's leftover ranks form a smaller
group that runs the same checks): shifts equal to, 30 above/below and 200 above/below the true lse, with uneven shards (rank 1
holds no keys), a batch row with no key on any rank, a dominant shard, GQA, a causal
multi-token query and rows whose scores are ~1e5 and -1e5; collectives are counted with torch's ``CommDebugMode`` (independently of
``CommStats``). The 2 x 2 groups also generate with a 2-layer transformers Llama (``HFTreeModel``)
and check the tokens against unmodified transformers' and the merge collectives of every decode
step, and drive a decode step whose deferred flag is raised (the redo path). The parent asserts
on what ranks return.
"""

import pytest
import torch

import megatron_tree as mt
from megatron_tree.comm import merge as comm
from megatron_tree.ops import reference
from benchmarks import precision
from tests.helpers.ranks import run_ranks

HEAD_DIM = 16
DELTAS = (0.0, 30.0, -30.0, 200.0, -200.0)  # shift - true lse
IN_RANGE = (0.0, 30.0, -30.0)
# name: (row lengths, seqlen_q, Hq, Hkv, causal, dominant rank or None)
CASES = {
    "gqa_empty_row": ([37, 0, 20], 1, 4, 2, False, None),
    "causal_sq2_dominant": ([29, 13], 2, 4, 1, True, 0),
    # scores ~1e5, -1e5 (exact in fp32; bench.precision.large_score_inputs)
    "large_scores": ([33, 24], 1, 4, 2, False, None),
}


def _bounds(n, world):
    return precision.uneven_cuts(n, world, empty=1 if world > 1 else None)  # rank 1 holds no keys


def _case(name, world):
    lengths, sq, hq, hkv, causal, dominant = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    b, n = len(lengths), max(lengths)
    q = torch.randn(b, sq, hq, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, hkv, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, hkv, HEAD_DIM, generator=g, dtype=torch.float64)
    if name == "large_scores":
        q, k, v, _ = precision.large_score_inputs([1e5, -1e5], lengths, sq, hq, hkv, seed=3)
    cuts = _bounds(n, world)
    if dominant is not None:  # one shard's scores ~6x larger: the others' weights are ~e^-40 of it
        k[:, cuts[dominant]:cuts[dominant + 1]] *= 6
    q, k, v = (t.float().double() for t in (q, k, v))  # fp32-representable: the oracle sees our inputs
    lens = torch.tensor(lengths, dtype=torch.int32)
    q_pos = (lens[:, None] - sq + torch.arange(sq)[None, :]).long() if causal else None
    return q, k, v, lens, q_pos, cuts


def _collectives(fn):
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as debug:
        res = fn()
    return res, debug.get_total_counts()


def exactness_body(groups):
    rank, world = groups.rank, groups.size
    rep = {"world": world, "group": list(groups.cp_ranks)}
    for name in CASES:
        q, k, v, lens, q_pos, cuts = _case(name, world)
        kw_full = {"cache_seqlens": lens}
        if q_pos is not None:
            kw_full.update(q_positions=q_pos, k_positions=torch.arange(k.shape[1]))
        want_out, want_lse = reference.partial_attention(q, k, v, **kw_full)  # fp64, unsharded
        lo, hi = cuts[rank], cuts[rank + 1]
        kw = {"cache_seqlens": (lens - lo).clamp(0, hi - lo).to(torch.int32)}
        if q_pos is not None:
            kw.update(q_positions=q_pos, k_positions=torch.arange(lo, hi))
        ql, kl, vl = q.float(), k[:, lo:hi].float(), v[:, lo:hi].float()
        finite = torch.isfinite(want_lse)
        # warm call: the cross-rank agreement on the signature (store traffic, not a collective)
        mt.tree_decode(ql, kl, vl, groups, strategy="shifted", shift=want_lse.float(), return_lse=True, **kw)
        for delta in DELTAS:
            shift = (want_lse + delta).float()  # -inf stays -inf on the empty row
            stats = mt.CommStats()
            (out, lse), count = _collectives(lambda: mt.tree_decode(
                ql, kl, vl, groups, strategy="shifted", shift=shift, return_lse=True, stats=stats, **kw))
            assert torch.equal(torch.isfinite(lse), finite) and not torch.isnan(out).any()
            rep[(name, delta)] = {
                "err_out": float((out.double() - want_out).abs().max()),
                # beyond the float32 rounding of the returned lse itself (4e-3 at 1e5)
                "err_lse": float(((lse.double()[finite] - want_lse[finite]).abs()
                                  - precision.lse_tolerance(want_lse[finite]) + 1e-5).max()),
                "count": count, "stats_collectives": stats.collectives, "fallbacks": stats.fallbacks,
                "bits": (out.tolist(), lse.tolist()),  # compared across ranks: bitwise identical
            }
        # the deferred form: no host check, the flag is left on the device for the caller
        flags = []
        mt.tree_decode(ql, kl, vl, groups, strategy="shifted", shift=(want_lse - 200).float(), deferred=flags, **kw)
        mt.tree_decode(ql, kl, vl, groups, strategy="shifted", shift=want_lse.float(), deferred=flags, **kw)
        rep[(name, "deferred")] = [bool(f) for f in flags]
    return rep


def _check_exactness(reports, world):
    for rank, rep in enumerate(reports):
        assert rep["world"] == world
        for name in CASES:
            for delta in DELTAS:
                r = rep[(name, delta)]
                where = f"world {world} rank {rank} {name} shift {delta:+}"
                assert r["err_out"] <= 1e-5 and r["err_lse"] <= 1e-5, (where, r["err_out"], r["err_lse"])
                if delta in IN_RANGE:  # one SUM, and the all-empty row did not force a redo
                    assert r["count"] == 1 and r["fallbacks"] == 0, (where, r["count"])
                else:  # the SUM, then MAX + SUM
                    assert r["count"] == 3 and r["fallbacks"] == 1, (where, r["count"])
                assert r["stats_collectives"] == r["count"], where
                assert r["bits"] == reports[0][(name, delta)]["bits"], f"{where}: ranks differ"
            assert rep[(name, "deferred")] == [True, False], (world, rank, name)


def world2_extra(groups):
    """Bad shifts fail clearly: wrong shape before any collective; ranks that disagree on having one."""
    rank = groups.rank
    q, k = torch.randn(2, 1, 4, HEAD_DIM), torch.randn(2, 5, 2, HEAD_DIM)
    msgs = []
    try:
        mt.tree_decode(q, k, k, groups, strategy="shifted", shift=torch.zeros(2, 1, 4))
    except ValueError as e:
        msgs.append(str(e))
    mt.tree_decode(q, k, k, groups, strategy="allgather")
    try:
        mt.tree_decode(q, k, k, groups, strategy="shifted", shift=torch.zeros(2, 4, 1) if rank == 0 else None)
    except mt.DisagreementError as e:
        msgs.append(str(e))
    # a NaN partial lse on one rank (the other rank's is finite, so the row counts as nonempty)
    # makes the all-reduced denominator NaN: that row is NaN at any shift, so it is answered NaN
    # and not flagged for a redo (packed would give the same NaN)
    o, lse = mt.flash_decode(q, k, k)
    if rank % 2 == 0:
        lse[0, 0, 0] = float("nan")
    flags = []
    out, merged = comm.merge(o.float(), lse, groups, "shifted", None, dtype=q.dtype, shift=torch.zeros(2, 4, 1),
                             deferred=flags)
    msgs.append((bool(torch.stack(flags).any()), bool(torch.isnan(out[0, 0, 0]).all() and torch.isnan(merged[0, 0, 0])),
                 int(torch.isnan(merged).sum())))
    return msgs


LAYOUTS = {  # name -> (CP rank lists, intra_size)
    "2": ([[0, 1], [2, 3], [4, 5], [6, 7]], None),
    "3": ([[0, 1, 2], [3, 4, 5], [6, 7]], None),
    "2x2": ([[0, 1, 2, 3], [4, 5, 6, 7]], 2),
    "2x4": (None, 4),
}


def run_all(rank, world, path):
    out = {}
    for name, (ranks, intra) in LAYOUTS.items():
        groups = mt.TreeGroups.build(ranks, intra)
        out[name] = {"exact": exactness_body(groups), "levels": [(l.name, l.size) for l in groups.levels]}
        if name == "2":
            out[name]["extra"] = world2_extra(groups)
        if name == "2x2":
            out[name]["generate"] = generate_body(groups, path)
    return out


# --------------------------------------------------------------------------- generate at CP 2 x 2


def generate_body(groups, path):
    import torch.distributed as dist

    from megatron_tree.decode.generate import GenerationHook, StepRunner, generate
    from megatron_tree.integrations.hf import load_hf_model
    from tests.helpers.hf_models import NEW_TOKENS, PROMPTS

    model = load_hf_model(path, groups)

    class Count(GenerationHook):
        """Collectives of each decode forward, counted by wrapping torch.distributed's functions
        (independent of CommStats; CommDebugMode's module tracker does not follow the model's
        decode path). The token broadcast comes after ``after_step``."""

        NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce_scatter")

        def __init__(self):
            self.per_step, self.stats, self.saved = [], [], {}

        def before_step(self, step):
            self.n = 0
            for name in self.NAMES:
                fn = self.saved[name] = getattr(dist, name)

                def counted(*a, _fn=fn, **k):
                    self.n += 1
                    return _fn(*a, **k)
                setattr(dist, name, counted)
            self.stats.append(mt.CommStats())
            return self.stats[-1]

        def after_step(self, step, logits):
            for name, fn in self.saved.items():
                setattr(dist, name, fn)
            self.per_step.append(self.n)

    hook = Count()
    prompts = PROMPTS + [[77]]  # a 1-token prompt: some ranks start with an empty shard of that row
    res = generate(model, prompts, NEW_TOKENS, strategy="shifted", hook=hook, progress=False)
    result = {"tokens": res.tokens, "per_step": hook.per_step,
              "stats": [(s.collectives, s.fallbacks, dict(s.levels["cp"].ops)) for s in hook.stats]}

    # The redo path: a decode step whose shifts are far off raises the flag; the step is run again
    # with packed on the same placement, and every logit equals a packed-only run's.
    def steps(corrupt):
        cache = model.new_cache(len(prompts), 32, block_size=4)
        ids = model.prefill(prompts, cache).argmax(-1)
        runner, logits, redos = StepRunner("shifted" if corrupt else "packed", groups), [], []
        for i in range(4):
            if corrupt and i == 2:
                runner.shifts = {key: r + 500.0 for key, r in runner.shifts.items()}
            stats = mt.CommStats()
            out, _ = runner.run(model, ids, cache, stats)
            redos.append(stats.fallbacks)
            logits.append(out.tolist())
            ids = out.argmax(-1)
        return logits, redos, cache.lengths

    result["redo"] = steps(True)
    result["plain"] = steps(False)

    # generate()'s own redo: step 2's shifts pushed 500 above the truth on its first try; generate
    # reads the flags, runs the step again with packed, and the tokens are transformers' still
    calls = []
    decode_step = model.decode_step

    def corrupting(ids, cache, step):
        calls.append(step.strategy)
        if len(calls) == 3 and step.shifts is not None:
            step.shifts = {key: r + 500.0 for key, r in step.shifts.items()}
        return decode_step(ids, cache, step)

    model.decode_step = corrupting
    stats = mt.CommStats()
    res = generate(model, prompts, NEW_TOKENS, strategy="shifted", stats=stats, progress=False)
    del model.decode_step
    result["generate_redo"] = {"tokens": res.tokens, "fallbacks": stats.fallbacks, "decode_calls": len(calls)}
    return result


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers.hf_models import NEW_TOKENS, PROMPTS, hf_greedy, make_checkpoint

    path = tmp_path_factory.mktemp("llama_shifted")
    hf = make_checkpoint(path)
    return str(path), hf_greedy(hf, PROMPTS + [[77]], NEW_TOKENS)


def test_shifted_exact_one_collective_and_generate(ckpt):
    """Worlds 2, 3, 2 x 2, 2 x 4: exact within 1e-5 of fp64 for every shift, one SUM when the
    shift is in range; at 2 x 2 generate's tokens equal transformers', one SUM per layer per
    step after the first, and a raised deferred flag redoes the step exactly."""
    from tests.helpers.hf_models import NEW_TOKENS

    path, expected = ckpt
    results = run_ranks(run_all, 8, path, timeout=600, env={"MEGATRON_TREE_TRANSPORT": "backend"})  # (counts torch collectives)
    for name, (ranks, intra) in LAYOUTS.items():
        for cp in ranks or [list(range(8))]:
            reports = [results[r][name]["exact"] for r in cp]
            assert all(rep["group"] == cp for rep in reports)
            _check_exactness(reports, len(cp))
            if intra:
                assert results[cp[0]][name]["levels"] == [("intra", intra), ("inter", len(cp) // intra)]
    for r in range(8):
        msgs = results[r]["2"]["extra"]
        assert "shift must have the lse's shape (2, 4, 1)" in msgs[0]
        me, peer = r, r ^ 1
        assert f"shift: {me % 2 == 0} on rank {me}; {peer % 2 == 0} on rank {peer}" in msgs[1] or \
            f"shift: {peer % 2 == 0} on rank {peer}; {me % 2 == 0} on rank {me}" in msgs[1], msgs[1]
    layers = 2
    for rank in range(8):
        rep = results[rank]["2x2"]["generate"]
        assert rep["tokens"] == expected, f"rank {rank}"
        assert len(rep["per_step"]) == NEW_TOKENS - 1
        # step 0 has no shift yet: packed (MAX + SUM); every later step one SUM per layer
        assert rep["per_step"][0] == 2 * layers, rep["per_step"]
        assert rep["per_step"][1:] == [layers] * (NEW_TOKENS - 2), (rank, rep["per_step"])
        assert rep["stats"][0] == (2 * layers, 0, {"all_reduce_max": layers, "all_reduce_sum": layers})
        assert all(s == (layers, 0, {"all_reduce_sum": layers}) for s in rep["stats"][1:]), rep["stats"]
        logits, redos, lengths = rep["redo"]
        plain_logits, plain_redos, plain_lengths = rep["plain"]
        assert redos == [0, 0, layers, 0] and plain_redos == [0, 0, 0, 0], redos
        assert lengths == plain_lengths  # the redo did not advance the cache a second time
        gen = rep["generate_redo"]
        assert gen["tokens"] == expected, f"rank {rank}: generate's redo changed the tokens"
        assert gen["fallbacks"] == layers and gen["decode_calls"] == NEW_TOKENS, gen  # one step run twice
        # a NaN denominator: no redo flag, that row NaN (out and lse), every other row finite
        assert results[rank]["2"]["extra"][2] == (False, True, 1)
        for i, (a, b) in enumerate(zip(logits, plain_logits)):
            err = float((torch.tensor(a) - torch.tensor(b)).abs().max())
            assert err <= 1e-5, f"rank {rank} step {i}: shifted/redo logits differ from packed by {err:.2e}"
