"""Architectures beyond Llama through ``integrations.hf``, against unmodified transformers, on real gloo ranks.

The architectures and their tiny configs are ``benchmarks.architectures``'s (the script
that writes docs/architectures.md): sliding windows on every layer (Mistral) or by
``layer_types`` (Qwen2, Gemma 2/3 alternation, GPT-OSS), attention sinks (GPT-OSS), attention
and final logit soft-capping (Gemma 2), MLA with its compressed latent cached and K/V of
different head dims (DeepSeek-V3), every RoPE type transformers ships (default, linear,
dynamic, yarn, longrope, llama3), StableLM (whose class flag says it bypasses the attention
interface, wrongly) and Qwen2-MoE (``sliding_window: 0`` with full-attention layers only). One
4-rank launch runs each on CP 3 (ranks 0-2; rank 3 alone) and CP 4 = 2 x 2; a left-padded batch
of prompts of 13, 8 and 3 tokens (windows are 5: shorter than two prompts, longer than one).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks

A = pytest.importorskip("benchmarks.architectures", reason="needs transformers")
NAMES = list(A.ARCHITECTURES)
EXACT = [n for n in NAMES if n != "bloom"]
WINDOWED = ("mistral-sliding", "qwen2-sliding", "gemma2", "gemma3", "gpt-oss")


def _rank_fn(rank, world):
    return A.rank_run(rank, world, NAMES)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank_fn, A.WORLD, timeout=600, pg_timeout=300)


@pytest.fixture(scope="module")
def references():
    return {name: A.reference(name) for name in EXACT}


@pytest.mark.parametrize("topo", list(A.TOPOLOGIES))
@pytest.mark.parametrize("name", EXACT)
def test_architecture_matches_single_process_transformers(ranks, references, name, topo):
    ref = references[name]
    per_rank = [r[(topo, name)] for r in ranks]
    assert [e["cp"] for e in per_rank] == ([3, 3, 3, 1] if topo == "cp3" else [4] * 4)
    for rank, e in enumerate(per_rank):
        where = f"{name} {topo} rank {rank} (CP {e['cp']})"
        assert "refused" not in e, f"{where}: {e.get('refused')}"
        assert e["cache"] == "TreeCache", where
        assert e["tokens"] == ref["tokens"], where  # greedy, left-padded batch of different lengths
        assert e["sampled"] == ref["sampled"], where  # ranks seeded differently: CP rank 0 decides
        err = float((torch.tensor(e["logits"]) - torch.tensor(ref["logits"])).abs().max())
        assert err <= A.LOGITS_ATOL, f"{where}: max |dlogits| {err:.2e}"
        assert e["lengths"] == [n + A.NEW - 1 for n in A.LENGTHS], where
    for e in per_rank:  # bitwise identical on every rank of one CP group
        assert all(o["logits"] == e["logits"] for o in per_rank if o["group"] == e["group"])
    assert A.verdict(ref, per_rank)["result"] == "exact"


@pytest.mark.parametrize("name", WINDOWED)
def test_windows_change_the_tokens(references, name):
    """The windows are short enough to matter: without them (a window longer than every sequence) the
    single-process model generates other tokens, so a backend that ignored them would fail above."""
    wide = A.reference(name, sliding_window=64)
    assert wide["tokens"] != references[name]["tokens"], name


def test_mla_caches_the_latent(ranks):
    """DeepSeek-V3 stores one latent per token (kv_lora_rank 16) and the shared RoPE key (4), not the
    expanded keys (4 heads x 12) and values (4 heads x 6)."""
    for r in ranks:
        for topo in A.TOPOLOGIES:
            assert r[(topo, "deepseek-v3")]["kv_shape"] == [1, 16, 4]


def test_own_attention_is_refused_on_every_rank(ranks):
    for topo in A.TOPOLOGIES:
        msgs = {r[(topo, "bloom")].get("refused") for r in ranks}
        assert len(msgs) == 1, msgs
        msg = msgs.pop()
        assert msg and "BloomForCausalLM does not route its attention through transformers' AttentionInterface" in msg


def test_the_table_reports_what_the_ranks_did(ranks, references, monkeypatch):
    monkeypatch.setattr(A, "reference", lambda name, **over: references[name])
    rows = A.table(NAMES, ranks)
    assert [r["name"] for r in rows] == NAMES
    for r in rows:
        want = "refused" if r["name"] == "bloom" else "exact"
        assert r["cp3"]["result"] == r["cp2x2"]["result"] == want, r
    text = A.markdown(rows, "python -m benchmarks.architectures")
    assert text.count("\n| ") == len(NAMES) + 1 and "`DeepseekV3ForCausalLM`" in text


def test_cache_takes_the_shapes_the_layers_store():
    """A config whose num_key_value_heads is not what the layers store (here: set after the model was
    built) sizes the cache wrongly; its first write re-makes the still-empty storage, and generation
    stays exact (CP 1, no process group)."""
    from megatron_tree.integrations.hf import enable_tree_attention

    ids, mask = A.batch()
    ref = A.reference("llama")
    model = A.build("llama")
    model.config.num_key_value_heads = 4  # the layers keep their 2 KV heads
    enable_tree_attention(model, None)
    got = A._generate(model, ids, mask, A.SEED_SAMPLE)
    assert got["kv_shape"] == [2, 8, 8]
    assert got["tokens"] == ref["tokens"] and got["sampled"] == ref["sampled"]
    assert float((torch.tensor(got["logits"]) - torch.tensor(ref["logits"])).abs().max()) <= A.LOGITS_ATOL
