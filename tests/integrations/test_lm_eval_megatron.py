"""lm-eval backend ``megatron_tree`` over a Megatron-Core checkpoint (``source=megatron``) against Megatron's own model.

A checkpoint is written by a short training loop (``tests/helpers/megatron_ckpt.py``: Megatron-LM's
``--save`` layout, ``dist_checkpointing.save``, the training arguments in ``common.pt``) with a
vocabulary the word-level tokenizer of ``tests/integrations/test_lm_eval.py`` fills. Two gloo ranks run the
shipped tasks through the backend at CP 2 (``MegatronLM``: tree attention, the KV cache sharded);
then rank 0, in the same process, runs them through an oracle backend on Megatron's own
``GPTModel`` at CP = 1 and TP = 1 (``DotProductAttention``, no megatron_tree code in its
attention), filled from the same checkpoint: every request's log-likelihood within 1e-4, the
same greedy flags, identical greedy generations and identical task metrics. The oracle reuses
the backend's request handling (tokenisation, rolling windows, stop strings) and replaces only
the model: one full causal forward per row, greedy generation by re-running it. Bad input
(unknown key, checkpoints that cannot load, a request beyond ``max_length``): the same error on
both ranks, exit status 2 through the CLI, before any forward. Through the CLI, a good run
writes one results file whose metrics are the oracle's.
"""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import shutil

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.launching import train_checkpoint

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'megatron_tree[lmeval]')")
pytest.importorskip("megatron.core", reason="megatron-core is not installed")

from tests.helpers.lm_eval import close_enough, offline_env, Req, build_tokenizer, evaluate, per_request, write_tasks  # noqa: E402

