"""transformers models CP-sharded through ``integrations.hf``, against unmodified transformers.

Four architectures (Llama, Qwen2 with QKV biases, Qwen3 with q/k norms, Mistral without a
sliding window), each a tiny random model saved with ``save_pretrained`` (safetensors) and
loaded on every rank through ``load_hf_model``. Biases and norm weights are randomised, so a
backend that dropped them would fail. One 4-rank gloo launch serves both topologies of the
issue: CP 3 (ranks 0-2; rank 3 runs alone, CP 1) and CP 4 as 2 simulated nodes x 2. Each
rank generates from a left-padded batch (two prompts of different lengths plus a
1-token one, so some ranks start with an empty shard of a row), greedy and sampled (ranks
seeded differently), and returns tokens, per-step logits, what the MLP of
layer 0 processed, the cache's shards and bytes; the parent holds them to single-process
transformers. Bad input is checked in this process (CP 1, no process group) where it needs
no collective, and inside the launch where it needs groups.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.ranks import run_ranks
from tests.helpers.hf_models import LENGTHS, batch, hf_model  # noqa: F401

NEW = 16
SAMPLED_NEW = 8  # sampling is checked on fewer steps (its own logits are the greedy run's code path)
# Two prompts of different lengths (odd: chunks of different sizes; the shorter is
# left-padded by 12) plus a 1-token one: at CP > 1 some ranks hold an empty shard of that row.
SEED_SAMPLE = 1234
SAMPLING = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.95)
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
TOPOLOGIES = {
    # name -> (TreeGroups.build ranks, intra_size, enable_tree_attention kwargs)
    "cp3": ([[0, 1, 2], [3]], None, dict(strategy="auto", prefill="ring", layout="load_balanced", block_size=4)),
    "cp2x2": (None, 2, dict(strategy="two_level", prefill="allgather", layout="contiguous", block_size=4)),
}



def _cache_of(out):
    """The cache a forward or generate returned (``cache`` in transformers 5.2x, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out["past_key_values"]


def _count_mlp(model, counts: list):
    layer0 = model.model.layers[0].mlp
    return layer0.register_forward_hook(lambda mod, args, out: counts.append(args[0].shape[0] * args[0].shape[1]))


def _rank_fn(rank, world, paths):
    from megatron_tree.comm import CommStats
    from megatron_tree.integrations.hf import TreeCache, load_hf_model
    from megatron_tree.distributed.topology import TreeGroups

    ids, mask = batch()
    built = {name: TreeGroups.build(ranks, intra) for name, (ranks, intra, _) in TOPOLOGIES.items()}
    seen = {}
    for topo, (_, _, kw) in TOPOLOGIES.items():
        groups = built[topo]
        # What one layer's CP prefill of this method issues on its own, to count the model's against.
        from megatron_tree.decode.prefill import cp_prefill

        alone = CommStats()
        q, kv = torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 2, 16)
        pos = torch.arange(2)[None, :] + 2 * groups.rank
        cp_prefill(q, kv, kv, pos, pos, groups, method=kw["prefill"], stats=alone)
        seen[(topo, "prefill_alone")] = alone.as_dict()
        for arch in ARCHS:
            stats = CommStats()
            model = load_hf_model(paths[arch], groups, stats=stats, **kw)
            hf = model.hf
            counts: list = []
            hook = _count_mlp(hf, counts)
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
            hook.remove()
            cache = _cache_of(out)
            entry = {
                "cp": groups.size, "cp_rank": groups.rank, "group": list(groups.cp_ranks),
                "tokens": out.sequences.tolist(), "logits": [lg.tolist() for lg in out.logits],
                "mlp_tokens": counts, "cache_type": type(cache).__name__, "shards": cache.shard_lengths,
                "lengths": cache.lengths, "seq_length": cache.get_seq_length(), "kv_bytes": cache.kv_nbytes,
                "local_tokens": cache.local_tokens, "stats": stats.as_dict(),
            }
            # Sampling: every rank seeded differently; CP rank 0's seed is the reference's.
            torch.manual_seed(SEED_SAMPLE if groups.rank == 0 else 999 + rank)
            with torch.no_grad():
                entry["sampled"] = hf.generate(ids, attention_mask=mask, max_new_tokens=SAMPLED_NEW,
                                               **SAMPLING).tolist()
            seen[(topo, arch)] = entry
        # A cache made for the other group, handed to this model: refused before any collective.
        other = built["cp2x2" if topo == "cp3" else "cp3"]
        try:
            hf(ids, attention_mask=mask, cache=TreeCache(hf, other))
            seen[(topo, "wrong_group")] = None
        except ValueError as e:
            seen[(topo, "wrong_group")] = str(e)
    # HFTreeModel under the library's generate with strategy="shifted" (2 x 2): one SUM per layer
    # per step after the first; a step whose shifts are far off is redone at the same positions.
    from megatron_tree.decode.generate import StepRunner, generate

    model = load_hf_model(paths["llama"], built["cp2x2"], **TOPOLOGIES["cp2x2"][2])
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    stats = CommStats()
    res = generate(model, prompts, NEW, strategy="shifted", stats=stats, progress=False)
    seen["shifted"] = (res.tokens, stats.fallbacks, dict(stats.levels["cp"].ops))
    cache = model.new_cache(len(prompts), max(LENGTHS) + 8)
    runner, steps, nxt = StepRunner("shifted", model.groups), [], model.prefill(prompts, cache).argmax(-1)
    for i in range(3):
        if i == 1:
            runner.shifts = {key: r + 500.0 for key, r in runner.shifts.items()}  # all weights underflow
        logits, redone = runner.run(model, nxt, cache)
        nxt = logits.argmax(-1)
        steps.append((nxt.tolist(), redone))
    seen["shifted_redo"] = (steps, cache.lengths, cache.get_seq_length())
    # Ranks handed different prompts: every rank of the CP group (2 x 2) raises, none computes.
    from megatron_tree.distributed.collectives import DisagreementError

    other = (ids + 1) % 128
    if rank == 1:
        other[0, -1] = (other[0, -1] + 1) % 128
    try:
        hf(other, attention_mask=mask)
        seen["different_prompts"] = None
    except DisagreementError as e:
        seen["different_prompts"] = str(e)
    # ... and different generate budgets: refused at the prefill, before any rank computes
    try:
        hf.generate(ids, attention_mask=mask, max_new_tokens=2 if rank == 0 else 3, do_sample=False)
        seen["different_budget"] = None
    except DisagreementError as e:
        seen["different_budget"] = str(e)
    return seen


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Save each architecture; run unmodified transformers on the batch in this process."""
    ids, mask = batch()
    paths, refs = {}, {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch)
        model = hf_model(arch)
        model.save_pretrained(str(path), safe_serialization=True)
        assert (path / "model.safetensors").is_file()
        counts: list = []
        hook = _count_mlp(model, counts)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        hook.remove()
        cache = _cache_of(out)
        kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        torch.manual_seed(SEED_SAMPLE)
        with torch.no_grad():
            sampled = model.generate(ids, attention_mask=mask, max_new_tokens=SAMPLED_NEW, **SAMPLING).tolist()
        paths[arch] = str(path)
        refs[arch] = {"tokens": out.sequences.tolist(), "logits": torch.stack(out.logits),
                      "mlp_prefill": counts[0], "kv_bytes": kv, "sampled": sampled}
    return paths, refs


@pytest.fixture(scope="module")
def ranks(references):
    paths, _ = references
    return run_ranks(_rank_fn, 4, paths, timeout=900, pg_timeout=300)


def _max_share(lengths, cp, layout, rank=None):
    from megatron_tree.decode.cache import prefill_ranges

    shares = [[sum(e - s for s, e in r) for r in prefill_ranges(n, cp, layout)] for n in lengths]
    if rank is None:
        return max(max(s) for s in shares)
    return max(s[rank] for s in shares)


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
@pytest.mark.parametrize("arch", ARCHS)
def test_generate_matches_single_process_transformers(references, ranks, topo, arch):
    _, refs = references
    ref = refs[arch]
    per_rank = [r[(topo, arch)] for r in ranks]
    for rank, e in enumerate(per_rank):
        where = f"{arch} {topo} rank {rank} (CP {e['cp']})"
        assert e["cache_type"] == "TreeCache", where
        assert e["tokens"] == ref["tokens"], where  # greedy, left-padded batch
        assert e["sampled"] == ref["sampled"], where  # ranks seeded differently: CP rank 0 decides
        got = torch.tensor(e["logits"])  # (NEW, batch, vocab): the prefill's, then each decode step's
        assert got.shape == ref["logits"].shape, where
        # fp32 rounding differs from transformers' by ~5e-6 on logits of magnitude ~5.
        err = (got - ref["logits"]).abs().amax(dim=(1, 2))
        assert float(err[0]) < 5e-5, f"{where}: prefill max |dlogits| {float(err[0])}"
        assert float(err[1:].max()) < 5e-5, f"{where}: decode max |dlogits| {err[1:].tolist()}"
        assert e["lengths"] == [n + NEW - 1 for n in LENGTHS], where  # pads never stored
        assert e["seq_length"] == max(LENGTHS) + NEW - 1, where  # what transformers counts (padded)
    for e in per_rank:  # bitwise identical on every rank of one CP group
        assert all(o["logits"] == e["logits"] for o in per_rank if o["group"] == e["group"])


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_prefill_compute_and_kv_memory_are_one_cp_th(references, ranks, topo):
    _, refs = references
    layout, block = TOPOLOGIES[topo][2]["layout"], TOPOLOGIES[topo][2]["block_size"]
    for arch in ARCHS:
        ref = refs[arch]
        per_rank = [r[(topo, arch)] for r in ranks]
        for rank, e in enumerate(per_rank):
            cp, where = e["cp"], f"{arch} {topo} rank {rank} (CP {e['cp']})"
            # MLP of layer 0: the prefill call sees this rank's chunk (batch x largest share),
            # then one token per row per decode step.
            w = _max_share(LENGTHS, cp, layout)
            assert e["mlp_tokens"][0] == len(LENGTHS) * w, where
            assert e["mlp_tokens"][1:] == [len(LENGTHS)] * (NEW - 1), where
            assert ref["mlp_prefill"] == len(LENGTHS) * max(LENGTHS)
            if cp > 1:
                assert e["mlp_tokens"][0] <= ref["mlp_prefill"] / cp + 2 * len(LENGTHS), where
            # Stored tokens: the rows' tokens split over the ranks, within a block (+2) of even.
            total = sum(n + NEW - 1 for n in LENGTHS)
            assert sum(o["local_tokens"] for o in per_rank if o["group"] == e["group"]) == total, where
            for shard in e["shards"]:
                assert max(shard) - min(shard) <= block + 2, (where, shard)
            # Memory: the cache is sized for the request, ceil((prompt + new) / CP) slots per row,
            # plus the spare slot per row that takes the tokens other ranks keep.
            per_token = ref["kv_bytes"] // (len(LENGTHS) * (max(LENGTHS) + NEW - 1))
            slots = -(-(max(LENGTHS) + NEW) // cp) + 1
            assert e["kv_bytes"] == per_token * len(LENGTHS) * slots, where
            assert e["kv_bytes"] * cp <= ref["kv_bytes"] * (1 + cp / (max(LENGTHS) + NEW - 1)) + \
                per_token * cp * (1 + len(LENGTHS)), where


def test_collectives_per_step(ranks):
    """Counted, not assumed: what generate issued, against what its parts issue on their own."""
    layers, steps = 2, NEW - 1
    for r in ranks:
        e = r[("cp2x2", "llama")]
        st = e["stats"]
        assert st["calls"] == layers * steps  # one tree merge per layer per decode step
        # two_level: a packed merge (MAX + SUM) inside the node, then across nodes, per call
        assert st["levels"]["intra"]["collectives"] == 2 * layers * steps
        assert st["levels"]["inter"]["collectives"] == 2 * layers * steps
        # level "cp": one CP prefill per layer (as prefill.py issues it alone), plus this backend's own:
        # the argument check (an all-gather) and the requested logits (an all-reduce SUM) at prefill,
        # and per generated token CP rank 0's random state (a broadcast) and the tokens (an all-gather)
        alone = r[("cp2x2", "prefill_alone")]["levels"]["cp"]["ops"]
        want = {op: layers * n for op, n in alone.items()}
        for op, n in (("all_gather", 1 + NEW), ("all_reduce_sum", 1), ("broadcast", NEW)):
            want[op] = want.get(op, 0) + n
        assert st["levels"]["cp"]["ops"] == want
        e = r[("cp3", "llama")]
        if e["cp"] == 3:  # ring prefill: its point-to-point rounds, once per layer
            alone = r[("cp3", "prefill_alone")]["levels"]["cp"]["ops"]
            p2p = {op: n for op, n in alone.items() if not op.startswith(("all_", "broadcast"))}
            assert p2p and all(e["stats"]["levels"]["cp"]["ops"][op] == layers * n for op, n in p2p.items())


def test_different_prompts_on_ranks_are_refused(ranks):
    msgs = [r["different_prompts"] for r in ranks]
    assert all(m is not None and "ranks disagree on hf.prefill: input_ids:" in m for m in msgs), msgs
    assert "attention_mask" not in msgs[0].split(". Every rank")[0]  # only what differs is listed
    assert "on rank 1" in msgs[0] and len(set(msgs)) == 1  # the same text everywhere, naming the odd rank
    budgets = [r["different_budget"] for r in ranks]
    assert len(set(budgets)) == 1 and "max_new_tokens: 2 on rank 0; 3 on ranks [1, 2, 3]" in (budgets[0] or ""), budgets


def test_cache_of_another_group_is_refused(ranks):
    for r in ranks:
        for topo in TOPOLOGIES:
            msg = r[(topo, "wrong_group")]
            assert msg is not None and "TreeCache was made for the CP group of ranks" in msg, msg


# --------------------------------------------------------------------------- one process (CP 1)


def test_cp1_forward_generate_and_disable():
    from megatron_tree.integrations.hf import TreeCache, disable_tree_attention, enable_tree_attention

    ids, mask = batch()
    ref = hf_model("qwen3", seed=3)
    model = copy.deepcopy(ref)  # its own config: the attention implementation is set on the config
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        enable_tree_attention(model, None)
        enable_tree_attention(model, None)  # idempotent
        got = model(ids, attention_mask=mask, use_cache=False).logits  # every position, no cache kept
        # real positions equal transformers'; pad positions are 0 (transformers computes them from pads)
        torch.testing.assert_close(got * mask[..., None], want * mask[..., None], rtol=0, atol=5e-5)
        assert float(got[mask == 0].abs().max()) == 0.0
        last = model(ids, attention_mask=mask, logits_to_keep=1)
        assert isinstance(_cache_of(last), TreeCache) and last.logits.shape == (len(LENGTHS), 1, 128)
        torch.testing.assert_close(last.logits[:, 0], want[:, -1], rtol=0, atol=5e-5)
        # a manual decode step on the returned cache, against the full forward of the longer sequence;
        # without position_ids transformers places the token at the cache's (padded) length on every row
        nxt = want[:, -1].argmax(-1, keepdim=True)
        step = model(nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1), cache=_cache_of(last))
        full = ref(torch.cat([ids, nxt], 1), attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1)).logits
        torch.testing.assert_close(step.logits[:, -1], full[:, -1], rtol=0, atol=5e-5)
        cache = _cache_of(last)
        assert cache.lengths == [n + 1 for n in LENGTHS] and cache.get_seq_length() == ids.shape[1] + 1
        disable_tree_attention(model)
        assert model.config._attn_implementation == ref.config._attn_implementation
        assert "forward" not in model.__dict__ and "generate" not in model.__dict__
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, want, rtol=0, atol=0)


def test_cp1_generate_under_autocast():
    """An fp32 model under torch.autocast(bfloat16) hands the attention an fp32 q and k (rotary runs in fp32) with a
    bf16 v, and in decode a bf16 query over the fp32 cache; transformers' sdpa runs them in the autocast dtype. It
    was a TypeError ('q, k, v must share one dtype') naming no autocast; now it computes as sdpa does."""
    from megatron_tree.integrations.hf import enable_tree_attention

    ids, mask = batch()
    ref = hf_model("llama", seed=5)
    model = enable_tree_attention(copy.deepcopy(ref), None)
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref.generate(ids, **kw)
        got = model.generate(ids, **kw)
    assert got.sequences.tolist() == want.sequences.tolist()
    for g, w in zip(got.logits, want.logits):
        assert g.dtype == w.dtype  # the lm head ran under autocast alike
        # bf16 rounding: sdpa and transformers' own eager attention differ by 0.16 here
        torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=0.25)


def test_speculative_and_assisted_decoding_under_autocast():
    """Speculative verification under torch.autocast(bfloat16) of an fp32 model: the attention cast q and the
    committed keys to bf16 but not the drafts' own keys and values (kept aside by the TreeCache: rotary's fp32
    keys beside bf16 values), a TypeError ('q and the drafts must share one dtype') in the package's
    speculative generate (lookup and draft model, at CP 1 and CP 3) and in transformers' assisted generate.
    The drafts are cast as k and v are; the tokens are transformers' own under autocast."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.integrations.hf import HFTreeModel

    ids, mask = batch()
    ref = hf_model("llama", seed=5)
    model = HFTreeModel(copy.deepcopy(ref), None)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = [ref.generate(torch.tensor([p]), **kw)[0, len(p):].tolist() for p in prompts]
        for spec in (SpeculativeConfig(width=2, depth=3),
                     SpeculativeConfig(method="draft_model", draft_model=model.unsharded(), width=2, depth=3)):
            got = generate(model, prompts, 6, progress=False, speculative=spec)
            assert got.tokens == want and got.drafted > 0, spec
        assistant = hf_model("llama", seed=6)
        one = torch.tensor([prompts[0]])
        assert model.hf.generate(one, assistant_model=assistant, **kw).tolist() == \
            ref.generate(one, assistant_model=assistant, **kw).tolist()


