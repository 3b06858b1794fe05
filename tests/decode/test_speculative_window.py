"""Speculative verification of sliding-window layers (``decode.speculative`` with ``window``), on real gloo ranks.

One 5-rank launch: CP 2 (ranks 0-1) and CP 3 (ranks 2-4) side by side. It checks

* ``verify_attention`` with a window against fp64 single-process attention of every draft row over the
  keys its window holds (committed keys at positions j > p - window, ancestors p - p_a < window), on
  unsharded tensors: chain, branching and irregular trees, GQA, ragged rows (one with no committed key),
  keys dealt to the ranks at random (one rank holds nothing of a row), garbage past every row's end,
  windows 1, 2, 5 and 9 that cut 20-40-token caches, and no window; bad windows/positions (an ancestor
  not before its row, int32, ``window=True``, windows or positions differing across ranks) give the
  same error on every rank;
* ``generate_speculative`` (prompt lookup, trees of width 1 and 2) on tiny transformers models with sliding
  windows -- Mistral with a window on every layer, Qwen2 with a sliding and a full layer -- equal to
  plain greedy ``generate`` token for token, prompts longer than the window, with drafts accepted;
  and ``verify_forward``'s logits of a width-2 tree, and of a chain of 8 rows deeper than the windows,
  equal transformers' in one process, path by path;
* transformers' ``generate(prompt_lookup_num_tokens=3)`` and ``generate(assistant_model=...)`` on a
  tree-enabled windowed model equal transformers in one process (the several-token chain forwards
  did run).

Assertions run in the parent.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.drafts import draft_masks, draft_tensors
from tests.helpers.ranks import run_ranks

WORLD = 5
GROUPS = [[0, 1], [2, 3, 4]]  # CP 2 and CP 3 side by side
LENGTHS = (31, 22, 0, 38, 7)  # committed keys per row; row 2 has none
HQ, HKV, D, DV = 4, 2, 16, 8
WINDOWS = (1, 2, 5, 9, None)


def _tensors(t):
    return draft_tensors(LENGTHS, t, 200 + t, HQ, HKV, D, DV)


def _owners(size):
    """Per row, the CP rank holding each committed position: dealt at random; rank 1 holds nothing of row 0."""
    g = torch.Generator().manual_seed(11 + size)
    out = []
    for row, n in enumerate(LENGTHS):
        own = torch.randint(0, size, (n,), generator=g)
        if row == 0:
            own[own == 1] = 0
        out.append(own)
    return out


def _shard(k, v, size, rank):
    """This rank's keys/values in ascending position order, their positions (-1 in free slots, whose keys are
    garbage that must never be read) and lengths."""
    owners = _owners(size)
    held = [(o == rank).nonzero()[:, 0] for o in owners]
    width = max(len(h) for h in held) + 3
    b = len(LENGTHS)
    ks = torch.full((b, width, HKV, D), 1e4)
    vs = torch.full((b, width, HKV, DV), float("nan"))
    pos = torch.full((b, width), -1, dtype=torch.int64)
    for row, h in enumerate(held):
        ks[row, :len(h)], vs[row, :len(h)], pos[row, :len(h)] = k[row, h], v[row, h], h
    return ks, vs, pos, torch.tensor([len(h) for h in held], dtype=torch.int32)


def _q_positions(mask):
    from megatron_tree.decode.speculative import tree_depths

    return torch.tensor(LENGTHS, dtype=torch.int64)[:, None] + tree_depths(mask)[None, :]


def reference(q, k, v, dk, dv, mask, window):
    """fp64: each draft row over the committed keys and ancestors its window holds, on the unsharded tensors."""
    b, t = q.shape[:2]
    g = HQ // HKV
    qpos = _q_positions(mask)
    out = torch.zeros(b, t, HQ, DV, dtype=torch.float64)
    for row in range(b):
        for i in range(t):
            p = int(qpos[row, i])
            lo = 0 if window is None else max(0, p - window + 1)
            anc = mask[i] & ((p - qpos[row]) < (window or 10 ** 9))
            keys = torch.cat([k[row, lo:LENGTHS[row]], dk[row][anc]]).double()
            vals = torch.cat([v[row, lo:LENGTHS[row]], dv[row][anc]]).double()
            for h in range(HQ):
                s = keys[:, h // g] @ q[row, i, h].double() * D ** -0.5
                out[row, i, h] = torch.softmax(s, 0) @ vals[:, h // g]
    return out


def _verify_part(rank, world):
    from megatron_tree.comm import CommStats
    from megatron_tree.decode.speculative import verify_attention
    from megatron_tree.distributed.topology import TreeGroups
    from tests.helpers.ranks import outcome

    groups = TreeGroups.build(GROUPS)
    res = {"cp": groups.size, "group": groups.cp_ranks}
    for mname, mask in draft_masks().items():
        q, k, v, dk, dv = _tensors(mask.shape[0])
        ks, vs, pos, lens = _shard(k, v, groups.size, groups.rank)
        for window in WINDOWS:
            stats = CommStats()
            out = verify_attention(q, ks, vs, dk, dv, mask, groups, cache_seqlens=lens, strategy="packed",
                                   stats=stats, q_positions=_q_positions(mask), k_positions=pos, window=window)
            res[(mname, window)] = (out.tolist(), stats.calls)
    # bad input: the same clear error on every rank of the group, before any merge
    mask = draft_masks()["tree"]
    q, k, v, dk, dv = _tensors(mask.shape[0])
    ks, vs, pos, lens = _shard(k, v, groups.size, groups.rank)
    qpos = _q_positions(mask)
    kw = dict(cache_seqlens=lens, q_positions=qpos, k_positions=pos, window=5)

    def attempt(**over):
        a = {**kw, **over}
        return outcome(lambda: verify_attention(q, ks, vs, dk, dv, mask, groups, **a))

    swapped = qpos.clone()
    swapped[1, 1], swapped[1, 2] = int(qpos[1, 2]), int(qpos[1, 1])  # row 1's child before its parent
    shifted = qpos + (1 if groups.rank == groups.size - 1 else 0)  # the last rank's positions differ
    level = qpos.clone()
    level[0, 1] = int(qpos[0, 0])  # row 0's first child at its parent's position (not after it)
    res["errors"] = {
        "no_positions": attempt(q_positions=None, k_positions=None),
        "zero_window": attempt(window=0),
        "only_q": attempt(k_positions=None),
        "bad_shape": attempt(q_positions=qpos[:, :-1]),
        "not_tree": attempt(q_positions=swapped),
        "differ": attempt(q_positions=shifted),
        "level": attempt(q_positions=level),
        "bool_window": attempt(window=True),
        "int32": attempt(q_positions=qpos.to(torch.int32)),
        "window_differs": attempt(window=5 + (groups.rank == groups.size - 1)),  # the last rank's is 6
    }
    return res


@pytest.fixture(scope="module")
def verified():
    return run_ranks(_verify_part, WORLD, timeout=300)


@pytest.mark.parametrize("mname", ["chain", "tree", "irregular"])
def test_windowed_verify_attention_matches_single_process(verified, mname):
    mask = draft_masks()[mname]
    q, k, v, dk, dv = _tensors(mask.shape[0])
    for window in WINDOWS:
        want = reference(q, k, v, dk, dv, mask, window)
        for rank, r in enumerate(verified):
            got, merges = r[(mname, window)]
            err = float((torch.tensor(got, dtype=torch.float64) - want).abs().max())
            assert err < 1e-5, f"{mname} window {window} rank {rank} (CP {r['cp']}): max |dout| {err}"
            assert merges == 1  # one merge collective for all T rows
            for other in verified:  # bitwise identical within a CP group
                if other["group"] == r["group"]:
                    assert other[(mname, window)][0] == got
    # the window matters: it changes the result against full attention
    full = reference(q, k, v, dk, dv, mask, None)
    assert float((reference(q, k, v, dk, dv, mask, 5) - full).abs().max()) > 1e-2


def test_windowed_verify_attention_bad_input_same_error_on_every_rank(verified):
    expect = {
        "no_positions": ("ValueError", "window=5 needs q_positions"),
        "zero_window": ("ValueError", "window must be a positive int"),
        "only_q": ("ValueError", "q_positions and k_positions go together"),
        "bad_shape": ("ValueError", "q_positions must be a (batch, T) = (5, 7) int64 tensor"),
        "not_tree": ("ValueError", "batch row 1's draft row 2 is at position 23 but its ancestor row 1 at 24"),
        "differ": ("DisagreementError", "disagree on speculative.verify: positions: "),
        "level": ("ValueError", f"batch row 0's draft row 1 is at position {LENGTHS[0]} but its ancestor row 0 at "
                                f"{LENGTHS[0]}"),
        "bool_window": ("ValueError", "window must be a positive int (a sliding window of that many keys) or None, "
                                       "got True"),
        "int32": ("ValueError", "int64 tensor of the draft rows' global positions, got (5, 7) torch.int32"),
        "window_differs": ("DisagreementError", "disagree on speculative.verify: window: 5 on rank"),
    }
    for group in GROUPS:
        errs = [verified[r]["errors"] for r in group]
        for what, (kind, needle) in expect.items():
            assert len({e[what][1] for e in errs}) == 1, (what, [e[what] for e in errs])
            for e in errs:
                assert e[what][0] == kind and needle in e[what][1], (what, e[what])
                assert e[what][2] < 20, (what, e[what][2])


# --------------------------------------------------------------------------- models with sliding windows

NEW = 16
MODELS = {  # name -> hf_model arguments, and the seed of its copier (whose greedy text falls into a cycle)
    "mistral": ("mistral", dict(sliding_window=6), 0),
    "qwen2-mixed": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=2,
                                  layer_types=["sliding_attention", "full_attention"]), 3),
}
VERIFY_PROMPTS = [[5, 17, 99, 3, 42, 8, 61, 23] * 3, [1, 2, 3, 4, 5, 6] * 3 + [1, 2], [77, 31, 9, 14]]


def _tiny(name, seed=3, **over):
    from tests.helpers.hf_models import hf_model

    arch, kw, _ = MODELS[name]
    model = hf_model(arch, seed=seed, **{**kw, **over})
    model.generation_config.eos_token_id = None
    return model


def _copier(name):
    """The model with attention outputs (and its second MLP) scaled down, not off: the next token depends mostly
    on the last one, so its greedy text cycles and prompt lookup finds the continuation (the window still
    changes its tokens: checked in one process when the seeds were picked)."""
    model = _tiny(name, seed=MODELS[name][2])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.03)
        model.model.layers[1].mlp.down_proj.weight.mul_(0.15)
    return model


def _assistant(target, name):
    """The target's first layer alone (its embeddings, norm and head), drafting 3 tokens a round."""
    small = _tiny(name, num_hidden_layers=1)
    small.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1.")})
    gc = small.generation_config
    gc.assistant_confidence_threshold, gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 0.0, 3, "constant"
    return small


