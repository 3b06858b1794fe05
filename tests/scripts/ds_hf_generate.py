"""Train with DeepSpeed, then generate CP-sharded: ``deepspeed --num_gpus 2 ds_hf_generate.py --out DIR``.

The recipe of ``docs/integrations.md`` ("transformers models under DeepSpeed"), run for
real on CPU: each rank initialises through ``megatron_tree.integrations.deepspeed.
init_distributed`` (gloo, no shared-memory op build), builds DeepSpeed's sequence-parallel
groups (``parallel_state_sp``, the mpu ALST/Ulysses training uses), trains a tiny random
transformers Llama a few steps with ``deepspeed.initialize`` (a client AdamW, so no optimizer
op is compiled), then wraps DeepSpeed's sequence-parallel group with
``TreeGroups.from_groups`` and generates from a left-padded batch with
``enable_tree_attention(engine.module, groups)``. ``--no-sp`` skips the sequence-parallel
groups: the recipe then makes a new group over the ranks.

Rank 0 saves the trained model (``save_pretrained``, before tree attention is enabled) and
writes what every rank saw to ``DIR/result.json``; the test reloads the model with plain
transformers and compares.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

PROMPT_LENGTHS = (13, 6)
NEW_TOKENS = 8


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      initializer_range=0.2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def prompts():
    """A left-padded batch (input_ids, attention_mask), the same on every rank."""
    g = torch.Generator().manual_seed(3)
    seq = max(PROMPT_LENGTHS)
    ids = torch.zeros(len(PROMPT_LENGTHS), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(PROMPT_LENGTHS):
        ids[b, seq - n:] = torch.randint(1, 128, (n,), generator=g)
        mask[b, seq - n:] = 1
    return ids, mask


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-sp", action="store_true", help="train without DeepSpeed sequence-parallel groups")
    args, _unknown = parser.parse_known_args()  # the launcher appends --local_rank=N

    import deepspeed
    import torch.distributed as dist

    from megatron_tree import CommStats, TreeGroups
    from megatron_tree.integrations.deepspeed import init_distributed
    from megatron_tree.integrations.hf import enable_tree_attention

    torch.set_num_threads(1)
    backend = init_distributed()
    world = dist.get_world_size()
    mpu = None
    if not args.no_sp:
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp.initialize_sequence_parallel(world)
        mpu = parallel_state_sp
    # Every rank builds its own random model; deepspeed.initialize broadcasts rank 0's weights.
    model = tiny_llama(seed=dist.get_rank())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=mpu)

    data = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(7))
    losses = []
    engine.train()
    for _ in range(args.steps):
        loss = engine(input_ids=data, labels=data).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))

    # DeepSpeed's sequence-parallel group when training had one, else a new group of all ranks.
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        sp_group, source = engine.get_sequence_parallel_group(), "deepspeed sequence-parallel group"
    else:
        sp_group, source = dist.new_group(list(range(world))), "new group"
    groups = TreeGroups.from_groups(sp_group)

    trained = engine.module.eval()
    os.makedirs(args.out, exist_ok=True)
    if dist.get_rank() == 0:
        trained.save_pretrained(os.path.join(args.out, "model"), safe_serialization=True)
    flat = torch.cat([p.detach().reshape(-1) for p in trained.parameters()])
    sums = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(sums, torch.stack([flat.double().sum(), flat.double().abs().sum()]))

    stats = CommStats()
    enable_tree_attention(trained, groups, stats=stats)
    ids, mask = prompts()
    with torch.no_grad():
        out = trained.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    mine = {"rank": dist.get_rank(), "tokens": out.sequences.tolist(), "logits": [lg.tolist() for lg in out.logits],
            "shards": cache.shard_lengths, "kv_bytes": cache.kv_nbytes, "merges": stats.calls}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        info = {
            "backend": backend, "world_size": world, "local_size": os.environ.get("LOCAL_SIZE"),
            "group_source": source, "cp_ranks": list(groups.cp_ranks), "losses": losses,
            "weights_agree": all(torch.equal(s, sums[0]) for s in sums), "ranks": everyone,
        }
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(info, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
