"""No silent wrong answer, one error on every rank: values ranks share are compared, bad writes refused.

Single-process cases: the paged cache's writes (shapes, row counts, layer indices; nothing written
on a bad call). Multi-rank cases run in one launch (``fail_alike``) on 3 gloo ranks (a world that
is not a power of two) and return, for each case, what every rank raised and how long it took.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tree.decode.paged import PagedKVCache


# --------------------------------------------------------------------------- paged cache writes


def _paged(layers=2, hkv=2, d=4):
    return PagedKVCache(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=4, blocks_per_rank=4,
                        max_seq_len=32, cp_size=2, cp_rank=0)


@pytest.mark.parametrize("call,kind,needle", [
    (lambda c, p: c.write(0, torch.ones(3, 1, 4), torch.ones(3, 2, 4), p), ValueError,
     r"write: k must have shape \(3, 2, 4\) \(tokens placed, num_kv_heads, head_dim\), got \(3, 1, 4\)"),
    (lambda c, p: c.write(0, torch.ones(5, 2, 4), torch.ones(5, 2, 4), p), ValueError,
     r"write: k must have shape \(3, 2, 4\).*got \(5, 2, 4\)"),
    (lambda c, p: c.write(0, torch.ones(3, 2, 4), torch.ones(2, 2, 4), p), ValueError,
     r"write: v must have shape \(3, 2, 4\).*got \(2, 2, 4\)"),
    (lambda c, p: c.write(-1, torch.ones(3, 2, 4), torch.ones(3, 2, 4), p), ValueError,
     r"write: layer index -1 is outside \[0, 2\)"),
    (lambda c, p: c.write(2, torch.ones(3, 2, 4), torch.ones(3, 2, 4), p), ValueError,
     r"write: layer index 2 is outside \[0, 2\)"),
    (lambda c, p: c.write(True, torch.ones(3, 2, 4), torch.ones(3, 2, 4), p), TypeError,
     r"write: layer must be an integer index in \[0, 2\), got bool True"),
    (lambda c, p: c.write(0, torch.ones(3, 2, 4, dtype=torch.int64), torch.ones(3, 2, 4), p), TypeError,
     r"write: k must be a floating-point tensor, got torch.int64"),
    (lambda c, p: c.write(0, torch.ones(3, 2, 4), torch.ones(3, 2, 4), [0, 1, 2]), TypeError,
     r"write: placed must be the TokenSlots of extend\(\), got list"),
])
def test_paged_write_refuses_bad_shapes_rows_and_layers_and_writes_nothing(call, kind, needle):
    c = _paged()
    placed = c.extend("r", 3)
    before = (c.k.clone(), c.v.clone())
    with pytest.raises(kind, match=needle):
        call(c, placed)
    assert torch.equal(c.k, before[0]) and torch.equal(c.v, before[1])  # nothing written
    c.write(1, torch.ones(3, 2, 4), torch.full((3, 2, 4), 2.0), placed)  # the good call still works
    mine = int((placed.owners == 0).sum())
    assert int((c.k[1] != 0).any(-1).any(-1).sum()) == mine and not bool((c.k[0] != 0).any())


def test_transformers_checkpoint_tensors_disagreeing_with_config_json_are_named_before_launch(tmp_path):
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree.eval.config import ConfigError, ModelConfig
    from megatron_tree.eval.launch import check_model

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(str(tmp_path))
    assert check_model(ModelConfig(source="hf", path=str(tmp_path)))[1] == 2048  # as saved: fine
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 64, "intermediate_size": 48}))
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        check_model(ModelConfig(source="hf", path=str(tmp_path)))
    message = str(e.value)
    assert f"model.path: the tensors disagree with {tmp_path / 'config.json'}" in message, message
    assert "model.embed_tokens.weight is [32, 16] in model.safetensors, config.json gives [64, 16]" in message
    assert "mlp.gate_proj.weight is [32, 16]" in message and "different models" in message, message
    assert time.monotonic() - start < 30  # headers only


def test_prompt_file_that_is_not_utf8_is_a_named_error_with_exit_2(tmp_path, capsys):
    from megatron_tree.eval import generate as generate_megatron

    f = tmp_path / "prompts.txt"
    f.write_bytes(b"1 2 3\n4 5\n\xff\xfe 6\n")
    with pytest.raises(Exception) as e:
        generate_megatron.read_prompts(generate_megatron.parse_args(["--sample-input-file", str(f)]), None, 32)
    assert type(e.value).__name__ == "ConfigError"
    assert f"{str(f)!r} is not UTF-8 text: byte 10 (line 3) is b'\\xff'" in str(e.value), str(e.value)
    f.write_bytes(b"1 2 3\r\n\n4 5\n")  # UTF-8 still reads as before: blank lines skipped
    texts, ids = generate_megatron.read_prompts(generate_megatron.parse_args(["--sample-input-file", str(f)]),
                                                None, 32)
    assert ids == [[1, 2, 3], [4, 5]]
    f.write_bytes(b"\xff")
    assert generate_megatron.main(["--sample-input-file", str(f)]) == 2
    err = capsys.readouterr().err
    assert "megatron-tree-generate: rank 0: error: --sample-input-file: " in err and "Traceback" not in err, err


def test_generate_megatron_refuses_to_run_past_max_position_embeddings(capsys):
    from megatron_tree.eval import generate as generate_megatron

    argv = ["--prompt", "1 2 3", "--out-seq-length", "15", "model.max_position_embeddings=16"]
    assert generate_megatron.main(argv) == 2  # 3 + 15 - 1 = 17 positions, the model has 16
    err = capsys.readouterr().err
    assert ("rank 0: error: --out-seq-length: prompt 0 has 3 tokens; with --out-seq-length 15 it needs 17 "
            "positions, but the model has max_position_embeddings 16") in err and "Traceback" not in err, err


# --------------------------------------------------------------------------- multi-rank: one launch

import os  # noqa: E402
import pickle  # noqa: E402
import time  # noqa: E402

from tests.helpers.ranks import outcome, run_ranks  # noqa: E402

T = 3.0  # seconds: the TreeGroups timeout of the cases that must fail within a bound
PG_TIMEOUT = 8.0  # the default group's: TreeGroups.build() without timeout= inherits it
WORLD = 3


def _shards(world, b=2, sq=1, hq=4, hkv=2, d=8, seed=0):
    """q and every rank's uneven (k, v) shard (rank r holds r + 1 keys per row... and rank 0 none)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g)
    ks = [torch.randn(b, r, hkv, d, generator=g) for r in range(world)]  # rank 0's shard is empty
    return q, ks


