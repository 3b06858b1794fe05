"""transformers' assisted generation (``generate(assistant_model=...)``, ``generate(prompt_lookup_num_tokens=...)``)
on a tree-enabled model at CP > 1.

Each round transformers runs the target on the last token plus the candidates (the first round: a
prefill of the prompt plus the candidates) and then crops the cache back to the accepted ones
(``cache.crop(-rejected)``). The forward of several new tokens on a filled ``TreeCache`` is verified as
a chain (``decode.speculative.verify_attention``, one merge per layer for all rows) and appended as
decode steps; ``TreeCache.crop`` cuts every rank's shard alike, into decode steps or into the prefill.

Checked here: the sequences and the target's logits of every generated token equal transformers' own in one
process, and so does every crop (the same rounds, accepting and rejecting the same candidates: the first
round's rejections cut into the prefill) -- CP 2, 3 and 2 x 2 and a compiled decode step (the verification forwards run eagerly, the
one-token steps compiled), a 33-token prompt (no CP size divides it into equal chunks); the cache's
lengths and shards afterwards; a cache cropped and extended by hand against a ``DynamicCache`` given
the same calls (left-padded rows, cuts into the prefill and into decoded tokens, a cache that grows
after a cut and outgrows the first storage); sampling (rank 0's draws, the assistant's too);
``RowPlacement.truncate`` against the placement it cuts; bad crops and padded new tokens refused; ranks handed
different candidates, or whose sequences differ before their last token, refused alike.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import outcome, run_ranks

NEW = 20


def _target(seed: int):
    """A tiny random Llama (GQA 4/2) whose greedy text repeats: attention outputs scaled down, so the next token
    depends mostly on the current one and the text falls into cycles that the prompt already holds; its
    second layer's MLP scaled down too, so a one-layer copy of it is a fair assistant."""
    from tests.helpers.hf_models import hf_model

    model = hf_model("llama", seed=seed)
    model.generation_config.eos_token_id = None  # (no early stop: every round is compared)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.03)
        model.model.layers[1].mlp.down_proj.weight.mul_(0.15)
    return model


def _assistant(target):
    """A smaller model of the same vocabulary: the target's first layer alone (its embeddings, norm and head),
    drafting 3 tokens a round whatever its confidence."""
    from tests.helpers.hf_models import hf_model

    small = hf_model("llama", seed=0, num_hidden_layers=1)
    small.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.1.")})
    gc = small.generation_config
    gc.assistant_confidence_threshold, gc.num_assistant_tokens, gc.num_assistant_tokens_schedule = 0.0, 3, "constant"
    return small


def _prompt(target):
    """33 tokens: 7 random ones, then the target's own greedy text (which the continuation partly repeats)."""
    p0 = torch.randint(1, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return target.generate(p0, max_new_tokens=26, do_sample=False, pad_token_id=0)


MODES = {"prompt_lookup": 4, "assistant": 1}
"""Each mode's target seed (a target whose first round rejects candidates in that mode: a cut into the prefill)."""


def _run(model, mode, prompt, crops, logits):
    """One assisted ``generate``; returns its tokens and the target's cache; ``crops`` receives each crop of
    that cache (the cache the target's first forward returned; the assistant's own crops are left out),
    ``logits`` the target's logits of each generated token (vocab floats a token: the verification forwards'
    rows; greedy tokens alone barely depend on attention in this model)."""
    from transformers.cache_utils import Cache

    from megatron_tree.integrations.hf import TreeCache

    kw = {"prompt_lookup_num_tokens": 3} if mode == "prompt_lookup" else {"assistant_model": _assistant(model)}
    target, calls = [], []
    originals = {cls: cls.__dict__["crop"] for cls in (Cache, TreeCache)}

    def spy(orig):
        def crop(self, n):
            calls.append((self, n))
            return orig(self, n)
        return crop

    own = model.__dict__.get("forward")
    forward = own or model.forward

    def remember(*args, **kwargs):
        out = forward(*args, **kwargs)
        if not target:
            target.append(out["cache"] if "cache" in out else out["past_key_values"])
        return out

    for cls, orig in originals.items():
        cls.crop = spy(orig)
    model.forward = remember
    try:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                 return_dict_in_generate=True, output_logits=True, **kw)
    finally:
        for cls, orig in originals.items():
            cls.crop = orig
        if own is None:
            del model.__dict__["forward"]
        else:
            model.forward = own
    crops.extend(n for c, n in calls if c is target[0])
    logits.extend(step[0].float().tolist() for step in out.logits)
    return out.sequences[0].tolist(), target[0]


