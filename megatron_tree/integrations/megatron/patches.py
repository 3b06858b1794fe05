"""Version-pinned patches for megatron-core where it offers no slot: apply, check, revert.

Invariant: every patch lives as a unified diff in ``patches/<package>/<version>/`` whose
header (``# key: value`` lines) says which file and function it changes and the sha256 of
both as released. The same header drives two ways of applying it, which are always
idempotent (a second apply changes nothing), logged, reversible, and refuse any other
megatron-core version or a drifted source with an error saying what was found and what
was expected:

* **runtime** (:func:`apply_runtime`, what the integration uses): the target function in
  the *imported* module is replaced by :data:`RUNTIME` 's implementation of the same
  change, carrying a marker (``_megatron_tree_patch``) and the original in
  ``__wrapped__``. Installed files are never touched, so other processes are unaffected.
* **files** (``python -m megatron_tree.integrations.patches apply|check|revert --root DIR``):
  ``git apply`` on a source tree (a copy of site-packages, a vendored checkout).

Why it lives here: patches are the integration's last resort (docs/design.md, "How the code is written"); keeping
them in one module with one metadata format keeps each one auditable.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib
import inspect
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PatchSpec", "PatchError", "PatchVersionError", "patch_root", "load_series", "apply_runtime",
    "revert_runtime", "check_runtime", "apply_files", "revert_files", "check_files", "main",
]

log = logging.getLogger("megatron_tree.patches")
ENV_PATCH_ROOT = "MEGATRON_TREE_PATCHES"
PACKAGE = "megatron-core"
MARKER_ATTR = "_megatron_tree_patch"


class PatchError(RuntimeError):
    """A patch does not apply (or revert) cleanly, or its target drifted from the release."""


class PatchVersionError(PatchError):
    """The megatron-core found is not the version the patches are pinned to."""


@dataclass(frozen=True)
class PatchSpec:
    """One patch file's header."""

    id: str
    """File stem, e.g. ``0001-attention-kv-cache-hook``."""
    package: str
    """Distribution the patch is for (``megatron-core``)."""
    version: str
    """The one release it applies to."""
    file: str
    """Path of the changed file, relative to the directory holding ``megatron/``."""
    file_sha256: str
    """sha256 of that file as released (before the patch)."""
    target: str
    """``module:Qualified.name`` of the function the runtime form replaces."""
    target_sha256: str
    """sha256 of ``inspect.getsource`` of that function as released."""
    why: str
    """What it changes and why no slot could do it."""
    path: Path
    """The patch file."""


def patch_root() -> Path:
    """The ``patches/`` directory: ``$MEGATRON_TREE_PATCHES`` or the one beside the package source."""
    env = os.environ.get(ENV_PATCH_ROOT)
    root = Path(env) if env else Path(__file__).resolve().parents[3] / "patches"
    if not (root / PACKAGE).is_dir():
        raise PatchError(
            f"no {PACKAGE} patches under {root}; set ${ENV_PATCH_ROOT} to the repository's patches/ directory"
        )
    return root


def _parse_header(path: Path) -> PatchSpec:
    fields: dict[str, str] = {}
    last = None
    for line in path.read_text().splitlines():
        if line.startswith("--- ") or line.startswith("diff "):
            break
        if not line.startswith("#"):
            continue
        body = line[1:].rstrip()
        m = re.match(r"^ ([a-z0-9-]+): (.*)$", body)
        if m:
            last = m.group(1)
            fields[last] = m.group(2).strip()
        elif last and body.startswith("   "):
            fields[last] += " " + body.strip()
    needed = ("id", "package", "version", "file", "file-sha256", "target", "target-sha256", "why")
    missing = [k for k in needed if k not in fields]
    if missing:
        raise PatchError(f"patch {path} lacks header fields {missing}")
    if fields["id"] != path.stem:
        raise PatchError(f"patch {path} declares id {fields['id']!r}, expected its file stem {path.stem!r}")
    return PatchSpec(
        fields["id"], fields["package"], fields["version"], fields["file"], fields["file-sha256"],
        fields["target"], fields["target-sha256"], fields["why"], path,
    )


def load_series(version: str | None = None) -> list[PatchSpec]:
    """Patch specs for ``version`` (default: every pinned version's directory must be the one found)."""
    base = patch_root() / PACKAGE
    versions = sorted(p.name for p in base.iterdir() if p.is_dir())
    if version is None:
        if len(versions) != 1:
            raise PatchError(f"several pinned versions {versions}; say which")
        version = versions[0]
    if version not in versions:
        raise PatchVersionError(
            f"megatron-core {version} found, but patches/ only has {', '.join(versions)}; the patches are "
            f"pinned to those releases and are not applied to any other (pin megatron-core=={versions[-1]})"
        )
    specs = [_parse_header(p) for p in sorted((base / version).glob("*.patch"))]
    for s in specs:
        if s.version != version or s.package != PACKAGE:
            raise PatchError(f"{s.path} declares {s.package} {s.version}, but lives under {PACKAGE}/{version}")
    return specs


