"""``MegatronLM.prefill_logits`` (the lm-eval backend's ``source=megatron`` scoring) at CP 2 against Megatron at CP 1.

Two gloo ranks build a tiny GPTModel with tree attention at CP 2 and Megatron's own model
(``DotProductAttention``, CP = TP = 1) with the same weights; prompts of three lengths, two of
them equal (one forward for both), are prefilled CP-sharded keeping the last ``keep`` positions'
logits, ``keep`` longer than the shortest prompt (its missing positions must be zeros). Each row
must be Megatron's full causal forward at those positions within 1e-4, on both ranks, and the
cache must continue with ``decode_step`` from there. No lm-eval: this file runs on both
megatron-core lanes (0.16.1 here, 0.19 in ``.ci/megatron312.sh``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], [6, 0, 2]]
KEEP = 5


def _rank(rank, world):
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import checkpoint as mc
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    with megatron_on_cpu():
        groups = mt.initialize_model_parallel(2)
        shape = mm.GPTShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            initializer_range=0.2)
        src = mm.build_gpt(shape, tree=False, pg_collection=mm.single_rank_groups(), seed=7)
        model = mm.build_gpt(shape, tree=True, cp=2, seed=7)
        mc.fill_from_global(model, mc.global_tensors(src))
        lm = mm.MegatronLM(model, groups, shape)
        ref = mm.MegatronReference(src)
        cache = lm.new_cache(len(PROMPTS), 16)
        got = lm.prefill_logits(PROMPTS, cache, KEEP)
        err, pad = 0.0, 0.0
        for b, p in enumerate(PROMPTS):
            full = ref(torch.tensor([p]))[0].float()
            n = min(KEEP, len(p))
            err = max(err, float((got[b, KEEP - n:] - full[len(p) - n:]).abs().max()))
            pad = max(pad, float(got[b, :KEEP - n].abs().max()) if KEEP > n else 0.0)
        # The cache holds every prompt: one decode step continues each row exactly.
        nxt = got[:, -1].argmax(-1)
        step = lm.decode_step(nxt, cache)
        dec = max(float((step[b] - ref(torch.tensor([p + [int(nxt[b])]]))[0, -1].float()).abs().max())
                  for b, p in enumerate(PROMPTS))
        parallel_state.destroy_model_parallel()
    return {"shape": tuple(got.shape), "err": err, "pad": pad, "decode_err": dec, "logits": got.tolist()}


def test_prefill_logits_cp2_match_megatron_cp1():
    res = run_ranks(_rank, 2, timeout=300)
    for r in res:
        assert r["shape"] == (len(PROMPTS), KEEP, 64)
        assert r["err"] <= 1e-4, f"kept logits differ from Megatron's CP 1 forward by {r['err']}"
        assert r["pad"] == 0.0, "positions before a short prompt must be zeros"
        assert r["decode_err"] <= 1e-4, f"decode after prefill_logits differs by {r['decode_err']}"
    assert res[0]["logits"] == res[1]["logits"], "the CP ranks' assembled logits differ"