def _copy_prompts(copier):
    """Two ragged prompts (43 and 37 tokens, longer than every window) ending in the copier's own greedy text."""
    with torch.no_grad():
        text = copier.generate(torch.tensor([[5, 17, 99]]), max_new_tokens=40, min_new_tokens=40, do_sample=False,
                               pad_token_id=0)[0].tolist()
    return [text, text[6:]]


def _model_part(rank, world):
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig, generate_speculative, tree_mask, verify_forward
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import HFTreeModel, TreeCache, enable_tree_attention

    groups = TreeGroups.build(GROUPS)
    res = {"cp": groups.size}
    for name in MODELS:
        copier = HFTreeModel(_copier(name), groups)
        prompts = _copy_prompts(copier.unsharded())
        entry = {"windows": list(copier._binding.windows)}
        entry["copy_greedy"] = generate(copier, prompts, NEW, progress=False).tokens
        for width in (1, 2):
            r = generate_speculative(copier, prompts, NEW, speculative=SpeculativeConfig(width=width, depth=3),
                                     progress=False)
            entry[width] = (r.tokens, r.mean_accepted)
        # the unscaled model: its own replica as the draft model (every draft accepted, trees of width 2)
        model = HFTreeModel(_tiny(name), groups)
        entry["greedy"] = generate(model, VERIFY_PROMPTS, NEW, progress=False).tokens
        r = generate_speculative(model, VERIFY_PROMPTS, NEW, progress=False, speculative=SpeculativeConfig(
            method="draft_model", draft_model=model.unsharded(), width=2, depth=3))
        entry["self"] = (r.tokens, r.acceptance_rate)
        cache = model.new_cache(len(VERIFY_PROMPTS), 48)
        model.prefill(VERIFY_PROMPTS, cache)
        mask = tree_mask(2, 3)
        toks = torch.randint(1, 128, (len(VERIFY_PROMPTS), mask.shape[0]), generator=torch.Generator().manual_seed(4))
        entry["verify"] = (toks.tolist(), verify_forward(model, cache, toks, mask).tolist())
        # a chain of 8 rows, deeper than every window: the last rows' windows drop their first ancestors
        cache = model.new_cache(len(VERIFY_PROMPTS), 48)
        model.prefill(VERIFY_PROMPTS, cache)
        deep = torch.randint(1, 128, (len(VERIFY_PROMPTS), 8), generator=torch.Generator().manual_seed(5))
        entry["deep"] = (deep.tolist(), verify_forward(model, cache, deep, tree_mask(1, 7)).tolist())
        res[name] = entry
    if groups.size == 2:  # transformers' assisted generation on the enabled model (CP 2)
        counts = {"chains": 0}
        begin = TreeCache._begin_chain

        def counted(self, *a, **k):  # (counts the several-token verification forwards; runs the real one)
            counts["chains"] += 1
            return begin(self, *a, **k)

        TreeCache._begin_chain = counted
        try:
            for name in MODELS:
                plain = _copier(name)
                prompt = torch.tensor(_copy_prompts(plain)[:1])
                assistant = _assistant(plain, name)
                target = enable_tree_attention(plain, groups)
                with torch.no_grad():
                    lookup = target.generate(prompt, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)
                    assisted = target.generate(prompt, max_new_tokens=NEW, do_sample=False, assistant_model=assistant)
                res[("hf", name)] = (lookup[0].tolist(), assisted[0].tolist())
        finally:
            TreeCache._begin_chain = begin
        res["chains"] = counts["chains"]
    return res


