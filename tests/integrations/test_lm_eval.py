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
import re

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.lm_eval import BATCH, SHARED, TASK_DIR, TASKS, Req, close_enough, offline_env, build_tokenizer, evaluate, per_request, write_tasks  # noqa: F401

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'megatron_tree[lmeval]')")

MAX_LENGTH = 64


# --------------------------------------------------------------------------- fixtures (built offline)



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
    model.save_pretrained(path)  # the tokenizer stays in its own directory (transformers would load a Qwen2
    # checkpoint's tokenizer files as its Qwen2Tokenizer class)



@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lm_eval"))
    tok = build_tokenizer(os.path.join(root, "tok"))
    for arch in ("llama", "qwen2"):
        build_model(arch, os.path.join(root, arch), tok, seed={"llama": 0, "qwen2": 1}[arch])
    write_tasks(os.path.join(root, "tasks"))
    return root


# --------------------------------------------------------------------------- running lm-eval



def hf_reference(workdir: str, arch: str, tasks) -> dict:
    import lm_eval.models.huggingface  # noqa: F401 -- registers "hf"

    res = evaluate("hf", f"pretrained={os.path.join(workdir, arch)},tokenizer={os.path.join(workdir, 'tok')},max_length={MAX_LENGTH},dtype=float32",
                   os.path.join(workdir, "tasks"), tasks=tasks)
    return per_request(res)


# --------------------------------------------------------------------------- ranks



def _rank_eval(rank, world, workdir, runs, cli=None, bad_cp=None):
    """Each run: (arch, extra model_args, tasks) through simple_evaluate with a TreeLM made here.

    Returns per run: the DP rank's per-request responses and metrics (None off DP rank 0), and
    this rank's (DP rank, CP rank, scored, prefill tokens). ``cli``: argv for the launcher's
    ``main`` after the runs; ``bad_cp``: a cp_size that does not divide the world, tried first.
    """
    offline_env()
    torch.manual_seed(100 + rank)  # ranks seeded differently: sampled tokens must still agree
    from megatron_tree.integrations import lm_eval as backend

    out = {}
    if bad_cp is not None:
        try:
            backend.TreeLM.create_from_arg_string(f"pretrained={os.path.join(workdir, 'llama')},cp_size={bad_cp}")
            out["bad_cp"] = None
        except backend.ModelArgsError as e:
            out["bad_cp"] = str(e)
    runs_out = []
    for arch, extra, tasks in runs:
        lm = backend.TreeLM.create_from_arg_string(
            f"pretrained={os.path.join(workdir, arch)},tokenizer={os.path.join(workdir, 'tok')},max_length={MAX_LENGTH},{extra}",
            {"batch_size": BATCH, "device": "cpu"})
        res = evaluate(lm, None, os.path.join(workdir, "tasks"), tasks=tasks)
        runs_out.append({"result": None if res is None else per_request(res), "dp": (lm.rank, lm.world_size),
                         "cp_rank": lm.cp_rank, "scored": lm.scored, "prefill_tokens": lm.prefill_tokens,
                         "prefill_tokens_unshared": lm.prefill_tokens_unshared})
    out["runs"] = runs_out
    if cli is not None:
        from megatron_tree.eval.lm_eval import main

        out["cli"] = main(cli)
    return out



@pytest.fixture(scope="module")
def references(workdir):
    offline_env()
    # The tasks each checkpoint's runs below compare: Qwen2 runs the greedy tasks only (no prefix-shared
    # mt_letters, no mt_sample); mt_sample is compared between ranks, not with hf.
    return {"llama": hf_reference(workdir, "llama", GREEDY + [SHARED]), "qwen2": hf_reference(workdir, "qwen2", GREEDY)}


def _check_cp_runs(results, references, runs, what):
    """Every CP rank of DP rank 0 returns the hf backend's responses; sampled text equal on every rank."""
    for i, (arch, extra, tasks) in enumerate(runs):
        per_rank = [r["runs"][i] for r in results if r["runs"][i]["dp"][0] == 0]
        ref = {"requests": {k: v for k, v in references[arch]["requests"].items() if k[0] in tasks},
               "metrics": {t: m for t, m in references[arch]["metrics"].items() if t in tasks}}
        for r in per_rank:
            close_enough(ref, r["result"], f"{what} {arch} ({extra}), CP rank {r['cp_rank']}")
        samples = [{k: v for k, v in r["result"]["requests"].items() if k[0] == "mt_sample"} for r in per_rank]
        if any(samples):
            assert all(s == samples[0] for s in samples), f"{what}: sampled generations differ between CP ranks"
            assert len(samples[0]) == 5 and any(samples[0].values()), "mt_sample produced nothing"


