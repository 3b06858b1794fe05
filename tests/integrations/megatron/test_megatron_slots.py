"""Tree attention through Megatron-Core's module slots only, on the megatron-core that is installed.

Runs unchanged on 0.16.1 (Python 3.11) and 0.19.x (Python 3.12). Gloo runs of 2, 3 and 4 ranks
build the same tiny GPTModel (local spec, RoPE, GQA, fp32) twice: with Megatron's own
``SelfAttention`` + ``DotProductAttention`` at CP = 1 (the reference: every rank the whole model
and cache), and with ``TreeSelfAttention`` in ``self_attention.module`` and
``TreeDotProductAttention`` in ``core_attention`` at CP 2, CP 3 and CP 4 = 2 x 2, with no runtime
or source patch of Megatron. Each decodes greedily through Megatron's controller loop (logits read
back), ``StaticInferenceEngine`` and ``DynamicInferenceEngine`` (requests arriving and finishing at
different steps, chunked prefill on and off), and on 0.19 ``MegatronLLM``; tokens must be equal and
logits / log-probs within 1e-4. Megatron's attention module (file bytes, method identity and
source) is fingerprinted before and after, and each rank's KV bytes are counted.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.weights import seed_weights

VOCAB = 96
HIDDEN = 64
HEADS, KV_HEADS = 4, 2
PROMPT_LEN = 11  # odd: the 2*CP prefill chunks need padding, shards grow unevenly
NEW_TOKENS = 12
MAX_LEN = 24
UNEVEN = [[5, 17, 3], [40, 2, 9, 77, 31, 8, 60, 12, 1]]  # the controller's catch-up path


def _config(cp, hier=None, **extra):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        attention_backend=AttnBackend.local, num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True,
        context_parallel_size=cp, hierarchical_context_parallel_sizes=hier, params_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0,
        add_bias_linear=False, **extra,
    )


def _build(cp, slot: bool, hier=None, mtp: bool = False):
    """The tiny GPT model; mtp: with one multi-token-prediction layer, repeated for every draft depth."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.integrations.megatron import get_gpt_layer_tree_spec

    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    spec = get_gpt_layer_tree_spec(strategy="two_level" if hier else "packed") if slot else get_gpt_layer_local_spec()
    config = _config(cp, hier, **(dict(mtp_num_layers=1, mtp_use_repeated_layer=True) if mtp else {}))
    mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False) if mtp else None
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=MAX_LEN, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False, mtp_block_spec=mtp_spec)
    return seed_weights(model).eval()  # the same weights at every layout, clear greedy margins


def _prompts():
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(3))


def _wrapper(model, ctx, slot: bool):
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    from megatron_tree.integrations.megatron import version as compat
    from megatron_tree.integrations.megatron import TreeGPTInferenceWrapper

    if slot:
        return TreeGPTInferenceWrapper(model, ctx)
    w = GPTInferenceWrapper.__new__(GPTInferenceWrapper)
    compat.init_gpt_wrapper(w, model, ctx, hidden_size=HIDDEN, params_dtype=torch.float32, padded_vocab_size=VOCAB)
    return w


def _prepared(model, ctx, slot: bool):
    """The wrapper, prepared for inference, and its inputs for the two prompts (Megatron's controller's first steps)."""
    from megatron_tree.integrations.megatron import version as compat

    wrapper = _wrapper(model, ctx, slot)
    if slot:
        wrapper.prep_model_for_inference()
    else:
        compat.prep_model_for_inference(wrapper)
    tokens = torch.zeros(2, MAX_LEN, dtype=torch.long)
    tokens[:, :PROMPT_LEN] = _prompts()
    return wrapper, wrapper.prep_inference_input(tokens)


def greedy(model, ctx, slot: bool):
    """Megatron's controller loop by hand (prefill, then one token a step), logits read back."""
    wrapper, inputs = _prepared(model, ctx, slot)
    start, end, margins = 0, PROMPT_LEN, []
    for step in range(NEW_TOKENS):
        if step:
            ctx.enable_decode_mode()
        logits = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(inputs, start, end))[:, -1].float()
        top2 = logits.topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
        inputs["tokens"][:, end] = logits.argmax(-1)
        start, end = end, end + 1
    return inputs["tokens"][:, PROMPT_LEN:end].tolist(), min(margins), logits.tolist()


def engine_generate(model, ctx, slot: bool, prompts):
    """Megatron's StaticInferenceEngine (legacy static batching) + TextGenerationController, greedy."""
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_tree.integrations.megatron import version as compat
    from megatron_tree.integrations.megatron.model import IdTokenizer

    tok = IdTokenizer(eod=VOCAB - 1)
    controller = TextGenerationController(_wrapper(model, ctx, slot), tok)
    with compat.inference_mode_off():  # the engine sets 0.19's process-wide flag and never clears it
        engine = StaticInferenceEngine(controller, max_batch_size=2, legacy=True)
        params = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
        reqs = [InferenceRequest(request_id=str(i), prompt=tok.detokenize(p), prompt_tokens=list(p),
                                 sampling_params=params) for i, p in enumerate(prompts)]
        done = engine.generate(inference_requests=reqs)
    return [[int(t) for t in r.generated_tokens] for r in done]


