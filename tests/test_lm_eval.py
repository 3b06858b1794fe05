"""lm-evaluation-harness backend ``megatron_tree`` against lm-eval's own ``hf`` backend.

Tiny random Llama (llama3 RoPE scaling) and Qwen2 (QKV biases) checkpoints, saved with
``save_pretrained`` beside a word-level tokenizer built here offline, are evaluated on the task
files shipped in ``tests/lm_eval_tasks`` (multiple choice with four continuations, greedy and
sampled ``generate_until`` cut at stop strings, rolling perplexity over documents longer than
``max_length``): once in this process by lm-eval's ``hf`` backend, and by the backend on gloo
ranks at CP 2, CP 3 and CP 4 = 2 x 2 (one launch per world; the 4-rank launch also runs
DP 2 x CP 2 through the CLI entry point). Per request: log-likelihoods within 1e-4, the same
greedy flags, identical greedy generations and identical task metrics; sampled generations the
same on every rank. DP x CP: every request scored once, one results file, one wandb run.
Bad input is checked in this process where it needs no process group.
"""

from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

from distributed import run_ranks

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'megatron_tree[lmeval]')")

HERE = os.path.dirname(os.path.abspath(__file__))
TASK_DIR = os.path.join(HERE, "lm_eval_tasks")
TASKS = ["mt_choice", "mt_gen", "mt_sample", "mt_ppl"]
MAX_LENGTH = 64
BATCH = 3
WORDS = ("the a one two red blue green cat dog bird fish tree house river sun moon star is was has sees likes "
         "eats runs big small old new fast slow and or but then here there now so very my your our it they we you")


# --------------------------------------------------------------------------- fixtures (built offline)


def build_tokenizer(path: str):
    """A word-level tokenizer over WORDS (+ '.', ',', <unk>, <pad>, </s>), saved as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<unk>", "<pad>", "</s>", ".", ","] + WORDS.split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def build_model(arch: str, path: str, tok, seed: int = 0):
    """A tiny random transformers causal LM over ``tok``'s vocabulary; biases and norms randomised."""
    import transformers as tf

    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                  rms_norm_eps=1e-6, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                  bos_token_id=None, tie_word_embeddings=False)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, head_dim=16, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    else:
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def write_tasks(out_dir: str) -> str:
    """The shipped task YAMLs with their data files made absolute (lm-eval reads them relative to the cwd)."""
    os.makedirs(out_dir, exist_ok=True)
    for name in TASKS:
        with open(os.path.join(TASK_DIR, f"{name}.yaml"), encoding="utf-8") as f:
            text = f.read().replace("tests/lm_eval_tasks/", TASK_DIR + "/")
        with open(os.path.join(out_dir, f"{name}.yaml"), "w", encoding="utf-8") as f:
            f.write(text)
    return out_dir


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lm_eval"))
    tok = build_tokenizer(os.path.join(root, "tok"))
    for arch in ("llama", "qwen2"):
        build_model(arch, os.path.join(root, arch), tok, seed={"llama": 0, "qwen2": 1}[arch])
    write_tasks(os.path.join(root, "tasks"))
    return root


# --------------------------------------------------------------------------- running lm-eval


def evaluate(model: str, model_args: str, tasks_dir: str, tasks=TASKS, **kw):
    """lm-eval's ``simple_evaluate`` on the shipped tasks; returns its results (None off rank 0)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), batch_size=BATCH,
                                   device="cpu", log_samples=True, task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
                                   **kw)


def per_request(results) -> dict:
    """{(task, doc_id, request index): response} and {task: metrics} from simple_evaluate's results."""
    reqs = {}
    for task, samples in results["samples"].items():
        for s in samples:
            for j, r in enumerate(s["resps"]):
                reqs[(task, s["doc_id"], j)] = r[0]
    metrics = {t: {k: v for k, v in m.items() if "stderr" not in k and k != "alias"}
               for t, m in results["results"].items()}
    return {"requests": reqs, "metrics": metrics}


def hf_reference(workdir: str, arch: str) -> dict:
    import lm_eval.models.huggingface  # noqa: F401 -- registers "hf"

    res = evaluate("hf", f"pretrained={os.path.join(workdir, arch)},max_length={MAX_LENGTH},dtype=float32",
                   os.path.join(workdir, "tasks"), tasks=[t for t in TASKS if t != "mt_sample"])
    return per_request(res)
