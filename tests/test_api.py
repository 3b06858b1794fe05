"""The front door: ``import megatron_tree as mt`` is one tier, the integrations come lazily.

Importing the package must not import a framework (transformers, megatron-core, deepspeed, wandb: heavy,
and they print at import), every name in ``__all__`` resolves, and ``mt.hf`` / ``mt.megatron`` are the
integration packages themselves once touched.
"""

import json
import subprocess
import sys

import pytest


def _fresh(code):
    """Run ``code`` in a fresh interpreter; return its last stdout line parsed as JSON."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_pulls_in_no_framework():
    loaded = _fresh(
        "import json, sys, megatron_tree as mt\n"
        "heavy = ('transformers', 'megatron', 'deepspeed', 'wandb', 'megatron_tree.integrations.hf',\n"
        "         'megatron_tree.integrations.megatron')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n")
    assert loaded == []


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
    out = _fresh(
        "import json, megatron_tree as mt\n"
        "from megatron_tree.integrations import megatron as direct\n"
        "print(json.dumps([mt.megatron is direct, callable(mt.megatron.get_gpt_layer_tree_spec)]))\n")
    assert out == [True, True]
