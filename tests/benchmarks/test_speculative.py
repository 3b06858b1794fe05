"""The speculative benchmark's trained mode end to end at a tiny size (a few training steps, a short
prompt, one round) at CP 2: every row keeps plain greedy's tokens, and the models are trained once
into their cache and reused."""

import json
import os

import pytest

from benchmarks import speculative

_RANK = speculative._rank


def _rank_noting_transport(rank, world, path, *args):
    """``speculative._rank``, also writing the transport its groups were built with
    (``describe()["transport"]``) to ``transport.<rank>`` two levels above the model's directory, so
    the test sees what the ranks ran on rather than what the report repeats from the command line."""
    from megatron_tree.distributed import topology

    build = topology.TreeGroups.__dict__["build"]

    def noting(cls, *a, **kw):
        groups = build.__func__(cls, *a, **kw)
        with open(os.path.join(os.path.dirname(os.path.dirname(path)), f"transport.{rank}"), "w") as f:
            f.write(groups.describe()["transport"])
        return groups

    topology.TreeGroups.build = classmethod(noting)
    try:
        return _RANK(rank, world, path, *args)
    finally:
        topology.TreeGroups.build = build


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


def test_trained_mode_tiny(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    monkeypatch.setattr(speculative, "_rank", _rank_noting_transport)
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
    # --transport reaches the ranks' groups, not only the report
    assert [(tmp_path / f"transport.{r}").read_text() for r in range(2)] == ["shm", "shm"]
    # --quote-tokens reaches the prompt: its last 6 tokens are the needle's first, after the instruction, and
    # the passage greedy should quote is the 12 tokens that follow the needle's first 6 in the text
    tok = Tokenizer.from_file(str(cache / "tokenizer.json"))
    prompt, info = speculative.needle_prompt(tok, 256, 12, 0.5, 6)
    instr, at = tok.encode(speculative.INSTRUCTION).ids, info["needle_token"]
    assert len(prompt) == 256 and prompt[-6 - len(instr):-6] == instr
    assert prompt[-6:] == prompt[at:at + 6] and at + 18 <= 256 - 6 - len(instr)
    assert info["expected"] == prompt[at + 6:at + 18] and info["prompt_end"] == tok.decode(instr + prompt[at:at + 6])
    assert data["needle"] == {k: v for k, v in info.items() if k != "expected"}
    assert data["expected_text"] == tok.decode(info["expected"])
    said, meant = data["plain_greedy_text"].split(), data["expected_text"].split()
    words = 0
    while words < min(len(said), len(meant)) and said[words] == meant[words]:
        words += 1
    assert data["quoted_words_prefix"] == words
    _check_rows(data, [name for name, _, _ in speculative.TRAINED_CONFIGS])
    assert "| draft model w1 d4 |" in md.read_text() and " NO |" not in md.read_text()
    # the cache is reused: a second ensure with the same recipe trains nothing
    done = cache / "DONE"
    stamp = done.stat().st_mtime_ns
    speculative.ensure_trained(str(cache), target=(2, 64), draft=(1, 64), vocab=512, steps=3, seq=96, batch=2,
                               log=lambda m: (_ for _ in ()).throw(AssertionError(f"retrained: {m}")))
    assert done.stat().st_mtime_ns == stamp
    assert sorted(os.listdir(cache)) == ["DONE", "draft", "target", "tokenizer.json", "tokenizer.stamp"]



def test_quote_counts_tokens_and_words():
    """The report's quoting measures: ids equal by position, the leading ids equal, and the leading words
    equal in the decoded text (a word split into other tokens still counts)."""
    pieces = {1: "The", 2: " cat", 3: " sat", 4: " s", 5: "at", 6: " on", 7: " mat", 8: " rug"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    # " sat" spelt " s" + "at": the token prefix ends at 2, the words agree up to " on"
    assert speculative.quote_counts([1, 2, 4, 5, 6, 8], [1, 2, 3, 6, 7, 6], decode) == {
        "quoted_tokens": 2, "quoted_prefix": 2, "quoted_words_prefix": 4}
    # every word of the shorter text equal: the prefix is its length; a later equal id still counts
    assert speculative.quote_counts([1, 2, 4, 5, 6], [1, 2, 3, 6, 6], decode) == {
        "quoted_tokens": 3, "quoted_prefix": 2, "quoted_words_prefix": 4}
    assert speculative.quote_counts([8, 2, 3], [1, 2, 3], decode) == {
        "quoted_tokens": 2, "quoted_prefix": 0, "quoted_words_prefix": 0}
    assert speculative.quote_counts([1, 2, 3], [1, 2, 3], decode) == {
        "quoted_tokens": 3, "quoted_prefix": 3, "quoted_words_prefix": 3}


@pytest.mark.parametrize("argv, message", [
    (["--model", "cycling", "--draft-layers", "3"], "--draft-layers applies to --model smollm2 only"),
    (["--model", "cycling", "--quote-tokens", "4"], "--quote-tokens applies to --model trained or smollm2 only"),
    (["--model", "cycling", "--cache", "/tmp/x"], "--cache applies to --model trained or smollm2 only"),
    (["--model", "trained", "--prompt-len", "0"], "--prompt-len must be a positive token count, got 0"),
    (["--model", "trained", "--quote-tokens", "0"], "--quote-tokens must be >= 1, got 0"),
    (["--model", "trained", "--needle-at", "1.5"], "--needle-at must be a fraction in [0, 1], got 1.5"),
])
def test_flags_of_another_model_or_out_of_range_are_refused(argv, message):
    """Refused before any model is built or trained: a flag another --model would use, or a value out of range."""
    with pytest.raises(SystemExit) as err:
        speculative.main(argv)
    assert message in str(err.value)
