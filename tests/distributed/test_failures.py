"""Failure behaviour: every bad input or fault is a clear error, the same on every rank, within a bound.

Multi-rank cases run on real gloo ranks (``megatron_tree/utils/testing.py``), batched into one 4-rank
launch that returns, for each case, what every rank raised (type, message, seconds). The
assertions check, on every rank: the exception type, that the message names the offending
values, that every rank raised the same text, that no rank returned a result, and that the
wait stayed within the timeout that bounds it. A rank killed by a signal fails the launch.

Single-process cases: strict cache writes, merge of zero states, broken checkpoints (the
eval's checks of a transformers checkpoint directory before launch).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time

import pytest
import torch

from tests.helpers.ranks import outcome, run_ranks

T = 3.0  # seconds: the TreeGroups timeout of the cases that must fail by timing out
PG_TIMEOUT = 60.0  # the default group's: generous, so slow process start-up never trips it


def _qkv(b, sq, hq, hkv, d, n, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(b, n, hkv, d, generator=g).to(dtype)
    return q, k, k.clone()


def _tiny_lm(groups, **shape):
    """A 1-layer random transformers Llama (the same weights on every rank) behind ``HFTreeModel``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree.integrations.hf import HFTreeModel

    kw = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1)
    torch.manual_seed(0)
    return HFTreeModel(LlamaForCausalLM(LlamaConfig(**{**kw, **shape})).eval(), groups)


