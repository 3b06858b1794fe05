"""The library's decode loop on a transformers model in one process (CP = 1), against transformers.

``HFTreeModel`` (``integrations.hf``) puts transformers' own ``LlamaForCausalLM`` behind the
protocol :func:`megatron_tree.decode.generate.generate` drives (``new_cache``, ``prefill``,
``decode_step``). The model is a tiny random Llama (GQA, Llama-3 rope scaling, init std 0.2 so
greedy choices are never near-ties) saved with safetensors; the reference is the unmodified
transformers model in this process. The multi-rank runs of the same loop are
``test_generate.py``; the eval's ``model.source: random`` model is built here too.
"""

import os

import pytest
import torch

from megatron_tree.decode.cache import CacheOverflowError
from megatron_tree.decode.generate import generate
from tests.helpers.hf_models import NEW_TOKENS, PROMPTS, hf_greedy, make_checkpoint  # noqa: F401


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf = make_checkpoint(path)
    return path, hf


@pytest.fixture(scope="module")
def model(ckpt):
    from megatron_tree.integrations.hf import load_hf_model

    return load_hf_model(ckpt[0], None)


def test_loaded_logits_match_transformers_single_and_sharded(ckpt, tmp_path):
    from megatron_tree.integrations.hf import load_hf_model

    path, hf = ckpt
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="40KB")
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    ids = torch.randint(0, 128, (2, 70), generator=torch.Generator().manual_seed(1))
    # Logits reach ~6; fp32 rounding differs from transformers' by ~5e-6. atol 5e-5 (rtol 0)
    # leaves 10x room; rtol=atol=1e-4 allowed ~7e-4 and let a 1.00002-scaled cached key through.
    with torch.no_grad():
        ref = hf(ids).logits
        for where in (path, sharded):
            ours = load_hf_model(where, None).hf(ids, use_cache=False).logits  # tree attention, every position
            assert ours.shape == (2, 70, 128)
            torch.testing.assert_close(ours, ref, rtol=0, atol=5e-5)


def test_prefill_and_decode_logits_match_full_forward(ckpt, model):
    _, hf = ckpt
    seqs = [p + [7, 8, 9] for p in PROMPTS]
    cache = model.new_cache(2, 32, block_size=2)
    first = model.prefill(PROMPTS, cache)
    steps = [model.decode_step(torch.tensor([s[len(p) + i] for s, p in zip(seqs, PROMPTS)]), cache) for i in range(3)]
    with torch.no_grad():
        for b, s in enumerate(seqs):
            ref = hf(torch.tensor([s])).logits[0]
            n = len(PROMPTS[b])
            torch.testing.assert_close(first[b], ref[n - 1], rtol=0, atol=5e-5)
            for i, lg in enumerate(steps):
                torch.testing.assert_close(lg[b], ref[n + i], rtol=0, atol=5e-5)


