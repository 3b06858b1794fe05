"""Every launcher starts a real 4-process CPU eval: launch/local.sh, launch/torchrun.sh,
launch/deepspeed.sh (the real deepspeed launcher, with a hostfile) and both Slurm scripts
run by bash under the stand-in srun/scontrol of tests/fake_slurm (2 nodes x 2 tasks).

These tests prove the launch: the rendezvous, the levels read from each launcher's environment,
the TP x CP layout, a checkpoint loaded at that layout, results.json / the plot / the offline
wandb run written, one line per rank on bad input, a run that fails when ranks diverge.
Exactness is proven where it is cheaper, in-process and without a launcher (test_tree_decode,
test_megatron*, test_hf, test_eval); here only the main job (local.sh's default, the README's
first command) still runs its reference at CP = 1, and the checkpoint runs must reproduce the
tokens Megatron's own StaticInferenceEngine generated for that checkpoint at CP = 1 (the
``trained`` fixture, Megatron-LM's ``--save`` layout), which costs no extra forward.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.helpers.launching import free_port, launch_env, run, train_checkpoint


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAKE_SLURM = os.path.join(ROOT, "tests", "fake_slurm")
# Tiny: one context length, batch 1, the level-aware strategy, 1 warmup + 2 timed steps. Layers: 2 (cpu_tiny).
TINY = ["eval.context_lengths=[40]", "eval.batch_sizes=[1]", "eval.strategies=[two_level]",
        "eval.decode_steps=2", "eval.warmup_steps=1", "eval.progress=false"]
# The launch alone: no reference model at CP = 1 (exactness is proven without a launcher), and no timing of
# attention alone beside the ring/all-gather baselines (108 timed collective calls per rank, ~2 CPU-s each): the
# main job times them at CP 4 = 2 x 2 and asserts them; the TP 2 x CP 2 launch (one level, packed) and the Slurm
# transformers launch (a transformers model's heads) switch them back on (WITH_BASELINES) and assert them too.
LAUNCH_ONLY = [*TINY, "eval.exactness.enabled=false", "eval.attention_baselines=false"]
WITH_BASELINES = "eval.attention_baselines=true"
BASELINE_METHODS = {"tree", "allgather", "ring", "allgather_kv"}
# The main job keeps its reference, every step, and lets auto choose beside two_level.
MAIN_JOB = [*TINY, "eval.strategies=[two_level,auto]", "eval.exactness.sample_rate=1.0"]
LAYERS = 2
NEW_TOKENS = 4  # the prefill's token + 1 warmup + 2 timed decode steps
SHORT = [5, 17, 3]
MEGATRON_REFERENCE = "Megatron-Core GPTModel at CP=1, TP=1 with its own DotProductAttention, same weights"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, the CP = 1 tokens of Megatron's own engine for the eval's prompt and SHORT)."""
    from megatron_tree.eval.run import random_prompts

    ckpt = tmp_path_factory.mktemp("megatron_ckpt")
    result = tmp_path_factory.mktemp("megatron_ckpt_result") / "result.json"
    prompts = random_prompts(0, 40, 1, 512) + [SHORT]  # the eval's prompt for ctx 40, batch 1 (model.seed 0)
    out = train_checkpoint(ckpt, result, prompts, NEW_TOKENS, timeout=300)
    assert out["core_attention"] == "DotProductAttention"
    return ckpt, out["tokens"]