def _sha256(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


# --------------------------------------------------------------------------- runtime form


def _hook_adjust_key_value(original):
    """Runtime form of patch 0001: the core attention may take over the KV-cache update."""

    @functools.wraps(original)
    def _adjust_key_value_for_inference(self, inference_context, query, key, value, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                                        sequence_len_offset=None, *, inference_params=None):
        from megatron.core.utils import deprecate_inference_params

        ctx = deprecate_inference_params(inference_context, inference_params)
        hook = getattr(self.core_attention, "adjust_key_value_for_inference", None)
        if hook is not None and ctx is not None:
            result = hook(self, ctx, query, key, value, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                          rotary_pos_cos_sin, sequence_len_offset)
            if result is not None:
                return result
        return original(self, inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos,
                        rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset,
                        inference_params=inference_params)

    return _adjust_key_value_for_inference


def _hook_dynamic_attention(original):
    """Runtime form of patch 0002: the core attention may compute a dynamic batch's attention."""

    @functools.wraps(original)
    def flash_decode_and_prefill(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k,
                                 seqlens_k, block_table, is_decode_only):
        assert not self.training
        assert block_table is not None
        hook = getattr(self.core_attention, "dynamic_attention", None)
        if hook is not None:
            result = hook(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                          block_table, is_decode_only)
            if result is not None:
                return result
        return original(self, q, k, v, max_seqlen_q, max_seqlen_k, cu_seqlens_q, cu_seqlens_k, seqlens_k,
                        block_table, is_decode_only)

    return flash_decode_and_prefill


RUNTIME = {
    "0001-attention-kv-cache-hook": _hook_adjust_key_value,
    "0002-dynamic-attention-hook": _hook_dynamic_attention,
}
"""Patch id -> factory ``original -> replacement`` implementing the same change as the diff."""


def _resolve(target: str):
    module_name, qualname = target.split(":")
    owner = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _installed_version() -> str:
    from .version import megatron_version

    return megatron_version()


def apply_runtime(version: str | None = None) -> list[str]:
    """Apply every pinned patch to the imported megatron-core; returns the ids newly applied.

    Refuses (``PatchVersionError``) another megatron-core version and (``PatchError``) a
    target whose source differs from the release the patch was written against.
    """
    version = version or _installed_version()
    applied = []
    for spec in load_series(version):
        owner, name = _resolve(spec.target)
        current = owner.__dict__[name]
        if getattr(current, MARKER_ATTR, None) == spec.id:
            log.debug("patch %s already applied to %s", spec.id, spec.target)
            continue
        found = _sha256(inspect.getsource(current))
        if found != spec.target_sha256:
            raise PatchError(
                f"patch {spec.id}: {spec.target} differs from megatron-core {spec.version} as released "
                f"(source sha256 {found[:12]}, expected {spec.target_sha256[:12]}); is the installed copy "
                "already modified?"
            )
        if spec.id not in RUNTIME:
            raise PatchError(f"patch {spec.id} has no runtime form in megatron_tree.integrations.patches.RUNTIME")
        replacement = RUNTIME[spec.id](current)
        setattr(replacement, MARKER_ATTR, spec.id)
        replacement.__wrapped__ = current
        setattr(owner, name, replacement)
        log.info("megatron-core %s: applied patch %s to %s", version, spec.id, spec.target)
        applied.append(spec.id)
    return applied


def revert_runtime(version: str | None = None) -> list[str]:
    """Undo :func:`apply_runtime`; returns the ids reverted (a no-op where not applied)."""
    version = version or _installed_version()
    reverted = []
    for spec in reversed(load_series(version)):
        owner, name = _resolve(spec.target)
        current = owner.__dict__[name]
        if getattr(current, MARKER_ATTR, None) == spec.id:
            setattr(owner, name, current.__wrapped__)
            log.info("megatron-core %s: reverted patch %s on %s", version, spec.id, spec.target)
            reverted.append(spec.id)
    return reverted


def check_runtime(version: str | None = None) -> dict[str, bool]:
    """Patch id -> whether it is applied to the imported megatron-core."""
    version = version or _installed_version()
    status = {}
    for spec in load_series(version):
        owner, name = _resolve(spec.target)
        status[spec.id] = getattr(owner.__dict__[name], MARKER_ATTR, None) == spec.id
    return status


# --------------------------------------------------------------------------- file form


def _tree_version(root: Path) -> str:
    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        raise PatchError(f"{root} holds no megatron/core/package_info.py; --root must be the directory containing megatron/")
    text = info.read_text()
    parts = []
    for key in ("MAJOR", "MINOR", "PATCH"):
        m = re.search(rf"^{key}\s*=\s*(\d+)", text, re.M)
        if not m:
            raise PatchError(f"cannot read {key} from {info}")
        parts.append(m.group(1))
    return ".".join(parts)


def _git_apply(root: Path, patch: Path, *args: str) -> bool:
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.resolve().parent))
    proc = subprocess.run(
        ["git", "apply", *args, str(patch.resolve())], cwd=root, env=env, capture_output=True, text=True
    )
    return proc.returncode == 0


