"""The merge strategies are listed once (``megatron_tree/comm/strategies.py``); everything else reads that list.

The config's ``Literal``, the cost model, the benchmarks and the CLIs take it from there, and
every table in the README or docs/ that lists strategies by name (one per row) names them all.
"""

from __future__ import annotations

import glob
import os
import re
import typing

import pytest

from megatron_tree.comm import merge as comm, cost, strategies
from megatron_tree.eval.config import ConfigError, EvalConfig, StrategyName, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_reader_takes_the_one_list():
    assert comm.STRATEGIES is strategies.STRATEGIES
    assert set(strategies.STRATEGIES) == set(strategies.MERGES) | {"auto"}
    assert typing.get_args(StrategyName) == strategies.STRATEGIES
    assert cost.MERGES is strategies.MERGES and comm.STRATEGIES is strategies.STRATEGIES
    from benchmarks import decode

    assert decode.TREE == strategies.STRATEGIES


def test_the_eval_accepts_every_strategy_and_only_those():
    cfg = load_config(None, ["eval.strategies=[shifted, packed]"])
    assert cfg.eval.strategies == ("shifted", "packed")
    assert EvalConfig().strategies == strategies.STRATEGIES  # the default sweep runs every one
    with pytest.raises(ConfigError, match="eval.strategies"):
        load_config(None, ["eval.strategies=[ring]"])


def _strategy_tables(text: str) -> list[list[str]]:
    """Markdown tables whose rows start with a backticked strategy name: the names of each, in row order."""
    tables, rows = [], []
    for line in text.splitlines() + [""]:
        m = re.match(r"\|\s*`([a-z_0-9]+)`\s*\|", line.strip())
        if m:
            rows.append(m.group(1))
            continue
        if sum(r in strategies.STRATEGIES for r in rows) >= 3:
            tables.append(rows)
        rows = []
    return tables


def test_docs_tables_name_every_strategy():
    docs = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    found = []
    for path in docs:
        with open(path, encoding="utf-8") as f:
            for rows in _strategy_tables(f.read()):
                found.append(path)
                names = [r for r in rows if r in strategies.STRATEGIES]
                assert sorted(names) == sorted(strategies.STRATEGIES), f"{path}: a strategy table lists {rows}"
    assert found, "no table of merge strategies in README.md or docs/"


def test_table_reader_sees_a_missing_strategy():
    table = "\n".join(f"| `{s}` | x |" for s in strategies.STRATEGIES if s != "shifted")
    (rows,) = _strategy_tables(table)
    assert "shifted" not in rows and len(rows) == len(strategies.STRATEGIES) - 1
