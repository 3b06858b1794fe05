"""``python -m megatron_tree.eval.lm_eval``: lm-evaluation-harness's own CLI with the ``megatron_tree`` backend.

Takes lm-eval's own flags (``--model megatron_tree --model_args pretrained=...,cp_size=... --tasks ...
--batch_size ... --output_path ... --log_samples --wandb_args ...``), registers the backend
(``integrations.lm_eval``) and runs ``lm_eval``'s CLI in every process the launcher started
(torchrun, the deepspeed launcher -- its ``--local_rank`` argument is dropped --, ``srun torchrun``:
``launch/slurm/lm_eval.sbatch``). Two things differ from a plain ``lm-eval`` run, both so
that one evaluation is recorded once whatever the world:

* results (and samples) are returned, printed and written by global rank 0 only: lm-eval keeps
  them on every process whose ``lm.rank`` is 0 (all CP peers of DP rank 0);
* ``--wandb_args`` / ``--wandb_config_args`` reach lm-eval's ``WandbLogger`` on global rank 0 only
  (one run); ``WANDB_MODE`` defaults to ``offline``.

A local task's relative ``dataset_kwargs.data_files`` are read relative to its task file
(:func:`resolve_data_files`), so ``--include_path`` tasks run from any working directory (lm-eval
alone reads them relative to the working directory; a path that is not found beside the task file
keeps that meaning).

A run whose one ``--tasks a,b`` names only plain tasks defined under ``--include_path`` indexes that
path alone (:func:`included_tasks_only`): lm-eval's CLI otherwise reads all of its own ~15,000 task
files on every rank before it looks at the include path, about 10 s of CPU per process, for tasks it
will not run. An included task overrides a built-in one of the same name in lm-eval's full index too,
so the tasks that run are the same. Space-separated or repeated ``--tasks``, ``-t``, groups, tags,
patterns, YAML paths and names that are not in the include path take lm-eval's full index, as before.

Bad input exits with status 2 and one line naming the problem, on every rank that sees it: among it
``--apply_chat_template`` (refused before the model loads) and a ``--batch_size`` / ``--max_batch_size`` /
``--device`` given with a value that the same ``model_args`` key contradicts (where both agree, or the flag is
not given, the ``model_args`` value is taken).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from pathlib import Path

__all__ = ["included_tasks_only", "main", "resolve_data_files"]

_RANK0_ONLY_FLAGS = ("--wandb_args", "--wandb_config_args")
_LAUNCHER_FLAGS = ("--local_rank", "--local-rank")
"""What the deepspeed launcher appends to every process's argv (it sets LOCAL_RANK too); not lm-eval's."""


def _global_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _strip_flags(argv: list[str], flags) -> list[str]:
    """argv without ``flags`` and their values (``--flag value`` or ``--flag=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            if not a.startswith("--"):
                continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def _flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name value`` / ``--name=value`` in argv (the last one), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


_LM_EVAL_INPUT_CHECKS = ("lm_eval/config/evaluate_config.py", "lm_eval/_cli/")
"""Where lm-eval checks its CLI input (tasks not found, conflicting flags, a bad ``--config`` file, ``key=value``
lists): an error raised there is bad input, reported in one line."""


def _raised_by_lm_eval_input_check(e: BaseException) -> bool:
    """Whether ``e`` (a ValueError, TypeError or OSError) was raised by lm-eval's own check of its CLI input
    (:data:`_LM_EVAL_INPUT_CHECKS`), judged by the innermost frame of its traceback."""
    if not isinstance(e, (ValueError, TypeError, OSError)) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename).as_posix()
    return any(part in where for part in _LM_EVAL_INPUT_CHECKS)


_MODEL_FLAGS = ("batch_size", "max_batch_size", "device")
"""lm-eval's flags that reach the backend beside ``--model_args``, which may set the same keys."""


def _parse_run(argv: list[str]):
    """lm-eval's own parse of argv's ``run`` flags (abbreviations, ``-a``/``-b``, ``--model_args`` as ``k=v,k=v``, as
    space-separated items or as JSON, repeats merged), or None for an argv it cannot parse (lm-eval reports it)."""
    import argparse
    import io

    from lm_eval._cli.run import Run

    commands = argparse.ArgumentParser(add_help=False).add_subparsers(dest="command")
    Run.create(commands)
    run = commands.choices["run"]
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            ns, _ = run.parse_known_args(argv[1:] if argv[:1] == ["run"] else argv)
    except SystemExit:
        return None
    return ns