def _positioned(b, sq=2, hq=4, hkv=2, d=8, seed=3):
    """q at the last ``sq`` of 12 global positions, the 12 keys/values, their positions and each rank's
    slice of them: ranks 0, 1, 2 hold positions [0, 3), [3, 7), [7, 12), so a window of 6 hides rank 0's
    shard, part of rank 1's and none of rank 2's."""
    g = torch.Generator().manual_seed(seed)
    n = 12
    q, k, v = (torch.randn(b, s, h, d, generator=g) for s, h in ((sq, hq), (n, hkv), (n, hkv)))
    qpos = torch.arange(n - sq, n).expand(b, sq).contiguous()
    return q, k, v, qpos, torch.arange(n), [slice(0, 3), slice(3, 7), slice(7, 12)]


ATTENTION = dict(softmax_scale=0.3, window=6, softcap=1.5)
"""The local attention settings of the cases where ranks disagree on one of them (each case changes one)."""


def _attention_settings(rank, q, k, v, qpos, kpos, cut, g, out):
    """Ranks that agree or disagree on tree_decode's softmax_scale, window and softcap: eager, overlapped, traced."""
    import math

    import megatron_tree as mt
    from megatron_tree.ops import reference
    from torch._dynamo.testing import CompileCounterWithBackend

    mine = dict(q_positions=qpos, k_positions=kpos[cut], strategy="packed")
    # agreeing ranks: rank 0 leaves the scale to the default, the others spell it out (one setting, resolved)
    same = dict(softmax_scale=None if rank == 0 else 1 / math.sqrt(q.shape[-1]), window=6, softcap=1.5)
    want, _ = reference.partial_attention(q, k, v, q_positions=qpos, k_positions=kpos, window=6, softcap=1.5)
    for overlap in (False, True):
        got = mt.tree_decode(q, k[:, cut], v[:, cut], g, overlap=overlap, **mine, **same)
        out[("attn_same_err", overlap)] = float((got - want).abs().max())
    ops: list = []

    def record(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def compiled(settings):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(record)
        return counter, torch.compile(lambda *t: mt.tree_decode(*t, g, **mine, **settings), fullgraph=True,
                                      backend=counter)

    counter, step = compiled(same)
    errs = [float((step(q, k[:, cut], v[:, cut]) - want).abs().max()) for _ in range(2)]
    out["attn_same_traced"] = errs, counter.frame_count, sum(o.startswith("megatron_tree.cp_merge") for o in ops)
    # disagreeing ranks, every rank's call changed (3 rows where the agreed calls had 2): every rank
    # compares at once
    q, k, v, qpos, kpos, _ = _positioned(3)
    mine["q_positions"] = qpos
    cases = {"attn_scale": dict(softmax_scale=0.5 if rank == 1 else 0.3),
             "attn_window": dict(window=5 if rank == 2 else 6),
             "attn_window_none": dict(window=None if rank == 0 else 6),
             "attn_softcap": dict(softcap=None if rank == 1 else 1.5)}
    for name, changed in cases.items():
        settings = {**ATTENTION, **changed}
        for overlap in (False, True):
            out[(name, overlap)] = outcome(
                lambda: mt.tree_decode(q, k[:, cut], v[:, cut], g, overlap=overlap, **mine, **settings))
        ops.clear()
        counter, step = compiled(settings)
        out[(name, "traced")] = outcome(lambda: step(q, k[:, cut], v[:, cut]))
        out[(name, "traced_ops")] = sum(o.startswith("megatron_tree.cp_merge") for o in ops)
    # speculative verification's merge (its own check compares the window, not the scale or the softcap):
    # three draft rows in a chain over each rank's keys
    from megatron_tree.decode.speculative import verify_attention

    chain = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    for name in ("attn_scale", "attn_softcap"):
        settings = {key: val for key, val in {**ATTENTION, **cases[name]}.items() if key != "window"}
        out[(name, "verify")] = outcome(lambda: verify_attention(q[:, :1].expand(-1, 3, -1, -1), k[:, cut], v[:, cut],
                                                                 k[:, :3], v[:, :3], chain, g, **settings))


def fail_alike_body(rank, world, outdir):
    import megatron_tree as mt
    from megatron_tree.ops import reference

    out: dict = {}
    import torch.distributed as dist

    sync = dist.barrier

    # -- shifted: the shift's values are compared on the merge's one SUM --
    g = mt.TreeGroups.build(timeout=T)
    q, ks = _shards(world, hq=4, hkv=2)  # GQA
    full = torch.cat(ks, 1)
    want, lse = reference.partial_attention(q, full, full)
    k = ks[rank]
    got, merged = mt.tree_decode(q, k, k, g, strategy="shifted", shift=lse.float(), return_lse=True)
    out["shift_same_err"] = float((got - want).abs().max())
    moved = lse.float() + (0.3 if rank == 1 else 0.0)  # finite, moderate: a wrong answer if unnoticed
    out["shift_differ"] = outcome(lambda: mt.tree_decode(q, k, k, g, strategy="shifted", shift=moved))
    out["shift_differ_overlap"] = outcome(
        lambda: mt.tree_decode(q, k, k, g, strategy="shifted", shift=moved, overlap=True))
    one_row = lse.float().clone()
    if rank == 2:
        one_row[1, 3, 0] += 1e-3  # one value of one row, one rank
    out["shift_one_value"] = outcome(lambda: mt.tree_decode(q, k, k, g, strategy="shifted", shift=one_row))
    flags: list = []
    got = mt.tree_decode(q, k, k, g, strategy="shifted", shift=moved, deferred=flags)
    out["shift_deferred_flag"] = [bool(f) for f in flags]
    # the same values held in another dtype are the same shift
    same = lse.double() if rank == 0 else lse.float()
    got = mt.tree_decode(q, k, k, g, strategy="shifted", shift=same.float() if rank else same)
    out["shift_dtype_err"] = float((got - want).abs().max())
    # -- NaN propagates at CP 3 in every strategy: a NaN in q or in one rank's keys is NaN for that
    #    row's heads, never an empty row's 0; every other entry exact --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    qn = q.clone()
    qn[0, 0, 1] = float("nan")  # row 0, query head 1 (KV head 0)
    kn = [x.clone() for x in ks]
    kn[2][1, 0, 1] = float("nan")  # rank 2's first key of row 1, KV head 1: query heads 2 and 3 see it
    nan = {}
    for strategy in (*mt.STRATEGIES, "shifted_redo"):
        for overlap in (False, True):
            kw = {}
            name = strategy
            if strategy.startswith("shifted"):
                name = "shifted"
                kw["shift"] = lse.float() - (200.0 if strategy == "shifted_redo" else 0.0)  # redo: far off
            for which, (qq, kk) in {"q": (qn, ks), "k": (q, kn)}.items():
                got = mt.tree_decode(qq, kk[rank], kk[rank], g, strategy=name, overlap=overlap, **kw)
                nan[(strategy, overlap, which)] = torch.isnan(got).any(-1).tolist()
                ref, _ = reference.partial_attention(qq, torch.cat(kk, 1), torch.cat(kk, 1))
                fine = ~torch.isnan(ref)
                nan[(strategy, overlap, which, "err")] = float((got[fine] - ref[fine]).abs().max())
    out["nan"] = nan

    # -- the local attention's settings: a merge of partials made with another scale, window or softcap
    #    on some rank is an error on every rank, never a silent wrong answer --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    q2, k2, v2, qpos, kpos, cuts = _positioned(2)
    _attention_settings(rank, q2, k2, v2, qpos, kpos, cuts[rank], g, out)

    # -- inputs that used to give an unclear error: a clear one, on the rank that passed them --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    empty = torch.zeros(0, 1, 4, 8)
    for strategy in ("allgather", "packed", "two_level", "shifted"):
        r = mt.tree_decode(empty, torch.zeros(0, 2, 2, 8), torch.zeros(0, 2, 2, 8), g, strategy=strategy,
                           shift=torch.zeros(0, 4, 1) if strategy == "shifted" else None)
        out[f"b0_{strategy}"] = tuple(r.shape)
    out["shift_meta"] = outcome(lambda: mt.tree_decode(q, k, k, g, strategy="shifted",
                                                        shift=torch.zeros(2, 4, 1, device="meta")))
    out["table_1d"] = outcome(lambda: mt.tree_decode(
        q, torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8), g, block_table=torch.zeros(2, dtype=torch.int32),
        cache_seqlens=torch.ones(2, dtype=torch.int32)))

    # -- transformers' own generate: sampling and stop settings are compared at the prefill --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree.integrations.hf import enable_tree_attention

    torch.manual_seed(0)
    lm = enable_tree_attention(LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval(), g)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    hf_cases = {
        "hf_temperature": dict(do_sample=True, temperature=0.7 if rank == 0 else 1.0),
        "hf_top_k": dict(do_sample=True, top_k=5 if rank == 2 else 50),
        "hf_do_sample": dict(do_sample=rank != 1),
        "hf_eos": dict(eos_token_id=7 if rank == 1 else None),
    }
    for name, kw in hf_cases.items():
        out[name] = outcome(lambda: lm.generate(ids, max_new_tokens=3, pad_token_id=0, **kw))
    out["hf_same"] = lm.generate(ids, max_new_tokens=3, do_sample=True, top_k=5, pad_token_id=0).tolist()
    from megatron_tree.integrations.hf import TreeCache

    other = TreeCache(lm, mt.TreeGroups.build(timeout=T))  # the same ranks, another process group
    out["hf_other_group"] = outcome(lambda: lm.generate(ids, max_new_tokens=2, past_key_values=other))
    out["hf_group_names"] = (other.groups.cp_group.group_name, g.cp_group.group_name)

    # -- one rank's bad cache_seqlens: that rank's error on every rank, never a bare timeout --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    lens = torch.full((2,), rank, dtype=torch.int32)
    bad = torch.full((3,), rank, dtype=torch.int32) if rank == 1 else lens  # one row too many
    out["local_first_call"] = outcome(lambda: mt.tree_decode(q, k, k, g, cache_seqlens=bad, strategy="packed"))
    out["local_every_rank"] = outcome(lambda: mt.tree_decode(
        q, k, k, g, cache_seqlens=torch.full((2,), 99, dtype=torch.int32), strategy="packed"))
    got = mt.tree_decode(q, k, k, g, cache_seqlens=lens, strategy="packed")  # still in step: nobody waited
    out["local_then_exact"] = float((got - want).abs().max())
    mt.tree_decode(q, k, k, g, cache_seqlens=lens, strategy="packed")
    out["local_steady"] = outcome(lambda: mt.tree_decode(q, k, k, g, cache_seqlens=bad, strategy="packed"))

    # -- an absent (alive, not calling) peer: CommError within 1.5 T on every other rank --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    mt.tree_decode(q, k, k, g, strategy="packed")
    if rank == 2:
        time.sleep(1.5 * T + 1)
    else:
        out["absent_steady"] = outcome(lambda: mt.tree_decode(q, k, k, g, strategy="packed"))
    sync()
    g = mt.TreeGroups.build(timeout=T)
    mt.tree_decode(q, k, k, g, strategy="packed")
    if rank == 2:
        time.sleep(1.5 * T + 1)
    else:  # a new signature on the others: they compare through the store, rank 2 never answers
        q3, ks3 = _shards(world, b=3)
        out["absent_changed"] = outcome(lambda: mt.tree_decode(q3, ks3[rank], ks3[rank], g, strategy="packed"))
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    sync()

    # -- TreeGroups.build without timeout= takes the default group's (8 s here): bounded, not 30 min --
    # (ranks 0 and 1 stay alive until rank 2 wakes: the first to time out must not exit while the other
    # still waits, or the other's liveness probe rightly reports it gone -- a CI run saw exactly that race)
    wake = time.monotonic() + 1.5 * PG_TIMEOUT + 1
    if rank != 2:
        out["absent_build"] = outcome(lambda: mt.TreeGroups.build())
    time.sleep(max(0.0, wake - time.monotonic()))  # rank 2 never calls; the default group is out of step afterwards
    return out


