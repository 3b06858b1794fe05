"""What the tests that start real launchers share: a free port, a launch environment cleaned of the
calling process's rank variables, a bounded run from the repo root, and a checkpoint written by a
short Megatron training loop (``tests/helpers/megatron_ckpt.py``) with Megatron's own CP = 1 tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(**extra) -> dict:
    """The environment a launcher starts from: no SLURM_/rank variables of the test process; this
    checkout first on PYTHONPATH (the Python 3.12 lane runs it without an editable install)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC"))}
    env.update({"PYTHON": sys.executable, "CONFIG": "configs/cpu_tiny.yaml",
                "PYTHONPATH": os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep), **extra})
    return env


def run(cmd, env, timeout=300):
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def train_checkpoint(ckpt, result, prompts, new_tokens, *, timeout, shape: dict | None = None) -> dict:
    """Train a few steps at CP = 1 and save to ``ckpt`` (Megatron-LM's ``--save`` layout); returns
    ``tests/helpers/megatron_ckpt.py``'s result: the losses, the core attention, Megatron's CP = 1 tokens.
    shape: changes to its default model shape (``vocab_size``, ``max_position_embeddings``)."""
    p = run([sys.executable, "tests/helpers/megatron_ckpt.py", str(ckpt), json.dumps(prompts), str(new_tokens), str(result),
             *([json.dumps(shape)] if shape else [])],
            launch_env(OMP_NUM_THREADS="1"), timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(result.read_text())
    assert out["losses"][-1] < out["losses"][0], out["losses"]  # the optimizer steps changed the weights
    assert sorted(os.listdir(ckpt)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]
    return out
