"""The house keeps its shape: no import cycle, and no import that runs up ``megatron_tree/LAYERS.md``.

The checker reads every module of a package with ``ast`` (imports inside functions and
methods included; ``from . import x`` resolved to the module ``x`` where there is one, else to
the package), maps each module to its row of the layer table, and reports, naming the
importing module, the line and the import: an import of a row further down the table, a
module no row (or more than one row) matches, and every cycle between modules. It is proven
able to fail on a tiny package planted in ``tmp_path``.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "megatron_tree")


# --------------------------------------------------------------------------- the checker


def read_table(path: str) -> list[tuple[str, list[str]]]:
    """The layer table of a LAYERS.md: ``[(layer, [module patterns])]`` from the first row down."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 2 or not line.lstrip().startswith("|") or cells[0] in ("layer", "") or \
                    set(cells[0]) <= set("-: "):
                continue
            rows.append((cells[0], re.findall(r"`([A-Za-z0-9_.*]+)`", cells[1])))
    return rows


def row_of(module: str, table) -> list[int]:
    """The rows whose most specific (longest) matching pattern is the longest of any row's: one row, or a tie."""
    best = {}
    for i, (_, patterns) in enumerate(table):
        lengths = [len(p) for p in patterns if fnmatch.fnmatchcase(module, p)]
        if lengths:
            best[i] = max(lengths)
    if not best:
        return []
    top = max(best.values())
    return [i for i, n in best.items() if n == top]