ALL = TASKS
GREEDY = [t for t in TASKS if t != "mt_sample"]  # sampling is checked on Llama (its logits are the greedy path's)


def test_cp2_llama_qwen2(workdir, references):
    runs = [("llama", "cp_size=2,strategy=auto,prefill=ring", ALL), ("qwen2", "cp_size=2,strategy=packed", GREEDY),
            ("llama", "cp_size=2", [SHARED])]
    results = run_ranks(_rank_eval, 2, workdir, runs, timeout=600)
    _check_cp_runs(results, references, runs, "CP 2")
    # Prefix sharing, counted: 4 questions x 4 one-token choices prefill each context once, not 4 times.
    with open(os.path.join(TASK_DIR, "letters.jsonl"), encoding="utf-8") as f:
        contexts = [len(json.loads(line)["question"].split()) for line in f]
    for r in results:
        shared = r["runs"][2]
        assert shared["scored"] == 16
        assert shared["prefill_tokens"] == sum(contexts), shared
        assert shared["prefill_tokens_unshared"] == 4 * sum(contexts), shared


def test_cp3(workdir, references):
    runs = [("qwen2", "cp_size=3,strategy=shifted,prefill=allgather", GREEDY)]
    results = run_ranks(_rank_eval, 3, workdir, runs, bad_cp=2, timeout=600)
    for r in results:  # refused on every rank, before any collective
        assert r["bad_cp"] and "cp_size=2 does not divide the world of 3 ranks" in r["bad_cp"]
    _check_cp_runs(results, references, runs, "CP 3")


def test_cp2x2_and_dp2_cp2(workdir, references, tmp_path):
    """CP 4 = 2 x 2 on Llama; then DP 2 x CP 2: every request scored once, one results file, one wandb run."""
    out = str(tmp_path / "out")
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    runs = [("llama", "cp_size=4,intra_size=2,strategy=two_level", ALL),
            ("llama", "cp_size=2,strategy=auto", ["mt_choice", "mt_ppl"])]
    cli = ["--model", "megatron_tree", "--model_args",
           f"pretrained={os.path.join(workdir, 'llama')},tokenizer={os.path.join(workdir, 'tok')},cp_size=2,"
           f"max_length={MAX_LENGTH}",
           "--tasks", "mt_choice,mt_gen", "--include_path", os.path.join(workdir, "tasks"), "--batch_size", "2",
           "--device", "cpu", "--output_path", out, "--log_samples", "--wandb_args", "project=mt_lmeval,mode=offline"]
    results = run_ranks(_rank_eval, 4, workdir, runs, cli=cli, timeout=900, env={"WANDB_DIR": str(wandb_dir)})
    _check_cp_runs(results, references, runs[:1], "CP 2x2")

    dp = [r["runs"][1] for r in results]
    assert sorted(r["dp"] for r in dp) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    ref = references["llama"]["requests"]
    # lm-eval pads DP rank 1's list (2 of 5 documents) with copies of its last request: scored once.
    unique = {k for k in ref if k[0] == "mt_choice"}
    ppl_windows = None
    for r in dp:
        assert r["result"] is None or r["dp"][0] == 0
    by_dp = {d: [r for r in dp if r["dp"][0] == d] for d in (0, 1)}
    for d, rs in by_dp.items():
        assert len({r["scored"] for r in rs}) == 1, f"CP peers of DP rank {d} scored different counts"
    total = sum(rs[0]["scored"] for rs in by_dp.values())
    ppl_windows = total - len(unique)
    assert ppl_windows == sum(_windows(workdir)), f"scored {total}: requests scored more or less than once"
    close_enough({"requests": {k: v for k, v in ref.items() if k[0] in ("mt_choice", "mt_ppl")},
            "metrics": {t: references["llama"]["metrics"][t] for t in ("mt_choice", "mt_ppl")}},
           by_dp[0][0]["result"], "DP 2 x CP 2")

    files = glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True)
    assert len(files) == 1, f"results written {len(files)} times: {files}"
    samples = glob.glob(os.path.join(out, "**", "samples_*.jsonl"), recursive=True)
    assert sorted(os.path.basename(s).split("_2")[0] for s in samples) == ["samples_mt_choice", "samples_mt_gen"]
    with open(files[0], encoding="utf-8") as f:
        written = json.load(f)
    assert written["results"]["mt_choice"]["acc,none"] == references["llama"]["metrics"]["mt_choice"]["acc,none"]
    for s in samples:
        with open(s, encoding="utf-8") as f:
            docs = [json.loads(line)["doc_id"] for line in f]
        assert sorted(docs) == list(range(5)), f"{s}: documents {docs}, expected each of 5 once"
    runs_dirs = glob.glob(str(wandb_dir / "**" / "offline-run-*"), recursive=True)
    assert len(runs_dirs) == 1, f"wandb runs: {runs_dirs}"


