"""Version-pinned megatron-core patches: apply cleanly, idempotent, revert, refuse other versions.

The runtime form is checked on the imported megatron-core in this process and always
reverted; the file form on a copy of the two installed files it reads (never on the
installed package, which other test sessions import concurrently).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_tree.integrations.megatron import patches

ROOT = Path(__file__).resolve().parents[3]


def _installed_root() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).resolve().parents[2]


@pytest.fixture()
def attention_cls():
    from megatron.core.transformer.attention import Attention

    patches.revert_runtime()
    yield Attention
    patches.revert_runtime()


@pytest.fixture()
def tree_copy(tmp_path):
    """A source tree holding copies of the files the patches and the version check read."""
    src = _installed_root()
    for rel in ("megatron/core/package_info.py", "megatron/core/transformer/attention.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, tmp_path / rel)
    return tmp_path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


IDS = ["0001-attention-kv-cache-hook", "0002-dynamic-attention-hook"]
TARGETS = ["_adjust_key_value_for_inference", "flash_decode_and_prefill"]


def test_series_metadata_matches_the_installed_release():
    specs = patches.load_series("0.16.1")
    assert [s.id for s in specs] == IDS
    for spec, target in zip(specs, TARGETS):
        assert spec.target.endswith("Attention." + target) and "slot" in spec.why
        # The installed file is the pristine release: nothing in this project patches it in place.
        assert _sha(_installed_root() / spec.file) == spec.file_sha256


def test_runtime_apply_is_idempotent_logged_and_reverts(attention_cls, caplog):
    originals = [attention_cls.__dict__[t] for t in TARGETS]
    assert patches.check_runtime() == dict.fromkeys(IDS, False)
    with caplog.at_level(logging.INFO, logger="megatron_tree.patches"):
        assert patches.apply_runtime() == IDS
    for pid in IDS:
        assert any(f"applied patch {pid}" in r.getMessage() for r in caplog.records)
    patched = [attention_cls.__dict__[t] for t in TARGETS]
    for pid, new, old in zip(IDS, patched, originals):
        assert new is not old and new.__wrapped__ is old
        assert new._megatron_tree_patch == pid
    assert patches.apply_runtime() == []  # second apply changes nothing
    assert [attention_cls.__dict__[t] for t in TARGETS] == patched
    assert patches.check_runtime() == dict.fromkeys(IDS, True)
    assert patches.revert_runtime() == IDS[::-1]
    assert [attention_cls.__dict__[t] for t in TARGETS] == originals
    assert patches.revert_runtime() == []


def test_runtime_refuses_other_version_and_drifted_source(attention_cls, monkeypatch):
    with pytest.raises(patches.PatchVersionError, match=r"megatron-core 0\.17\.0 found.*0\.16\.1"):
        patches.apply_runtime(version="0.17.0")

    def drifted(self, *args, **kwargs):  # an installed copy someone edited
        return None

    monkeypatch.setattr(attention_cls, "_adjust_key_value_for_inference", drifted)
    with pytest.raises(patches.PatchError, match="differs from megatron-core 0.16.1 as released"):
        patches.apply_runtime()
    assert attention_cls.__dict__["_adjust_key_value_for_inference"] is drifted


def test_files_apply_idempotent_revert(tree_copy):
    target = tree_copy / "megatron/core/transformer/attention.py"
    before = target.read_bytes()
    assert patches.check_files(tree_copy) == dict.fromkeys(IDS, "not applied")
    assert patches.apply_files(tree_copy) == IDS
    patched = target.read_bytes()
    assert patched != before and b"megatron_tree patch 0001" in patched and b"megatron_tree patch 0002" in patched
    assert patches.apply_files(tree_copy) == []  # idempotent
    assert target.read_bytes() == patched
    assert patches.check_files(tree_copy) == dict.fromkeys(IDS, "applied")
    # The patched file still compiles.
    compile(patched, str(target), "exec")
    assert patches.revert_files(tree_copy) == IDS[::-1]
    assert target.read_bytes() == before
    assert patches.revert_files(tree_copy) == []


def test_files_series_on_one_file_partly_applied(tree_copy):
    """A tree with only 0001 applied (the series before 0002 existed): 0002 is recognised as the
    release plus 0001, applies on top, and an edit elsewhere in that file is still refused."""
    target = tree_copy / "megatron/core/transformer/attention.py"
    release = target.read_bytes()
    first = patches.load_series("0.16.1")[0]
    assert subprocess.run(["git", "apply", str(first.path)], cwd=tree_copy).returncode == 0
    assert patches.check_files(tree_copy) == {IDS[0]: "applied", IDS[1]: "not applied"}
    assert patches.apply_files(tree_copy) == [IDS[1]]
    assert patches.check_files(tree_copy) == dict.fromkeys(IDS, "applied")
    assert patches.revert_files(tree_copy) == IDS[::-1]
    assert target.read_bytes() == release
    assert subprocess.run(["git", "apply", str(first.path)], cwd=tree_copy).returncode == 0
    target.write_text(target.read_text() + "\n# local edit\n")
    with pytest.raises(patches.PatchError, match=f"patch {IDS[1]}: .* differs from the 0.16.1 release"):
        patches.check_files(tree_copy)


def test_files_refuse_other_version_and_modified_file(tree_copy):
    info = tree_copy / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("MINOR = 16", "MINOR = 17"))
    with pytest.raises(patches.PatchVersionError, match=r"0\.17\.1 found, but patches/ only has 0\.16\.1"):
        patches.apply_files(tree_copy)
    info.write_text(info.read_text().replace("MINOR = 17", "MINOR = 16"))
    target = tree_copy / "megatron/core/transformer/attention.py"
    target.write_text(target.read_text() + "\n# local edit\n")
    with pytest.raises(patches.PatchError, match="differs from the 0.16.1 release"):
        patches.apply_files(tree_copy)


def test_cli(tree_copy, capsys):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "megatron_tree.integrations.megatron.patches", *args, "--root", str(tree_copy)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )

    proc = run("apply")
    assert proc.returncode == 0, proc.stderr
    assert f"applied {IDS}" in proc.stdout
    assert patches.check_files(tree_copy) == dict.fromkeys(IDS, "applied")

    # check and revert through the same entry point (in-process: the same main()).
    capsys.readouterr()
    assert patches.main(["check", "--root", str(tree_copy)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{pid}: applied" for pid in IDS]
    target = tree_copy / "megatron/core/transformer/attention.py"
    assert patches.main(["revert", "--root", str(tree_copy)]) == 0
    assert f"reverted {IDS[::-1]}" in capsys.readouterr().out
    assert _sha(target) == patches.load_series("0.16.1")[0].file_sha256  # the release, byte for byte
    assert patches.main(["check", "--root", str(tree_copy)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{pid}: not applied" for pid in IDS]

    # Errors: exit status 2 and the message.
    info = tree_copy / "megatron/core/package_info.py"
    info.write_text(info.read_text().replace("PATCH = 1", "PATCH = 2"))
    assert patches.main(["apply", "--root", str(tree_copy)]) == 2
    assert "error: megatron-core 0.16.2 found" in capsys.readouterr().err