def _error(fn, *a, **k) -> str:
    try:
        fn(*a, **k)
    except Exception as err:  # noqa: BLE001 -- asserted on by the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def slot_rank(rank, world, hier=None):
    from megatron.core import parallel_state
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import version as compat
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu
    from megatron_tree.integrations.megatron import TreeInferenceContext, megatron_attention_fingerprint

    out = {"api": compat.megatron_api().__dict__.copy()}
    with megatron_on_cpu() as replaced:
        out["shim"] = replaced
        before = megatron_attention_fingerprint()
        mt.initialize_model_parallel(1)
        ref = _build(1, slot=False)
        out["ref"] = greedy(ref, StaticInferenceContext(2, MAX_LEN), slot=False)
        out["ref_engine"] = engine_generate(ref, StaticInferenceContext(2, MAX_LEN), False, _prompts().tolist())
        out["ref_uneven"] = engine_generate(ref, StaticInferenceContext(2, MAX_LEN), False, UNEVEN)
        out["ref_types"] = (type(ref.decoder.layers[0].self_attention).__name__,
                            type(ref.decoder.layers[0].self_attention.core_attention).__name__)
        # The slot model at CP = 1 inside Megatron's own context: our hooks decline, Megatron's code runs.
        out["slot_cp1_megatron_ctx"] = greedy(_build(1, slot=True), StaticInferenceContext(2, MAX_LEN), slot=False)
        parallel_state.destroy_model_parallel()

        groups = mt.initialize_model_parallel(world, hier)
        model = _build(world, slot=True, hier=hier)
        out["levels"] = [lvl.size for lvl in groups.levels]
        out["types"] = (type(model.decoder.layers[0].self_attention).__name__,
                        type(model.decoder.layers[0].self_attention.core_attention).__name__)
        ctx = TreeInferenceContext(2, MAX_LEN, groups=groups, block_size=4)
        out["tree"] = greedy(model, ctx, slot=True)
        out["shards"] = [ctx.shard_lens(0), ctx.local_lengths(0, 2).tolist(), ctx.capacity]
        out["kv_rows"] = int(ctx.key_value_memory_dict[1][0].shape[0])
        out["tree_engine"] = engine_generate(model, TreeInferenceContext(2, MAX_LEN, groups=groups, block_size=4),
                                             True, _prompts().tolist())
        out["tree_uneven"] = engine_generate(model, TreeInferenceContext(2, MAX_LEN, groups=groups, block_size=4),
                                             True, UNEVEN)
        # Megatron's own context at CP = 2 with the slot model: refused on every rank, not silently replicated.
        out["megatron_ctx_cp"] = _error(greedy, model, StaticInferenceContext(2, MAX_LEN), False)
        out["after"] = megatron_attention_fingerprint()
        out["before"] = before
        parallel_state.destroy_model_parallel()
    if compat.megatron_api().wrapper_config:  # 0.16.1: the runtime patches exist and must not be applied
        from megatron_tree.integrations.megatron import patches

        out["runtime_patches"] = patches.check_runtime()
    return out


MIXED = [[7, 19, 33, 2, 61, 8, 45], [12, 3, 90, 27, 5, 66, 14, 38, 9, 71]]
"""A batch of a 7- and a 10-token prompt (7 is divisible by no CP size here): the controller prefills 7."""


def prefill_logits(model, ctx, slot: bool):
    """Every prompt token's logits [b, PROMPT_LEN, vocab] of one prefill forward through the wrapper."""
    from megatron_tree.integrations.megatron import version as compat

    wrapper, inputs = _prepared(model, ctx, slot)
    compat.set_only_last_token_logits(ctx, False)
    logits = wrapper.run_one_forward_step(wrapper.get_batch_for_context_window(inputs, 0, PROMPT_LEN))
    return logits.float().tolist()