def _given_model_flags(ns) -> dict:
    """The :data:`_MODEL_FLAGS` that lm-eval's parse ``ns`` of the command line gives ({} for None)."""
    return {} if ns is None else {k: getattr(ns, k) for k in _MODEL_FLAGS if getattr(ns, k, None) is not None}


def _model_and_args(ns) -> tuple[str | None, dict]:
    """(``--model``, ``model_args``) as lm-eval's ``EvaluatorConfig.from_cli`` will pass them: a ``--config`` YAML's
    values, then the command line's given ones over them (a ``model_args`` string parsed as ``k=v,k=v``). A YAML
    that cannot be read is left to lm-eval's own report."""
    from lm_eval import utils as lm_utils

    merged = {}
    if getattr(ns, "config", None):
        from lm_eval.config.evaluate_config import EvaluatorConfig

        try:
            merged.update(EvaluatorConfig.load_yaml_config(ns.config))
        except (ValueError, TypeError, OSError):
            pass
    merged.update({k: v for k, v in vars(ns).items() if k in ("model", "model_args") and (v or v == 0)})
    args = merged.get("model_args") or {}
    if isinstance(args, str):
        args = lm_utils.simple_parse_args_string(args)
    return merged.get("model"), dict(args)


def _check_model_args(argv: list[str], backend) -> None:
    """Refuse bad ``--model_args`` of this backend before lm-eval indexes its tasks (the same on every rank),
    and a ``model_args`` key that an lm-eval flag given beside it contradicts (the ``model_args`` value would
    win: :meth:`TreeLM.create_from_arg_obj`). The model and its arguments are read as lm-eval reads them
    (:func:`_model_and_args`), in every form its CLI takes."""
    ns = _parse_run(argv)
    if ns is None:
        return
    model, given = _model_and_args(ns)
    if model != backend.BACKEND_NAME:
        return
    args = backend.model_args_from(given)
    for key, value in _given_model_flags(ns).items():
        if key in given and str(given[key]) != str(value):
            raise backend.ModelArgsError(f"model_args {key}={given[key]} and --{key} {value} disagree; give one (a "
                                         f"model_args value wins over the flag)")
    backend.check_checkpoint(args)


def _tasks_flag(argv: list[str]) -> str | None:
    """The one ``--tasks V`` / ``--tasks=V`` of argv when it is the only way argv names tasks, else None: a
    repeated flag, ``-t``, an abbreviation (``--task``) or space-separated names after it (lm-eval takes
    ``nargs="+"`` and adds up repeats) are read by lm-eval's own parser alone."""
    found = []
    for i, a in enumerate(argv):
        name = a.split("=", 1)[0]
        if a.startswith("-t") and not a.startswith("--") or len(name) > 3 and "--tasks".startswith(name):
            found.append(i)
    if len(found) != 1 or argv[found[0]].split("=", 1)[0] != "--tasks":
        return None
    after = found[0] + (1 if "=" in argv[found[0]] else 2)  # the token after its value
    if after < len(argv) and not argv[after].startswith("-"):
        return None  # more names after the first
    return _flag(argv, "--tasks")


def _included_task_names(argv: list[str]) -> list[str] | None:
    """The ``--tasks`` of argv when each is a plain task (not a group, tag, pattern or YAML path) that the
    ``--include_path`` directory defines, else None (the run needs lm-eval's full task index)."""
    include, tasks = _flag(argv, "--include_path"), _tasks_flag(argv)
    if not include or not tasks or not os.path.isdir(include):
        return None
    names = [t.strip() for t in tasks.split(",")]
    if any(set("*?[") & set(n) for n in names):  # lm-eval matches each name as a pattern over the whole index
        return None
    import inspect

    from lm_eval.tasks import TaskManager

    if "include_defaults" not in inspect.signature(TaskManager).parameters:  # an lm-eval without the switch
        return None
    plain = set(TaskManager(include_path=include, include_defaults=False).all_subtasks)
    return names if all(n in plain for n in names) else None


