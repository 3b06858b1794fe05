"""Chunked CP prefill through the transformers integration, against unmodified transformers in one process.

One 4-rank gloo launch: CP 2 (two groups side by side), CP 3 (rank 3 alone, CP 1) and CP 4 as
2 simulated nodes x 2. Every rank runs a tiny random Llama (GQA) enabled with
``max_prefill_tokens`` far below the prompts (so each prompt takes several windows, each over the
cache the earlier windows filled), on a left-padded batch of ragged rows (one of a single token),
and returns the logits of every prompt position and the greedy tokens; the parent holds them to
an fp64 forward as closely as transformers' own fp32 forward is (twice its error) and to its greedy tokens. The ring's own
counts (``PrefillWork``) show every window's causal work done exactly once. Ranks that disagree on
the layout or on ``max_prefill_tokens`` get the same ``DisagreementError``; a prompt past the
model's window is refused on every rank.
"""

from __future__ import annotations

import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.hf_models import LENGTHS, batch, hf_model

NEW = 6
TOPOLOGIES = {"cp2": ([[0, 1], [2, 3]], None), "cp3": ([[0, 1, 2], [3]], None), "cp2x2": (None, 2)}
CHUNK = 7  # windows of 4 tokens at CP 2, 6 at CP 1 and 3, 8 at CP 4 (prefill_chunk: a multiple of 2 x CP, at least 2 x CP)


def _rank_fn(rank, world):
    from megatron_tree.decode.prefill import PrefillWork
    from megatron_tree.integrations.hf import HFTreeModel
    from megatron_tree.integrations.hf.forward import prefill_chunk
    from megatron_tree.distributed.topology import TreeGroups

    ids, mask = batch()
    out = {}
    for name, (ranks, intra) in TOPOLOGIES.items():
        groups = TreeGroups.build(ranks, intra)
        for layout in ("load_balanced", "contiguous"):
            work = PrefillWork()
            m = HFTreeModel(hf_model("llama"), groups, layout=layout, block_size=4, work=work,
                            max_prefill_tokens=CHUNK)
            with torch.no_grad():
                logits = m.hf(input_ids=ids, attention_mask=mask).logits  # every position, pads 0
            pairs, blocks = work.pairs, work.blocks + work.skipped
            tokens = m.hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
            out[f"{name}/{layout}"] = dict(
                p=groups.size, chunk=prefill_chunk(CHUNK, groups.size), logits=logits.numpy(),
                tokens=tokens.tolist(), pairs=pairs, kernels=dict(work.kernels), blocks=blocks)
        # a prompt past the model's window: the same clear error on every rank, nothing truncated
        m = HFTreeModel(hf_model("llama", max_position_embeddings=16), groups, max_prefill_tokens=CHUNK)
        try:
            m.hf(input_ids=ids, attention_mask=mask)
            out[f"{name}/window"] = None
        except Exception as e:  # noqa: BLE001 -- the message is checked
            out[f"{name}/window"] = f"{type(e).__name__}: {e}"
        # past it with allow_beyond_window (RoPE: positions computed for any index): exact, as the model's own
        m = HFTreeModel(hf_model("llama", max_position_embeddings=16), groups, max_prefill_tokens=CHUNK,
                        allow_beyond_window=True)
        with torch.no_grad():
            out[f"{name}/beyond"] = m.hf(input_ids=ids, attention_mask=mask).logits.numpy()
    # ranks that disagree on the layout, or on the window of a chunked prefill: the same
    # DisagreementError on every rank of the group, before any KV moves
    groups = TreeGroups.build(None, 2)
    for what, kw in (("layout", dict(layout="contiguous" if rank == 0 else "load_balanced")),
                     ("max_prefill_tokens", dict(max_prefill_tokens=8 if rank == 3 else CHUNK))):
        m = HFTreeModel(hf_model("llama"), groups, **kw)
        try:
            m.hf(input_ids=ids, attention_mask=mask)
            out[f"disagree/{what}"] = None
        except Exception as e:  # noqa: BLE001 -- the type and message are checked
            out[f"disagree/{what}"] = (type(e).__name__, str(e))
    return out


