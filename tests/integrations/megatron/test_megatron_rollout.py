"""Rollouts in the training layout: a GPTModel trained at CP 2 by Megatron's own loop decodes in place.

Megatron decodes only at CP = 1 (0.19's ``inference/shards_spec.py`` rejects cp != 1, and
Megatron-RL builds a second, CP = 1 inference model when training uses CP > 1). Here one 2-rank
gloo run trains the same tiny GPTModel (2 layers, GQA, RoPE, fp32) a few steps with Megatron's
own training pieces -- ``get_forward_backward_func()``'s schedule, its ``DistributedDataParallel``
(gradients averaged over the data-and-context-parallel group by ``finalize_model_grads``) and
``get_megatron_optimizer`` (SGD) -- twice, on the same token sequences:

* at CP = 1 with Megatron's own layer spec (``DotProductAttention``); it then generates with
  Megatron's own ``DynamicInferenceEngine`` (the reference);
* at CP = 2 with the tree layer spec (each rank its 2·CP load-balanced chunks of every sequence,
  ``get_batch_on_this_cp_rank``); the *same* module objects, in the same process groups, with no
  reshard, no checkpoint round trip and no second model, then generate with the dynamic engine at
  CP 2 (the paged KV cache sharded over the two ranks).

The trained weights agree to fp32 noise, the rollout tokens are equal and their log-probs
within 1e-4, on megatron-core 0.16.1 and 0.19.x alike.
"""

from __future__ import annotations


import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.weights import seed_weights

VOCAB, HIDDEN, HEADS, KV_HEADS = 96, 64, 4, 2
SEQ = 24  # a multiple of 2 * CP: get_batch_on_this_cp_rank's requirement
BATCH = 2
STEPS = 3
LR = 0.05
MAX_LEN = 128
BLOCK = 16  # Megatron's logical block; 8 tokens per rank at CP 2
BLOCKS = 10
PROMPTS = [[5, 17, 3, 40, 2, 9, 77], [12, 1, 88, 4], [9] * 20, [31]]
NEW = [8, 5, 7, 4]
ARRIVALS = [0, 0, 2, 3]
BYTES_PER_TOKEN = 2 * 2 * KV_HEADS * (HIDDEN // HEADS) * 4


def _gb(blocks: int, block_tokens: int) -> float:
    return (blocks + 0.5) * block_tokens * BYTES_PER_TOKEN / 2**30


def _config(cp):
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        attention_backend=AttnBackend.local, num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=KV_HEADS, ffn_hidden_size=4 * HIDDEN, use_cpu_initialization=True,
        context_parallel_size=cp, params_dtype=torch.float32, attention_dropout=0.0, hidden_dropout=0.0,
        add_bias_linear=False,
    )


def _build(cp: int, tree: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tree.integrations.megatron import get_gpt_layer_tree_spec

    model_parallel_cuda_manual_seed(1234, inference_rng_tracker=True)
    spec = get_gpt_layer_tree_spec(strategy="packed") if tree else get_gpt_layer_local_spec()
    model = GPTModel(_config(cp), spec, vocab_size=VOCAB, max_sequence_length=MAX_LEN,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False)
    return seed_weights(model)  # the same weights at both layouts


def _batches():
    """The same batch every step, so that the loss must fall (the loop trains)."""
    seq = torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    return [seq] * STEPS


def train(model, cp: int) -> list[float]:
    """Megatron's own training step, ``STEPS`` times: schedule, DDP gradient sync, optimizer."""
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_tree.integrations.megatron.version import batch_on_this_cp_rank

    config = model.config
    config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=False), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="sgd", lr=LR, weight_decay=0.0, sgd_momentum=0.0, clip_grad=0.0,
                                                 bf16=False, fp16=False, params_dtype=torch.float32), [ddp])
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]

    def loss_func(output_tensor):
        # Megatron-LM's convention (pretrain_gpt.loss_func): this rank's loss sum over the whole batch's
        # token count; Megatron's schedule scales it by the CP size and DDP averages over the CP group,
        # so the gradient is the whole batch's mean loss's. The reported loss is summed over CP.
        local = output_tensor.float().sum()
        reported = local.detach().clone()
        torch.distributed.all_reduce(reported, group=parallel_state.get_context_parallel_group())
        return local / (BATCH * SEQ), {"lm loss": reported / (BATCH * SEQ)}

    def forward_step(data_iterator, module):
        seq = next(data_iterator)
        batch = batch_on_this_cp_rank({
            "tokens": seq[:, :-1], "labels": seq[:, 1:],
            "position_ids": torch.arange(SEQ)[None].expand(BATCH, SEQ).contiguous(),
        }, cp_group=parallel_state.get_context_parallel_group())
        mask = causal if cp == 1 else None  # the tree core attention masks by global position
        out = module(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return out, partial(loss_func)

    forward_backward = get_forward_backward_func()
    losses = []
    model.train()
    for seq in _batches():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter([seq]), model=[ddp],
                               num_microbatches=1, seq_length=SEQ // cp, micro_batch_size=BATCH,
                               forward_only=False)
        ok, _, _ = opt.step()
        assert ok, "Megatron's optimizer skipped a step"
        losses.append(float(out[0]["lm loss"]))
    model.eval()
    return losses


