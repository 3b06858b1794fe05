"""Architectures through the transformers backend: each a tiny random model, CP-sharded against one process.

Every architecture below is built by transformers' own classes from a tiny random config
(same seed on every rank: same weights), enabled with ``enable_tree_attention`` on CP 3
(ranks 0-2 of a 4-process gloo world; rank 3 alone) and CP 4 as 2 simulated nodes x 2, and
asked to ``generate`` from a left-padded batch of prompts of different lengths (one shorter
than every sliding window used here, the others longer). Greedy tokens and per-step logits
are held to the unmodified model in one process; a sampled run (ranks seeded differently)
must give the same tokens on every rank as the single-process model seeded like CP rank 0.
A model the backend refuses is reported with its refusal (raised on every rank by
``enable_tree_attention``, before any collective).

Run (CPU, about a minute; writes the table to ``docs/architectures.md`` and ``.json``)::

    python -m benchmarks.architectures [--out docs/architectures] [--only NAME ...]

``tests/integrations/hf/test_hf_arch.py`` runs the same functions and asserts what the table reports.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import torch

LENGTHS = (13, 8, 3)
"""Prompt lengths of the left-padded batch: two longer than every window below (5), one shorter."""
NEW = 6
"""Greedy tokens generated per architecture and topology."""
SAMPLED_NEW = 4
SAMPLING = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)
SEED_SAMPLE = 1234
VOCAB = 96
WINDOW = 5
TOPOLOGIES = {
    # name -> (TreeGroups.build ranks, intra_size, enable_tree_attention kwargs)
    "cp3": ([[0, 1, 2], [3]], None, dict(strategy="auto", prefill="ring", layout="load_balanced", block_size=2)),
    "cp2x2": (None, 2, dict(strategy="two_level", prefill="allgather", layout="contiguous", block_size=2)),
}
WORLD = 4
LOGITS_ATOL = 1e-4

_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


@dataclass(frozen=True)
class Arch:
    """One architecture of the table: transformers' classes and the tiny config that exercises its feature."""

    model: str
    """transformers' causal-LM class (``config`` is its config class)."""
    config: str
    features: str
    """What the tiny config exercises (the table's column)."""
    kwargs: dict = field(default_factory=dict)
    base: bool = True
    """Start from the shared tiny widths (``False``: ``kwargs`` are the whole config)."""


def _rope(kind: str, **extra) -> dict:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **extra}}


