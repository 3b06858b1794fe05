"""The README's lm-evaluation-harness recipe as a complete program: the ``megatron_tree`` backend at
CP 2 against lm-eval's own ``hf`` backend in one process.

Run (from anywhere, offline, about 35 s on 2 CPU cores):

    python examples/lm_eval_backend.py [OUTPUT_DIR]

It runs, with the small trained Llama that examples/tiny_checkpoint.py writes and the local tasks
in examples/lm_eval_tasks (multiple choice and greedy generation over the sentences the model
was trained on), the two commands it prints:

    torchrun --standalone --nproc_per_node 2 -m megatron_tree.eval.lm_eval --model megatron_tree \\
        --model_args pretrained=CKPT,cp_size=2 --tasks ex_story,ex_continue \\
        --include_path examples/lm_eval_tasks --batch_size 2 --device cpu --output_path OUT/tree --log_samples
    python -m megatron_tree.eval.lm_eval --model hf --model_args pretrained=CKPT ... --output_path OUT/hf

each from OUTPUT_DIR as its working directory (the task files' data paths are relative to the
task files). Every request's log-likelihood and every generation must agree, and so must the
metrics. Default OUTPUT_DIR: outputs/examples/lm_eval.
"""

import glob
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from tiny_checkpoint import DEFAULT_DIR, ensure  # noqa: E402

TASKS = "ex_story,ex_continue"


def lm_eval(launch: list[str], model: str, model_args: str, out: str, cwd: str) -> dict:
    cmd = [*launch, "-m", "megatron_tree.eval.lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASKS,
           "--include_path", os.path.join(HERE, "lm_eval_tasks"), "--batch_size", "2", "--device", "cpu",
           "--output_path", out, "--log_samples"]
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    print(f"  done in {time.monotonic() - t0:.0f} s", flush=True)
    results = json.load(open(sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))[-1]))
    samples = {}
    for task in TASKS.split(","):
        path = sorted(glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True))[-1]
        samples[task] = [json.loads(line) for line in open(path)]
    return {"results": results["results"], "samples": samples}


def main() -> int:
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "outputs", "examples", "lm_eval"))
    os.makedirs(out, exist_ok=True)
    ckpt = ensure(DEFAULT_DIR)
    py = sys.executable
    tree = lm_eval([py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], "megatron_tree",
                   f"pretrained={ckpt},cp_size=2", os.path.join(out, "tree"), out)
    hf = lm_eval([py], "hf", f"pretrained={ckpt},dtype=float32", os.path.join(out, "hf"), out)
    worst, compared, generations = 0.0, 0, 0
    for task in TASKS.split(","):
        a = sorted(tree["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(hf["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) > 0, (task, len(a), len(b))
        for x, y in zip(a, b):
            for rx, ry in zip(x["resps"], y["resps"]):
                if isinstance(rx[0], list):  # loglikelihood: [logprob, is_greedy]
                    worst = max(worst, abs(float(rx[0][0]) - float(ry[0][0])))
                    assert rx[0][1] == ry[0][1], (task, x["doc_id"], rx, ry)
                    compared += 1
                else:  # a generation
                    assert rx == ry, (task, x["doc_id"], rx, ry)
                    generations += 1
    for task in TASKS.split(","):
        mt_metrics = {k: v for k, v in tree["results"][task].items() if not k.endswith("_stderr,none")}
        hf_metrics = {k: v for k, v in hf["results"][task].items() if not k.endswith("_stderr,none")}
        print(f"  {task}: megatron_tree CP 2 {mt_metrics}  |  hf {hf_metrics}")
        assert mt_metrics == hf_metrics, (task, mt_metrics, hf_metrics)
    print(f"lm-eval megatron_tree at CP 2 vs lm-eval's hf in one process: {compared} log-likelihoods within "
          f"{worst:.2e}, {generations} generations identical, metrics identical; outputs in {out}")
    assert worst < 1e-4, worst
    return 0


if __name__ == "__main__":
    sys.exit(main())
