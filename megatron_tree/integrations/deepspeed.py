"""DeepSpeed integration: launcher-driven initialisation, an mpu over Megatron's groups, ds_config's wandb.

Invariant: DeepSpeed only sets up communication and reads its config here; the tree merge
itself always runs on ``torch.distributed`` groups held by :class:`~megatron_tree.TreeGroups`
(DeepSpeed's comm wraps the same process groups). The mpu adapter maps DeepSpeed's names
onto Megatron's groups without building new ones, so ``deepspeed.initialize(mpu=...)``
sees exactly Megatron's layout: its *sequence-parallel* group is Megatron's CP group,
its *data-parallel* group is Megatron's DP group (without CP) and its
*sequence-data-parallel* group (where gradients are reduced) is Megatron's DP x CP group.

Why it lives here: DeepSpeed is optional; nothing else in the package imports it (the
run config's tracking reads a ds_config's ``wandb`` section through :func:`wandb_settings`,
the one reader of it, which needs no DeepSpeed).

On CPU, ``deepspeed.init_distributed`` would compile DeepSpeed's shared-memory collective
op with g++ on first use (80-100 s per machine). :func:`init_distributed` skips that op by
default (``cpu_shm_op=False``): tree decode's collectives go through ``torch.distributed``
groups, not ``deepspeed.comm``'s shm fast path, so the op buys nothing here; DeepSpeed
itself treats an op marked incompatible in ``deepspeed.ops.__compatible_ops__`` as absent
and falls back to plain gloo. ``cpu_shm_op=True`` keeps DeepSpeed's default (compile once,
cached in ``$TORCH_EXTENSIONS_DIR``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from ..utils.extras import require

__all__ = ["init_distributed", "MegatronMPU", "WandbSettings", "wandb_settings", "load_ds_config"]

log = logging.getLogger("megatron_tree.integrations")

SHM_OP = "deepspeed_shm_comm"
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(
    *,
    dist_backend: str | None = None,
    timeout_s: float = 1800.0,
    cpu_shm_op: bool = False,
    env=None,
) -> str:
    """Initialise ``torch.distributed`` through ``deepspeed.init_distributed``; returns the backend.

    Started by the deepspeed launcher (``deepspeed --num_gpus N script.py``), the launcher's
    ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*`` are used; the backend is the
    accelerator's (NCCL on CUDA, gloo on CPU) unless ``dist_backend`` says otherwise. A
    process group that already exists is adopted, not recreated. Raises ``RuntimeError``
    naming the missing variables when neither a group nor a launcher environment exists
    (no silent single-process fallback).
    """
    deepspeed = require("deepspeed", "megatron_tree.integrations.deepspeed")
    from deepspeed.accelerator import get_accelerator

    env = os.environ if env is None else env
    if not dist.is_initialized():
        missing = [v for v in LAUNCHER_VARS if v not in env]
        if missing:
            raise RuntimeError(
                f"init_distributed: no process group and no launcher environment (missing {missing}); start the "
                "script with `deepspeed --num_gpus N`, torchrun or srun"
            )
    accel = get_accelerator()
    backend = dist_backend or accel.communication_backend_name()
    if accel.device_name() == "cpu" and not cpu_shm_op:
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__[SHM_OP] = False
    deepspeed.init_distributed(
        dist_backend=backend, auto_mpi_discovery=False, timeout=datetime.timedelta(seconds=timeout_s),
        verbose=False,
    )
    log.info(
        "deepspeed %s: rank %d/%d backend=%s (cpu shm op %s)", deepspeed.__version__, dist.get_rank(),
        dist.get_world_size(), backend, "on" if cpu_shm_op else "off",
    )
    return backend


class MegatronMPU:
    """DeepSpeed's ``mpu`` protocol over Megatron-Core's process groups.

    pg_collection: a ``ProcessGroupCollection`` with ``tp``, ``pp``, ``mp``, ``cp``, ``dp``,
        ``dp_cp``; ``None`` takes them from ``megatron.core.parallel_state`` (the only place
        this package reads it). Sequence-parallel in DeepSpeed's sense = Megatron's CP.
    """

    def __init__(self, pg_collection=None):
        if pg_collection is None:
            from megatron.core import parallel_state as ps

            if not ps.model_parallel_is_initialized():
                raise RuntimeError("MegatronMPU: megatron.core.parallel_state is not initialised and no pg_collection given")
            self._tp = ps.get_tensor_model_parallel_group()
            self._pp = ps.get_pipeline_model_parallel_group()
            self._mp = ps.get_model_parallel_group()
            self._cp = ps.get_context_parallel_group()
            self._dp = ps.get_data_parallel_group()
            self._dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        else:
            names = ("tp", "pp", "mp", "cp", "dp", "dp_cp")
            missing = [n for n in names if getattr(pg_collection, n, None) is None]
            if missing:
                raise ValueError(f"MegatronMPU: pg_collection lacks process groups {missing}")
            self._tp, self._pp, self._mp, self._cp, self._dp, self._dp_cp = (getattr(pg_collection, n) for n in names)

    @staticmethod
    def _size(g) -> int:
        return dist.get_world_size(g)

    @staticmethod
    def _rank(g) -> int:
        return dist.get_rank(g)

    # model parallel = tensor x pipeline (Megatron's "model parallel group")
    def get_model_parallel_group(self):
        return self._mp

    def get_model_parallel_rank(self) -> int:
        return self._rank(self._mp)

    def get_model_parallel_world_size(self) -> int:
        return self._size(self._mp)

    def get_tensor_model_parallel_group(self):
        return self._tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank(self._tp)

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._size(self._tp)

    def get_tensor_model_parallel_src_rank(self) -> int:
        return dist.get_process_group_ranks(self._tp)[0]

    def get_pipeline_model_parallel_group(self):
        return self._pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._rank(self._pp)

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._size(self._pp)

    # data parallel without CP
    def get_data_parallel_group(self):
        return self._dp

    def get_data_parallel_rank(self) -> int:
        return self._rank(self._dp)

    def get_data_parallel_world_size(self) -> int:
        return self._size(self._dp)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(self._dp)

    # sequence parallel = Megatron's context parallel
    def get_sequence_parallel_group(self):
        return self._cp

    def get_sequence_parallel_rank(self) -> int:
        return self._rank(self._cp)

    def get_sequence_parallel_world_size(self) -> int:
        return self._size(self._cp)

    # sequence x data parallel = Megatron's DP x CP group (gradient reduction)
    def get_sequence_data_parallel_group(self):
        return self._dp_cp

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank(self._dp_cp)

    def get_sequence_data_parallel_world_size(self) -> int:
        return self._size(self._dp_cp)


@dataclass(frozen=True)
class WandbSettings:
    """The ``wandb`` section of a ds_config, in wandb.init's terms."""

    enabled: bool
    """``wandb.enabled`` (DeepSpeed's default: false)."""
    project: str
    """``wandb.project`` (DeepSpeed's default: ``"deepspeed"``)."""
    entity: str | None
    """``wandb.team`` (DeepSpeed's name for wandb's entity)."""
    group: str | None
    """``wandb.group``: runs grouped together in the UI."""