@pytest.fixture(scope="module")
def fail_alike(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("fail_alike")
    return run_ranks(fail_alike_body, WORLD, str(outdir), timeout=240, pg_timeout=PG_TIMEOUT)


def _same_everywhere(results, case, ranks=None):
    got = [results[r][case] for r in (range(WORLD) if ranks is None else ranks)]
    assert len({o[0] for o in got}) == 1 and len({o[1] for o in got}) == 1, f"{case}: ranks differ: {got}"
    return got[0][0], got[0][1], max(o[2] for o in got)


def test_shift_values_that_differ_between_ranks_are_an_error_on_every_rank(fail_alike):
    for res in fail_alike:
        assert res["shift_same_err"] < 1e-5 and res["shift_dtype_err"] < 1e-5
        assert res["shift_deferred_flag"] == [True]  # under a decode loop: the step is redone with packed
    for case in ("shift_differ", "shift_differ_overlap", "shift_one_value"):
        kind, message, seconds = _same_everywhere(fail_alike, case)
        assert kind == "DisagreementError", message
        assert "ranks disagree on merge: shift (a digest of its values): " in message, message
        assert seconds < T  # seen on the merge's own SUM: no timeout waited out
    _, message, _ = _same_everywhere(fail_alike, "shift_differ")
    assert "on ranks [0, 2]" in message and "on rank 1" in message, message
    _, message, _ = _same_everywhere(fail_alike, "shift_one_value")
    assert "on ranks [0, 1]" in message and "on rank 2" in message, message


@pytest.mark.parametrize("case,needle", [
    ("attn_scale", "softmax_scale: 0.3 on ranks [0, 2]; 0.5 on rank 1"),
    ("attn_window", "window: 6 on ranks [0, 1]; 5 on rank 2"),
    ("attn_window_none", "window: None on rank 0; 6 on ranks [1, 2]"),
    ("attn_softcap", "softcap: 1.5 on ranks [0, 2]; None on rank 1"),
])
@pytest.mark.parametrize("path", [False, True, "traced"], ids=["eager", "overlapped", "traced"])
def test_attention_settings_that_differ_between_ranks_are_an_error_on_every_rank(fail_alike, case, needle, path):
    """Each rank's partial is its local attention under its own softmax_scale, window and softcap: ranks
    that differ on one would merge into no attention at all. The merge's agreement names the setting and
    each rank's value, the same text on every rank, at once (every rank's call changed): the eager merge,
    the overlapped one (``SPLIT_SIGNATURE``) and a ``torch.compile(fullgraph=True)`` step, whose merge is
    the ``megatron_tree::cp_merge`` op carrying the settings."""
    kind, message, seconds = _same_everywhere(fail_alike, (case, path))
    assert kind == "DisagreementError", message
    assert f"ranks disagree on merge: {needle}. " in message, message  # that setting alone differs
    assert seconds < T, seconds
    if path == "traced":
        assert all(res[(case, "traced_ops")] == 1 for res in fail_alike)  # the merge traced as the op


@pytest.mark.parametrize("case,needle", [
    ("attn_scale", "softmax_scale: 0.3 on ranks [0, 2]; 0.5 on rank 1"),
    ("attn_softcap", "softcap: 1.5 on ranks [0, 2]; None on rank 1"),
])
def test_verify_attention_settings_that_differ_are_an_error_on_every_rank(fail_alike, case, needle):
    """The same for speculative verification, whose merge carries the draft rows: the scale and the softcap
    (its own all-gather compares the window) are the merge's agreement's, named alike on every rank."""
    kind, message, seconds = _same_everywhere(fail_alike, (case, "verify"))
    assert kind == "DisagreementError" and f"ranks disagree on merge: {needle}. " in message, message
    assert seconds < T, seconds


def test_agreeing_attention_settings_give_the_reference_with_the_scale_compared_resolved(fail_alike):
    """Rank 0 leaves softmax_scale to its default, ranks 1 and 2 pass 1/sqrt(d): one setting (the scale is
    compared as the kernel uses it), and with window and softcap alike the merge is the single-process
    reference's attention -- eager, overlapped and traced (twice: one trace, the settings a step's constants).
    Every strategy at CP 3 and 2 x 2 with these settings: ``tests/decode/test_variants.py``."""
    for res in fail_alike:
        assert res[("attn_same_err", False)] < 1e-5 and res[("attn_same_err", True)] < 1e-5, res
        errs, frames, merges = res["attn_same_traced"]
        assert max(errs) < 1e-5 and frames == 1 and merges == 1, res["attn_same_traced"]


def test_empty_batch_and_bad_placement_arguments_are_clear(fail_alike):
    for res in fail_alike:
        for strategy in ("allgather", "packed", "two_level", "shifted"):
            assert res[f"b0_{strategy}"] == (0, 1, 4, 8)  # B = 0: an empty result, no collective garbage
        kind, message, _ = res["shift_meta"]
        assert kind == "ValueError" and "shift is on meta, the attention's state on cpu" in message, message
    for case, needle in (("shift_meta", "shift is on meta"),
                         ("table_1d", "block_table must have shape (2, max_blocks) (one row per batch row), got (2,)")):
        kind, message, seconds = _same_everywhere(fail_alike, case)
        assert kind == "ValueError" and needle in message and seconds < T, message


def test_one_ranks_bad_cache_seqlens_is_its_error_on_every_rank(fail_alike):
    kind, message, seconds = _same_everywhere(fail_alike, "local_first_call")
    assert kind == "ValueError" and message.startswith("rank 1: cache_seqlens must have shape (2,)"), message
    assert seconds < T  # a first call compares on every rank: at once
    kind, message, seconds = _same_everywhere(fail_alike, "local_every_rank")
    assert kind == "ValueError" and message.startswith("rank 0: cache_seqlens must lie in [0, 0]"), message
    assert "; rank 2: cache_seqlens must lie in [0, 2] (the KV length), got values in [99, 99]" in message
    assert seconds < T
    assert all(res["local_then_exact"] < 1e-5 for res in fail_alike)
    # in steady state the others are already in the merge's collectives: they learn it when those time out
    kind, message, seconds = _same_everywhere(fail_alike, "local_steady")
    assert kind == "ValueError" and message.startswith("rank 1: cache_seqlens must have shape (2,)"), message
    assert "(the other ranks had entered the call's collectives and waited until their timeout" in message, message
    assert seconds < 1.5 * T


def test_absent_peer_is_reported_within_one_and_a_half_timeouts(fail_alike):
    for case in ("absent_steady", "absent_changed"):
        for res in fail_alike[:2]:  # rank 2 is the absent one; the backend's own text differs by rank
            kind, message, seconds = res[case]
            assert kind == "CommError", message
            assert seconds < 1.5 * T, (case, seconds, message)
            if case == "absent_steady":
                assert "timeout of 3 s" in message and "'cp' level (3 ranks)" in message, message
            else:
                assert "comparing arguments with the other 2 rank(s) got no answer" in message, message
    for res in fail_alike[:2]:
        kind, message, seconds = res["absent_build"]
        assert kind == "CommError" and "TreeGroups: exchanging topology facts" in message, message
        assert "timeout of 8 s" in message and seconds < 1.5 * PG_TIMEOUT, (seconds, message)


@pytest.mark.parametrize("case,needle", [
    ("hf_temperature", "temperature: 0.7 on rank 0; 1.0 on ranks [1, 2]"),
    ("hf_top_k", "top_k: 50 on ranks [0, 1]; 5 on rank 2"),
    ("hf_do_sample", "do_sample: True on ranks [0, 2]; False on rank 1"),
    ("hf_eos", "eos_token_id: None on ranks [0, 2]; 7 on rank 1"),
])
def test_transformers_generate_settings_that_differ_are_an_error_on_every_rank(fail_alike, case, needle):
    kind, message, seconds = _same_everywhere(fail_alike, case)
    assert kind == "DisagreementError" and "ranks disagree on hf.prefill: " in message, message
    assert needle in message, message
    assert seconds < T  # the prefill's one comparison, before any token is drawn
    assert len({str(res["hf_same"]) for res in fail_alike}) == 1  # alike settings: one generation everywhere


def test_a_treecache_of_another_group_over_the_same_ranks_is_told_apart(fail_alike):
    kind, message, seconds = _same_everywhere(fail_alike, "hf_other_group")
    theirs, ours = fail_alike[0]["hf_group_names"]
    assert theirs != ours
    assert kind == "ValueError" and seconds < T, message
    assert f"made for the CP group of ranks [0, 1, 2] (process group {theirs!r})" in message, message
    assert f"over the CP group of ranks [0, 1, 2] (process group {ours!r})" in message, message
    assert "the same ranks, but another process group" in message, message


def test_nan_in_q_or_in_one_ranks_keys_is_nan_for_that_row_at_cp3_in_every_strategy(fail_alike):
    import megatron_tree as mt

    want_q = [[[False, True, False, False]], [[False, False, False, False]]]  # (B, Sq, Hq)
    want_k = [[[False, False, False, False]], [[False, False, True, True]]]
    for res in fail_alike:
        nan = res["nan"]
        for strategy in (*mt.STRATEGIES, "shifted_redo"):
            for overlap in (False, True):
                assert nan[(strategy, overlap, "q")] == want_q, (strategy, overlap)
                assert nan[(strategy, overlap, "k")] == want_k, (strategy, overlap)
                for which in ("q", "k"):
                    assert nan[(strategy, overlap, which, "err")] < 1e-5, (strategy, overlap, which)


# --------------------------------------------------------------------------- Megatron checkpoints


def _dcp_checkpoint(path, *, untie=True):
    """A torch_dist checkpoint (DCP data files and .metadata, as dist_checkpointing writes) with
    Megatron-LM's training arguments in common.pt."""
    import argparse
    import json

    import torch.distributed.checkpoint as dcp

    from megatron_tree.integrations.megatron.checkpoint import expected_tensor_shapes
    from megatron_tree.integrations.megatron.model import GPTShape

    dims = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=128)
    shape = GPTShape(**dims, tie_word_embeddings=not untie)
    dcp.save({k: torch.randn(v) for k, v in expected_tensor_shapes(shape).items()}, checkpoint_id=str(path),
             no_dist=True)
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    args = argparse.Namespace(num_layers=1, hidden_size=16, ffn_hidden_size=32, num_attention_heads=2,
                              group_query_attention=True, num_query_groups=1, kv_channels=8, padded_vocab_size=32,
                              untie_embeddings_and_output_weights=untie)
    torch.save({"args": args}, path / "common.pt")
    return dims


