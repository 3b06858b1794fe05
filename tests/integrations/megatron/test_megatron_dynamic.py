"""Megatron-Core's DynamicInferenceEngine at CP 2, CP 4 and CP [2, 2] against its own engine at CP = 1.

One 4-rank gloo run builds the same tiny GPTModel (2 layers, hidden 64, GQA 4/2, RoPE, fp32)
with Megatron's own attention at CP = 1 (the reference: Megatron's dynamic context and its
flash-attn path, which on CPU runs through the shim's torch stand-ins) and with our layer
spec at CP 2 (two replicas), CP 4 and CP [2, 2]. Four requests -- prompts of 5, 64, 300 and
1 tokens, the last two arriving after the first decode steps, each generating a different
number of tokens -- run through ``DynamicInferenceEngine`` with chunked prefill (128 tokens
per step, so the 300-token prompt arrives in chunks). Every CP configuration uses the same
logical block (64 tokens) and block count as the reference, so Megatron schedules the same
steps; greedy tokens must be identical and log-probabilities equal to fp32 noise.

The same run checks, against independent facts: the reference's tokens and log-probs are
those of a plain full-sequence forward with Megatron's DotProductAttention (no cache); KV
memory per rank is 1/CP of the reference's and blocks per rank stay within one of even;
a pool so small that Megatron pauses and evicts a request changes no token; a chunked
prefill that stalls (no chunk for two steps: Megatron's placeholder tokens, then its rewind)
gives Megatron CP = 1's tokens at CP 2 and [2, 2]; a paged-cache mismatch the cache cannot
repair fails that request alone; ranks handed different requests all raise one
DisagreementError within 10 s; a request longer than the context window fails alone; the integration applies no patch and leaves
Megatron's attention module as installed (file bytes, method identity); Megatron's own engine
is unchanged with the source patches (for models without the module slot) applied by hand;
bad setups fail with messages.
"""

from __future__ import annotations


import time

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.weights import seed_weights
from tests.helpers.megatron_dynamic import ARRIVALS, BYTES_PER_TOKEN, HEADS, HIDDEN, KV_HEADS, MAX_LEN, NEW_TOKENS, VOCAB, stall_prompts, STALL, STALL_ENGINE, GuardDecodeForwards, IdTokenizer, build_dynamic_model, error_text, gb, run_dynamic  # noqa: F401

LOGICAL_BLOCK = 64  # Megatron's block: CP x our per-rank block, the same at every CP size
MAX_TOKENS = 128
NUM_BLOCKS = 12  # Megatron's block count (one is its dummy): room for every request at once



def _recompute(model, prompts, tokens):
    """Greedy tokens and their log-probs from one full forward per request: no cache, a causal mask."""
    out = {}
    for rid, prompt in enumerate(prompts):
        seq = prompt + tokens[rid][:-1]
        n = len(seq)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        with torch.no_grad():
            logits = model(torch.tensor([seq]), torch.arange(n)[None], mask)[0].float()
        gen = logits[len(prompt) - 1:]
        out[rid] = (gen.argmax(-1).tolist(), torch.log_softmax(gen, -1).gather(1, torch.tensor(tokens[rid])[:, None])
                    .flatten().tolist(), float((gen.topk(2).values[:, 0] - gen.topk(2).values[:, 1]).min()))
    return out



# Pool pressure: blocks of 8 tokens, 8 usable; three requests that need 12 together.
SMALL = dict(prompts=[[5, 17, 3, 40, 2, 9, 77, 31, 8, 60], [12, 1, 88, 4, 23, 70, 6, 14, 50, 33, 2, 71], [9] * 9],
             counts=[20, 20, 20], arrivals=[0, 0, 1])


# A stalled chunked prefill: 8-token blocks, 22 usable, 64 tokens a step; the 119-token prompt gets its
# first chunk, then no chunk for two steps (its remaining blocks are not free), so Megatron runs a
# placeholder token for it each step and rewinds it when the next chunk comes.


class _LoseAToken:
    """Before step 5, drop request 0's last cached token from the paged cache (a mismatch the cache
    cannot repair: Megatron counts one more token than it holds)."""

    def __init__(self, context):
        self.context = context

    def before_step(self, step):
        if step == 5:
            self.context.kv_cache.truncate(0, self.context.kv_cache.length(0) - 1)

    def after_step(self, step):
        pass