_WANDB_KEYS = {"enabled", "project", "team", "group"}


def _unique_keys(pairs: list, path) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise ValueError(f"ds_config {path}: duplicate key {key!r} in one JSON object; JSON readers keep "
                             "only the last (DeepSpeed's own refuses it), so each key may appear once")
        seen.add(key)
    return dict(pairs)


def load_ds_config(ds_config) -> dict:
    """A ds_config as a dict: a dict (returned as is), or a path to a JSON (or YAML) file."""
    if isinstance(ds_config, dict):
        return ds_config
    path = Path(ds_config)
    if not path.is_file():
        raise FileNotFoundError(f"ds_config {path} does not exist")
    text = path.read_text()
    # A key written twice is an error naming it, as DeepSpeed's own reader makes it for JSON
    # (deepspeed.runtime.config's object_pairs_hook); plain json/yaml would keep the last silently.
    if path.suffix in (".yaml", ".yml"):
        from ..utils import yaml_files

        try:
            data = yaml_files.load(text)
        except yaml_files.DuplicateKeyError as e:
            raise ValueError(f"ds_config {path}: {e}") from None
    else:
        data = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, path))
    if not isinstance(data, dict):
        raise ValueError(f"ds_config {path} must hold a mapping, got {type(data).__name__}")
    return data


def wandb_settings(ds_config) -> WandbSettings:
    """Read the ``wandb`` section of a ds_config (dict or path) with DeepSpeed's defaults.

    DeepSpeed's ``WandbConfig`` (deepspeed 0.19, ``deepspeed/monitor/config.py``): ``enabled``
    false, ``project`` ``"deepspeed"``, ``team`` and ``group`` unset -- so a section without
    ``enabled``, or no section, means wandb disabled. An unknown key in the section is an
    error naming it (DeepSpeed's own config would reject it too). The one reader of the
    section: the eval's tracking (``tracking.resolve_wandb_settings``) uses it too.
    """
    cfg = load_ds_config(ds_config)
    section = cfg.get("wandb") or {}
    if not isinstance(section, dict):
        raise ValueError(f"ds_config 'wandb' must be a mapping, got {type(section).__name__}")
    unknown = sorted(set(section) - _WANDB_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in ds_config 'wandb'; expected some of {sorted(_WANDB_KEYS)}")
    return WandbSettings(
        enabled=bool(section.get("enabled", False)),
        project=str(section.get("project", "deepspeed")),
        entity=section.get("team"),
        group=section.get("group"),
    )