def _check_results(out_dir, p, *, launcher, levels, source="megatron", tp=1, tokens=None, engine="static",
                   exact=False, baselines=False):
    """What every launch must show; ``exact``: the run compared itself with its reference; ``baselines``:
    it timed attention alone (tree beside the ring and all-gather baselines) at every context of its sweep
    and beyond (4x, 16x)."""
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    res = json.loads((out_dir / "results.json").read_text())
    assert res["schema_version"] == 3 and res["engine"] == engine
    launch = res["launch"]
    assert launch["launcher"] == launcher
    assert launch["world_size"] == 4 and launch["tp_size"] == tp and launch["cp_size"] == 4 // tp
    assert launch["level_sizes"] == levels
    assert res["model"]["source"] == source
    assert res["tokens_agree_across_ranks"] is True
    by = {r["strategy"]: r for r in res["runs"]}
    assert set(by) == ({"two_level", "auto"} if exact else {"two_level"})
    for r in res["runs"]:
        assert r["engine"] == engine
        assert len(r["tokens"]) == 1 and len(r["tokens"][0]) == NEW_TOKENS
        assert r["tokens"] == res["runs"][0]["tokens"]  # every merge strategy decodes the same tokens
        if tokens is not None:
            assert r["tokens"] == tokens, (r["strategy"], r["tokens"], tokens)
        assert len(r["peak_memory_bytes"]) == 4 and min(r["peak_memory_bytes"]) > 10 * 2**20
        assert len(r["step_latency_ms"]) == 2
    if exact:
        if source == "megatron":
            assert res["exactness_reference"] == MEGATRON_REFERENCE
        # the config's tolerance is 1e-3; fp32 rounding at CP 4 is ~1e-5, so hold the run to 1e-4.
        what = "dlogits" if engine == "static" else "dlogprobs"
        assert res["exact"] is True and res[f"max_abs_{what}"] < 1e-4
        assert res["tokens_match_reference"] is True
        for r in res["runs"]:
            ex = r["exactness"]
            assert ex["reference_tokens"] == r["tokens"] and ex["tokens_match_reference"]
            assert ex["checked_steps"] == [0, 1, 2] and ex["within_tolerance"]
        # auto ran what the cost model chose, with that strategy's collectives
        from megatron_tree.comm.cost import UNSHIFTED_CANDIDATES

        chosen = by["auto"]["resolved_strategy"]
        assert chosen in UNSHIFTED_CANDIDATES  # no shift on an eval step's first try: shifted is no candidate
        merge = {"all_reduce_max": LAYERS, "all_reduce_sum": LAYERS}
        expected_ops = {"two_level": {lvl: merge for lvl in levels}, "packed": {"cp": merge},
                        "allreduce3": {"cp": {"all_reduce_max": LAYERS, "all_reduce_sum": 2 * LAYERS}},
                        "allgather": {"cp": {"all_gather": LAYERS}}}
        assert {k: v["ops"] for k, v in by["auto"]["comm_per_step"]["levels"].items()} == expected_ops[chosen], chosen
        # the table's header and the verdict line name the quantity; every row's tokens equal the reference's
        assert p.stdout.count(f"max|{what}|") == 2
        rows = [l for l in p.stdout.splitlines() if l.lstrip().startswith("40 ") and len(l.split()) > 5]  # not the attention table's
        assert len(rows) == 2 and all(l.rstrip().endswith("same") for l in rows), rows
    else:
        assert res["exact"] is None and res["exactness_reference"] is None
    # Collectives per decode step, per level, from the launcher's layout: one merge per layer.
    two = by["two_level"]["comm_per_step"]["levels"]
    if len(levels) == 2:
        assert {k: v["collectives"] for k, v in two.items()} == {"intra": 2 * LAYERS, "inter": 2 * LAYERS}
    else:
        assert sum(v["collectives"] for v in two.values()) == 2 * LAYERS
    if baselines:
        assert res["attention_baselines"], "the run timed no attention baselines"
        points = res["attention_baselines"]["points"]
        assert {q["method"] for q in points} == BASELINE_METHODS, points
        assert sorted({q["context_length"] for q in points}) == [40, 160, 640], points
        tree = "two_level" if len(levels) == 2 else "packed"
        assert {q["strategy"] for q in points if q["method"] == "tree"} == {tree}, points
        assert all(q["step_ms"] > 0 for q in points), points
    else:
        assert res["attention_baselines"] is None, res["attention_baselines"]
    run_dir = res["wandb"]["run_dir"]
    assert run_dir.startswith(str(out_dir / "wandb"))
    assert any(f.startswith("run-") and f.endswith(".wandb") for f in os.listdir(run_dir)), os.listdir(run_dir)
    assert f"results: {out_dir / 'results.json'}" in p.stdout
    assert os.path.isfile(res["plot"])
    return res


def test_local_sh_default_is_megatron_at_cp4_as_2x2(tmp_path):
    out = tmp_path / "local"
    p = run(["bash", "launch/local.sh", f"output_dir={out}", *MAIN_JOB, "eval.progress=true"], launch_env(NPROC="4"))
    res = _check_results(out, p, launcher="torchrun", levels={"intra": 2, "inter": 2}, exact=True, baselines=True)
    assert res["model"]["checkpoint"] is None and res["model"]["hierarchical_context_parallel_sizes"] == [2, 2]
    _check_reads_like_a_report(p, out, res)