def test_chunked_prefill_is_exact_on_every_topology():
    results = run_ranks(_rank_fn, 4, timeout=400)
    ids, mask = batch()
    ref_model = hf_model("llama")
    with torch.no_grad():
        fp32 = ref_model(input_ids=ids, attention_mask=mask).logits.double()
        ref_tokens = ref_model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                        pad_token_id=0).tolist()
        want = hf_model("llama").double()(input_ids=ids, attention_mask=mask).logits  # the fp64 truth
    real = mask.bool()
    # float32 rounding: the sharded, windowed prefill sums in another order than one process does, so it is held
    # to fp64 as closely as transformers' own float32 forward is (twice its error: windows and ranks reorder sums)
    bound = 2 * float((fp32[real] - want[real]).abs().max())
    assert 0 < bound < 1e-4, bound
    layers = ref_model.config.num_hidden_layers
    for name in TOPOLOGIES:
        for layout in ("load_balanced", "contiguous"):
            case = f"{name}/{layout}"
            rows = [r[case] for r in results]
            for rank, row in enumerate(rows):
                assert row["chunk"] < max(LENGTHS), case  # several windows per prompt
                got = torch.from_numpy(row["logits"]).double()
                err = float((got[real] - want[real]).abs().max())
                assert err <= bound, f"rank {rank} {case}: chunked prefill logits off fp64 by {err:.2e} > {bound:.2e}"
                assert torch.all(got[~real] == 0), case
                assert row["tokens"] == ref_tokens, f"rank {rank} {case}: tokens differ from transformers"
                windows = -(-max(LENGTHS) // row["chunk"])  # one forward per window, each a whole ring
                assert row["blocks"] == windows * layers * row["p"], (case, row["blocks"], windows)
                assert set(row["kernels"]) <= {"cpu_flash"}, (case, row["kernels"])
            # each group's ranks together did every (query, key) pair of every row once per layer
            p = rows[0]["p"]
            group = rows[:p]
            total = sum(n * (n + 1) // 2 for n in LENGTHS) * layers
            assert sum(r["pairs"] for r in group) == total, (case, [r["pairs"] for r in group], total)
    for what in ("layout", "max_prefill_tokens"):
        seen = [r[f"disagree/{what}"] for r in results]
        assert all(x is not None and x[0] == "DisagreementError" and what in x[1] for x in seen), (what, seen)
        assert len({x[1] for x in seen}) == 1, f"{what}: the ranks' messages differ: {seen}"
    for name in TOPOLOGIES:
        for rank, r in enumerate(results):
            msg = r[f"{name}/window"]
            assert msg is not None and "max_position_embeddings = 16" in msg and "29 tokens" in msg, (rank, msg)
            assert "allow_beyond_window=True" in msg, msg
    # the same window, allowed: the logits of the unmodified model of that config (fp64), as closely as above
    with torch.no_grad():
        want16 = hf_model("llama", max_position_embeddings=16).double()(input_ids=ids, attention_mask=mask).logits
    for name in TOPOLOGIES:
        for rank, r in enumerate(results):
            got = torch.from_numpy(r[f"{name}/beyond"]).double()
            err = float((got[real] - want16[real]).abs().max())
            assert err <= bound, f"rank {rank} {name}: past the window, logits off fp64 by {err:.2e} > {bound:.2e}"


def test_a_prefill_window_is_a_multiple_of_2_x_cp_and_at_least_that():
    """Below one chunk pair per rank a window cannot be balanced (a rank would be handed more of the prompt than
    its cache holds: a reviewer's max_prefill_tokens=1 at CP 3 failed with a misleading capacity error)."""
    from megatron_tree.integrations.hf.forward import prefill_chunk

    assert [prefill_chunk(t, 3) for t in (1, 2, 5, 6, 7, 13)] == [6, 6, 6, 6, 6, 12]
    assert [prefill_chunk(t, 4) for t in (3, 7, 8, 17)] == [8, 8, 8, 16]
    assert prefill_chunk(None, 4) is None and prefill_chunk(1, 1) == 2


def test_allow_beyond_window_runs_rope_models_only():
    """allow_beyond_window lets a RoPE model's prompt pass max_position_embeddings; a model whose positions are a
    learned table (GPT-2) is still refused at the prefill, saying why; the flag takes True or False only."""
    import pytest
    import transformers as tf

    from megatron_tree.integrations.hf import HFTreeModel

    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                            bos_token_id=0, eos_token_id=0)).eval()
    m = HFTreeModel(gpt2, None, allow_beyond_window=True)
    with torch.no_grad(), pytest.raises(ValueError, match="a table of that many rows"):
        m.hf(input_ids=torch.randint(0, 64, (1, 20)))
    with pytest.raises(TypeError, match="allow_beyond_window must be True or False, got 'yes'"):
        HFTreeModel(hf_model("llama"), None, allow_beyond_window="yes")
    # enabling a model again (new settings, the same groups) takes the flag too, both ways
    from megatron_tree.integrations.hf import enable_tree_attention

    llama, ids = hf_model("llama", max_position_embeddings=16).eval(), torch.randint(1, 128, (1, 20))
    for allow in (False, True, False):
        enable_tree_attention(llama, None, allow_beyond_window=allow)
        with torch.no_grad():
            if allow:
                assert llama(input_ids=ids).logits.shape == (1, 20, 128)
            else:
                with pytest.raises(ValueError, match="pass enable_tree_attention\\(allow_beyond_window=True\\)"):
                    llama(input_ids=ids)


def test_dynamic_ntk_rope_runs_past_its_window_without_the_flag():
    """hf.common.position_window: dynamic-NTK RoPE is built to run past max_position_embeddings (its frequencies
    follow the length), so its prompt passes the window without allow_beyond_window, with the logits of the
    unmodified model."""
    import transformers as tf

    from megatron_tree.integrations.hf import HFTreeModel

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rope_scaling={"rope_type": "dynamic", "factor": 2.0})).eval()
    ids = torch.randint(1, 64, (1, 20))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = HFTreeModel(model, None).hf(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-4
