"""Speculative decoding across the CP group (``decode.speculative``), on real gloo ranks.

One 4-rank launch, two parts. The first checks ``verify_attention`` (T draft rows of a tree over the
sharded committed cache plus their ancestors) against fp64 single-process attention over all keys
at CP 1, 2, 3 and 2 x 2: chain, branching and irregular trees, GQA, ragged rows, uneven and empty
shards, a row with no committed key; and that a bad mask or drafts that differ between ranks give
the same error on every rank. The second runs ``generate_speculative`` on a transformers Llama
through ``HFTreeModel`` and compares it token for token with greedy decoding (the argmax of the
unmodified transformers model's full forwards, computed once in the parent; prompt lookup and draft
models, trees of width 1 and > 1) and with greedy ``generate`` where a stop token ends a row, and the
verification forward's logits with the unmodified single-process transformers model. Assertions run in the parent.
"""

import contextlib
import io
import time

import pytest
import torch

from tests.helpers.drafts import draft_masks, draft_tensors
from tests.helpers.ranks import outcome, run_ranks
from tests.helpers.hf_models import make_checkpoint

# CP rank lists per case (TreeGroups.build(ranks, intra_size)); a rank outside the listed group runs its own
GROUPINGS = {
    "cp2": ([[0, 1], [2, 3]], None),
    "cp3": ([[0, 1, 2], [3]], None),
    "2x2": (None, 2),
}
LENGTHS = (13, 6, 0, 9)  # committed keys per row; row 2 has none
HQ, HKV, D, DV = 4, 2, 16, 8


def _tensors(t):
    return draft_tensors(LENGTHS, t, 100 + t, HQ, HKV, D, DV)


def _cuts(size, rank_of_case):
    """Per row, the [lo, hi) of the committed keys each of ``size`` ranks holds: uneven, some empty."""
    g = torch.Generator().manual_seed(7 + size)
    out = []
    for row, n in enumerate(LENGTHS):
        inner = sorted(torch.randint(0, n + 1, (size - 1,), generator=g).tolist())
        bounds = [0] + inner + [n]
        if row == 0 and size > 1:  # rank 1 holds nothing of row 0, rank 0 all but the last rank's
            bounds = [0] + [n - 2] * (size - 1) + [n]
        out.append([(bounds[r], bounds[r + 1]) for r in range(size)])
    return out


def _shard(k, v, size, rank):
    cuts = _cuts(size, None)
    lens = [cuts[b][rank][1] - cuts[b][rank][0] for b in range(len(LENGTHS))]
    width = max(lens) + 2  # slots past a row's length hold garbage that must never be read
    ks = torch.full((k.shape[0], width, HKV, D), 1e4)
    vs = torch.full((v.shape[0], width, HKV, DV), float("nan"))
    for b, (lo, hi) in enumerate(c[rank] for c in cuts):
        ks[b, :hi - lo] = k[b, lo:hi]
        vs[b, :hi - lo] = v[b, lo:hi]
    return ks, vs, torch.tensor(lens, dtype=torch.int32)