def _release_sha256(root: Path, spec: PatchSpec, applied: list[PatchSpec]) -> str:
    """sha256 of ``spec.file`` under ``root`` with the series' other applied patches on it taken out.

    Several patches may change one file; the file of one that is not applied yet must be the
    release plus exactly the others that are.
    """
    others = [s for s in applied if s.file == spec.file]
    if not others:
        return _sha256((root / spec.file).read_bytes())
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mt_patch_check_") as tmp:
        copy = Path(tmp) / spec.file
        copy.parent.mkdir(parents=True)
        copy.write_bytes((root / spec.file).read_bytes())
        for other in reversed(others):
            if not _git_apply(Path(tmp), other.path, "-R"):
                raise PatchError(f"patch {other.id} does not revert cleanly from {root / spec.file}")
        return _sha256(copy.read_bytes())


def check_files(root) -> dict[str, str]:
    """Patch id -> ``"applied"``, ``"not applied"`` for the tree at ``root`` (refuses other versions)."""
    root = Path(root)
    series = load_series(_tree_version(root))
    status = {}
    for spec in series:
        if _git_apply(root, spec.path, "--check", "-R"):
            status[spec.id] = "applied"
        elif _git_apply(root, spec.path, "--check"):
            status[spec.id] = "not applied"
        else:
            raise PatchError(f"patch {spec.id} neither applies nor reverts cleanly on {root / spec.file}")
    applied = [s for s in series if status[s.id] == "applied"]
    for spec in series:
        if status[spec.id] == "not applied":
            found = _release_sha256(root, spec, applied)
            if found != spec.file_sha256:
                raise PatchError(
                    f"patch {spec.id}: {spec.file} under {root} differs from the {spec.version} release "
                    f"(sha256 {found[:12]}, expected {spec.file_sha256[:12]})"
                )
    return status


def apply_files(root) -> list[str]:
    """Apply every pinned patch to the source tree at ``root``; returns ids newly applied."""
    root = Path(root)
    applied = []
    for spec_id, state in check_files(root).items():
        if state == "applied":
            log.info("patch %s already applied under %s", spec_id, root)
            continue
        spec = next(s for s in load_series(_tree_version(root)) if s.id == spec_id)
        if not _git_apply(root, spec.path):
            raise PatchError(f"git apply of {spec.path} failed under {root}")
        log.info("applied patch %s under %s", spec_id, root)
        applied.append(spec_id)
    return applied


def revert_files(root) -> list[str]:
    """Reverse every applied patch under ``root``; returns ids reverted."""
    root = Path(root)
    reverted = []
    status = check_files(root)
    for spec in reversed(load_series(_tree_version(root))):
        if status[spec.id] != "applied":
            continue
        if not _git_apply(root, spec.path, "-R"):
            raise PatchError(f"git apply -R of {spec.path} failed under {root}")
        log.info("reverted patch %s under %s", spec.id, root)
        reverted.append(spec.id)
    return reverted


def _default_root() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).resolve().parents[2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_tree.integrations.patches",
        description="Apply, check or revert megatron_tree's version-pinned megatron-core patches on a source tree.",
    )
    parser.add_argument("action", choices=("apply", "check", "revert"))
    parser.add_argument("--root", default=None,
                        help="directory containing megatron/ (default: the installed megatron-core)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    root = Path(args.root) if args.root else _default_root()
    try:
        if args.action == "apply":
            done = apply_files(root)
            print(f"applied {done or 'nothing (already applied)'} under {root}")
        elif args.action == "revert":
            done = revert_files(root)
            print(f"reverted {done or 'nothing (not applied)'} under {root}")
        else:
            for pid, state in check_files(root).items():
                print(f"{pid}: {state}")
    except PatchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