def prefill_rank(rank, world, hier=None):
    """The static engine's prefill at CP > 1 is ``decode.prefill.ring_prefill``: its PrefillWork and CommStats
    are counted on every layer, and any all-gather of the prompt's keys (``gather_seq``) is counted too."""
    from megatron.core import parallel_state
    from megatron.core.inference.contexts import StaticInferenceContext

    from megatron_tree.comm import CommStats
    from megatron_tree.decode.prefill import PrefillWork
    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import TreeInferenceContext, attention, static
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    out, gathers = {}, []
    with megatron_on_cpu():
        mt.initialize_model_parallel(1)
        ref = _build(1, slot=False)
        out["ref_logits"] = prefill_logits(ref, StaticInferenceContext(2, MAX_LEN), False)
        out["ref_mixed"] = engine_generate(ref, StaticInferenceContext(2, MAX_LEN), False, MIXED)
        parallel_state.destroy_model_parallel()

        groups = mt.initialize_model_parallel(world, hier)
        model = _build(world, slot=True, hier=hier)
        work, stats = PrefillWork(), CommStats()
        for layer in model.decoder.layers:
            layer.self_attention.core_attention.prefill_work = work
            layer.self_attention.core_attention.prefill_stats = stats
        saved = {m: m.gather_seq for m in (attention, static) if hasattr(m, "gather_seq")}
        for m, fn in saved.items():  # count every all-gather of keys/values (the old prefill's way)
            setattr(m, "gather_seq", lambda t, g, site, fn=fn: gathers.append(site) or fn(t, g, site))
        try:
            out["tree_logits"] = prefill_logits(model, TreeInferenceContext(2, MAX_LEN, groups=groups), True)
            out["work"] = (work.pairs, work.blocks, work.skipped, dict(work.kernels))
            out["stats"] = {k: dict(v.ops) for k, v in stats.levels.items()}
            out["tree_mixed"] = engine_generate(model, TreeInferenceContext(2, MAX_LEN, groups=groups, block_size=4),
                                                True, MIXED)
            out["mixed_pairs"] = work.pairs - out["work"][0]
        finally:
            for m, fn in saved.items():
                setattr(m, "gather_seq", fn)
        out["gathers"] = list(gathers)
        # A prompt longer than the context: the same clear error on every rank, before any forward.
        long = [list(range(1, MAX_LEN + 4)), list(range(1, MAX_LEN + 4))]
        out["too_long"] = _error(engine_generate, model, TreeInferenceContext(2, MAX_LEN, groups=groups), True, long)
        out["too_long_plan"] = _error(TreeInferenceContext(2, MAX_LEN, groups=groups).plan_step, 0, MAX_LEN + 3)
        parallel_state.destroy_model_parallel()
    return out


LAYOUTS = {"cp2": (2, None), "cp3": (3, None), "cp2x2": (4, [2, 2])}
"""CP 2 and CP 3 (flat; 3 is not a power of two) and CP 4 as 2 simulated nodes x 2 (the two-level merge)."""


def layout_rank(rank, world, hier=None):
    """One spawn per layout (imports cost ~15 s a rank): the static, dynamic and (CP 2, 0.19) LLM runs."""
    from megatron_tree.integrations.megatron import version as compat

    out = {"static": slot_rank(rank, world, hier), "prefill": prefill_rank(rank, world, hier),
           "dynamic": dynamic_rank(rank, world, hier)}
    if world in (2, 4) and compat.megatron_api().llm_api:  # CP 2 and CP 4 = 2 x 2
        out["llm"] = llm_rank(rank, world, hier)
    return out


_RUNS: dict = {}
"""Layout name -> per-rank results of its one spawn (shared by the fixtures below)."""


def _layout_run(name):
    if name not in _RUNS:
        world, hier = LAYOUTS[name]
        _RUNS[name] = run_ranks(layout_rank, world, hier, timeout=1200)
    return _RUNS[name]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout_results(request):
    return _layout_run(request.param)


@pytest.fixture(scope="module")
def slot_results(layout_results):
    return [r["static"] for r in layout_results]


def test_slot_static_cp_equals_megatron_cp1(slot_results):
    base_tokens, margin, base_logits = slot_results[0]["ref"]
    assert margin > 1e-3, f"the reference's greedy choices are too close to call ({margin})"
    assert slot_results[0]["ref_types"] == ("SelfAttention", "DotProductAttention")
    for r, out in enumerate(slot_results):
        assert out["levels"] == ([2, 2] if len(slot_results) == 4 else [len(slot_results)])
        assert out["types"] == ("TreeSelfAttention", "TreeDotProductAttention")
        assert out["ref"][0] == base_tokens and out["ref_engine"] == base_tokens, r
        tokens, _, logits = out["tree"]
        assert tokens == base_tokens, f"rank {r}: slot decode {tokens} differs from Megatron CP=1 {base_tokens}"
        torch.testing.assert_close(torch.tensor(logits), torch.tensor(base_logits), rtol=1e-4, atol=1e-4)
        assert out["tree_engine"] == base_tokens, r
        assert len(out["ref_uneven"][0]) == NEW_TOKENS and out["tree_uneven"] == out["ref_uneven"], r
        ctokens, _, clogits = out["slot_cp1_megatron_ctx"]
        assert ctokens == base_tokens
        torch.testing.assert_close(torch.tensor(clogits), torch.tensor(base_logits), rtol=1e-4, atol=1e-4)


