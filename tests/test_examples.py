"""Every program in examples/ runs as its docstring says, offline, and holds its own result to the
single-process reference (each asserts that itself and exits non-zero otherwise; here the exit
status and the verdict line it prints are checked). The examples share one small trained Llama,
written once by examples/tiny_checkpoint.py under outputs/examples/ (about 10-30 s)."""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.helpers.launching import ROOT, launch_env, run

EXAMPLES = os.path.join(ROOT, "examples")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def _stated(script: str) -> str:
    """The one command the script's docstring states (the line that runs ``examples/<script>``)."""
    text = open(os.path.join(EXAMPLES, script), encoding="utf-8").read()
    return next(l.strip() for l in text.splitlines()
                if f"examples/{script}" in l and l.strip().startswith(("torchrun ", "python ")))


def _command(script: str) -> list[str]:
    """That command with this interpreter (``torchrun`` as ``python -m torch.distributed.run``), no optional args."""
    words = [w for w in _stated(script).split() if not w.startswith("[")]
    return TORCHRUN + words[2:] if words[0] == "torchrun" else [sys.executable, *words[1:]]


def _run(script: str, timeout: int = 420):
    p = run(_command(script), launch_env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"),
            timeout=timeout)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-4000:]}"
    return p


def test_every_example_is_tested_and_documented():
    scripts = sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".py") and f != "tiny_checkpoint.py")
    assert scripts == ["functional_api.py", "lm_eval_backend.py", "megatron_core.py", "transformers_generate.py"]
    readme = open(os.path.join(EXAMPLES, "README.md"), encoding="utf-8").read()
    for s in scripts:
        assert _stated(s).split(" [")[0] in readme, s  # examples/README.md states the same command


def test_checkpoint_is_a_trained_model_transformers_loads():
    sys.path.insert(0, EXAMPLES)
    from tiny_checkpoint import ensure

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("the dragon slept in", return_tensors="pt", return_token_type_ids=False)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:]) == "a cave full of gold and old bones"


def test_transformers_generate():
    p = _run("transformers_generate.py")
    assert re.search(r"transformers generate at CP 2 vs one process: tokens identical, max\|dlogits\| \S+ over "
                     r"\d+ steps x 2 rows", p.stdout), p.stdout
    assert "generated: a cave full of gold and old bones ." in p.stdout


def test_functional_api():
    p = _run("functional_api.py")
    assert "tree_decode at CP 3 (slices [500, 1000, 1500] of 3000 tokens)" in p.stdout, p.stdout
    assert "all equal the single-process result" in p.stdout
    # the example's own checks, again here on what it printed (an example whose asserts were lost would
    # still have to print errors this small)
    tree_err = float(re.search(r"max\|out - fp64 reference\| ([0-9.e+-]+)", p.stdout).group(1))
    merge_err = float(re.search(r"merge_states of 3 partial states: ([0-9.e+-]+)", p.stdout).group(1))
    assert tree_err < 1e-5 and merge_err < 1e-5, p.stdout


def test_megatron_core():
    p = _run("megatron_core.py")
    assert "vs Megatron's own GPTModel at CP = 1: tokens identical (10 x 2)" in p.stdout, p.stdout[-3000:]
    assert "the dragon slept in -> a cave full of gold and old bones ." in p.stdout


@pytest.mark.skipif(not __import__("importlib").util.find_spec("lm_eval"),
                    reason="lm-eval is not installed (pip install 'megatron_tree[lmeval]')")
def test_lm_eval_backend(tmp_path):
    p = _run("lm_eval_backend.py")
    assert re.search(r"\d+ log-likelihoods within \S+, 3 generations identical, metrics identical", p.stdout), p.stdout
    assert "'exact_match,none': 1.0" in p.stdout and "'acc,none': 1.0" in p.stdout
