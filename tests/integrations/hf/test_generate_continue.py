"""A tree-enabled model's ``generate`` continuing the cache an earlier ``generate`` returned (multi-turn
use), the assisted-decoding settings refused before generation starts, and assisted decoding (prompt
lookup, an assistant model) on a sliding-window model equal to transformers in one process.

generate sizes the ``TreeCache`` it makes for its own ``max_new_tokens``; a later call handed that
cache (``past_key_values=out.past_key_values``) asks for more tokens than it was sized for, so the
storage grows (its placement copied, ``ShardedKVCache.continue_from``) -- at CP 2 and 3 the two turns
give transformers' one-process tokens (a DynamicCache continued the same way). A new-user review found
the second turn raising CacheOverflowError with advice that did not apply.
"""

from __future__ import annotations

import torch

from tests.helpers.ranks import outcome, run_ranks

FIRST, SECOND = 3, 12


def _model(arch="llama", **over):
    from tests.helpers.hf_models import hf_model

    model = hf_model(arch, seed=3, **over)
    model.generation_config.eos_token_id = None
    return model


def _two_turns(model, prompt, follow):
    """generate FIRST tokens, append ``follow`` (the user's next turn), generate SECOND more on the same cache."""
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=FIRST, do_sample=False, return_dict_in_generate=True)
        ids = torch.cat([out.sequences, follow], dim=1)
        out2 = model.generate(ids, past_key_values=out.past_key_values, max_new_tokens=SECOND, do_sample=False,
                              return_dict_in_generate=True)
    return out.sequences[0].tolist(), out2.sequences[0].tolist(), out2.past_key_values


def _body(rank, world, intra):
    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention

    prompt = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    follow = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    ref = _two_turns(_model(), prompt, follow)[:2]
    groups = mt.TreeGroups.build(intra_size=intra)
    model = enable_tree_attention(_model(), groups)
    first, second, cache = _two_turns(model, prompt, follow)
    res = {"ref": ref, "got": (first, second), "lengths": cache.lengths, "shards": cache.shard_lengths,
           "capacity": cache.storage.capacity}

    # refused before any forward, naming what to change
    assistant = _model(num_hidden_layers=1)
    res["early_exit"] = outcome(lambda: model.generate(prompt, max_new_tokens=4, assistant_early_exit=1))
    tree_assistant = enable_tree_attention(_model(num_hidden_layers=1), groups)
    res["tree_assistant"] = outcome(lambda: model.generate(prompt, max_new_tokens=4, assistant_model=tree_assistant))
    # sliding windows (8, shorter than the 11-token prompt): assisted decoding as transformers in one process
    windowed = enable_tree_attention(_model("mistral", sliding_window=8), groups)
    plain = _model("mistral", sliding_window=8)
    with torch.no_grad():
        for case, kw in (("window_lookup", {"prompt_lookup_num_tokens": 3}),
                         ("window_assistant", {"assistant_model": assistant})):
            res[case] = tuple(m.generate(prompt, max_new_tokens=10, do_sample=False, **kw)[0].tolist()
                              for m in (windowed, plain))
    with torch.no_grad():  # the windowed model still generates plainly, and exactly
        res["window_plain"] = (windowed.generate(prompt, max_new_tokens=6, do_sample=False)[0].tolist(),
                               _model("mistral", sliding_window=8).generate(prompt, max_new_tokens=6,
                                                                            do_sample=False)[0].tolist())
    # a sized cache (max_seq_len) still refuses to grow, naming the size
    from megatron_tree.integrations.hf import TreeCache

    small = TreeCache(model, groups, max_seq_len=14)
    res["sized"] = outcome(lambda: model.generate(prompt, past_key_values=small, max_new_tokens=8))
    return res


