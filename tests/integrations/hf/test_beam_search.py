"""transformers' beam search (``generate(num_beams=...)``) on a tree-enabled model at CP > 1.

Each step transformers reorders the cache by the surviving beams (``TreeCache.reorder_cache``): every
CP rank reorders its own shard of every row alike (``ShardedKVCache.reorder_rows``; the beams of one
prompt are placed alike over the ranks). The sequences must be transformers' own in one process, on
every rank -- a left-padded batch of prompts of different lengths, CP 2, 3 and 2 x 2, and a compiled
decode step -- and the reorder must have moved rows (else the comparison would not test it). Rows
placed differently cannot trade contents: a clear error naming both.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks

BEAMS, NEW = 3, 10


def _model():
    from tests.helpers.hf_models import hf_model

    model = hf_model("qwen2", seed=3)
    return model


def _inputs():
    from tests.helpers.hf_models import batch

    ids, mask = batch()  # prompts of 29, 17 and 1 tokens, left-padded
    return ids, mask


def _beam_generate(model, ids, mask):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, num_beams=BEAMS, num_return_sequences=2, max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False, early_stopping=False, length_penalty=0.0,
                              pad_token_id=0).tolist()


def _rank(rank, world, intra, compile_step):
    import megatron_tree as mt
    from megatron_tree.decode.cache import ShardedKVCache
    from megatron_tree.integrations.hf import enable_tree_attention

    moved = []
    inner = ShardedKVCache.reorder_rows

    def counted(self, order):
        moved.append(order != list(range(len(order))))
        return inner(self, order)

    ShardedKVCache.reorder_rows = counted
    groups = mt.TreeGroups.build(intra_size=intra) if intra else mt.TreeGroups.build()
    model = _model()
    enable_tree_attention(model, groups, compile_step={"backend": "aot_eager"} if compile_step else False)
    ids, mask = _inputs()
    return _beam_generate(model, ids, mask), sum(moved)


@pytest.mark.parametrize("world,intra,compile_step", [(2, None, False), (3, None, False), (4, 2, False),
                                                      (2, None, True)])
def test_beam_search_gives_transformers_own_sequences(world, intra, compile_step):
    want = _beam_generate(_model(), *_inputs())
    results = run_ranks(_rank, world, intra, compile_step, timeout=300)
    for rank, (got, moved) in enumerate(results):
        assert got == want, (rank, got, want)
        assert moved > 0, "no step reordered the beams: the comparison would not test reorder_cache"


def test_rows_placed_differently_cannot_trade_contents():
    from megatron_tree.decode.cache import ShardedKVCache

    cache = ShardedKVCache(num_layers=1, batch_size=2, max_seq_len=16, num_kv_heads=1, head_dim=4, cp_size=2)
    cache.start_prefill([5, 3])
    with pytest.raises(ValueError, match=r"row 0 would take row 1's tokens, but the two are placed differently over "
                                         r"the CP ranks \(lengths 5 and 3"):
        cache.reorder_rows([1, 1])
    with pytest.raises(ValueError, match=r"expected 2 row indices in \[0, 2\), got \[0, 2\]"):
        cache.reorder_rows([0, 2])
    cache.reorder_rows([0, 1])  # nothing moves