def failures_body(rank, world, outdir):
    """Every multi-rank case on 4 ranks; returns {case: outcome} (and a few facts).

    Rank 3 dies in the last case, so every rank also saves its outcomes before then.
    """
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import megatron_tree as mt
    from megatron_tree.distributed import collectives
    from megatron_tree.ops import reference
    from megatron_tree.comm.baselines import ShardPlan
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.prefill import allgather_prefill, ring_prefill

    from megatron_tree.ops import triton as kernels  # noqa: F401 -- import Triton now, not inside a timed case
    from megatron_tree.integrations import hf  # noqa: F401 -- and transformers (the models of the cases below)

    out: dict = {}
    sync = dist.barrier  # the default group (PG_TIMEOUT): lines the ranks up between cases

    # -- bounded waits by default; topology facts exchanged once, the same error everywhere --
    g = mt.TreeGroups.build(intra_size=2)  # no timeout=: inherits the default group's
    out["timeouts"] = (g.timeout, [collectives.group_timeout(x).total_seconds()
                                   for x in (g.cp_group, *(lvl.group for lvl in g.levels))])
    env = lambda **kw: {k: str(v) for k, v in kw.items()}  # noqa: E731
    out["local_size_differs"] = outcome(lambda: mt.TreeGroups.from_env(
        env=env(LOCAL_WORLD_SIZE=4 if rank == 3 else 2, LOCAL_RANK=rank % 2)))
    out["local_rank_x"] = outcome(lambda: mt.TreeGroups.from_env(
        env=env(LOCAL_WORLD_SIZE=2, LOCAL_RANK="x" if rank == 1 else rank % 2)))
    out["round_robin"] = outcome(lambda: mt.TreeGroups.from_env(env=env(LOCAL_WORLD_SIZE=2, LOCAL_RANK=rank // 2)))
    out["args_differ"] = outcome(lambda: mt.TreeGroups.build(intra_size=2 if rank < 2 else None))
    out["bad_timeout"] = outcome(lambda: mt.TreeGroups.build(timeout=-1))

    # -- merge: every rank changes at once (fresh groups): an immediate, identical error --
    g = mt.TreeGroups.build(timeout=T)
    q, k, v = _qkv(2, 4, 4, 2, 8, 5)
    cases = {
        "swap_b_sq": lambda: ((q.reshape(4, 2, 4, 8), k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1)) if rank == 1
                              else (q, k, v), {}),
        "heads": lambda: (_qkv(2, 4, 8 if rank == 2 else 4, 2, 8, 5), {}),
        "dtype": lambda: (_qkv(2, 4, 4, 2, 8, 5, torch.float64 if rank == 0 else torch.float32), {}),
        "strategy": lambda: ((q, k, v), {"strategy": "allgather" if rank == 3 else "packed"}),
        "backend": lambda: ((q, k, v), {"backend": "triton" if rank == 0 else "torch"}),
    }
    for name, make in cases.items():
        (qq, kk, vv), kw = make()
        kw.setdefault("strategy", "packed")
        sync()
        out["merge_" + name] = outcome(lambda: mt.tree_decode(qq, kk, vv, g, **kw))
    # the same groups still work, exactly, once the ranks agree (no collective was entered above)
    sync()
    full = torch.cat([_qkv(2, 4, 4, 2, 8, 5, seed=s)[1] for s in range(world)], dim=1)
    mine = _qkv(2, 4, 4, 2, 8, 5, seed=rank)[1]
    got = mt.tree_decode(q, mine, mine, g, strategy="packed")
    out["after_errors_exact"] = float((got - reference.partial_attention(q, full, full)[0]).abs().max())

    # -- steady state: no check, no extra collective; a change every rank makes: one check --
    checks = g.agreement.checks
    with CommDebugMode() as debug:
        for _ in range(3):
            mt.tree_decode(q, mine, mine, g, strategy="packed")
    out["steady"] = (g.agreement.checks - checks, debug.get_total_counts())
    q3, k3, _ = _qkv(3, 1, 4, 2, 8, 2 + rank)
    mt.tree_decode(q3, k3, k3, g, strategy="packed")
    out["change_all"] = g.agreement.checks - checks
    out["agreement_timeout"] = g.agreement.timeout.total_seconds()

    # -- only some ranks change: the others wait out T in the merge, then every rank knows --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    mt.tree_decode(q, k, v, g, strategy="packed")
    qq, kk = (q.reshape(4, 2, 4, 8), k.repeat(2, 1, 1, 1)) if rank == 1 else (q, k)
    out["partial_b_sq"] = outcome(lambda: mt.tree_decode(qq, kk, kk, g, strategy="packed"))
    sync()
    g = mt.TreeGroups.build(intra_size=2, timeout=T)
    mt.tree_decode(q, k, v, g, strategy="packed")
    out["partial_strategy"] = outcome(
        lambda: mt.tree_decode(q, k, v, g, strategy="two_level" if rank == 0 else "packed"))

    # -- a stuck (alive) peer: CommError within 2T on the others, no 30-minute wait --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    mt.tree_decode(q, k, v, g, strategy="packed")
    if rank == 2:
        time.sleep(2 * T + 1)
        out["stuck"] = None
    else:
        out["stuck"] = outcome(lambda: mt.tree_decode(q, k, v, g, strategy="packed"))

    # -- prefill and the baselines: one fixed-size exchange first, so even a partial change is immediate --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    pos = torch.arange(rank * 3, rank * 3 + 3)[None].expand(2, 3)
    pq, pk, pv = _qkv(2, 3, 4, 1 if rank == 1 else 2, 8, 3)
    out["prefill_heads"] = outcome(lambda: ring_prefill(pq, pk, pv, pos, pos, g))
    pq, pk, pv = _qkv(2, 3, 4, 2, 8, 3)
    fn = allgather_prefill if rank == 0 else ring_prefill
    out["prefill_method"] = outcome(lambda: fn(pq, pk, pv, pos, pos, g))
    out["shard_plan"] = outcome(lambda: ShardPlan.build(_qkv(2, 1, 4, 2, 16 if rank == 3 else 8, 3)[1], g))
    # models whose attention shapes agree but whose hidden size does not: the transformers prefill's check
    odd = _tiny_lm(g, hidden_size=32 if rank == 0 else 16, head_dim=8)  # built outside the timed call
    out["model_hidden"] = outcome(lambda: generate(odd, [[1, 2, 3]], 2, progress=False))
    # generate's one check per call: prompts (lengths, contents), budget, sampling; then the prefill's own
    lm = _tiny_lm(g)
    rows = [[1, 2, 3, 4, 5], [6, 7]]
    gen_cases = {
        "gen_lengths": (rows if rank != 2 else [[1, 2, 3, 4, 5], [6, 7, 8]], 2, {}),
        "gen_contents": (rows if rank != 1 else [[1, 2, 3, 4, 5], [6, 9]], 2, {}),
        "gen_max_new": (rows, 3 if rank == 3 else 2, {}),
        "gen_top_p": (rows, 2, {"do_sample": True, "top_p": 0.5 if rank == 0 else None}),
    }
    for name, (prompts, new, kw) in gen_cases.items():
        out[name] = outcome(lambda: generate(lm, prompts, new, progress=False, **kw))
    uneven = rows if rank != 2 else [[1, 2, 3, 4], [6, 7]]
    out["prefill_lengths"] = outcome(lambda: lm.prefill(uneven, lm.new_cache(2, 8)))
    # one rank's own arguments fail its checks: every rank raises that error at once, naming the rank
    bad_rows = rows if rank != 2 else [[1, 2, 99], [6, 7]]
    out["local_bad_prompt"] = outcome(lambda: generate(lm, bad_rows, 2, progress=False))
    short = pos[:, :2] if rank == 1 else pos
    out["local_bad_k_pos"] = outcome(lambda: ring_prefill(pq, pk, pv, pos, short, g))
    out["local_bad_everywhere"] = outcome(lambda: generate(lm, rows, 0, progress=False))
    out["local_after_errors"] = generate(lm, rows, 2, progress=False).tokens  # the group is still in step

    # -- a dead peer: every helper, prefill and generation raise CommError on the survivors --
    sync()
    g = mt.TreeGroups.build(timeout=T)
    model = _tiny_lm(g)
    out["generate_ok"] = generate(model, [[1, 2, 3]], 2, progress=False).tokens
    mt.tree_decode(q, k, v, g, strategy="packed")  # agreed: the same call after the death is unchanged
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    sync()
    if rank == 3:
        os._exit(0)  # dies without any cleanup
    calls = {
        "dead_all_reduce": lambda: collectives.all_reduce(torch.ones(4), g.cp_group, what="test"),
        "dead_all_gather": lambda: collectives.all_gather(torch.ones(4), g.cp_group, what="test"),
        "dead_broadcast": lambda: collectives.broadcast(torch.ones(4), 3, g.cp_group, what="test"),
        "dead_p2p": lambda: collectives.p2p([(torch.ones(4), 3)], [(torch.empty(4), 3)], g.cp_group,
                                            what="test").wait(),
        "dead_prefill": lambda: ring_prefill(pq, pk, pv, pos, pos, g),
        "dead_generate": lambda: generate(model, [[1, 2, 3]], 2, progress=False),
        "dead_merge": lambda: mt.tree_decode(q, k, v, g, strategy="packed"),
    }
    for name, fn in calls.items():
        out[name] = outcome(fn)
    return out


@pytest.fixture(scope="module")
def failures(tmp_path_factory):
    # TRITON_INTERPRET (conftest) reaches the ranks: rank 0's backend="triton" runs on CPU
    outdir = tmp_path_factory.mktemp("failures")
    results = run_ranks(failures_body, 4, str(outdir), timeout=240, pg_timeout=PG_TIMEOUT, expect_dead=(3,),
                        env={"MEGATRON_TREE_TRANSPORT": "backend"})  # (counts torch.distributed calls: the backend, no shared-memory channel)
    assert results[3] is None  # rank 3 died as planned; its earlier outcomes are on disk
    with open(outdir / "rank3.pkl", "rb") as f:
        results[3] = pickle.load(f)
    return results


def _same_everywhere(results, case, ranks=(0, 1, 2, 3)):
    """The outcome of ``case`` on every rank in ``ranks``: same type and message; returns (type, message, max s)."""
    got = [results[r][case] for r in ranks]
    kinds = {o[0] for o in got}
    messages = {o[1] for o in got}
    assert len(kinds) == 1 and len(messages) == 1, f"{case}: ranks differ: {got}"
    return got[0][0], got[0][1], max(o[2] for o in got)


def test_groups_get_the_default_groups_timeout_not_torchs_30_minutes(failures):
    for res in failures[:3]:
        own, each = res["timeouts"]
        assert own == PG_TIMEOUT and each == [PG_TIMEOUT] * 3  # cp + intra + inter, none at 1800 s
        assert res["agreement_timeout"] == T  # the agreement's T is its group's (a check waits 2T)


@pytest.mark.parametrize("case,needles", [
    ("local_size_differs", ["LOCAL_WORLD_SIZE=2 on ranks [0, 1, 2]", "LOCAL_WORLD_SIZE=4 on ranks [3]"]),
    ("local_rank_x", ["rank 1 has LOCAL_RANK='x'", "not an integer"]),
    ("round_robin", ["local ranks of ranks 0..3 are [0, 0, 1, 1]", "expected [0, 1, 0, 1]", "round-robin"]),
    ("args_differ", ["intra_size=2", "on ranks [0, 1]", "intra_size=None", "on ranks [2, 3]"]),
    ("bad_timeout", ["timeout must be a positive number", "-1"]),
])
def test_topology_errors_are_the_same_on_every_rank(failures, case, needles):
    kind, message, _ = _same_everywhere(failures, case)
    assert kind == "TopologyError", message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize("case,needles", [
    ("swap_b_sq", ["batch: 2 on ranks [0, 2, 3]; 4 on rank 1", "seqlen_q: 4 on ranks [0, 2, 3]; 2 on rank 1"]),
    ("heads", ["heads_q: 4 on ranks [0, 1, 3]; 8 on rank 2"]),
    ("dtype", ["dtype: 'float64' on rank 0; 'float32' on ranks [1, 2, 3]"]),
    ("strategy", ["strategy: 'packed' on ranks [0, 1, 2]; 'allgather' on rank 3"]),
    ("backend", ["backend: 'triton' on rank 0; 'torch' on ranks [1, 2, 3]"]),
])
def test_merge_disagreement_is_an_immediate_error_on_every_rank(failures, case, needles):
    kind, message, seconds = _same_everywhere(failures, "merge_" + case)
    assert kind == "DisagreementError", message
    for needle in needles:
        assert needle in message, message
    assert seconds < T, "every rank changed at once: no timeout to wait out"


def test_groups_still_exact_after_immediate_disagreements(failures):
    for res in failures[:3]:
        assert res["after_errors_exact"] < 1e-5


def test_steady_state_adds_no_collective_and_a_change_one_check(failures):
    for res in failures[:3]:
        checks, counted = res["steady"]
        assert checks == 0
        assert counted == 3 * 2  # packed: MAX + SUM per call, nothing else
        assert res["change_all"] == 1


@pytest.mark.parametrize("case,needles", [
    ("partial_b_sq", ["batch: 2 on ranks [0, 2, 3]; 4 on rank 1", "ranks [0, 2, 3] kept the previous call's"]),
    ("partial_strategy", ["strategy: 'two_level' on rank 0; 'packed' on ranks [1, 2, 3]"]),
])
def test_partial_change_is_a_disagreement_on_every_rank_after_the_timeout(failures, case, needles):
    kind, message, seconds = _same_everywhere(failures, case)
    assert kind == "DisagreementError", message
    for needle in needles:
        assert needle in message, message
    assert seconds < 2 * T + 5  # T in the merge's collective, then the comparison


def test_stuck_peer_is_a_comm_error_within_twice_the_timeout(failures):
    for rank in (0, 1, 3):  # rank 2 is the stuck one
        kind, message, seconds = failures[rank]["stuck"]
        assert kind == "CommError", message
        assert "timeout of 3 s" in message and "'cp' level (4 ranks)" in message, message
        # T in the merge, then at most T comparing notes (the test's FileStore rounds a wait up
        # by ~1 s); far below the default group's 60 s and torch's 30 minutes
        assert T - 0.5 < seconds < 2 * T + 10


@pytest.mark.parametrize("case,needles", [
    ("prefill_heads", ["heads_kv: 2 on ranks [0, 2, 3]; 1 on rank 1"]),
    ("prefill_method", ["method: 'allgather' on rank 0; 'ring' on ranks [1, 2, 3]"]),
    ("shard_plan", ["headdim: 8 on ranks [0, 1, 2]; 16 on rank 3"]),
    ("model_hidden", ["ranks disagree on hf.prefill: hidden_size: 32 on rank 0; 16 on ranks [1, 2, 3]"]),
    ("gen_lengths", ["ranks disagree on generate: prompt_lengths: (5, 2) on ranks [0, 1, 3]; (5, 3) on rank 2"]),
    ("gen_contents", ["ranks disagree on generate: prompt_ids: "]),
    ("gen_max_new", ["max_new_tokens: 2 on ranks [0, 1, 2]; 3 on rank 3"]),
    ("gen_top_p", ["top_p: 0.5 on rank 0; None on ranks [1, 2, 3]"]),
    ("prefill_lengths", ["ranks disagree on hf.prefill: seq: 5 on ranks [0, 1, 3]; 4 on rank 2"]),
])
def test_prefill_baseline_and_model_disagreement_is_immediate_on_every_rank(failures, case, needles):
    kind, message, seconds = _same_everywhere(failures, case)
    assert kind == "DisagreementError", message
    for needle in needles:
        assert needle in message, message
    assert seconds < T
    if case == "gen_contents":  # only what differs is named: the second prompt, on rank 1
        differing = message.split(". Every rank")[0]
        assert "prompt_lengths" not in differing and differing.count(" on rank 1") == 1, message


@pytest.mark.parametrize("case,kind,needles", [
    ("local_bad_prompt", "ValueError", ["rank 2: prompt 0 has token ids outside [0, 32): [99]"]),
    ("local_bad_k_pos", "ValueError", ["rank 1: k_pos must have shape (2, 3) (batch, seqlen_k), got (2, 2)"]),
    ("local_bad_everywhere", "ValueError", ["ranks [0, 1, 2, 3]: max_new_tokens must be a positive integer, got 0"]),
])
def test_one_ranks_bad_arguments_are_its_error_on_every_rank_at_once(failures, case, kind, needles):
    """A rank whose own arguments fail its checks does not leave the others waiting in the call's
    collectives: its status rides on the call's agreement all-gather and every rank raises its error."""
    got, message, seconds = _same_everywhere(failures, case)
    assert got == kind, message
    for needle in needles:
        assert needle in message, message
    assert seconds < T, "the others learn of the failure from the first exchange, not from a timeout"
    for res in failures:
        assert len(res["local_after_errors"]) == 2 and len(res["local_after_errors"][0]) == 2


@pytest.mark.parametrize("case,op", [
    ("dead_all_reduce", "all_reduce(SUM)"), ("dead_all_gather", "all_gather"), ("dead_broadcast", "broadcast from rank 3"),
    ("dead_p2p", "send/recv"), ("dead_prefill", "all_gather"), ("dead_generate", "all_gather"),
    ("dead_merge", "tree merge: all_reduce(MAX)"),
])
def test_dead_peer_is_a_comm_error_in_every_helper(failures, case, op):
    for res in failures[:3]:  # rank 3 is the one that died
        assert res["generate_ok"] and len(res["generate_ok"][0]) == 2
        kind, message, seconds = res[case]
        assert kind == "CommError", message
        assert op in message and "a peer rank may have died or timed out" in message, message
        # a closed connection is reported at once (before the group's timeout T could fire); a rank
        # that only sees a timeout compares notes (2T)
        assert seconds < (T if "connection closed" in message else 2 * T + 10), (seconds, message)


# --------------------------------------------------------------------------- single process


def _cache(**kw):
    from megatron_tree.decode import ShardedKVCache

    args = dict(num_layers=2, batch_size=2, max_seq_len=8, num_kv_heads=2, head_dim=4)
    args.update(kw)
    return ShardedKVCache(**args)


def test_cache_writes_check_shapes_and_layer_index():
    c = _cache()
    c.start_prefill([3, 2])
    good = torch.zeros(2, 3, 2, 4)
    with pytest.raises(ValueError, match=r"layer index 2 is outside \[0, 2\)"):
        c.write_prefill(2, good, good)
    with pytest.raises(ValueError, match=r"layer index -1 is outside \[0, 2\)"):
        c.layer_kv(-1)
    with pytest.raises(TypeError, match="layer must be an integer index, got float 1.0"):
        c.write_prefill(1.0, good, good)
    with pytest.raises(TypeError, match="layer must be an integer index, got bool True"):
        c.write_prefill(True, good, good)  # operator.index(True) would be layer 1
    with pytest.raises(ValueError, match=r"write_prefill: k must have shape \(2, S, 2, 4\).*got \(3, 3, 2, 4\)"):
        c.write_prefill(0, torch.zeros(3, 3, 2, 4), good)
    with pytest.raises(ValueError, match=r"write_prefill: v must have shape \(2, S, 2, 4\).*got \(2, 3, 1, 4\)"):
        c.write_prefill(0, good, torch.zeros(2, 3, 1, 4))
    with pytest.raises(ValueError, match=r"cover the same S >= 3 tokens"):
        c.write_prefill(0, good, torch.zeros(2, 4, 2, 4))
    c.write_prefill(0, good, good)
    _, slots = c.begin_decode_step()
    with pytest.raises(ValueError, match=r"append: k must have shape \(2, 1, 2, 4\).*got \(3, 2, 2, 4\)"):
        c.append(0, torch.ones(3, 2, 2, 4), torch.ones(3, 2, 2, 4), slots)  # stored k[:2, 0] before
    with pytest.raises(ValueError, match=r"append: v must have shape \(2, 1, 2, 4\).*got \(2, 1, 2, 8\)"):
        c.append(0, torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 8), slots)
    with pytest.raises(ValueError, match=r"slots must be the integer \(2,\) tensor"):
        c.append(0, torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4), slots[:1])
    with pytest.raises(ValueError, match=r"append: layer index 5 is outside \[0, 2\)"):
        c.append(5, torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4), slots)
    with pytest.raises(IndexError, match=r"append: a slot is beyond this rank's 8 storage slots per row"):
        c.append(0, torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4), torch.tensor([3, 99]))
    import megatron_tree as mt

    full = _cache(max_seq_len=3)
    full.start_prefill([3, 1])
    with pytest.raises(mt.CacheOverflowError, match="row 0 already holds 3 tokens"):  # exported at the top level
        full.begin_decode_step()
    before = c.k.clone()
    c.append(1, torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4), slots)
    assert int((c.k != before).any(-1).any(-1).sum()) == 2  # exactly the two new tokens of layer 1