TASKS = ["mt_choice", "mt_gen", "mt_ppl", "mt_letters"]
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_megatron")
    tok = build_tokenizer(str(root / "tok"))
    ckpt = root / "ckpt"
    ckpt.mkdir()
    train_checkpoint(ckpt, root / "train.json", [[5, 6, 7]], 1, timeout=300,
                     shape={"vocab_size": len(tok), "max_position_embeddings": 256})
    write_tasks(str(root / "tasks"))
    # Checkpoints that cannot load: no training arguments; a truncated data file.
    for name in ("no_args", "truncated"):
        shutil.copytree(ckpt, root / name)
    os.remove(root / "no_args" / "iter_0000004" / "common.pt")
    data = sorted((root / "truncated" / "iter_0000004").glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    return str(root)


def _oracle_lm(workdir: str):
    """The backend's request handling over Megatron's own GPTModel at CP = 1 (the checkpoint's weights)."""
    from lm_eval.api.model import TemplateLM
    from transformers import AutoTokenizer

    from megatron_tree.integrations import lm_eval as backend
    from megatron_tree.integrations.megatron import checkpoint as mc
    from megatron_tree.integrations.megatron import model as mm

    args = backend.model_args_from({"pretrained": os.path.join(workdir, "ckpt"), "source": "megatron",
                                    "tokenizer": os.path.join(workdir, "tok"), "max_length": MAX_LENGTH,
                                    "batch_size": 3})
    shape, info = backend.check_checkpoint(args)
    single = mm.single_rank_groups()  # collective: every rank of the default group calls the oracle's builder
    if torch.distributed.get_rank() != 0:
        return None
    src = mm.build_gpt(shape, tree=False, pg_collection=single, seed=0)
    assert type(src.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    mc.fill_from_global(src, mc.read_global_tensors(info.dist_dir, mc.expected_tensor_shapes(shape)))
    ref = mm.MegatronReference(src)

    class Oracle(backend.TreeLM):
        def __init__(self):
            TemplateLM.__init__(self)
            self.args, self.tokenizer, self._max_length, self.batch_size = (
                args, AutoTokenizer.from_pretrained(args.tokenizer), MAX_LENGTH, 3)
            self.groups, self._dp_group, self._rank, self._world_size = None, None, 0, 1
            self._device, self.model = torch.device("cpu"), None
            self.scored = self.prefill_tokens = self.prefill_tokens_unshared = self._generations = 0
            self._stop_ids_of, self._vocab_texts = {}, None  # TreeLM's stop-token caches (_stop_ids)

        def _forward_rows(self, rows):
            return [torch.log_softmax(ref(torch.tensor([inp]))[0, len(inp) - k:].float(), dim=-1) for inp, k in rows]

        def _generate(self, prompts, max_new_tokens, *, do_sample, stop_token_ids, **kw):
            assert not do_sample, "the oracle generates greedily only"
            out = []
            for p in prompts:
                toks = []
                while len(toks) < max_new_tokens and not (toks and toks[-1] in stop_token_ids):
                    toks.append(int(ref(torch.tensor([p + toks]))[0, -1].argmax()))
                out.append(toks)
            return out

    return Oracle()


def _cli(argv) -> tuple[int, str]:
    """``python -m megatron_tree.eval.lm_eval`` in this rank: (exit status, stderr)."""
    from megatron_tree.eval.lm_eval import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def _rank(rank, world, workdir):
    offline_env()
    from megatron_tree.integrations import lm_eval as backend

    ckpt, tok, tasks = (os.path.join(workdir, n) for n in ("ckpt", "tok", "tasks"))
    base = f"pretrained={ckpt},source=megatron,tokenizer={tok},max_length={MAX_LENGTH}"
    out = {"bad": {}}
    for name, margs in {"unknown": f"{base},cp_size=2,cp_sise=2",
                        "missing": f"pretrained={workdir}/nowhere,source=megatron,tokenizer={tok},cp_size=2",
                        "no_args": f"pretrained={workdir}/no_args,source=megatron,tokenizer={tok},cp_size=2",
                        "truncated": f"pretrained={workdir}/truncated,source=megatron,tokenizer={tok},cp_size=2",
                        "no_tokenizer": f"pretrained={ckpt},source=megatron,cp_size=2",
                        "allgather": f"{base},cp_size=2,prefill=allgather"}.items():
        out["bad"][name] = _cli(["--model", "megatron_tree", "--model_args", margs, "--tasks", "mt_choice",
                                 "--include_path", tasks, "--device", "cpu"])

    # As if each rank were on a node of its own (LOCAL_WORLD_SIZE 1): Megatron's flat CP group [0, 1] spans two
    # nodes, so its level is "inter" (intra_size 1), what merge auto's cost model prices; before, "intra" always.
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        lm = backend.TreeLM.create_from_arg_string(f"{base},cp_size=2,strategy=auto", {"batch_size": 3, "device": "cpu"})
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    out["levels"] = [(lv.name, lv.ranks) for lv in lm.groups.levels], lm.groups.intra_size
    too_long = []
    for call in (lambda: lm.loglikelihood([Req("the cat " * 40, " sees the dog")]),
                 lambda: lm.generate_until([Req("the cat " * 30, {"until": ["."], "max_gen_toks": 8})])):
        try:
            call()
            too_long.append(None)
        except backend.RequestError as e:
            too_long.append(str(e))
    out["too_long"], out["scored_before"] = too_long, lm.scored
    res = evaluate(lm, None, tasks, tasks=TASKS)
    out.update(tree=None if res is None else per_request(res), cp_rank=lm.cp_rank, scored=lm.scored,
               info=lm.get_model_info())
    oracle = _oracle_lm(workdir)  # inside the backend's CPU shim, beside Megatron's groups (its seeding reads them)
    if oracle is not None:
        out["oracle"] = per_request(evaluate(oracle, None, tasks, tasks=TASKS))
    lm.close()
    # The CLI end to end: a second backend in this process (Megatron's groups made again), one results file.
    out["cli"] = _cli(["--model", "megatron_tree", "--model_args", f"{base},cp_size=2", "--tasks", "mt_choice",
                       "--include_path", tasks, "--batch_size", "2", "--device", "cpu",
                       "--output_path", os.path.join(workdir, "cli_out")])
    return out


def test_megatron_checkpoint_cp2_matches_megatron_cp1(workdir):
    results = run_ranks(_rank, 2, workdir, timeout=600)
    messages = {"unknown": "unknown model_args key(s) ['cp_sise']", "missing": "does not exist",
                "no_args": "no training arguments stored with the checkpoint",
                "truncated": "is truncated", "no_tokenizer": "source=megatron needs model_args tokenizer=",
                "allgather": "prefill='allgather' is not available with source=megatron"}
    for rank, r in enumerate(results):
        for name, message in messages.items():
            code, err = r["bad"][name]
            assert code == 2 and f"rank {rank}:" in err and message in err, (rank, name, code, err)
        assert "needs 82 tokens" in r["too_long"][0] and "beyond max_length=64" in r["too_long"][0], r["too_long"]
        assert "context of 60 tokens; with max_gen_toks=8 it needs 68" in r["too_long"][1], r["too_long"]
        assert r["scored_before"] == 0, "a refused request must not run"
        assert r["info"]["source"] == "megatron" and r["info"]["cp_size"] == 2
        assert r["levels"] == ([("inter", (0, 1))], 1), r["levels"]
    oracle = results[0]["oracle"]
    assert {t for t, *_ in oracle["requests"]} == set(TASKS)
    gens = [v for k, v in oracle["requests"].items() if k[0] == "mt_gen"]
    assert len(gens) == 5 and any(gens), f"the oracle generated nothing: {gens}"
    for r in results:
        close_enough(oracle, r["tree"], f"CP 2 rank {r['cp_rank']} vs Megatron's own model at CP 1")
    assert results[0]["scored"] == results[1]["scored"] > 0
    assert [r["cli"][0] for r in results] == [0, 0], [r["cli"][1][-2000:] for r in results]
    files = glob.glob(os.path.join(workdir, "cli_out", "**", "results_*.json"), recursive=True)
    assert len(files) == 1, f"results written {len(files)} times: {files}"
    with open(files[0], encoding="utf-8") as f:
        written = json.load(f)["results"]["mt_choice"]
    assert written["acc,none"] == oracle["metrics"]["mt_choice"]["acc,none"]
    assert written["acc_norm,none"] == oracle["metrics"]["mt_choice"]["acc_norm,none"]
