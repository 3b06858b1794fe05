"""DeepSpeed integration: the real launcher, init without the shm-op compile, ds_config's wandb.

One launcher run (``deepspeed --num_gpus 4``, 4 CPU processes, gloo): a two-level tree
decode checked against a single-process ``flash_decode`` here. It runs with a fresh
``TORCH_EXTENSIONS_DIR`` that must stay empty: no shared-memory op is compiled
(``init_distributed(cpu_shm_op=False)``), so CI never pays DeepSpeed's 80-100 s g++ build.
``deepspeed.initialize`` with ``MegatronMPU`` over Megatron's groups is checked in
``test_megatron.py``, inside the 4-rank run that already pays megatron-core's import.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ds_tree_decode.py"
sys.path.insert(0, str(SCRIPT.parent))

import ds_tree_decode  # noqa: E402

from megatron_tree import flash_decode  # noqa: E402


@pytest.fixture(scope="module")
def launcher_run(tmp_path_factory):
    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH (pip install deepspeed==0.19.8)")
    tmp = tmp_path_factory.mktemp("ds")
    ds_config = tmp / "ds_config.json"
    ds_config.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1,
        "wandb": {"enabled": True, "project": "tree-eval", "team": "zyphra-lab", "group": "cp4"},
    }))
    ext_dir = tmp / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [
        "deepspeed", "--num_gpus", "4", "--master_port", str(29600 + os.getpid() % 300), str(SCRIPT),
        "--out", str(tmp / "out"), "--intra-size", "2", "--strategy", "two_level",
        "--ds-config", str(ds_config),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"deepspeed launcher failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    result = json.loads((tmp / "out" / "result.json").read_text())
    out = torch.load(tmp / "out" / "out.pt")
    return result, out, ext_dir


def test_launcher_tree_decode_matches_single_process(launcher_run):
    result, out, _ = launcher_run
    assert result["world_size"] == 4 and result["local_size"] == "4" and result["backend"] == "gloo"
    assert result["levels"] == [["intra", 2], ["inter", 2]]
    assert result["collectives"] == {"intra": 2, "inter": 2}  # two_level: packed merge per level
    assert result["ranks_agree"]
    q, k, v, seqlens = ds_tree_decode.make_inputs()
    expected, _ = flash_decode(q, k, v, cache_seqlens=seqlens, backend="torch")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_no_shm_op_compiled(launcher_run):
    ext_dir = launcher_run[2]
    built = list(ext_dir.rglob("*.so")) if ext_dir.exists() else []
    assert built == [], f"DeepSpeed compiled ops during the run: {built}"


def test_script_reads_wandb_section(launcher_run):
    assert launcher_run[0]["wandb"] == {"enabled": True, "project": "tree-eval", "entity": "zyphra-lab", "group": "cp4"}


def test_wandb_settings_defaults_and_errors(tmp_path):
    from megatron_tree.integrations.deepspeed import WandbSettings, wandb_settings

    assert wandb_settings({}) == WandbSettings(enabled=False, project="deepspeed", entity=None, group=None)
    path = tmp_path / "c.yaml"
    path.write_text("wandb:\n  enabled: true\n  project: p\n")
    assert wandb_settings(path) == WandbSettings(True, "p", None, None)
    with pytest.raises(ValueError, match="unknown key.*'entity'"):
        wandb_settings({"wandb": {"entity": "x"}})
    with pytest.raises(FileNotFoundError):
        wandb_settings(tmp_path / "missing.json")
    # a key written twice is refused, naming it (DeepSpeed's own JSON reader refuses it too), where
    # plain json/yaml would keep the last section silently
    path.write_text("wandb:\n  enabled: true\nwandb:\n  project: p\n")
    with pytest.raises(ValueError, match=r"c.yaml: duplicate key 'wandb' at line 3 \(first at line 1\)"):
        wandb_settings(path)
    js = tmp_path / "ds.json"
    js.write_text('{"wandb": {"enabled": true, "enabled": false}}')
    with pytest.raises(ValueError, match="ds.json: duplicate key 'enabled'"):
        wandb_settings(js)


def test_wandb_settings_defaults_are_deepspeeds_own():
    """The one reader of a ds_config's wandb section takes DeepSpeed's WandbConfig defaults."""
    from deepspeed.monitor.config import WandbConfig

    from megatron_tree.integrations.deepspeed import wandb_settings

    ds = WandbConfig()
    assert wandb_settings({"wandb": {}}) == wandb_settings({})
    got = wandb_settings({})
    assert (got.enabled, got.project, got.entity, got.group) == (ds.enabled, ds.project, ds.team, ds.group)


def test_init_distributed_without_launcher_fails_loudly():
    from megatron_tree.integrations.deepspeed import init_distributed

    with pytest.raises(RuntimeError, match="no launcher environment.*RANK"):
        init_distributed(env={})
