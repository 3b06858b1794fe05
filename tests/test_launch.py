"""Every launcher starts a real 4-process CPU eval: launch/local.sh, launch/torchrun.sh,
launch/deepspeed.sh (the real deepspeed launcher, with a hostfile) and both Slurm scripts
run by bash under the stand-in srun/scontrol of tests/fake_slurm (2 nodes x 2 tasks).

Each run's results.json must show the launched topology, max |delta logits| within
tolerance, collectives per level per step as the strategies promise, and an offline wandb
run directory holding the run. Bad launches fail on every rank, quickly.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_SLURM = os.path.join(ROOT, "tests", "fake_slurm")
# Tiny: one context length, batch 1, two strategies, 3 timed steps. Layers: 2 (cpu_tiny).
TINY = ["eval.context_lengths=[40]", "eval.batch_sizes=[1]", "eval.strategies=[two_level,allgather,auto]",
        "eval.decode_steps=3", "eval.warmup_steps=1", "eval.progress=false", "eval.exactness.sample_rate=1.0"]
LAYERS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update({"PYTHON": sys.executable, "CONFIG": "configs/cpu_tiny.yaml", **extra})
    return env


def _launch(cmd, env, timeout=240):
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return p


def _check_results(out_dir, p, *, launcher, levels):
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    res = json.loads((out_dir / "results.json").read_text())
    launch = res["launch"]
    assert launch["launcher"] == launcher
    assert launch["world_size"] == 4 and launch["cp_size"] == 4
    assert launch["level_sizes"] == levels
    # the config's tolerance is 1e-3; fp32 rounding at CP 4 is ~1e-5, so hold the run to 1e-4
    assert res["exact"] is True and res["max_abs_dlogits"] < 1e-4
    assert res["tokens_agree_across_ranks"] is True
    by = {r["strategy"]: r for r in res["runs"]}
    assert set(by) == {"two_level", "allgather", "auto"}
    # auto ran what the cost model chose, with that strategy's collectives
    chosen = by["auto"]["resolved_strategy"]
    assert chosen in ("allreduce3", "packed", "two_level", "allgather")
    if chosen in by:
        assert by["auto"]["comm_per_step"]["levels"] == by[chosen]["comm_per_step"]["levels"]
    # and whatever it chose (it may pick one not in the sweep), its collectives per level per step
    merge = {"all_reduce_max": LAYERS, "all_reduce_sum": LAYERS}
    expected_ops = {"two_level": {lvl: merge for lvl in levels}, "packed": {"cp": merge},
                    "allreduce3": {"cp": {"all_reduce_max": LAYERS, "all_reduce_sum": 2 * LAYERS}},
                    "allgather": {"cp": {"all_gather": LAYERS}}}
    assert {k: v["ops"] for k, v in by["auto"]["comm_per_step"]["levels"].items()} == expected_ops[chosen], chosen
    for r in res["runs"]:
        assert r["exactness"]["checked_steps"] == [0, 1, 2, 3] and r["exactness"]["within_tolerance"]
        assert len(r["peak_memory_bytes"]) == 4 and min(r["peak_memory_bytes"]) > 10 * 2**20
        assert len(r["step_latency_ms"]) == 3
    # Collectives per decode step, per level: one merge per layer.
    two = by["two_level"]["comm_per_step"]["levels"]
    if len(levels) == 2:
        assert {k: v["collectives"] for k, v in two.items()} == {"intra": 2 * LAYERS, "inter": 2 * LAYERS}
    else:
        assert sum(v["collectives"] for v in two.values()) == 2 * LAYERS
    assert by["allgather"]["comm_per_step"]["levels"]["cp"]["ops"] == {"all_gather": LAYERS}
    run_dir = res["wandb"]["run_dir"]
    assert run_dir.startswith(str(out_dir / "wandb"))
    assert any(f.startswith("run-") and f.endswith(".wandb") for f in os.listdir(run_dir)), os.listdir(run_dir)
    assert f"results: {out_dir / 'results.json'}" in p.stdout
    assert os.path.isfile(res["plot"])
    # Other ranks are quiet: one summary line per run, printed once.
    assert p.stdout.count("max|dlogits|") == 3
    return res


def test_local_sh(tmp_path):
    out = tmp_path / "local"
    p = _launch(["bash", "launch/local.sh", f"output_dir={out}", *TINY, "eval.progress=true"], _env(NPROC="4"))
    _check_results(out, p, launcher="torchrun", levels={"intra": 2, "inter": 2})
    # One progress bar over the sweep (rank 0's), finished.
    assert p.stderr.count("sweep: 100%") == 1, p.stderr[-2000:]


def test_torchrun_sh_takes_the_real_layout(tmp_path):
    # intra_size null: the layout of the launch itself, 4 ranks on one node -> one level.
    out = tmp_path / "torchrun"
    p = _launch(["bash", "launch/torchrun.sh", f"output_dir={out}", "topology.intra_size=null", *TINY],
                _env(NPROC_PER_NODE="4", MASTER_PORT=str(_free_port())))
    _check_results(out, p, launcher="torchrun", levels={"intra": 4})


def test_deepspeed_sh_with_a_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    out = tmp_path / "ds"
    p = _launch(["bash", "launch/deepspeed.sh", f"output_dir={out}", *TINY],
                _env(HOSTFILE=str(hostfile), MASTER_PORT=str(_free_port())))
    res = _check_results(out, p, launcher="deepspeed", levels={"intra": 2, "inter": 2})
    assert res["launch"]["backend"] == "gloo"


def _slurm_env(**extra) -> dict:
    # What sbatch would have set for `--nodes=2 --ntasks-per-node=2`.
    return _env(PATH=FAKE_SLURM + os.pathsep + os.environ["PATH"], SLURM_JOB_NODELIST="fake-node[1-2]",
                SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=ROOT,
                MASTER_PORT=str(_free_port()), **extra)


def test_slurm_sbatch_tiers_from_slurm_ntasks_per_node(tmp_path):
    # intra_size null: the tiers come from SLURM_NTASKS_PER_NODE (2 per node x 2 nodes).
    out = tmp_path / "slurm"
    p = _launch(["bash", "launch/slurm/eval.sbatch", f"output_dir={out}", "topology.intra_size=null", *TINY],
                _slurm_env())
    _check_results(out, p, launcher="slurm", levels={"intra": 2, "inter": 2})


def test_slurm_torchrun_sbatch(tmp_path):
    out = tmp_path / "slurm_torchrun"
    p = _launch(["bash", "launch/slurm/torchrun.sbatch", f"output_dir={out}", "topology.intra_size=null", *TINY],
                _slurm_env(GPUS_PER_NODE="2"))
    _check_results(out, p, launcher="slurm+torchrun", levels={"intra": 2, "inter": 2})


def test_bad_launches_fail_on_every_rank(tmp_path):
    # A CP size that does not fit the launched world: refused before any collective; torchrun
    # stops the job at the first rank that exits, so at least one rank reports it.
    t0 = time.monotonic()
    p = _launch(["bash", "launch/local.sh", f"output_dir={tmp_path}", "topology.cp_size=3", "topology.intra_size=null"],
                _env(NPROC="4"), timeout=120)
    assert p.returncode != 0
    assert "error: topology.cp_size: 3 does not divide the launched world of 4" in p.stderr, p.stderr[-3000:]
    # An intra-node level wider than the real nodes (2 tasks per node), found after the process
    # group exists: without --kill-on-bad-exit every rank must still exit on its own, none hangs.
    env = _slurm_env(MASTER_ADDR="127.0.0.1")
    p = _launch([os.path.join(FAKE_SLURM, "srun"), sys.executable, "-m", "megatron_tree.eval", "--config",
                 "configs/cpu_tiny.yaml", f"output_dir={tmp_path}", "topology.intra_size=4"], env, timeout=120)
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
                 str(_free_port()), "tests/scripts/eval_rank1_diverges.py", "--config", "configs/cpu_tiny.yaml",
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