def _check_reads_like_a_report(p, out, res):
    """The main job's log: what it runs first, a headed table, one verdict line last; third-party
    warnings one line each on rank 0 only; no progress bars in a captured (non-terminal) log."""
    lines = p.stdout.splitlines()
    assert lines[0].startswith("megatron-tree-eval: cpu_tiny: megatron.core.models.gpt.GPTModel (random weights"), lines[:3]
    assert "CP 4 = intra 2 x inter 2 on 4 processes (torchrun, gloo/cpu)" in lines[0]
    header = next(i for i, l in enumerate(lines) if l.startswith("ctx  batch  strategy"))
    assert lines[header].split() == ["ctx", "batch", "strategy", "prefill_s", "p50_ms", "p90_ms", "p99_ms", "tok/s",
                                     "collectives/bytes", "per", "step", "max|dlogits|", "tokens", "vs", "ref"]
    assert set(lines[header + 1].replace(" ", "")) == {"-"}
    assert [l.split()[2] for l in lines[header + 2: header + 4]] == ["two_level", f"auto->{res['runs'][1]['resolved_strategy']}"]
    verdicts = [l for l in lines if l.startswith("verdict:")]
    assert verdicts == [lines[-1]], lines[-6:]
    assert lines[-1].startswith("verdict: EXACT: CP 4 (intra 2 x inter 2) vs Megatron-Core GPTModel at CP=1")
    tokens = sum(len(row) for r in res["runs"] for row in r["exactness"]["reference_tokens"])
    assert f"max|dlogits| {res['max_abs_dlogits']:.2e} (tolerance 0.001), {tokens} tokens compared in 2 runs, identical" \
        in lines[-1]
    assert f"results in {out}/ (results.json, decode_latency.png, wandb)" in lines[-1]
    # attention alone beside the ring and all-gather baselines, crossovers stated
    assert any(l.startswith("crossover here (measured): tree ") for l in lines)
    assert any(l.startswith("crossover on dgx_h100 (modelled, CP 4, bf16") for l in lines)
    assert {p_["method"] for p_ in res["attention_baselines"]["points"]} == {"tree", "allgather", "ring", "allgather_kv"}
    # Megatron-Core's 7 warnings per rank (28 lines + 28 source lines before): one line per kind, rank 0 only
    warns = [l for l in p.stderr.splitlines() if "warn" in l.lower()]
    assert all(l.startswith("megatron-tree-eval: warning (") for l in warns), warns
    assert len(warns) == len(set(warns)) <= 3, warns
    assert sum("Apex" in l for l in warns) == 1, warns
    assert "sweep:" not in p.stderr and "decode:" not in p.stderr  # no progress bars: stderr is not a terminal
    # wandb left no empty folders in the output directory
    empty = [d for d, subdirs, files in os.walk(out) if not subdirs and not files]
    assert empty == [], empty


def test_deepspeed_sh_evaluates_a_trained_checkpoint_at_cp4_as_2x2(tmp_path, trained):
    ckpt, cp1_tokens = trained
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=4\n")
    out = tmp_path / "ds"
    p = run(["bash", "launch/deepspeed.sh", f"output_dir={out}", f"model.path={ckpt}", *LAUNCH_ONLY],
                launch_env(HOSTFILE=str(hostfile), MASTER_PORT=str(free_port())))
    res = _check_results(out, p, launcher="deepspeed", levels={"intra": 2, "inter": 2}, tokens=cp1_tokens[:1])
    assert res["launch"]["backend"] == "gloo"
    assert res["model"]["checkpoint"]["iteration"] == 4 and res["model"]["checkpoint"]["training_args"] is True
    assert res["model"]["checkpoint"]["dist_dir"] == str(ckpt / "iter_0000004")


def test_torchrun_sh_evaluates_a_trained_checkpoint_at_tp2_x_cp2(tmp_path, trained):
    # intra_size null: the layout of the launch itself, 4 ranks on one node; CP groups are
    # the ranks of equal TP rank ([0, 2] and [1, 3]), one level each.
    ckpt, cp1_tokens = trained
    out = tmp_path / "torchrun"
    p = run(["bash", "launch/torchrun.sh", f"output_dir={out}", f"model.path={ckpt}", "topology.tp_size=2",
                 "topology.intra_size=null", *LAUNCH_ONLY, WITH_BASELINES],
            launch_env(NPROC_PER_NODE="4", MASTER_PORT=str(free_port())))
    res = _check_results(out, p, launcher="torchrun", levels={"intra": 2}, tp=2, tokens=cp1_tokens[:1], baselines=True)
    assert res["launch"]["topology"]["cp_ranks"] == [0, 2] and res["launch"]["num_cp_groups"] == 2


