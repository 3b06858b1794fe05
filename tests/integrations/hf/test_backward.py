"""Tree attention has no backward, and a backward through it is an error, never a silently wrong gradient.

The kernels and the CP collectives record no autograd graph: a gradient through them would drop the attention's
part (the local ops) or the peers' rows (the collectives). Forwards with gradients enabled still give the same
outputs; a backward raises naming what has none. A transformers prefill at world 1 (plain SDPA, no op of ours)
keeps its exact gradient.
"""

from __future__ import annotations

import pytest
import torch

import megatron_tree as mt

from tests.helpers.ranks import run_ranks

NO_BACKWARD = "has no backward: megatron_tree's decode, merge and CP attention are inference only"


def test_the_ops_give_the_same_outputs_with_gradients_on_and_refuse_a_backward():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 12, 2, 16, generator=g)
    lens = torch.tensor([5, 12], dtype=torch.int32)
    want = mt.flash_decode(q, k, k, cache_seqlens=lens)
    qg = q.clone().requires_grad_()
    got = mt.flash_decode(qg, k, k, cache_seqlens=lens)
    assert all(torch.equal(a.detach(), b) for a, b in zip(got, want)) and got[0].requires_grad
    with pytest.raises(RuntimeError, match=f"flash_decode {NO_BACKWARD}"):
        got[0].sum().backward()
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)
    merged = mt.merge_states(outs.clone().requires_grad_(), lses)
    assert torch.equal(merged[0].detach(), mt.merge_states(outs, lses)[0])
    with pytest.raises(RuntimeError, match=f"merge_states {NO_BACKWARD}"):
        merged[0].sum().backward()
    with torch.no_grad():  # no gradient recorded: plain tensors, nothing wrapped
        assert mt.flash_decode(qg, k, k, cache_seqlens=lens)[0].grad_fn is None
    # only the keys, or only the partial lses, recording gradients: the same refusal, not a silently missing gradient
    out, _ = mt.flash_decode(q, k.clone().requires_grad_(), k, cache_seqlens=lens)
    assert torch.equal(out.detach(), want[0])
    with pytest.raises(RuntimeError, match=f"flash_decode {NO_BACKWARD}"):
        out.sum().backward()
    merged = mt.merge_states(outs, lses.clone().requires_grad_())
    with pytest.raises(RuntimeError, match=f"merge_states {NO_BACKWARD}"):
        merged[0].sum().backward()


def _backward(rank, world):
    import copy

    import torch
    import transformers as tf

    import megatron_tree as mt

    groups = mt.TreeGroups.build()
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 10, 2, 16, generator=g)
    q.requires_grad_()
    out = mt.tree_decode(q, k, k, groups, cache_seqlens=torch.tensor([4, 10], dtype=torch.int32))
    try:
        out.sum().backward()
        tree = "ran"
    except RuntimeError as e:
        tree = str(e)

    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    ref = tf.LlamaForCausalLM(copy.deepcopy(cfg))
    ref.load_state_dict(model.state_dict())
    mt.hf.enable_tree_attention(model, groups)
    ids = torch.randint(3, 64, (1, 9), generator=g)
    logits = model(ids).logits
    with torch.no_grad():
        same = torch.equal(logits.detach(), model(ids).logits)
    try:
        logits[:, -1].pow(2).sum().backward()
        ref(ids).logits[:, -1].pow(2).sum().backward()
        hf = max(float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
    except RuntimeError as e:
        hf = str(e)

    def refused(**kw):  # the message of a backward through another forward, or None if it ran
        m = mt.hf.enable_tree_attention(tf.LlamaForCausalLM(copy.deepcopy(cfg)), groups, **kw.pop("enable", {}))
        try:
            m(ids, **kw).logits.float().pow(2).sum().backward()
        except RuntimeError as e:
            return str(e)
        return None

    # a chunked prefill reads its earlier windows' keys back from the cache; logits_to_keep=1 leaves the last row's
    # logits to one rank, which the others receive by a collective: both refuse on every rank
    return tree, same, hf, refused(enable={"max_prefill_tokens": 4}), refused(logits_to_keep=1)


def test_a_backward_through_tree_attention_raises_on_every_rank_and_world_1s_prefill_stays_exact():
    [(tree, same, hf, chunked, kept)] = run_ranks(_backward, 1)
    assert NO_BACKWARD in tree and tree.startswith("flash_decode")  # world 1: the local op alone
    assert same and hf == 0.0  # a world-1 prefill in one forward runs no op of ours: transformers' own gradient
    assert chunked.startswith(f"a chunked prefill (max_prefill_tokens) with tree attention {NO_BACKWARD}"), chunked
    assert kept is None  # (one rank, one forward: nothing read back, the gradient is transformers')
    cp2 = f"a transformers forward with tree attention at CP > 1 {NO_BACKWARD}"
    for tree, same, hf, chunked, kept in run_ranks(_backward, 2):
        assert tree.startswith("the CP merge " + NO_BACKWARD), tree
        assert same  # the forward with gradients on gives the no-grad logits
        for got in (hf, chunked, kept):
            assert isinstance(got, str) and got.startswith(cp2), got