def test_slot_static_prefill_is_the_ring_prefill(layout_results):
    """Prefill logits of an 11-token prompt (11 is divisible by no CP size here) within 1e-4 of Megatron's
    own CP = 1 prefill; the engine's tokens for a 7- and a 10-token prompt equal Megatron's. Every layer's
    prefill ran decode.prefill.ring_prefill (PrefillWork counted every visible pair of the causal prompt,
    ring sends recorded) and no rank all-gathered keys/values (the old prefill's gather_seq, counted)."""
    res = [r["prefill"] for r in layout_results]
    world = len(res)
    layers, rows, n = 2, 2, PROMPT_LEN
    assert len(res[0]["ref_mixed"][0]) == NEW_TOKENS
    for r, out in enumerate(res):
        torch.testing.assert_close(torch.tensor(out["tree_logits"]), torch.tensor(out["ref_logits"]),
                                   rtol=1e-4, atol=1e-4)
        assert torch.tensor(out["tree_logits"]).shape == (rows, n, VOCAB)
        assert out["tree_mixed"] == out["ref_mixed"], (r, out["tree_mixed"], out["ref_mixed"])
        assert out["gathers"] == [], (r, out["gathers"])
        pairs, blocks, skipped, kernels = out["work"]
        assert blocks + skipped == layers * world, (r, out["work"])  # one ring of P blocks per layer
        assert blocks > 0 and sum(kernels.values()) >= blocks, (r, out["work"])  # the fused prefill kernels ran
        # P - 1 rounds of (k, v, k_pos) per layer
        assert out["stats"]["cp"]["send"] == layers * (world - 1) * 3, (r, out["stats"])
    # Over the ranks: every causal (query, key) pair of both rows, once (11 * 12 / 2 per row and layer; then 7 * 8 / 2).
    assert sum(o["work"][0] for o in res) == layers * rows * n * (n + 1) // 2
    assert sum(o["mixed_pairs"] for o in res) == layers * rows * 7 * 8 // 2
    for out in res:  # too long: the same clear error on every rank
        assert out["too_long"] == res[0]["too_long"] and out["too_long"] != "no error", out["too_long"]
        assert out["too_long_plan"].startswith("ValueError") and "exceed max_sequence_length" in out["too_long_plan"]


def test_slot_kv_cache_is_sharded(slot_results):
    """11 prompt tokens + 11 decoded: each of the P ranks stores about 1/P, its buffers hold 24/P + 1 rows."""
    world = len(slot_results)
    for r, out in enumerate(slot_results):
        row0, local, capacity = out["shards"]
        assert sum(row0) == PROMPT_LEN + NEW_TOKENS - 1 and max(row0) - min(row0) <= 4  # one decode block
        assert local == [row0[r], row0[r]]
        assert capacity == MAX_LEN // world and out["kv_rows"] == capacity + 1


def test_megatron_source_and_functions_untouched(slot_results):
    for out in slot_results:
        assert out["before"] == out["after"], "Megatron's attention module changed during the run"
        assert out["after"]["patched"] == []
        if "runtime_patches" in out:  # 0.16.1
            assert out["runtime_patches"] == {"0001-attention-kv-cache-hook": False,
                                              "0002-dynamic-attention-hook": False}


def test_megatron_context_at_cp_refused(slot_results):
    for out in slot_results:
        msg = out["megatron_ctx_cp"]
        want = f"context_parallel_size={len(slot_results)} needs a TreeInferenceContext"
        assert msg.startswith("RuntimeError") and want in msg, msg


def test_version_gate_and_refused_features(monkeypatch):
    from megatron_tree.integrations.megatron import version as compat

    api = compat.megatron_api()
    assert compat.check_supported("x") is api
    for found in ("0.18.2", "0.17.0", "0.16.0", "0.20.0rc1"):
        monkeypatch.setattr(compat, "megatron_version", lambda found=found: found)
        with pytest.raises(RuntimeError, match=rf"supports megatron-core >=0.16.1,<0.17, >=0.19.0,<0.20 .* but {found}"):
            compat.check_supported("the tree spec")
    monkeypatch.undo()
    for field, value, needle in (("softmax_type", "off-by-one", "sink / off-by-one"),
                                 ("window_size", (8, 0), "sliding-window"),
                                 ("flash_decode", True, "flash_decode=True")):
        cfg = _config(1)
        setattr(cfg, field, value)
        with pytest.raises(NotImplementedError, match=needle):
            compat.refuse_unsupported_features(cfg)
    if api.inference_config:
        from megatron.core.inference.config import InferenceConfig

        compat.refuse_unsupported_features(_config(1), InferenceConfig(num_speculative_tokens=2))  # followed
        for kw, needle in ((dict(enable_prefix_caching=True), "prefix caching"),
                           (dict(num_cuda_graphs=4), "CUDA graphs"),
                           (dict(kv_cache_management_mode="offload"), "KV offload"),
                           (dict(async_sched_mode="async"), "asynchronous scheduling")):
            try:
                cfg = InferenceConfig(**kw)
            except ValueError as err:  # an enum value this release does not have
                pytest.fail(f"InferenceConfig({kw}) rejected: {err}")
            with pytest.raises(NotImplementedError, match=needle):
                compat.refuse_unsupported_features(_config(1), cfg)


# --------------------------------------------------------------------------- dynamic engine