def test_generate_megatron_under_local_sh(tmp_path, trained):
    """The Megatron-LM-style generation entry under the same launcher (MODULE=...): CP 2, prompts
    of 40 and 3 tokens from a file, the 40-token one continued with Megatron's own CP = 1 tokens."""
    ckpt, cp1_tokens = trained
    from megatron_tree.eval.run import random_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(" ".join(map(str, random_prompts(0, 40, 1, 512)[0])) + "\n" + " ".join(map(str, SHORT)) + "\n")
    out = tmp_path / "out.jsonl"
    p = run(["bash", "launch/local.sh", "--sample-input-file", str(prompts), "--sample-output-file", str(out),
                 "--out-seq-length", str(NEW_TOKENS), f"model.path={ckpt}", "topology.intra_size=null"],
                launch_env(NPROC="2", MODULE="megatron_tree.eval.generate"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and rows[1]["prompt_tokens"] == SHORT and rows[1]["text"] is None
    assert [r["tokens"] for r in rows] == cp1_tokens


def _slurm_env(**extra) -> dict:
    # What sbatch would have set for `--nodes=2 --ntasks-per-node=2`.
    extra.setdefault("MASTER_PORT", str(free_port()))
    return launch_env(PATH=FAKE_SLURM + os.pathsep + os.environ["PATH"], SLURM_JOB_NODELIST="fake-node[1-2]",
                SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="77", SLURM_SUBMIT_DIR=ROOT,
                **extra)


def test_slurm_sbatch_runs_a_transformers_qwen2_with_tiers_from_slurm(tmp_path):
    """model.source hf: transformers' own Qwen2ForCausalLM (QKV biases, randomised) from a
    save_pretrained directory, tree attention as its attention backend, CP 4 = 2 x 2 with the
    tiers from SLURM_NTASKS_PER_NODE (intra_size null); test_hf holds it to single-process transformers.
    (model.source random builds its transformers Llama the same way, through the same
    HFTreeModel and models._cp_groups; test_bad_launches and test_ranks_that_decode_different_tokens
    run it.)"""
    from tests.helpers.hf_models import hf_model

    ckpt = tmp_path / "qwen2"
    model = hf_model("qwen2")
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # the biases are in play
    model.save_pretrained(ckpt)
    out = tmp_path / "slurm"
    p = run(["bash", "launch/slurm/eval.sbatch", f"output_dir={out}", "topology.intra_size=null", *LAUNCH_ONLY,
                 WITH_BASELINES, "model.source=hf", f"model.path={ckpt}"], _slurm_env(CONFIG="configs/cpu_tiny_llama.yaml"))
    res = _check_results(out, p, launcher="slurm", levels={"intra": 2, "inter": 2}, source="hf", baselines=True)
    assert res["model"]["class"] == "transformers.Qwen2ForCausalLM" and res["model"]["model_type"] == "qwen2"
    assert p.stderr.count("Loading weights: 100%") <= 1  # rank 0's loading bar only, not one per rank


def test_lm_eval_sbatch_example_line_parses_as_lm_eval_reads_it():
    """The example in launch/slurm/lm_eval.sbatch's header, split by bash as a user pasting it would be, gives
    lm-eval a --metadata it can read; unquoted, bash stripped the JSON's quotes ('{max_seq_lengths:[131072]}')
    and lm-eval's parser refused it."""
    from lm_eval._cli.utils import try_parse_json

    with open(os.path.join(ROOT, "launch", "slurm", "lm_eval.sbatch")) as f:
        lines = [l[1:].strip() for l in f if l.startswith("#  ")]
    start = next(i for i, l in enumerate(lines) if l.startswith("sbatch launch/slurm/lm_eval.sbatch"))
    example = lines[start]
    while example.endswith("\\"):
        start += 1
        example = example[:-1] + " " + lines[start]
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {example}"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    metadata = words[words.index("--metadata") + 1]
    assert try_parse_json(metadata) == {"max_seq_lengths": [131072]}, metadata


def test_slurm_torchrun_sbatch_runs_megatrons_dynamic_engine(tmp_path):
    """eval.engine dynamic under Slurm + torchrun: Megatron-Core's DynamicInferenceEngine over the
    paged KV cache sharded over CP 4 = 2 x 2 (test_megatron_dynamic holds its tokens to Megatron's
    own engine at CP = 1); the paged cache holds the request's blocks spread over the ranks."""
    out = tmp_path / "slurm_torchrun"
    p = run(["bash", "launch/slurm/torchrun.sbatch", f"output_dir={out}", "topology.intra_size=null", *LAUNCH_ONLY,
                 "eval.engine=dynamic", "eval.prefill_method=null"], _slurm_env(GPUS_PER_NODE="2"))
    res = _check_results(out, p, launcher="slurm+torchrun", levels={"intra": 2, "inter": 2}, engine="dynamic")
    for r in res["runs"]:
        # 40 + 4 tokens in blocks of 16 per rank: 3 blocks, one on each of three ranks
        assert sorted(r["kv_blocks_per_rank"]) == [0, 1, 1, 1], r["kv_blocks_per_rank"]


_BAD_RUNS = """
import os, sys
from megatron_tree.eval import main
out, ckpt, plain, stripped, late_out, late_port = sys.argv[1:]
cases = [
    [f"model.path={plain}"],
    [f"model.path={ckpt}", "model.hidden_size=128"],
    [f"model.path={stripped}", "model.intermediate_size=96"],
    ["topology.tp_size=2", "topology.cp_size=3", "topology.intra_size=null"],
    ["topology.cp_size=3", "topology.intra_size=null"],
]
for case in cases:
    rc = main(["--config", "configs/cpu_tiny.yaml", f"output_dir={out}", "topology.timeout_s=30", *case])
    os.write(1, f"exit {rc}\\n".encode())  # one write: four ranks share the pipe, print() can interleave them
# test_bad_launches_fail_on_every_rank's case, found after the process group exists: a port that answers, and
# this rank's stdout/stderr in a file of its own, so the lines above are exactly the checks' lines.
import time
five_done = time.time()
os.environ["MASTER_PORT"] = late_port
log = os.open(os.path.join(late_out, f"rank{os.environ['SLURM_PROCID']}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
os.dup2(log, 1)
os.dup2(log, 2)
os.write(2, f"five cases done at {five_done}\\n".encode())
rc = main(["--config", "configs/cpu_tiny_llama.yaml", f"output_dir={late_out}", "topology.intra_size=4"])
os.write(2, f"exit {rc}\\n".encode())
"""


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, trained):
    """One fake-srun job of 4 ranks that holds both bad-input tests' runs: the five cases refused before any
    process group (test_bad_megatron_inputs_fail_on_every_rank_before_any_collective), then, in the same
    processes, the case found after it exists (test_bad_launches_fail_on_every_rank). Two jobs started eight
    interpreters that import torch and the eval for this; one starts four. Returns the paths, the completed
    process, the seconds until the MASTER_PORT blocker was released, and each rank's log of the last case."""
    ckpt, _ = trained
    root = tmp_path_factory.mktemp("bad_runs")
    plain = root / "plain"
    plain.mkdir()
    (plain / "model.pt").write_bytes(b"not a checkpoint")
    stripped = root / "stripped"  # the same tensors without the training arguments (common.pt)
    shutil.copytree(ckpt / "iter_0000004", stripped)
    (stripped / "common.pt").unlink()
    out = root / "out"
    out.mkdir()
    (out / "results.json").write_text('{"exact": true}')  # an earlier run's
    late = root / "late"
    late.mkdir()
    t0, t0_wall = time.monotonic(), time.time()
    # MASTER_PORT is held by a socket that never answers: a rank that reached init_process_group
    # would fail to start the store (rank 0) or hang connecting to it, not print the checks' line.
    # (The last case's port, given after the five cases, is a free one.)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(1)
        env = _slurm_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(blocker.getsockname()[1]))
        p = run([os.path.join(FAKE_SLURM, "srun"), sys.executable, "-c", _BAD_RUNS, str(out), str(ckpt),
                 str(plain), str(stripped), str(late), str(free_port())], env, timeout=120)
    elapsed = time.monotonic() - t0
    logs = {r: (late / f"rank{r}.log").read_text() if (late / f"rank{r}.log").exists() else None for r in range(4)}
    # when the last rank finished the five cases (seconds since the job started), from the ranks' logs
    done = [float(l.split()[-1]) for log in logs.values() if log for l in log.splitlines()
            if l.startswith("five cases done at ")]
    five = max(done) - t0_wall if len(done) == 4 else None
    return {"out": out, "plain": plain, "stripped": stripped, "late": late, "p": p, "elapsed": elapsed,
            "five_cases_s": five, "logs": logs}