@pytest.fixture(scope="module")
def modelled():
    return run_ranks(_model_part, WORLD, timeout=400)


def test_speculative_generation_with_windows_equals_greedy_generate(modelled):
    for name in MODELS:
        for rank, r in enumerate(modelled):
            e = r[name]
            assert any(w is not None for w in e["windows"]), e["windows"]
            for width in (1, 2):  # prompt lookup on the copier
                tokens, mean = e[width]
                assert tokens == e["copy_greedy"], (name, rank, r["cp"], width, tokens, e["copy_greedy"])
                assert mean > 1.5, (name, rank, width, mean)  # drafts were accepted
            tokens, rate = e["self"]  # the model drafting for itself: trees of width 2 accepted whole
            assert tokens == e["greedy"], (name, rank, r["cp"], tokens, e["greedy"])
            assert rate > 0.9, (name, rank, rate)


def test_windowed_verification_logits_match_transformers(modelled):
    from megatron_tree.decode.speculative import tree_mask

    mask = tree_mask(2, 3)  # two chains of three: row 1 + c * 3 + d - 1 is chain c's token at depth d
    for name in MODELS:
        hf = _tiny(name)
        want = {}  # (row, chain) -> logits of the prompt, the root and the chain's tokens, in one process
        for b, prompt in enumerate(VERIFY_PROMPTS):
            toks = modelled[0][name]["verify"][0][b]
            for c in range(2):
                ids = prompt + [toks[0]] + toks[1 + 3 * c:4 + 3 * c]
                with torch.no_grad():
                    want[b, c] = hf(torch.tensor([ids])).logits[0, len(prompt):]  # (4, vocab)
        for rank, r in enumerate(modelled):
            toks, logits = r[name]["verify"]
            assert toks == modelled[0][name]["verify"][0]
            for b in range(len(VERIFY_PROMPTS)):
                for i in range(mask.shape[0]):
                    c, d = (0, 0) if i == 0 else ((i - 1) // 3, (i - 1) % 3 + 1)
                    err = float((torch.tensor(logits[b][i]) - want[b, c][d]).abs().max())
                    assert err < 1e-4, f"{name} rank {rank} (CP {r['cp']}) row {b} draft {i}: |dlogits| {err:.2e}"
        # the chain deeper than the window (8 rows; windows of 6 and 5): the same as one forward of the chain
        assert all(w is None or w < 8 for w in modelled[0][name]["windows"])
        for b, prompt in enumerate(VERIFY_PROMPTS):
            deep = modelled[0][name]["deep"][0][b]
            with torch.no_grad():
                want = hf(torch.tensor([prompt + deep])).logits[0, len(prompt):]  # (8, vocab)
            for rank, r in enumerate(modelled):
                toks, logits = r[name]["deep"]
                assert toks[b] == deep
                err = float((torch.tensor(logits[b]) - want).abs().max())
                assert err < 1e-4, f"{name} rank {rank} (CP {r['cp']}) row {b} deep chain: |dlogits| {err:.2e}"


def test_transformers_assisted_generation_with_windows_equals_one_process(modelled):
    for name in MODELS:
        hf = _copier(name)
        prompt = torch.tensor(_copy_prompts(hf)[:1])
        assistant = _assistant(hf, name)
        with torch.no_grad():
            want = (hf.generate(prompt, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3)[0].tolist(),
                    hf.generate(prompt, max_new_tokens=NEW, do_sample=False, assistant_model=assistant)[0].tolist())
        for rank in (0, 1):  # the CP 2 group
            assert modelled[rank][("hf", name)] == want, (name, rank, modelled[rank][("hf", name)], want)
    assert modelled[0]["chains"] > 8, modelled[0]["chains"]  # several-token verification forwards ran

