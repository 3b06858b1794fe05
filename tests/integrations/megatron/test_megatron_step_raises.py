"""``MegatronLM.decode_step`` whose forward raises leaves the cache as before the call: the next step is exact.

The step's tokens are placed (``TreeInferenceContext.plan_decode``) before the layers run, and the layers
that run store their keys there. If a later layer raises, the placement must be taken back, or the next
step lands one slot further and every later step reads a stray key (wrong logits, no error). Three gloo
ranks (CP 3) build a tiny GPTModel with tree attention and Megatron's own model (CP = TP = 1) with the same
weights; two rows of different lengths are prefilled, a decode step raises in the second layer (a pre-hook),
then decoding goes on on the same cache, each step against Megatron's full causal forward. Driven by hand
(``plan_step``, the model's forward, ``commit_step``), a step whose forward raised stays planned: planning the
next one must say to take it back with ``rewind_step()``, after which the step runs exact. Through Megatron's
``TreeGPTInferenceWrapper`` a prefill or decode forward that raises is taken back by the wrapper itself
(``TreeInferenceContext.abandon_step``), so the controller's retry of the same window is exact.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed")

STEPS = 4


def _rank(rank, world):
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import checkpoint as mc
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    with megatron_on_cpu():
        groups = mt.initialize_model_parallel(world)
        shape = mm.GPTShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            initializer_range=0.2)
        src = mm.build_gpt(shape, tree=False, pg_collection=mm.single_rank_groups(), seed=7)
        model = mm.build_gpt(shape, tree=True, cp=world, seed=7)
        mc.fill_from_global(model, mc.global_tensors(src))
        lm = mm.MegatronLM(model, groups, shape)
        ref = mm.MegatronReference(src)
        seqs = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [6, 0, 2]]
        cache = lm.new_cache(len(seqs), 32, block_size=2)  # blocks of 2: new tokens move across ranks
        ids = lm.prefill(seqs, cache).argmax(-1)
        lengths = [cache.shard_lens(b) for b in range(len(seqs))]

        def boom(module, args, kwargs):
            raise RuntimeError("layer 2 failed")

        hook = model.decoder.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
        try:
            lm.decode_step(ids, cache)
            raised = None
        except RuntimeError as e:
            raised = str(e)
        finally:
            hook.remove()
        after = {"raised": raised, "step": cache.step,
                 "same_shards": [cache.shard_lens(b) for b in range(len(seqs))] == lengths}
        errs = []
        for _ in range(STEPS):
            for s, t in zip(seqs, ids.tolist()):
                s.append(t)
            logits = lm.decode_step(ids, cache)
            errs.append(max(float((logits[b] - ref(torch.tensor([s]))[0, -1].float()).abs().max())
                            for b, s in enumerate(seqs)))
            ids = logits.argmax(-1)
        # Driven by hand (plan_step, the model's forward, commit_step): a forward that raised leaves its step
        # planned; planning the next one says how to take it back, and after rewind_step it runs exact.
        rows = [[3, 1, 4, 1, 5], [6, 0, 2, 8, 1]]
        ctx = lm.new_cache(len(rows), 32, block_size=2)
        nxt = lm.prefill(rows, ctx).argmax(-1)
        for r, t in zip(rows, nxt.tolist()):
            r.append(t)
        plan = ctx.plan_step(len(rows[0]) - 1, 1)
        hook = model.decoder.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
        try:
            model(nxt[:, None], plan.positions, None, inference_context=ctx, runtime_gather_output=True)
        except RuntimeError:
            pass
        finally:
            hook.remove()
        try:
            ctx.plan_step(len(rows[0]) - 1, 1)
            replan = None
        except RuntimeError as e:
            replan = str(e)
        ctx.rewind_step()
        plan = ctx.plan_step(len(rows[0]) - 1, 1)
        logits = model(nxt[:, None], plan.positions, None, inference_context=ctx, runtime_gather_output=True)[:, -1]
        ctx.commit_step()
        by_hand = max(float((logits[b] - ref(torch.tensor([r]))[0, -1].float()).abs().max())
                      for b, r in enumerate(rows))
        wrapped = _through_wrapper(model, lm, ref, boom)
        parallel_state.destroy_model_parallel()
    return {"after": after, "errs": errs, "replan": replan, "by_hand": by_hand, "wrapped": wrapped}


def _through_wrapper(model, lm, ref, boom):
    """Megatron's controller path (``TreeGPTInferenceWrapper.run_one_forward_step``): a prefill and a decode
    step whose forwards raise are taken back, so the controller's retry of the same window is exact."""
    from megatron_tree.integrations.megatron import TreeGPTInferenceWrapper

    rows = [[3, 1, 4, 1, 5, 9, 2], [6, 0, 2, 8, 1, 8, 2]]
    ctx = lm.new_cache(len(rows), 32, block_size=2)
    wrapper = TreeGPTInferenceWrapper(model, ctx)
    wrapper.prep_model_for_inference()
    tokens = torch.zeros(len(rows), 32, dtype=torch.long)
    tokens[:, :len(rows[0])] = torch.tensor(rows)
    inputs = wrapper.prep_inference_input(tokens)
    start, end, out = 0, len(rows[0]), {"raised": [], "errs": []}
    for step in range(3):
        if step:
            ctx.enable_decode_mode()
        window = wrapper.get_batch_for_context_window(inputs, start, end)
        hook = model.decoder.layers[1].register_forward_pre_hook(boom, with_kwargs=True)
        try:
            wrapper.run_one_forward_step(window)
        except RuntimeError as e:
            out["raised"].append(str(e))
        finally:
            hook.remove()
        out["step"] = None if ctx.step is None else ctx.step.mode  # (a plan holds tensors: not sent back)
        logits = wrapper.run_one_forward_step(window)[:, -1].float()  # the controller's retry of the same window
        seen = inputs["tokens"][:, :end]
        out["errs"].append(float((logits - ref(seen)[:, -1].float()).abs().max()))
        inputs["tokens"][:, end] = logits.argmax(-1)
        start, end = end, end + 1
    return out


def test_decode_step_that_raises_leaves_the_cache_as_before():
    for r in run_ranks(_rank, 3, timeout=300):
        assert r["after"] == {"raised": "layer 2 failed", "step": None, "same_shards": True}, r["after"]
        assert max(r["errs"]) <= 1e-4, r["errs"]  # every step after the failed one matches Megatron at CP 1
        assert r["replan"] is not None and "take it back with rewind_step()" in r["replan"], r["replan"]
        assert r["by_hand"] <= 1e-4, r["by_hand"]
        # through Megatron's wrapper: the prefill and two decode steps each raised once, and their retries are exact
        assert r["wrapped"]["raised"] == ["layer 2 failed"] * 3 and r["wrapped"]["step"] is None, r["wrapped"]
        assert max(r["wrapped"]["errs"]) <= 1e-4, r["wrapped"]["errs"]