def test_merge_states_of_zero_states_is_a_clear_error():
    import megatron_tree as mt

    with pytest.raises(ValueError, match=r"at least one partial state \(P >= 1\).*P = 0"):
        mt.merge_states(torch.zeros(0, 1, 1, 2, 4), torch.zeros(0, 1, 2, 1))
    with pytest.raises(TypeError, match="stacked tensor"):
        mt.merge_states([torch.zeros(1, 1, 2, 4)], torch.zeros(1, 1, 2, 1))


def _write_checkpoint(path, *, sharded=False):
    """A tiny random transformers Llama saved with ``save_pretrained`` (one file, or an index and several)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    model.save_pretrained(str(path), **({"max_shard_size": "4KB"} if sharded else {}))
    return model.state_dict()


def test_checkpoint_errors_name_the_file_and_the_problem(tmp_path, monkeypatch):
    """The eval's checks of a transformers checkpoint before launch (``model.source: hf``): every broken
    file is a ConfigError naming it and what is wrong, from headers and config alone."""
    from megatron_tree.eval.config import ConfigError, ModelConfig
    from megatron_tree.eval.launch import check_model
    from megatron_tree.eval.models import load_hf

    def check(path):
        return check_model(ModelConfig(source="hf", path=str(path)))

    good = tmp_path / "good"
    state = _write_checkpoint(good)
    loaded = load_hf(ModelConfig(source="hf", path=str(good))).state_dict()
    assert all(torch.equal(loaded[n], t) for n, t in state.items())
    st = good / "model.safetensors"
    blob = st.read_bytes()

    def variant(name, **files):
        d = tmp_path / name
        shutil.copytree(good, d)
        for fname, content in files.items():
            (d / fname).write_bytes(content)
        return d

    cases = [
        (variant("truncated", **{"model.safetensors": blob[: len(blob) - 100]}),
         ["model.safetensors is truncated", f"the file has {len(blob) - 100}"]),
        (variant("garbage", **{"model.safetensors": b"\x89PNG not a checkpoint at all" * 10}),
         ["model.safetensors announces a", "not a safetensors file"]),
        (variant("tiny", **{"model.safetensors": b"abc"}), ["model.safetensors is 3 bytes, too short"]),
        (variant("badjson", **{"config.json": b'{"vocab_size": 32,'}), ["config.json is not valid JSON", "line 1"]),
        (variant("notobj", **{"config.json": b"[1, 2]"}), ["config.json must hold a JSON object, got list"]),
        (variant("latin1", **{"config.json": b'{"model_type": "llama\xff"}'}), ["config.json is not UTF-8"]),
        (variant("badfield", **{"config.json": json.dumps(dict(model_type="llama", vocab_size="many", hidden_size=16,
                                                             intermediate_size=32, num_hidden_layers=1,
                                                             num_attention_heads=2)).encode()}),
         ["transformers cannot read", "config.json", "vocab_size", "'many'"]),
    ]
    for path, needles in cases:
        with pytest.raises(ConfigError) as e:
            check(path)
        for needle in needles:
            assert needle in str(e.value), (path.name, str(e.value))
        assert str(path) in str(e.value)

    sharded = tmp_path / "sharded"
    _write_checkpoint(sharded, sharded=True)
    assert check(sharded) == (None, 2048)  # (no Megatron checkpoint, the config's max_position_embeddings)
    names = sorted(set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert len(names) > 1
    os.remove(sharded / names[-1])
    with pytest.raises(ConfigError, match=rf"index.json names {names[-1]}, which is not in"):
        check(sharded)
    with pytest.raises(ConfigError, match="does not exist"):
        check(tmp_path / "nowhere")

    # the checks read headers and config only: they pass with tensor loading made impossible
    import safetensors

    def no_loading(*a, **k):
        raise AssertionError("the checks before launch must not load tensors")

    monkeypatch.setattr(safetensors, "safe_open", no_loading)
    assert check(good)[1] == 2048


def _one_rank_passes_a_bad_timeout(rank, world):
    import megatron_tree as mt

    out = {}
    for name, bad in (("inf", float("inf")), ("nan", float("nan")), ("bool", True), ("text", "ten"),
                      ("huge", 1e20)):
        out[name] = outcome(lambda: mt.TreeGroups.build(timeout=bad if rank == 1 else T))
    out["then_good"] = mt.TreeGroups.build(timeout=T).size  # every rank is still in step
    return out


_BAD_TIMEOUTS = {
    "inf": ["timeout_s='inf'", "(rank 1: timeout must be", "finite positive number of seconds, got inf"],
    "nan": ["timeout_s='nan'", "finite positive number of seconds, got nan"],
    "bool": ["timeout_s='True'", "got the bool True"],
    "text": ["timeout_s=\"'ten'\"", "got str 'ten'"],
    "huge": ["timeout_s='1e+20'", "timedelta's range"],
}


def test_one_ranks_unusable_timeout_is_the_same_topology_error_on_every_rank():
    """Before: an infinite (or too large) timeout on one rank raised OverflowError on that rank alone, before
    the facts exchange, and the others waited in it until the default group's timeout (torch's: 30 min);
    NaN was "cannot convert float NaN to integer", True a silent 1 s timeout."""
    results = run_ranks(_one_rank_passes_a_bad_timeout, 2, timeout=60, pg_timeout=PG_TIMEOUT)
    for case, needles in _BAD_TIMEOUTS.items():
        got = [r[case] for r in results]
        assert {g[0] for g in got} == {"TopologyError"} and len({g[1] for g in got}) == 1, (case, got)
        for needle in needles + ["ranks built TreeGroups with different arguments"]:
            assert needle in got[0][1], (case, got[0][1])
        assert max(g[2] for g in got) < 5.0, (case, got)
    assert [r["then_good"] for r in results] == [2, 2]
