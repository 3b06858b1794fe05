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


def _models(world):
    """(the tree GPTModel at CP ``world``, its ``MegatronLM``, Megatron's own model at CP 1 with the same weights)."""
    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import checkpoint as mc
    from megatron_tree.integrations.megatron import model as mm

    groups = mt.initialize_model_parallel(world)
    shape = mm.GPTShape(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        initializer_range=0.2)
    src = mm.build_gpt(shape, tree=False, pg_collection=mm.single_rank_groups(), seed=7)
    model = mm.build_gpt(shape, tree=True, cp=world, seed=7)
    mc.fill_from_global(model, mc.global_tensors(src))
    return model, mm.MegatronLM(model, groups, shape), mm.MegatronReference(src)


def _rank(rank, world):
    from megatron.core import parallel_state

    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    with megatron_on_cpu():
        model, lm, ref = _models(world)
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


def _failing(module, times=1, pre=False):
    """A hook on ``module`` whose first ``times`` calls raise "boom"; returns its handle."""
    left = [times]

    def hook(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("boom")

    return module.register_forward_pre_hook(hook) if pre else module.register_forward_hook(hook)


def _after_every_layer(rank, world):
    """Failures after every layer stored its keys: the controller's retries, a row subset, and the engine going on."""
    from megatron.core import parallel_state

    from megatron_tree.integrations.megatron import TreeGPTInferenceWrapper
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    with megatron_on_cpu():
        model, lm, ref = _models(world)
        out = {}

        # the controller's path: the prefill raises after the last layer, decode steps raise before the output
        # layer (every layer stored its keys) -- step 2 twice in a row -- and after the final norm
        rows = [[3, 1, 4, 1, 5, 9, 2], [6, 0, 2, 8, 1, 8, 2]]
        ctx = lm.new_cache(len(rows), 32, block_size=2)
        wrapper = TreeGPTInferenceWrapper(model, ctx)
        wrapper.prep_model_for_inference()
        tokens = torch.zeros(len(rows), 32, dtype=torch.long)
        tokens[:, :len(rows[0])] = torch.tensor(rows)
        inputs = wrapper.prep_inference_input(tokens)
        fails = {0: (model.decoder.layers[-1], 1, False), 1: (model.output_layer, 1, True),
                 2: (model.output_layer, 2, True), 3: (model.decoder.final_layernorm, 1, False)}
        start, end, raised, errs = 0, len(rows[0]), 0, []
        for step in range(6):
            if step:
                ctx.enable_decode_mode()
            window = wrapper.get_batch_for_context_window(inputs, start, end)
            if step in fails:
                module, times, pre = fails[step]
                hook = _failing(module, times, pre)
                for _ in range(times):
                    try:
                        wrapper.run_one_forward_step(window)
                    except RuntimeError:
                        raised += 1
                hook.remove()
            logits = wrapper.run_one_forward_step(window)[:, -1].float()
            errs.append(float((logits - ref(inputs["tokens"][:, :end])[:, -1].float()).abs().max()))
            inputs["tokens"][:, end] = logits.argmax(-1)
            start, end = end, end + 1
        out["controller"] = {"raised": raised, "errs": errs, "step": ctx.step}

        # a subset of the rows (batch_size_offset 1): row 1's prefill raises after the last layer; row 0 keeps
        # its tokens, row 1 is empty again, and the retried prefill and the decode steps after it are exact
        seqs = [[3, 1, 4, 1, 5, 9, 2], [6, 0, 2, 8, 1, 8, 2]]
        ctx = lm.new_cache(2, 32, block_size=2)
        wrapper = TreeGPTInferenceWrapper(model, ctx)
        wrapper.prep_model_for_inference()

        def forward(toks, offset):
            ctx.batch_size_offset = offset
            try:
                return wrapper._forward({"tokens": torch.tensor(toks), "position_ids": None, "attention_mask": None,
                                         "inference_context": ctx})[:, -1].float()
            finally:
                ctx.batch_size_offset = 0

        ctx.materialize_only_last_token_logits = True
        first = forward(seqs[:1], 0)
        hook = _failing(model.decoder.layers[-1])
        try:
            forward(seqs[1:], 1)
        except RuntimeError:
            pass
        finally:
            hook.remove()
        out["subset_after"] = (ctx.lengths(), ctx.step)
        ids = torch.cat([first, forward(seqs[1:], 1)]).argmax(-1)
        sub_errs = []
        ctx.sequence_len_offset = len(seqs[0])
        ctx.enable_decode_mode()
        for _ in range(3):
            for s, t in zip(seqs, ids.tolist()):
                s.append(t)
            logits = forward([[t] for t in ids.tolist()], 0)
            ctx.sequence_len_offset += 1
            sub_errs.append(float((logits - ref(torch.tensor(seqs))[:, -1].float()).abs().max()))
            ids = logits.argmax(-1)
        out["subset_errs"] = sub_errs
        parallel_state.destroy_model_parallel()
    return out


def test_failures_after_every_layer_stored_its_keys_are_taken_back():
    """A prefill that raises after the last layer, a decode step that raises before the output layer (twice in a
    row) or after the final norm: every layer wrote its keys, and the retries are exact all the same. A prefill of
    a subset of the rows (``batch_size_offset``) that raises empties only its own rows."""
    for r in run_ranks(_after_every_layer, 3, timeout=300):
        assert r["controller"]["raised"] == 5 and r["controller"]["step"] is None, r["controller"]
        assert max(r["controller"]["errs"]) <= 1e-4, r["controller"]["errs"]
        assert r["subset_after"] == ([7, 0], None), r["subset_after"]
        assert max(r["subset_errs"]) <= 1e-4, r["subset_errs"]