def _reference(mode):
    model = _target(MODES[mode])
    crops, logits = [], []
    tokens, _ = _run(model, mode, _prompt(model), crops, logits)
    return tokens, crops, logits


def _rank(rank, world, intra, compile_step):
    import megatron_tree as mt
    from megatron_tree.integrations.hf import TreeCache, enable_tree_attention

    groups = mt.TreeGroups.build(intra_size=intra) if intra else mt.TreeGroups.build()
    out = {}
    for mode, seed in MODES.items():
        model = _target(seed)
        prompt = _prompt(model)  # (made by the plain model: the same on every rank)
        enable_tree_attention(model, groups, compile_step={"backend": "aot_eager"} if compile_step else False)
        crops, logits = [], []
        tokens, cache = _run(model, mode, prompt, crops, logits)
        assert isinstance(cache, TreeCache)
        st = cache.storage
        row = st._rows[0]
        n = int(st.seqlens[0])
        stored = st.positions[0].tolist()
        out[mode] = dict(tokens=tokens, crops=crops, logits=logits, lengths=cache.lengths, seq=cache.get_seq_length(),
                         shards=cache.shard_lengths, local=n, placed=row.positions(groups.rank),
                         stored=stored[:n], rest=stored[n:])
    return out


@pytest.mark.parametrize("world,intra,compile_step", [(2, None, False), (3, None, False), (4, 2, False),
                                                      (2, None, True)])
def test_assisted_generate_gives_transformers_own_tokens(world, intra, compile_step):
    want = {mode: _reference(mode) for mode in MODES}
    for mode, (tokens, crops, _) in want.items():  # the case must exercise what it claims to
        assert crops[0] < 0, (mode, crops, "the first round rejects nothing: no cut into the prefill")
        assert any(c < 0 for c in crops[1:]), (mode, crops, "no later round rejects a candidate")
        assert len(crops) < NEW, (mode, crops, "no round accepted a candidate")
    results = run_ranks(_rank, world, intra, compile_step, timeout=300)
    for rank, got in enumerate(results):
        for mode, (tokens, crops, logits) in want.items():
            g = got[mode]
            assert g["tokens"] == tokens, (rank, mode, g["tokens"], tokens)
            torch.testing.assert_close(torch.tensor(g["logits"]), torch.tensor(logits), rtol=0, atol=5e-5,
                                       msg=lambda m, rank=rank, mode=mode: f"rank {rank}, {mode}: {m}")
            assert g["crops"] == crops, (rank, mode, g["crops"], crops)
            # the cache holds every token but the last (transformers feeds it next)
            assert g["lengths"] == [len(tokens) - 1] and g["seq"] == len(tokens) - 1, (rank, mode, g)
            assert sum(g["shards"][0]) == len(tokens) - 1 and g["shards"][0][rank] == g["local"], (rank, mode, g)
            assert g["stored"] == g["placed"] and set(g["rest"]) <= {-1}, (rank, mode, g)
            assert g["shards"] == results[0][mode]["shards"]


SAMPLING = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)
SEED = 1234


def _sample(model, mode, prompt, seed):
    kw = {"prompt_lookup_num_tokens": 3} if mode == "prompt_lookup" else {"assistant_model": _assistant(model)}
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=NEW, pad_token_id=0, **SAMPLING, **kw)[0].tolist()


def _sample_rank(rank, world):
    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention

    groups = mt.TreeGroups.build()
    out = {}
    for mode, seed in MODES.items():
        model = _target(seed)
        prompt = _prompt(model)
        enable_tree_attention(model, groups)
        # Ranks seeded differently: every draw (the assistant's too) is CP rank 0's.
        out[mode] = _sample(model, mode, prompt, SEED if rank == 0 else 99 + rank)
    return out


def test_assisted_sampling_draws_rank_zeros_tokens():
    """do_sample with assisted decoding at CP 3: transformers' own tokens in one process for rank 0's seed, on
    every rank (the target's logits processors, _RankZeroDraws among them, run in the assistant's generate too)."""
    want = {}
    for mode, seed in MODES.items():
        model = _target(seed)
        want[mode] = _sample(model, mode, _prompt(model), SEED)
    for rank, got in enumerate(run_ranks(_sample_rank, 3, timeout=300)):
        assert got == want, (rank, got, want)


# --------------------------------------------------------------------------- crop by hand


CALLS = [("prefill",), ("crop", -3), ("new", 4), ("crop", -2), ("new", 1), ("new", 1), ("new", 1),
         ("crop", -6), ("new", 3), ("keep", 12), ("new", 1), ("new", 2), ("new", 1), ("new", 8), ("new", 5)]