def rollout(model, cp: int, groups=None):
    from megatron_tree.integrations.megatron.dynamic import build_dynamic_engine, dynamic_kv_bytes, generate_dynamic
    from megatron_tree.integrations.megatron.model import IdTokenizer

    engine = build_dynamic_engine(model, IdTokenizer(eod=VOCAB - 1), max_sequence_length=MAX_LEN,
                                  buffer_size_gb=_gb(BLOCKS, BLOCK // cp), block_size_tokens=BLOCK // cp,
                                  max_tokens=64, max_requests=4, enable_chunked_prefill=True, groups=groups)
    run = generate_dynamic(engine, PROMPTS, num_tokens_to_generate=NEW, arrivals=ARRIVALS)
    return {"tokens": run.tokens, "log_probs": run.log_probs, "status": run.status, "ctx": type(engine.context).__name__,
            "kv": dynamic_kv_bytes(engine.context)}


def rollout_rank(rank, world):
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import version
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    out = {}
    with megatron_on_cpu():
        mt.initialize_model_parallel(1)  # two data-parallel replicas of CP = 1
        ref = _build(1, tree=False)
        out["ref_losses"] = train(ref, 1)
        with version.inference_mode_off():  # 0.19's engines set a process-wide flag that breaks training
            out["ref"] = rollout(ref, 1)
        ref_weights = {n: p.detach().clone() for n, p in ref.named_parameters()}
        out["moved"] = max(float((ref_weights[n] - p).abs().max()) for n, p in _build(1, tree=False).named_parameters())
        parallel_state.destroy_model_parallel()

        groups = mt.initialize_model_parallel(2)
        model = _build(2, tree=True)
        out["losses"] = train(model, 2)
        weights = dict(model.named_parameters())
        out["weight_names"] = (sorted(weights), sorted(ref_weights))
        out["weight_diff"] = {n: float((weights[n].detach() - w).abs().max()) for n, w in ref_weights.items()}
        out["weight_scale"] = {n: float(w.abs().max()) for n, w in ref_weights.items()}
        with version.inference_mode_off():
            out["tree"] = rollout(model, 2, groups)  # the trained module itself, in the training groups
        out["losses_after_rollout"] = train(model, 2)[:1]  # and training goes on after the rollout
        out["fingerprint"] = mt.megatron_attention_fingerprint()
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(rollout_rank, 2, timeout=900)


def test_training_at_cp2_matches_cp1(results):
    for out in results:
        assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-5, abs=1e-6)
        assert out["ref_losses"][-1] < out["ref_losses"][0], "the training loop did not train"
        assert out["losses_after_rollout"][0] < out["losses"][0], "training after the rollout did not go on"
        names, ref_names = out["weight_names"]
        assert names == ref_names
        assert out["moved"] > 1e-3, "training did not change the weights"
        for name, diff in out["weight_diff"].items():
            assert diff <= 1e-5 * (1 + out["weight_scale"][name]), (name, diff)


def test_rollout_in_training_layout_equals_cp1(results):
    ref = results[0]["ref"]
    assert set(ref["status"].values()) == {"COMPLETED"}
    assert [len(ref["tokens"][i]) for i in range(len(PROMPTS))] == NEW
    for r, out in enumerate(results):
        tree = out["tree"]
        assert tree["ctx"] == "TreeDynamicInferenceContext"
        assert tree["tokens"] == ref["tokens"], (r, tree["tokens"], ref["tokens"])
        for rid, lp in ref["log_probs"].items():
            torch.testing.assert_close(torch.tensor(tree["log_probs"][rid]), torch.tensor(lp), rtol=1e-4, atol=1e-4)
        assert tree["kv"]["megatron_memory_buffer"] == 0
        assert tree["kv"]["tree_kv_cache"] == (BLOCKS - 1) * BLOCK * BYTES_PER_TOKEN // 2
        assert out["fingerprint"]["patched"] == []


def _gather_rank(rank, world):
    import torch.distributed as dist

    from megatron_tree import TreeGroups
    from megatron_tree.integrations.megatron.attention import _GatherSeq, gather_seq

    groups = TreeGroups.build()
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randn(3, 2, generator=g, dtype=torch.float64) for _ in range(world)]
    weights = [torch.randn(3 * world, 2, generator=g, dtype=torch.float64) for _ in range(world)]
    mine = chunks[rank].clone().requires_grad_(True)
    with torch.no_grad():
        plain = gather_seq(chunks[rank], groups, "test gather")
    out = _GatherSeq.apply(mine, groups, "test gather")
    (out * weights[rank]).sum().backward()
    # the reference in one process: rank r's loss is <weights[r], cat(chunks)>, so the sum of every
    # rank's loss has gradient sum_r weights[r] with respect to the whole sequence
    want = sum(weights)[rank * 3:(rank + 1) * 3]
    dist.barrier()
    return {"gathered": out.detach().tolist(), "plain": plain.tolist(), "cat": torch.cat(chunks).tolist(),
            "grad": mine.grad.tolist(), "want": want.tolist()}


def test_training_layout_gather_backward_sums_every_ranks_gradient():
    """docs/integrations.md: the training layout's key/value gather has a backward, an all-reduce of the
    gathered tensor's gradient over the CP group, of which each rank keeps its own chunk's slice."""
    for out in run_ranks(_gather_rank, 2, timeout=300):
        assert out["gathered"] == out["plain"] == out["cat"]
        torch.testing.assert_close(torch.tensor(out["grad"]), torch.tensor(out["want"]), rtol=1e-12, atol=1e-12)
