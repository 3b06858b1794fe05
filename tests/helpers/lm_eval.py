"""lm-eval tasks, tokenizer, requests and the evaluation call that the lm-eval backend tests share."""

from __future__ import annotations

import math
import os


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


TASK_DIR = os.path.join(HERE, "lm_eval_tasks")


TASKS = ["mt_choice", "mt_gen", "mt_sample", "mt_ppl"]


SHARED = "mt_letters"  # one-token choices: the four continuations of a question share one prefilled row


BATCH = 3


WORDS = ("the a one two red blue green cat dog bird fish tree house river sun moon star is was has sees likes "
         "eats runs big small old new fast slow and or but then here there now so very my your our it they we you")


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


def write_tasks(out_dir: str) -> str:
    """The shipped task YAMLs with their data files made absolute (lm-eval's own loader reads them relative
    to the cwd; ``python -m megatron_tree.eval.lm_eval`` reads them relative to the task file)."""
    os.makedirs(out_dir, exist_ok=True)
    for name in [*TASKS, SHARED]:
        with open(os.path.join(TASK_DIR, f"{name}.yaml"), encoding="utf-8") as f:
            text = f.read().replace("    test: ", f"    test: {TASK_DIR}/")
        with open(os.path.join(out_dir, f"{name}.yaml"), "w", encoding="utf-8") as f:
            f.write(text)
    return out_dir


def evaluate(model, model_args, tasks_dir: str, tasks=TASKS, **kw):
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


def offline_env():
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def close_enough(ref, got, what):
    assert set(got["requests"]) >= set(ref["requests"]), f"{what}: requests missing"
    for key, r in ref["requests"].items():
        g = got["requests"][key]
        if isinstance(r, str):
            assert g == r, f"{what} {key}: generated {g!r}, lm-eval's hf generated {r!r}"
        elif isinstance(r, (list, tuple)):
            assert abs(g[0] - r[0]) <= 1e-4 and g[1] == r[1], f"{what} {key}: {g} vs hf {r}"
        else:
            assert abs(g - r) <= 1e-4, f"{what} {key}: rolling log-likelihood {g} vs hf {r}"
    for task, m in ref["metrics"].items():
        for k, v in m.items():
            if isinstance(v, float) and "perplexity" in k or k.startswith("bits_per_byte"):
                assert math.isclose(got["metrics"][task][k], v, rel_tol=1e-5), f"{what} {task} {k}"
            else:
                assert got["metrics"][task][k] == v, f"{what} {task} {k}: {got['metrics'][task][k]} vs hf {v}"


class Req:
    """What the backend reads of lm-eval's ``Instance``: ``args``."""

    def __init__(self, *args):
        self.args = args
