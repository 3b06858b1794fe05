"""Speculative sampling (``decode.speculative``) draws from exactly the target distribution.

The statistics: chi-square goodness of fit of the first three tokens against their exact
distribution, computed from the target in closed form. Each check rejects when the chi-square
p-value is below ``ALPHA`` = 1e-8; the samples are drawn with fixed seeds, so the tests are
deterministic, and over random seeds a correct sampler would fail any one check with probability
1e-8 (the file makes 10 such checks: a false failure rate below 1e-7 for the whole file). Cells
whose expected count is below 5 are pooled into one cell (so the chi-square approximation holds).

1. ``speculative_accept`` alone, on a fixed table of next-token distributions over 5 tokens (the
   target's and a draft's, each depending on the last token and the length's parity), with
   200,000 rows per check: a tree of two chains of two drafts, point-mass drafts (prompt lookup:
   distinct and duplicate siblings) and drafts drawn from the draft table; each also truncated at
   an independent random length (what a batch does when rows commit the fewest any row accepted).
   Plain sampling from the table is checked the same way, as a control of the statistic.
   A wrong rule fails these checks: accepting with min(1, q/p) accepts (nearly) every draft and
   fails the check that some rows reject; drawing from r instead of the residual after a
   rejection gives chi-square statistics above 38,000 (p-value 0) in every case.
2. ``generate(do_sample=True, speculative=...)`` through a tiny transformers Llama of 8 tokens at
   world 1: 1,500 rows of one prompt per check, with temperature/top-k/top-p, prompt lookup, a
   draft model and the target as its own draft (every draft accepted: several tokens committed per
   step), against the exact distribution from the unmodified model in one process.
3. One CP 2 gloo run: every rank keeps the same tokens, equal to world 1's for the same seed, and
   the same seed gives the same tokens again. (World 1 and CP 2 agree unless a uniform draw falls
   within the last bits of the logits' difference between the layouts of an acceptance threshold:
   with fixed seeds the outcome is fixed on one platform; elsewhere it could flip with a probability
   of the order of 1e-7 per decision.)
"""

import pytest
import torch

from tests.helpers.hf_models import hf_config
from tests.helpers.ranks import run_ranks

ALPHA = 1e-8
V = 5
L = 7  # the context's length (its parity selects the table's half)
C0 = 3  # the context's last token


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor):
    """Pearson's chi-square p-value of ``counts`` against ``probs`` (same shape); cells expecting fewer
    than 5 are pooled. A cell with probability 0 that was drawn is a certain failure (p-value 0)."""
    counts = counts.flatten().double()
    n = counts.sum()
    expect = probs.flatten().double() * n
    if bool((counts[expect == 0] > 0).any()):
        return 0.0, float("inf")
    small = expect < 5
    o = torch.cat([counts[~small], counts[small].sum()[None]]) if small.any() else counts
    e = torch.cat([expect[~small], expect[small].sum()[None]]) if small.any() else expect
    keep = e > 0
    o, e = o[keep], e[keep]
    stat = float(((o - e) ** 2 / e).sum())
    df = o.numel() - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return p, stat


def _table(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, 2, V, generator=g, dtype=torch.float64) * 1.3, dim=-1)


F = _table(1)  # the target: F[last token, length % 2] is the next token's distribution
G = _table(2)  # the draft


def exact_joint(tab, c0, length, k=3):
    """P(y1..yk) after a context of ``length`` tokens ending in ``c0`` under ``tab``: (V,) * k."""
    out = tab[c0, length % 2]
    for j in range(1, k):
        step = tab[:, (length + j) % 2]  # (V last, V next)
        out = out.unsqueeze(-1) * step.reshape((1,) * (j - 1) + (V, V))
    return out


def complete(emitted, n, gen, tab=F, k=3):
    """(n, k) tokens: each row's emitted tokens, continued by plain sampling from ``tab``."""
    out = torch.tensor([e[:k] + [-1] * (k - len(e[:k])) for e in emitted], dtype=torch.long).reshape(n, k)
    for j in range(k):
        need = out[:, j] < 0
        if need.any():
            last = out[need, j - 1] if j else torch.full((int(need.sum()),), C0)
            out[need, j] = torch.multinomial(tab[last, (L + j) % 2], 1, generator=gen)[:, 0]
    return out