def _paged(ks, vs, seed, block=4):
    """A contiguous shard (batch, width, heads, dim) as a pool of blocks in shuffled order and its block table."""
    b, width = ks.shape[:2]
    per = -(-width // block)
    perm = torch.randperm(b * per + 1, generator=torch.Generator().manual_seed(seed))
    kp = torch.full((b * per + 1, block, *ks.shape[2:]), 7e3)
    vp = torch.full((b * per + 1, block, *vs.shape[2:]), float("nan"))
    table = torch.zeros(b, per, dtype=torch.int32)
    for row in range(b):
        for j in range(per):
            blk = int(perm[row * per + j])
            table[row, j] = blk
            n = min(block, width - j * block)
            kp[blk, :n] = ks[row, j * block:j * block + n]
            vp[blk, :n] = vs[row, j * block:j * block + n]
    return kp, vp, table


def reference(q, k, v, dk, dv, mask):
    """fp64 attention of each draft row over every committed key of its row and its ancestors."""
    b, t = q.shape[:2]
    g = HQ // HKV
    out = torch.zeros(b, t, HQ, DV, dtype=torch.float64)
    for row in range(b):
        for i in range(t):
            keys = torch.cat([k[row, :LENGTHS[row]], dk[row][mask[i]]]).double()
            vals = torch.cat([v[row, :LENGTHS[row]], dv[row][mask[i]]]).double()
            for h in range(HQ):
                s = keys[:, h // g] @ q[row, i, h].double() * D ** -0.5
                out[row, i, h] = torch.softmax(s, 0) @ vals[:, h // g]
    return out


def _verify_body(rank, world):
    from megatron_tree.comm import CommStats
    from megatron_tree.decode.speculative import verify_attention
    from megatron_tree.distributed.topology import TreeGroups

    res = {}
    for name, (ranks, intra) in GROUPINGS.items():
        groups = TreeGroups.build(ranks, intra)
        for mname, mask in draft_masks().items():
            q, k, v, dk, dv = _tensors(mask.shape[0])
            ks, vs, lens = _shard(k, v, groups.size, groups.rank)
            stats = CommStats()
            out = verify_attention(q, ks, vs, dk, dv, mask, groups, cache_seqlens=lens, strategy="packed",
                                   stats=stats, room=mask.shape[0])
            res[(name, mname)] = {"out": out.tolist(), "cp": groups.size, "group": groups.cp_ranks,
                                  "merges": stats.calls, "levels": sorted(stats.as_dict()["levels"])}
            # the same shard as a paged cache: blocks of 4 in a shuffled pool
            kp, vp, table = _paged(ks, vs, seed=groups.rank)
            paged = verify_attention(q, kp, vp, dk, dv, mask, groups, cache_seqlens=lens, block_table=table,
                                     strategy="packed")
            res[(name, mname + "_paged")] = {"out": paged.tolist(), "cp": groups.size, "group": groups.cp_ranks,
                                             "merges": 1, "levels": res[(name, mname)]["levels"]}
    # bad input: the same clear error on every rank, before any merge collective
    groups = TreeGroups.build(intra_size=None)
    mask = draft_masks()["tree"]
    q, k, v, dk, dv = _tensors(mask.shape[0])
    ks, vs, lens = _shard(k, v, groups.size, groups.rank)
    errors = {}

    def attempt(what, **over):
        kw = dict(q=q, k=ks, v=vs, draft_k=dk, draft_v=dv, mask=mask, groups=groups, cache_seqlens=lens)
        kw.update(over)
        t0 = time.monotonic()
        try:
            verify_attention(**kw)
            errors[what] = (None, "no error", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 -- the parent compares the texts
            errors[what] = (type(e).__name__, str(e), time.monotonic() - t0)

    later = mask.clone()
    later[2, 3] = True  # row 2 sees the later row 3
    attempt("later_row", mask=later)
    # only rank 2's mask is bad: every rank raises rank 2's error, naming it
    attempt("one_rank", mask=later if rank == 2 else mask)
    broken = mask.clone()
    broken[4, 0] = False  # row 4's ancestors skip the root its parent sees
    attempt("not_chain", mask=broken)
    attempt("too_many", room=mask.shape[0] - 1)
    other = dk.clone()
    if rank == 3:
        other[0, 1, 0, 0] += 1e-3  # drafts that differ on one rank
    attempt("drafts_differ", draft_k=other)
    res["errors"] = errors
    return res


@pytest.fixture(scope="module")
def verified(launched):
    return launched["verify"]


@pytest.mark.parametrize("case", list(GROUPINGS))
@pytest.mark.parametrize("mname", ["chain", "tree", "irregular", "chain_paged", "tree_paged", "irregular_paged"])
def test_verify_attention_matches_single_process(verified, case, mname):
    mask = draft_masks()[mname.replace("_paged", "")]
    q, k, v, dk, dv = _tensors(mask.shape[0])
    want = reference(q, k, v, dk, dv, mask)
    for rank, r in enumerate(verified):
        e = r[(case, mname)]
        got = torch.tensor(e["out"], dtype=torch.float64)
        err = float((got - want).abs().max())
        assert err < 1e-5, f"{case}/{mname} rank {rank} (CP {e['cp']}): max |dout| {err}"
        assert e["merges"] == 1  # one merge collective for all T rows
        if e["cp"] > 1:
            assert e["levels"], e
        for other in verified:  # bitwise identical within a CP group
            if other[(case, mname)]["group"] == e["group"]:
                assert other[(case, mname)]["out"] == e["out"]


def test_verify_attention_bad_input_same_error_on_every_rank(verified):
    errs = [r["errors"] for r in verified]
    expect = {
        "later_row": ("ValueError", "row 2 sees the later row 3"),
        "one_rank": ("ValueError", "rank 2: draft mask is not a tree: row 2 sees the later row 3"),
        "not_chain": ("ValueError", "row 4's ancestors are not a chain to a root"),
        "too_many": ("ValueError", "7 draft rows do not fit: the cache has room for 6"),
        "drafts_differ": ("DisagreementError", "drafts: "),
    }
    for what, (kind, needle) in expect.items():
        texts = {e[what][1] for e in errs}
        assert len(texts) == 1, f"{what}: ranks raised different texts: {texts}"
        for rank, e in enumerate(errs):
            assert e[what][0] == kind, (what, rank, e[what])
            assert needle in e[what][1], (what, e[what][1])
            assert e[what][2] < 20, f"{what}: rank {rank} took {e[what][2]:.1f} s"
    assert "on rank 3" in errs[0]["drafts_differ"][1]


# --------------------------------------------------------------------------- single process


def test_check_draft_tree_accepts_trees_and_names_what_is_wrong():
    from megatron_tree.decode.speculative import check_draft_tree, tree_mask

    for m in draft_masks().values():
        check_draft_tree(m)
    assert torch.equal(tree_mask(1, 3), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    with pytest.raises(TypeError, match="bool"):
        check_draft_tree(tree_mask(1, 3).int())
    with pytest.raises(ValueError, match="square"):
        check_draft_tree(torch.ones(2, 3, dtype=torch.bool))
    no_diag = tree_mask(2, 2)
    no_diag[3, 3] = False
    with pytest.raises(ValueError, match=r"row 3 does not see itself"):
        check_draft_tree(no_diag)
    with pytest.raises(ValueError, match=r"is \(5, 5\) but there are 4 draft query rows"):
        check_draft_tree(tree_mask(1, 4), 4)


def test_prompt_lookup_drafts_branch_on_distinct_continuations():
    from megatron_tree.decode.speculative import prompt_lookup_drafts

    seq = [1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 3, 7, 5, 1, 2]
    # the latest match of (1, 2) first: 3 7 5, then 4 8 (3 is already proposed), longest n-gram first
    assert prompt_lookup_drafts(seq, 3, 3, max_ngram=2) == [[3, 7, 5], [4, 8, 1]]
    assert prompt_lookup_drafts(seq, 1, 2, max_ngram=2) == [[3, 7]]
    assert prompt_lookup_drafts([5, 6, 7], 2, 3) == []


@pytest.mark.parametrize("width, depth", [(1, 1), (1, 4), (3, 1), (2, 3)])
def test_draft_model_cache_gives_the_full_forwards_chains(width, depth):
    """DraftCaches feeds the draft model only each row's new tokens (its KV kept across steps, the chains'
    keys cropped off): chains equal those of full forwards over the whole sequence, for rows that gain
    several tokens, one or none between steps. Rows of one length that grew alike share one batched
    cache (rows 0 and 1), a group whose rows come to differ is split; the cache then holds all but each
    row's last token."""
    from megatron_tree.decode.speculative import DraftCaches
    from tests.helpers.hf_models import hf_model

    model = hf_model("llama", seed=2)
    cached, full = DraftCaches(model, 3), DraftCaches(model, 3)
    full.enabled = False
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (9, 9, 4)]
    # (gained per row, rows sharing row 0's cache after the step)
    steps = (((0, 0, 0), 2), ((3, 3, 1), 2), ((1, 0, 0), 1), ((0, 2, 2), 1), ((5, 5, 5), 1))
    with torch.no_grad():
        for gained, together in steps:
            for b in range(3):
                seqs[b] += torch.randint(1, 128, (gained[b],), generator=g).tolist()
            got, want = cached.chains(seqs, width, depth), full.chains(seqs, width, depth)
            assert got == want, (gained, got, want)
            assert all(len(r) == width and all(len(c) == depth for c in r) for r in got)
            assert cached.held(0) == (len(seqs[0]) - 1, together), (gained, cached.held(0))
            assert [cached.held(b)[0] for b in range(3)] == [len(s) - 1 for s in seqs]
    assert cached.enabled and full.held(0) == (0, 0) and len(cached.groups) == 3


@pytest.mark.parametrize("width, depth", [(1, 1), (1, 4), (3, 1), (2, 3)])
def test_sampled_drafts_over_the_cache_equal_full_forwards(width, depth):
    """Speculative sampling's draft model over its kept KV cache (DraftCaches.sampled): with the same random
    stream, the tokens drawn and the proposal distributions q equal those of full forwards over the whole
    sequence (_draft_model_sampled), step after step as the rows grow by different amounts, rows of one
    length drafted together (rows 0 and 1 share a cache, then split); the cache is left holding all but
    each row's last token."""
    from megatron_tree.decode.speculative import DraftCaches, _draft_model_sampled, _draft_model_sampled_cached
    from tests.helpers.hf_models import hf_model

    model = hf_model("llama", seed=3)
    caches = DraftCaches(model, 3)

    def probs(logits):  # a temperature, so draws are not all the argmax
        return torch.softmax(logits.float() / 1.5, dim=-1)

    g = torch.Generator().manual_seed(1)
    # The full-forward path batches the rows of one length, in the order of their lengths' first rows;
    # the cached path the rows of one group, in the order of their first rows. The gains keep the two
    # orders alike, so both consume the random stream in the same order.
    seqs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 7, 9)]
    steps = (((0, 0, 0), 2), ((2, 2, 1), 2), ((1, 0, 2), 1), ((4, 4, 4), 1))
    with torch.no_grad():
        for step, (gained, together) in enumerate(steps):
            for b in range(3):
                seqs[b] += torch.randint(1, 128, (gained[b],), generator=g).tolist()
            g_full, g_cached = torch.Generator().manual_seed(step), torch.Generator().manual_seed(step)
            want_t, want_q = _draft_model_sampled(model, seqs, width, depth, probs, g_full)
            got_t, got_q = _draft_model_sampled_cached(caches, seqs, width, depth, probs, g_cached)
            assert got_t.shape == want_t.shape == (3, width, depth) and got_q.shape == want_q.shape
            assert torch.equal(got_t, want_t), (step, got_t, want_t)
            assert torch.allclose(got_q, want_q, atol=1e-6, rtol=0), float((got_q - want_q).abs().max())
            assert caches.held(0) == (len(seqs[0]) - 1, together), (step, caches.held(0))
            assert [caches.held(b)[0] for b in range(3)] == [len(s) - 1 for s in seqs]
    assert caches.enabled


def test_draft_groups_that_meet_in_length_stay_apart_and_draw_in_row_order():
    """DraftCaches' groups where the tests above do not reach: rows of different groups that come to one
    length (a finished row stops growing, a shorter one catches up) stay in their own caches and still
    give the full forwards' chains; a group of rows that are not adjacent (0 and 2) splits into groups
    drafted in row order, so sampled drafts consume the random stream as the full forwards do; a batch of
    the wrong size is a clear error."""
    from megatron_tree.decode.speculative import DraftCaches, _draft_model_sampled, _draft_model_sampled_cached
    from tests.helpers.hf_models import hf_model

    model = hf_model("llama", seed=4)
    g = torch.Generator().manual_seed(2)
    cached, full = DraftCaches(model, 2), DraftCaches(model, 2)
    full.enabled = False
    seqs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (5, 6)]
    with torch.no_grad():
        # (gained per row, rows sharing row 0's cache): rows 0 and 1 meet at length 6, then grow alike
        for gained, together in (((0, 0), 1), ((1, 0), 1), ((2, 2), 1)):
            for b in range(2):
                seqs[b] += torch.randint(1, 128, (gained[b],), generator=g).tolist()
            got, want = cached.chains(seqs, 2, 3), full.chains(seqs, 2, 3)
            assert got == want, (gained, got, want)
            assert cached.held(0) == (len(seqs[0]) - 1, together) and cached.held(1) == (len(seqs[1]) - 1, 1)
        with pytest.raises(ValueError, match=r"DraftCaches was made for 2 rows, got 3"):
            cached.chains(seqs + [seqs[0]], 2, 3)

        def probs(logits):
            return torch.softmax(logits.float() / 1.5, dim=-1)

        caches = DraftCaches(model, 3)
        seqs = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (7, 5, 7)]
        # rows 0 and 2 share a cache, then split: groups [0], [1], [2] draw in that order (the full
        # forwards' order: lengths 8, 5, 7), not in the order the groups were kept ([0, 2] before [1])
        for step, (gained, together) in enumerate((((0, 0, 0), 2), ((1, 0, 0), 1), ((2, 2, 2), 1))):
            for b in range(3):
                seqs[b] += torch.randint(1, 128, (gained[b],), generator=g).tolist()
            g_full, g_cached = torch.Generator().manual_seed(step), torch.Generator().manual_seed(step)
            want_t, want_q = _draft_model_sampled(model, seqs, 2, 3, probs, g_full)
            got_t, got_q = _draft_model_sampled_cached(caches, seqs, 2, 3, probs, g_cached)
            assert torch.equal(got_t, want_t), (step, got_t, want_t)
            assert torch.allclose(got_q, want_q, atol=1e-6, rtol=0), float((got_q - want_q).abs().max())
            assert caches.held(0) == (len(seqs[0]) - 1, together), (step, caches.held(0))
            assert [caches.held(b)[0] for b in range(3)] == [len(s) - 1 for s in seqs]