DYN_PROMPTS = (5, 40, 150, 1)  # chunked prefill: 64 tokens a step, so the 150-token prompt arrives in 3 chunks
DYN_NEW = [8, 6, 7, 4]
DYN_ARRIVALS = [0, 0, 3, 4]  # requests join after the first steps and finish at different steps
DYN_MAX_LEN = 256
LOGICAL_BLOCK = 48  # Megatron's block: CP x the per-rank block, the same at CP 1, 2, 3, 4
NUM_BLOCKS = 12  # Megatron's block count, one of them its dummy block
BYTES_PER_TOKEN = 2 * 2 * KV_HEADS * (HIDDEN // HEADS) * 4  # k+v, layers, kv heads, head dim, fp32


def _gb(blocks: int, block_tokens: int) -> float:
    """A buffer size that Megatron turns into exactly ``blocks`` blocks of ``block_tokens`` tokens."""
    return (blocks + 0.5) * block_tokens * BYTES_PER_TOKEN / 2**30


def _dyn_prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in DYN_PROMPTS]


SMALL_POOL = dict(blocks=5, max_len=160)
"""Pool pressure: 4 usable blocks of 48 tokens, while the four requests need 7 together (the
150-token prompt alone 4): Megatron makes requests wait for blocks that others free."""


