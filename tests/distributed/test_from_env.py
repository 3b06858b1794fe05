"""``TreeGroups.from_env()`` creates the default process group itself under a launcher.

Real launchers, gloo on CPU: ``torchrun --standalone --nproc_per_node 2``, the deepspeed
launcher (``deepspeed --num_gpus 2``, with an empty TORCH_EXTENSIONS_DIR that must stay empty:
the script never imports deepspeed, so no shm op is compiled) and the stand-in ``srun`` of
tests/fake_slurm (3 tasks on one node, MASTER_ADDR found through ``scontrol show hostnames``).
Each runs tests/scripts/from_env_decode.py, which calls ``from_env()`` with no
``init_process_group`` and decodes one step; every rank's output is held to a single-process
fp64 reference here. The refusals run in-process: no launcher, and half-set variables, each a
named error raised before any rendezvous wait (MASTER_PORT points at a socket that never answers,
so a rendezvous attempt would hang past the bound).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time

import pytest
import torch

from tests.helpers.launching import ROOT, free_port, launch_env, run

SCRIPT = os.path.join(ROOT, "tests", "scripts", "from_env_decode.py")
FAKE_SLURM = os.path.join(ROOT, "tests", "fake_slurm")
sys.path.insert(0, os.path.dirname(SCRIPT))

import from_env_decode  # noqa: E402

ANNOUNCE = "megatron_tree: created the default process group from the"


def _check(out_dir, p, world: int, levels, launcher: str):
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-4000:]}"
    from megatron_tree.ops import reference

    q, k, v, lens = from_env_decode.make_inputs()
    want = reference.partial_attention(q.double(), k.double(), v.double(), cache_seqlens=lens)[0]
    outs = [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
    for r, out in enumerate(outs):
        seen = json.loads((out_dir / f"rank{r}.json").read_text())
        assert seen["world_size"] == world and seen["backend"] == "gloo" and seen["levels"] == levels, seen
        assert seen["timeout_s"] == 300.0  # the bounded default, not torch's 30 minutes
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(out, outs[0])  # identical on every rank
    # one line, from rank 0, naming the launcher
    assert p.stderr.count(ANNOUNCE) == 1, p.stderr[-3000:]
    assert f"{ANNOUNCE} {launcher} launcher's variables: gloo, world {world}" in p.stderr


def test_torchrun_standalone(tmp_path):
    p = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
             str(tmp_path)], launch_env(OMP_NUM_THREADS="1"), timeout=180)
    _check(tmp_path, p, 2, [["intra", 2]], "torchrun")


def test_deepspeed_launcher(tmp_path):
    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH (pip install deepspeed)")
    ext = tmp_path / "torch_extensions"
    out = tmp_path / "out"
    out.mkdir()
    p = run(["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT, str(out)],
            launch_env(OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(ext)), timeout=240)
    _check(out, p, 2, [["intra", 2]], "deepspeed")
    assert not (list(ext.rglob("*.so")) if ext.exists() else []), "DeepSpeed compiled an op"


def test_fake_srun_three_tasks_first_host_from_scontrol(tmp_path):
    # No MASTER_ADDR: from_env expands SLURM_JOB_NODELIST with scontrol (the stand-in answers localhost).
    env = launch_env(PATH=FAKE_SLURM + os.pathsep + os.environ["PATH"], SLURM_JOB_NODELIST="fake-node1",
                     SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="3", SLURM_JOB_ID="91",
                     MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    p = run([os.path.join(FAKE_SLURM, "srun"), sys.executable, SCRIPT, str(tmp_path)], env, timeout=180)
    _check(tmp_path, p, 3, [["intra", 3]], "slurm")


# --------------------------------------------------------------------------- refusals, in-process


@pytest.fixture
def dead_port():
    """A listening socket that never accepts: a rendezvous on it would wait, not fail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield str(s.getsockname()[1])


def _refused(env: dict) -> str:
    import torch.distributed as dist

    from megatron_tree import LauncherEnvError, TreeGroups

    assert not dist.is_initialized()
    t0 = time.monotonic()
    with pytest.raises(LauncherEnvError) as e:
        TreeGroups.from_env(env=env)
    assert time.monotonic() - t0 < 5
    assert not dist.is_initialized()
    return str(e.value)


def test_no_launcher_says_what_to_do():
    msg = _refused({"PATH": os.environ["PATH"]})
    assert "no process group and no launcher variables" in msg
    assert "torchrun --nproc_per_node 2 script.py" in msg and "init_process_group" in msg


