"""Optional frameworks and the extra that installs each: a missing one is an ImportError naming the extra.

The core of the package (the functional API, the caches, the generation loop) needs torch, triton
and numpy only. Each framework it integrates with comes with an extra of ``setup.py``; the module
that needs a framework calls :func:`require` before importing it, so a user who never installed
that extra reads which one to install instead of a bare ``No module named ...``.
"""

from __future__ import annotations

import importlib
import importlib.util

EXTRAS = {
    # extra: (the module imported, the distribution(s) the extra installs)
    "megatron": ("megatron.core", "megatron-core"),
    "deepspeed": ("deepspeed", "deepspeed"),
    "hf": ("transformers", "transformers and safetensors"),
    "lmeval": ("lm_eval", "lm-eval[ruler]"),
    "wandb": ("wandb", "wandb"),
    "plot": ("matplotlib", "matplotlib"),
}


def require(extra: str, what: str):
    """Import and return the framework module of ``extra``; ``what`` names the part of megatron_tree that needs it.

    Raises ImportError: ``<what> needs <distribution>: pip install 'megatron_tree[<extra>]' (importing
    <module> failed: <the original error>)``.
    """
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; the extras are {sorted(EXTRAS)}")
    module, dist = EXTRAS[extra]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{what} needs {dist}: pip install 'megatron_tree[{extra}]' (importing {module} "
                          f"failed: {e})") from e


def installed(module: str) -> bool:
    """Whether ``module`` (dotted) can be found, without importing it (its parent packages are imported).

    A presence check, not an import: importing megatron.core, deepspeed or wandb costs seconds of CPU per
    process, which a run that then fails on a bad path or config would spend for nothing. An installed
    framework that fails to import is reported where it is first imported (:func:`require`)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not import; a module without a spec
        return False


def missing(needs: dict) -> dict:
    """The entries of ``needs`` (extra -> why it is needed) whose framework is not installed: extra -> why."""
    out = {}
    for extra, why in needs.items():
        if extra not in EXTRAS:
            raise ValueError(f"unknown extra {extra!r}; the extras are {sorted(EXTRAS)}")
        if not installed(EXTRAS[extra][0]):
            out[extra] = why
    return out


def require_all(needs: dict, what: str, extra: str) -> None:
    """Check every framework of ``needs`` (extra -> why it is needed) at once, before any of them is used.

    Raises one ImportError naming the extra that installs them all (``extra``), e.g. ``megatron-tree-eval
    needs megatron-core (model.source megatron) and matplotlib (the latency plot), which are not installed:
    pip install 'megatron_tree[eval]'``.
    """
    gone = missing(needs)
    if gone:
        listed = " and ".join(f"{EXTRAS[x][1]} ({why})" for x, why in gone.items())
        raise ImportError(f"{what} needs {listed}, which {'is' if len(gone) == 1 else 'are'} not installed: "
                          f"pip install 'megatron_tree[{extra}]'")