def _dyn_run(model, cp, chunked, groups=None, blocks=NUM_BLOCKS, max_len=DYN_MAX_LEN, drafts=0):
    from megatron_tree.integrations.megatron.dynamic import build_dynamic_engine, dynamic_kv_bytes
    from megatron_tree.integrations.megatron.dynamic import generate_dynamic
    from megatron_tree.integrations.megatron.model import IdTokenizer

    engine = build_dynamic_engine(
        model, IdTokenizer(eod=VOCAB - 1), max_sequence_length=max_len,
        buffer_size_gb=_gb(blocks, LOGICAL_BLOCK // cp), block_size_tokens=LOGICAL_BLOCK // cp,
        max_tokens=64 if chunked else 192,
        max_requests=8, enable_chunked_prefill=chunked, num_speculative_tokens=drafts, groups=groups,
    )
    r = generate_dynamic(engine, _dyn_prompts(), num_tokens_to_generate=DYN_NEW, arrivals=DYN_ARRIVALS)
    return {"tokens": r.tokens, "log_probs": r.log_probs, "status": r.status, "steps": r.steps,
            "finished": r.finished_step, "kv": dynamic_kv_bytes(engine.context), "blocks": r.blocks_per_rank,
            "spread": r.max_blocks_per_rank, "live": r.live_requests,
            "ctx": type(engine.context).__name__, "rewound": r.rewound_tokens,
            "drafts": (r.drafts_proposed, r.drafts_accepted)}


def dynamic_rank(rank, world, hier=None):
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import version as compat
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu
    from megatron_tree.integrations.megatron import megatron_attention_fingerprint

    out = {}
    with megatron_on_cpu(), compat.inference_mode_off():
        before = megatron_attention_fingerprint()
        mt.initialize_model_parallel(1)
        ref = _build(1, slot=False)
        for chunked in (True, False):
            out[f"ref_{chunked}"] = _dyn_run(ref, 1, chunked)
        out["ref_small"] = _dyn_run(ref, 1, True, **SMALL_POOL)
        parallel_state.destroy_model_parallel()
        groups = mt.initialize_model_parallel(world, hier)
        model = _build(world, slot=True, hier=hier)
        for chunked in (True, False):
            out[f"tree_{chunked}"] = _dyn_run(model, world, chunked, groups)
        out["tree_small"] = _dyn_run(model, world, True, groups, **SMALL_POOL)
        parallel_state.destroy_model_parallel()
        out["fingerprint"] = (before, megatron_attention_fingerprint())
    if compat.megatron_api().inference_mode:
        from megatron.core.inference.utils import InferenceMode

        out["inference_mode_after"] = InferenceMode.is_active()
    return out


@pytest.fixture(scope="module")
def dynamic_results(layout_results):
    return [r["dynamic"] for r in layout_results]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked_prefill", "whole_prefill"])
def test_slot_dynamic_cp_equals_megatron_cp1(dynamic_results, chunked):
    ref = dynamic_results[0][f"ref_{chunked}"]
    assert set(ref["status"].values()) == {"COMPLETED"} and len(ref["tokens"]) == len(DYN_PROMPTS)
    assert [len(ref["tokens"][i]) for i in range(len(DYN_PROMPTS))] == DYN_NEW
    assert len(set(ref["finished"].values())) > 1, "requests should finish at different steps"
    for r, out in enumerate(dynamic_results):
        tree = out[f"tree_{chunked}"]
        assert tree["ctx"] == "TreeDynamicInferenceContext"
        assert tree["tokens"] == ref["tokens"], (r, chunked, tree["tokens"], ref["tokens"])
        assert tree["steps"] == ref["steps"] and tree["finished"] == ref["finished"]
        for rid, lp in ref["log_probs"].items():
            torch.testing.assert_close(torch.tensor(tree["log_probs"][rid]), torch.tensor(lp), rtol=1e-4, atol=1e-4)


def test_slot_dynamic_under_pool_pressure_equals_megatron_cp1(dynamic_results):
    """A pool too small for every request at once: the scheduler waits (more steps), no token changes."""
    big, small = dynamic_results[0]["ref_True"], dynamic_results[0]["ref_small"]
    assert set(small["status"].values()) == {"COMPLETED"} and small["tokens"] == big["tokens"]
    assert small["steps"] > big["steps"], "the small pool put no pressure on the scheduler"
    for r, out in enumerate(dynamic_results):
        tree = out["tree_small"]
        assert tree["tokens"] == small["tokens"] and tree["steps"] == small["steps"], r
        assert tree["finished"] == small["finished"], r
        assert max(max(used) for used in tree["blocks"]) <= SMALL_POOL["blocks"] - 1  # no rank's pool overflows
        for rid, lp in small["log_probs"].items():
            torch.testing.assert_close(torch.tensor(tree["log_probs"][rid]), torch.tensor(lp), rtol=1e-4, atol=1e-4)


def test_slot_dynamic_kv_memory_is_one_cp_th(dynamic_results):
    """Counted bytes: Megatron's buffer on a tree rank is empty and the paged shard holds exactly
    (blocks - dummy) x logical block / CP tokens of KV; the reference holds every block in full."""
    for out in dynamic_results:
        ref, tree = out["ref_True"]["kv"], out["tree_True"]["kv"]
        assert ref["megatron_memory_buffer"] == NUM_BLOCKS * LOGICAL_BLOCK * BYTES_PER_TOKEN
        assert tree["megatron_memory_buffer"] == 0
        assert tree["tree_kv_cache"] == (NUM_BLOCKS - 1) * LOGICAL_BLOCK * BYTES_PER_TOKEN // len(dynamic_results)
        run = out["tree_True"]
        # every request round-robin by block: within one block of even on every rank, every step
        assert max(run["spread"]) <= 1 and run["blocks"][-1] == [0] * len(dynamic_results)  # all freed at the end
        for used, live in zip(run["blocks"], run["live"]):
            assert max(used) - min(used) <= max(1, live), run["blocks"]


def test_slot_dynamic_leaves_megatron_and_inference_mode_untouched(dynamic_results):
    for out in dynamic_results:
        before, after = out["fingerprint"]
        assert before == after and after["patched"] == []
        if "inference_mode_after" in out:
            assert out["inference_mode_after"] is False


# --------------------------------------------------------------------------- MegatronLLM (0.19)


def llm_rank(rank, world, hier=None):
    from megatron.core import parallel_state
    from megatron.core.inference.apis import MegatronLLM
    from megatron.core.inference.config import InferenceConfig
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import version as compat
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu
    from megatron_tree.integrations.megatron import megatron_attention_fingerprint
    from megatron_tree.integrations.megatron.llm import TreeMegatronLLM
    from megatron_tree.integrations.megatron.model import IdTokenizer

    def icfg(cp):
        return InferenceConfig(max_sequence_length=DYN_MAX_LEN, buffer_size_gb=_gb(NUM_BLOCKS, LOGICAL_BLOCK // cp),
                               block_size_tokens=LOGICAL_BLOCK // cp, max_tokens=64, max_requests=8,
                               enable_chunked_prefill=True, use_flashinfer_fused_rope=False)

    params = SamplingParams(top_k=1, num_tokens_to_generate=6, termination_id=-1, return_log_probs=True,
                            skip_prompt_log_probs=True)
    out = {}
    with megatron_on_cpu(), compat.inference_mode_off():
        before = megatron_attention_fingerprint()
        mt.initialize_model_parallel(1)
        llm = MegatronLLM(model=_build(1, slot=False), tokenizer=IdTokenizer(eod=VOCAB - 1),
                          inference_config=icfg(1), use_coordinator=False)
        out["ref"] = [(list(map(int, r.generated_tokens)), list(r.generated_log_probs)) for r in
                      llm.generate(_dyn_prompts(), params)]
        parallel_state.destroy_model_parallel()
        groups = mt.initialize_model_parallel(world, hier)
        model = _build(world, slot=True, hier=hier)
        out["coordinator"] = _error(TreeMegatronLLM, model=model, tokenizer=IdTokenizer(eod=VOCAB - 1),
                                    inference_config=icfg(world), use_coordinator=True)
        with TreeMegatronLLM(model=model, tokenizer=IdTokenizer(eod=VOCAB - 1), inference_config=icfg(world),
                             groups=groups) as tllm:
            out["tree"] = [(list(map(int, r.generated_tokens)), list(r.generated_log_probs)) for r in
                           tllm.generate(_dyn_prompts(), params)]
            out["tree_ctx"] = type(tllm.context).__name__
        parallel_state.destroy_model_parallel()
        out["fingerprint"] = (before, megatron_attention_fingerprint())
    return out


@pytest.fixture(scope="module", params=["cp2", "cp2x2"])
def llm_results(request):
    from megatron_tree.integrations.megatron import version as compat

    if not compat.megatron_api().llm_api:
        pytest.skip(f"megatron-core {compat.megatron_api().version} has no MegatronLLM (added in 0.18)")
    return [r["llm"] for r in _layout_run(request.param)]


def test_tree_megatron_llm_equals_megatron_llm_cp1(llm_results):
    ref = llm_results[0]["ref"]
    assert len(ref) == len(DYN_PROMPTS) and all(len(t) == 6 for t, _ in ref)
    for r, out in enumerate(llm_results):
        assert out["tree_ctx"] == "TreeDynamicInferenceContext"
        assert [t for t, _ in out["tree"]] == [t for t, _ in ref], r
        for (_, lp), (_, ref_lp) in zip(out["tree"], ref):
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref_lp), rtol=1e-4, atol=1e-4)
        assert "use_coordinator=False only" in out["coordinator"], out["coordinator"]
        before, after = out["fingerprint"]
        assert before == after


