"""The front door: ``import megatron_tree as mt`` is one tier, the integrations come lazily.

Importing the package must not import a framework (transformers, megatron-core, deepspeed, wandb: heavy,
and they print at import), every name in ``__all__`` resolves, and ``mt.hf`` / ``mt.megatron`` are the
integration packages themselves once touched.
"""

import json
import subprocess
import sys
import textwrap

import pytest


def _fresh(code):
    """Run ``code`` in a fresh interpreter; return its last stdout line parsed as JSON."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def cold_imports():
    """One fresh interpreter for the two import checks below (each paid a torch import of its own): what
    ``import megatron_tree`` alone loaded, read before anything else is imported, then what the core tiers
    loaded on top of it."""
    return _fresh(
        "import json, sys, megatron_tree as mt\n"
        "heavy = ('transformers', 'megatron', 'deepspeed', 'wandb', 'megatron_tree.integrations.hf',\n"
        "         'megatron_tree.integrations.megatron')\n"
        "front = sorted(m for m in heavy if m in sys.modules)\n"
        "import megatron_tree.decode, megatron_tree.comm, megatron_tree.ops\n"
        "import megatron_tree.distributed, megatron_tree.comm.baselines, megatron_tree.eval\n"
        "print(json.dumps({'front_door': front,\n"
        "                  'tiers': [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules]}))\n")


def test_import_pulls_in_no_framework(cold_imports):
    assert cold_imports["front_door"] == []


def test_core_tiers_import_without_torch_compiler_stack(cold_imports):
    """torch._dynamo costs about a second to import: a process that only decodes eagerly must not pay it
    at import (benchmarks.cold_start counts it in the first call, where torch's custom ops import it)."""
    assert cold_imports["tiers"] == []


def test_front_door_names():
    import megatron_tree as mt

    for name in mt.__all__:
        if name not in ("hf", "megatron"):
            assert getattr(mt, name) is not None, name
    assert {"tree_decode", "flash_decode", "merge_states", "TreeGroups", "CommStats", "DisagreementError",
            "CommError", "TopologyError", "CacheOverflowError", "STRATEGIES"} <= set(mt.__all__)
    assert {"hf", "megatron"} <= set(dir(mt))
    with pytest.raises(AttributeError, match="has no attribute 'ShardedKVCache'.*megatron_tree.decode"):
        mt.ShardedKVCache  # noqa: B018 -- the caches live in the decode tier
    from megatron_tree.decode import ShardedKVCache, generate  # noqa: F401 -- where they do live


def test_integrations_are_reached_lazily():
    out = _fresh(
        "import json, sys, megatron_tree as mt\n"
        "before = 'transformers' in sys.modules\n"
        "hf = mt.hf\n"
        "from megatron_tree.integrations import hf as direct\n"
        "print(json.dumps([before, hf is direct, callable(hf.enable_tree_attention), callable(hf.load_hf_model),\n"
        "                  'megatron' in sys.modules]))\n")
    assert out == [False, True, True, True, False]
    # Megatron checkpoints are checked (files, headers, training arguments) and the eval's frameworks found without
    # importing megatron.core, wandb or deepspeed, which cost seconds per rank: a wrong path fails at once. The
    # package's names load on first use, and mt.megatron is the integration package itself. (One interpreter for
    # both: each fresh one that reaches megatron.core pays its ~10 CPU-s import; mt.megatron is read last, after
    # the imports before it were checked not to load megatron.core.)
    out = _fresh(
        "import json, sys, megatron_tree as mt\n"
        "from megatron_tree.integrations.megatron.checkpoint import check_checkpoint\n"
        "from megatron_tree.integrations.megatron.model import GPTShape\n"
        "import megatron_tree.integrations.megatron as m\n"
        "from megatron_tree.utils.extras import installed, missing\n"
        "found = [installed(n) for n in ('megatron.core', 'wandb', 'deepspeed', 'no_such_module', 'json.no_such')]\n"
        "gone = missing({'megatron': 'a', 'wandb': 'b', 'deepspeed': 'c'})\n"
        "before = [n for n in ('megatron.core', 'wandb', 'deepspeed') if n in sys.modules]\n"
        "print(json.dumps([found, gone, before, callable(m.use_tree_attention), 'megatron.core' in sys.modules,\n"
        "                  all(getattr(m, n) is not None for n in m.__all__),\n"
        "                  mt.megatron is m, callable(mt.megatron.get_gpt_layer_tree_spec)]))\n")
    # installed frameworks are found, absent ones not, and none of them is imported by the check
    assert out[:6] == [[True, True, True, False, False], {}, [], True, True, True], out
    assert out[6:] == [True, True], "mt.megatron is not the integration package megatron_tree.integrations.megatron"


@pytest.mark.parametrize("module, blocked, extra", [
    ("megatron_tree.integrations.megatron", "megatron", "megatron"),
    ("megatron_tree.integrations.hf", "transformers", "hf"),
    ("megatron_tree.integrations.lm_eval", "lm_eval", "lmeval"),
    ("megatron_tree.integrations.deepspeed:init_distributed", "deepspeed", "deepspeed"),
])
def test_a_missing_framework_names_the_extra_that_installs_it(module, blocked, extra):
    """With the framework absent (its import made to fail), the core still imports and runs, and the
    integration's import (or first use) is an ImportError naming ``megatron_tree[<extra>]``."""
    name, _, func = module.partition(":")
    script = textwrap.dedent(f"""
        import sys
        sys.modules[{blocked!r}] = None  # `import {blocked}` now raises ImportError
        import torch, megatron_tree as mt
        out, lse = mt.flash_decode(torch.randn(1, 1, 2, 8), torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8))
        assert out.shape == (1, 1, 2, 8)
        try:
            import importlib
            m = importlib.import_module({name!r})
            if {func!r}:
                getattr(m, {func!r})(env={{}})
        except ImportError as e:
            print("IMPORTERROR", e)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("IMPORTERROR")), "")
    assert f"pip install 'megatron_tree[{extra}]'" in line and name.rsplit(".", 1)[-1] in line, proc.stdout