ARCHITECTURES: dict[str, Arch] = {
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", "RoPE default", _rope("default")),
    "llama-linear": Arch("LlamaForCausalLM", "LlamaConfig", "RoPE linear", _rope("linear", factor=2.0)),
    "llama-dynamic": Arch("LlamaForCausalLM", "LlamaConfig",
                          "RoPE dynamic (NTK; frequencies grow with the sequence length)",
                          {**_rope("dynamic", factor=2.0), "max_position_embeddings": 8}),
    "llama-yarn": Arch("LlamaForCausalLM", "LlamaConfig", "RoPE yarn",
                       _rope("yarn", factor=4.0, original_max_position_embeddings=8)),
    "llama-llama3": Arch("LlamaForCausalLM", "LlamaConfig", "RoPE llama3",
                         _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8)),
    "phi3-longrope": Arch("Phi3ForCausalLM", "Phi3Config",
                          "RoPE longrope (long factors past original_max_position_embeddings)",
                          {**_rope("longrope", short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.5, 2.0, 3.0, 4.0],
                                   original_max_position_embeddings=10), "original_max_position_embeddings": 10}),
    "mistral-sliding": Arch("MistralForCausalLM", "MistralConfig", f"sliding window {WINDOW} on every layer",
                            {"sliding_window": WINDOW}),
    "qwen2-sliding": Arch("Qwen2ForCausalLM", "Qwen2Config", f"sliding window {WINDOW} on layer 0 (layer_types)",
                          {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2,
                           "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma2": Arch("Gemma2ForCausalLM", "Gemma2Config",
                   f"local {WINDOW} / global alternation, attention and final logit soft-capping",
                   {"sliding_window": WINDOW, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                    "query_pre_attn_scalar": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    "gemma3": Arch("Gemma3ForCausalLM", "Gemma3TextConfig",
                   f"local {WINDOW} / global alternation, q/k norms, per-layer-type RoPE",
                   {"sliding_window": WINDOW, "query_pre_attn_scalar": 8,
                    "layer_types": ["sliding_attention", "full_attention"]}),
    "gpt-oss": Arch("GptOssForCausalLM", "GptOssConfig", f"attention sinks, sliding window {WINDOW} alternation, MoE",
                    {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "intermediate_size": 32, "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek-v3": Arch("DeepseekV3ForCausalLM", "DeepseekV3Config",
                        "MLA (latent KV cached, K 12 / V 6 head dims), MoE",
                        {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8,
                         "qk_rope_head_dim": 4, "v_head_dim": 6, "moe_intermediate_size": 16, "n_routed_experts": 4,
                         "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1,
                         "first_k_dense_replace": 1, "head_dim": 4}),
    "stablelm": Arch("StableLmForCausalLM", "StableLmConfig",
                     "partial RoPE; class flag _supports_attention_backend is False, its attention dispatches anyway",
                     {}),
    "qwen2-moe": Arch("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                      "sliding_window stored as 0 for off, full-attention layers only, MoE",
                      {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "num_experts": 4,
                       "num_experts_per_tok": 2, "use_sliding_window": False}),
    "bloom": Arch("BloomForCausalLM", "BloomConfig", "ALiBi in its own attention code (refused)",
                  {"vocab_size": VOCAB, "hidden_size": 32, "n_layer": 2, "n_head": 4, "pad_token_id": 0,
                   "bos_token_id": 1, "eos_token_id": 2}, base=False),
}


def build(name: str, seed: int = 0, **over):
    """The tiny random model of ``ARCHITECTURES[name]`` in eval mode (the same on every process for one seed);
    ``over`` replaces config fields.

    One-dimensional parameters are randomised too (norm weights around 1, biases and attention
    sinks around 0 with spread 0.5), so a backend that dropped them would show.
    """
    import transformers as tf

    arch = ARCHITECTURES[name]
    kwargs = {**(_BASE if arch.base else {}), **arch.kwargs, **over}
    cfg = getattr(tf, arch.config)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(tf, arch.model)(cfg).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in pname else 0.0, 0.5 if "sinks" in pname else 0.2)
    return model


def batch():
    """The left-padded prompts of :data:`LENGTHS`: (ids, mask), each (batch, max length)."""
    g = torch.Generator().manual_seed(5)
    seq = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), seq, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(LENGTHS):
        ids[b, seq - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[b, seq - n:] = 1
    return ids, mask


def _generate(model, ids, mask, seed: int | None):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        if seed is not None:
            torch.manual_seed(seed)
        sampled = model.generate(ids, attention_mask=mask, max_new_tokens=SAMPLED_NEW, **SAMPLING)
    cache = out["cache"] if "cache" in out else out["past_key_values"]
    shape = [getattr(cache, n, None) for n in ("num_kv_heads", "head_dim", "head_dim_v")]
    return {"tokens": out.sequences.tolist(), "logits": torch.stack(out.logits).tolist(), "sampled": sampled.tolist(),
            "cache": type(cache).__name__, "kv_shape": shape, "lengths": getattr(cache, "lengths", None)}


def reference(name: str, **over) -> dict:
    """Unmodified transformers in this process: greedy tokens, (NEW, batch, vocab) logits, sampled tokens."""
    ids, mask = batch()
    return _generate(build(name, **over), ids, mask, SEED_SAMPLE)


def rank_run(rank: int, world: int, names) -> dict:
    """On each rank of a ``world``-process group: every architecture of ``names`` on every topology.

    returns {(topology, name): entry}: an entry holds the rank's CP size and group, and either
    ``refused`` (the ``UnsupportedModelError`` text) or the greedy tokens and logits and the
    sampled tokens (this rank seeded differently from the others).
    """
    from megatron_tree.integrations.hf import UnsupportedModelError, enable_tree_attention
    from megatron_tree.distributed.topology import TreeGroups

    ids, mask = batch()
    built = {topo: TreeGroups.build(ranks, intra) for topo, (ranks, intra, _) in TOPOLOGIES.items()}
    seen = {}
    for topo, (_, _, kw) in TOPOLOGIES.items():
        groups = built[topo]
        for name in names:
            entry = {"cp": groups.size, "cp_rank": groups.rank, "group": list(groups.cp_ranks)}
            model = build(name)
            try:
                enable_tree_attention(model, groups, **kw)
            except UnsupportedModelError as e:
                entry["refused"] = str(e)
                seen[(topo, name)] = entry
                continue
            entry.update(_generate(model, ids, mask, SEED_SAMPLE if groups.rank == 0 else 999 + rank))
            seen[(topo, name)] = entry
    return seen


def verdict(ref: dict, per_rank: list[dict]) -> dict:
    """One table cell: ``exact`` (every rank: greedy tokens equal, logits within LOGITS_ATOL, sampled tokens
    equal), ``refused`` (every rank refused, with the same text) or ``WRONG`` with what differed."""
    refused = [e.get("refused") for e in per_rank]
    if any(r is not None for r in refused):
        same = len(set(refused)) == 1 and refused[0] is not None
        return {"result": "refused" if same else "WRONG", "why": refused[0] if same else f"refusals differ: {refused}"}
    want = torch.tensor(ref["logits"])
    err = max(float((torch.tensor(e["logits"]) - want).abs().max()) for e in per_rank)
    bad = [f"rank {r}: " + ", ".join(w for w, ok in (("greedy tokens", e["tokens"] == ref["tokens"]),
                                                   ("sampled tokens", e["sampled"] == ref["sampled"]),
                                                   (f"logits off by {err:.2e}", err <= LOGITS_ATOL)) if not ok)
           for r, e in enumerate(per_rank)
           if e["tokens"] != ref["tokens"] or e["sampled"] != ref["sampled"] or err > LOGITS_ATOL]
    return {"result": "WRONG" if bad else "exact", "max_abs_dlogits": err, "why": "; ".join(bad)}


def table(names, ranks: list[dict]) -> list[dict]:
    """The table's rows: per architecture, its classes, features and the verdict per topology."""
    rows = []
    for name in names:
        arch, ref = ARCHITECTURES[name], None
        row = {"name": name, "model": arch.model, "features": arch.features}
        for topo in TOPOLOGIES:
            per_rank = [r[(topo, name)] for r in ranks]
            if ref is None and not any("refused" in e for e in per_rank):
                ref = reference(name)
            row[topo] = verdict(ref, per_rank)
        rows.append(row)
    return rows


def run(names) -> list[dict]:
    """Run :func:`rank_run` on a 4-process gloo world (this machine, ``run_ranks``) and build the table."""
    from megatron_tree.utils.testing import run_ranks

    # No bound on the whole run (a minute here, more on a loaded host); each collective has 300 s.
    ranks = run_ranks(rank_run, WORLD, list(names), timeout=float("inf"), pg_timeout=300)
    return table(names, ranks)


def markdown(rows: list[dict], command: str) -> str:
    def cell(v):
        if v["result"] == "exact":
            return f"exact (max \\|Δlogit\\| {v['max_abs_dlogits']:.1e})"
        return f"{v['result']}: {v['why']}".replace("|", "\\|")

    lines = [
        "# Architectures through the transformers backend",
        "",
        f"Produced by `{command}` (CPU, gloo; `benchmarks/architectures.py` says how). Each row is a tiny",
        "random model of transformers' own class, CP-sharded with `enable_tree_attention`, generating from a",
        f"left-padded batch of prompts of lengths {list(LENGTHS)}: {NEW} greedy tokens and logits against the",
        f"unmodified model in one process (logits within {LOGITS_ATOL:g}), and {SAMPLED_NEW} sampled tokens, ranks",
        "seeded differently, against the single-process model seeded like CP rank 0. CP 3 is ranks 0-2 with",
        "the ring prefill; 2 x 2 is CP 4 as two simulated nodes with the all-gather prefill and the two-level",
        "merge. `refused` is the `UnsupportedModelError` every rank raised in `enable_tree_attention`, before",
        "any collective.",
        "",
        "| architecture | transformers class | exercises | CP 3 | CP 4 = 2 x 2 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['name']} | `{r['model']}` | {r['features']} | {cell(r['cp3'])} | {cell(r['cp2x2'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/architectures", help="path prefix of the .md and .json written")
    p.add_argument("--only", nargs="*", choices=sorted(ARCHITECTURES), help="run only these architectures")
    args = p.parse_args(argv)
    names = args.only or list(ARCHITECTURES)
    rows = run(names)
    command = "python -m benchmarks.architectures" + (f" --only {' '.join(names)}" if args.only else "")
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(markdown(rows, command))
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"command": command, "lengths": list(LENGTHS), "new_tokens": NEW, "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['name']:16s} cp3: {r['cp3']['result']:8s} 2x2: {r['cp2x2']['result']:8s} {r['cp3'].get('why', '')}")
    return 0 if all(r[t]["result"] != "WRONG" for r in rows for t in TOPOLOGIES) else 1


if __name__ == "__main__":
    raise SystemExit(main())
