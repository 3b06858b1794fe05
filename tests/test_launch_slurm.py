"""Launcher runs that need no trained checkpoint: both Slurm scripts under the stand-in
srun/scontrol of tests/fake_slurm (2 nodes x 2 tasks) -- the transformers source and Megatron's
dynamic engine --, bad launches, ranks that decode different tokens, and the stand-ins themselves.

Split from ``test_launch.py`` (whose runs share the ``trained`` checkpoint fixture) so that CI's
two xdist workers (``--dist loadfile``) each take one file of real launcher runs; the helpers and
what each run's results.json must show are ``test_launch``'s.
"""

import json
import os
import subprocess
import sys
import time

import pytest

from test_launch import FAKE_SLURM, TINY, _check_results, _env, _free_port, _launch, _slurm_env


def test_slurm_sbatch_runs_a_transformers_qwen2_with_tiers_from_slurm(tmp_path):
    """model.source hf: transformers' own Qwen2ForCausalLM (QKV biases, randomised) from a
    save_pretrained directory, tree attention as its attention backend, CP 4 = 2 x 2 with the
    tiers from SLURM_NTASKS_PER_NODE (intra_size null), held to single-process transformers.
    (The library's Llama source shares this run's group building, models._cp_groups; its
    own CP exactness is test_llama's.)"""
    from test_hf import hf_model

    ckpt = tmp_path / "qwen2"
    model = hf_model("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the biases are in play
    model.save_pretrained(ckpt)
    out = tmp_path / "slurm"
    p = _launch(["bash", "launch/slurm/eval.sbatch", f"output_dir={out}", "topology.intra_size=null", *TINY,
                 "model.source=hf", f"model.path={ckpt}"], _slurm_env(CONFIG="configs/cpu_tiny_llama.yaml"))
    res = _check_results(out, p, launcher="slurm", levels={"intra": 2, "inter": 2}, source="hf")
    assert res["model"]["class"] == "transformers.Qwen2ForCausalLM" and res["model"]["model_type"] == "qwen2"
    assert res["exactness_reference"].startswith("unmodified transformers Qwen2ForCausalLM in one process")
    assert p.stderr.count("Loading weights: 100%") <= 1  # rank 0's loading bar only, not one per rank


def test_slurm_torchrun_sbatch_runs_megatrons_dynamic_engine(tmp_path):
    """eval.engine dynamic: Megatron-Core's DynamicInferenceEngine over the paged KV cache sharded
    over CP 4 = 2 x 2, its greedy tokens and log-probabilities held to Megatron's own GPTModel
    at CP = 1 (one full forward); the paged cache holds each request's blocks on every rank."""
    out = tmp_path / "slurm_torchrun"
    p = _launch(["bash", "launch/slurm/torchrun.sbatch", f"output_dir={out}", "topology.intra_size=null", *TINY,
                 "eval.engine=dynamic", "eval.prefill_method=null"], _slurm_env(GPUS_PER_NODE="2"))
    res = _check_results(out, p, launcher="slurm+torchrun", levels={"intra": 2, "inter": 2}, engine="dynamic")
    for r in res["runs"]:
        ex = r["exactness"]
        assert ex["quantity"] == "log_probs" and len(ex["step_max_abs_dlogprobs"]) == 4
        # 40 + 5 tokens in blocks of 16 per rank: 3 blocks, one on each of three ranks
        assert sorted(r["kv_blocks_per_rank"]) == [0, 1, 1, 1], r["kv_blocks_per_rank"]


def test_bad_launches_fail_on_every_rank(tmp_path):
    # A CP size that does not fit the launched world: refused before any collective; torchrun
    # stops the job at the first rank that exits, so at least one rank reports it.
    t0 = time.monotonic()
    p = _launch(["bash", "launch/local.sh", f"output_dir={tmp_path}", "topology.cp_size=3", "topology.intra_size=null"],
                _env(NPROC="4"), timeout=120)
    assert p.returncode != 0
    assert "error: topology.cp_size: 3 does not divide the launched world of 4" in p.stderr, p.stderr[-3000:]
    # The Llama source: an intra-node level wider than the real nodes (2 tasks per node), found
    # after the process group exists: without --kill-on-bad-exit every rank must still exit on
    # its own, none hangs.
    env = _slurm_env(MASTER_ADDR="127.0.0.1")
    p = _launch([os.path.join(FAKE_SLURM, "srun"), sys.executable, "-m", "megatron_tree.eval", "--config",
                 "configs/cpu_tiny_llama.yaml", f"output_dir={tmp_path}", "topology.intra_size=4"], env, timeout=120)
    assert p.returncode == 2
    for r in range(4):
        assert f"rank {r}: error: intra_size 4 disagrees with the real layout" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "results.json").exists()
    assert time.monotonic() - t0 < 90


def test_ranks_that_decode_different_tokens_fail_the_run(tmp_path):
    # Rank 1's output head is negated (tests/scripts/eval_rank1_diverges.py): the tokens
    # agreement across ranks must be recorded as false and the job must exit non-zero.
    out = tmp_path / "diverge"
    p = _launch([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(_free_port()), "tests/scripts/eval_rank1_diverges.py", "--config", "configs/cpu_tiny_llama.yaml",
                 f"output_dir={out}", "eval.context_lengths=[16]", "eval.batch_sizes=[1]",
                 "eval.strategies=[packed]", "eval.decode_steps=2", "eval.warmup_steps=0", "eval.progress=false",
                 "topology.intra_size=null", "wandb.enabled=false"], _env(OMP_NUM_THREADS="1"), timeout=120)
    assert p.returncode != 0, p.stdout[-2000:]
    res = json.loads((out / "results.json").read_text())
    assert res["launch"]["world_size"] == 2
    assert res["tokens_agree_across_ranks"] is False
    assert [r["tokens_agree_across_ranks"] for r in res["runs"]] == [False]
    assert "ranks decoded different tokens" in p.stderr


@pytest.mark.parametrize("nodelist, expected", [
    ("fake-node[1-2]", 2), ("n[01-03,7]", 4), ("a,b", 2), ("gpu[5]", 1),
])
def test_fake_scontrol_expands_node_lists(nodelist, expected):
    p = subprocess.run([os.path.join(FAKE_SLURM, "scontrol"), "show", "hostnames", nodelist],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and p.stdout.split() == ["localhost"] * expected


def test_fake_srun_sets_slurm_variables_and_propagates_failure():
    code = ("import os; e = os.environ; os.write(1, ' '.join([e['SLURM_PROCID'], e['SLURM_LOCALID'], "
            "e['SLURM_NODEID'], e['SLURM_NTASKS'], e['SLURM_NTASKS_PER_NODE']]).encode() + b'\\n')")
    p = subprocess.run([os.path.join(FAKE_SLURM, "srun"), sys.executable, "-c", code], env=_slurm_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    assert sorted(p.stdout.strip().splitlines()) == ["0 0 0 4 2", "1 1 0 4 2", "2 0 1 4 2", "3 1 1 4 2"]
    p = subprocess.run([os.path.join(FAKE_SLURM, "srun"), "--kill-on-bad-exit=1", sys.executable, "-c",
                        "import os, sys, time; sys.exit(5) if os.environ['SLURM_PROCID'] == '2' else time.sleep(60)"],
                       env=_slurm_env(), capture_output=True, text=True, timeout=30)
    assert p.returncode == 5
