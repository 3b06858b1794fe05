"""The main job's report pieces, in-process: third-party warnings once and on one line, progress bars
only on a terminal, the verdict line, crossovers, wandb's empty folders, lm-eval task paths."""

from __future__ import annotations

import io
import os
import warnings

import pytest


def _warn_from(filename: str, message: str, category=UserWarning):
    warnings.warn_explicit(message, category, filename, 12)


@pytest.fixture
def restore_showwarning():
    saved = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        yield
    warnings.showwarning = saved


def test_third_party_warnings_once_one_line_rank0(restore_showwarning):
    from megatron_tree.eval.console import quiet_third_party

    third = "/usr/lib/python3/site-packages/megatron/core/optimizer/__init__.py"
    out = io.StringIO()
    quiet_third_party(0, stream=out)
    for _ in range(4):  # four ranks' worth of the same notices, from several modules
        _warn_from(third, "Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        _warn_from(third.replace("optimizer/__init__", "models/backends"), "Apex is not installed. Falling back to Torch Norm")
        _warn_from(third, "full scope is deprecated.\nUse empty cuda_graph_scope.")
    lines = out.getvalue().splitlines()
    assert lines == [
        "megatron-tree-eval: warning (megatron.core, UserWarning): Transformer Engine / Apex not installed: "
        "Megatron-Core uses its torch fallbacks (expected on CPU)",
        "megatron-tree-eval: warning (megatron.core, UserWarning): full scope is deprecated.",
    ]
    other = io.StringIO()
    quiet_third_party(1, stream=other)
    _warn_from(third, "something new")
    assert other.getvalue() == ""


def test_own_warnings_pass_through(restore_showwarning):
    import megatron_tree
    from megatron_tree.eval.console import quiet_third_party

    seen = []
    warnings.showwarning = lambda message, *a, **k: seen.append(str(message))
    quiet_third_party(1, stream=io.StringIO())
    _warn_from(os.path.join(os.path.dirname(megatron_tree.__file__), "ops.py"), "ours")
    assert seen == ["ours"]


def test_progress_only_on_a_terminal():
    from megatron_tree.eval.console import progress_enabled

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert progress_enabled(True, 0, Tty(), Tty()) is True
    assert progress_enabled(True, 0, io.StringIO(), Tty()) is False  # a pipe, a file, CI
    assert progress_enabled(True, 0, Tty(), io.StringIO()) is False  # stdout saved to a log
    assert progress_enabled(True, 1, Tty(), Tty()) is False and progress_enabled(False, 0, Tty(), Tty()) is False


def _results(exact=True, tokens_match=True):
    exactness = {"max_abs_dlogits": 2e-5 if exact else 0.5, "reference_tokens": [[1, 2, 3], [4, 5, 6]],
                 "tokens_match_reference": tokens_match, "within_tolerance": exact and tokens_match}
    return {"runs": [{"exactness": exactness}, {"exactness": dict(exactness)}], "max_abs_dlogits": exactness["max_abs_dlogits"],
            "max_abs_dlogprobs": None, "exact": exact and tokens_match, "tokens_match_reference": tokens_match,
            "tokens_agree_across_ranks": True, "exactness_reference": "Megatron at CP=1",
            "launch": {"cp_size": 4, "level_sizes": {"intra": 2, "inter": 2}}, "wandb": {"run_dir": "x"}}


def test_verdict_line(tmp_path):
    from megatron_tree.eval.report import verdict_line

    line = verdict_line(_results(), tmp_path, 1e-3)
    assert line == (f"verdict: EXACT: CP 4 (intra 2 x inter 2) vs Megatron at CP=1 (CP = 1): max|dlogits| 2.00e-05 "
                    f"(tolerance 0.001), 12 tokens compared in 2 runs, identical; results in {tmp_path}/ "
                    "(results.json, decode_latency.png, wandb)")
    assert verdict_line(_results(exact=False), tmp_path, 1e-3).startswith("verdict: NOT EXACT: ")
    assert "NOT identical" in verdict_line(_results(tokens_match=False), tmp_path, 1e-3)
    split = _results()
    split["tokens_agree_across_ranks"] = False  # exact on rank 0, but the ranks decoded different tokens
    line = verdict_line(split, tmp_path, 1e-3)
    assert line.startswith("verdict: NOT EXACT: ") and "RANKS DECODED DIFFERENT TOKENS" in line, line
    res = _results()
    res["runs"] = [{"exactness": None}]
    assert verdict_line(res, tmp_path, 1e-3).startswith("verdict: NOT CHECKED (eval.exactness.enabled is false)")


def test_crossover():
    from megatron_tree.eval.baselines import crossover

    pts = lambda tree, ring: [{"context_length": c, "method": m, "step_ms": t} for c, a, b in zip((256, 1024, 4096), tree, ring)
                              for m, t in (("tree", a), ("ring", b))]
    assert crossover(pts([3, 2, 2], [1, 3, 9]), "tree", "ring")["from_context"] == 1024
    assert crossover(pts([1, 5, 2], [2, 3, 9]), "tree", "ring")["from_context"] == 4096  # must hold from there on
    x = crossover(pts([3, 3, 3], [1, 1, 1]), "tree", "ring")
    assert x["from_context"] is None and not x["always"]
    assert crossover(pts([1, 1, 1], [2, 2, 2]), "tree", "ring")["always"]


def test_remove_empty_dirs_keeps_files(tmp_path):
    from megatron_tree.eval.tracking import remove_empty_dirs

    (tmp_path / "wandb" / "config").mkdir(parents=True)
    (tmp_path / "wandb" / "run" / "tmp" / "code").mkdir(parents=True)
    (tmp_path / "wandb" / "run" / "run-1.wandb").write_text("x")
    remove_empty_dirs(tmp_path / "wandb")
    left = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert left == [os.path.join("wandb", "run", "run-1.wandb")]
    assert not (tmp_path / "wandb" / "config").exists() and not (tmp_path / "wandb" / "run" / "tmp").exists()


def test_lm_eval_data_files_relative_to_the_task_file(tmp_path):
    from megatron_tree.eval.lm_eval import resolve_data_files

    (tmp_path / "a.jsonl").write_text("{}\n")
    cfg = {"task": "t", "dataset_kwargs": {"data_files": {"test": "a.jsonl", "train": ["a.jsonl", "nowhere.jsonl"]}}}
    out = resolve_data_files(cfg, tmp_path)
    assert out["dataset_kwargs"]["data_files"] == {"test": str(tmp_path / "a.jsonl"),
                                                   "train": [str(tmp_path / "a.jsonl"), "nowhere.jsonl"]}
    assert resolve_data_files({"dataset_kwargs": {"data_files": "/abs.jsonl"}}, tmp_path)["dataset_kwargs"]["data_files"] \
        == "/abs.jsonl"
    assert resolve_data_files({"task": "no kwargs"}, tmp_path) == {"task": "no kwargs"}
    assert cfg["dataset_kwargs"]["data_files"]["test"] == "a.jsonl"  # the input is not changed