def counts_of(seqs, k=3):
    idx = torch.zeros(seqs.shape[0], dtype=torch.long)
    for j in range(k):
        idx = idx * V + seqs[:, j]
    return torch.bincount(idx, minlength=V ** k).reshape((V,) * k)


N = 200_000
TOP = torch.argsort(F[C0, L % 2], descending=True).tolist()  # the target's first tokens, most likely first


def _tree_inputs(case, gen):
    """p, tokens, q of N rows for a tree of two chains of two drafts after the context."""
    from megatron_tree.decode.speculative import tree_mask

    mask = tree_mask(2, 2)  # rows 1-2: chain 0; rows 3-4: chain 1
    tokens = torch.zeros(N, 5, dtype=torch.long)
    tokens[:, 0] = C0
    q = None
    if case == "point":  # distinct siblings: the likeliest first tokens, each continued by a likely token
        heads = [TOP[0], TOP[1]]
        for c, h in enumerate(heads):
            tokens[:, 1 + 2 * c] = h
            tokens[:, 2 + 2 * c] = int(F[h, (L + 1) % 2].argmax())
    elif case == "point_dup":  # the same draft twice, then an unlikely one below it
        for c in range(2):
            tokens[:, 1 + 2 * c] = TOP[1]
            tokens[:, 2 + 2 * c] = int(F[TOP[1], (L + 1) % 2].argmin())
    else:  # drawn from the draft table: the heads independently from one distribution
        q = torch.zeros(N, 5, V, dtype=torch.float64)
        for c in range(2):
            head = torch.multinomial(G[C0, L % 2].expand(N, V), 1, generator=gen)[:, 0]
            second = torch.multinomial(G[head, (L + 1) % 2], 1, generator=gen)[:, 0]
            tokens[:, 1 + 2 * c], tokens[:, 2 + 2 * c] = head, second
            q[:, 1 + 2 * c] = G[C0, L % 2]
            q[:, 2 + 2 * c] = G[head, (L + 1) % 2]
    p = torch.zeros(N, 5, V, dtype=torch.float64)
    p[:, 0] = F[C0, L % 2]
    for node, depth in ((1, 1), (2, 2), (3, 1), (4, 2)):
        p[:, node] = F[tokens[:, node], (L + depth) % 2]
    return p, tokens, mask, q


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("case", ["point", "point_dup", "draft"])
def test_speculative_accept_follows_the_target_distribution(case, truncate):
    from megatron_tree.decode.speculative import speculative_accept

    gen = torch.Generator().manual_seed(1234)
    p, tokens, mask, q = _tree_inputs(case, gen)
    paths, emitted = speculative_accept(p, tokens, mask, q, gen)
    lengths = torch.tensor([len(e) for e in emitted])
    assert all(len(a) == len(e) for a, e in zip(paths, emitted))
    # the tree is exercised: some rows accept no draft (1 token), some one, some both drafts of a chain (3)
    least = N // 50 if case != "point_dup" else 100  # (point_dup's second draft is the unlikeliest token)
    assert int(lengths.bincount(minlength=4)[1:].min()) > least, lengths.bincount()
    if case == "point":  # both chains are taken by some rows
        assert {tuple(a[:2]) for a in paths[:2000]} >= {(0, 1), (0, 3)}
    if truncate:  # an independent cut: the rows keep the fewest tokens any row of their batch accepted
        cut = torch.randint(1, 4, (N,), generator=gen).tolist()
        emitted = [e[:c] for e, c in zip(emitted, cut)]
    seqs = complete(emitted, N, gen)
    pval, stat = chi_square_pvalue(counts_of(seqs), exact_joint(F, C0, L))
    assert pval > ALPHA, f"{case} (truncated: {truncate}): chi-square {stat:.1f}, p-value {pval:.3g}"


