"""The eval main job with ``model.source=megatron`` on the installed megatron-core (0.16.1 or 0.19.x).

A checkpoint is written by a short training loop on this release (``tests/helpers/megatron_ckpt.py``:
Megatron-LM's layout, ``dist_checkpointing.save``) with the CP = 1 tokens of Megatron's own
static engine; then ``launch/local.sh`` runs the eval over it at CP 2 with the static and the
dynamic engine. The run must report exactness against Megatron's own model at CP = 1 and decode
the checkpoint's CP = 1 tokens. ``tests/eval/test_launch.py`` covers the launchers at 4 ranks on
0.16.1; this file is what the Python 3.12 lane (``.ci/megatron312.sh``) runs of the eval.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from tests.helpers.launching import free_port, launch_env, run, train_checkpoint

_RELEASE = importlib.metadata.version("megatron-core")
pytestmark = pytest.mark.skipif(
    _RELEASE.startswith("0.16."),
    reason=f"megatron-core {_RELEASE}: tests/eval/test_launch.py runs the eval over a trained checkpoint on this release "
           "(4 ranks, every launcher); this file is the Python 3.12 lane's copy for 0.19",
)
NEW_TOKENS = 5  # the prefill's token + 1 warmup + 3 timed decode steps
ARGS = ["eval.context_lengths=[40]", "eval.batch_sizes=[1]", "eval.strategies=[two_level]", "eval.decode_steps=3",
        "eval.warmup_steps=1", "eval.progress=false", "eval.exactness.sample_rate=1.0", "wandb.enabled=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from megatron_tree.eval.run import random_prompts

    ckpt = tmp_path_factory.mktemp("megatron_ckpt")
    result = tmp_path_factory.mktemp("megatron_ckpt_result") / "result.json"
    prompts = random_prompts(0, 40, 1, 512)  # the eval's prompt for ctx 40, batch 1 (model.seed 0)
    return ckpt, train_checkpoint(ckpt, result, prompts, NEW_TOKENS, timeout=600)["tokens"]


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_eval_of_a_checkpoint_at_cp2_gives_megatrons_cp1_tokens(tmp_path, trained, engine):
    from megatron_tree.integrations.megatron import megatron_version

    ckpt, cp1_tokens = trained
    out = tmp_path / engine
    p = run(["bash", "launch/local.sh", f"output_dir={out}", f"model.path={ckpt}", f"eval.engine={engine}", *ARGS],
             launch_env(OMP_NUM_THREADS="1", NPROC="2", MASTER_PORT=str(free_port())), timeout=600)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    res = json.loads((out / "results.json").read_text())
    assert res["model"]["source"] == "megatron" and res["engine"] == engine
    assert res["launch"]["cp_size"] == 2 and res["model"]["checkpoint"]["iteration"] == 4
    assert res["exact"] is True and res["tokens_match_reference"] is True and res["tokens_agree_across_ranks"]
    for r in res["runs"]:
        assert r["tokens"] == cp1_tokens, (megatron_version(), r["tokens"], cp1_tokens)