def test_bad_megatron_inputs_fail_on_every_rank_before_any_collective(bad_runs):
    """4 real ranks (fake srun): a path that is not a distributed checkpoint, training arguments
    and tensor shapes that disagree with the config, TP x CP that does not fit the world, a CP size
    that does not divide it (TP 1; test_bad_launches ran it as its own 5-process local.sh launch). Each
    is one line per rank and exit status 2, before any process group exists (a rank that got
    past the checks would wait in rendezvous for the others and time out), and a stale
    results.json from an earlier run is gone."""
    p, out, plain, stripped = bad_runs["p"], bad_runs["out"], bad_runs["plain"], bad_runs["stripped"]
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split().count("exit") == 20 and set(p.stdout.split()) == {"exit", "2"}, p.stdout
    assert "Traceback" not in p.stderr
    needles = [
        f"is not a Megatron distributed checkpoint: expected metadata.json and .metadata",
        "the config disagrees with the training arguments: model.hidden_size=128 but the checkpoint was trained "
        "with hidden_size=64",
        "tensors whose shapes disagree with model.*: decoder.layers.mlp.linear_fc1.weight: (2, 256, 64) "
        "(the config gives (2, 192, 64))",
        "topology.tp_size x topology.cp_size: 2 x 3 = 6 does not fit the launched world of 4",
        "error: topology.cp_size: 3 does not divide the launched world of 4",
    ]
    lines = [l for l in p.stderr.splitlines() if "error:" in l]
    assert len(lines) == 20, p.stderr[-3000:]
    for needle in needles:
        hits = [l for l in lines if needle in l]
        assert sorted(l.split(":")[1].strip() for l in hits) == [f"rank {r}" for r in range(4)], (needle, lines)
    assert str(plain) in p.stderr and str(stripped) in p.stderr  # the messages name the file
    assert not (out / "results.json").exists()
    assert bad_runs["five_cases_s"] is not None, bad_runs["logs"]
    assert bad_runs["five_cases_s"] < 90


