"""A small trained causal LM the examples can load offline: ``python examples/tiny_checkpoint.py [DIR]``.

No model hub is reachable from this machine, and no package on the index ships the weights of a
trained GPT-2 / TinyStories / SmolLM / Pythia model inside its wheel (searched; see
examples/README.md), so the examples write their own: a word-level tokenizer over the words of a
few dozen short sentences (``tokenizers``' ``WordLevel`` model, saved as a
``PreTrainedTokenizerFast``) and a 2-layer transformers Llama (GQA 4/2 heads, RoPE) trained on
those sentences for a few hundred Adam steps (about 10 s on 2 CPU cores), saved with
``save_pretrained`` as safetensors. Training makes its greedy continuations the sentences it
read, so a decode that went wrong shows as a wrong sentence as well as a wrong logit.

The directory (default ``outputs/examples/tiny_llama``) is written once and reused; a finished
checkpoint has ``DONE`` beside its files.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(ROOT, "outputs", "examples", "tiny_llama")

SENTENCES = [
    "the cat sat on the mat and looked at the red ball .",
    "the dog ran to the old tree and barked at the bird .",
    "a small bird sang in the green tree every morning .",
    "the river runs past the old mill to the sea .",
    "my sister reads a long book about the stars at night .",
    "the sun rose over the hills and the farm woke up .",
    "we walked to the market and bought bread and apples .",
    "the old man told a story about the king and the dragon .",
    "the train left the station at noon and went north .",
    "a blue boat floated on the quiet lake under the moon .",
    "the children played in the park until the rain came .",
    "the baker made fresh bread before the sun rose .",
    "the king lived in a castle on the hill above the river .",
    "the dragon slept in a cave full of gold and old bones .",
    "one two three four five six seven eight nine ten .",
    "monday tuesday wednesday thursday friday saturday sunday .",
]


def _stamp(steps: int, seed: int) -> str:
    """What the checkpoint was made from (the sentences, steps, seed): a changed recipe is rewritten."""
    import hashlib

    return hashlib.sha256(repr((SENTENCES, steps, seed, 1)).encode()).hexdigest()[:16]


def ensure(path: str = DEFAULT_DIR, *, steps: int = 300, seed: int = 0) -> str:
    """Write the tokenizer and the trained model to ``path`` unless a finished one is there; returns ``path``."""
    stamp = _stamp(steps, seed)
    done = os.path.join(path, "DONE")
    if os.path.isfile(done) and open(done).read().startswith(stamp):
        return path
    if os.path.isdir(path):  # an older recipe's checkpoint, or an unfinished one
        import shutil

        shutil.rmtree(path)
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = {t: i for i, t in enumerate(["<unk>", "<pad>", "</s>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                eos_token="</s>")
    cfg = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
        pad_token_id=fast.pad_token_id, eos_token_id=fast.eos_token_id, bos_token_id=None,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    ids = [fast(s)["input_ids"] + [fast.eos_token_id] for s in SENTENCES]
    width = max(map(len, ids))
    batch = torch.full((len(ids), width), fast.pad_token_id)
    for i, row in enumerate(ids):
        batch[i, : len(row)] = torch.tensor(row)
    mask = batch != fast.pad_token_id
    labels = batch.masked_fill(~mask, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=batch, attention_mask=mask.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.generation_config.eos_token_id = fast.eos_token_id
    model.generation_config.pad_token_id = fast.pad_token_id
    tmp = path + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    fast.save_pretrained(tmp)
    with open(os.path.join(tmp, "DONE"), "w") as f:
        f.write(f"{stamp}: trained {steps} steps, final loss {loss.item():.4f}\n")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    where = ensure(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR)
    print(f"checkpoint: {where} ({open(os.path.join(where, 'DONE')).read().strip()})")
