"""The eval entry point in one process: results.json schema, exactness against the reference
(unmodified transformers in one process; Megatron's own GPTModel at CP = 1), wandb offline run inside the output
dir, passkey/perplexity with a real (tiny) checkpoint and tokenizer for both sources, and
every bad-config path failing fast with a clear message.

Multi-process runs through the real launchers are in test_launch.py.
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_tree import eval as E
from megatron_tree.eval.config import ConfigError, load_config
from megatron_tree.eval import models as M
from megatron_tree.eval import run as R

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, "configs/cpu_tiny_llama.yaml")
TINY = ["eval.context_lengths=[24, 40]", "eval.batch_sizes=[2]", "eval.strategies=[packed, allgather]",
        "eval.decode_steps=3", "eval.warmup_steps=1", "eval.progress=false", "topology.intra_size=null"]


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers' warnings (a load report) off while the eval runs here: its log handler keeps the
    stream it first wrote to, which under pytest's capture can be a stream closed since, and the
    resulting "Logging error" traceback would read as the eval's own."""
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher variables: the eval runs as a single process."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_single_process_run_writes_results_plot_and_wandb(tmp_path, clean_env, capsys):
    out = tmp_path / "run"
    assert E.main(["--config", LLAMA, f"output_dir={out}", *TINY, "eval.exactness.sample_rate=1.0"]) == 0
    printed = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["schema_version"] == 3 and res["engine"] == "static"
    assert res["model"]["source"] == "random" and res["model"]["class"] == "transformers.LlamaForCausalLM"
    assert res["exactness_reference"].startswith("unmodified transformers LlamaForCausalLM in one process")
    assert res["launch"]["world_size"] == 1 and res["launch"]["cp_size"] == 1
    assert res["launch"]["level_sizes"] == {"intra": 1}
    assert [(r["context_length"], r["strategy"]) for r in res["runs"]] == [
        (24, "packed"), (24, "allgather"), (40, "packed"), (40, "allgather")]
    for r in res["runs"]:
        assert len(r["step_latency_ms"]) == 3
        lat = r["decode_latency_ms"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"]
        steps = r["step_latency_ms"]  # the summary is computed from the recorded steps
        assert [lat[f"p{q}"] for q in (50, 90, 99)] == [E.percentile(steps, q) for q in (50, 90, 99)]
        assert (lat["min"], lat["max"]) == (min(steps), max(steps))
        assert r["tokens_per_s"] == pytest.approx(2 * 3 / (sum(steps) / 1e3)) and r["prefill_s"] > 0
        assert r["comm_per_step"]["collectives"] == 0  # CP = 1: nothing to merge
        assert r["peak_memory_kind"] == "cpu_peak_rss" and r["peak_memory_bytes"][0] > 10 * 2**20
        ex = r["exactness"]
        assert ex["checked_steps"] == [0, 1, 2, 3]  # sample_rate 1: warmup + timed steps
        # fp32 rounding gives ~7e-6 here; 1e-4 (not the config's 1e-3) leaves room for it and no more
        assert ex["within_tolerance"] and ex["max_abs_dlogits"] < 1e-4
        assert r["tokens_agree_across_ranks"]
        # the generated ids (prefill's token + 4 steps per row), and the reference chose the same
        assert [len(row) for row in r["tokens"]] == [5, 5] and ex["reference_tokens"] == r["tokens"]
    assert res["exact"] is True and res["max_abs_dlogits"] < 1e-4 and res["tokens_match_reference"] is True
    run_dir = res["wandb"]["run_dir"]
    assert res["wandb"] == {"enabled": True, "mode": "offline", "run_dir": run_dir, "disabled_by": None}
    assert run_dir.startswith(str(out / "wandb")) and any(f.startswith("run-") and f.endswith(".wandb")
                                                          for f in os.listdir(run_dir))
    # what was logged: per-step metrics and the summary (in the run's record), a table per
    # context length and the plot as an image (media files)
    record = open(os.path.join(run_dir, [f for f in os.listdir(run_dir) if f.endswith(".wandb")][0]), "rb").read()
    assert b"decode_latency_ms/packed" in record and b"decode_latency_ms/allgather" in record
    assert b"max_abs_dlogits" in record
    tables = sorted(os.listdir(os.path.join(run_dir, "files", "media", "table", "runs")))
    assert [t.split("_")[1] for t in tables] == ["24", "40"], tables
    assert os.listdir(os.path.join(run_dir, "files", "media", "images"))
    assert os.path.getsize(res["plot"]) > 1000 and res["plot"].endswith(".png")
    assert f"results: {out / 'results.json'}" in printed and "plot:" in printed and run_dir in printed
    assert printed.count("max|dlogits|") == 2  # the table's header and the verdict line
    assert sum(line.rstrip().endswith(" same") for line in printed.splitlines()) == 4  # one table row per run
    assert printed.splitlines()[-1].startswith("verdict: EXACT: CP 1 (intra 1) vs unmodified transformers")


def test_compiled_decode_steps_run_exact_and_are_recorded(tmp_path, clean_env):
    """model.compile_step: the sweep's decode steps run compiled (here Dynamo with the eager kernels, aot_eager),
    exact against the unmodified model, the setting in results.json. The same at CP 3 through torchrun:
    ``torchrun --nproc_per_node 3 -m megatron_tree.eval ... model.compile_step=aot_eager`` (EXACT, 9.3e-06)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = tmp_path / "compiled"
    assert E.main(["--config", LLAMA, f"output_dir={out}", *TINY, "eval.exactness.sample_rate=1.0",
                   "eval.batch_sizes=[2, 1]", "model.compile_step=aot_eager", "wandb.enabled=false",
                   "eval.attention_baselines=false"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["model"]["compile_step"] == "aot_eager"
    # each (batch, cache length bucket) compiled: 24 and 40 tokens (+ steps) share one bucket
    assert res["model"]["compiled_steps"] == [[1, 64], [2, 64]] and res["model"]["compile_failed"] is None
    # the caches of consecutive runs of one shape share storage: the warmup's second strategy, then the second
    # strategy of each (context, batch); a new batch size allocates (the 24 and 40 tokens share one bucket)
    assert res["model"]["cache_storage_reused"] == 1 + 2 * 2
    assert res["exact"] is True and res["max_abs_dlogits"] < 1e-4 and res["tokens_match_reference"] is True
    assert len(res["runs"]) == 8 and all(r["exactness"]["checked_steps"] == [0, 1, 2, 3] for r in res["runs"])
    # traced once per batch (2, 1) x strategy (its merge is a constant of the graph), in the warmup step: 24 and
    # 40 tokens share a length bucket, the warmup records into a scratch CommStats (a step with stats, as the timed
    # ones), and a run's new CommStats is no new trace (16 before: every run traced again, twice)
    assert counters["stats"]["unique_graphs"] == 4, dict(counters["stats"])


def test_the_default_compile_step_is_auto_and_eager_without_warmup(tmp_path, clean_env):
    """model.compile_step defaults to auto (captured on GPUs over NCCL, eager here: nothing is traced), recorded
    as such; with eval.warmup_steps 0 the model is built eager (a capture would be timed)."""
    from torch._dynamo.utils import counters

    built = []
    real_build = M.build

    def build(m, *args, **kwargs):
        built.append(m.compile_step)
        return real_build(m, *args, **kwargs)

    clean_env.setattr(M, "build", build)
    torch._dynamo.reset()
    counters.clear()
    for warmup, out in ((1, tmp_path / "auto"), (0, tmp_path / "cold")):
        assert E.main(["--config", LLAMA, f"output_dir={out}", *TINY, f"eval.warmup_steps={warmup}",
                       "eval.batch_sizes=[2]", "eval.context_lengths=[24]", "wandb.enabled=false",
                       "eval.attention_baselines=false"]) == 0
        res = json.loads((out / "results.json").read_text())
        assert res["exact"] is True and res["model"]["compile_step"] == ("auto" if warmup else False)
        assert res["model"]["compiled_steps"] == [] and res["model"]["compile_failed"] is None  # eager here
    assert built == ["auto", False]
    assert counters["stats"]["unique_graphs"] == 0  # eager on CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of a machine without CUDA")
def test_reduce_overhead_without_cuda_is_a_config_error_before_the_model(tmp_path, clean_env, capsys):
    """model.compile_step=reduce-overhead on a CPU run: one line naming the setting, the device and what to use,
    before the model is built (before: a ValueError traceback on every rank from inside the first decode step,
    naming ``compile_step=True``, an argument of enable_tree_attention, not the eval's setting)."""
    def build(*args, **kwargs):
        raise AssertionError("the model was built before the refusal")

    clean_env.setattr(M, "build", build)
    assert E.main(["--config", LLAMA, f"output_dir={tmp_path / 'ro'}", *TINY, "model.compile_step=reduce-overhead",
                   "wandb.enabled=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("megatron-tree-eval: rank 0: error: model.compile_step: 'reduce-overhead' captures"), err
    assert "this run is on cpu over gloo: use model.compile_step=true" in err[0], err
    assert not (tmp_path / "ro").exists()


def test_exactness_catches_a_wrong_model(tmp_path, clean_env, capsys):
    """The check can fail: a replica with different weights must exceed the tolerance."""
    real = M.build

    def perturbed(*args, **kwargs):
        em = real(*args, **kwargs)
        ref = em.reference.model.model  # shares the model's tensors: replace, do not modify
        ref.norm.weight = torch.nn.Parameter(ref.norm.weight.detach() * 1.5)
        return em

    clean_env.setattr(M, "build", perturbed)
    rc = E.main(["--config", LLAMA, f"output_dir={tmp_path}", *TINY, "eval.context_lengths=[24]",
                 "eval.strategies=[packed]", "eval.exactness.sample_rate=0.0"])
    assert rc == 3
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["exact"] is False and res["max_abs_dlogits"] > 1e-2
    # sample_rate 0 still compares the last decode step (warmup 1 + 3 timed: step 3), and that
    # comparison itself (not only the prefill's) sees the wrong replica
    ex = res["runs"][0]["exactness"]
    assert ex["checked_steps"] == [3] and ex["step_max_abs_dlogits"][0] > 1e-2
    assert ex["prefill_max_abs_dlogits"] > 1e-2 and not ex["within_tolerance"]
    assert "FAILED" in capsys.readouterr().err


@pytest.mark.parametrize("args, env, fragment", [
    (["eval.bogus=1"], {}, "unknown key 'eval.bogus'"),
    (["eval.decode_steps=many"], {}, "eval.decode_steps: expected an integer, got 'many'"),
    (["topology.intra_size=3"], {"WORLD_SIZE": "4", "RANK": "0"}, "topology.intra_size: 3 does not factor the CP size 4"),
    (["topology.cp_size=8"], {"WORLD_SIZE": "4", "RANK": "0"}, "topology.cp_size: 8 does not fit the launched world of 4"),
    (["topology.cp_size=3", "topology.intra_size=null"], {"WORLD_SIZE": "4", "RANK": "0"},
     "topology.cp_size: 3 does not divide the launched world of 4"),
    (["model.source=hf", "model.path=/nonexistent/ckpt"], {}, "model.path: checkpoint directory '/nonexistent/ckpt' does not exist"),
    (["model.source=llama", "model.path=/x"], {},
     "model.source: 'llama' (the library's own Llama) was retired; use model.source=hf with the same model.path"),
    (["model.source=bogus"], {}, "model.source: expected one of 'megatron', 'random', 'hf', got 'bogus'"),
    (["model.source=hf", "model.path=/x", "eval.engine=dynamic"], {},
     "eval.engine: 'dynamic' is Megatron-Core's DynamicInferenceEngine and needs model.source megatron, got 'hf'"),
    (["model.source=random", "eval.engine=dynamic"], {}, "needs model.source megatron, got 'random'"),
    (["eval.engine=dynamic", "eval.prefill_method=allgather"], {}, "eval.prefill_method: 'allgather' does not apply to eval.engine dynamic"),
    (["eval.engine=dynamic", "eval.cache_layout=contiguous"], {}, "eval.cache_layout: 'contiguous' does not apply to eval.engine dynamic"),
    (["eval.engine=dynamic", "topology.tp_size=2"], {"WORLD_SIZE": "4", "RANK": "0"}, "eval.engine: 'dynamic' runs at topology.tp_size 1"),
    (["eval.engine=paged"], {}, "eval.engine: expected one of 'static', 'dynamic', got 'paged'"),
    (["model.path=/nonexistent/ckpt"], {}, "model.path: checkpoint directory '/nonexistent/ckpt' does not exist"),
    (["model.path=/"], {}, "model.path: '/' is not a Megatron distributed checkpoint"),
    (["topology.tp_size=2", "topology.cp_size=4"], {"WORLD_SIZE": "4", "RANK": "0"},
     "topology.tp_size x topology.cp_size: 2 x 4 = 8 does not fit the launched world of 4"),
    (["topology.tp_size=3"], {"WORLD_SIZE": "6", "RANK": "0"}, "model.num_attention_heads: 4 is not divisible by topology.tp_size 3"),
    (["model.source=random", "topology.tp_size=2"], {"WORLD_SIZE": "4", "RANK": "0"}, "topology.tp_size: 2 needs model.source megatron"),
    (["topology.tp_size=2", "topology.intra_size=2"], {"WORLD_SIZE": "8", "RANK": "0", "LOCAL_WORLD_SIZE": "2"},
     "topology.intra_size: 2 disagrees with the real layout: with tp_size 2 an intra-node CP group spans 4"),
    (["eval.prefill_method=allgather"], {}, "eval.prefill_method: 'allgather' is not available for model.source megatron"),
    (["eval.passkey.enabled=true"], {}, "eval.passkey.enabled needs a tokenizer"),
    (["eval.context_lengths=[70000]"], {}, "eval.allow_beyond_max_position=true"),
    # dynamic-NTK RoPE past the window: the CP model decodes as transformers does step by step (frequencies from
    # the length so far), the reference is one forward over prompt + generated tokens (frequencies from the whole
    # length), which differ by design: every such run was reported NOT EXACT (max|dlogits| ~0.9); now refused
    # before launch, naming max_context
    (["model.source=random", "model.max_position_embeddings=128", "model.rope_scaling={rope_type: dynamic, factor: 2.0}",
      "eval.context_lengths=[64, 200]", "eval.allow_beyond_max_position=true", "eval.decode_steps=2"], {},
     "eval.exactness: a checked run of context 200 needs 205 positions, past max_position_embeddings 128"),
    (["wandb.ds_config=/nonexistent/ds.json"], {}, "wandb.ds_config"),
])
def test_bad_config_fails_before_any_process_group(clean_env, capsys, args, env, fragment):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert E.main(args if env else ["topology.intra_size=null", *args]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and fragment in err, err
    assert not torch.distributed.is_initialized()


def test_output_dir_that_is_a_file_fails_before_any_process_group(tmp_path, clean_env, capsys):
    (tmp_path / "taken").write_text("a file")
    for out in (tmp_path / "taken", tmp_path / "taken" / "sub"):
        assert E.main([f"output_dir={out}", "topology.intra_size=null"]) == 2
        err = capsys.readouterr().err
        assert f"output_dir: '{out}' cannot be created: '{tmp_path / 'taken'}' is a file" in err, err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("wandb", ["true", "false"])
def test_output_dir_rank_0_cannot_write_fails_before_the_model(wandb, clean_env, capsys):
    """A directory that cannot be created (/proc/<missing>/out) or written (/proc: even root cannot create a
    file there) is exit 2 with one line naming output_dir, before the model is built. Before, with wandb on
    it was reported as "wandb could not start ... (set wandb.mode=offline ...)" although it was offline; with
    wandb off the whole sweep ran and then a FileNotFoundError traceback came from saving the plot."""
    tiny = ["topology.intra_size=null", "eval.context_lengths=[16]", "eval.batch_sizes=[1]", "eval.strategies=[packed]",
            "eval.decode_steps=1", "eval.warmup_steps=0", "eval.attention_baselines=false", "eval.progress=false",
            "eval.exactness.enabled=false", f"wandb.enabled={wandb}"]
    for out in ("/proc", "/proc/megatron_tree_no_such_dir/out"):
        assert E.main([f"output_dir={out}", *tiny]) == 2
        err = capsys.readouterr().err
        assert f"rank 0: error: output_dir: '{out}' is not a directory global rank 0 can create and write" in err, err
        assert "wandb" not in err and "Traceback" not in err, err
    assert not torch.distributed.is_initialized()


def _eval_barriers_after_a_peer_died(rank, world):
    import megatron_tree as mt
    from megatron_tree.utils.testing import outcome

    groups = mt.TreeGroups.build(timeout=10.0, transport="backend")
    # both ranks are past building the groups (a rank that left during it is a failure at group creation,
    # another test's subject): only then is rank 1 killed
    torch.distributed.barrier()
    if rank == 1:
        os._exit(0)  # killed mid-run: no goodbye
    cpu = torch.device("cpu")
    return [outcome(lambda: R.StepTimer(groups, cpu, timed_from=0, stats=None).before_step(0)),
            outcome(lambda: R.DynamicStepTimer(groups, cpu, [], timed_from=0, stats=None).before_step(0))]


def test_a_rank_killed_mid_run_is_named_at_the_evals_step_barrier():
    """Every timed step of the eval (static and dynamic engines) starts at a CP barrier, so that is where a
    rank killed mid-run is found most often: the survivor's error names the dead rank (a CommError, as in
    the merges), where it was gloo's bare "Connection reset by peer" or, for a stopped peer, "Timed out
    waiting 20000ms for recv"."""
    from megatron_tree.utils.testing import run_ranks

    results = run_ranks(_eval_barriers_after_a_peer_died, 2, timeout=120, pg_timeout=20, expect_dead=(1,))
    for kind, message, seconds in results[0]:
        assert kind == "CommError", (kind, message)
        assert "barrier" in message and "rank 1 (host " in message and "has exited" in message, message
        assert seconds < 8, seconds  # at once, not after the group's timeout of 10 s


def test_a_rank_that_never_joins_the_rendezvous_is_one_line(clean_env, capsys):
    """Rank 0 of a world of 2 whose rank 1 never starts (it failed, or was launched with another port): one
    line naming the rendezvous and what to check, exit 2, within topology.timeout_s; before, torch's
    DistStoreError ("1/2 clients joined") came at the end of a 30-line traceback."""
    from tests.helpers.launching import free_port

    for var, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        clean_env.setenv(var, value)
    assert E.main(["model.source=random", "topology.intra_size=null", "topology.timeout_s=2", "wandb.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "rank 0: error: rendezvous at 127.0.0.1:" in err and "failed within topology.timeout_s 2 s" in err, err
    assert "1/2 clients joined" in err and "Traceback" not in err, err
    assert not torch.distributed.is_initialized()


def test_bad_config_exit_status_from_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.json").write_text('{"exact": true}')  # an earlier run's: must not survive a failed run
    p = subprocess.run([sys.executable, "-m", "megatron_tree.eval", "--config", "configs/cpu_tiny.yaml",
                        "model.source=hf", f"model.path={tmp_path}", "topology.intra_size=null", f"output_dir={out}"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "has no config.json" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (out / "results.json").exists()


def test_helpers():
    assert E.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert E.percentile([1.0, 2.0], 90) == pytest.approx(1.9)
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    assert E.map_slurm_env(env) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert E.map_slurm_env({**env, "RANK": "0"}) == {}  # torchrun inside srun: leave it alone
    assert E.check_launch(load_config(None, ["topology.intra_size=2"]), 8) == 8
    assert E.check_launch(load_config(None, ["topology.tp_size=2", "topology.intra_size=null"]), 8, {}) == 4
    # Megatron's CP groups at TP 2 are strided by 2, so an intra-node level of 2 spans 4 ranks
    topo = load_config(None, ["topology.tp_size=2", "topology.intra_size=null"]).topology
    assert M.megatron_layout(topo, 16, 8, 8) == [4, 2] and M.megatron_layout(topo, 8, 4, 8) is None
    assert E.parse_args(["--local_rank=2", "eval.decode_steps=2"]).overrides == ["eval.decode_steps=2"]


def test_megatron_layout_from_the_launcher_picks_an_intra_level_that_fits_the_nodes():
    """topology.intra_size null takes the launcher's nodes: the intra level is the largest divisor of the CP
    size whose tp x intra consecutive ranks tile a node. 2 nodes x 3 ranks at CP 2 gives CP groups [0, 1],
    [2, 3] (across the node boundary), [4, 5]: no intra level of 2 fits every group, so the groups are flat;
    before, the derived 2 was refused as "topology.intra_size: 2 disagrees with the real layout", a value
    the user never set, and the launch could not run at all."""
    six = {"SLURM_NTASKS_PER_NODE": "3"}
    flat = load_config(None, ["topology.cp_size=2", "topology.intra_size=null"])
    assert E.check_launch(flat, 6, six) == 2
    assert M.megatron_layout(flat.topology, 6, 2, 3) is None
    # CP 6 on 2 x 3: intra 3 x inter 2 (the largest divisor of 6 that tiles a node of 3), not 2 x 3
    assert M.megatron_layout(flat.topology, 6, 6, 3) == [3, 2]
    # 4 per node, CP 8 at TP 2: intra 2 (2 x 2 = 4 consecutive ranks per node) x inter 4
    tp2 = load_config(None, ["topology.tp_size=2", "topology.intra_size=null"]).topology
    assert M.megatron_layout(tp2, 16, 8, 4) == [2, 4]
    assert M.megatron_layout(tp2, 6, 3, 3) is None  # TP 2 does not tile a node of 3: flat, no endless search
    # an intra_size the user set is still held to the nodes, and the message names it
    with pytest.raises(ConfigError, match="topology.intra_size: 2 disagrees with the real layout"):
        E.check_launch(load_config(None, ["topology.cp_size=2", "topology.intra_size=2"]), 6, six)


def test_a_flat_megatron_cp_group_one_rank_per_node_is_named_inter():
    """Megatron's CP groups carry no node layout: a flat one (hierarchical sizes null, the layout the launcher's
    nodes leave for TP 2 x CP 3 on 3 nodes x 2: CP group [0, 2, 4], one rank per node) was one node's group,
    level "intra" and intra_size 3 (results.json: num_nodes 1, the verdict "CP 3 (intra 3)"), and merge auto's
    cost model was handed intra_size 3. It is "inter" with intra_size 1 now, as TreeGroups.build names such a group; a
    group inside one node stays "intra", a hierarchical one as Megatron built it."""
    from megatron_tree.distributed.topology import Level, TreeGroups
    from megatron_tree.integrations.megatron.groups import megatron_cp_levels

    def flat(ranks):
        return TreeGroups(None, tuple(ranks), (Level("intra", None, tuple(ranks)),), len(ranks))

    spread = megatron_cp_levels(flat([0, 2, 4]), 2)
    assert [(lv.name, lv.ranks) for lv in spread.levels] == [("inter", (0, 2, 4))] and spread.intra_size == 1
    assert spread.describe()["num_nodes"] == 3 and spread.cp_ranks == (0, 2, 4)
    # 2 nodes x 3 at CP 2 (flat since 0a607f1): [2, 3] crosses the node boundary, [0, 1] does not
    assert megatron_cp_levels(flat([2, 3]), 3).levels[0].name == "inter"
    for kept in (megatron_cp_levels(flat([0, 1]), 3), megatron_cp_levels(flat([0, 1]), None)):
        assert kept.levels[0].name == "intra" and kept.intra_size == 2
    two = TreeGroups(None, (0, 1, 2, 3), (Level("intra", None, (0, 1)), Level("inter", None, (0, 2))), 2)
    assert megatron_cp_levels(two, 1) is two


# ----------------------------------------------------------------------------- real checkpoint


HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
             "tie_word_embeddings": False, "bos_token_id": 1, "initializer_range": 0.2}


def _tiny_checkpoint(path):
    """A random transformers Llama saved with ``save_pretrained``, with a byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
              "What is the pass key? The pass key is 12345. Remember it."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    torch.manual_seed(0)
    shape = {k: v for k, v in HF_CONFIG.items() if k not in ("architectures", "model_type")}
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    model.save_pretrained(str(path))
    assert json.loads((path / "config.json").read_text())["architectures"] == HF_CONFIG["architectures"]
    return model, tok


def test_passkey_and_perplexity_with_a_checkpoint(tmp_path, clean_env):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    model, tok = _tiny_checkpoint(ckpt)
    text = tmp_path / "book.txt"
    text.write_text("The sky is blue and the grass is green. " * 40)
    out = tmp_path / "out"
    seen = []  # the passkey prompts and what the sharded decode generated for them
    real_greedy_n = R.greedy_n

    def spy(em, prompts, n, *args, **kw):
        got = real_greedy_n(em, prompts, n, *args, **kw)
        seen.append((prompts, got.tolist()))
        return got

    clean_env.setattr(R, "greedy_n", spy)
    rc = E.main(["model.source=hf", f"model.path={ckpt}", f"output_dir={out}", *TINY, "eval.context_lengths=[64]",
                 "eval.strategies=[packed]", "eval.passkey.enabled=true", "eval.passkey.trials=2",
                 "eval.passkey.new_tokens=4", f"eval.perplexity.text_file={text}", "eval.perplexity.prefix_tokens=40",
                 "eval.perplexity.eval_tokens=6", "wandb.enabled=false"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["wandb"] == {"enabled": False, "mode": "disabled", "run_dir": None, "disabled_by": None}
    assert res["exact"] is True
    (pk,) = res["passkey"]
    assert pk["context_length"] == 64 and pk["trials"] == 2 and 0.0 <= pk["accuracy"] <= 1.0
    assert len(pk["answers"]) == 2 and all(isinstance(a, str) for a in pk["answers"])
    assert pk["accuracy"] == sum(str(k) in a for k, a in zip(pk["keys"], pk["answers"])) / 2
    # Each prompt is 64 tokens holding its own key's needle at its own depth, and the answer
    # is the unsharded model's greedy continuation of it.
    ((prompts, generated),) = seen
    depths = []
    for key, prompt, gen, answer in zip(pk["keys"], prompts, generated, pk["answers"]):
        assert len(prompt) == 64 and prompt[0] == 1  # bos_token_id
        needle = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ",
                            add_special_tokens=False).ids
        depths += [i for i in range(len(prompt)) if prompt[i:i + len(needle)] == needle]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(4):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert gen == ids[64:] and answer == tok.decode(gen)
    assert len(depths) == 2 and depths[0] < depths[1], depths
    # Perplexity through CP prefill + decode steps equals the unsharded forward's.
    ppl = res["perplexity"]
    ids = [1] + tok.encode(text.read_text(), add_special_tokens=False).ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:46]])).logits.float()[0], -1)
    nll = -torch.stack([logp[39 + i, ids[40 + i]] for i in range(6)]).mean().item()
    assert ppl["eval_tokens"] == 6
    assert ppl["nll"] == pytest.approx(nll, abs=1e-4)
    assert ppl["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)


@pytest.mark.parametrize("args, fragment", [
    (["eval.passkey.enabled=true", "eval.passkey.context_lengths=[2100]", "eval.passkey.new_tokens=4"],
     "eval.passkey.context_lengths: 2100 tokens + eval.passkey.new_tokens 4 need 2104 positions, but the model has "
     "max_position_embeddings 2048"),
    (["eval.perplexity.prefix_tokens=2100", "eval.perplexity.eval_tokens=6"],
     "eval.perplexity: prefix_tokens + eval_tokens need 2106 positions, but the model has max_position_embeddings 2048"),
    # at the window's edge: the context (the prefix) fits, only its new tokens (eval tokens) pass the window
    (["eval.passkey.enabled=true", "eval.passkey.context_lengths=[2046]", "eval.passkey.new_tokens=4"],
     "eval.passkey.context_lengths: 2046 tokens + eval.passkey.new_tokens 4 need 2050 positions, but the model has "
     "max_position_embeddings 2048"),
    (["eval.perplexity.prefix_tokens=2045", "eval.perplexity.eval_tokens=6"],
     "eval.perplexity: prefix_tokens + eval_tokens need 2051 positions, but the model has max_position_embeddings 2048"),
])
def test_passkey_and_perplexity_past_the_models_window_fail_before_the_sweep(tmp_path, clean_env, capsys, args, fragment):
    """eval.context_lengths past max_position_embeddings is a config error before launch; the passkey's own
    context lengths and the perplexity's prefix + eval tokens were not checked, so the whole sweep ran and then
    the CP prefill's ValueError ended the run with a traceback. Now the same one-line config error, before any
    process group, naming the key and the flag that lets this RoPE model run past its window."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _tiny_checkpoint(ckpt)
    text = tmp_path / "book.txt"
    text.write_text("The sky is blue and the grass is green. " * 300)
    rc = E.main(["model.source=hf", f"model.path={ckpt}", f"output_dir={tmp_path / 'out'}", *TINY,
                 "eval.context_lengths=[24]", "eval.strategies=[packed]", "wandb.enabled=false",
                 f"eval.perplexity.text_file={text}", "eval.perplexity.prefix_tokens=40", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and fragment in err and "Traceback" not in err, err
    assert "eval.allow_beyond_max_position=true" in err, err
    assert not torch.distributed.is_initialized() and not (tmp_path / "out" / "results.json").exists()


def test_only_a_rope_model_runs_past_its_window_and_only_with_the_flag(tmp_path, clean_env, capsys):
    """eval.allow_beyond_max_position lets a RoPE model's runs pass its max_position_embeddings (positions are
    computed for any index: the 16-node Llama-3.1 config's contexts of 512K-2M past its 128K window); a transformers
    model whose positions are a learned table (GPT-2) is refused before launch, naming the reason."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from megatron_tree.eval.launch import check_inputs

    ckpt = tmp_path / "llama"
    ckpt.mkdir()
    _tiny_checkpoint(ckpt)
    past = ["model.source=hf", f"model.path={ckpt}", "eval.context_lengths=[4000]", "eval.passkey.enabled=false"]
    with pytest.raises(ConfigError, match="set eval.allow_beyond_max_position=true"):
        check_inputs(load_config(None, past))
    check_inputs(load_config(None, [*past, "eval.allow_beyond_max_position=true", "eval.exactness.max_context=24"]))
    check_inputs(load_config(None, ["model.source=random", "model.max_position_embeddings=128",
                                    "eval.context_lengths=[200]", "eval.allow_beyond_max_position=true"]))
    gpt2 = tmp_path / "gpt2"
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=64)).save_pretrained(gpt2)
    table = ["model.source=hf", f"model.path={gpt2}", "eval.allow_beyond_max_position=true", "topology.intra_size=null"]
    with pytest.raises(ConfigError, match="max_position_embeddings 64, and its positions are a learned table"):
        check_inputs(load_config(None, [*table, "eval.context_lengths=[100]", "eval.passkey.enabled=false"]))
    # megatron-tree-generate: the same rule for its prompts, before any process group
    from megatron_tree.eval import generate as G

    assert G.main(["--prompt", "5 " * 70, "--out-seq-length", "2", *table]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings 64; its positions are a learned table of that many rows" in err, err
    assert not torch.distributed.is_initialized()


def test_dynamic_rope_exactness_is_refused_from_the_first_run_past_the_window(clean_env):
    """Dynamic-NTK RoPE past the window: the exactness check is refused for a checked run whose positions
    (context + warmup + decode steps + 1) pass max_position_embeddings, though its context alone fits, and
    eval.exactness.max_context at the largest value the message suggests, below a longer unchecked context, is taken
    (as is exactness.enabled=false)."""
    from megatron_tree.eval.launch import check_inputs

    dyn = ["model.source=random", "model.max_position_embeddings=128", "model.rope_scaling={rope_type: dynamic, factor: 2.0}",
           "eval.allow_beyond_max_position=true", "eval.warmup_steps=2", "eval.decode_steps=2", "eval.passkey.enabled=false"]
    with pytest.raises(ConfigError, match=r"a checked run of context 124 needs 129 positions, past max_position_embeddings "
                                          r"128.*set eval.exactness.max_context to at most 123 "):
        check_inputs(load_config(None, [*dyn, "eval.context_lengths=[64, 124]"]))
    check_inputs(load_config(None, [*dyn, "eval.context_lengths=[64, 123, 200]", "eval.exactness.max_context=123"]))
    check_inputs(load_config(None, [*dyn, "eval.context_lengths=[64, 200]", "eval.exactness.enabled=false"]))


def test_a_rope_model_runs_past_its_window_with_the_flag_exactly(tmp_path, clean_env, capsys):
    """eval.allow_beyond_max_position must reach the model (enable_tree_attention(allow_beyond_window=True)), not
    only the config check: a random Llama with max_position_embeddings 16 runs the eval at context 24 exactly
    against its own attention, and megatron-tree-generate continues a 20-token prompt with the tokens of the same
    weights at a window of 65536 (RoPE: the window changes no weight and no position)."""
    from megatron_tree.eval import generate as G

    small = ["model.max_position_embeddings=16", "eval.allow_beyond_max_position=true"]
    out = tmp_path / "out"
    rc = E.main(["--config", LLAMA, f"output_dir={out}", *TINY, "eval.context_lengths=[24]", "eval.strategies=[packed]",
                 *small])
    assert rc == 0, capsys.readouterr().err
    assert json.loads((out / "results.json").read_text())["exact"] is True
    capsys.readouterr()  # the eval's report
    tokens = []
    for window in (small, []):
        assert G.main(["--config", LLAMA, "--prompt", " ".join(str(t) for t in range(3, 23)), "--out-seq-length", "3",
                       "--greedy", "topology.intra_size=null", "eval.progress=false", *window]) == 0, capsys.readouterr().err
        tokens.append(json.loads(capsys.readouterr().out)["tokens"])
    assert len(tokens[0]) == 3 and tokens[0] == tokens[1], tokens


def test_broken_checkpoints_are_clear_errors(tmp_path, clean_env, capsys):
    args = ["model.source=hf", f"model.path={tmp_path}", "topology.intra_size=null", "wandb.enabled=false"]
    (tmp_path / "config.json").write_text("{}")
    assert E.main(args) == 2
    assert "has neither model.safetensors nor model.safetensors.index.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert E.main(args) == 2
    assert "config.json is not valid JSON" in capsys.readouterr().err
    # Unreadable or truncated weights: named, before any process group (a complete config, so
    # that a check of the config could not be what refuses it).
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    assert E.main(args) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'model.safetensors'} is 0 bytes, too short for a safetensors header" in err, err
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert E.main(args) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'model.safetensors'} is truncated" in err, err
    assert not torch.distributed.is_initialized()
    # Readable weights, none of them the model's: refused before any process group (transformers
    # would otherwise build config.json's model with random weights -- a 7B one for a bare config).
    save_file({"w": torch.zeros(64, 64)}, str(tmp_path / "model.safetensors"))
    assert E.main(args) == 2
    err = capsys.readouterr().err
    assert "none of the checkpoint's 1 tensors is a weight of LlamaForCausalLM" in err, err
    # A readable checkpoint of an architecture tree attention cannot run exactly (Bloom's ALiBi
    # attention bypasses transformers' attention interface): refused before any process group, as
    # one line (no traceback) and exit status 2. (What the loader refuses after the group exists --
    # weights that are not the class's -- is test_transformers_checkpoints_that_cannot_run_are_clear_errors.)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BloomForCausalLM"], "model_type": "bloom"}))
    assert E.main(args) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "unsupported architecture" in err and "BloomForCausalLM does not route" in err, err
    assert "Traceback" not in err
    assert not torch.distributed.is_initialized()


def test_transformers_checkpoints_that_cannot_run_are_clear_errors(tmp_path, clean_env, capsys):
    """model.source hf: what transformers cannot load, or tree attention cannot run exactly, is
    refused before any process group (architecture) or before any collective (weights), as one line."""
    import transformers as tf
    from safetensors.torch import save_file

    args = ["model.source=hf", f"model.path={tmp_path}", "topology.intra_size=null", "wandb.enabled=false",
            "eval.context_lengths=[24]"]
    save_file({"w": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))

    def refused(config: dict, fragment: str, *, before_group: bool = True):
        (tmp_path / "config.json").write_text(json.dumps(config))
        assert E.main(args) == 2
        err = capsys.readouterr().err
        assert "error:" in err and fragment in err and "Traceback" not in err, err
        if before_group:
            assert not torch.distributed.is_initialized()

    refused({"model_type": "no_such_model"}, "model.path: transformers cannot read")
    refused(tf.T5Config(num_layers=1, d_model=8, d_ff=8, num_heads=1, d_kv=8, vocab_size=16).to_dict(),
            "unsupported architecture: " + str(tmp_path / "config.json") + " describes model_type 't5', which has "
            "no causal-LM class")
    tiny = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64)
    refused(tf.BloomConfig(vocab_size=16, hidden_size=8, n_layer=1, n_head=2).to_dict(),
            "unsupported architecture: " + str(tmp_path / "config.json") + ": BloomForCausalLM does not route its "
            "attention through transformers' AttentionInterface")
    # A supported class whose weights are not in the files: transformers would fill them randomly.
    refused(tf.Qwen3Config(**tiny, head_dim=4).to_dict(),
            "model.path: none of the checkpoint's 1 tensors is a weight of Qwen3ForCausalLM")
    # and the context must fit the checkpoint's positions (its config.json, not model.*)
    tf.Qwen3ForCausalLM(tf.Qwen3Config(**tiny, head_dim=4)).save_pretrained(tmp_path)
    refused(tf.Qwen3Config(**tiny, head_dim=4).to_dict() | {"max_position_embeddings": 16},
            "the model has max_position_embeddings 16")


def test_megatron_source_in_one_process_passkey_perplexity_and_a_wrong_reference(tmp_path, clean_env):
    """The default source (a Megatron-Core GPTModel, random weights) at CP = 1: exact against
    Megatron's own model, and with a tokenizer the passkey and perplexity tasks run on it; the
    perplexity equals the reference model's. A perturbed reference fails the run (exit 3)."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _, tok = _tiny_checkpoint(ckpt)  # only its tokenizer.json is used
    text = tmp_path / "book.txt"
    text.write_text("The sky is blue and the grass is green. " * 40)
    seen = {}
    real_ppl = R.perplexity_eval

    def spy(em, ev, device, tok_):
        got = real_ppl(em, ev, device, tok_)
        ids = tok_.encode(text.read_text(), add_special_tokens=False).ids
        with torch.no_grad():  # the reference (Megatron's DotProductAttention, CP = 1) over the same tokens
            logp = torch.log_softmax(em.reference(torch.tensor([ids[:46]])).float()[0], -1)
        seen["nll"] = -torch.stack([logp[39 + i, ids[40 + i]] for i in range(6)]).mean().item()
        seen["reference"] = type(em.reference.model.decoder.layers[0].self_attention.core_attention).__name__
        return got

    clean_env.setattr(R, "perplexity_eval", spy)
    out = tmp_path / "out"
    rc = E.main([f"output_dir={out}", *TINY, "topology.intra_size=null", "eval.context_lengths=[64]",
                 "eval.strategies=[packed]", "eval.exactness.sample_rate=1.0", f"model.tokenizer={ckpt / 'tokenizer.json'}",
                 "eval.passkey.enabled=true", "eval.passkey.trials=2", "eval.passkey.new_tokens=3",
                 f"eval.perplexity.text_file={text}", "eval.perplexity.prefix_tokens=40",
                 "eval.perplexity.eval_tokens=6", "wandb.enabled=false"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["model"]["source"] == "megatron" and res["model"]["class"].endswith("GPTModel")
    assert res["exactness_reference"].endswith("with its own DotProductAttention, same weights")
    assert res["exact"] is True and res["max_abs_dlogits"] < 1e-4 and res["tokens_match_reference"] is True
    (run,) = res["runs"]
    assert run["exactness"]["reference_tokens"] == run["tokens"] and len(run["tokens"][0]) == 5
    (pk,) = res["passkey"]
    assert pk["trials"] == 2 and pk["accuracy"] == sum(str(k) in a for k, a in zip(pk["keys"], pk["answers"])) / 2
    assert seen["reference"] == "DotProductAttention"
    assert res["perplexity"]["nll"] == pytest.approx(seen["nll"], abs=1e-4)

    real_build = M.build

    def perturbed(*args, **kwargs):
        em = real_build(*args, **kwargs)
        with torch.no_grad():  # the reference is a separate TP = 1 model: scale its final norm
            em.reference.model.decoder.final_layernorm.weight.mul_(1.5)
        return em

    clean_env.setattr(M, "build", perturbed)
    rc = E.main([f"output_dir={out}", *TINY, "topology.intra_size=null", "eval.context_lengths=[24]",
                 "eval.strategies=[packed]", "wandb.enabled=false"])
    assert rc == 3
    res = json.loads((out / "results.json").read_text())
    assert res["exact"] is False and res["max_abs_dlogits"] > 1e-2


def test_dynamic_engine_comparison_reads_the_right_positions():
    """compare_dynamic_with_reference: the engine's token t of row b (t = 0 from the prefill) is
    scored by the reference's logits at position ctx - 1 + t over prompt + tokens[:, :-1]; a
    log-prob off by 0.01 at one step, or a token the reference would not choose, is caught."""
    from types import SimpleNamespace

    torch.manual_seed(3)
    ctx, new, vocab = 5, 4, 11
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    table = torch.randn(vocab, vocab) * 3  # logits depend on the last token and its position

    def reference(ids):
        pos = torch.arange(ids.shape[1], dtype=torch.float32)[None, :, None]
        return table[ids] + 0.1 * pos

    ids = torch.tensor(prompts)
    for _ in range(new):  # the reference's own greedy continuation: what an exact engine generates
        ids = torch.cat([ids, reference(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    tokens = ids[:, ctx:]
    lp = torch.log_softmax(reference(ids[:, :-1])[:, ctx - 1:].double(), -1).gather(-1, tokens[..., None])[..., 0]
    em = SimpleNamespace(reference=reference, reference_name="ref")
    ok = R.compare_dynamic_with_reference(em, prompts, tokens, lp, 1e-3, "cpu")
    assert ok["quantity"] == "log_probs" and ok["checked_steps"] == [0, 1, 2]
    assert ok["max_abs_dlogprobs"] < 1e-6 and ok["tokens_match_reference"] and ok["within_tolerance"]
    assert ok["max_abs_dlogits"] is None and ok["reference_tokens"] == tokens.tolist()
    off = lp.clone()
    off[1, 2] += 0.01  # decode step 1 of row 1
    bad = R.compare_dynamic_with_reference(em, prompts, tokens, off, 1e-3, "cpu")
    assert bad["step_max_abs_dlogprobs"][1] == pytest.approx(0.01) and bad["prefill_max_abs_dlogprobs"] < 1e-6
    assert not bad["within_tolerance"] and bad["tokens_match_reference"]
    other = tokens.clone()
    other[0, 3] = (other[0, 3] + 1) % vocab
    wrong = R.compare_dynamic_with_reference(em, prompts, other, lp, 1.0, "cpu")
    assert not wrong["tokens_match_reference"] and not wrong["within_tolerance"]
    # a token the reference would not choose fails the run even when its log-prob is the
    # reference's own (the last token does not change the reference's context)
    ids_other = torch.cat([torch.tensor(prompts), other[:, :-1]], 1)
    lp_other = torch.log_softmax(reference(ids_other)[:, ctx - 1:].double(), -1).gather(-1, other[..., None])[..., 0]
    chosen_badly = R.compare_dynamic_with_reference(em, prompts, other, lp_other, 1e-3, "cpu")
    assert chosen_badly["max_abs_dlogprobs"] < 1e-6
    assert not chosen_badly["tokens_match_reference"] and not chosen_badly["within_tolerance"]


def _strategy_rank(rank, world):
    """One layer's attention as Megatron's dynamic engine calls it (``DynamicTreeContext.attend``: a
    plain ``DecodeStep`` of the core attention's strategy), per strategy: ops per level and output."""
    from megatron_tree import CommStats, TreeGroups
    from megatron_tree.decode.generate import DecodeStep

    groups = TreeGroups.build()
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 1, 4, 8, generator=g)
    k, v = (torch.randn(world, 2, 6, 2, 8, generator=g)[rank] for _ in range(2))
    lens = torch.full((2,), 6, dtype=torch.int32)
    out = {}
    for strategy in ("shifted", "packed"):
        stats = CommStats()
        o = DecodeStep(strategy, stats).attend(0, q, k, v, groups, cache_seqlens=lens)
        out[strategy] = ({n: dict(s.ops) for n, s in stats.levels.items()}, o.tolist())
    out["label"] = R.resolved_strategy("shifted", "dynamic", groups, (2, 1, 4, 8))
    return out


def test_shifted_on_the_dynamic_engine_is_labelled_as_the_packed_it_runs():
    """Megatron's dynamic engine has no place to redo a step, so its attention passes no shift and a
    ``shifted`` run merges with ``packed`` (docs/strategies.md): the report labels it
    ``shifted->packed``, as it labels ``auto`` with its pick; the static engine's ``shifted`` is itself."""
    from tests.helpers.ranks import run_ranks
    from megatron_tree.eval import report

    for out in run_ranks(_strategy_rank, 2, timeout=300):
        assert out["packed"][0] == {"cp": {"all_reduce_max": 1, "all_reduce_sum": 1}}
        assert out["shifted"] == out["packed"]  # the same collectives (MAX + SUM) and the same output
        assert out["label"] == "packed"
    assert R.resolved_strategy("shifted", "static", None, (2, 1, 4, 8)) == "shifted"
    assert R.resolved_strategy("packed", "dynamic", None, (2, 1, 4, 8)) == "packed"
    row = {"context_length": 40, "batch_size": 1, "strategy": "shifted", "resolved_strategy": "packed",
           "prefill_s": 0.5, "decode_latency_ms": {"p50": 1.0, "p90": 2.0, "p99": 3.0}, "tokens_per_s": 9.0,
           "comm_per_step": {"levels": {"cp": {"collectives": 4.0, "sent_bytes": 64.0}}}, "exactness": None}
    assert report._table_row(row)[2] == "shifted->packed"
    assert " shifted->packed " in report.summary_line(row)


@pytest.mark.parametrize("flags, fragment", [
    (["--top_p", "2.0"], "--top_p must lie in (0, 1], got 2.0"),
    (["--top_k", "-1"], "--top_k must be >= 0 (0: no top-k), got -1"),
    (["--temperature", "-0.5"], "--temperature must be >= 0 (0: greedy), got -0.5"),
    (["--out-seq-length", "0"], "--out-seq-length must be a positive integer, got 0"),
    # --greedy with a flag that asks for sampling: which one was meant is not guessed
    (["--greedy", "--temperature", "0.7"], "--greedy contradicts --temperature 0.7"),
    (["--greedy", "--top_k", "5", "--top_p", "0.9"], "--greedy contradicts --top_k 5, --top_p 0.9"),
])
def test_generate_megatron_refuses_bad_sampling_flags_before_building(clean_env, capsys, flags, fragment):
    from megatron_tree.eval import generate as G

    with pytest.raises(SystemExit) as exc:
        G.main(["--prompt", "5 17 3", *flags])
    assert exc.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_generate_refuses_an_output_file_it_cannot_write_before_building(tmp_path, clean_env, capsys):
    """--sample-output-file in a folder that does not exist (or naming a folder) is exit 2 with one line
    before the model is built; before, the whole generation ran and then open() raised a traceback."""
    from megatron_tree.eval import generate as G

    for out, fragment in [(tmp_path / "missing" / "out.jsonl", f"has no folder '{tmp_path / 'missing'}'"),
                          (tmp_path, "is a directory")]:
        assert G.main(["--prompt", "5 17 3", "--out-seq-length", "2", "--sample-output-file", str(out),
                       "topology.intra_size=null"]) == 2
        err = capsys.readouterr().err
        assert f"megatron-tree-generate: rank 0: error: --sample-output-file: '{out}' {fragment}" in err, err
        assert not torch.distributed.is_initialized()


def test_generate_shows_no_progress_bar_outside_a_terminal(clean_env, capsys, monkeypatch):
    """The generation's output under a launcher or into a log is the eval's: no tqdm redraws (stderr is not
    a terminal here), third-party warnings shaped by the eval's console filter; before, the "generate:" bar
    was drawn into logs and every rank printed Megatron-Core's warnings with their source lines."""
    import warnings

    from megatron_tree.eval import generate as G

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() installs its filter: undo it after
    monkeypatch.setenv("TQDM_DISABLE", "")  # and sets TQDM_DISABLE outside a terminal: unset again after
    monkeypatch.delenv("TQDM_DISABLE")
    assert G.main(["--prompt", "5 17 3", "--out-seq-length", "3", "topology.intra_size=null",
                   "model.source=random"]) == 0
    out, err = capsys.readouterr()
    assert len(json.loads(out)["tokens"]) == 3
    assert "generate:" not in err and "tok/s" not in err, err
    assert warnings.showwarning.__module__ == "megatron_tree.eval.console"


def test_generate_stops_at_the_models_eos(tmp_path, clean_env, capsys):
    """eval.generate stops a row at the checkpoint's EOS (generation_config.json's eos_token_id, an int or a
    list, as transformers' generate stops), and the tokens before it are the ones a run with --ignore-eos
    generates; --ignore-eos keeps --stop-token-id. --greedy with --temperature 0 (greedy too) is no contradiction."""
    from megatron_tree.eval import generate as G

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _tiny_checkpoint(ckpt)
    out = tmp_path / "out.jsonl"

    def run(*flags):
        rc = G.main(["--config", LLAMA, "model.source=hf", f"model.path={ckpt}", "eval.progress=false",
                     "--prompt", "The sky is", "--out-seq-length", "8", "--greedy", "--temperature", "0",
                     "--sample-output-file", str(out), *flags])
        assert rc == 0, capsys.readouterr().err
        return json.loads(out.read_text())["tokens"]

    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 319}))  # never generated below
    full = run("--ignore-eos")
    assert len(full) == 8
    k = next(i for i in range(1, 8) if full[i] not in full[:i])  # the first token not generated before it
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [319, full[k]]}))
    assert run() == full[:k + 1]
    assert run("--ignore-eos") == full
    assert run("--ignore-eos", "--stop-token-id", str(full[k])) == full[:k + 1]
    # no generation_config.json: config.json's eos_token_id, as transformers falls back to it
    (ckpt / "generation_config.json").unlink()
    conf = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**conf, "eos_token_id": full[k]}))
    assert run() == full[:k + 1]
    # other sources: the tokenizer's EOS (tokenizer_config.json's eos_token beside tokenizer.json), as
    # Megatron-LM stops at its tokenizer's end-of-document id; none named there, no EOS stop
    from tokenizers import Tokenizer

    tok_file = str(ckpt / "tokenizer.json")
    tok = Tokenizer.from_file(tok_file)
    tok.add_special_tokens(["</s>"])
    tok.save(tok_file)
    cfg = load_config(LLAMA, ["model.source=random", f"model.tokenizer={tok_file}"])
    assert G.eos_ids(cfg, tok_file) == []
    for eos in ("</s>", {"content": "</s>", "special": True}):
        (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        assert G.eos_ids(cfg, tok_file) == [tok.token_to_id("</s>")] == [300]


def test_single_process_ignores_the_simulated_node_layout(clean_env, capsys):
    # configs/cpu_tiny.yaml's intra_size 2 (a 4-rank layout) does not apply to one process: a note, not an error
    cfg = load_config(os.path.join(ROOT, "configs/cpu_tiny.yaml"), [])
    one = E.single_process_topology(cfg, 1)
    assert one.topology.intra_size is None and E.check_launch(one, 1) == 1
    assert "topology.intra_size 2 ignored" in capsys.readouterr().err
    assert E.single_process_topology(cfg, 4) is cfg  # launched ranks keep it (and its checks)
    from megatron_tree.eval.generate import parse_args

    assert parse_args(["--prompt", "1", "--top_k", "0"]).top_k is None  # Megatron-LM's 0 = no top-k