def modules_of(package_dir: str) -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (file, is a package ``__init__``) of every ``.py`` under ``package_dir``."""
    base = os.path.dirname(package_dir)
    out = {}
    for dirpath, _, files in os.walk(package_dir):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            parts = os.path.relpath(path, base)[:-3].split(os.sep)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            out[".".join(parts)] = (path, is_pkg)
    return out


def imports_of(module: str, path: str, is_pkg: bool, known) -> list[tuple[int, str, str]]:
    """``[(line, imported module, the import as written)]`` for every import of a package module."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in known:  # import a.b.c: the deepest package module named
                    name = name.rpartition(".")[0]
                if name:
                    found.append((node.lineno, name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            written = f"from {'.' * node.level}{node.module or ''} import " + ", ".join(a.name for a in node.names)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in known:
                    found.append((node.lineno, target, written))
                elif source in known:
                    found.append((node.lineno, source, written))
    return found


def check(package_dir: str, table_path: str) -> list[str]:
    """Every violation of the layer table and every import cycle in the package, as readable lines."""
    table = read_table(table_path)
    known = modules_of(package_dir)
    layer_of, problems = {}, []
    for module in sorted(known):
        rows = row_of(module, table)
        if len(rows) != 1:
            where = "no row" if not rows else f"rows {[table[i][0] for i in rows]}"
            problems.append(f"{module}: matched by {where} of the layer table {table_path}")
            continue
        layer_of[module] = rows[0]
    graph: dict[str, list[tuple[str, int, str]]] = {m: [] for m in known}
    for module, (path, is_pkg) in known.items():
        for line, target, written in imports_of(module, path, is_pkg, known):
            if target == module:
                continue
            graph[module].append((target, line, written))
            if module in layer_of and target in layer_of and layer_of[target] > layer_of[module]:
                problems.append(
                    f"{os.path.relpath(path, os.path.dirname(package_dir))}:{line}: `{written}` runs up the layers: "
                    f"{module} ({table[layer_of[module]][0]}) imports {target} ({table[layer_of[target]][0]})")
    problems += [f"import cycle: {cycle}" for cycle in _cycles(graph, known, package_dir)]
    return problems


def _cycles(graph, known, package_dir) -> list[str]:
    """One readable cycle per strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, comps, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w, _, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(set(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # walk the component from its first module back to itself, naming each import
        start = min(comp)
        path, seen, node = [], {start}, start
        while True:
            nxt = next((e for e in sorted(graph[node]) if e[0] in comp and (e[0] == start or e[0] not in seen)), None)
            if nxt is None:
                break
            target, line, written = nxt
            rel = os.path.relpath(known[node][0], os.path.dirname(package_dir))
            path.append(f"{node} ({rel}:{line} `{written}`)")
            if target == start:
                break
            seen.add(target)
            node = target
        out.append(" -> ".join(path) + f" -> {start}")
    return out


# --------------------------------------------------------------------------- the package


def test_megatron_tree_keeps_its_layers_and_has_no_import_cycle():
    problems = check(PACKAGE, os.path.join(PACKAGE, "LAYERS.md"))
    assert not problems, "\n".join(problems)


def test_the_table_names_the_layers_in_order():
    layers = [name for name, _ in read_table(os.path.join(PACKAGE, "LAYERS.md"))]
    assert layers == ["utils", "kernels", "ops", "distributed", "comm", "decode", "integrations", "eval",
                      "front door"], layers


def test_the_folder_tree_is_the_table():
    """One row per folder: every sub-package of megatron_tree is named by exactly one row, as itself, and
    nothing but the front door's ``__init__`` sits at the package's top level."""
    table = read_table(os.path.join(PACKAGE, "LAYERS.md"))
    named = {p for _, patterns in table for p in patterns if "*" not in p}
    folders = sorted(m for m, (_, is_pkg) in modules_of(PACKAGE).items() if is_pkg)
    for folder in folders:
        rows = [name for name, patterns in table if folder in patterns]
        if folder == "megatron_tree" or folder.count(".") == 1 or folder == "megatron_tree.ops.triton":
            assert len(rows) == 1, f"{folder}: named by rows {rows}; each tier folder is one row of LAYERS.md"
    top_level = [m for m, (_, is_pkg) in modules_of(PACKAGE).items() if m.count(".") == 1 and not is_pkg]
    assert top_level == [], f"modules at the package's top level, outside every tier folder: {top_level}"
    assert named <= set(folders), f"rows name modules that do not exist: {sorted(named - set(folders))}"


FORBIDDEN = [
    # (modules matching, may not import, why)
    ("megatron_tree.ops.triton*", "torch.distributed", "kernels never communicate"),
    ("megatron_tree.comm*", "megatron_tree.ops.triton", "comm merges partial states and never calls a kernel"),
]


def forbidden_imports(package_dir: str) -> list[str]:
    """Imports the tiers' two extra rules forbid (docs/design.md §2), as readable lines."""
    known = modules_of(package_dir)
    found = []
    for module, (path, is_pkg) in sorted(known.items()):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        names = [(n.lineno, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [(n.lineno, n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
        names += [(line, target) for line, target, _ in imports_of(module, path, is_pkg, known)]
        for pattern, banned, why in FORBIDDEN:
            if fnmatch.fnmatchcase(module, pattern):
                for line, name in names:
                    if name == banned or name.startswith(banned + "."):
                        found.append(f"{os.path.relpath(path, os.path.dirname(package_dir))}:{line}: {module} "
                                     f"imports {name}: {why}")
    return found


def test_kernels_never_communicate_and_comm_never_calls_a_kernel():
    problems = forbidden_imports(PACKAGE)
    assert not problems, "\n".join(problems)


def test_the_extra_rules_can_fail(tmp_path):
    pkg = tmp_path / "megatron_tree"
    for rel, text in {"__init__.py": "", "ops/__init__.py": "", "ops/triton/__init__.py": "",
                      "ops/triton/k.py": "def f():\n    import torch.distributed as dist\n",
                      "comm/__init__.py": "", "comm/m.py": "from ..ops.triton import k\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    problems = forbidden_imports(str(pkg))
    assert any("megatron_tree.ops.triton.k imports torch.distributed" in p for p in problems), problems
    assert any("megatron_tree.comm.m imports megatron_tree.ops.triton" in p for p in problems), problems


# --------------------------------------------------------------------------- the checker can fail


def _plant(tmp_path, files: dict, table: str):
    pkg = tmp_path / "planted"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "LAYERS.md").write_text(table)
    return str(pkg), str(tmp_path / "LAYERS.md")


TABLE = """| layer | modules | what |
|---|---|---|
| low | `planted.low`, `planted.low.*` | below |
| high | `planted`, `planted.high` | above |
"""


def test_checker_fails_on_an_upward_import_inside_a_function(tmp_path):
    pkg, table = _plant(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/core.py": "def f():\n    from ..high import g\n    return g\n",
        "high.py": "from .low import core\n\ndef g():\n    return core\n",
    }, TABLE)
    problems = check(pkg, table)
    assert any("planted/low/core.py:2: `from ..high import g` runs up the layers: planted.low.core (low) imports "
               "planted.high (high)" in p for p in problems), problems


def test_checker_fails_on_a_cycle_and_names_each_import(tmp_path):
    pkg, table = _plant(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from . import b\n",
        "low/b.py": "import planted.low.c\n",
        "low/c.py": "def late():\n    from .a import x\n",
    }, TABLE)
    problems = check(pkg, table)
    cycles = [p for p in problems if p.startswith("import cycle")]
    assert len(cycles) == 1, problems
    for needle in ("planted.low.a (planted/low/a.py:1 `from . import b`)", "planted.low.b (planted/low/b.py:1 "
                   "`import planted.low.c`)", "planted.low.c (planted/low/c.py:2 `from .a import x`)"):
        assert needle in cycles[0], cycles[0]


def test_checker_fails_on_an_upward_import_between_nested_folders(tmp_path):
    """A folder nested in another's row (``low.inner`` below ``low``) is its own row by the longer pattern."""
    table = TABLE.replace("| low |", "| inner | `planted.low.inner`, `planted.low.inner.*` | below low |\n| low |")
    pkg, table = _plant(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/core.py": "x = 1\n",
        "low/inner/__init__.py": "",
        "low/inner/k.py": "from .. import core\n",
    }, table)
    problems = check(pkg, table)
    assert any("planted.low.inner.k (inner) imports planted.low.core (low)" in p for p in problems), problems


def test_checker_fails_on_a_module_outside_the_table(tmp_path):
    pkg, table = _plant(tmp_path, {"__init__.py": "", "stray.py": "x = 1\n"}, TABLE)
    assert check(pkg, table) == [f"planted.stray: matched by no row of the layer table {table}"]


def test_checker_passes_a_package_that_keeps_its_layers(tmp_path):
    pkg, table = _plant(tmp_path, {
        "__init__.py": "from .high import g\n",
        "low/__init__.py": "",
        "low/core.py": "import os\n",
        "high.py": "from .low import core\nfrom . import low\n",
    }, TABLE)
    assert check(pkg, table) == []