def test_cp1_float64_model_keeps_float64_logits():
    """A float64 model's prefill logits came back through float32 (the logits' assembly cast them): 2e-7 off
    transformers' own in float64, a float64 tensor with float32's digits. Now they are float64 throughout."""
    from megatron_tree.integrations.hf import enable_tree_attention

    ids, mask = batch()
    ref = hf_model("llama", seed=7).double()
    model = enable_tree_attention(copy.deepcopy(ref), None)
    with torch.no_grad():
        want = ref(ids[:1]).logits
        got = model(ids[:1], use_cache=False).logits
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
        kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        a, b = ref.generate(ids, **kw), model.generate(ids, **kw)
    assert a.sequences.tolist() == b.sequences.tolist()
    for w, g in zip(a.logits, b.logits):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_cp1_cache_made_from_a_config_takes_the_layers_dtype():
    """TreeCache(model.config, groups), as transformers' DynamicCache(config=model.config) is made, knows no dtype:
    its storage was float32, so a bfloat16 model's first decode step was a TypeError ('q, k, v must share one
    dtype'). Made from a config without dtype / device, the storage now takes the layers' own at the first write."""
    from megatron_tree.integrations.hf import TreeCache, enable_tree_attention

    ids, mask = batch()
    ref = hf_model("llama", seed=7).to(torch.bfloat16)
    model = enable_tree_attention(copy.deepcopy(ref), None)
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        cache = TreeCache(model.config, None)
        got = model.generate(ids, cache=cache, **kw)
        own = model.generate(ids, **kw)  # the cache generate makes from the model itself
        want = ref.generate(ids, **kw)
    assert cache.storage.k.dtype == torch.bfloat16 and cache.dtype == torch.bfloat16
    assert got.sequences.tolist() == own.sequences.tolist() == want.sequences.tolist()
    for g, o in zip(got.logits, own.logits):
        torch.testing.assert_close(g, o, rtol=0, atol=0)
    assert TreeCache(model.config, None, dtype=torch.float16).dtype == torch.float16  # a given dtype is kept