@pytest.fixture(scope="module")
def expected(ckpt):
    return hf_greedy(ckpt[1], PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("layout", ["load_balanced", "contiguous"])
def test_greedy_generate_matches_transformers_cp1(model, expected, layout):
    cache = model.new_cache(2, 40, layout=layout, block_size=4)
    res = generate(model, PROMPTS, NEW_TOKENS, cache=cache, progress=False)
    assert res.tokens == expected
    assert len(res.step_times) == NEW_TOKENS - 1 and all(t > 0 for t in res.step_times)
    assert res.prefill_time > 0
    assert cache.lengths == [len(p) + NEW_TOKENS - 1 for p in PROMPTS]


def test_tied_embeddings(tmp_path):
    from safetensors import safe_open

    from megatron_tree.integrations.hf import load_hf_model

    hf = make_checkpoint(tmp_path, tie=True, seed=3)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = load_hf_model(tmp_path, None)
    assert model.hf.lm_head.weight.data_ptr() == model.hf.model.embed_tokens.weight.data_ptr()
    cache = model.new_cache(1, 16)
    first = model.prefill([PROMPTS[1]], cache)
    with torch.no_grad():
        torch.testing.assert_close(first[0], hf(torch.tensor([PROMPTS[1]])).logits[0, -1], rtol=0, atol=5e-5)


def test_random_source_is_seeded_and_an_ordinary_single_process_model():
    """``model.source: random``: transformers' Llama of the config's shape, the same weights for
    the same seed (every rank builds its own), exact through prefill and decode at CP 1."""
    from megatron_tree.eval.config import ModelConfig
    from megatron_tree.eval.models import random_llama
    from megatron_tree.integrations.hf import HFTreeModel

    m = ModelConfig(source="random", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64, seed=5)
    a, b, c = random_llama(m), random_llama(m), random_llama(ModelConfig(**{**vars(m), "seed": 6}))
    assert type(a).__name__ == "LlamaForCausalLM"
    assert a.config.head_dim == 8 and a.config.num_key_value_heads == 1 and a.config.initializer_range == 0.2
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa) and not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])
    model = HFTreeModel(a.eval(), None)
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.unsharded()(ids).logits[0]
    cache = model.new_cache(1, 16)
    first = model.prefill([ids[0, :5].tolist()], cache, method="allgather")
    torch.testing.assert_close(first[0], full[4], rtol=1e-5, atol=1e-5)
    for i in range(5, 9):
        out = model.decode_step(ids[:, i], cache)
        torch.testing.assert_close(out[0], full[i], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- bad input


def _rewrite(src, dst, edit):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_missing_and_misshapen_tensors_are_listed(ckpt, tmp_path):
    """The eval's loader refuses a class whose weights are not all in the files (transformers would
    re-initialise them), naming the tensors, and tensors the class has no place for (transformers
    would drop them): the checkpoint check every loader runs (integrations.hf.checkpoint)."""
    from megatron_tree.eval.config import ConfigError, ModelConfig
    from megatron_tree.eval.models import load_hf

    path, _ = ckpt

    def drop_and_add(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        del t["model.norm.weight"]
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)

    _rewrite(path, tmp_path / "a", drop_and_add)
    with pytest.raises(ConfigError) as e:
        load_hf(ModelConfig(source="hf", path=str(tmp_path / "a")))
    msg = str(e.value)
    assert f"'{tmp_path / 'a'}' holds no tensor for 2 weight(s) of LlamaForCausalLM" in msg, msg
    assert "would re-initialise them" in msg and "model.layers.1.mlp.up_proj.weight [" in msg, msg
    assert "model.norm.weight [" in msg and "model.layers.0.self_attn.q_norm.weight [16] in model.safetensors" in msg

    def misshape(t):
        t["model.embed_tokens.weight"] = torch.zeros(100, 64)

    _rewrite(path, tmp_path / "b", misshape)
    with pytest.raises(ConfigError, match=r"\(1 of other shapes\): model.embed_tokens.weight is \[100, 64\] in "
                                          r"model.safetensors, config.json gives \["):
        load_hf(ModelConfig(source="hf", path=str(tmp_path / "b")))


def test_bad_generation_input(model):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1, 2], []], 4, progress=False)
    with pytest.raises(ValueError, match="non-empty token-id lists"):
        model.prefill([[]], model.new_cache(1, 8))
    with pytest.raises(ValueError, match=r"outside \[0, 128\): \[128\]"):
        generate(model, [[1, 128]], 4, progress=False)
    # in range but not integers: the error says so, naming the values and their type
    with pytest.raises(TypeError, match=r"prompt 0: token ids must be integers, got \[1.0, 2.7, 3.0\] \(float\)"):
        generate(model, [[1.0, 2.7, 3.0]], 4, progress=False)
    with pytest.raises(TypeError, match=r"prompt 1: token ids must be integers, got \[True\] \(bool\)"):
        generate(model, [[1, 2], [3, True]], 4, progress=False)
    # stop_token_ids is a collection of ids: a single id is refused with the spelling that works
    with pytest.raises(TypeError, match=r"stop_token_ids must be a list \(or tuple/set\) of int token ids or None, "
                                        r"got int 5; for one id pass \[5\]"):
        generate(model, PROMPTS, 2, stop_token_ids=5, progress=False)
    with pytest.raises(TypeError, match=r"stop_token_ids must be a list .* got str '</s>'"):
        generate(model, PROMPTS, 2, stop_token_ids="</s>", progress=False)
    with pytest.raises(TypeError, match=r"stop_token_ids: token ids must be integers, got \[5.0\] \(float\)"):
        generate(model, PROMPTS, 2, stop_token_ids=[5.0], progress=False)
    # an id the model can never generate would never stop a row: a typo, refused
    for bad in ([-1], [3, 128], [10 ** 9]):
        with pytest.raises(ValueError, match=r"stop_token_ids outside the model's vocabulary \[0, 128\): \["):
            generate(model, PROMPTS, 2, stop_token_ids=bad, progress=False)
    cache = model.new_cache(2, 20)
    with pytest.raises(CacheOverflowError, match="prompt 1 has 13 tokens; with max_new_tokens=8 it needs 21"):
        generate(model, PROMPTS, 8, cache=cache, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, PROMPTS, 0, progress=False)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, PROMPTS, 2, do_sample=True, temperature=0.0, progress=False)
    with pytest.raises(ValueError, match="unknown prefill method 'zigzag'"):
        model.prefill(PROMPTS, cache, method="zigzag")
    # a cache that is full: the next decode step is refused, naming the size
    full = model.new_cache(2, 13)
    model.prefill(PROMPTS, full)
    with pytest.raises(CacheOverflowError, match="a row already holds 13 tokens"):
        model.decode_step(torch.tensor([1, 2]), full)


