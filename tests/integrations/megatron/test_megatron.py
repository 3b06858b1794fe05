"""Megatron-Core integration: greedy decode through Megatron's inference path at CP = 4, CP [2, 2], CP = 1.

Both Megatron's controller loop driven by hand (to read logits) and
``StaticInferenceEngine.generate`` are checked. One 4-rank gloo run builds the same tiny GPTModel (local spec, RoPE, GQA, fp32) three times:
with Megatron's own DotProductAttention at CP = 1 (the baseline), and with
TreeDotProductAttention at CP = 4 (flat) and CP = 4 with hierarchical sizes [2, 2]. Each
decodes 16 greedy tokens for a 2-row batch with an odd prompt length (so the 2·CP prefill
chunks need padding and the decode shards grow unevenly) and the results must be identical.
"""

from __future__ import annotations


import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.weights import seed_weights

VOCAB = 96
HIDDEN = 64
HEADS, KV_HEADS = 4, 2
PROMPT_LEN = 11
NEW_TOKENS = 16
MAX_LEN = 28
BLOCK = 4  # decode tokens go to one rank in blocks of 4, round-robin (megatron_tree.placement)


def _config(cp, hier):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        attention_backend=AttnBackend.local,  # the wrapper passes an explicit causal mask (CPU)
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=KV_HEADS,
        ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True, context_parallel_size=cp,
        hierarchical_context_parallel_sizes=hier, params_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, add_bias_linear=False,
    )


def _build_model(cp, hier, tree: bool, strategy="auto"):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.integrations.megatron import get_gpt_layer_tree_spec

    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    spec = get_gpt_layer_tree_spec(strategy=strategy) if tree else get_gpt_layer_local_spec()
    model = GPTModel(
        _config(cp, hier), spec, vocab_size=VOCAB, max_sequence_length=MAX_LEN,
        position_embedding_type="rope", share_embeddings_and_output_weights=False,
    )
    return seed_weights(model).eval()  # the same weights in every configuration, clear greedy margins


def _prompts():
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (2, PROMPT_LEN), generator=gen)


def greedy_decode(model, wrapper_cls, context):
    """The controller's static-batch loop: prefill the prompt, then one token per step."""
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig

    cfg = InferenceWrapperConfig(
        hidden_size=HIDDEN, params_dtype=torch.float32, inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=VOCAB, inference_max_requests=2, inference_max_seq_length=MAX_LEN,
    )
    wrapper = wrapper_cls(model, cfg, context)
    wrapper.prep_model_for_inference()
    tokens = torch.zeros(2, MAX_LEN, dtype=torch.long)
    tokens[:, :PROMPT_LEN] = _prompts()
    inputs = wrapper.prep_inference_input(tokens)
    start, end = 0, PROMPT_LEN
    margins = []
    for step in range(NEW_TOKENS):
        if step:
            context.enable_decode_mode()
        window = wrapper.get_batch_for_context_window(inputs, start, end)
        logits = wrapper.run_one_forward_step(window)[:, -1].float()
        top2 = logits.topk(2, dim=-1).values
        margins.append(float((top2[:, 0] - top2[:, 1]).min()))
        inputs["tokens"][:, end] = logits.argmax(-1)
        start, end = end, end + 1
    return inputs["tokens"][:, PROMPT_LEN:end].tolist(), min(margins), logits.tolist()


def _IdTokenizer():
    """Token ids as text ("5 17 3"): all the controller needs from a tokenizer."""
    from megatron_tree.integrations.megatron.model import IdTokenizer

    return IdTokenizer(eod=VOCAB - 1)


def engine_generate(model, wrapper_cls, context, prompts=None):
    """Megatron's StaticInferenceEngine (legacy static batching) + TextGenerationController, greedy.

    prompts: token lists (default: the two 11-token prompts); unequal lengths exercise the
    controller's path that prefills the shortest prompt and then feeds the rest token by token.
    """
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    cfg = InferenceWrapperConfig(
        hidden_size=HIDDEN, params_dtype=torch.float32, inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=VOCAB, inference_max_requests=2, inference_max_seq_length=MAX_LEN,
    )
    controller = TextGenerationController(wrapper_cls(model, cfg, context), _IdTokenizer())
    engine = StaticInferenceEngine(controller, max_batch_size=2, legacy=True)
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
    requests = [
        InferenceRequest(request_id=str(i), prompt=_IdTokenizer().detokenize(p), prompt_tokens=list(p),
                         sampling_params=params)
        for i, p in enumerate(prompts if prompts is not None else _prompts().tolist())
    ]
    done = engine.generate(inference_requests=requests)
    return [[int(t) for t in r.generated_tokens] for r in done]


# A 3-token prompt at CP = 4 leaves half the ranks with an empty shard after prefill.
UNEVEN_PROMPTS = [[5, 17, 3], [40, 2, 9, 77, 31, 8, 60, 12, 1]]

TRAIN_LEN = 16  # a multiple of 2 * CP for the training layout


