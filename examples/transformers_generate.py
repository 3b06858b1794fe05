"""The README's transformers recipe as a complete program: a causal LM's own ``generate``, CP-sharded.

Run (from the repository root, offline, about 30 s on 2 CPU cores):

    torchrun --standalone --nproc_per_node 2 examples/transformers_generate.py [CHECKPOINT_DIR]

CHECKPOINT_DIR: any ``save_pretrained`` directory of a decoder transformers can load (default: the
small trained Llama that examples/tiny_checkpoint.py writes on first use). ``TreeGroups.from_env()``
creates the process group from torchrun's variables (no ``init_process_group`` needed); every rank
holds 1/CP of every layer's KV cache (half at CP 2); the generated tokens and every step's logits are checked
against the same model's ``generate`` in one process without context parallelism.
"""

import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_tree as mt  # noqa: E402
from tiny_checkpoint import DEFAULT_DIR, ensure  # noqa: E402

PROMPTS = ["the dragon slept in", "the old man told a story about the king and"]

groups = mt.TreeGroups.from_env()  # CP group + node levels from torchrun / deepspeed / Slurm
torch.set_num_threads(1)
path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR
if dist.get_rank() == 0 and len(sys.argv) == 1:
    ensure(path)  # rank 0 writes the checkpoint once; the others wait at the barrier
dist.barrier()

tok = AutoTokenizer.from_pretrained(path)
tok.padding_side = "left"
batch = tok(PROMPTS, return_tensors="pt", padding=True, return_token_type_ids=False)
settings = dict(attention_mask=batch["attention_mask"], max_new_tokens=12, do_sample=False,
                return_dict_in_generate=True, output_logits=True)

model = mt.hf.enable_tree_attention(AutoModelForCausalLM.from_pretrained(path).eval(), groups)
out = model.generate(batch["input_ids"], **settings)  # every rank, same inputs, same tokens

if dist.get_rank() == 0:
    ref_model = AutoModelForCausalLM.from_pretrained(path).eval()  # the same weights, one process, no CP
    ref = ref_model.generate(batch["input_ids"], **settings)
    dlogits = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
    for row in tok.batch_decode(out.sequences[:, batch["input_ids"].shape[1]:], skip_special_tokens=True):
        print(f"  generated: {row}")
    same = torch.equal(out.sequences, ref.sequences)
    print(f"transformers generate at CP {groups.size} vs one process: tokens {'identical' if same else 'DIFFER'}, "
          f"max|dlogits| {dlogits:.2e} over {len(out.logits)} steps x {len(PROMPTS)} rows")
    assert same, (out.sequences.tolist(), ref.sequences.tolist())
    assert dlogits < 1e-4, dlogits
dist.destroy_process_group()