def test_sampling_seeded_and_filtered(model):
    kw = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9, progress=False)
    a = generate(model, PROMPTS, 8, seed=7, **kw).tokens
    b = generate(model, PROMPTS, 8, seed=7, **kw).tokens
    c = generate(model, PROMPTS, 8, seed=8, **kw).tokens
    assert a == b and a != c
    stop = a[0][2]
    d = generate(model, PROMPTS, 8, seed=7, stop_token_ids=[stop], **kw).tokens
    assert d[0] == a[0][: a[0].index(stop) + 1]


def test_sample_next_filters():
    from megatron_tree.decode.generate import sample_next

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    greedy = logits.argmax(-1)
    assert torch.equal(sample_next(logits, do_sample=True, top_k=1, generator=g), greedy)
    assert torch.equal(sample_next(logits, do_sample=True, top_p=1e-6, generator=g), greedy)
    top3 = torch.topk(logits, 3, dim=-1).indices
    draws = torch.stack([sample_next(logits, do_sample=True, top_k=3, generator=g) for _ in range(50)], 1)
    assert all(set(draws[b].tolist()) <= set(top3[b].tolist()) for b in range(3))
    assert any(len(set(draws[b].tolist())) > 1 for b in range(3))
    # temperature: logits [2, 0] give P(token 0) = sigmoid(2 / T)
    two = torch.tensor([[2.0, 0.0]]).expand(4000, 2)
    for t in (0.5, 1.0, 4.0):
        share = (sample_next(two, do_sample=True, temperature=t, generator=g) == 0).float().mean().item()
        assert abs(share - torch.sigmoid(torch.tensor(2.0 / t)).item()) < 0.03, (t, share)
    # top_p keeps the smallest set of most likely tokens whose mass reaches top_p (vocab order shuffled)
    lg = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()[None].expand(500, 4)
    for top_p, kept in ((0.4, {1}), (0.75, {1, 3}), (0.9, {0, 1, 3}), (1.0, {0, 1, 2, 3})):
        assert set(sample_next(lg, do_sample=True, top_p=top_p, generator=g).tolist()) == kept, top_p