def _windows(workdir):
    """Rolling windows lm-eval makes of each mt_ppl document at MAX_LENGTH (what the backend scores)."""
    from lm_eval import utils as lm_utils
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(workdir, "tok"))
    with open(os.path.join(TASK_DIR, "ppl.jsonl"), encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    return [len(list(lm_utils.get_rolling_token_windows(tok.encode(d), tok.eos_token_id, MAX_LENGTH, 1)))
            for d in docs]


# --------------------------------------------------------------------------- bad input (one process)



def test_bad_input(workdir, capsys, monkeypatch):
    offline_env()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from megatron_tree.integrations import lm_eval as backend
    from megatron_tree.eval.lm_eval import main

    llama, tok = os.path.join(workdir, "llama"), os.path.join(workdir, "tok")
    cases = [
        (f"pretrained={llama},cp_sise=2", "unknown model_args key(s) ['cp_sise']"),
        ("cp_size=2", "needs model_args pretrained="),
        (f"pretrained={llama},cp_size=2", "cp_size=2 does not divide the world of 1 ranks"),
        (f"pretrained={llama},cp_size=two", "cp_size must be an integer, got 'two'"),
        (f"pretrained={llama},strategy=ring", "strategy='ring' is not one of"),
        (f"pretrained={llama},dtype=float8", "dtype='float8' is not one of"),
        (f"pretrained={llama},batch_size=auto", "batch_size=auto is not supported"),
        (f"pretrained={llama},transport=tcp", "transport='tcp' is not one of ['auto', 'backend', 'shm']"),
        (f"pretrained={llama},source=megatron,transport=shm", "transport=shm is available with source=hf only"),
        (f"pretrained={workdir}/missing", "is not a transformers checkpoint directory"),
        (f"pretrained={llama},source=megatron", "source=megatron needs model_args tokenizer="),
        (f"pretrained={llama},source=megatron,tokenizer={workdir}/tok", "is not a Megatron distributed checkpoint"),
    ]
    for args, message in cases:
        with pytest.raises(backend.ModelArgsError) as e:
            backend.TreeLM.create_from_arg_string(args)
        assert message in str(e.value), (args, str(e.value))

    # model_args batch_size/device beside lm-eval's --batch_size/--device (which its CLI always passes, 1 by
    # default): the model_args value is taken, not a TypeError for a keyword given twice
    lm = backend.TreeLM.create_from_arg_obj(
        {"pretrained": llama, "tokenizer": tok, "max_length": 16, "batch_size": 2, "device": "cpu"},
        {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    assert lm.batch_size == 2 and lm.device.type == "cpu"
    with pytest.raises(backend.RequestError, match="needs 18 tokens .* beyond max_length=16; this backend never"):
        lm.loglikelihood([Req("the cat " * 8, " sees the dog")])
    with pytest.raises(backend.RequestError, match="context of 12 tokens; with max_gen_toks=8 it needs 20"):
        lm.generate_until([Req("the cat " * 6, {"until": ["."], "max_gen_toks": 8})])
    with pytest.raises(backend.RequestError, match=r"generation kwargs \['num_beams'\]"):
        lm.generate_until([Req("the cat", {"until": ["."], "max_gen_toks": 2, "num_beams": 4})])
    # generation kwargs transformers refuses when sampling, and a budget of no tokens: one line naming the
    # key as the request gave it, never the decode loop's own argument names
    for gen_kwargs, message in (({"do_sample": True, "top_k": -1, "max_gen_toks": 4}, "top_k=-1 must be an integer >= 0"),
                                ({"do_sample": True, "top_k": 2.5, "max_gen_toks": 4}, "top_k=2.5 must be an integer >= 0"),
                                ({"do_sample": True, "top_p": 1.5, "max_gen_toks": 4}, "top_p=1.5 must lie in (0, 1]"),
                                ({"do_sample": True, "temperature": -1.0, "max_gen_toks": 4}, "temperature=-1.0 must be >= 0"),
                                ({"max_gen_toks": 0}, "max_gen_toks=0 must be a positive integer"),
                                ({"max_new_tokens": -3}, "max_new_tokens=-3 must be a positive integer"),
                                ({"max_gen_toks": "ten"}, "'max_gen_toks': 'ten'")):
        with pytest.raises(backend.RequestError, match=f"request 0: .*{re.escape(message)}"):
            lm.generate_until([Req("the cat", {"until": ["."], **gen_kwargs})])
    assert lm.scored == 0 and lm.prefill_tokens == 0, "a refused batch must not run"
    # top_k=0 and top_p=1.0 are transformers' "no top-k" / "no top-p": the same draws as neither given
    sampled = []
    for extra in ({}, {"top_k": 0}, {"top_p": 1.0}, {"top_k": 0, "top_p": 1.0}):
        lm._generations = 0  # each call's first batch draws with seed + 0
        sampled.append(lm.generate_until([Req("the cat", {"until": ["."], "max_gen_toks": 6, "do_sample": True,
                                                          **extra})]))
    assert sampled[1:] == sampled[:1] * 3, sampled
    # A task's stop strings repeat for every request: the vocabulary's texts are decoded once per backend (the
    # calls above did it), not once per batch (128K token texts each time for a Llama-3 tokenizer), and each set
    # of stop strings' tokens are found once -- the same tokens as a search of the whole vocabulary.
    real, vocab_decodes = lm.tokenizer.batch_decode, []
    monkeypatch.setattr(lm.tokenizer, "batch_decode",
                        lambda ids, **kw: (vocab_decodes.append(len(ids)), real(ids, **kw))[1])
    for until in (["."], ["the", "."], [".", "the"]):
        lm.generate_until([Req("the cat", {"until": until, "max_gen_toks": 2})])
    assert all(n < len(lm.tokenizer) for n in vocab_decodes), vocab_decodes
    special = set(lm.tokenizer.all_special_ids)
    texts = real([[i] for i in range(len(lm.tokenizer))])
    want = {i for i, t in enumerate(texts) if i not in special and ("the" in t or "." in t)} | {lm.eot_token_id}
    assert len(want) > 2 and set(lm._stop_ids(["the", "."])) == want == set(lm._stop_ids([".", "the", ""]))
    # A request that fits runs, and a rolling document longer than max_length is windowed, not refused.
    assert len(lm.loglikelihood_rolling([Req("the cat sees the dog " * 8)])) == 1

    with pytest.raises(SystemExit) as e:
        main(["--model", "megatron_tree", "--model_args", f"pretrained={llama},bogus=1", "--tasks", "mt_choice",
              "--include_path", os.path.join(workdir, "tasks"), "--device", "cpu"])
    assert e.value.code == 2
    assert "rank 0: unknown model_args key(s) ['bogus']" in capsys.readouterr().err

    # --apply_chat_template is refused by name before the model loads; a model_args key that the lm-eval flag
    # given beside it contradicts is refused (the same value twice is not a contradiction)
    tasks = os.path.join(workdir, "tasks")
    for argv, message in ((["--model_args", f"pretrained={llama}", "--device", "cpu", "--apply_chat_template"],
                           "--apply_chat_template is not supported by --model megatron_tree"),
                          (["--model_args", f"pretrained={llama},batch_size=2", "--batch_size", "4"],
                           "model_args batch_size=2 and --batch_size 4 disagree"),
                          (["--model_args", f"pretrained={llama},device=cuda", "--device", "cpu"],
                           "model_args device=cuda and --device cpu disagree")):
        with pytest.raises(SystemExit) as e:
            main(["--model", "megatron_tree", "--tasks", "mt_gen", "--include_path", tasks, *argv])
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert f"megatron_tree.eval.lm_eval: rank 0: {message}" in err and "Traceback" not in err, err
    with pytest.raises(backend.ModelArgsError, match="--apply_chat_template is not supported"):
        lm.chat_template(True)  # lm-eval's Python API asks the model first

    # lm-eval's own checks of its flags: one line and status 2 too, not a traceback
    tasks = os.path.join(workdir, "tasks")
    for argv, message in ((["--tasks", "mt_choice,no_such_task"], "Tasks not found: no_such_task"),
                          (["--config", os.path.join(workdir, "missing.yaml")], "Config file not found: ")):
        with pytest.raises(SystemExit) as e:
            main(["--model", "megatron_tree", "--model_args", f"pretrained={llama}", "--include_path", tasks, *argv])
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert f"megatron_tree.eval.lm_eval: rank 0: error: {message}" in err and "Traceback" not in err, err
    # and only those: the same exception types raised anywhere else are not taken for bad input
    from megatron_tree.eval.lm_eval import _raised_by_lm_eval_input_check

    with pytest.raises(ValueError) as e:
        raise ValueError("Tasks not found: x")
    assert not _raised_by_lm_eval_input_check(e.value)
    import lm_eval.utils
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    with pytest.raises(TypeError) as e:  # lm-eval's, but not a check of its CLI input
        lm_eval.utils.hash_dict_images([])
    assert not _raised_by_lm_eval_input_check(e.value)

    @register_model("mt_test_failing")
    class Failing(LM):  # a backend that fails on its own: its error stands, with its traceback
        def __init__(self, **kwargs):
            raise ValueError("a backend's own failure")

        loglikelihood = loglikelihood_rolling = generate_until = None

    with pytest.raises(ValueError, match="a backend's own failure"):
        main(["--model", "mt_test_failing", "--include_path", tasks, "--tasks", "mt_choice"])
    assert "megatron_tree.eval.lm_eval: rank 0: error" not in capsys.readouterr().err


def test_max_length_beyond_the_models_window_is_refused_before_any_request(workdir, capsys, monkeypatch):
    """model_args max_length above the checkpoint's max_position_embeddings (256 here): the CP prefill refuses
    every prompt longer than the window, so such a max_length only defers the failure to the first long request,
    mid-evaluation, as a ValueError traceback on every rank. It is refused when the model is made, named, and
    through the CLI with exit 2 and one line, before any task is read; max_length up to the window is taken."""
    offline_env()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from megatron_tree.integrations import lm_eval as backend
    from megatron_tree.eval.lm_eval import main

    llama, tok = os.path.join(workdir, "llama"), os.path.join(workdir, "tok")
    message = "max_length=512 is beyond the model's window (max_position_embeddings = 256, "
    with pytest.raises(backend.ModelArgsError, match=re.escape(message)):
        backend.TreeLM.create_from_arg_string(f"pretrained={llama},tokenizer={tok},max_length=512", {"device": "cpu"})
    with pytest.raises(SystemExit) as e:
        main(["--model", "megatron_tree", "--model_args", f"pretrained={llama},tokenizer={tok},max_length=512",
              "--tasks", "mt_choice", "--include_path", os.path.join(workdir, "tasks"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"rank 0: model_args {message}" in err and "Traceback" not in err, err
    lm = backend.TreeLM.create_from_arg_string(f"pretrained={llama},tokenizer={tok},max_length=256", {"device": "cpu"})
    assert lm.max_length == 256


def test_the_cli_checks_model_args_in_every_form_lm_eval_takes(workdir, tmp_path, capsys, monkeypatch):
    """lm-eval 0.4.13's CLI takes model_args as ``--model_args k=v,k=v``, as space-separated ``k=v`` items, as a
    JSON object, through ``-a``, and from a ``--config`` YAML. The launcher's check before the task index read only
    the single token after ``--model_args``: ``-a`` was refused as "needs model_args pretrained=", JSON as unknown
    keys '{"pretrained":...', a YAML's model_args likewise, and space-separated items past the first were not seen
    (a contradicting ``--batch_size`` went through). Now each form is checked as lm-eval will pass it: here a
    max_length past the model's window (256) is named in every form, and the contradiction is refused."""
    offline_env()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    from megatron_tree.eval.lm_eval import main

    llama, tok, tasks = os.path.join(workdir, "llama"), os.path.join(workdir, "tok"), os.path.join(workdir, "tasks")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"model_args": {"pretrained": llama, "tokenizer": tok, "max_length": 512}}))
    too_long = "model_args max_length=512 is beyond the model's window"
    for argv, message in (
            (["-a", f"pretrained={llama},tokenizer={tok},max_length=512"], too_long),
            (["--model_args", json.dumps({"pretrained": llama, "tokenizer": tok, "max_length": 512})], too_long),
            (["--model_args", f"pretrained={llama}", f"tokenizer={tok}", "max_length=512"], too_long),
            (["--config", str(config)], too_long),
            (["--model_args", f"pretrained={llama}", f"tokenizer={tok}", "batch_size=2", "--batch_size", "4"],
             "model_args batch_size=2 and --batch_size 4 disagree")):
        with pytest.raises(SystemExit) as e:
            main(["--model", "megatron_tree", *argv, "--tasks", "mt_choice", "--include_path", tasks, "--device", "cpu",
                  "--limit", "1"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"megatron_tree.eval.lm_eval: rank 0: {message}" in err, (argv, err)
        assert "Traceback" not in err, err
    # lm-eval's precedence: a command-line model_args replaces the YAML's (EvaluatorConfig.from_cli), so a YAML with
    # max_length=256 beside a command-line max_length=512 runs at 512, and is refused as such before lm-eval reads
    # any task (a task that does not exist is never reached; the model's own check would come after it)
    config_ok = tmp_path / "ok.yaml"
    config_ok.write_text(json.dumps({"model_args": {"pretrained": llama, "tokenizer": tok, "max_length": 256}}))
    with pytest.raises(SystemExit) as e:
        main(["--model", "megatron_tree", "--config", str(config_ok), "--model_args",
              f"pretrained={llama},tokenizer={tok},max_length=512", "--tasks", "no_such_task", "--include_path", tasks,
              "--device", "cpu", "--limit", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"megatron_tree.eval.lm_eval: rank 0: {too_long}" in err and "Traceback" not in err, err


def test_the_cli_indexes_the_include_path_alone_where_it_defines_every_task(tmp_path):
    """lm-eval's CLI reads its ~15,000 own task files on every rank before --include_path: where every task
    named is a plain task of the include path, only that path is indexed (an included task overrides a
    built-in one of its name in the full index too); a group, a tag, a pattern, a YAML path, a built-in
    task or no include path keep lm-eval's full index."""
    import shutil

    import lm_eval.tasks
    from megatron_tree.eval.lm_eval import _included_task_names, included_tasks_only

    full = lm_eval.tasks.TaskManager
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name in ("mt_choice", "mt_gen"):
        shutil.copy(os.path.join(TASK_DIR, f"{name}.yaml"), tasks)
    (tasks / "both.yaml").write_text("group: mt_both\ntask:\n  - mt_choice\n  - mt_gen\n")
    (tasks / "tagged.yaml").write_text((tasks / "mt_gen.yaml").read_text().replace("task: mt_gen", "task: mt_tagged\ntag: mt_tag"))
    (tasks / "starred.yaml").write_text((tasks / "mt_gen.yaml").read_text().replace("task: mt_gen", "task: mt_g*"))
    include = ["--include_path", str(tasks)]
    assert _included_task_names(["--model", "megatron_tree", *include, "--tasks", "mt_choice,mt_gen", "--device",
                                 "cpu"]) == ["mt_choice", "mt_gen"]
    with included_tasks_only([*include, "--tasks=mt_tagged"]) as alone:
        assert alone and lm_eval.tasks.TaskManager is not full
        index = lm_eval.tasks.TaskManager(include_path=str(tasks))  # as lm-eval's CLI builds it
        assert "mt_tagged" in index.all_tasks and "hellaswag" not in index.all_tasks
    assert lm_eval.tasks.TaskManager is full
    for argv in ([*include, "--tasks", "mt_choice,hellaswag"], [*include, "--tasks", "mt_*"],
                 [*include, "--tasks", str(tasks / "mt_gen.yaml")], [*include, "--tasks", "mt_both"],
                 [*include, "--tasks", "mt_tag"], ["--tasks", "mt_choice"],
                 ["--include_path", str(tmp_path / "missing"), "--tasks", "mt_choice"],
                 # lm-eval also reads space-separated names, repeated flags, -t and abbreviations: its parser alone
                 [*include, "--tasks", "mt_choice", "hellaswag"], [*include, "--tasks", "mt_gen", "--tasks", "hellaswag"],
                 [*include, "--tasks", "hellaswag", "--tasks", "mt_gen"],
                 [*include, "-t", "hellaswag", "--tasks", "mt_choice"], [*include, "--task", "mt_choice"],
                 # a name lm-eval would also match as a pattern over the full index (mt_gen and mt_g* here)
                 [*include, "--tasks", "mt_g*"]):
        assert _included_task_names(argv) is None, argv
        with included_tasks_only(argv) as alone:
            assert alone is False and lm_eval.tasks.TaskManager is full, argv