def test_bad_launches_fail_on_every_rank(bad_runs):
    # (A CP size that does not divide the launched world, refused on every rank before any collective:
    # test_bad_megatron_inputs_fail_on_every_rank_before_any_collective's fifth case, in its one launch.)
    # A random transformers Llama: an intra-node level wider than the real nodes (2 tasks per node), found
    # after the process group exists: without --kill-on-bad-exit every rank must still exit on
    # its own, none hangs. (Run by bad_runs's job, after the five cases refused before a process group, in
    # the same four fake-srun ranks; each rank's output of this case is its log.)
    p, logs = bad_runs["p"], bad_runs["logs"]
    assert p.returncode == 0, p.stderr[-3000:]  # every rank finished its script: none hung
    for r in range(4):
        assert logs[r] is not None, f"rank {r} never reached the case after the process group: {p.stderr[-3000:]}"
        assert f"rank {r}: error: intra_size 4 disagrees with the real layout" in logs[r], logs[r][-3000:]
        assert logs[r].splitlines()[-1] == "exit 2", logs[r][-3000:]  # main's exit status on this rank
    assert not (bad_runs["late"] / "results.json").exists()
    # A hanging rank would hit the launch's own 120 s limit first; the bound leaves room for start-up
    # on a shared, loaded machine.
    assert bad_runs["elapsed"] < 120


def test_ranks_that_decode_different_tokens_fail_the_run(tmp_path):
    # Rank 1's output head is negated (tests/scripts/eval_rank1_diverges.py): the tokens
    # agreement across ranks must be recorded as false and the job must exit non-zero.
    out = tmp_path / "diverge"
    p = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                 str(free_port()), "tests/scripts/eval_rank1_diverges.py", "--config", "configs/cpu_tiny_llama.yaml",
                 f"output_dir={out}", "eval.context_lengths=[16]", "eval.batch_sizes=[1]",
                 "eval.strategies=[packed]", "eval.decode_steps=2", "eval.warmup_steps=0", "eval.progress=false",
                 "topology.intra_size=null", "wandb.enabled=false", "eval.attention_baselines=false"],
                launch_env(OMP_NUM_THREADS="1"), timeout=240)
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