def test_a_cache_made_from_a_config_allocates_its_storage_once(monkeypatch):
    """A cache made from a config learns the layers' dtype and device at the prompt's first write. Its prefill
    allocated a full-size float32 storage on the CPU first and replaced it at that write: for a bfloat16 model
    3x the storage's bytes of host memory at the peak (8 layers, 400K slots: 3.5 GiB of RSS for a 1.2 GiB cache,
    2.5 s of CPU against 0.8 s), and the whole cache on the host for a CUDA model. The placement it needs
    before that write holds no keys: no storage of keys and values is made but the one the layers fill, for
    each prompt, static caches too."""
    import megatron_tree.integrations.hf.cache as hf_cache
    from megatron_tree.integrations.hf import TreeCache, enable_tree_attention

    made = []

    class Recorded(hf_cache.ShardedKVCache):
        def __init__(self, **kw):
            super().__init__(**kw)
            made.append(self)

    monkeypatch.setattr(hf_cache, "ShardedKVCache", Recorded)
    ids, mask = batch()
    ref = hf_model("llama", seed=7).to(torch.bfloat16)
    model = enable_tree_attention(copy.deepcopy(ref), None)
    kw = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        want = ref.generate(ids, **kw).tolist()
        for static in (False, True):
            made.clear()
            cache = TreeCache(model.config, None, max_seq_len=64, static=static)
            assert model.generate(ids, cache=cache, **kw).tolist() == want
            assert cache.storage.k.dtype == torch.bfloat16
            # (the placement's own storage: one layer of one 1-wide head, 1/32 of this one)
            big = [m for m in made if m.kv_nbytes > cache.kv_nbytes // 8]
            assert big == [cache.storage], [(m.k.dtype, m.kv_nbytes) for m in made]
            # a second prompt: the cache knows the layers' dtype now (a static one keeps its storage)
            kept = cache.storage
            made.clear()
            cache.reset()
            assert model.generate(ids, cache=cache, **kw).tolist() == want
            assert made == ([] if static else [cache.storage])
            assert (cache.storage is kept) == static


def test_a_cache_of_another_dtype_than_the_layers_is_a_clear_error():
    """TreeCache(..., dtype=float32) for a bfloat16 model stores the prompt, then every decode step reads float32
    keys beside the layers' bfloat16 query: that was tree_decode's 'q, k, v must share one dtype, got
    q=torch.bfloat16, k=torch.float32', naming neither the cache nor the dtype argument. It names both now; a cache
    made with the layers' dtype runs."""
    from megatron_tree.integrations.hf import TreeCache, enable_tree_attention

    ids, mask = batch()
    model = enable_tree_attention(hf_model("llama", seed=7).to(torch.bfloat16), None)
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False)
    for make in (lambda: TreeCache(model.config, None, dtype=torch.float32),
                 lambda: TreeCache(model, None, dtype=torch.float16)):
        cache = make()
        want = str(cache.dtype)
        with torch.no_grad(), pytest.raises(TypeError, match=rf"the TreeCache stores {want} keys and values .*"
                                                             r"layer 0 computes in torch.bfloat16: .*dtype=torch.bfloat16"):
            model.generate(ids, cache=cache, **kw)
    with torch.no_grad():
        assert model.generate(ids, cache=TreeCache(model.config, None, dtype=torch.bfloat16), **kw).shape[1] == \
            ids.shape[1] + 3