def test_plain_sampling_control():
    """The statistic itself: plain sampling from the table passes; drawing from the draft table fails."""
    gen = torch.Generator().manual_seed(99)
    seqs = complete([[] for _ in range(N)], N, gen)
    pval, stat = chi_square_pvalue(counts_of(seqs), exact_joint(F, C0, L))
    assert pval > ALPHA, (stat, pval)
    wrong = complete([[] for _ in range(N)], N, gen, tab=G)
    pval, _ = chi_square_pvalue(counts_of(wrong), exact_joint(F, C0, L))
    assert pval < 1e-30


def test_target_probs_is_sample_next_distribution():
    from megatron_tree.decode.generate import sample_next
    from megatron_tree.decode.speculative import target_probs

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    for kw in ({}, {"temperature": 0.7, "top_k": 9}, {"top_p": 0.8}, {"temperature": 1.4, "top_k": 20, "top_p": 0.9}):
        probs = target_probs(logits.reshape(8, 8, 50), **kw).reshape(64, 50)
        a = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5))[:, 0]
        b = sample_next(logits, do_sample=True, generator=torch.Generator().manual_seed(5), **kw)
        assert torch.equal(a, b), kw
        if kw.get("top_k"):
            assert int((probs > 0).sum(-1).max()) <= kw["top_k"]


def test_speculative_accept_bad_input():
    from megatron_tree.decode.speculative import speculative_accept, tree_mask

    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError, match=r"tokens must be \(batch, T\) = \(2, 3\)"):
        speculative_accept(p, torch.zeros(2, 4, dtype=torch.long), tree_mask(1, 2))
    with pytest.raises(ValueError, match=r"q must be \(batch, T, vocab\) = \(2, 3, 4\)"):
        speculative_accept(p, torch.zeros(2, 3, dtype=torch.long), tree_mask(1, 2), q=torch.zeros(2, 3, 5))
    two_roots = torch.eye(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="row 1 does not descend from row 0"):
        speculative_accept(p, torch.zeros(2, 3, dtype=torch.long), two_roots)


# --------------------------------------------------------------------------- through generate (transformers)

HV = 8  # the tiny Llama's vocabulary
PROMPT = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3, 1, 2]  # repeated n-grams: prompt lookup finds drafts
ROWS = 1500
SAMPLING = {"temperature": 1.3, "top_k": 6, "top_p": 0.95}


def _llama(seed):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(hf_config(vocab_size=HV, initializer_range=0.1)).eval()


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    target, draft = _llama(0), _llama(1)
    path = tmp_path_factory.mktemp("sampling_target")
    target.save_pretrained(str(path), safe_serialization=True)
    draft_path = tmp_path_factory.mktemp("sampling_draft")
    draft.save_pretrained(str(draft_path), safe_serialization=True)
    return target, draft, path, draft_path


def _hf_exact(hf, prompt, k=3, **sampling):
    """P(y1..yk) after ``prompt`` under transformers in one process and sample_next's transform."""
    from megatron_tree.decode.speculative import target_probs

    with torch.no_grad():
        joint = torch.ones(())
        ctx = [[]]
        for j in range(k):
            ids = torch.tensor([prompt + c for c in ctx])
            step = target_probs(hf(ids).logits[:, -1], **sampling).double()  # (V^j, V)
            joint = (joint.reshape(-1, 1) * step).reshape(-1)
            ctx = [c + [y] for c in ctx for y in range(HV)]
    return joint.reshape((HV,) * k)