# --------------------------------------------------------------------------- speculative decoding (0.19 MTP)

MTP_DRAFTS = 2
"""Draft tokens per decode step (``num_speculative_tokens``): the model's one MTP layer, run at both depths."""


def _mtp_traced_run(model, cp, groups=None, drafts=MTP_DRAFTS):
    """:func:`_dyn_run`, plus each MTP layer call's output rows (the draft step's hidden states, one row
    per active request; recorded by a forward hook on the MTP transformer layer, the only observer)."""
    calls = []
    hooks = [layer.mtp_model_layer.register_forward_hook(
        lambda mod, args, kwargs, output: calls.append(output[0][:, 0].tolist()), with_kwargs=True)
        for layer in model.mtp.layers]
    try:
        run = _dyn_run(model, cp, True, groups, drafts=drafts)
    finally:
        for h in hooks:
            h.remove()
    run["mtp_calls"] = calls
    return run


@contextlib.contextmanager
def _dropped_tokens():
    """A list that collects the tokens each ``PagedKVCache.truncate`` call drops while the block runs
    (observed at the paged cache itself, independently of the context's ``rewound_tokens`` counter)."""
    from megatron_tree.decode.paged import PagedKVCache

    dropped, truncate = [], PagedKVCache.truncate

    def observed(self, request, length):
        before = self.length(request)
        truncate(self, request, length)
        dropped.append(before - self.length(request))

    PagedKVCache.truncate = observed
    try:
        yield dropped
    finally:
        PagedKVCache.truncate = truncate


def _mtp_core_modes(model, rank):
    """The MTP core attention (flagged replicated_in_inference) and a decoder core attention (not flagged)
    on the same causal, context-free input (this rank's own q/k/v), with Megatron's InferenceMode off and
    on: (off: MTP - decoder, off: MTP - local causal, on: MTP - local causal, on: decoder - local causal),
    max abs differences. Off, both take the training layout (this rank's 2 of 2·CP chunks, every rank's
    keys); on, only the MTP core attends locally (its serial draft step's rows are the same on every rank)."""
    from megatron.core.inference.utils import InferenceMode
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tree.ops import reference

    mtp_core = model.mtp.layers[0].mtp_model_layer.self_attention.core_attention
    dec_core = model.decoder.layers[0].self_attention.core_attention
    gen = torch.Generator().manual_seed(100 + rank)
    sq, d = 6, HIDDEN // HEADS
    q = torch.randn(sq, 1, HEADS, d, generator=gen)
    k, v = (torch.randn(sq, 1, KV_HEADS, d, generator=gen) for _ in range(2))
    local, _ = reference.partial_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), softmax_scale=mtp_core.softmax_scale,
        q_positions=torch.arange(sq)[None, :], k_positions=torch.arange(sq))
    local = local.transpose(0, 1).reshape(sq, 1, -1)

    def run(core):
        with torch.no_grad():
            return core(q, k, v, None, attn_mask_type=AttnMaskType.causal)

    was = InferenceMode.is_active()
    try:
        InferenceMode.unset_active()
        mtp_off, dec_off = run(mtp_core), run(dec_core)
        InferenceMode.set_active()
        mtp_on, dec_on = run(mtp_core), run(dec_core)
    finally:
        (InferenceMode.set_active if was else InferenceMode.unset_active)()
    return [float((a - b).abs().max()) for a, b in
            ((mtp_off, dec_off), (mtp_off, local), (mtp_on, local), (dec_on, local))]


def mtp_rank(rank, world):
    """Megatron's dynamic engine with MTP drafts: CP = 1 with and without drafts, then the tree slots at CP = world."""
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import version as compat
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu
    from megatron_tree.integrations.megatron import megatron_attention_fingerprint

    out = {}
    with megatron_on_cpu() as replaced, compat.inference_mode_off():
        out["shim"] = replaced
        before = megatron_attention_fingerprint()
        mt.initialize_model_parallel(1)
        ref = _build(1, slot=False, mtp=True)
        out["ref_plain"] = _dyn_run(ref, 1, True)
        out["ref"] = _mtp_traced_run(ref, 1)
        out["ref_small"] = _dyn_run(ref, 1, True, drafts=MTP_DRAFTS, **SMALL_POOL)
        parallel_state.destroy_model_parallel()
        groups = mt.initialize_model_parallel(world)
        model = _build(world, slot=True, mtp=True)
        with _dropped_tokens() as dropped:
            out["tree"] = _mtp_traced_run(model, world, groups)
        out["tree"]["dropped"] = sum(dropped)
        with _dropped_tokens() as dropped:
            out["tree_small"] = _dyn_run(model, world, True, groups, drafts=MTP_DRAFTS, **SMALL_POOL)
        out["tree_small"]["dropped"] = sum(dropped)
        out["mtp_cores"] = [(type(layer.mtp_model_layer.self_attention.core_attention).__name__,
                             layer.mtp_model_layer.self_attention.core_attention.replicated_in_inference)
                            for layer in model.mtp.layers]
        out["decoder_flags"] = [layer.self_attention.core_attention.replicated_in_inference
                                for layer in model.decoder.layers]
        out["mtp_core_modes"] = _mtp_core_modes(model, rank)
        parallel_state.destroy_model_parallel()
        out["fingerprint"] = (before, megatron_attention_fingerprint())
    return out