def test_finished_rows_are_not_drafted():
    """Rows that stop early (a stop token) leave the draft model's batch: the unfinished rows of one prompt
    length stay one group, so every step costs exactly its depth in draft forwards (finished rows each ran
    their own forwards before, every step to the end); tokens equal plain greedy generate's, and sampling
    with a seed is reproducible."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.integrations.hf import HFTreeModel
    from tests.helpers.hf_models import hf_model

    target, draft = HFTreeModel(hf_model("llama", seed=0), None), hf_model("qwen2", seed=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (6,), generator=g).tolist() for _ in range(8)]
    plain = generate(target, prompts, 16, progress=False).tokens
    stop = sorted({plain[b][b] for b in range(6)})  # rows 0-5 stop at different steps
    want = generate(target, prompts, 16, stop_token_ids=stop, progress=False).tokens
    assert len({len(t) for t in want}) > 2 and max(len(t) for t in want) > 6, want
    calls = [0]
    hook = draft.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        cfg = SpeculativeConfig(method="draft_model", draft_model=draft, width=2, depth=3)
        got = generate(target, prompts, 16, stop_token_ids=stop, progress=False, speculative=cfg)
        assert got.tokens == want
        assert calls[0] == got.drafted, (calls[0], got.drafted)  # one forward per draft token, all rows at once
        runs = [generate(target, prompts, 16, stop_token_ids=stop, do_sample=True, seed=4, temperature=1.3,
                         progress=False, speculative=cfg).tokens for _ in range(2)]
        assert runs[0] == runs[1] and all(1 <= len(t) <= 16 for t in runs[0])
    finally:
        hook.remove()


def test_draft_model_with_another_vocabulary_is_a_clear_error(tmp_path):
    from megatron_tree.decode.speculative import SpeculativeConfig, generate_speculative
    from megatron_tree.integrations.hf import HFTreeModel
    from tests.helpers.hf_models import hf_model

    target = HFTreeModel(make_checkpoint(tmp_path), None)
    small = hf_model("llama", vocab_size=96)
    with pytest.raises(ValueError, match=r"draft model's vocabulary has 96 tokens but the target model's has 128"):
        generate_speculative(target, [[1, 2, 3]], 4, progress=False,
                             speculative=SpeculativeConfig(method="draft_model", draft_model=small))
    with pytest.raises(ValueError, match=r"draft_model must be a loaded causal LM, got the path '/some/dir'"):
        generate_speculative(target, [[1, 2, 3]], 4, progress=False,
                             speculative=SpeculativeConfig(method="draft_model", draft_model="/some/dir"))
    from megatron_tree.decode.cache import CacheOverflowError
    from megatron_tree.decode.generate import generate

    with pytest.raises(NotImplementedError, match=r"speculative generation takes none of \['forced_tokens'\]"):
        generate(target, [[1, 2, 3]], 4, forced_tokens=torch.zeros(1, 4, dtype=torch.long),
                 speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match=r"draft_model must be a causal LM module .* got dict"):
        generate_speculative(target, [[1, 2, 3]], 4, progress=False,
                             speculative=SpeculativeConfig(method="draft_model", draft_model={"layers": 2}))
    # the same argument checks as generate's: a single stop id, float prompt ids
    with pytest.raises(TypeError, match=r"stop_token_ids must be a list .* got int 5; for one id pass \[5\]"):
        generate(target, [[1, 2, 3]], 4, stop_token_ids=5, progress=False, speculative=SpeculativeConfig())
    with pytest.raises(TypeError, match=r"prompt 0: token ids must be integers, got \[2.5\] \(float\)"):
        generate_speculative(target, [[1, 2.5, 3]], 4, progress=False)
    # a cache handed in that cannot hold every prompt plus max_new_tokens: refused before the prefill, as
    # generate refuses it (it overflowed at a later step's commit, after the prefill and the steps before)
    cache = target.new_cache(1, 8)
    with pytest.raises(CacheOverflowError, match=r"prompt 0 has 3 tokens; with max_new_tokens=10 it needs 13 slots"):
        generate(target, [[1, 2, 3]], 10, cache=cache, progress=False, speculative=SpeculativeConfig())
    assert cache.lengths == []
    with pytest.raises(ValueError, match=r"cache has batch size 1 but 2 prompts were given"):
        generate(target, [[1, 2, 3], [4]], 4, cache=cache, progress=False, speculative=SpeculativeConfig())


def test_a_draft_model_loaded_by_the_package_runs_as_its_transformers_model(tmp_path):
    """What load_hf_model returns (an HFTreeModel, no .parameters) drafts as the transformers model inside
    it: the same greedy tokens as that model passed directly, and as plain greedy generation."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.integrations.hf import HFTreeModel, load_hf_model

    target = HFTreeModel(make_checkpoint(tmp_path), None)
    wrapped = load_hf_model(str(tmp_path), None)
    assert not isinstance(wrapped, torch.nn.Module) and isinstance(wrapped.hf, torch.nn.Module)
    prompt = [[5, 17, 99, 3, 42, 5, 17, 99, 3, 42, 7]]
    plain = generate(target, prompt, 10, progress=False).tokens
    runs = {name: generate(target, prompt, 10, progress=False,
                           speculative=SpeculativeConfig(method="draft_model", draft_model=d, depth=3))
            for name, d in (("wrapped", wrapped), ("module", wrapped.hf))}
    assert runs["wrapped"].tokens == runs["module"].tokens == plain
    assert runs["wrapped"].accepted == runs["module"].accepted and runs["wrapped"].drafted > 0


