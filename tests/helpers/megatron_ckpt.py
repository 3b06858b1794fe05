"""Test fixture: a Megatron-LM-style checkpoint written by a short training loop at CP = 1.

``train_and_save`` (run as a script, ``python tests/helpers/megatron_ckpt.py OUT PROMPTS_JSON NEW RESULT_JSON [SHAPE_JSON]``:
a process of its own, because ``dist_checkpointing.save`` starts helper processes, which the
test harness's daemonic ranks may not) builds the eval's
default GPTModel shape with Megatron's own local spec and ``DotProductAttention``, takes a
few Adam steps on random token sequences, and saves it the way Megatron-LM's ``--save``
does: ``<dir>/iter_0000004/`` written by ``dist_checkpointing.save`` with the training
arguments in ``common.pt``, and ``<dir>/latest_checkpointed_iteration.txt``. It then
decodes the eval's prompts greedily with Megatron's own ``StaticInferenceEngine`` at CP = 1:
the tokens every other layout must reproduce. ``SHAPE_JSON`` changes fields of :data:`SHAPE`
(the lm-eval test takes a vocabulary its tokenizer fills and a short context).
"""

from __future__ import annotations

import argparse
import os

import torch

STEPS = 4
SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=65536, initializer_range=0.2)
"""The default eval config's model shape (configs/cpu_tiny.yaml)."""


def training_args(**changes) -> argparse.Namespace:
    """What Megatron-LM stores as ``args`` for this shape (its argument names)."""
    args = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, group_query_attention=True,
                num_query_groups=2, kv_channels=16, padded_vocab_size=512, rotary_base=10000, norm_epsilon=1e-5,
                untie_embeddings_and_output_weights=True, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                position_embedding_type="rope", max_position_embeddings=65536, tensor_model_parallel_size=1,
                context_parallel_size=1, iteration=STEPS)
    args.update(changes)
    return argparse.Namespace(**args)


def _IdTokenizer():
    """Token ids as text: all Megatron's controller needs from a tokenizer."""
    from megatron_tree.integrations.megatron.model import IdTokenizer

    return IdTokenizer(eod=-1)


def engine_generate(model, prompts, new_tokens: int, max_len: int) -> list[list[int]]:
    """Megatron's StaticInferenceEngine + TextGenerationController at CP = 1, greedy (its own KV cache)."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_tree.integrations.megatron import version

    ctx = StaticInferenceContext(len(prompts), max_len)
    wrapper = GPTInferenceWrapper.__new__(GPTInferenceWrapper)  # the release's own signature (0.16.1 / 0.19)
    version.init_gpt_wrapper(wrapper, model, ctx, hidden_size=model.config.hidden_size, params_dtype=torch.float32,
                             padded_vocab_size=model.vocab_size)
    params = SamplingParams(top_k=1, num_tokens_to_generate=new_tokens, termination_id=-1)
    requests = [InferenceRequest(request_id=str(i), prompt=_IdTokenizer().detokenize(p), prompt_tokens=list(p),
                                 sampling_params=params) for i, p in enumerate(prompts)]
    with version.inference_mode_off():  # 0.19's engines set a process-wide flag that they never clear
        engine = StaticInferenceEngine(TextGenerationController(wrapper, _IdTokenizer()),
                                       max_batch_size=len(prompts), legacy=True)
        return [[int(t) for t in r.generated_tokens] for r in engine.generate(inference_requests=requests)]


_ARG_OF = {"vocab_size": "padded_vocab_size", "max_position_embeddings": "max_position_embeddings"}
"""The SHAPE fields a test may change, and their Megatron-LM argument names."""


def train_and_save(out_dir: str, prompts: list[list[int]], new_tokens: int, changes: dict | None = None) -> dict:
    """Train a few steps at CP = 1, save as Megatron-LM does, decode ``prompts`` with Megatron's engine."""
    from megatron.core import dist_checkpointing

    from megatron_tree.integrations import megatron as mtm
    from megatron_tree.integrations.megatron import model as mm
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    changes = dict(changes or {})
    if set(changes) - set(_ARG_OF):
        raise ValueError(f"shape changes {sorted(set(changes) - set(_ARG_OF))}: only {sorted(_ARG_OF)} may change")
    shape = mm.GPTShape(**{**SHAPE, **changes})
    losses = []
    with megatron_on_cpu():
        mtm.initialize_model_parallel(1)
        model = mm.build_gpt(shape, tree=False, seed=11)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(5)
        n = 32
        pos = torch.arange(n)[None].expand(2, n)
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None]
        for _ in range(STEPS):
            tokens = torch.randint(0, shape.vocab_size, (2, n + 1), generator=gen)
            loss = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:]).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        model.eval()
        iter_dir = os.path.join(out_dir, f"iter_{STEPS:07d}")
        os.makedirs(iter_dir)
        args = training_args(**{_ARG_OF[k]: v for k, v in changes.items()})
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": args, "iteration": STEPS,
                                 "checkpoint_version": 3.0}, iter_dir)
        with open(os.path.join(out_dir, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(STEPS))
        tokens = engine_generate(model, prompts, new_tokens, max(len(p) for p in prompts) + new_tokens + 2)
        core = type(model.decoder.layers[0].self_attention.core_attention).__name__
    return {"losses": losses, "tokens": tokens, "core_attention": core}


if __name__ == "__main__":
    import json
    import sys

    import torch.distributed as dist

    out, prompts_json, new, result, *shape_json = sys.argv[1:]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        res = train_and_save(out, json.loads(prompts_json), int(new), json.loads(shape_json[0]) if shape_json else None)
    finally:
        dist.destroy_process_group()
    with open(result, "w") as f:
        json.dump(res, f)
