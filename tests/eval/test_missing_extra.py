"""``megatron-tree-eval`` in an environment without the eval extra: one line naming ``[eval]``, exit 2.

A real subprocess runs the console entry point (``megatron_tree.eval:main``) with the frameworks'
imports made to fail (``sys.modules[name] = None``: ``import name`` raises ImportError, as when
the distribution is not installed). Before the check, the run got as far as building the model and
every rank printed a traceback ending in ``pip install 'megatron_tree[megatron]'`` -- the narrower
extra, which leaves wandb and matplotlib still missing for the next try.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(blocked: tuple, config: str, tmp_path, *overrides: str, world: int | None = None):
    script = textwrap.dedent(f"""
        import sys
        for name in {blocked!r}:
            sys.modules[name] = None  # `import name` now raises ImportError
        from megatron_tree.eval import main
        sys.exit(main(["--config", {config!r}, "output_dir={tmp_path / 'out'}", *{list(overrides)!r}]))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                              "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    if world is not None:
        env["WORLD_SIZE"] = str(world)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)


@pytest.mark.parametrize("blocked, config, overrides, want", [
    (("megatron", "deepspeed", "transformers", "safetensors", "wandb", "matplotlib"), "configs/cpu_tiny.yaml", (),
     "megatron-core (model.source megatron) and wandb (wandb.enabled) and matplotlib (the decode latency plot), "
     "which are not installed"),
    (("transformers",), "configs/cpu_tiny_llama.yaml", ("wandb.enabled=false",),
     "transformers and safetensors (model.source random), which is not installed"),
])
def test_missing_eval_extra_is_one_line_naming_it(blocked, config, overrides, want, tmp_path):
    proc = _run(blocked, config, tmp_path, *overrides)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert lines == [f"megatron-tree-eval: rank 0: error: megatron-tree-eval needs {want}: "
                     "pip install 'megatron_tree[eval]'"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not os.path.exists(tmp_path / "out" / "results.json")


def test_sizes_that_cannot_fit_the_launch_fail_before_the_frameworks_are_imported(tmp_path):
    """A CP size that does not divide the launched world is refused before any framework is imported (a second per
    rank, not the ~5 s of importing megatron.core, wandb and matplotlib first): with them all missing, that is the
    error, not the missing extra."""
    blocked = ("megatron", "deepspeed", "transformers", "safetensors", "wandb", "matplotlib")
    proc = _run(blocked, "configs/cpu_tiny.yaml", tmp_path, "topology.cp_size=3", "topology.intra_size=null", world=4)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["megatron-tree-eval: rank 0: error: topology.cp_size: 3 does not divide the launched world of 4 "
                     "rank(s); expected a divisor of 4"], proc.stderr[-3000:]
