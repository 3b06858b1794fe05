"""Tiny transformers checkpoints and their references, shared by the decode, comm and integration tests."""

import torch


ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}


PROMPTS = [[5, 17, 99, 3, 42], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]]


NEW_TOKENS = 16


def hf_config(tie=False, **over):
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.2,
              rope_scaling=dict(ROPE), rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)
    kw.update(over)
    return LlamaConfig(**kw)


def make_checkpoint(path, *, tie=False, max_shard_size=None, seed=0):
    """Save a tiny random transformers Llama into ``path``; return the HF model (eval mode)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(hf_config(tie)).eval()
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return model


def hf_greedy(model, prompts, new_tokens):
    """transformers' greedy generate, one prompt at a time (no padding), never stopping early.

    ``min_new_tokens`` also keeps transformers from choosing the EOS id before the last token, which a
    plain argmax loop (the package's, with no stop tokens) does choose: this is a reference only for runs
    whose argmax never lands on EOS (a run that does fails the comparison; it cannot pass it wrongly). On
    the tiny llama, 3 ragged prompts over 70 tokens, the package's loop equals a plain argmax loop of full
    forwards token for token, while this one departs at the first step where a row's argmax is EOS
    (steps 2 and 42 of two of the rows)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


LENGTHS = (29, 17, 1)


def hf_model(arch: str, seed: int = 0, **over):
    """A tiny random transformers causal LM; biases and norm weights are randomised too."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.2, rms_norm_eps=1e-6, pad_token_id=0, tie_word_embeddings=False)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, head_dim=16, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=16), tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common, head_dim=16, sliding_window=None), tf.MistralForCausalLM
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms (weight ~1) and biases (~0)
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    return model


def batch():
    """A left-padded batch of the prompts of LENGTHS, identical on every rank."""
    g = torch.Generator().manual_seed(5)
    seq = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, seq - n:] = torch.randint(1, 128, (n,), generator=g)
        mask[b, seq - n:] = 1
    return ids, mask