@contextlib.contextmanager
def included_tasks_only(argv: list[str]):
    """While lm-eval's CLI runs ``argv``: a task index of ``--include_path`` alone where every task it names is
    a plain task defined there (:func:`_included_task_names`); otherwise nothing changes. Yields whether the
    index is the include path's alone."""
    import lm_eval.tasks

    if _included_task_names(argv) is None:
        yield False
        return
    full_index = lm_eval.tasks.TaskManager

    class IncludePathIndex(full_index):
        """lm-eval's TaskManager without its built-in tasks (the CLI imports the name from lm_eval.tasks)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    lm_eval.tasks.TaskManager = IncludePathIndex
    try:
        yield True
    finally:
        lm_eval.tasks.TaskManager = full_index


def resolve_data_files(cfg: dict, task_dir) -> dict:
    """``cfg`` (a task YAML's dict) with each relative ``dataset_kwargs.data_files`` path that exists
    beside the task file (in ``task_dir``) made absolute; other paths (absolute, URLs, not found
    there) unchanged. ``data_files`` may be a string, a list, or a split -> string/list mapping."""
    kwargs = cfg.get("dataset_kwargs") if isinstance(cfg, dict) else None
    if not isinstance(kwargs, dict) or kwargs.get("data_files") is None:
        return cfg

    def fix(p):
        if isinstance(p, list):
            return [fix(x) for x in p]
        if not isinstance(p, str) or os.path.isabs(p) or "://" in p:
            return p
        beside = Path(task_dir) / p
        return str(beside) if beside.exists() else p

    files = kwargs["data_files"]
    files = {k: fix(v) for k, v in files.items()} if isinstance(files, dict) else fix(files)
    return {**cfg, "dataset_kwargs": {**kwargs, "data_files": files}}


@contextlib.contextmanager
def _task_files_beside_yaml():
    """While lm-eval reads task YAMLs, resolve their data files relative to each YAML (lm-eval 0.4.x's
    ``tasks._yaml_loader.load_yaml``, imported by name into the modules that read tasks)."""
    import importlib

    patched = []
    try:
        loader = importlib.import_module("lm_eval.tasks._yaml_loader")
    except ImportError:  # another lm-eval layout: its own cwd-relative reading applies
        yield
        return
    original = loader.load_yaml

    @functools.wraps(original)
    def load_yaml(path, *args, **kwargs):
        return resolve_data_files(original(path, *args, **kwargs), Path(path).expanduser().resolve().parent)

    for name, module in list(sys.modules.items()):
        if name.startswith("lm_eval") and getattr(module, "load_yaml", None) is original:
            module.load_yaml = load_yaml
            patched.append(module)
    try:
        yield
    finally:
        for module in patched:
            module.load_yaml = original


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on ``argv`` (default ``sys.argv[1:]``) with the backend registered; returns 0."""
    argv = _strip_flags(list(sys.argv[1:] if argv is None else argv), _LAUNCHER_FLAGS)
    os.environ.setdefault("WANDB_MODE", "offline")
    from ..utils.extras import require

    lm_eval = require("lmeval", "megatron-tree-lm-eval")
    import lm_eval.models  # noqa: F401 -- lm-eval's own backends stay available beside ours
    from lm_eval.__main__ import cli_evaluate

    from ..integrations import lm_eval as backend

    if _global_rank() != 0:
        argv = _strip_flags(argv, _RANK0_ONLY_FLAGS)
    original = lm_eval.simple_evaluate

    @functools.wraps(original)
    def simple_evaluate(*args, **kwargs):
        if kwargs.get("model") == backend.BACKEND_NAME and kwargs.get("apply_chat_template"):
            raise backend.ModelArgsError(backend.CHAT_TEMPLATE_REFUSED)  # before the model loads
        results = original(*args, **kwargs)
        return results if _global_rank() == 0 else None

    saved_argv = sys.argv
    sys.argv = ["lm-eval", *argv]
    lm_eval.simple_evaluate = simple_evaluate
    try:
        _check_model_args(argv, backend)
        with included_tasks_only(argv), _task_files_beside_yaml():
            cli_evaluate()
    except (backend.ModelArgsError, backend.RequestError) as e:
        print(f"megatron_tree.eval.lm_eval: rank {_global_rank()}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e
    except (ValueError, TypeError, OSError) as e:
        if not _raised_by_lm_eval_input_check(e):
            raise
        # lm-eval's own check of its flags (e.g. "Tasks not found: x"): one line, not a traceback per rank
        print(f"megatron_tree.eval.lm_eval: rank {_global_rank()}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from e
    finally:
        lm_eval.simple_evaluate = original
        sys.argv = saved_argv
    return 0


if __name__ == "__main__":
    sys.exit(main())