def test_second_generate_on_the_returned_cache_grows_it_and_equals_one_process():
    for world, intra in ((2, None), (3, None)):
        for res in run_ranks(_body, world, intra, timeout=300):
            first, second = res["got"]
            assert (first, second) == tuple(res["ref"]), (world, res["got"], res["ref"])
            assert len(second) == len(first) + 5 + SECOND
            assert res["lengths"] == [len(second) - 1]  # (the last drawn token is not stored yet)
            assert sum(res["shards"][0]) == res["lengths"][0]
            # grown past what the first call sized: ceil((11 + 3) / world) + 1 slots
            assert res["capacity"] > -(-(11 + FIRST) // world) + 1, res["capacity"]

            kind, msg, _ = res["early_exit"]
            assert kind == "NotImplementedError" and "assistant_early_exit=1" in msg and "assistant_model" in msg, msg
            kind, msg, _ = res["tree_assistant"]
            assert kind == "ValueError" and "assistant_model has tree attention enabled" in msg, msg
            assert "disable_tree_attention" in msg, msg
            for case in ("window_lookup", "window_assistant"):
                assert res[case][0] == res[case][1], (world, case, res[case])
            assert res["window_plain"][0] == res["window_plain"][1]
            kind, msg, _ = res["sized"]
            assert kind == "CacheOverflowError" and "max_seq_len=14" in msg, msg


def test_a_continued_generate_whose_mask_hides_a_decoded_token_is_refused():
    """Without an attention_mask, generate makes one from pad_token_id: continuing a cache whose decoded tokens
    include the pad token id hides them (transformers masks them out; the tree cache holds them and would attend
    to them: a silent other answer before). Refused on the step's host half naming the mask, with the cache as it
    was; continued with the mask, the tokens are transformers' own."""
    import pytest

    from megatron_tree.integrations.hf import enable_tree_attention

    prompt = torch.tensor([[5, 17, 90, 3, 42, 8]])
    with torch.no_grad():
        first = _model().generate(prompt, max_new_tokens=FIRST, do_sample=False)
    pad = int(first[0, prompt.shape[1]])  # the first decoded token, which the cache holds, taken as the pad id
    assert pad not in prompt[0].tolist()  # (else the prompt itself holds the pad id: the prefill's own error)
    plain, model = _model(), enable_tree_attention(_model(), None)
    for m in (plain, model):
        m.generation_config.pad_token_id = pad
    with torch.no_grad():
        want = plain.generate(prompt, max_new_tokens=FIRST, do_sample=False, return_dict_in_generate=True)
        out = model.generate(prompt, max_new_tokens=FIRST, do_sample=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, want.sequences) and torch.equal(out.sequences, first)
        cache, length = out.past_key_values, out.past_key_values.get_seq_length()
        with pytest.raises(ValueError, match="a generated token equal to the pad token id then looks like padding"):
            model.generate(out.sequences, past_key_values=cache, max_new_tokens=SECOND, do_sample=False)
        assert cache.get_seq_length() == length and cache.lengths == [prompt.shape[1] + FIRST - 1]
        mask = torch.ones_like(out.sequences)
        again = model.generate(out.sequences, attention_mask=mask, past_key_values=cache, max_new_tokens=SECOND,
                               do_sample=False)
        expected = plain.generate(want.sequences, attention_mask=mask, past_key_values=want.past_key_values,
                                  max_new_tokens=SECOND, do_sample=False)
    assert torch.equal(again, expected), (again, expected)


def _package_loop_growing(rank, world):
    """decode.generate on TreeCaches the caller made without a size or a batch: eager's tokens, the storage grown."""
    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel, TreeCache

    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (13, 8, 3)]
    model = HFTreeModel(_model(), mt.TreeGroups.build() if world > 1 else None)
    want = generate(model, prompts, 30, progress=False).tokens
    out = {}
    for name, kw in (("unsized", {}), ("small", {"new_tokens": 2}), ("rows", {"batch_size": 3})):
        cache = TreeCache(model.hf, model.groups, **kw)
        out[name] = (generate(model, prompts, 30, progress=False, cache=cache).tokens == want, cache.storage.max_seq_len)
    out["wrong_rows"] = outcome(lambda: generate(model, prompts, 4, progress=False,
                                                 cache=TreeCache(model.hf, model.groups, batch_size=2)))
    return out


def test_the_package_loop_takes_a_cache_that_grows():
    """A TreeCache made without max_seq_len grows as rows need, and one without batch_size takes the prompts'
    rows: decode.generate takes them (it compared the prompts with a size of None and a batch of -1 before: a
    TypeError, or a refusal naming batch size -1), with the default cache's tokens, at CP 1 and 2; a cache made
    for another batch is still refused by name."""
    for world in (1, 2):
        for r in run_ranks(_package_loop_growing, world, timeout=300):
            assert r["unsized"][0] and r["rows"][0] and r["small"][0], r
            assert r["small"][1] >= 13 + 30 > 2 * 13, r  # (sized for 13 + 2 at prefill, then doubled as needed)
            kind, said = r["wrong_rows"][:2]  # (at CP 2 naming the ranks: "ranks [0, 1]: ...")
            assert kind == "ValueError" and said.endswith("cache has batch size 2 but 3 prompts were given"), r