def full_sequence_logits(model, cp_group, cp_size):
    """Logits of a 16-token sequence given to the model in Megatron's training CP layout, gathered.

    Each rank feeds ``get_batch_on_this_cp_rank``'s chunks (no inference context, no mask
    tensor); the gathered logits are put back in sequence order with the same layout.
    """
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_tree.integrations.megatron import load_balanced_positions

    tokens = torch.randint(0, VOCAB, (2, TRAIN_LEN), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(TRAIN_LEN)[None, :].expand(2, -1)
    local = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": positions}, cp_group=cp_group)
    # Megatron's own attention needs the causal mask as a tensor (True = masked); ours derives
    # it from global positions, which is the only correct mask for the load-balanced chunks.
    mask = torch.triu(torch.ones(TRAIN_LEN, TRAIN_LEN, dtype=torch.bool), 1)[None, None] if cp_size == 1 else None
    with torch.no_grad():
        logits = model(local["tokens"], local["position_ids"], mask)  # [b, s_local, V]
    if cp_size == 1:
        return logits.tolist(), local["position_ids"][0].tolist()
    parts = [torch.empty_like(logits) for _ in range(cp_size)]
    dist.all_gather(parts, logits.contiguous(), group=cp_group)
    order = torch.cat([load_balanced_positions(TRAIN_LEN, cp_size, r) for r in range(cp_size)])
    full = torch.cat(parts, dim=1)[:, torch.argsort(order)]
    return full.tolist(), local["position_ids"][0].tolist()


def _error(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 -- the test asserts on type and message
        return f"{type(err).__name__}: {err}"
    return "no error"


def megatron_rank(rank, world):
    """Everything that needs Megatron's groups on 4 ranks, in one spawn (imports cost ~15 s a rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_tree.comm import CommStats
    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import patches
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    results = {}
    fingerprint = mt.megatron_attention_fingerprint()
    with megatron_on_cpu():
        # Baseline: Megatron's own attention and KV cache, CP = 1 (every rank the same model).
        mt.initialize_model_parallel(1)
        model = _build_model(1, None, tree=False)
        results["megatron_cp1"] = greedy_decode(model, GPTInferenceWrapper, StaticInferenceContext(2, MAX_LEN))
        results["megatron_cp1_engine"] = engine_generate(model, GPTInferenceWrapper, StaticInferenceContext(2, MAX_LEN))
        results["megatron_cp1_uneven"] = engine_generate(
            model, GPTInferenceWrapper, StaticInferenceContext(2, MAX_LEN), UNEVEN_PROMPTS
        )
        results["megatron_cp1_core"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
        results["megatron_cp1_train"] = full_sequence_logits(model, parallel_state.get_context_parallel_group(), 1)
        # Our attention at CP = 1 inside Megatron's own (unsharded) KV cache: the hook defers to Megatron.
        model = _build_model(1, None, tree=True)
        results["tree_cp1_megatron_cache"] = greedy_decode(model, GPTInferenceWrapper, StaticInferenceContext(2, MAX_LEN))
        parallel_state.destroy_model_parallel()

        for name, cp, hier, strategy in (("tree_cp4", 4, None, "packed"), ("tree_cp2x2", 4, [2, 2], "two_level")):
            mt.initialize_model_parallel(cp, hier)
            model = _build_model(cp, hier, tree=True, strategy=strategy)
            stats = CommStats()
            for layer in model.decoder.layers:
                layer.self_attention.core_attention.comm_stats = stats
            ctx = mt.TreeInferenceContext(2, MAX_LEN, groups=mt.tree_groups_from_megatron(model.pg_collection),
                                          block_size=BLOCK)
            results[name] = greedy_decode(model, mt.TreeGPTInferenceWrapper, ctx)
            results[name + "_stats"] = (stats.calls, {k: v.collectives for k, v in stats.levels.items()})
            results[name + "_shard"] = (ctx.local_lengths(0, 2).tolist(), ctx.shard_lens(0), ctx.shard_lens(1),
                                        ctx.capacity)
            results[name + "_positions"] = [ctx.local_positions[b, : ctx.local_lengths(b, b + 1)[0]].tolist()
                                            for b in range(2)]
            results[name + "_levels"] = [lvl.size for lvl in ctx.groups.levels]
            results[name + "_core"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
            results[name + "_module"] = type(model.decoder.layers[0].self_attention).__name__
            results[name + "_engine"] = engine_generate(model, mt.TreeGPTInferenceWrapper, ctx)
            results[name + "_uneven"] = engine_generate(model, mt.TreeGPTInferenceWrapper, ctx, UNEVEN_PROMPTS)
            results[name + "_train"] = full_sequence_logits(model, model.pg_collection.cp, cp)
            # The integration's constructor sees the same layout from pg_collection and from parallel_state.
            results[name + "_from_megatron"] = (mt.tree_groups_from_megatron(model.pg_collection).describe(),
                                                mt.tree_groups_from_megatron().describe())
            parallel_state.destroy_model_parallel()

        # The integration applied no patch; with the source patches applied by hand (for models
        # without the module slot), Megatron's own attention is unchanged.
        results["patched"] = patches.check_runtime()
        results["fingerprint"] = (fingerprint, mt.megatron_attention_fingerprint())
        patches.apply_runtime()
        mt.initialize_model_parallel(1)
        model = _build_model(1, None, tree=False)
        results["megatron_cp1_patched"] = greedy_decode(model, GPTInferenceWrapper, StaticInferenceContext(2, MAX_LEN))
        parallel_state.destroy_model_parallel()
        patches.revert_runtime()

        # Bad layouts fail loudly and leave no groups behind (no fallback to CP = 1).
        for label, args in (("cp3", (3,)), ("cp8", (8,)), ("hier23", (4, [2, 3])), ("hier4_2", (4, [2]))):
            results["bad_" + label] = (_error(mt.initialize_model_parallel, *args),
                                       parallel_state.model_parallel_is_initialized())
        results["mixed_batch"] = mixed_length_batch(rank)
        results["host_sync"] = decode_without_host_sync()

        mt.initialize_model_parallel(2)
        # Misuse: our spec with Megatron's own wrapper and context at CP = 2, the patch reverted
        # and never applied by hand: building the spec applies it, so the model refuses.
        patches.revert_runtime()  # (the mixed batch's MegatronLM applied it)
        results["megatron_ctx_cp2_patched_before"] = patches.check_runtime()
        results["megatron_ctx_cp2"] = _error(
            greedy_decode, _build_model(2, None, tree=True), GPTInferenceWrapper, StaticInferenceContext(2, MAX_LEN)
        )
        # Megatron's static engine on CP ranks handed different requests (a rank-dependent prompt): each rank would
        # take its chunks of its own prompt and the assembled logits mix them; every rank must refuse instead.
        cp2 = _build_model(2, None, tree=True)
        own = [[5, 17, 3 + rank % 2], [40, 2, 9, 77, 31, 8, 60, 12, 1]]  # CP rank 1 (ranks 1, 3) differs
        results["static_different_prompts"] = _error(
            engine_generate, cp2, mt.TreeGPTInferenceWrapper,
            mt.TreeInferenceContext(2, MAX_LEN, groups=mt.tree_groups_from_megatron(cp2.pg_collection)), own)
        longer = [[5, 17, 3, 4][: 3 + rank % 2], [40, 2, 9, 77, 31, 8, 60, 12, 1]]  # (before: a gloo abort)
        results["static_different_lengths"] = _error(
            engine_generate, cp2, mt.TreeGPTInferenceWrapper,
            mt.TreeInferenceContext(2, MAX_LEN, groups=mt.tree_groups_from_megatron(cp2.pg_collection)), longer)
        results["static_same_after"] = engine_generate(
            cp2, mt.TreeGPTInferenceWrapper,
            mt.TreeInferenceContext(2, MAX_LEN, groups=mt.tree_groups_from_megatron(cp2.pg_collection)), UNEVEN_PROMPTS)
        results["deepspeed_mpu"] = deepspeed_mpu_check()
        results["bad_config_vs_groups"] = _error(_build_model, 4, None, True)
        # A context (or MegatronLM) over other ranks than the model's CP group -- here the whole world of 4,
        # e.g. TreeGroups.from_env(), beside a model at CP 2 -- would place each row over 4 ranks while the
        # layers merge over 2: every rank must refuse it before any step (it decoded other tokens, silently).
        from megatron_tree.distributed.topology import TreeGroups
        from megatron_tree.integrations.megatron.model import GPTShape, MegatronLM

        world_groups = TreeGroups.from_groups(dist.group.WORLD)
        # Weights mapped in memory (the README's example path) with an untied output layer, filled into a model
        # that ties it: the trained output layer must not be dropped silently (check_checkpoint refuses it too).
        from megatron_tree.integrations.megatron import checkpoint as mc
        from megatron_tree.integrations.megatron import model as mm

        dims = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=1,
                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS)
        single = mm.single_rank_groups()
        untied = mc.global_tensors(mm.build_gpt(GPTShape(**dims), tree=False, pg_collection=single, seed=0))
        tied = mm.build_gpt(GPTShape(**dims, tie_word_embeddings=True), tree=False, pg_collection=single, seed=1)
        results["fill_drops_output_layer"] = _error(mc.fill_from_global, tied, untied)
        results["fill_drops_other"] = _error(mc.fill_from_global, tied, {**{k: v for k, v in untied.items()
                                                                            if k != "output_layer.weight"},
                                                                         "decoder.layers.self_attention.q_layernorm.weight":
                                                                         torch.ones(2, HIDDEN // HEADS)})
        cp2_model = _build_model(2, None, tree=True)
        results["ctx_groups_not_the_models"] = _error(
            mt.TreeGPTInferenceWrapper, cp2_model, mt.TreeInferenceContext(2, MAX_LEN, groups=world_groups))
        results["lm_groups_not_the_models"] = _error(
            MegatronLM, cp2_model, world_groups, GPTShape(VOCAB, HIDDEN, 4 * HIDDEN, 2, HEADS, KV_HEADS))
        results["bad_ctx_type"] = _error(
            mt.TreeDotProductAttention(_config(2, None), 1, AttnMaskType.causal, "self",
                                       pg_collection=_pg()).adjust_key_value_for_inference,
            None, StaticInferenceContext(2, MAX_LEN), None, None, None, None,
        )
        parallel_state.destroy_model_parallel()
        results["world"] = dist.get_world_size()
    return results


def decode_without_host_sync() -> dict:
    """MegatronLM.decode_step at CP 4 = [2, 2] under ``sync_guard.no_host_sync``:
    TreeInferenceContext's plan, the KV-cache hook, the core attention's tree_decode and the
    two-level merge read no tensor value back to the host. Rows of different lengths, blocks
    of 2 so new tokens move across ranks; logits checked against Megatron's own model at CP 1."""
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import checkpoint as mc
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.utils.sync_guard import HostSyncError, no_host_sync

    mt.initialize_model_parallel(4, [2, 2])
    shape = mm.GPTShape(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                        initializer_range=0.2)
    src = mm.build_gpt(shape, tree=False, pg_collection=mm.single_rank_groups(), seed=5)
    model = mm.build_gpt(shape, tree=True, cp=4, hierarchical=[2, 2], seed=5)
    mc.fill_from_global(model, mc.global_tensors(src))
    lm = mm.MegatronLM(model, mt.tree_groups_from_megatron(model.pg_collection), shape)
    seqs = [[3, 1, 4, 1, 5, 9, 2], [6, 5]]
    cache = lm.new_cache(len(seqs), 32, block_size=2)
    ids = lm.prefill(seqs, cache).argmax(-1)
    err, sync = 0.0, None
    try:
        for _ in range(5):
            for s, t in zip(seqs, ids.tolist()):
                s.append(t)
            with no_host_sync("MegatronLM.decode_step"):
                logits = lm.decode_step(ids, cache, strategy="two_level")
                ids = logits.argmax(-1)
            for b, s in enumerate(seqs):
                full = mm.MegatronReference(src)(torch.tensor([s]))[0, -1].float()
                err = max(err, float((logits[b] - full).abs().max()))
    except HostSyncError as e:  # reported by the test; the rest of the run goes on
        sync = str(e)
    parallel_state.destroy_model_parallel()
    return {"err": err, "sync": sync, "shards": [cache.shard_lens(b) for b in range(len(seqs))]}


MIXED_LENGTHS = (8, 512)
MIXED_NEW = 4


def mixed_length_batch(rank) -> dict:
    """Prompts of 8 and 512 tokens in one batch at CP 4 = [2, 2], through the eval's path
    (MegatronLM + generate): every prompt is prefilled CP-sharded at its full length, then
    both rows decode together. Counted on each rank: the query tokens its core attention saw
    in each prefill forward and the keys they attended, and the decode forwards. Megatron's
    own StaticInferenceEngine at CP = 1 (rank 0) is the token reference and shows the
    controller's way: prefill the shortest prompt, then the rest one token per step."""
    from megatron.core import parallel_state

    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import checkpoint as mc
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.integrations.megatron.attention import CorePlan
    from tests.helpers.megatron_ckpt import engine_generate

    mt.initialize_model_parallel(4, [2, 2])
    shape = mm.GPTShape(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                        initializer_range=0.2)
    single = mm.single_rank_groups()
    src = mm.build_gpt(shape, tree=False, pg_collection=single, seed=3)  # Megatron's own attention, CP = 1
    model = mm.build_gpt(shape, tree=True, cp=4, hierarchical=[2, 2], seed=3)
    mc.fill_from_global(model, mc.global_tensors(src))
    lm = mm.MegatronLM(model, mt.tree_groups_from_megatron(model.pg_collection), shape)
    seen, states, decode_plans = [], {}, []

    def state(module):  # every attribute of the module, by object: what a forward could read besides its arguments
        return {k: id(v) for k, v in vars(module).items()}

    def count(module, args, kwargs):
        query, key = args[0], args[1]
        plan = kwargs.get("attn_mask_type")  # the context's CorePlan for this forward
        mode = plan.mode if isinstance(plan, CorePlan) else None
        seen.append((mode, module.layer_number, tuple(query.shape[:2]), key.shape[0]))
        if mode == "decode":
            states.setdefault(module.layer_number, []).append(state(module))
            decode_plans.append((module.layer_number, plan))

    for layer in model.decoder.layers:
        layer.self_attention.core_attention.register_forward_pre_hook(count, with_kwargs=True)
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in MIXED_LENGTHS]
    cache = lm.new_cache(2, max(MIXED_LENGTHS) + MIXED_NEW, block_size=16)
    res = generate(lm, prompts, MIXED_NEW, cache=cache, progress=False)
    out = {"tokens": res.tokens, "calls": list(seen), "shards": [cache.shard_lens(b) for b in range(2)]}
    # The step's metadata reaches the core attention with the call (CorePlan), not through module state:
    # each core attention is the same object, attribute for attribute, in every decode forward and after.
    after = {layer.self_attention.core_attention.layer_number: state(layer.self_attention.core_attention)
             for layer in model.decoder.layers}
    out["core_state_changes"] = sorted({(n, k) for n, seq in states.items() for st in seq for k in
                                        set(st) | set(after[n]) if st.get(k) != after[n].get(k)})
    out["core_state_steps"] = {n: len(seq) for n, seq in states.items()}
    # one CorePlan per decode step, shared by both layers of that step
    out["plan_per_step"] = [(a[0], b[0], a[1] is b[1]) for a, b in zip(decode_plans[::2], decode_plans[1::2])]
    # strategy="shifted" through the same path: one SUM per layer per step after the first, and a
    # step whose shifts are far off raises the deferred flag and is redone on the same plan.
    from megatron_tree.comm import CommStats
    from megatron_tree.decode.generate import StepRunner

    st = CommStats()
    shifted = generate(lm, prompts, MIXED_NEW, cache=cache, strategy="shifted", stats=st, progress=False)
    # (no "cp" level: no merge reached the loop's stats -- the layers merged into a DecodeStep of their own)
    out["shifted"] = (shifted.tokens, st.fallbacks, dict(st.levels["cp"].ops) if "cp" in st.levels else {})
    ids, runner, redo_tokens = lm.prefill(prompts, cache).argmax(-1), StepRunner("shifted", lm.groups), []
    for i in range(MIXED_NEW - 1):
        if i == 1:
            runner.shifts = {key: r - 500.0 for key, r in runner.shifts.items()}  # weights overflow
        logits, redone = runner.run(lm, ids, cache)
        ids = logits.argmax(-1)
        redo_tokens.append((ids.tolist(), redone))
    out["shifted_redo"] = (redo_tokens, [cache.shard_lens(b) for b in range(2)])
    # A rewound step run again gets the DecodeStep it is handed then, not the one its plan first carried:
    # each step's CommStats counts that run's merges (2 layers, packed: one MAX and one SUM each).
    from megatron_tree.decode.generate import DecodeStep

    first, again = CommStats(), CommStats()
    lm.decode_step(ids, cache, DecodeStep("packed", first))
    cache.rewind_step()
    lm.decode_step(ids, cache, DecodeStep("packed", again))
    out["rewound_stats"] = [{name: dict(lv.ops) for name, lv in s.levels.items()} for s in (first, again)]
    from megatron_tree.decode.generate import DecodeCache, DecodeModel

    out["protocol"] = (isinstance(lm, DecodeModel), isinstance(cache, DecodeCache))  # generate's written protocol
    if rank == 0:
        baseline_calls = []
        src.decoder.layers[0].self_attention.core_attention.register_forward_pre_hook(
            lambda m, a: baseline_calls.append(tuple(a[0].shape[:2])))
        out["megatron_cp1"] = engine_generate(src, prompts, MIXED_NEW, max(MIXED_LENGTHS) + MIXED_NEW + 2)
        out["megatron_cp1_calls"] = baseline_calls
    parallel_state.destroy_model_parallel()
    return out


def deepspeed_mpu_check() -> dict:
    """deepspeed.initialize(mpu=MegatronMPU()) over Megatron's current groups: what DeepSpeed sees."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups
    from megatron.core import parallel_state

    from megatron_tree.integrations.deepspeed import MegatronMPU, init_distributed

    import os

    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what the launcher would set (one node)
    init_distributed()  # adopts the harness's gloo group; no shm-op compile
    model = torch.nn.Linear(8, 8)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1},
        mpu=MegatronMPU(),
    )
    info = {
        "sequence_parallel_size": engine.sequence_parallel_size,
        "dp_world_size": engine.dp_world_size,
        "seq_dp_world_size": engine.seq_dp_world_size,
        "train_batch_size": engine.train_batch_size(),
        "sp_group_ranks": dist.get_process_group_ranks(ds_groups._get_sequence_parallel_group()),
        "megatron_cp_ranks": dist.get_process_group_ranks(parallel_state.get_context_parallel_group()),
        "seq_dp_group_ranks": dist.get_process_group_ranks(engine.seq_data_parallel_group),
    }
    ds_groups.mpu = None  # DeepSpeed keeps the mpu in a module global; later code must not see it
    return info


def _pg():
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp", "hcp"])


@pytest.fixture(scope="module")
def megatron_results():
    return run_ranks(megatron_rank, 4, timeout=900)


def test_greedy_decode_identical_cp4_hierarchical_and_megatron_cp1(megatron_results):
    out = megatron_results
    base_tokens, base_margin, base_logits = out[0]["megatron_cp1"]
    # fp32 attention of different algorithms agrees to ~1e-6; choices closer than this would be luck.
    assert base_margin > 1e-3, f"the baseline's greedy choices are too close to call ({base_margin})"
    assert out[0]["megatron_cp1_core"] == "DotProductAttention"
    assert out[0]["tree_cp4_core"] == out[0]["tree_cp2x2_core"] == "TreeDotProductAttention"
    assert out[0]["tree_cp4_module"] == out[0]["tree_cp2x2_module"] == "TreeSelfAttention"
    for r in range(4):
        assert out[r]["megatron_cp1"][0] == base_tokens
        # The same through StaticInferenceEngine + TextGenerationController (Megatron's generate()).
        assert out[r]["megatron_cp1_engine"] == base_tokens
        assert out[r]["tree_cp4_engine"] == base_tokens
        assert out[r]["tree_cp2x2_engine"] == base_tokens
        # Prompts of 3 and 9 tokens: empty shards after prefill, then the controller's catch-up.
        assert len(out[r]["megatron_cp1_uneven"][0]) == NEW_TOKENS
        assert out[r]["tree_cp4_uneven"] == out[r]["tree_cp2x2_uneven"] == out[r]["megatron_cp1_uneven"]
        for name in ("tree_cp4", "tree_cp2x2"):
            torch.testing.assert_close(torch.tensor(out[r][name][2]), torch.tensor(base_logits), rtol=1e-4, atol=1e-4)
        assert out[r]["tree_cp4"][0] == base_tokens, f"rank {r}: CP=4 decode differs from Megatron CP=1"
        assert out[r]["tree_cp2x2"][0] == base_tokens, f"rank {r}: CP=[2,2] decode differs from Megatron CP=1"
        assert out[r]["tree_cp4_levels"] == [4]
        assert out[r]["tree_cp2x2_levels"] == [2, 2]
        assert out[r]["tree_cp1_megatron_cache"][0] == base_tokens
        torch.testing.assert_close(torch.tensor(out[r]["tree_cp1_megatron_cache"][2]), torch.tensor(base_logits),
                                   rtol=1e-4, atol=1e-4)
        flat, flat_ps = out[r]["tree_cp4_from_megatron"]
        hier, hier_ps = out[r]["tree_cp2x2_from_megatron"]
        assert flat == flat_ps and flat["cp_ranks"] == [0, 1, 2, 3] and flat["levels"] == [{"name": "intra", "size": 4}]
        assert hier == hier_ps and hier["levels"] == [{"name": "intra", "size": 2}, {"name": "inter", "size": 2}]
    # 15 decode steps x 2 layers merged by tree decode: packed = 2 collectives over the CP group,
    # two_level = 2 inside each simulated node, then 2 across.
    assert out[0]["tree_cp4_stats"] == (30, {"cp": 60})
    assert out[0]["tree_cp2x2_stats"] == (30, {"intra": 60, "inter": 60})
    # The cache is sharded by the planner: 11 prompt tokens as 3, 3, 3, 2, then 15 decode tokens
    # in blocks of 4 opening on the least-loaded rank (3, then 0, 1, 2): 26 tokens over 4 ranks.
    for name in ("tree_cp4", "tree_cp2x2"):
        _, row0, row1, capacity = out[0][name + "_shard"]
        assert row0 == row1 == [7, 7, 6, 6]
        assert [out[r][name + "_shard"][0] for r in range(4)] == [[n, n] for n in row0]
        assert capacity == MAX_LEN // 4


def test_prefill_in_training_layout_and_cache_shards_disjoint(megatron_results):
    """The 11-token prompt is stored in get_batch_on_this_cp_rank's chunks r and 7-r of 8
    (the first 11 % 8 chunks one token longer); decode tokens follow in blocks of 4. Together
    the ranks hold every position of the 26 cached tokens exactly once."""
    expected = {0: [0, 1, 10, *range(15, 19)], 1: [2, 3, 9, *range(19, 23)], 2: [4, 5, 8, *range(23, 26)],
                3: [6, 7, *range(11, 15)]}
    for name in ("tree_cp4", "tree_cp2x2"):
        for r in range(4):
            for b in range(2):
                assert megatron_results[r][name + "_positions"][b] == expected[r], (name, r, b)


def test_mixed_length_batch_is_prefilled_cp_sharded_then_decoded(megatron_results):
    """Prompts of 8 and 512 tokens: two prefill forwards (one per length), each rank's attention
    gets its own 2 and 128 query and key tokens (the ring brings the others'); then MIXED_NEW - 1 decode
    forwards of both rows. Megatron's static controller at CP = 1 needs 1 + 504 + 3 forwards."""
    base = megatron_results[0]["mixed_batch"]["megatron_cp1"]
    for r in range(4):  # the decode step's metadata is an argument of the call, never state of the module
        mixed = megatron_results[r]["mixed_batch"]
        assert mixed["core_state_steps"] == {1: MIXED_NEW - 1, 2: MIXED_NEW - 1}, mixed["core_state_steps"]
        assert mixed["core_state_changes"] == [], mixed["core_state_changes"]
        assert mixed["plan_per_step"] == [(1, 2, True)] * (MIXED_NEW - 1), mixed["plan_per_step"]
    assert [len(t) for t in base] == [MIXED_NEW, MIXED_NEW]
    for r in range(4):
        mixed = megatron_results[r]["mixed_batch"]
        assert mixed["tokens"] == base, (r, mixed["tokens"], base)
        for layer in (1, 2):
            calls = [(mode, q, k) for mode, ln, q, k in mixed["calls"] if ln == layer]
            prefill = [c for c in calls if c[0] == "prefill"]
            decode = [c for c in calls if c[0] == "decode"]
            # [s, b] of the queries on this rank, and the keys handed to the core attention: this rank's
            # chunks only (ring_prefill passes the rest round the ring; no all-gather of the prompt)
            assert prefill == [("prefill", (2, 1), 2), ("prefill", (128, 1), 128)], (r, layer, prefill)
            assert sum(q[0] for _, q, _ in prefill) == sum(MIXED_LENGTHS) // 4
            assert [q for _, q, _ in decode] == [(1, 2)] * (MIXED_NEW - 1)
            assert len(calls) == 2 + MIXED_NEW - 1
        # stored: the prompts in the load-balanced layout, then 3 decode tokens of each row in a
        # block opened on rank 0; row 1's rank 0 is full at ceil(516 / 4) = 129, so its block
        # moves on to ranks 1 and 2
        assert mixed["shards"] == [[5, 2, 2, 2], [129, 129, 129, 128]]
        # shifted: the same tokens; step 0 packed (MAX + SUM per layer), later steps one SUM per layer
        tokens, fallbacks, ops = mixed["shifted"]
        assert tokens == base and fallbacks == 0, (r, tokens, fallbacks)
        assert ops == {"all_reduce_max": 2, "all_reduce_sum": 2 * (MIXED_NEW - 1)}, \
            f"the loop's CommStats counted {ops}: the layers did not merge through the loop's DecodeStep"
        # the redone step gives the same tokens and the cache advanced once per step
        assert mixed["protocol"] == (True, True)  # MegatronLM and its context provide the loop's protocol
        steps, shards = mixed["shifted_redo"]
        assert [redone for _, redone in steps] == [False, True, False]
        # the rewound step's second run merges into the stats of the step handed to it, not the first's
        packed = {"cp": {"all_reduce_max": 2, "all_reduce_sum": 2}}
        assert mixed["rewound_stats"] == [packed, packed], mixed["rewound_stats"]
        assert [t for t, _ in steps] == [[row[i + 1] for row in base] for i in range(MIXED_NEW - 1)]
        assert shards == [[5, 2, 2, 2], [129, 129, 129, 128]]
    # Megatron's controller: one prefill of the shortest prompt (8 tokens), then one forward per token.
    calls = megatron_results[0]["mixed_batch"]["megatron_cp1_calls"]
    assert calls[0] == (8, 2) and calls[1:] == [(1, 2)] * (max(MIXED_LENGTHS) - 8 + MIXED_NEW - 1)


def test_patched_megatron_attention_unchanged(megatron_results):
    out = megatron_results
    assert out[0]["patched"] == {"0001-attention-kv-cache-hook": False, "0002-dynamic-attention-hook": False}
    before, after = out[0]["fingerprint"]
    assert before == after and after["patched"] == [], "Megatron's attention module changed during the decodes"
    for r in range(4):
        assert out[r]["megatron_cp1_patched"][0] == out[r]["megatron_cp1"][0]
        assert out[r]["megatron_cp1_patched"][2] == out[r]["megatron_cp1"][2]  # bit-identical logits


def test_training_cp_layout_forward_matches_cp1(megatron_results):
    """The 2·CP load-balanced chunks (get_batch_on_this_cp_rank) through our attention at CP = 4."""
    out = megatron_results
    base, base_pos = out[0]["megatron_cp1_train"]
    assert base_pos == list(range(TRAIN_LEN))
    for r in range(4):
        for name in ("tree_cp4_train", "tree_cp2x2_train"):
            logits, pos = out[r][name]
            c = TRAIN_LEN // 8
            assert pos == list(range(r * c, (r + 1) * c)) + list(range((7 - r) * c, (8 - r) * c))
            torch.testing.assert_close(torch.tensor(logits), torch.tensor(base), rtol=1e-4, atol=1e-4)


def test_bad_layouts_fail_loudly(megatron_results):
    out = megatron_results[0]
    assert out["world"] == 4
    for label, needle in (("cp3", "does not divide the launched world of 4"),
                          ("cp8", "does not divide the launched world of 4"),
                          ("hier23", "multiply to 6, expected the context_parallel_size 4"),
                          ("hier4_2", "multiply to 2, expected the context_parallel_size 4")):
        message, initialised = out["bad_" + label]
        assert message.startswith("TopologyError") and needle in message, message
        assert initialised is False
    assert out["bad_config_vs_groups"].startswith("TopologyError")
    assert "context_parallel_size=4 but the CP process group has 2 ranks" in out["bad_config_vs_groups"]
    assert out["bad_ctx_type"].startswith("RuntimeError") and "needs a TreeInferenceContext" in out["bad_ctx_type"]


def test_static_engine_on_cp_ranks_with_different_requests_is_refused_on_every_rank(megatron_results):
    """Each CP rank's controller prepares its own batch; ranks handed different prompts (or lengths, or token
    budgets) all raise one DisagreementError naming the ranks before the prefill (before: no error, and the
    tokens came from logits assembled out of both ranks' prompts)."""
    for rank, out in enumerate(megatron_results):
        for key in ("static_different_prompts", "static_different_lengths"):
            message = out[key]
            assert message.startswith("DisagreementError"), (rank, key, message)
            assert "TreeGPTInferenceWrapper" in message and "prompt_tokens" in message, message
        # the engine runs on afterwards, with Megatron CP = 1's tokens for the same requests
        assert out["static_same_after"] == megatron_results[0]["megatron_cp1_uneven"]


def test_fill_from_global_refuses_tensors_the_model_would_drop(megatron_results):
    """In-memory weights (fill_from_global, as examples/megatron_core.py maps a transformers Llama) with a tensor the
    model has no parameter for are refused, as check_checkpoint refuses them in a checkpoint (before: ignored, so an
    untied output layer filled into a tied model left the logits on the embedding, silently)."""
    out = megatron_results[0]
    message = out["fill_drops_output_layer"]
    assert message.startswith("CheckpointError"), message
    assert "output_layer.weight" in message and "tie_word_embeddings" in message, message
    message = out["fill_drops_other"]
    assert message.startswith("CheckpointError"), message
    assert "decoder.layers.self_attention.q_layernorm.weight" in message and "no parameter" in message, message


def test_context_over_other_ranks_than_the_models_cp_group_is_refused(megatron_results):
    """A TreeInferenceContext (or MegatronLM) whose groups are not the model's CP group is refused on every
    rank when it is wrapped, naming both rank lists (before: no error, and the static engine's tokens differed
    from the model's own CP-group context)."""
    for rank, out in enumerate(megatron_results):
        cp = "(0, 1)" if rank < 2 else "(2, 3)"
        for key, what in (("ctx_groups_not_the_models", "TreeGPTInferenceWrapper"),
                          ("lm_groups_not_the_models", "MegatronLM")):
            message = out[key]
            assert message.startswith("ValueError"), message
            assert what in message and "ranks (0, 1, 2, 3)" in message and f"CP group {cp}" in message, message
            assert "tree_groups_from_megatron(model.pg_collection)" in message, message


def test_megatrons_own_context_at_cp2_is_refused_on_every_rank(megatron_results):
    """No TreeGPTInferenceWrapper anywhere: the spec alone makes Megatron's StaticInferenceContext fail loudly."""
    for out in megatron_results:
        assert out["megatron_ctx_cp2_patched_before"] == {
            "0001-attention-kv-cache-hook": False, "0002-dynamic-attention-hook": False}
        message = out["megatron_ctx_cp2"]
        assert message.startswith("RuntimeError"), message
        assert "context_parallel_size=2 needs a TreeInferenceContext (got StaticInferenceContext)" in message


def test_spec_swap_idempotent_reversible_version_gated(monkeypatch, caplog):
    import logging

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_tree.integrations import megatron as mt

    spec = get_gpt_layer_local_spec()
    attn = spec.submodules.self_attention
    subs = attn.submodules
    assert subs.core_attention is DotProductAttention and attn.module is SelfAttention
    from megatron_tree.integrations.megatron import patches

    patches.revert_runtime()
    with caplog.at_level(logging.INFO, logger="megatron_tree.integrations"):
        mt.use_tree_attention(spec, strategy="two_level")
    assert any("TreeDotProductAttention(strategy=two_level)" in r.getMessage() for r in caplog.records)
    # both slots filled, no source patch applied: the module slot's hooks make Megatron's own
    # contexts at CP > 1 fail loudly
    assert patches.check_runtime() == {"0001-attention-kv-cache-hook": False, "0002-dynamic-attention-hook": False}
    assert attn.module is mt.TreeSelfAttention and attn.module._megatron_tree == mt.SLOT_MARKER
    assert issubclass(mt.TreeSelfAttention, SelfAttention)
    slot = subs.core_attention
    assert slot.func is mt.TreeDotProductAttention and slot.keywords["strategy"] == "two_level"
    assert slot._megatron_tree == mt.MARKER and slot.__wrapped__ is DotProductAttention
    mt.use_tree_attention(spec, strategy="packed")  # idempotent: the slots already hold ours
    assert subs.core_attention is slot and attn.module is mt.TreeSelfAttention
    mt.restore_core_attention(spec)
    assert subs.core_attention is DotProductAttention and attn.module is SelfAttention
    mt.restore_core_attention(spec)
    assert subs.core_attention is DotProductAttention and attn.module is SelfAttention
    with pytest.raises(ValueError, match="unknown merge strategy 'ring'"):
        mt.use_tree_attention(spec, strategy="ring")

    class OwnAttention(SelfAttention):
        pass

    attn.module = OwnAttention  # a model's own attention module: no slot left for ours
    with pytest.raises(TypeError, match="self_attention.module is OwnAttention, expected Megatron's SelfAttention"):
        mt.use_tree_attention(spec)
    assert subs.core_attention is DotProductAttention  # refused before anything changed
    attn.module = SelfAttention
    from megatron_tree.integrations.megatron import version

    monkeypatch.setattr(version, "megatron_version", lambda: "0.18.2")
    with pytest.raises(RuntimeError, match=r"supports megatron-core >=0.16.1,<0.17, >=0.19.0,<0.20 .* but 0.18.2"):
        mt.use_tree_attention(spec)
    assert subs.core_attention is DotProductAttention and attn.module is SelfAttention


def test_deepspeed_initialize_sees_megatron_cp_as_sequence_parallel(megatron_results):
    """4 ranks, Megatron CP = 2: DeepSpeed's sequence-parallel group is Megatron's CP group, DP = 2."""
    for r, out in enumerate(megatron_results):
        mpu = out["deepspeed_mpu"]
        assert mpu["sequence_parallel_size"] == 2
        assert mpu["dp_world_size"] == 2
        assert mpu["seq_dp_world_size"] == 4 and mpu["seq_dp_group_ranks"] == [0, 1, 2, 3]
        assert mpu["train_batch_size"] == 2  # micro-batch 1 x DP 2
        assert mpu["sp_group_ranks"] == mpu["megatron_cp_ranks"] == ([0, 1] if r < 2 else [2, 3])


def test_megatron_decode_step_cp4_two_level_has_no_host_sync(megatron_results):
    """MegatronLM.decode_step ran under sync_guard.no_host_sync on every rank (a sync raises) and stayed exact."""
    for out in megatron_results:
        assert out["host_sync"]["sync"] is None, out["host_sync"]["sync"]
        assert out["host_sync"]["err"] < 1e-4, out["host_sync"]
        assert all(min(row) > 0 for row in out["host_sync"]["shards"]), out["host_sync"]  # every rank holds tokens


def test_check_checkpoint_refuses_tensors_the_config_would_drop(tmp_path):
    """A real torch_dist checkpoint (DCP metadata, as dist_checkpointing writes it) of a model with an
    untied output layer, read against a config that ties it: the trained output layer would be dropped."""
    import json

    import torch.distributed.checkpoint as dcp

    from megatron_tree.integrations.megatron.checkpoint import CheckpointError, check_checkpoint, expected_tensor_shapes
    from megatron_tree.integrations.megatron.model import GPTShape

    dims = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128)
    untied = GPTShape(**dims, tie_word_embeddings=False)
    tied = GPTShape(**dims, tie_word_embeddings=True)
    tensors = {k: torch.zeros(v) for k, v in expected_tensor_shapes(untied).items()}
    tensors["optimizer.state.exp_avg.output_layer.weight"] = torch.zeros(32, 16)  # not the model's: allowed
    dcp.save(tensors, checkpoint_id=str(tmp_path), no_dist=True)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                        "common_backend": "torch", "common_backend_version": 1}))
    assert check_checkpoint(str(tmp_path), untied).dist_dir == str(tmp_path)
    with pytest.raises(CheckpointError, match=r"has output_layer\.weight \(an untied output layer\) but "
                                              r"model\.tie_word_embeddings is true"):
        check_checkpoint(str(tmp_path), tied)
