"""lm-eval's RULER ``niah_single_1`` through the ``megatron_tree`` backend at CP 3, against ``hf``.

RULER's own task (its template, "repeat" haystack, needle words and numbers, and scorer, from
lm-eval's ``tasks/ruler``) at 512 tokens, registered by ``benchmarks.niah.write_task``
with a dataset function that asks RULER's ``generate_samples`` for 2 samples instead of its 500
(the only change). A word-level tokenizer covering the haystack and needles is built offline; the
model is a tiny random Llama (GQA 4/2, llama3 RoPE scaling). lm-eval's ``hf`` backend in this
process gives the reference: every CP rank returns identical greedy generations (128 tokens or up
to the end token) and the same task score; each rank holds its share of the KV cache.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.ranks import run_ranks

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'megatron_tree[lmeval]')")
pytest.importorskip("wonderwords", reason="lm-eval's RULER extra is not installed (pip install 'lm-eval[ruler]')")

LENGTH = 512
SAMPLES = 2
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_theta=10000.0, tie_word_embeddings=False, initializer_range=0.2,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128})


def _offline():
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from benchmarks import niah

    _offline()
    root = str(tmp_path_factory.mktemp("ruler"))
    tok = niah.build_tokenizer(os.path.join(root, "tok"))
    niah.build_checkpoint(os.path.join(root, "model"), tok, 2, LENGTH, **TINY)
    niah.write_task(root)
    return root


@pytest.fixture(scope="module")
def reference(root):
    from lm_eval.models.huggingface import HFLM

    from benchmarks import niah

    lm = HFLM(pretrained=os.path.join(root, "model"), tokenizer=os.path.join(root, "tok"), max_length=LENGTH,
              batch_size=1, device="cpu", dtype="float32")
    return niah.evaluate(lm, root, LENGTH, SAMPLES)


def _rank(rank, world, root):
    _offline()
    from benchmarks import niah
    from megatron_tree.integrations.lm_eval import TreeLM

    lm = TreeLM(pretrained=os.path.join(root, "model"), tokenizer=os.path.join(root, "tok"), cp_size=world,
                max_length=LENGTH, device="cpu", batch_size=1)
    caches = niah.record_caches(lm)
    out = niah.evaluate(lm, root, LENGTH, SAMPLES)
    out["shards"] = [c.shard_lengths for c in caches]
    return out


@pytest.mark.parametrize("cp", [3])  # CP 2: the shipped tasks in test_lm_eval.py, and bench.niah at 4K-16K
def test_niah_single_1_at_cp_equals_lm_eval_hf(root, reference, cp):
    assert reference["samples"] == SAMPLES and len(reference["generations"]) == SAMPLES
    assert all(LENGTH // 2 < n <= LENGTH - 128 for n in reference["prompt_tokens"]), reference["prompt_tokens"]
    assert sum(reference["generated_tokens"]) > SAMPLES, "the reference generated (almost) nothing: nothing compared"
    results = run_ranks(_rank, cp, root, timeout=300)
    for r, got in enumerate(results):
        assert got["generations"] == reference["generations"], (cp, r, got["generations"], reference["generations"])
        assert got["score"] == reference["score"] and got["samples"] == SAMPLES
        assert got["prompt_tokens"] == reference["prompt_tokens"]
        for shards in got["shards"]:  # each row spread over every rank, none holding more than its share + 1
            for row in shards:
                assert len(row) == cp and max(row) - min(row) <= 1 and sum(row) > LENGTH // 2, row
