"""What the tests that start real launchers share: a free port (below the ephemeral range), a launch environment cleaned of the
calling process's rank variables, a bounded run from the repo root, and a checkpoint written by a
short Megatron training loop (``tests/helpers/megatron_ckpt.py``) with Megatron's own CP = 1 tokens."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# The first port free_port hands out; the ports below the kernel's ephemeral range are taken only by
# explicit binds, never by a port-0 bind (gloo's listeners, a test's silent socket) or an outgoing
# connection. A port picked with bind(0) and released could be taken by either before the launcher
# bound it: a listener in another test that never answers made a torchrun agent wait out its 60 s
# connect timeout (CI, stop 43).
_FIRST_PORT = 15000


def free_port() -> int:
    """A port no other caller of free_port on this machine holds, below the ephemeral range.

    A counter in a file under the temp directory, advanced under a lock, gives each caller (every
    xdist worker, every concurrent test run) its own port; one that cannot be bound now is skipped."""
    hi = _ephemeral_low()
    span = hi - _FIRST_PORT
    if span < 100:  # an unusual ip_local_port_range: fall back to the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    # one counter per user: a file another user made (mode 0644) cannot be opened for writing
    with open(os.path.join(tempfile.gettempdir(), f"megatron_tree_test_ports.{os.getuid()}"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        try:  # (a file left empty or corrupt: start anywhere; str.isdigit also passes "²", which int refuses)
            nxt = int(f.read())
        except ValueError:
            nxt = -1
        if nxt < 0:
            nxt = os.getpid() % span
        for i in range(span):
            port = _FIRST_PORT + (nxt + i) % span
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
            f.seek(0)
            f.truncate()
            f.write(str((nxt + i + 1) % span))
            f.flush()
            return port
    raise RuntimeError(f"no free TCP port in {_FIRST_PORT}-{hi - 1}")


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
