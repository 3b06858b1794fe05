"""Optional frameworks and the extra that installs each: a missing one is an ImportError naming the extra.

The core of the package (the functional API, the caches, the generation loop) needs torch, triton
and numpy only. Each framework it integrates with comes with an extra of ``setup.py``; the module
that needs a framework calls :func:`require` before importing it, so a user who never installed
that extra reads which one to install instead of a bare ``No module named ...``.
"""

from __future__ import annotations

import importlib

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
