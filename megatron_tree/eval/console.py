"""What the eval's command line shows a person: third-party warnings once, progress bars on a terminal.

Invariant: installed by the entry point (``megatron_tree.eval.main``) for its own process only --
never at package import -- so a program that imports the library keeps its own warning and
logging settings. Warnings raised from megatron_tree's own code pass through untouched; those of
other packages (Megatron-Core's "Apex is not installed" family, Transformer Engine, deprecations)
become one line each, on global rank 0 only, the first time they are seen.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["quiet_third_party", "progress_enabled", "quiet_library_bars", "THIRD_PARTY_LOGGERS"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

THIRD_PARTY_LOGGERS = ("DeepSpeed", "megatron", "megatron.core", "transformers", "torch.distributed", "wandb")
"""Loggers held at WARNING or above by :func:`quiet_third_party` (their INFO chatter is not the eval's)."""


def _family(message: str) -> str:
    """One key per kind of notice: Megatron-Core warns about missing Apex / Transformer Engine from
    several modules with different words; they are one fact."""
    if "Apex" in message or "Transformer Engine" in message:
        return "apex/te"
    return message


def quiet_third_party(rank: int, prog: str = "megatron-tree-eval", stream=None) -> None:
    """Show each third-party warning at most once, as one line, on rank 0; none on the other ranks."""
    seen: set = set()
    out = sys.stderr if stream is None else stream
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(str(filename)).startswith(_PACKAGE_DIR):
            return original(message, category, filename, lineno, file, line)
        if rank != 0:
            return None
        text = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
        key = (category.__name__, _family(text))
        if key in seen:
            return None
        seen.add(key)
        origin = _origin(str(filename))
        if key[1] == "apex/te":
            text = "Transformer Engine / Apex not installed: Megatron-Core uses its torch fallbacks (expected on CPU)"
        out.write(f"{prog}: warning ({origin}, {category.__name__}): {text}\n")
        out.flush()
        return None

    warnings.showwarning = show  # the filters stay Python's (and the user's): show() only shapes what they let through
    for name in THIRD_PARTY_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level < logging.WARNING:
            logger.setLevel(logging.WARNING)
    if rank != 0:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _origin(filename: str) -> str:
    """The package a warning came from (``megatron.core``, ``transformers``, ...), from its file's path."""
    parts = os.path.normpath(filename).split(os.sep)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in parts:
            rest = parts[parts.index(anchor) + 1:]
            return ".".join(p for p in rest[:2] if not p.endswith(".py")) or rest[0]
    return os.path.basename(filename)


def progress_enabled(requested: bool, rank: int, stream=None, out=None) -> bool:
    """Progress bars when asked for, on rank 0, and only in a terminal session: the bars' stream
    (stderr) and stdout both terminals. A saved log (``> log``, ``| tee``), Slurm's output file or a CI
    transcript gets the table and the verdict instead of carriage-return redraws."""
    stream = sys.stderr if stream is None else stream
    out = sys.stdout if out is None else out
    tty = all(bool(getattr(s, "isatty", lambda: False)()) for s in (stream, out))
    return bool(requested) and rank == 0 and tty


def quiet_library_bars() -> None:
    """Outside a terminal session, other libraries' tqdm bars too (transformers' "Loading weights"):
    tqdm takes ``TQDM_DISABLE`` as the default of its ``disable`` argument (tqdm >= 4.66)."""
    if not progress_enabled(True, 0):
        os.environ.setdefault("TQDM_DISABLE", "1")
