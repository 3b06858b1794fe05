"""``benchmarks.gpu_e2e`` -- the end-to-end run of the one GPU call -- runs on CPU (``--device cpu --tiny``) with
all four runs, equal tokens, per-step counts and its bounds, so a device call is not spent finding a broken
script; and its counting and checking are right on hand-made inputs."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_e2e

from tests.helpers.ranks import run_ranks

RUNS = ("hf_eager", "hf_static_compiled", "tree_eager", "tree_compiled")


def _smoke(rank, world, out):
    # a real one-rank gloo group, which the script takes as its own (it makes NCCL's on a GPU)
    return gpu_e2e.main(["--device", "cpu", "--tiny", "--contexts", "24", "--layers", "2", "--new-tokens", "5",
                         "--warmup", "2", "--out", str(out)])


def test_the_script_runs_every_run_on_cpu_with_equal_tokens_and_counts_each_step(tmp_path):
    [result] = run_ranks(_smoke, 1, tmp_path, timeout=300)
    runs = result["contexts"]["24"]["runs"]
    assert tuple(runs) == RUNS
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        assert run["tokens_equal"] and len(run["tokens"]) == 5, name
        assert run["ms_per_token"] > 0 and run["vs_best_transformers"] > 0, name
        counts = run["per_step"]
        assert set(counts) == set(gpu_e2e.COUNTED), (name, counts)
        # transformers' loop reads one value per step (whether every row has stopped); a tree run adds none
        assert counts["host_reads"] == runs["hf_eager"]["per_step"]["host_reads"] >= 1, (name, counts)
        assert counts["cuda_syncs"] == counts["kernel_launches"] == counts["graph_launches"] == 0, (name, counts)
    assert [(c["check"], c["ok"]) for c in result["checks"]][-1] == ("every run's tokens equal hf_eager's", True)
    # the ratios: to the better transformers run (which is 1.0) and to the byte floor of this model and context --
    # its weights and a KV cache of 2 layers x 24 tokens x 2 KV heads x 16 x (K and V), fp32, at 4.8 TB/s
    d, h, f, vocab = 64, 4 * 16, 128, 256
    weights = 2 * vocab * d + 2 * (2 * d * h + 2 * d * 2 * 16 + 3 * d * f + 2 * d) + d
    floor = result["contexts"]["24"]["floor_ms"]
    assert floor == pytest.approx(1e3 * 4 * (weights + 2 * 2 * 24 * 2 * 16) / 4.8e12)
    best = min(runs["hf_eager"]["ms_per_token"], runs["hf_static_compiled"]["ms_per_token"])
    assert min(runs[n]["vs_best_transformers"] for n in ("hf_eager", "hf_static_compiled")) == pytest.approx(1.0)
    for name, run in runs.items():
        assert run["vs_best_transformers"] == pytest.approx(run["ms_per_token"] / best), name
        assert run["vs_floor"] == pytest.approx(run["ms_per_token"] / floor), name
    assert json.loads((tmp_path / "gpu_e2e.json").read_text()) == json.loads(json.dumps(result))
    md = (tmp_path / "gpu_e2e.md").read_text()
    assert "| 24 | tree_compiled |" in md and "Issue 31's bounds:" in md and "Plot: `gpu_e2e.png`" in md
    # the per-step table and every bound's row
    c = runs["tree_compiled"]["per_step"]
    assert f"| 24 | tree_compiled | {c['host_reads']:.1f} | 0.0 | 0.0 | 0.0 |" in md
    assert f"| 24 | tree_compiled vs_best_transformers <= 1.1 | {runs['tree_compiled']['vs_best_transformers']:.2f}x |" in md
    assert "| 24 | every run's tokens equal hf_eager's | 4 of 4 | True |" in md
    assert (tmp_path / "gpu_e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # --replot rewrites the markdown and the plot from the JSON alone, the same
    replotted = tmp_path / "replot"
    gpu_e2e.main(["--replot", str(tmp_path / "gpu_e2e.json"), "--out", str(replotted)])
    assert (replotted / "gpu_e2e.md").read_text() == md
    assert (replotted / "gpu_e2e.png").is_file()


def test_counts_are_the_events_between_the_first_and_the_last_step_per_step():
    mark = gpu_e2e.STEP_MARK
    events = [("cudaLaunchKernel", 5), (mark, 10), ("cudaLaunchKernel", 11), ("cuLaunchKernel", 12),
              ("aten::_local_scalar_dense", 15), ("cudaStreamSynchronize", 16), (mark, 20), ("cudaLaunchKernel", 21),
              ("cudaGraphLaunch", 22), ("aten::mm", 23), (mark, 30), ("cudaLaunchKernel", 31), ("cudaMemcpy", 40)]
    assert gpu_e2e.per_step_counts(events) == {"host_reads": 0.5, "cuda_syncs": 0.5, "kernel_launches": 1.5,
                                               "graph_launches": 0.5}
    # the marks in any order (a profile's events need not be sorted); a copy from the device is a sync
    events = [(mark, 30), ("cudaMemcpy", 25), (mark, 10), ("cudaLaunchKernel", 5), (mark, 20), ("cudaLaunchKernel", 35)]
    assert gpu_e2e.per_step_counts(events) == {"host_reads": 0, "cuda_syncs": 0.5, "kernel_launches": 0,
                                               "graph_launches": 0}
    with pytest.raises(ValueError, match="at least 2 step marks"):
        gpu_e2e.per_step_counts([("cudaLaunchKernel", 1), (mark, 2)])


def test_the_bounds_are_issue_31s_and_a_missing_run_is_not_called_met():
    def context(tree_ms, best_ms, floor_ms, equal=True):
        runs = {"hf_eager": {"ms_per_token": best_ms, "tokens_equal": True}}
        if tree_ms is not None:
            runs["tree_compiled"] = {"ms_per_token": tree_ms, "vs_best_transformers": tree_ms / best_ms,
                                     "vs_floor": tree_ms / floor_ms, "tokens_equal": equal}
        return {"floor_ms": floor_ms, "runs": runs}

    result = {"contexts": {"32768": context(2.2, 2.0, 0.7), "131072": context(1.4, 1.5, 1.05, equal=False)}}
    rows = {(c["context"], c["check"]): (c["value"], c["ok"]) for c in gpu_e2e.checks(result)}
    assert rows[(32768, "tree_compiled vs_best_transformers <= 1.1")] == (pytest.approx(1.1), True)
    assert (32768, "tree_compiled vs_floor <= 1.3") not in rows  # the floor bound is 128K's only
    assert rows[(131072, "tree_compiled vs_floor <= 1.3")] == (pytest.approx(1.4 / 1.05), False)
    assert rows[(131072, "tree_compiled vs_best_transformers <= 1.1")][1] is True
    assert rows[(32768, "every run's tokens equal hf_eager's")] == ("2 of 2", True)
    assert rows[(131072, "every run's tokens equal hf_eager's")] == ("1 of 2", False)
    missing = {(c["check"], c["ok"]) for c in gpu_e2e.checks({"contexts": {"131072": context(None, 1.5, 1.05)}})}
    # a run that failed has no tokens to compare: the token check is not called failed, nor met
    failed = context(1.4, 1.5, 1.05)
    failed["runs"]["tree_eager"] = {"error": "RuntimeError: x"}
    [tokens] = [c for c in gpu_e2e.checks({"contexts": {"32768": failed}}) if c["check"].startswith("every run")]
    assert (tokens["value"], tokens["ok"]) == ("2 of 3", None)
    assert ("tree_compiled vs_best_transformers <= 1.1", None) in missing
    assert ("tree_compiled vs_floor <= 1.3", None) in missing
