"""The speculative benchmark's trained mode end to end at a tiny size (a few training steps, a short
prompt, one round) at CP 2: every row keeps plain greedy's tokens, and the models are trained once
into their cache and reused."""

import json
import os

from benchmarks import speculative


def _check_rows(data, names):
    rows = {r["config"]: r for r in data["rows"]}
    assert list(rows) == ["plain greedy"] + names
    plain = rows["plain greedy"]
    assert plain["tokens_per_step"] == 1.0 and plain["acceptance_rate"] is None
    assert plain["ms_per_token_vs_plain"] == 1.0
    for name, r in rows.items():
        assert r["median_step_ms"] > 0 and r["ms_per_token"] > 0, r
        if "sampling" in name:
            assert r["tokens_equal_greedy"] is None
            continue
        assert r["tokens_equal_greedy"] is True, r  # speculative greedy == plain greedy, every round
        # a verification step commits the target's own token and any accepted drafts: >= 1 per step
        assert r["tokens_per_step"] >= 1.0 and r["steps"] <= data["new_tokens"] - 1, r
        if r["acceptance_rate"] is not None:
            assert 0.0 <= r["acceptance_rate"] <= 1.0


def test_trained_mode_tiny(tmp_path):
    cache = tmp_path / "models"
    out, md = tmp_path / "spec.json", tmp_path / "spec.md"
    argv = ["--model", "trained", "--cache", str(cache), "--target", "2:64", "--draft", "1:64", "--train-steps", "3",
            "--train-seq", "96", "--train-batch", "2", "--vocab", "512", "--prompt-len", "256", "--new-tokens", "12",
            "--rounds", "1", "--quote-tokens", "6", "--transport", "shm", "--out", str(out), "--markdown", str(md)]
    speculative.main(argv)
    data = json.loads(out.read_text())
    assert data["command"].endswith(" ".join(argv)) and data["cp"] == 2
    assert data["prompt_len"] == 256 and data["new_tokens"] == 12 and data["rounds"] == 1
    assert data["recipe"]["target"] == [2, 64] and data["recipe"]["steps"] == 3
    assert data["needle"]["prompt_end"].startswith(speculative.INSTRUCTION) and data["transport"] == "shm"
    assert "6 tokens of a held-out paragraph" in data["prompt"] and md.read_text().startswith(
        "# Speculative decoding at CP 2 (shared memory, CPU)")
    assert 0 <= data["quoted_prefix"] <= data["quoted_tokens"] <= 12
    _check_rows(data, [name for name, _, _ in speculative.TRAINED_CONFIGS])
    assert "| draft model w1 d4 |" in md.read_text() and " NO |" not in md.read_text()
    # the cache is reused: a second ensure with the same recipe trains nothing
    done = cache / "DONE"
    stamp = done.stat().st_mtime_ns
    speculative.ensure_trained(str(cache), target=(2, 64), draft=(1, 64), vocab=512, steps=3, seq=96, batch=2,
                               log=lambda m: (_ for _ in ()).throw(AssertionError(f"retrained: {m}")))
    assert done.stat().st_mtime_ns == stamp
    assert sorted(os.listdir(cache)) == ["DONE", "draft", "target", "tokenizer.json", "tokenizer.stamp"]