@pytest.mark.parametrize("method", ["prompt_lookup", "draft_model", "self"])
def test_generate_speculative_sampling_matches_transformers_distribution(llamas, method):
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.integrations.hf import HFTreeModel

    target, draft, _, _ = llamas
    model = HFTreeModel(target, None)
    if method == "prompt_lookup":
        cfg = SpeculativeConfig(width=2, depth=2)
    elif method == "draft_model":
        cfg = SpeculativeConfig(method="draft_model", draft_model=draft, width=2, depth=2)
    else:
        cfg = SpeculativeConfig(method="draft_model", draft_model=model.unsharded(), width=1, depth=2)
    # 4 tokens: the prefill's, then one step of a depth-2 tree (the first three are counted)
    r = generate(model, [PROMPT] * ROWS, 4, do_sample=True, seed=11, speculative=cfg, progress=False, **SAMPLING)
    seqs = torch.tensor(r.tokens)
    assert seqs.shape == (ROWS, 4)
    if method == "self":  # the target drafting for itself: every draft accepted, one step for all three
        assert r.steps == 1 and r.accepted == [3], (r.steps, r.accepted)
    idx = (seqs[:, 0] * HV + seqs[:, 1]) * HV + seqs[:, 2]
    counts = torch.bincount(idx, minlength=HV ** 3)
    pval, stat = chi_square_pvalue(counts, _hf_exact(target, PROMPT, **SAMPLING))
    assert pval > ALPHA, f"{method}: chi-square {stat:.1f}, p-value {pval:.3g}"


# --------------------------------------------------------------------------- CP 2 over gloo

CP_PROMPTS = [PROMPT, [4, 5, 6, 4, 5], [7], PROMPT[:9]]
CP_NEW = 10
STOPS = (2, 5)


def _cp_runs(model, draft):
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig

    out = {}
    for name, cfg in (("lookup", SpeculativeConfig(width=2, depth=3)),
                      ("draft", SpeculativeConfig(method="draft_model", draft_model=draft, width=2, depth=2)),
                      ("self", SpeculativeConfig(method="draft_model", draft_model=model.unsharded(), depth=3))):
        for seed in (3, 3, 4):
            r = generate(model, CP_PROMPTS, CP_NEW, do_sample=True, seed=seed, speculative=cfg, progress=False,
                         **SAMPLING)
            out.setdefault(name, []).append((r.tokens, r.accepted))
    # stop tokens: rows finish at different steps while the others go on drafting
    r = generate(model, CP_PROMPTS, CP_NEW, do_sample=True, seed=3, stop_token_ids=STOPS, progress=False,
                 speculative=SpeculativeConfig(method="draft_model", draft_model=model.unsharded(), depth=3),
                 **SAMPLING)
    out["stop"] = [(r.tokens, r.accepted)]
    return out


def _cp_body(rank, world, path, draft_path):
    from transformers import AutoModelForCausalLM

    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import load_hf_model

    groups = TreeGroups.build(intra_size=None)
    draft = AutoModelForCausalLM.from_pretrained(draft_path).eval()
    return _cp_runs(load_hf_model(path, groups), draft)


def test_cp2_ranks_keep_the_same_sampled_tokens_as_world_1(llamas):
    from megatron_tree.integrations.hf import load_hf_model

    _, draft, path, draft_path = llamas
    ranks = run_ranks(_cp_body, 2, str(path), str(draft_path), timeout=300)
    single = _cp_runs(load_hf_model(str(path), None), draft)
    for name in ("lookup", "draft", "self"):
        (a, acc_a), (b, _), (c, _) = ranks[0][name]
        assert ranks[1][name] == ranks[0][name], f"{name}: CP ranks kept different tokens"
        assert a == b, f"{name}: the same seed gave different tokens"
        assert a != c, f"{name}: seeds 3 and 4 gave the same tokens"
        assert single[name] == ranks[0][name], f"{name}: CP 2 and world 1 differ for the same seed"
        assert all(len(row) == CP_NEW for row in a)
    assert ranks[1]["stop"] == ranks[0]["stop"] == single["stop"]
    stopped = ranks[0]["stop"][0][0]
    for row in stopped:  # a row ends at its first stop token, or runs to the budget without one
        first = next((i for i, t in enumerate(row) if t in STOPS), None)
        assert (first is None and len(row) == CP_NEW) or first == len(row) - 1, row
    assert any(len(row) < CP_NEW for row in stopped) and any(len(row) > 1 for row in stopped), stopped
    # the target as its own draft: every step commits all its drafts plus one on both ranks alike
    # (10 tokens: the prefill's, two steps of 3 drafts, a last step with no room for a draft)
    assert all(acc == [4, 4, 1] for _, acc in ranks[0]["self"]), [acc for _, acc in ranks[0]["self"]]