def test_megatron_checkpoint_files_are_checked_before_any_collective(tmp_path):
    from megatron_tree.integrations.megatron.checkpoint import CheckpointError, check_checkpoint
    from megatron_tree.integrations.megatron.model import GPTShape

    ckpt = tmp_path / "iter_0000004"
    ckpt.mkdir()
    dims = _dcp_checkpoint(ckpt, untie=True)
    untied = GPTShape(**dims, tie_word_embeddings=False)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert check_checkpoint(str(tmp_path), untied).iteration == 4
    # the training argument as it was given, not the config field's negation
    with pytest.raises(CheckpointError, match=r"model\.tie_word_embeddings=True but the checkpoint was trained with "
                                              r"untie_embeddings_and_output_weights=True \(model\.tie_word_embeddings=False\)"):
        check_checkpoint(str(tmp_path), GPTShape(**dims, tie_word_embeddings=True))
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"4\xff\n")
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration\.txt is not UTF-8 text: byte 1 is "
                                              r"b'\\xff'"):
        check_checkpoint(str(tmp_path), untied)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    data = sorted(ckpt.glob("*.distcp"))
    assert data
    blob = data[0].read_bytes()
    data[0].write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match=rf"{data[0].name} is truncated: \.metadata says its data ends at byte "
                                              rf"\d+, the file has {len(blob) // 2}"):
        check_checkpoint(str(tmp_path), untied)
    data[0].unlink()
    with pytest.raises(CheckpointError, match=rf"{data[0].name} is missing"):
        check_checkpoint(str(tmp_path), untied)
