"""Every command and path the README and docs give a reader exists and starts.

For each ``python -m <module>`` in README.md, CONTRIBUTING.md, docs/*.md and benchmarks/README.md,
the module resolves and its ``--help`` exits 0 (one interpreter runs them all, as ``python -m``
would: ``runpy`` with ``__main__``); every repository path those pages name in backticks or links
(``megatron_tree/...``, ``tests/...``, ``benchmarks/...``, ``docs/...``, ``launch/...``, ``configs/...``)
exists. What the commands compute is tested where it is cheap to run: the main job in
``tests/eval/test_launch.py``, the benchmarks' sweep in ``tests/benchmarks/test_bench.py``, the
lm-eval entry point in ``tests/integrations/test_lm_eval.py``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, p) for p in ("README.md", "CONTRIBUTING.md", "benchmarks/README.md")
         if os.path.exists(os.path.join(ROOT, p))] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PATH_PREFIXES = ("megatron_tree/", "tests/", "benchmarks/", "docs/", "launch/", "configs/", "patches/", "examples/")


def _text() -> dict[str, str]:
    return {os.path.relpath(p, ROOT): open(p, encoding="utf-8").read() for p in PAGES}


def documented_modules() -> dict[str, list[str]]:
    """``python -m`` module -> the pages that give it (pytest excluded: not ours)."""
    found: dict[str, list[str]] = {}
    for page, text in _text().items():
        for mod in re.findall(r"python3? -m ([A-Za-z_][\w.]*\w)(?![\w.<])", text):
            if mod != "pytest":
                found.setdefault(mod, []).append(page)
    return found


def documented_paths() -> dict[str, list[str]]:
    """Repository path -> the pages that name it (in backticks or as a link target)."""
    found: dict[str, list[str]] = {}
    for page, text in _text().items():
        base = os.path.dirname(page)
        named = [c for c in re.findall(r"`([^`\s]+)`", text) if c.startswith(PATH_PREFIXES)]
        linked = [os.path.normpath(os.path.join(base, c)) for c in re.findall(r"\]\(([^)#\s]+)", text)
                  if not c.startswith(("http", "mailto"))]
        for rel in named + linked:
            rel = rel.rstrip(".,:;")
            if any(ch in rel for ch in "*<{") or "..." in rel:
                continue  # a pattern or a placeholder, not a path
            if rel.startswith(PATH_PREFIXES) and re.fullmatch(r"[\w./-]+", rel):
                found.setdefault(rel.split("::")[0], []).append(page)
    return found


def test_every_documented_path_exists():
    paths = documented_paths()
    assert len(paths) > 40, sorted(paths)  # the pages name many files; a broken extractor finds few
    missing = {p: pages for p, pages in paths.items() if not os.path.exists(os.path.join(ROOT, p.rstrip("/")))}
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(
        f"  {p}  (in {', '.join(sorted(set(pages)))})" for p, pages in sorted(missing.items()))


def test_every_documented_module_starts():
    modules = documented_modules()
    assert {"megatron_tree.eval", "megatron_tree.eval.lm_eval", "benchmarks.decode"} <= set(modules), sorted(modules)
    script = textwrap.dedent(f"""
        import json, runpy, sys, io, contextlib
        out = {{}}
        for mod in {sorted(modules)!r}:
            sys.argv = [mod, "--help"]
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf):
                    runpy.run_module(mod, run_name="__main__", alter_sys=True)
                out[mod] = "returned without printing help" if "usage" not in buf.getvalue().lower() else 0
            except SystemExit as e:
                out[mod] = 0 if e.code in (0, None) and "usage" in buf.getvalue().lower() else f"exit {{e.code}}"
            except BaseException as e:
                out[mod] = f"{{type(e).__name__}}: {{e}}"
        print("RESULT " + json.dumps(out))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    bad = {m: r for m, r in result.items() if r != 0}
    assert not bad, "documented commands whose --help fails:\n" + "\n".join(
        f"  python -m {m}: {r}  (in {', '.join(sorted(set(modules[m])))})" for m, r in sorted(bad.items()))