def dynamic_rank(rank, world):
    from megatron.core import parallel_state

    from megatron_tree.comm import CommStats
    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import dynamic as md
    from megatron_tree.integrations.megatron import patches
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    tok = IdTokenizer()
    res = {"patched_before": patches.check_runtime(), "fingerprint_before": mt.megatron_attention_fingerprint()}

    def megatron_engine(model, blocks=NUM_BLOCKS, block=LOGICAL_BLOCK, max_len=MAX_LEN, max_requests=8,
                        max_tokens=MAX_TOKENS):
        return md.build_dynamic_engine(model, tok, max_sequence_length=max_len, buffer_size_gb=gb(blocks, block),
                                       block_size_tokens=block, max_tokens=max_tokens, max_requests=max_requests)

    with megatron_on_cpu():
        # Reference: Megatron's own attention and dynamic context at CP = 1, on rank 0 only (the
        # other ranks go on to the next collective group creation and wait there).
        mt.initialize_model_parallel(1)
        if rank == 0:
            model = build_dynamic_model(1, None, tree=False)
            eng = megatron_engine(model)
            res["ref"] = run_dynamic(eng)
            res["ref_core"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
            res["ref_buffer"] = (eng.context.memory_buffer.numel() * eng.context.memory_buffer.element_size(),
                                 eng.context.block_allocator.total_count)
            res["ref_recompute"] = _recompute(model, stall_prompts(), res["ref"]["tokens"])
            for key, blocks in (("ref_small", 9), ("ref_small_free", 40)):
                res[key] = run_dynamic(megatron_engine(model, blocks=blocks, block=8, max_len=64, max_requests=4), **SMALL)
            res["ref_stall"] = run_dynamic(megatron_engine(model, **STALL_ENGINE), **STALL)
            res["ref_stall_free"] = run_dynamic(megatron_engine(model, **dict(STALL_ENGINE, blocks=60)), **STALL)
        parallel_state.destroy_model_parallel()

        for name, cp, hier, strategy in (("cp2", 2, None, "packed"), ("cp4", 4, None, "packed"),
                                         ("cp2x2", 4, [2, 2], "two_level")):
            mt.initialize_model_parallel(cp, hier)
            model = build_dynamic_model(cp, hier, tree=True, strategy=strategy)
            stats = CommStats()
            for layer in model.decoder.layers:
                layer.self_attention.core_attention.comm_stats = stats

            def tree_engine(blocks=NUM_BLOCKS, block=LOGICAL_BLOCK, max_len=MAX_LEN, max_requests=8, cp=cp,
                            max_tokens=MAX_TOKENS):
                return md.build_dynamic_engine(model, tok, max_sequence_length=max_len,
                                               buffer_size_gb=gb(blocks, block) / cp, block_size_tokens=block // cp,
                                               max_tokens=max_tokens, max_requests=max_requests)

            eng = tree_engine()
            guard = GuardDecodeForwards(eng)  # every decode-only forward under sync_guard.no_host_sync
            # Each layer's core attention before every forward of the run (its attributes, by object): the
            # step's pages reach it in the block_table slot of the call (PagedLayer), never as module state.
            cores, states = [layer.self_attention.core_attention for layer in model.decoder.layers], []
            hooks = [layer.self_attention.register_forward_pre_hook(
                lambda m, a, core=core, i=i, seen=states: seen.append((i, {k: id(v) for k, v in vars(core).items()})))
                for i, (layer, core) in enumerate(zip(model.decoder.layers, cores))]
            # A fifth request longer than the context window arrives with the third.
            res[name] = run_dynamic(eng, stall_prompts() + [[7] * (MAX_LEN - 4)], NEW_TOKENS + [8], ARRIVALS + [3])
            for h in hooks:
                h.remove()
            after = [{k: id(v) for k, v in vars(core).items()} for core in cores]
            changed = {(i, k) for i, st in states for k in set(st) | set(after[i]) if st.get(k) != after[i].get(k)}
            res[name + "_core_state"] = (len(states), sorted(changed))
            res[name + "_guard"] = (guard.guarded, list(guard.syncs))
            res[name + "_forwards"] = list(guard.forwards)
            res[name + "_stats"] = (stats.calls, {k: v.collectives for k, v in stats.levels.items()})
            ctx = eng.context
            res[name + "_memory"] = (ctx.kv_cache.nbytes, ctx.memory_buffer.numel(), ctx.kv_cache.blocks_per_rank,
                                     ctx.kv_cache.block_size, ctx.block_allocator.total_count, ctx.block_size_tokens)
            res[name + "_core"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
            res[name + "_levels"] = [lvl.size for lvl in ctx.groups.levels]
            if name in ("cp2", "cp2x2"):
                res[name + "_stall"] = run_dynamic(tree_engine(**STALL_ENGINE), **STALL)
                if name == "cp2":
                    broken = tree_engine(**STALL_ENGINE)
                    res["cp2_broken"] = run_dynamic(broken, hook=_LoseAToken(broken.context), **STALL)
                # Each CP rank handed its own first prompt (cp2) or its own token budget (cp2x2): every
                # rank raises the same error before any request is added, and the engine stays usable.
                me = ctx.groups.rank
                bad = dict(prompts=[[me, 5, 9], [3, 4]], counts=[4, 4]) if name == "cp2" else \
                    dict(prompts=[[1, 5, 9], [3, 4]], counts=[4, 4 + me])
                t0 = time.perf_counter()
                res[name + "_disagree"] = (error_text(run_dynamic, eng, arrivals=[0, 0], **bad), time.perf_counter() - t0)
                if name == "cp2":
                    guard.inject_host_read()  # the guard is live in this run: an injected host read raises
                syncs = len(guard.syncs)
                res[name + "_after_disagree"] = run_dynamic(eng, prompts=[[1, 5, 9], [3, 4]], counts=[4, 4], arrivals=[0, 0])
                res[name + "_injected"] = guard.syncs[syncs:]
                # The same through Megatron's own engine API (add_request / step_modern, what MegatronLLM.generate
                # drives), which bypasses generate_dynamic's check: a rank-dependent prompt must still be refused.
                res[name + "_direct_disagree"] = error_text(_add_and_step, tree_engine(), [[1, 5, 9 + me], [3, 4]])
                # ... and a rank-dependent request that arrives while another decodes: the step that starts it
                # also decodes the first, and is checked all the same
                res[name + "_direct_disagree_late"] = error_text(_add_and_step, tree_engine(), [[1, 5, 9], [3, 4 + me]],
                                                                 arrivals=[0, 2])
                if name == "cp2":
                    # A context over CP groups of the model's size but other ranks ({0, 2} / {1, 3} beside the
                    # model's {0, 1} / {2, 3}) would place each request's keys over ranks the layers never merge
                    # over: the wrapper refuses it on every rank (check_context_groups), before any step.
                    from megatron_tree.distributed.topology import TreeGroups

                    res["cp2_ctx_groups_not_the_models"] = error_text(
                        wrap_megatron_model_in_tree_wrapper, model, groups=TreeGroups.build([[0, 2], [1, 3]]))
            if name == "cp4":
                res["cp4_small"] = run_dynamic(tree_engine(blocks=9, block=8, max_len=64, max_requests=4), **SMALL)
                res["bad_pool"] = error_text(tree_engine, blocks=4)
                res["bad_megatron_context_at_cp4"] = error_text(run_dynamic, megatron_engine_at(model, tok))
            parallel_state.destroy_model_parallel()

        res["patched_after"] = patches.check_runtime()
        res["fingerprint_after"] = mt.megatron_attention_fingerprint()
        mt.initialize_model_parallel(1)
        if rank == 0:
            model = build_dynamic_model(1, None, tree=False)
            res["bad_wrapper"] = error_text(wrap_megatron_model_in_tree_wrapper, model)
            # Megatron's local attention cannot be built at CP > 1 (TE's can): such a model's config.
            model.config.context_parallel_size = 2
            res["bad_megatron_spec_at_cp2"] = error_text(md.build_dynamic_engine, model, tok,
                                                     max_sequence_length=MAX_LEN, buffer_size_gb=0.01)
            model.config.context_parallel_size = 1
            # Megatron's own engine with both source patches applied by hand: bit-identical to the first run.
            patches.apply_runtime()
            res["ref_patched"] = run_dynamic(megatron_engine(model))
        parallel_state.destroy_model_parallel()
        patches.revert_runtime()
    return res


def _add_and_step(engine, prompts, new_tokens=4, arrivals=None):
    """Megatron's own engine API, as a user (or MegatronLLM) drives it: add each request at its arrival step
    (default: all before the first), step until done."""
    from megatron.core.inference.sampling_params import SamplingParams

    arrivals = list(arrivals or [0] * len(prompts))
    pending, done, step = list(range(len(prompts))), {}, 0
    while pending or engine.has_unfinished_requests():
        for i in [i for i in pending if arrivals[i] <= step]:
            engine.add_request(i, list(prompts[i]),
                               SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1))
            pending.remove(i)
        if engine.has_unfinished_requests():
            for record in engine.step_modern()["finished_request_records"]:
                req = record.merge()
                done[req.request_id] = [int(t) for t in req.generated_tokens]
        step += 1
    return done


def megatron_engine_at(model, tok):
    """Megatron's own DynamicInferenceContext + GPTInferenceWrapper around a tree-spec model at CP > 1."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.engines import DynamicInferenceEngine
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    ctx = DynamicInferenceContext(params_dtype=torch.float32, num_layers=2, kv_channels=HIDDEN // HEADS,
                                  num_attention_heads=KV_HEADS, max_sequence_length=MAX_LEN,
                                  buffer_size_gb=gb(NUM_BLOCKS, LOGICAL_BLOCK), block_size_tokens=LOGICAL_BLOCK,
                                  max_tokens=MAX_TOKENS, max_requests=8)
    cfg = InferenceWrapperConfig(hidden_size=HIDDEN, params_dtype=torch.float32,
                                 inference_batch_times_seqlen_threshold=-1, padded_vocab_size=VOCAB,
                                 inference_max_requests=8, inference_max_seq_length=MAX_LEN)
    return DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, cfg, ctx), tok), ctx,
                                  random_seed=0)


def wrap_megatron_model_in_tree_wrapper(model, groups=None):
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

    from megatron_tree.integrations.megatron import dynamic as md

    where = {"pg_collection": model.pg_collection} if groups is None else {"groups": groups}
    ctx = md.TreeDynamicInferenceContext(
        **where, params_dtype=torch.float32, num_layers=2, kv_channels=HIDDEN // HEADS,
        num_attention_heads=KV_HEADS, max_sequence_length=MAX_LEN, buffer_size_gb=gb(NUM_BLOCKS, LOGICAL_BLOCK),
        block_size_tokens=LOGICAL_BLOCK, max_tokens=MAX_TOKENS, max_requests=8,
    )
    cfg = InferenceWrapperConfig(hidden_size=HIDDEN, params_dtype=torch.float32,
                                 inference_batch_times_seqlen_threshold=-1, padded_vocab_size=VOCAB,
                                 inference_max_requests=8, inference_max_seq_length=MAX_LEN)
    md.TreeDynamicGPTInferenceWrapper(model, cfg, ctx)


@pytest.fixture(scope="module")
def dyn():
    # pg_timeout: ranks 1-3 wait in the next group creation while rank 0 runs the references.
    return run_ranks(dynamic_rank, 4, timeout=600, pg_timeout=300)


def _assert_same_run(got, ref, where):
    assert {k: got["tokens"][k] for k in ref["tokens"]} == ref["tokens"], where
    assert {k: got["finished"][k] for k in ref["finished"]} == ref["finished"], where  # same schedule
    for rid, lps in ref["log_probs"].items():
        # fp32 attention of different algorithms agrees to ~1e-6 in the log-probabilities.
        torch.testing.assert_close(torch.tensor(got["log_probs"][rid]), torch.tensor(lps), rtol=0, atol=2e-5,
                                   msg=lambda m: f"{where}, request {rid}: {m}")


def test_dynamic_engine_cp2_cp4_cp2x2_equal_megatron_cp1(dyn):
    ref = dyn[0]["ref"]
    assert dyn[0]["ref_core"] == "DotProductAttention"
    assert sorted(ref["tokens"]) == [0, 1, 2, 3]
    assert [len(ref["tokens"][i]) for i in range(4)] == NEW_TOKENS
    # Continuous batching: requests finish at different steps; the late arrivals run alongside.
    assert len(set(ref["finished"].values())) == 4 and ref["finished"][2] > ref["finished"][1]
    for rank in range(4):
        for name in ("cp2", "cp4", "cp2x2"):
            assert dyn[rank][name + "_core"] == "TreeDotProductAttention"
            _assert_same_run(dyn[rank][name], ref, f"rank {rank} {name}")
            assert dyn[rank][name]["status"] == {0: "COMPLETED", 1: "COMPLETED", 2: "COMPLETED", 3: "COMPLETED",
                                                 4: "FAILED"}
        assert dyn[rank]["cp4_levels"] == [4] and dyn[rank]["cp2x2_levels"] == [2, 2]
        for name in ("cp2", "cp4", "cp2x2"):  # the step's pages travel with the call, not as core-attention state
            forwards, changed = dyn[rank][name + "_core_state"]
            assert forwards == 2 * dyn[rank][name]["steps"] and changed == [], (rank, name, forwards, changed)
    # Every forward merges each of the 2 layers once: packed = MAX + SUM over the CP group;
    # two_level = that inside each simulated node, then across.
    steps = dyn[0]["cp4"]["steps"]
    assert dyn[0]["cp4_stats"] == (2 * steps, {"cp": 4 * steps})
    assert dyn[0]["cp2x2_stats"] == (2 * steps, {"intra": 4 * steps, "inter": 4 * steps})
    assert dyn[0]["cp2_stats"] == (2 * steps, {"cp": 4 * steps})


def test_decode_forwards_run_without_host_sync(dyn):
    """Issue 31's no_host_sync on the dynamic engine: every decode-only model forward (one query token per
    active request) at CP 2, CP 4 and CP [2, 2] ran under ``sync_guard.no_host_sync`` -- Megatron's
    GPTModel forward with our KV-cache hook, RoPE at global positions, the paged tree_decode and its
    packed / two-level merges -- with no host sync, and the guarded runs gave Megatron CP = 1's
    unguarded tokens. The guard was live there: a host read injected into our KV-cache hook raised."""
    ref = dyn[0]["ref"]
    for rank in range(4):
        counts = set()
        for name in ("cp2", "cp4", "cp2x2"):
            guarded, syncs = dyn[rank][name + "_guard"]
            assert syncs == [], (rank, name, syncs)
            assert guarded > 0, (rank, name)  # not vacuous: decode-only forwards ran under the guard
            # the guarded forwards are exactly those with one token per active request (the decode-only ones)
            forwards = dyn[rank][name + "_forwards"]
            assert all(g == (tokens == requests) for tokens, requests, g in forwards), (rank, name, forwards)
            assert sum(g for *_, g in forwards) == guarded < len(forwards), (rank, name, forwards)
            counts.add(guarded)
            _assert_same_run(dyn[rank][name], ref, f"rank {rank} {name} guarded")
        assert len(counts) == 1, counts  # the same schedule at every CP size
        injected = dyn[rank]["cp2_injected"]
        assert len(injected) == 1 and injected[0].startswith(
            f"host sync inside {GuardDecodeForwards.WHERE}: int(tensor)"), (rank, injected)
        assert dyn[rank]["cp2x2_injected"] == []
        # the forward that raised ran again unguarded: the same tokens as the run without the injection
        assert dyn[rank]["cp2_after_disagree"]["tokens"] == dyn[rank]["cp2x2_after_disagree"]["tokens"]


def test_ranks_with_different_requests_all_raise_the_same_error_promptly(dyn):
    """Ranks of one CP group handed different prompts or token budgets would each run Megatron's
    scheduler on their own requests and return tokens neither gives; every rank raises instead."""
    for name, what in (("cp2", "prompt_ids"), ("cp2x2", "num_tokens_to_generate")):
        messages = set()
        for rank in range(4):
            message, seconds = dyn[rank][name + "_disagree"]
            assert message.startswith("DisagreementError") and "generate_dynamic" in message, (name, rank, message)
            assert what in message, (name, message)
            assert seconds < 10, (name, rank, seconds)
            after = dyn[rank][name + "_after_disagree"]
            assert after["status"] == {0: "COMPLETED", 1: "COMPLETED"} and len(after["tokens"][0]) == 4
            messages.add(message)
        # cp2: ranks {0, 1} and {2, 3} are two CP groups, each raising one message naming both of its ranks.
        assert len(messages) == (2 if name == "cp2" else 1), messages
    assert "[4, 4]" in dyn[0]["cp2x2_disagree"][0] or "(4, 4)" in dyn[0]["cp2x2_disagree"][0]
    assert "(4, 7)" in dyn[0]["cp2x2_disagree"][0] or "[4, 7]" in dyn[0]["cp2x2_disagree"][0]


def test_ranks_adding_different_requests_through_megatrons_engine_api_all_raise(dyn):
    """engine.add_request + step_modern with a rank-dependent prompt at CP 2: every rank raises one
    DisagreementError at the step that starts the requests (before: no error, each rank's tokens mixed
    from both ranks' prompts)."""
    for key in ("cp2_direct_disagree", "cp2_direct_disagree_late"):
        messages = {dyn[rank][key] for rank in range(2)}
        assert len(messages) == 1, (key, messages)
        message = messages.pop()
        assert message.startswith("DisagreementError") and "TreeDynamicInferenceContext" in message, (key, message)
        assert "new requests" in message, (key, message)


def test_a_dynamic_context_over_other_ranks_than_the_models_cp_group_is_refused(dyn):
    """TreeDynamicGPTInferenceWrapper around a model at CP 2 (groups {0, 1}, {2, 3}) and a context over groups of
    the same size but other ranks ({0, 2}, {1, 3}): every rank refuses it, naming both rank lists and the fix."""
    for rank in range(4):
        message = dyn[rank]["cp2_ctx_groups_not_the_models"]
        ctx, cp = ("(0, 2)" if rank % 2 == 0 else "(1, 3)"), ("(0, 1)" if rank < 2 else "(2, 3)")
        assert message.startswith("ValueError: TreeDynamicGPTInferenceWrapper"), (rank, message)
        assert f"span ranks {ctx}" in message and f"CP group {cp}" in message, (rank, message)
        assert "tree_groups_from_megatron(model.pg_collection)" in message, message


def test_reference_equals_full_forward_with_megatron_attention(dyn):
    """The CPU reference itself is right: Megatron's DotProductAttention over the whole
    sequence, without any cache, picks the same greedy tokens with the same log-probs."""
    ref = dyn[0]["ref"]
    for rid, (argmax, log_probs, margin) in dyn[0]["ref_recompute"].items():
        assert argmax == ref["tokens"][rid], rid
        torch.testing.assert_close(torch.tensor(ref["log_probs"][rid]), torch.tensor(log_probs), rtol=0, atol=2e-5)
        assert margin > 1e-3, f"request {rid}: greedy choices too close to call ({margin})"


def test_kv_memory_per_rank_is_one_cp_th(dyn):
    ref_bytes, ref_blocks = dyn[0]["ref_buffer"]
    assert ref_blocks == NUM_BLOCKS and ref_bytes == NUM_BLOCKS * LOGICAL_BLOCK * BYTES_PER_TOKEN
    for name, cp in (("cp2", 2), ("cp4", 4), ("cp2x2", 4)):
        for rank in range(4):
            nbytes, megatron_buffer, blocks, block_size, logical_blocks, logical_size = dyn[rank][name + "_memory"]
            assert megatron_buffer == 0  # no full-size buffer hides behind the paged cache
            assert (logical_blocks, logical_size, block_size) == (NUM_BLOCKS, LOGICAL_BLOCK, LOGICAL_BLOCK // cp)
            # Same token capacity as the reference (less its dummy block), 1/CP of the bytes on each rank
            # (and the one spare token slot per layer that takes the tokens other ranks keep).
            assert blocks * block_size * cp == (ref_blocks - 1) * LOGICAL_BLOCK
            assert nbytes == (ref_blocks - 1) * LOGICAL_BLOCK * BYTES_PER_TOKEN // cp + BYTES_PER_TOKEN
            run = dyn[rank][name]
            assert len(run["blocks"]) == len(run["live"]) == run["steps"]
            # Every request is spread round-robin: within one block of even on every rank, every step.
            assert max(run["spread"]) <= 1 and run["blocks"][-1] == [0] * cp  # all freed at the end
            # So the ranks' totals differ by at most one block per live request; when the cache is
            # fullest they are within one block of even.
            for used, live in zip(run["blocks"], run["live"]):
                assert max(used) - min(used) <= max(1, live), (name, rank, run["blocks"], run["live"])
            peak = max(run["blocks"], key=sum)
            assert max(peak) - min(peak) <= 1, (name, rank, run["blocks"])
            assert sum(peak) * block_size >= 300 + 9  # the long request was resident at once


def test_pool_pressure_pauses_and_evicts_without_changing_tokens(dyn):
    """8 blocks of 8 tokens, three requests needing 12: Megatron pauses and evicts one and
    re-runs it later; at CP = 4 the paged pools follow (blocks freed and reused) and every
    token equals an unconstrained run's."""
    free, small = dyn[0]["ref_small_free"], dyn[0]["ref_small"]
    assert small["tokens"] == free["tokens"]
    assert small["evicted"] >= 1 and free["evicted"] == 0
    assert small["finished"][2] > free["finished"][2]  # the evicted request finished later
    for rank in range(4):
        cp4 = dyn[rank]["cp4_small"]
        assert cp4["tokens"] == free["tokens"] and cp4["finished"] == small["finished"]
        assert cp4["evicted"] == small["evicted"]
        assert max(max(u) for u in cp4["blocks"]) >= 7  # the per-rank pools (8 blocks) were nearly full
        assert any(sum(u) > sum(v) for u, v in zip(cp4["blocks"], cp4["blocks"][1:]))  # blocks were freed mid-run


def test_stalled_chunked_prefill_follows_megatrons_rewind(dyn):
    """A chunked prefill that gets no chunk for two steps runs Megatron's placeholder token, which
    Megatron rewinds when the next chunk comes; the paged cache drops it alike on every rank, and
    CP 2 and CP [2, 2] give Megatron's own CP = 1 tokens under the same stall (which are those of a
    pool large enough never to stall: the reference is self-consistent)."""
    ref, free = dyn[0]["ref_stall"], dyn[0]["ref_stall_free"]
    assert ref["tokens"] == free["tokens"] and ref["steps"] > free["steps"]  # the stall cost steps, not tokens
    assert set(ref["status"].values()) == {"COMPLETED"}
    for rank in range(4):
        for name in ("cp2", "cp2x2"):
            got = dyn[rank][name + "_stall"]
            assert got["rewound"] == 2, (rank, name, got["rewound"])  # two placeholder tokens dropped
            _assert_same_run(got, ref, f"rank {rank} {name} stall")
            assert got["errors"] == {} and got["blocks"][-1] == [0] * len(got["blocks"][-1])  # all freed


def test_a_cache_mismatch_it_cannot_repair_fails_that_request_alone(dyn):
    """A paged cache that lost a token of request 0 (one it cannot repair): request 0 fails with the
    counts in its message on every rank; the other requests' tokens are Megatron's."""
    ref = dyn[0]["ref_stall"]
    for rank in range(4):
        got = dyn[rank]["cp2_broken"]
        assert got["status"][0] == "FAILED" and got["tokens"][0] == [], (rank, got["status"])
        assert "request 0: Megatron's context has" in got["errors"][0] and "the other requests are unaffected" in \
            got["errors"][0], got["errors"][0]
        assert {k: v for k, v in got["tokens"].items() if k} == {k: v for k, v in ref["tokens"].items() if k}
        assert all(got["status"][k] == "COMPLETED" for k in got["status"] if k)
        assert got["blocks"][-1] == [0, 0]


def test_request_longer_than_context_fails_alone(dyn):
    for rank in range(4):
        for name in ("cp2", "cp4", "cp2x2"):
            run = dyn[rank][name]
            assert run["status"][4] == "FAILED" and run["tokens"][4] == []
            assert f"316 prompt + 8 new tokens exceed the context window of {MAX_LEN} tokens" in run["errors"][4]


def test_megatron_dynamic_engine_unpatched_and_unchanged_by_the_patches(dyn):
    out = dyn[0]
    ids = ["0001-attention-kv-cache-hook", "0002-dynamic-attention-hook"]
    assert out["patched_before"] == dict.fromkeys(ids, False)
    assert out["patched_after"] == dict.fromkeys(ids, False), "the tree engine applied a source patch"
    assert out["fingerprint_before"] == out["fingerprint_after"] and out["fingerprint_after"]["patched"] == []
    assert out["ref_patched"]["tokens"] == out["ref"]["tokens"]
    assert out["ref_patched"]["log_probs"] == out["ref"]["log_probs"]  # bit-identical


def test_bad_setups_fail_loudly(dyn):
    out = dyn[0]
    assert out["bad_pool"].startswith("ValueError") and "a request of the full context window could never be" in \
        out["bad_pool"] and f"fewer than max_sequence_length={MAX_LEN}" in out["bad_pool"], out["bad_pool"]
    bad_context = out["bad_megatron_context_at_cp4"]
    assert bad_context.startswith("RuntimeError") and "needs a TreeDynamicInferenceContext" in bad_context, bad_context
    assert out["bad_megatron_spec_at_cp2"].startswith("ValueError") and \
        "build the model with get_gpt_layer_tree_spec()" in out["bad_megatron_spec_at_cp2"]
    assert out["bad_wrapper"].startswith("TypeError") and "core attention is DotProductAttention" in out["bad_wrapper"]


# --------------------------------------------------------------------------- the CPU shim alone


def test_cpu_shim_standins_are_flash_attention_and_everything_is_restored():
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.inference.engines import dynamic_engine
    from megatron.core.transformer import attention

    from megatron_tree.ops import reference
    from megatron_tree.integrations.megatron import cpu as _cpu

    watched = [(torch, "empty_like"), (torch.cuda, "current_device"), (dynamic_engine, "range_push"),
               (dynamic_context, "triton_append_key_value_cache"), (attention, "flash_attn_varlen_func"),
               (attention, "flash_attn_with_kvcache"), (attention, "is_fa_min_version")]
    before = [getattr(o, n) for o, n in watched]
    with _cpu.megatron_on_cpu():
        assert attention.flash_attn_varlen_func is _cpu.flash_attn_varlen_func
        assert attention.is_fa_min_version("2.7.3") and not attention.is_fa_min_version("2.8.0")
        assert not torch.empty_like(torch.ones(2), device="cpu", pin_memory=True).is_pinned()
    assert [getattr(o, n) for o, n in watched] == before

    # Packed varlen over a paged cache (GQA, ragged, bottom-right causal, a padding row) and the
    # paged decode, both against the fp64 oracle with explicit positions.
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 4, 2, 8, 3
    kv_lens, q_lens = [7, 4, 1], [3, 4, 1]
    kc = torch.randn(10, bs, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(10, bs, hkv, d, generator=g, dtype=torch.float64)
    table = torch.tensor([[4, 0, 7], [9, 2, 0], [5, 0, 0]], dtype=torch.int32)
    q = torch.randn(sum(q_lens) + 1, hq, d, generator=g, dtype=torch.float64)
    cu_q = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 11, 12], dtype=torch.int32)
    out = _cpu.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 4, 7, softmax_scale=0.3, causal=True, block_table=table)
    dec = _cpu.flash_attn_with_kvcache(q[cu_q[1:] - 1][:, None], kc, vc, cache_seqlens=torch.tensor(kv_lens),
                                       block_table=table, causal=True)
    for i, (nk, nq) in enumerate(zip(kv_lens, q_lens)):
        k = kc[table[i].long()].reshape(-1, hkv, d)[None, :nk]
        v = vc[table[i].long()].reshape(-1, hkv, d)[None, :nk]
        qi = q[cu_q[i]: cu_q[i + 1]][None]
        want, _ = reference.partial_attention(qi, k, v, softmax_scale=0.3, q_positions=torch.arange(nk - nq, nk)[None],
                                              k_positions=torch.arange(nk)[None])
        torch.testing.assert_close(out[cu_q[i]: cu_q[i + 1]], want[0], rtol=0, atol=1e-12)
        last, _ = reference.partial_attention(qi[:, -1:], k, v)
        torch.testing.assert_close(dec[i], last[0], rtol=0, atol=1e-12)
    assert out[-1].abs().max() == 0  # padding past cu_seqlens_q[-1]
