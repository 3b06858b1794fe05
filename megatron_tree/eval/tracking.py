"""Experiment tracking: wandb on rank 0 only, a no-op object with the same methods elsewhere.

Invariant: exactly one process per run talks to wandb, and every wandb directory (runs,
cache, artifacts staging, settings) lives inside the run's output directory, so a run
never writes under ``~`` and never needs the network unless ``mode: online`` is asked for.
Callers do not branch on the rank: they call the same methods on whatever
:func:`make_tracker` returns (docs/design.md, "How the code is written", nanochat's ``DummyWandb``).

wandb is imported lazily inside :class:`WandbTracker`, so importing this module is cheap
and has no side effects. A ds_config's ``wandb`` section is read by the one reader,
:func:`megatron_tree.integrations.deepspeed.wandb_settings`, with DeepSpeed's own defaults.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .config import ConfigError, WandbConfig
from ..integrations.deepspeed import wandb_settings
from ..utils.extras import require

__all__ = ["NullTracker", "WandbTracker", "make_tracker", "resolve_wandb_settings", "env_disabled"]

DEFAULT_PROJECT = "megatron-tree"


class NullTracker:
    """What ranks other than 0 (and runs with wandb disabled) get: every call does nothing."""

    run_dir: str | None = None

    def log(self, metrics: dict, step: int | None = None) -> None:
        pass

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        pass

    def image(self, key: str, path: str) -> None:
        pass

    def summary(self, values: dict) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass


def _ds_wandb(path: str):
    """The ds_config's ``wandb`` section (``WandbSettings``), or a ConfigError naming ``wandb.ds_config``."""
    try:
        return wandb_settings(path)
    except FileNotFoundError:
        raise ConfigError(f"wandb.ds_config: file {path!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"wandb.ds_config: {path!r} is not valid JSON: {e}") from None
    except ValueError as e:
        raise ConfigError(f"wandb.ds_config: {path!r}: {e}") from None


def env_disabled(environ=None) -> str | None:
    """The environment variable that turns wandb off, as wandb and transformers read it (``WANDB_MODE=disabled``,
    or the older ``WANDB_DISABLED=true``), in words (``"WANDB_MODE=disabled"``); None when none does.

    It wins over the YAML: a user who switched wandb off for every tool expects no run, and no files.
    (An inherited ``WANDB_MODE=online`` does not: the YAML's ``mode`` decides between offline and online.)"""
    environ = os.environ if environ is None else environ
    mode = environ.get("WANDB_MODE", "").strip()
    if mode.lower() == "disabled":
        return f"WANDB_MODE={mode}"
    flag = environ.get("WANDB_DISABLED", "").strip()
    if flag.lower() in ("true", "1", "yes"):
        return f"WANDB_DISABLED={flag}"
    return None


def resolve_wandb_settings(cfg: WandbConfig, default_name: str) -> dict:
    """Project/entity/group/tags/name/enabled: YAML first, then the ds_config's ``wandb`` section.

    The section means what it means to DeepSpeed (``integrations.deepspeed.wandb_settings``,
    DeepSpeed's ``WandbConfig`` defaults): wandb is on only where it says ``enabled: true``,
    its project defaults to ``deepspeed``, ``team`` is the entity. A field set in the YAML
    always wins over it; without a ds_config the YAML alone decides. ``WANDB_MODE=disabled`` (or
    ``WANDB_DISABLED=true``) in the environment turns it off whatever the YAML says (:func:`env_disabled`).
    """
    ds = _ds_wandb(cfg.ds_config) if cfg.ds_config else None
    return {
        "enabled": cfg.enabled and (ds is None or ds.enabled) and env_disabled() is None,
        "project": cfg.project or (ds.project if ds is not None else DEFAULT_PROJECT),
        "entity": cfg.entity or (ds.entity if ds is not None else None),
        "group": cfg.group or (ds.group if ds is not None else None),
        "tags": list(cfg.tags),
        "name": cfg.name or default_name,
    }


class WandbTracker:
    """A wandb run whose files all live under ``<output_dir>/wandb``."""

    def __init__(self, cfg: WandbConfig, settings: dict, output_dir: str, config: dict):
        root = Path(output_dir).resolve() / "wandb"
        self.root = root
        dirs = {"WANDB_DIR": root, "WANDB_CACHE_DIR": root / "cache",
                "WANDB_DATA_DIR": root / "data", "WANDB_CONFIG_DIR": root / "config"}
        for var, d in dirs.items():
            d.mkdir(parents=True, exist_ok=True)
            os.environ[var] = str(d)
        # The YAML's mode wins over an inherited WANDB_MODE: an offline default must stay offline.
        os.environ["WANDB_MODE"] = cfg.mode
        os.environ.setdefault("WANDB_SILENT", "true")
        wandb = require("wandb", "wandb tracking (tracking.mode online or offline)")

        self._wandb = wandb
        self.run = wandb.init(
            project=settings["project"], entity=settings["entity"], group=settings["group"],
            tags=settings["tags"] or None, name=settings["name"], config=config,
            dir=str(root), mode=cfg.mode, reinit="finish_previous",
        )
        # run.dir is <run dir>/files; the run directory holds run-<id>.wandb
        self.run_dir = str(Path(self.run.dir).parent)

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.run.log(metrics, step=step)

    def table(self, key: str, columns: list[str], rows: list[list]) -> None:
        self.run.log({key: self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])})

    def image(self, key: str, path: str) -> None:
        self.run.log({key: self._wandb.Image(path)})

    def summary(self, values: dict) -> None:
        for k, v in values.items():
            self.run.summary[k] = v

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
        # run.finish() can return before wandb's service has written the run's last records
        # (seen offline on a loaded machine: the summary missing from run-<id>.wandb right
        # after the eval returned); teardown waits for it, so the run file is complete when
        # the eval prints its path.
        self._wandb.teardown()
        remove_empty_dirs(self.root)


def remove_empty_dirs(root: Path) -> list[str]:
    """Remove every empty directory under ``root`` (deepest first; ``root`` too if it ends up empty):
    wandb creates config, staging and ``tmp/code`` folders it may never fill. Files are never touched.
    Returns the removed paths."""
    removed = []
    root = Path(root)
    if not root.is_dir():
        return removed
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -len(Path(w[0]).parts)):
        try:
            if not any(os.scandir(dirpath)):
                os.rmdir(dirpath)
                removed.append(dirpath)
        except OSError:  # in use or not ours to remove: leave it
            pass
    return removed


def make_tracker(cfg: WandbConfig, *, rank: int, output_dir: str, config: dict, default_name: str):
    """A :class:`WandbTracker` on global rank 0 when enabled, else a :class:`NullTracker`.

    Every rank calls this (the ds_config is read, and so validated, everywhere).
    """
    settings = resolve_wandb_settings(cfg, default_name)
    if rank != 0 or not settings["enabled"]:
        return NullTracker()
    return WandbTracker(cfg, settings, output_dir, config)