@pytest.mark.parametrize("env, needle", [
    ({"RANK": "0"}, "WORLD_SIZE is not set but RANK is"),
    ({"WORLD_SIZE": "2"}, "RANK is not set but WORLD_SIZE is"),
    ({"LOCAL_RANK": "0"}, "RANK is not set but LOCAL_RANK is"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK='2' is out of range; expected this process's rank in the world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE=4 does not divide WORLD_SIZE=6"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "3"}, "LOCAL_RANK='3' is out of range"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "PORT"}, "MASTER_ADDR is not set but RANK=0 and WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT is not set but RANK=0"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999"},
     "MASTER_PORT='99999' is out of range; expected a TCP port"),
    # a world of one with MASTER_ADDR rendezvous over TCP too: the same checks as at world 2
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
     "MASTER_PORT is not set but RANK=0 and WORLD_SIZE=1 are; expected the rendezvous port"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"},
     "MASTER_PORT='http' is not an integer; expected a TCP port"),
    ({"SLURM_PROCID": "0"}, "SLURM_PROCID is set but SLURM_NTASKS is not"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "3", "MASTER_PORT": "PORT"},
     "LOCAL_WORLD_SIZE=3 does not divide WORLD_SIZE=4"),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "4", "MASTER_PORT": "PORT"}, "SLURM_PROCID='5' is out of range"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_PORT": "PORT"},
     "SLURM_PROCID is set but MASTER_ADDR and SLURM_JOB_NODELIST are not"),
])
def test_half_set_environment_names_the_variable_before_any_wait(env, needle, dead_port):
    env = {k: (dead_port if v == "PORT" else v) for k, v in env.items()}
    msg = _refused({"PATH": os.environ["PATH"], **env})
    assert needle in msg, msg


def test_slurm_port_from_job_id_and_mapping_shared_with_the_eval():
    from megatron_tree.eval import map_slurm_env
    from megatron_tree.distributed.topology import launcher_rendezvous

    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_ID": "123456", "MASTER_ADDR": "node7"}
    assert launcher_rendezvous(env) == {"rank": 1, "world_size": 2, "master_addr": "node7", "master_port": "23456",
                                        "local_rank": 1, "launcher": "slurm"}
    assert map_slurm_env(env) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert launcher_rendezvous({"PATH": "/bin"}) is None
    # a world of one without MASTER_ADDR: an in-process group, whatever MASTER_PORT says
    alone = launcher_rendezvous({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "29500"})
    assert alone["master_addr"] is None and alone["master_port"] is None


def test_build_without_a_group_says_to_initialise_or_use_from_env():
    from megatron_tree import TreeGroups

    with pytest.raises(RuntimeError, match=r"call torch.distributed.init_process_group\(...\) first .*"
                                           r"TreeGroups.from_env\(\), which creates it"):
        TreeGroups.build()


def test_plain_srun_reads_slurm_tasks_per_node_and_bad_counts_name_the_variable():
    """``srun -N2 -n8`` without --ntasks-per-node sets SLURM_TASKS_PER_NODE="4(x2)" but no
    SLURM_NTASKS_PER_NODE: the nodes are read from it (not taken for one node of 8, which then blamed a
    round-robin numbering that was not there); an unreadable count is a LauncherEnvError naming it."""
    from megatron_tree.distributed import topology as t

    facts = [{"launcher": {"SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_LOCALID": str(r % 4)}} for r in range(8)]
    per_node, source = t._per_node_from_facts(facts, 8)
    assert per_node == 4 and source.startswith("SLURM_TASKS_PER_NODE"), (per_node, source)
    t._check_local_ranks(facts, per_node, source)  # block numbering: accepted
    assert t.launcher_local_size({"SLURM_TASKS_PER_NODE": "3"}) == (3, "SLURM_TASKS_PER_NODE=3")
    with pytest.raises(t.LauncherEnvError, match=r"cannot read processes per node from LOCAL_WORLD_SIZE='abc'; "
                                                 r"expected a positive integer"):
        t.launcher_local_size({"LOCAL_WORLD_SIZE": "abc"})


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_never_joins_the_rendezvous_is_a_named_error_within_the_timeout(rank):
    """A world of 2 in which the other rank never comes (it failed before from_env: a bad argument, an import
    error). Before: torch's raw DistStoreError -- rank 0 "Timed out after 2 seconds waiting for clients. 1/2
    clients joined.", rank 1 (whose store server, rank 0, is not there) a DistNetworkError naming a socket."""
    from megatron_tree import TreeGroups
    from megatron_tree.distributed.topology import LauncherEnvError

    port = free_port()
    env = {"PATH": os.environ["PATH"], "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    t0 = time.monotonic()
    with pytest.raises(LauncherEnvError) as e:
        TreeGroups.from_env(env=env, timeout=2)
    assert time.monotonic() - t0 < 8  # the timeout (2 s), and torch's connect retries for rank 1
    assert not torch.distributed.is_initialized()
    msg = str(e.value)
    assert f"the rendezvous at 127.0.0.1:{port} (torchrun launcher's variables; this is rank {rank} of 2) failed " \
           "within the timeout of 2 s" in msg, msg
    assert "a rank that failed before it" in msg, msg