@pytest.fixture(scope="module")
def mtp_results():
    from megatron_tree.integrations.megatron import version as compat

    if not compat.megatron_api().inference_config:
        pytest.skip(f"megatron-core {compat.megatron_api().version}'s dynamic engine has no speculative decoding")
    return run_ranks(mtp_rank, 3, timeout=900)


def test_slot_dynamic_mtp_speculative_equals_megatron_cp1(mtp_results):
    """0.19's speculative decoding (2 MTP drafts a step, verified by the model) through the slots at
    CP 3 (uneven shards): tokens, log-probs, finishing steps and Megatron's own per-position draft
    acceptance counts equal its CP = 1 run; the drafts were partly accepted (requests finish
    earlier than without drafts) and partly rejected (the paged cache dropped rewound tokens)."""
    plain, ref = mtp_results[0]["ref_plain"], mtp_results[0]["ref"]
    assert set(ref["status"].values()) == {"COMPLETED"} and ref["tokens"] == plain["tokens"]
    proposed, accepted = ref["drafts"]
    assert len(proposed) == MTP_DRAFTS and 0 < sum(accepted) < sum(proposed), ref["drafts"]
    assert any(ref["finished"][i] < plain["finished"][i] for i in plain["finished"]), (ref["finished"], plain["finished"])
    assert plain["drafts"] == ([], [])
    for r, out in enumerate(mtp_results):
        assert any(n.endswith("text_generation_controller.verify_speculative_tokens") for n in out["shim"])
        tree = out["tree"]
        assert tree["ctx"] == "TreeDynamicInferenceContext"
        assert out["mtp_cores"] == [("TreeDotProductAttention", True)]
        assert out["decoder_flags"] == [False, False], r  # only the MTP layers attend replicated
        # Outside InferenceMode the MTP core takes the training layout like any layer; inside, only it is local.
        off_vs_dec, off_vs_local, on_vs_local, dec_on_vs_local = out["mtp_core_modes"]
        assert off_vs_dec < 1e-6 and off_vs_local > 1e-3, (r, out["mtp_core_modes"])
        assert on_vs_local < 1e-5 and dec_on_vs_local > 1e-3, (r, out["mtp_core_modes"])
        assert tree["tokens"] == ref["tokens"], (r, tree["tokens"], ref["tokens"])
        assert tree["finished"] == ref["finished"] and tree["steps"] == ref["steps"], r
        assert tree["drafts"] == ref["drafts"], (r, tree["drafts"], ref["drafts"])
        assert tree["rewound"] > 0 and tree["blocks"][-1] == [0, 0, 0], (r, tree["rewound"], tree["blocks"][-1])
        assert tree["rewound"] == tree["dropped"], (r, tree["rewound"], tree["dropped"])  # the counter is what was cut
        for rid, lp in ref["log_probs"].items():
            torch.testing.assert_close(torch.tensor(tree["log_probs"][rid]), torch.tensor(lp), rtol=1e-4, atol=1e-4)
        # The draft step itself (MTP layer outputs, one row per request, causal over the rows as Megatron runs it).
        assert len(tree["mtp_calls"]) == len(ref["mtp_calls"]) > 0
        for got, want in zip(tree["mtp_calls"], ref["mtp_calls"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
        before, after = out["fingerprint"]
        assert before == after and after["patched"] == []


def test_slot_dynamic_mtp_speculative_under_pool_pressure(mtp_results):
    """Drafts with the small pool (requests wait for blocks, rejected drafts give blocks back): as Megatron's CP = 1."""
    small, big = mtp_results[0]["ref_small"], mtp_results[0]["ref"]
    assert small["tokens"] == big["tokens"] and small["steps"] > big["steps"], "no pressure on the scheduler"
    for r, out in enumerate(mtp_results):
        tree = out["tree_small"]
        assert tree["tokens"] == small["tokens"] and tree["finished"] == small["finished"], r
        assert tree["drafts"] == small["drafts"] and tree["rewound"] == tree["dropped"] > 0, r
        assert max(max(used) for used in tree["blocks"]) <= SMALL_POOL["blocks"] - 1  # no rank's pool overflows