def test_a_tree_enabled_draft_model_drafts_trees_and_rows_that_finish(tmp_path):
    """A tree-enabled draft model (load_hf_model's, or the transformers model inside it) drafts a tree of width
    > 1 and a batch whose rows finish at different steps: tree attention's cache cannot repeat or select rows
    (it raised NotImplementedError from TreeCache.batch_repeat_interleave), so the draft runs as its plain
    replica; the tokens equal plain greedy generate's, with and without stop tokens, and sampling is seeded."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.integrations.hf import HFTreeModel, load_hf_model
    from tests.helpers.hf_models import hf_model

    target = HFTreeModel(hf_model("llama", seed=0), None)
    make_checkpoint(tmp_path, seed=1)
    wrapped = load_hf_model(str(tmp_path), None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128, (6,), generator=g).tolist() for _ in range(3)]
    plain = generate(target, prompts, 10, progress=False).tokens
    stop = [plain[0][2]]  # row 0 stops at its third token: its draft group splits
    want = generate(target, prompts, 10, stop_token_ids=stop, progress=False).tokens
    assert len(want[0]) == 3 < max(len(t) for t in want), want
    for d in (wrapped, wrapped.hf):
        cfg = SpeculativeConfig(method="draft_model", draft_model=d, width=2, depth=3)
        got = generate(target, prompts, 10, stop_token_ids=stop, progress=False, speculative=cfg)
        assert got.tokens == want and got.drafted > 0
    sampled = generate(target, prompts, 10, stop_token_ids=stop, do_sample=True, seed=2, progress=False,
                       speculative=cfg).tokens
    assert all(1 <= len(t) <= 10 for t in sampled), sampled
    # the draft model itself stays tree-enabled and unchanged
    assert wrapped.hf.model.layers[0].self_attn.config._attn_implementation == "megatron_tree"


def test_verify_forward_bad_input_is_a_clear_error():
    """verify_forward refuses tokens that do not fit the mask, the cache or the vocabulary with one clear error
    each (they were transformers' shape errors, or an IndexError from the embedding), and commit nodes that are
    not rows of the verification; both leave the cache as it was: the next verification and commit are exact."""
    from megatron_tree.decode.cache import CacheOverflowError
    from megatron_tree.decode.speculative import commit, tree_mask, verify_forward
    from megatron_tree.integrations.hf import HFTreeModel
    from tests.helpers.hf_models import hf_model

    hf = hf_model("llama", seed=0)
    model = HFTreeModel(hf_model("llama", seed=0), None)
    prompts = [[5, 17, 99, 3], [1, 2]]
    cache = model.new_cache(2, 16)
    model.prefill(prompts, cache)
    mask = tree_mask(2, 2)
    ok = torch.tensor([[7, 8, 9, 10, 11], [12, 13, 14, 15, 16]])
    for tokens, msg in ((ok[:, :3], r"draft mask is \(5, 5\) but there are 3 draft query rows"),
                        (ok[:1], r"tokens have 1 batch rows, the cache holds 2"),
                        (ok[0], r"tokens must be a \(batch, T\) integer tensor of token ids, got \(5,\)"),
                        (ok.float(), r"tokens must be a \(batch, T\) integer tensor .* torch.float32"),
                        (ok + 120, r"outside the model's vocabulary \[0, 128\): \[128, 129, 130, 131, 132\]")):
        with pytest.raises(ValueError, match=msg):
            verify_forward(model, cache, tokens, mask)
    assert cache.lengths == [4, 2]
    logits = verify_forward(model, cache, ok, mask)
    # commit refuses nodes that are not rows of the verification, before it places a step (it placed the first
    # tokens, then failed on an index: the cache kept a slot no key was written to, read by every later step)
    for nodes, msg in ((torch.tensor([[0, 9], [0, 1]]), r"nodes must be draft rows in \[0, 5\) .* got \[0, 1, 9\]"),
                       (torch.tensor([[0, 1]]), r"nodes have 1 batch rows, the verified drafts 2"),
                       (torch.tensor([0, 1]), r"nodes must be a \(batch, n\) integer tensor")):
        with pytest.raises(ValueError, match=msg):
            commit(cache, nodes)
    assert cache.lengths == [4, 2]
    # a path longer than a fixed-size cache's room: refused whole (it stored the tokens that fitted, then raised)
    small = model.new_cache(2, 6)
    model.prefill(prompts, small)
    verify_forward(model, small, ok, mask)
    with pytest.raises(CacheOverflowError, match=r"a row already holds 4 tokens and 3 more do not fit"):
        commit(small, torch.tensor([[0, 3, 4], [0, 1, 2]]))
    assert small.lengths == [4, 2]
    commit(cache, torch.tensor([[0, 3, 4], [0, 1, 2]]))
    with pytest.raises(ValueError, match=r"run verify_forward first \(and commit its drafts once\)"):
        commit(cache, torch.tensor([[0], [0]]))  # (a KeyError after a step was placed)
    with torch.no_grad():
        for b, p in enumerate(prompts):
            want = hf(torch.tensor([p + ok[b, :3].tolist()])).logits[0, -1]  # row 2: chain 0's second draft
            assert float((logits[b, 2] - want).abs().max()) < 5e-5
    assert cache.lengths == [7, 5]
    step = model.decode_step(torch.tensor([9, 9]), cache)
    with torch.no_grad():
        for b, (p, path) in enumerate(zip(prompts, ([0, 3, 4], [0, 1, 2]))):
            want = hf(torch.tensor([p + [int(ok[b, j]) for j in path] + [9]])).logits[0, -1]
            assert float((step[b] - want).abs().max()) < 5e-5


# --------------------------------------------------------------------------- generation through transformers

NEW = 24
COPY_PROMPTS = [[5, 17, 99, 3, 42, 5, 17, 99, 3, 42, 7], [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2], [77]]


def _gen_body(rank, world, path, copy_path, draft_path, loop_prompt, stop):
    from transformers import AutoModelForCausalLM

    from megatron_tree.comm import CommStats
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import (SpeculativeConfig, commit, generate_speculative, tree_mask,
                                                  verify_forward)
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import load_hf_model

    draft = AutoModelForCausalLM.from_pretrained(draft_path).eval()
    res = {}
    for name, (ranks, intra) in GROUPINGS.items():
        groups = TreeGroups.build(ranks, intra)
        model = load_hf_model(path, groups)
        copier = load_hf_model(copy_path, groups)
        entry = {"cp": groups.size, "cp_rank": groups.rank, "group": groups.cp_ranks}
        runs = {
            ("lookup", 1): (copier, SpeculativeConfig(width=1, depth=4)),
            ("draft", 1): (model, SpeculativeConfig(method="draft_model", draft_model=draft, width=1, depth=3)),
            ("draft", 2): (model, SpeculativeConfig(method="draft_model", draft_model=draft, width=2, depth=3)),
            ("self", 2): (model, SpeculativeConfig(method="draft_model", draft_model=model.unsharded(), width=2,
                                                   depth=4)),
            # the draft loaded with the CP groups (tree-enabled): it drafts as its plain replica
            ("tree_draft", 2): (model, SpeculativeConfig(method="draft_model", draft_model=load_hf_model(
                draft_path, groups), width=2, depth=3)),
        }
        # a stop token met inside an accepted run of drafts (the parent's: the copier's 10th greedy token after
        # loop_prompt): the row ends where greedy generate ends it
        entry["stop_greedy"] = generate(copier, [loop_prompt, COPY_PROMPTS[1]], NEW, stop_token_ids=stop,
                                        progress=False).tokens
        entry["stop_spec"] = generate_speculative(copier, [loop_prompt, COPY_PROMPTS[1]], NEW, stop_token_ids=stop,
                                                  progress=False).tokens
        runs[("loop", 1)] = (copier, SpeculativeConfig(width=1, depth=4))
        runs[("loop", 3)] = (copier, SpeculativeConfig(width=3, depth=4))
        for key, (m, cfg) in runs.items():
            stats = CommStats()
            prompts = [loop_prompt] if key[0] == "loop" else COPY_PROMPTS
            if key == ("loop", 3):  # through generate(speculative=), with its progress line
                bar = io.StringIO()
                with contextlib.redirect_stderr(bar):
                    r = generate(m, prompts, NEW, speculative=cfg, stats=stats, progress=True)
                entry["bar"] = bar.getvalue()
            else:
                r = generate_speculative(m, prompts, NEW, speculative=cfg, stats=stats, progress=False)
            entry[key] = {"tokens": r.tokens, "mean": r.mean_accepted, "rate": r.acceptance_rate, "steps": r.steps,
                          "merges": stats.calls}
        # the verification forward's logits against transformers in one process (chain and tree),
        # and the cache after committing a path equals one that never saw the other drafts
        cache = model.new_cache(len(COPY_PROMPTS), 40)
        model.prefill(COPY_PROMPTS, cache)
        mask = tree_mask(2, 3)
        g = torch.Generator().manual_seed(3)
        toks = torch.randint(1, 128, (len(COPY_PROMPTS), mask.shape[0]), generator=g)
        entry["verify_tokens"] = toks.tolist()
        entry["verify_logits"] = verify_forward(model, cache, toks, mask).tolist()
        path_nodes = torch.tensor([[0, 4, 5], [0, 1, 2], [0, 4, 5]])
        commit(cache, path_nodes)
        entry["after_commit"] = model.decode_step(torch.tensor([9, 9, 9]), cache).tolist()
        entry["after_lengths"] = cache.lengths
        # drafts that differ on one CP rank: every rank raises the same error before any merge (each rank
        # computed its own logits from its own drafts, no error), and the cache is untouched
        other = toks.clone()
        if groups.rank == 1:
            other[1, 3] += 1
        entry["verify_differ"] = outcome(lambda: verify_forward(model, cache, other, mask))
        entry["after_differ"] = model.decode_step(torch.tensor([9, 9, 9]), cache).tolist()
        res[name] = entry
    return res


def _both_body(rank, world, gen_args):
    """The module's one 4-rank launch: verify_attention's cases, then the generation runs (a second launch
    of the same 4 ranks only repeated their start, group creation and imports)."""
    return {"verify": _verify_body(rank, world), "gen": _gen_body(rank, world, *gen_args)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec_target")
    hf = make_checkpoint(path)
    copy_path = tmp_path_factory.mktemp("spec_copy")
    copier = make_checkpoint(copy_path)
    # A model whose next token depends almost only on the last one (attention scaled down, not off):
    # its greedy text cycles, so prompt lookup finds the continuation in the text seen so far.
    with torch.no_grad():
        for layer in copier.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
    copier.save_pretrained(str(copy_path), safe_serialization=True)
    draft_path = tmp_path_factory.mktemp("spec_draft")
    make_checkpoint(draft_path, seed=1)
    # A prompt that ends in the copier's own greedy text: once that text cycles, its continuation
    # repeats a span of the prompt (what prompt lookup drafts from).
    with torch.no_grad():
        seed = [11, 22, 33]
        text = copier.generate(torch.tensor([seed]), max_new_tokens=36, min_new_tokens=36, do_sample=False,
                               pad_token_id=0)[0].tolist()
    # Greedy decoding's tokens, once, in this process: the argmax of full forwards of the unmodified
    # transformers models (what the package's greedy generate equals token for token; the ranks'
    # speculative runs must equal it at every CP layout).
    refs = {"greedy": _argmax_loop(hf, COPY_PROMPTS), "copy_greedy": _argmax_loop(copier, COPY_PROMPTS),
            "loop_greedy": _argmax_loop(copier, [text])}
    stop = [refs["loop_greedy"][0][9]]
    results = run_ranks(_both_body, 4, (str(path), str(copy_path), str(draft_path), text, stop), timeout=600)
    return {"verify": [r["verify"] for r in results], "gen": (hf, copier, refs, [r["gen"] for r in results])}


@pytest.fixture(scope="module")
def generated(launched):
    return launched["gen"]


def _argmax_loop(model, prompts):
    """NEW greedy tokens per prompt: the argmax of a full forward over prompt + tokens so far, never stopping."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def test_speculative_generation_equals_greedy_generate(generated):
    _, _, refs, results = generated
    for name in GROUPINGS:
        for rank, e in enumerate(r[name] for r in results):
            where = f"{name} rank {rank} (CP {e['cp']})"
            if e["cp_rank"] == 0:  # the progress line shows the acceptance, on CP rank 0 only
                assert f"{NEW}/{NEW}" in e["bar"] and "accepted" in e["bar"] and "tok/step" in e["bar"], e["bar"]
            else:
                assert e["bar"] == "", where
            assert e["stop_spec"] == e["stop_greedy"], where
            assert len(e["stop_greedy"][0]) < NEW, where  # the stop token did end row 0 early
            for key in (("lookup", 1),):
                assert e[key]["tokens"] == refs["copy_greedy"], (where, key)
                assert e[key]["mean"] > 1.0, (where, key, e[key])  # drafts were accepted (rows share steps)
                assert e[key]["merges"] == 2 * e[key]["steps"]  # one merge per layer per verification step
            for key in (("loop", 1), ("loop", 3)):
                assert e[key]["tokens"] == refs["loop_greedy"], (where, key)
                assert e[key]["mean"] > 2.5, (where, key, e[key])  # one row on a repeating text: most accepted
                assert e[key]["merges"] == 2 * e[key]["steps"]
            for key in (("draft", 1), ("draft", 2), ("self", 2), ("tree_draft", 2)):
                assert e[key]["tokens"] == refs["greedy"], (where, key)
            # the model as its own draft: every draft accepted
            assert e[("self", 2)]["rate"] == 1.0, (where, e[("self", 2)])
            assert e[("self", 2)]["steps"] <= -(-(NEW - 1) // 5) + 1


def test_verification_logits_and_commit_match_transformers(generated):
    hf, _, _, results = generated
    from megatron_tree.decode.speculative import tree_mask

    mask = tree_mask(2, 3)
    memo = {}

    def single(ids):  # transformers in one process: the last position's logits (memoised: ranks share inputs)
        if tuple(ids) not in memo:
            with torch.no_grad():
                memo[tuple(ids)] = hf(torch.tensor([ids])).logits[0, -1]
        return memo[tuple(ids)]

    for name in GROUPINGS:
        for rank, e in enumerate(r[name] for r in results):
            toks, logits = e["verify_tokens"], torch.tensor(e["verify_logits"])
            with torch.no_grad():
                for b, p in enumerate(COPY_PROMPTS):
                    for i in range(mask.shape[0]):
                        branch = [toks[b][j] for j in range(mask.shape[0]) if mask[i, j]]
                        want = single(p + branch)
                        err = float((logits[b, i] - want).abs().max())
                        assert err < 5e-5, f"{name} rank {rank} row {b} draft {i}: max |dlogits| {err}"
                    # after committing the path, a decode step sees exactly prompt + path + the new token
                    path = {0: [0, 4, 5], 1: [0, 1, 2], 2: [0, 4, 5]}[b]
                    want = single(p + [toks[b][j] for j in path] + [9])
                    err = float((torch.tensor(e["after_commit"][b]) - want).abs().max())
                    assert err < 5e-5, f"{name} rank {rank} row {b} after commit: {err}"
            assert e["after_lengths"] == [len(p) + 4 for p in COPY_PROMPTS]
            kind, msg, _ = e["verify_differ"]
            if e["cp"] == 1:
                assert kind == "returned", (name, rank, msg)
            else:
                assert kind == "DisagreementError" and "speculative.verify_forward" in msg and "tokens" in msg, \
                    (name, rank, kind, msg)
                assert msg == [r[name] for r in results if r[name]["group"] == e["group"]][0]["verify_differ"][1]
            with torch.no_grad():
                for b, p in enumerate(COPY_PROMPTS):  # the refused call stored nothing
                    path = {0: [0, 4, 5], 1: [0, 1, 2], 2: [0, 4, 5]}[b]
                    want = single(p + [toks[b][j] for j in path] + [9, 9])
                    err = float((torch.tensor(e["after_differ"][b]) - want).abs().max())
                    assert err < 5e-5, f"{name} rank {rank} row {b} after a refused verification: {err}"
