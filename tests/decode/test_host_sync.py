"""A decode step makes no host-device synchronisation, checked on CPU.

``megatron_tree.utils.sync_guard.no_host_sync`` raises on any call that would make the host wait
for the device on CUDA (``.item()``, ``.tolist()``, ``.cpu()``, ``bool(t)``, ``nonzero``,
boolean-mask indexing, ...), whatever the device. One 4-rank gloo run (CP 4 = 2 nodes x 2)
decodes under the guard with transformers' own ``LlamaForCausalLM`` behind ``HFTreeModel``:
the guard spans ``HFTreeModel.decode_step`` whole -- transformers' forward of one token
(embedding, RoPE, layers, norms, logits), our attention function, the ``TreeCache`` append and
``tree_decode`` with the two-level, packed, all-gather and shifted merges. It checks the
guarded logits against unmodified transformers in one process over the whole sequence
(exact), and that a decode step creates no persistent buffer (everything a step reuses exists
after prefill). The Megatron decode path (``MegatronLM.decode_step``) is checked under the same
guard inside ``test_megatron.py``'s 4-rank run, which has paid for Megatron's imports already.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers.ranks import run_ranks

PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]  # uneven rows, 2 < CP tokens
STEPS = 5  # with blocks of 2, new tokens move across ranks during the run
OWN = ("megatron_tree", "torch.nn", "transformers")
"""Modules whose objects ``_tensors`` looks into: ours, torch's modules, transformers' models and configs."""


def _tensors(obj, seen=None, prefix="") -> dict:
    """name -> (storage data_ptr, storage bytes) of every tensor reachable from obj's attributes (modules,
    dicts, lists): a view of a buffer that existed before (a step's plan in the planner's buffer) is
    not a new buffer."""
    seen = set() if seen is None else seen
    out = {}
    if id(obj) in seen:
        return out
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return {prefix: (obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes())}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(OWN):
        items = vars(obj).items()
    else:
        return out
    for k, v in items:
        out.update(_tensors(v, seen, f"{prefix}.{k}"))
    return out


def _hf_rank(rank, world):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree import TreeGroups
    from megatron_tree.decode.generate import StepRunner
    from megatron_tree.distributed.collectives import CommStats
    from megatron_tree.integrations.hf import HFTreeModel
    from megatron_tree.utils.sync_guard import HostSyncError, no_host_sync

    groups = TreeGroups.build(intra_size=2)  # CP 4 = 2 simulated nodes x 2
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2)
    torch.manual_seed(0)  # the same weights on every rank
    model = HFTreeModel(LlamaForCausalLM(cfg).eval(), groups)
    plain = model.unsharded()  # transformers' own attention, one process, the same weight tensors
    out = {}
    for strategy in ("two_level", "packed", "allgather", "shifted"):
        cache = model.new_cache(len(PROMPTS), 32, block_size=2)
        logits = model.prefill(PROMPTS, cache)
        before = _tensors(cache, prefix="cache") | _tensors(model, prefix="model") | _tensors(groups, prefix="groups")
        seqs = [list(p) for p in PROMPTS]
        got, stats = [], CommStats()
        # shifted: the merges leave device flags with the runner; generate() reads them once
        # per step, outside the step (as here: StepRunner.finish), and redoes the step only when one is raised
        runner = StepRunner(strategy, groups)
        redos = 0
        ids = logits.argmax(-1)
        for _ in range(STEPS):
            for s, t in zip(seqs, ids.tolist()):
                s.append(t)
            step = runner.step(stats)
            with no_host_sync("HFTreeModel.decode_step"):
                logits = model.decode_step(ids, cache, step)
            logits, redone = runner.finish(model, ids, cache, step, logits)
            ids = logits.argmax(-1)
            redos += redone
            got.append(logits)
        after = _tensors(cache, prefix="cache") | _tensors(model, prefix="model") | _tensors(groups, prefix="groups")
        new = sorted(k for k, storage in after.items() if storage not in set(before.values()))
        # Reference: unmodified transformers, one process, the whole sequence, no cache.
        ref = [[] for _ in range(STEPS)]
        with torch.no_grad():
            for b, s in enumerate(seqs):
                full = plain(torch.tensor([s])).logits[0]
                for i in range(STEPS):
                    ref[i].append(full[len(PROMPTS[b]) + i])
        err = max(float((g - torch.stack(r)).abs().max()) for g, r in zip(got, ref))
        out[strategy] = {"err": err, "new_buffers": new, "shards": cache.shard_lengths,
                         "collectives": stats.collectives, "redos": redos}
    # The guard is live in this process: an injected sync in the step is caught.
    cache = model.new_cache(len(PROMPTS), 32, block_size=2)
    model.prefill(PROMPTS, cache)
    try:
        with no_host_sync("HFTreeModel.decode_step"):
            model.decode_step(torch.tensor([1, 2, 3]), cache, strategy="packed")
            cache.storage.seqlens.max().item()
        out["injected"] = "not caught"
    except HostSyncError as e:
        out["injected"] = str(e)
    return out


def _generate_rank(rank, world):
    """transformers' own ``generate`` on a tree-enabled model (CP 4 = 2 x 2): every decode forward (one
    new token per row on a filled cache) runs under the guard -- the host half (the call's checks, the
    placement) and the device half. (A user-compiled forward's device half is proved sync-free by
    ``fullgraph=True`` in ``test_compile_step.py``: the guard is a dispatch mode, under which Dynamo
    does not trace.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree import TreeGroups
    from megatron_tree.integrations.hf import enable_tree_attention
    from megatron_tree.utils.sync_guard import HostSyncError, no_host_sync

    groups = TreeGroups.build(intra_size=2)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.2)
    torch.manual_seed(0)  # the same weights on every rank
    plain = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(0)  # (a config of its own: enabling sets the attention implementation on it)
    model = enable_tree_attention(LlamaForCausalLM(copy.deepcopy(cfg)).eval(), groups)
    tree_forward = model.forward
    guarded = []

    def forward(*args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:
            return tree_forward(*args, **kwargs)  # the prefill: host work by design
        guarded.append(tuple(kwargs["input_ids"].shape))
        with no_host_sync("a decode forward of transformers' generate"):
            return tree_forward(*args, **kwargs)

    model.forward = forward
    got, want = [], []
    kw = {"max_new_tokens": STEPS, "min_new_tokens": STEPS, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        for p in PROMPTS:
            got.append(model.generate(torch.tensor([p]), **kw)[0, len(p):].tolist())
            want.append(plain.generate(torch.tensor([p]), **kw)[0, len(p):].tolist())
        # the guard is live around these forwards: a decoded token marked as padding, which the forward
        # checks without a host read on the device, is still refused (a host read there would fail as a sync)
        steps = list(guarded)
        ids = torch.tensor([PROMPTS[0]])
        out = tree_forward(ids)
        refused = None
        try:
            forward(input_ids=ids[:, :1], attention_mask=torch.tensor([[1] * len(PROMPTS[0]) + [0]]), cache=out.cache)
        except (ValueError, HostSyncError) as e:
            refused = f"{type(e).__name__}: {e}"
    return {"equal": got == want, "guarded": steps, "refused": refused}


def _rank(rank, world):
    return {"hf": _hf_rank(rank, world), "generate": _generate_rank(rank, world)}


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 4, timeout=240)


def test_transformers_decode_step_cp4_two_level_has_no_host_sync_and_is_exact(results):
    for r in results:
        for strategy, res in r["hf"].items():
            if strategy == "injected":
                continue
            assert res["err"] < 1e-5, (strategy, res["err"])
            assert res["new_buffers"] == [], (strategy, res["new_buffers"])
            assert res["collectives"] > 0
            assert res["redos"] == 0, (strategy, res["redos"])  # shifted: every step's shift was in range
        # every rank of 2 x 2 took part in the steps: the new tokens moved across ranks
        shards = r["hf"]["two_level"]["shards"]
        assert all(min(row) > 0 for row in shards), shards
    assert "host sync inside HFTreeModel.decode_step: Tensor.item()" in results[0]["hf"]["injected"]


def test_transformers_generate_decode_forwards_have_no_host_sync(results):
    """Every decode forward of transformers' generate on the tree-enabled model ran under the guard (a
    sync raises) with unmodified transformers' tokens; the attention mask's value check needs no host read."""
    for r in results:
        res = r["generate"]
        assert res["equal"]
        assert res["guarded"] == [(1, 1)] * (len(PROMPTS) * (STEPS - 1)), res["guarded"]  # every step after a prefill
        assert res["refused"].startswith("ValueError: the attention_mask marks a new (decoded) token as padding")


SYNCS = {
    "item": lambda t: t[0].item(), "tolist": lambda t: t.tolist(), "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.numpy(), "if": lambda t: 1 if t.any() else 0, "int": lambda t: int(t.max()),
    "float": lambda t: float(t[0]), "nonzero": lambda t: (t > 2).nonzero(), "where1": lambda t: torch.where(t > 2),
    "mask_index": lambda t: t[t > 2], "mask_put": lambda t: t.clone().__setitem__(t > 2, 0),
    "masked_select": lambda t: t.masked_select(t > 1), "unique": lambda t: t.unique(),
    "repeat_interleave": lambda t: torch.repeat_interleave(t), "equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("name", sorted(SYNCS))
def test_guard_catches_each_kind_of_host_read(name):
    from megatron_tree.utils.sync_guard import HostSyncError, no_host_sync

    t = torch.arange(5)
    with pytest.raises(HostSyncError, match="host sync inside a decode step"):
        with no_host_sync():
            SYNCS[name](t)


def test_guard_passes_device_work_and_keeps_cpu_value_checks():
    from megatron_tree.ops import dispatch as ops
    from megatron_tree.utils.sync_guard import HostSyncError, no_host_sync

    t = torch.arange(5)
    q, k = torch.randn(2, 1, 4, 8), torch.randn(2, 10, 2, 8)
    with no_host_sync():  # index arithmetic, host data made a tensor, shapes, the opaque local op
        torch.where(t > 2, t, 0).scatter_(0, t.clamp(max=3), t)
        torch.tensor([1, 2]) + t.shape[0] + len(t)
        ops.flash_decode(q, k, k, cache_seqlens=torch.tensor([3, 10], dtype=torch.int32))
        with pytest.raises(HostSyncError, match="megatron_tree::flash_decode, an op the guard cannot see into"):
            with no_host_sync(opaque=()):
                ops.flash_decode(q, k, k)
        # the value check moved inside the op: still a clear error on CPU, no sync outside it
        with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 10\]"):
            ops.flash_decode(q, k, k, cache_seqlens=torch.tensor([3, 11], dtype=torch.int32))