"""A prefill of two left-padded prompts (14 and 9 tokens), cuts into the prefill and into decoded tokens
(``keep``: crop to a length, the positive form), forwards of one and of several new tokens; the last ones
take row 0 to 29 tokens, past what the first storage holds on all ranks together (the grown cache's rows
must place into its larger capacity)."""


def _crop_calls(model, cache_of, positive: bool):
    """Run CALLS; returns each forward's logits, the rows' real lengths after each call and the cache.
    positive: ``keep`` crops to the length (TreeCache), else by the negative count (DynamicCache of 5.x)."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (2, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    logits, lengths, cache = [], [], None
    with torch.no_grad():
        for call in CALLS:
            if call[0] == "prefill":
                out = model(ids, attention_mask=mask)
            elif call[0] == "new":
                new = torch.randint(1, 128, (2, call[1]), generator=g)
                mask = torch.cat([mask, torch.ones_like(new)], dim=1)
                out = model(new, attention_mask=mask, cache=cache)
            else:
                n = call[1] if call[0] == "crop" else call[1] - cache.get_seq_length()
                cache.crop(call[1] if call[0] == "keep" and positive else n)
                mask = mask[:, :mask.shape[1] + n]
                lengths.append(mask.sum(dim=1).tolist())
                continue
            cache = cache_of(out)
            logits.append(out.logits.float())
            lengths.append(mask.sum(dim=1).tolist())
    return logits, lengths, cache


def _cache_of(out):
    return out["cache"] if "cache" in out else out["past_key_values"]


def _crop_rank(rank, world):
    import megatron_tree as mt
    import megatron_tree.integrations.hf.cache as hf_cache
    from tests.helpers.hf_models import hf_model
    from megatron_tree.integrations.hf import enable_tree_attention

    hf_cache._HEADROOM = 1  # an unsized cache with room for one more token: it grows after cuts
    groups = mt.TreeGroups.build()
    model = enable_tree_attention(hf_model("llama", seed=3), groups, block_size=2)
    seen = []

    def cache_of(out):
        c = _cache_of(out)
        seen.append((c.lengths, c.get_seq_length(), c.shard_lengths, c.storage.max_seq_len, c.storage.capacity))
        return c

    logits, lengths, cache = _crop_calls(model, cache_of, True)
    st = cache.storage
    placed = [row.positions(groups.rank) for row in st._rows]
    stored = [st.positions[b, :int(st.seqlens[b])].tolist() for b in range(2)]
    return [t.tolist() for t in logits], lengths, seen, placed == stored  # (plain lists cross the process boundary)


@pytest.mark.parametrize("world", [2, 3])
def test_crop_then_continue_equals_a_dynamic_cache(world):
    """Crops into the prefill and into decoded tokens, then forwards of one and several tokens: the logits of a
    single-process DynamicCache given the same calls (crop(-n); ``keep`` as the negative count), every rank."""
    from tests.helpers.hf_models import hf_model

    ref = hf_model("llama", seed=3)
    want, want_lengths, _ = _crop_calls(ref, _cache_of, False)
    for rank, (logits, lengths, seen, consistent) in enumerate(run_ranks(_crop_rank, world, timeout=300)):
        assert lengths == want_lengths, (rank, lengths, want_lengths)
        assert len(logits) == len(want)
        for i, (a, b) in enumerate(zip(logits, want)):
            torch.testing.assert_close(torch.tensor(a), b, rtol=0, atol=5e-5,
                                       msg=lambda m, rank=rank, i=i: f"rank {rank}, forward {i}: {m}")
        # real lengths, global length, shards adding up to the rows, the cache grown after a cut
        for (lens, seq, shards, *_), real in zip(seen, [want_lengths[i] for i, c in enumerate(CALLS)
                                                       if c[0] in ("prefill", "new")]):
            assert lens == real and [sum(s) for s in shards] == real and seq == real[0]  # (row 0 is unpadded)
        assert seen[-1][3] > seen[0][3], "the cache never grew: the test would not reach continue_from"
        assert seen[-1][0][0] > world * seen[0][4], "the rows never outgrew the first storage's slots on every rank"
        assert consistent, "a rank's stored positions differ from its placement"


# --------------------------------------------------------------------------- placement and refusals


@pytest.mark.parametrize("cp", [1, 2, 3])
@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
def test_row_placement_truncate_keeps_each_ranks_prefix(cp, layout):
    from megatron_tree.decode.placement import RowPlacement

    prompt, appended = 11, 9
    for keep in range(prompt + appended + 1):
        row = RowPlacement(cp, layout=layout, block_size=3)
        row.place_prompt(prompt)
        row.append(appended)
        before = [row.positions(r) for r in range(cp)]
        row.truncate(keep)
        assert row.total == keep and sum(row.counts) == keep
        for r in range(cp):
            assert row.positions(r) == [t for t in before[r] if t < keep], (keep, r)  # a prefix of each rank's slots
        if keep:
            owners = row.append(5)  # appending goes on from the cut row, by the rule
            assert row.total == keep + 5 and all(row.locate(keep + i)[0] == o for i, o in enumerate(owners))
            assert sorted(t for r in range(cp) for t in row.positions(r)) == list(range(keep + 5))
    from megatron_tree.decode.placement import PlacementError

    with pytest.raises(PlacementError, match=r"truncate needs 0 <= length <= 20 \(the row's tokens\), got 21"):
        row = RowPlacement(cp)
        row.place_prompt(prompt)
        row.append(appended)
        row.truncate(21)


def test_bad_crops_are_refused():
    from tests.helpers.hf_models import hf_model
    from megatron_tree.decode.cache import ShardedKVCache
    from megatron_tree.integrations.hf import TreeCache, enable_tree_attention

    model = enable_tree_attention(hf_model("llama", seed=1), None)
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    cache = TreeCache(model, None)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
    with pytest.raises(ValueError, match=r"holds 6 tokens per row .* cannot be cropped to a larger length"):
        cache.crop(7)
    with pytest.raises(TypeError, match="takes an integer"):
        cache.crop(1.5)
    with pytest.raises(ValueError, match=r"would leave rows \[1\] without a token \(they hold \[2\] real tokens, 2"):
        cache.crop(-2)
    cache.crop(0)
    cache.crop(6)  # nothing to cut
    assert cache.lengths == [6, 2]
    cache.crop(-1)
    assert cache.lengths == [5, 1] and cache.get_seq_length() == 5
    # Several new tokens: the padding check covers them all, not only the last (nothing is stored).
    new = torch.tensor([[5, 6, 7], [8, 9, 10]])
    padded = torch.cat([mask[:, :5], torch.tensor([[1, 1, 1], [1, 0, 1]])], dim=1)
    with torch.no_grad(), pytest.raises(ValueError, match=r"marks a new \(decoded\) token as padding"):
        model(new, attention_mask=padded, cache=cache)
    assert cache.lengths == [5, 1] and cache.get_seq_length() == 5
    empty = TreeCache(model, None)
    empty.crop(0)
    with pytest.raises(ValueError, match="would remove 2 tokens from a cache holding 0"):
        empty.crop(-2)
    st = ShardedKVCache(num_layers=1, batch_size=2, max_seq_len=16, num_kv_heads=1, head_dim=4, cp_size=2)
    st.start_prefill([5, 3])
    with pytest.raises(ValueError, match=r"row 1 holds 3 tokens and cannot be cut to 4"):
        st.truncate([5, 4])
    with pytest.raises(ValueError, match=r"expected 2 integer row lengths"):
        st.truncate([5])


def _disagree_rank(rank, world):
    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention

    groups = mt.TreeGroups.build()
    model = _target(4)
    prompt = _prompt(model)
    small = _assistant(model)
    enable_tree_attention(model, groups)
    with torch.no_grad():
        noise = torch.randn(small.lm_head.weight.shape, generator=torch.Generator().manual_seed(rank))
        small.lm_head.weight.add_(5 * noise)  # each rank's assistant drafts other candidates
        assisted = outcome(lambda: model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                                  assistant_model=small))
        out = model(prompt)  # the same prompt, then other new tokens on each rank
        chain = outcome(lambda: model(torch.tensor([[7, 8, 9 + rank]]), cache=_cache_of(out)))
        lengths = out["cache"].lengths
    return assisted, chain, lengths


def test_ranks_with_different_candidates_are_refused_alike():
    results = run_ranks(_disagree_rank, 2, timeout=300)
    for assisted, chain, lengths in results:
        # the first round prefills the prompt with each rank's candidates: the prefill's comparison refuses it
        assert assisted[0] == "DisagreementError" and "hf.prefill" in assisted[1], assisted
        assert chain[0] == "DisagreementError" and "hf.decode_chain" in chain[1] and "input_ids" in chain[1], chain
        assert lengths == [33]  # refused before anything was stored
    assert results[0][1][1] == results[1][1][1]  # the same error on every rank


def _agree_rank(rank, world):
    import megatron_tree as mt
    from megatron_tree.integrations.hf.generate import _TokensAgree

    check = _TokensAgree(mt.TreeGroups.build(), None)
    ids = torch.tensor([[3, 9, 4, 7, 7, 2], [5, 1, 8, 8, 6, 6]])
    same = check(ids, None)
    swapped = ids.clone()
    if rank == 1:  # two earlier tokens of row 1 swapped: the same length, last token and sum of tokens
        swapped[1, 1], swapped[1, 2] = ids[1, 2], ids[1, 1]
    inner = outcome(lambda: check(swapped, None))
    longer = outcome(lambda: check(torch.cat([ids[:, :1], ids], dim=1) if rank == 2 else ids, None))
    return same.tolist(), inner, longer


def test_ranks_whose_sequences_differ_are_refused_alike():
    """_TokensAgree compares whole rows (an assisted step appends several tokens): a rank whose row differs
    before its last token, or is longer, fails on every rank with one message."""
    results = run_ranks(_agree_rank, 3, timeout=120)
    for same, inner, longer in results:
        assert same == [False, False]
        assert inner[0] == "RuntimeError" and "chose different tokens at generated step 2" in inner[1], inner
        assert "sequence lengths [[6, 6], [6, 6], [6, 6]]" in inner[1], inner
        assert longer[0] == "RuntimeError" and "sequence lengths [[6, 6], [6, 6], [7, 7]]" in longer[1], longer
    assert len({(r[1][1], r[2][1]) for r in results}) == 1  # the same errors on every rank


# --------------------------------------------------------------------------- other architectures

ARCHS = ("deepseek-v3", "phi3-longrope", "qwen2-moe", "mistral-sliding", "gemma2", "gpt-oss")
"""MLA (the latent is cached: the layer expands the shard and the new tokens together, and the new tokens'
part is split off again), length-dependent RoPE, a MoE; sliding windows (of 5, shorter than two of the
prompts) on every layer, and alternating with full layers under soft-capping (Gemma 2) and with attention
sinks (GPT-OSS): each new token sees the keys its window holds, by global position."""


def _arch_calls(model, ids, mask, cache_of, cache=None):
    """Prefill a left-padded batch (13, 8 and 3 tokens), 4 new tokens, crop 5 (the 3-token row's cut reaches into
    its prefill), 2 new, 1 new, 7 new (longer than the windows: the last new tokens' windows drop the first ones);
    returns the logits of every forward as lists. cache: the prefill's (the
    one-process reference passes a ``DynamicCache()`` of full layers: transformers' sliding-window layers keep
    only the window and cannot be cropped once it is full; the model's masks apply the windows either way)."""
    g = torch.Generator().manual_seed(3)
    out = []
    with torch.no_grad():
        res = model(ids, attention_mask=mask, **({} if cache is None else {"cache": cache}))
        out.append(res.logits)
        for step in (4, -5, 2, 1, 7):
            cache = cache_of(res)
            if step < 0:
                cache.crop(step)
                mask = mask[:, :step]
                continue
            new = torch.randint(1, 60, (ids.shape[0], step), generator=g)
            mask = torch.cat([mask, torch.ones_like(new)], dim=1)
            res = model(new, attention_mask=mask, cache=cache)
            out.append(res.logits)
    return [t.float().tolist() for t in out]


def _arch_rank(rank, world):
    import benchmarks.architectures as A
    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention

    groups = mt.TreeGroups.build()
    ids, mask = A.batch()
    return {name: _arch_calls(enable_tree_attention(A.build(name), groups), ids, mask, _cache_of) for name in ARCHS}


def test_other_architectures_verify_several_tokens_exactly():
    A = pytest.importorskip("benchmarks.architectures", reason="needs transformers")
    ids, mask = A.batch()
    from transformers import DynamicCache

    want = {name: _arch_calls(A.build(name), ids, mask, _cache_of, DynamicCache()) for name in ARCHS}
    for rank, got in enumerate(run_ranks(_arch_rank, 3, timeout=300)):
        for name in ARCHS:
            for i, (a, b) in enumerate(zip(got[name], want[name], strict=True)):
                d = torch.tensor(a) - torch.tensor(b)
                if i == 0:  # the prefill: pad positions have no defined logits (the tree forward returns 0 there;
                    d = d * mask[:, :, None]  # Gemma 2's final soft-capping gives transformers' other values)
                err = float(d.abs().max())
                assert err <= A.LOGITS_ATOL, f"{name} rank {rank} forward {i}: max |dlogits| {err:.2e}"
