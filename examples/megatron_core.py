"""The README's Megatron-Core recipe as a complete program: Megatron's own engine at CP 4 = 2 x 2.

Run (from the repository root, offline, about a minute on 2 CPU cores):

    torchrun --standalone --nproc_per_node 4 examples/megatron_core.py

The small trained transformers Llama that examples/tiny_checkpoint.py writes is converted into a
Megatron-Core ``GPTModel`` (Llama-style: RMSNorm, SwiGLU, RoPE, GQA; the weights are copied
tensor by tensor below). Tree attention fills the ``core_attention`` and ``self_attention.module``
slots, the KV cache is sharded over CP 4 as 2 simulated nodes x 2 ranks, and Megatron's own
``StaticInferenceEngine`` generates greedily. Rank 0 checks the tokens against Megatron's own
``GPTModel`` (its ``DotProductAttention``, its own KV cache) at CP = 1 with the same weights, and
that model's logits against the transformers model's.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_tree as mt  # noqa: E402
from tiny_checkpoint import DEFAULT_DIR, ensure  # noqa: E402

NEW_TOKENS = 10
PROMPTS = ["the dragon slept in", "the train left the station at"]


def megatron_tensors(hf_model) -> dict:
    """A transformers Llama's weights under Megatron-Core's checkpoint keys (layers stacked on axis 0)."""
    cfg, sd = hf_model.config, hf_model.state_dict()
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    layers = range(cfg.num_hidden_layers)

    def qkv(i):  # Megatron interleaves per query group: that group's query heads, then its key, then its value
        q = sd[f"model.layers.{i}.self_attn.q_proj.weight"].view(hkv, hq // hkv, d, -1)
        k = sd[f"model.layers.{i}.self_attn.k_proj.weight"].view(hkv, 1, d, -1)
        v = sd[f"model.layers.{i}.self_attn.v_proj.weight"].view(hkv, 1, d, -1)
        return torch.cat([q, k, v], dim=1).reshape((hq + 2 * hkv) * d, -1)

    def stack(fn):
        return torch.stack([fn(i) for i in layers])

    return {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight":
            stack(lambda i: sd[f"model.layers.{i}.input_layernorm.weight"]),
        "decoder.layers.self_attention.linear_qkv.weight": stack(qkv),
        "decoder.layers.self_attention.linear_proj.weight": stack(lambda i: sd[f"model.layers.{i}.self_attn.o_proj.weight"]),
        "decoder.layers.mlp.linear_fc1.layer_norm_weight":
            stack(lambda i: sd[f"model.layers.{i}.post_attention_layernorm.weight"]),
        "decoder.layers.mlp.linear_fc1.weight": stack(lambda i: torch.cat(  # SwiGLU: [gate; up]
            [sd[f"model.layers.{i}.mlp.gate_proj.weight"], sd[f"model.layers.{i}.mlp.up_proj.weight"]])),
        "decoder.layers.mlp.linear_fc2.weight": stack(lambda i: sd[f"model.layers.{i}.mlp.down_proj.weight"]),
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "output_layer.weight": sd["lm_head.weight"],
    }


def generate(model, wrapper, prompts: list[list[int]]) -> list[list[int]]:
    """Megatron's StaticInferenceEngine + TextGenerationController, greedy."""
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_tree.integrations.megatron import version
    from megatron_tree.integrations.megatron.model import IdTokenizer

    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW_TOKENS, termination_id=-1)
    requests = [InferenceRequest(request_id=str(i), prompt=IdTokenizer().detokenize(p), prompt_tokens=list(p),
                                 sampling_params=params) for i, p in enumerate(prompts)]
    with version.inference_mode_off():  # megatron-core 0.19's engines leave a process-wide flag set
        engine = StaticInferenceEngine(TextGenerationController(wrapper, IdTokenizer()), len(prompts), legacy=True)
        return [[int(t) for t in r.generated_tokens] for r in engine.generate(inference_requests=requests)]


def main():
    from megatron.core import parallel_state
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_tree.integrations.megatron import checkpoint, version
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    mt.TreeGroups.from_env()  # creates the default process group from torchrun's variables
    torch.set_num_threads(1)
    if dist.get_rank() == 0:
        ensure(DEFAULT_DIR)
    dist.barrier()
    hf = AutoModelForCausalLM.from_pretrained(DEFAULT_DIR).eval()
    tok = AutoTokenizer.from_pretrained(DEFAULT_DIR)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    c = hf.config
    rope_theta = getattr(c, "rope_parameters", None) and c.rope_parameters.get("rope_theta")  # transformers 5
    rope_theta = rope_theta or getattr(c, "rope_theta", 10000.0)  # transformers 4
    shape = mm.GPTShape(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=rope_theta,
                        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings)
    weights = megatron_tensors(hf)
    mtm = mt.megatron
    with megatron_on_cpu():  # Megatron's torch.cuda allocations on the CPU (a CPU-only torch)
        mtm.initialize_model_parallel(4, [2, 2])  # CP 4 = 2 x 2, validated: never falls back to CP = 1
        single = mm.single_rank_groups()  # every rank makes the CP = 1 groups of the reference (collective)
        model = mm.build_gpt(shape, tree=True, cp=4, hierarchical=[2, 2], strategy="two_level", seed=0)
        checkpoint.fill_from_global(model, weights)
        ctx = mtm.TreeInferenceContext(len(prompts), 64, groups=mtm.tree_groups_from_megatron(model.pg_collection))
        tokens = generate(model, mtm.TreeGPTInferenceWrapper(model, ctx), prompts)
        if dist.get_rank() == 0:
            ref = mm.build_gpt(shape, tree=False, pg_collection=single, seed=0)  # Megatron's own attention, CP = 1
            checkpoint.fill_from_global(ref, weights)
            wrapper = GPTInferenceWrapper.__new__(GPTInferenceWrapper)  # the release's own signature
            version.init_gpt_wrapper(wrapper, ref, StaticInferenceContext(len(prompts), 64),
                                     hidden_size=shape.hidden_size, params_dtype=torch.float32,
                                     padded_vocab_size=shape.vocab_size)
            want = generate(ref, wrapper, prompts)
            ids = torch.tensor([prompts[0] + want[0]])
            with torch.no_grad():  # the conversion is faithful: Megatron's CP = 1 logits = transformers' logits
                positions = torch.arange(ids.shape[1]).unsqueeze(0)
                mlog = ref(ids, positions, None).float()
                hlog = hf(ids).logits
            conv = float((mlog - hlog).abs().max())
            for p, t in zip(PROMPTS, tokens):
                print(f"  {p} -> {tok.decode(t)}")
            same = tokens == want
            print(f"Megatron-Core StaticInferenceEngine at CP 4 (2 x 2, two_level) vs Megatron's own GPTModel at "
                  f"CP = 1: tokens {'identical' if same else 'DIFFER'} ({NEW_TOKENS} x {len(prompts)}); "
                  f"Megatron CP = 1 vs transformers logits max|d| {conv:.2e}")
            assert same, (tokens, want)
            assert conv < 1e-4, conv
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