def test_eval_protocol_cp1(tmp_path):
    """load_hf_model's HFTreeModel drives the library's own generation loop; unsharded() is the plain model."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import load_hf_model

    ref = hf_model("mistral", seed=2)
    ref.save_pretrained(str(tmp_path), safe_serialization=True)
    model = load_hf_model(str(tmp_path), None)
    prompts = [[5, 17, 99, 3, 42], list(range(1, 12))]
    res = generate(model, prompts, 6, progress=False)
    with torch.no_grad():
        for p, toks in zip(prompts, res.tokens):
            want = ref.generate(torch.tensor([p]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
            assert toks == want[0, len(p):].tolist()
        cache = model.new_cache(2, 20)
        assert cache.batch_size == 2 and cache.max_seq_len == 20  # what generate() checks a given cache by
        with pytest.raises(ValueError, match="made for batch_size=2"):
            model.prefill(prompts[:1], cache)
        first = model.prefill(prompts, cache)
        second = model.decode_step(first.argmax(-1), cache)
        plain = model.unsharded()
        assert plain.config._attn_implementation != "megatron_tree"
        assert plain.model.embed_tokens.weight.data_ptr() == model.hf.model.embed_tokens.weight.data_ptr()
        for b, p in enumerate(prompts):
            full = plain(torch.tensor([p + [int(first[b].argmax())]])).logits[0]
            torch.testing.assert_close(full, ref(torch.tensor([p + [int(first[b].argmax())]])).logits[0], rtol=0, atol=0)
            torch.testing.assert_close(first[b], full[-2], rtol=0, atol=5e-5)
            torch.testing.assert_close(second[b], full[-1], rtol=0, atol=5e-5)


def test_cache_grows_when_unsized(monkeypatch):
    """Without a size (no generate, no max_seq_len) the cache doubles and its placement continues in the larger one."""
    import megatron_tree.integrations.hf.cache as hf_cache
    from megatron_tree.integrations.hf import TreeCache, enable_tree_attention

    monkeypatch.setattr(hf_cache, "_HEADROOM", 1)  # room for one decoded token: it grows at the second

    ref = hf_model("llama", seed=4)
    model = enable_tree_attention(copy.deepcopy(ref), None)
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    cache = TreeCache(model, None, max_seq_len=None)
    with torch.no_grad():
        out = model(ids, cache=cache, logits_to_keep=1)
        assert cache.storage.max_seq_len == 6
        seq = ids
        for _ in range(4):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            out = model(nxt, cache=cache)
        want = ref(seq).logits[:, -1]
    torch.testing.assert_close(out.logits[:, -1], want, rtol=0, atol=5e-5)
    assert cache.storage.max_seq_len == 12 and cache.lengths == [9]
    small = TreeCache(model, None, max_seq_len=6)
    with torch.no_grad():
        model(ids, cache=small)
        model(ids[:, :1], cache=small)
        from megatron_tree.decode.cache import CacheOverflowError

        with pytest.raises(CacheOverflowError, match="max_seq_len"):
            model(ids[:, :1], cache=small)


@pytest.mark.parametrize("what", ["window_zero", "chunked_layers", "chunk_size", "bidirectional", "cross_attention",
                                  "own_attention"])
def test_unsupported_models_are_refused(what):
    import transformers as tf

    from megatron_tree.integrations.hf import UnsupportedModelError, enable_tree_attention

    if what == "window_zero":  # no layer_types: every layer would slide, over 0 keys
        model, match = hf_model("mistral", sliding_window=0), r"config.sliding_window=0; expected a positive"
    elif what == "chunked_layers":
        model = hf_model("qwen2", layer_types=["full_attention", "chunked_attention"])
        match = r"\['chunked_attention'\] layers \(config.layer_types\)"
    elif what == "chunk_size":
        model, match = hf_model("llama", attention_chunk_size=8), "attention_chunk_size=8 .*chunked attention"
    elif what == "bidirectional":
        cfg = tf.Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  use_bidirectional_attention=True)
        model, match = tf.Gemma3ForCausalLM(cfg), r"\['Gemma3Attention'\] are not causal"
    elif what == "cross_attention":
        cfg = tf.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64)
        model, match = tf.BartForConditionalGeneration(cfg), "cross-attention"
    else:  # Bloom computes ALiBi attention in its own module, outside the AttentionInterface
        cfg = tf.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2)
        model, match = tf.BloomForCausalLM(cfg), "cannot be replaced"
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedModelError, match=match):
        enable_tree_attention(model, None)
    assert model.config._attn_implementation == before and "forward" not in model.__dict__


def test_bad_calls_are_refused():
    from megatron_tree.integrations.hf import enable_tree_attention

    model = enable_tree_attention(hf_model("llama", seed=1), None)
    ids, mask = batch()
    right = mask.flip(1)  # right padding
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"rows \[1, 2\] are not left-padded"):
            model(ids, attention_mask=right)
        with pytest.raises(NotImplementedError, match="labels"):
            model(ids, attention_mask=mask, labels=ids)
        with pytest.raises(NotImplementedError, match=r"generate\(max_time=...\) is not supported .* own clock"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, max_time=10.0)
        out = model(ids, attention_mask=mask)
        grown = torch.cat([mask, torch.tensor([[1, 0, 1]] * 3)], dim=1)
        with pytest.raises(ValueError, match="marks a new .decoded. token as padding"):
            model(ids[:, :3], attention_mask=grown, cache=_cache_of(out))
    with pytest.raises(ValueError, match="unknown merge strategy"):
        enable_tree_attention(hf_model("llama"), None, strategy="ring")


# --------------------------------------------------------------------------- DeepSpeed


def test_deepspeed_trained_model_generates_cp_sharded(tmp_path):
    """The real launcher: train with deepspeed.initialize, generate on DeepSpeed's sequence-parallel group."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from transformers import LlamaForCausalLM

    root = Path(__file__).resolve().parents[3]
    script = root / "tests" / "scripts" / "ds_hf_generate.py"
    if shutil.which("deepspeed") is None:
        pytest.fail("the deepspeed launcher is not on PATH (pip install deepspeed==0.19.8)")
    ext_dir = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext_dir), PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(29300 + os.getpid() % 300), str(script),
           "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, f"deepspeed launcher failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert res["backend"] == "gloo" and res["world_size"] == 2 and res["local_size"] == "2"
    assert res["group_source"] == "deepspeed sequence-parallel group" and res["cp_ranks"] == [0, 1]
    assert res["weights_agree"]  # DeepSpeed kept the replicas equal (they started from different seeds)
    assert res["losses"][-1] < res["losses"][0]  # it trained
    built = list(ext_dir.rglob("*.so")) if ext_dir.exists() else []
    assert built == [], f"DeepSpeed compiled ops during the run: {built}"

    sys.path.insert(0, str(script.parent))
    try:
        import ds_hf_generate as script_mod
    finally:
        sys.path.remove(str(script.parent))
    trained = LlamaForCausalLM.from_pretrained(str(tmp_path / "out" / "model")).eval()
    fresh = script_mod.tiny_llama(seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters()))
    ids, mask = script_mod.prompts()
    with torch.no_grad():
        ref = trained.generate(ids, attention_mask=mask, max_new_tokens=script_mod.NEW_TOKENS, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    want = torch.stack(ref.logits)
    total = sum(n + script_mod.NEW_TOKENS - 1 for n in script_mod.PROMPT_LENGTHS)
    for r in res["ranks"]:
        assert r["tokens"] == ref.sequences.tolist(), r["rank"]
        err = float((torch.tensor(r["logits"]) - want).abs().max())
        assert err < 5e-5, f"rank {r['rank']}: max |dlogits| {err}"
        assert sum(sum(s) for s in r["shards"]) == total
        assert r["merges"] == 2 * (script_mod.NEW_TOKENS - 1)  # one tree merge per layer per decode step


def test_hf_tree_model_shifted_generate(references, ranks):
    """HFTreeModel + generate(strategy="shifted") at CP 2 x 2: transformers' tokens, step 0 packed
    then one SUM per layer per step; a raised deferred flag redoes the step on the same slots."""
    _, refs = references
    want = [row[max(LENGTHS):] for row in refs["llama"]["tokens"]]
    layers = 2
    for rank, r in enumerate(ranks):
        tokens, fallbacks, ops = r["shifted"]
        assert tokens == want and fallbacks == 0, rank
        assert ops == {"all_reduce_max": layers, "all_reduce_sum": layers * (NEW - 1)}, ops
        steps, lengths, seq = r["shifted_redo"]
        assert [redone for _, redone in steps] == [False, True, False]
        assert [t for t, _ in steps] == [[row[i + 1] for row in want] for i in range(3)]
        assert lengths == [n + 3 for n in LENGTHS] and seq == max(LENGTHS) + 3  # one token per step
