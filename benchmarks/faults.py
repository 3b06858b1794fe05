"""Fault-injection soak: random bad inputs and faults at CP 2-4, and how each one ended.

Not a test: a seeded random walk over what careless users and unlucky clusters do -- wrong
shapes, dtypes and strategies on one rank, bad ``cache_seqlens`` or block tables, shifts and
prompts that differ between ranks, NaN in queries or keys, an empty batch, a stuck peer, a full
KV pool, a bad paged write, a peer killed at a random decode step -- and the surfaces added since:
a bad safetensors checkpoint on one rank or every rank (truncated, random bytes, a tensor missing
or misshapen, no ``config.json``) and a good one, speculative verification with a draft mask that
is not a tree, more draft rows than the cache has room for, drafts that differ between ranks, and
speculative generation (its tokens against greedy ``generate``'s), ``TreeGroups.from_env`` with
launcher variables that are half-set, unreadable or differ between ranks, and a peer that dies
before or inside ``TreeGroups.build`` or before the first merge -- each case run on every rank of
a real gloo group, and classified from every rank's outcome:

* ``clear_error_every_rank``: every rank raised, the same exception type and text (for a lost
  peer: every survivor a ``CommError`` naming the dead rank), within the bound;
* ``exact``: every rank returned a result within fp32 tolerance of the fp64 computation (NaN
  exactly where the fp64 computation has NaN);
* ``silent_wrong``: some rank returned a result that is not exact;
* ``hang``: some rank took longer than ``3 T`` (``T`` the groups' timeout), or never finished;
* ``native_crash``: a rank that was not the one killed on purpose died by a signal or without
  a record;
* ``not_alike``: every rank stopped within the bound but not the same way (ranks raised
  different errors, or some returned exact results while others raised; for a lost peer, a
  survivor whose error is not a ``CommError`` naming the dead rank);
* ``spurious_error``: a valid input (no fault, NaN, an empty batch) that raised instead of
  returning the exact result.

``slow`` counts the cases that ended beyond the documented bound ``1.5 T`` (but within ``3 T``).

Every case gets fresh groups (``TreeGroups.build(timeout=T)``); ranks line up between cases
through the rendezvous store, never through the groups under test. Cases run in one launch per
world size; a kill ends its launch, so each kill case has a launch of its own; a launch that dies
(a native crash) or stops advancing (a hang) is restarted after the case in progress, which is
counted as such.

    python -m benchmarks.faults --seed 0 --cases 300 --ranks 2,3,4 --out benchmarks/results/faults.json

``--transport shm`` runs every case over the shared-memory transport (``MEGATRON_TREE_TRANSPORT=shm``
in every rank: each case's groups get channels, so its merges, stuck peers and kills go through them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time

OUTCOMES = ("clear_error_every_rank", "exact", "silent_wrong", "hang", "native_crash", "not_alike", "spurious_error")

VALID = ("none", "none_paged", "nan_q", "nan_k", "empty_batch", "prefill_ok", "ckpt_ok", "spec_ok",
         "spec_generate_ok", "env_ok", "compile_ok")
"""Fault kinds whose input is valid: an exact result is the only right outcome (an error is ``spurious_error``)."""

FAULTS = (
    "none", "none_paged", "nan_q", "nan_k", "empty_batch",
    "heads", "batch", "dtype", "strategy", "backend",
    "seqlens_shape", "seqlens_range", "seqlens_dtype", "block_table_1d",
    "shift_values", "shift_presence", "shift_device",
    "stuck",
    "pool", "paged_write",
    "prefill_heads", "prefill_kpos", "prefill_ok",
    "generate_prompt", "generate_sampling", "generate_bad_token",
    "ckpt_ok", "ckpt_truncated", "ckpt_random_bytes", "ckpt_missing_tensor", "ckpt_misshapen", "ckpt_no_config",
    "spec_ok", "spec_not_tree", "spec_too_many", "spec_drafts_differ", "spec_generate_ok", "spec_config",
    "env_ok", "env_local_size", "env_local_rank", "env_unreadable", "env_half",
)
"""Fault kinds of the in-launch cases (a kill is a launch of its own).

``ckpt_*`` other than ``ckpt_ok``: the culprit's checkpoint is bad, or every rank's when the case's
seed is odd. ``env_half``: the same half-set launcher variables on every rank (the check
``from_env`` runs before any rendezvous when no group exists yet)."""

CAPTURED_FAULTS: tuple = ("compile_ok", "compile_shifted", "compile_split")
"""Compiled-step cases (``enable_tree_attention(compile_step=...)``, Dynamo with ``aot_eager`` on these CPU
ranks): ``compile_ok`` -- a compiled step's tokens against the eager step's (compiled before the timed
call); ``compile_shifted`` -- every rank's model is made with ``strategy="shifted"``, which a compiled step
refuses where it is made (no collective: a rank alone with that setting would be a disagreement of
strategies, ``compile_split``'s kind); ``compile_split`` -- only the culprit compiles its
steps (the prefill's agreement names ``compile_step``). They join ``FAULTS`` here."""
FAULTS = FAULTS + CAPTURED_FAULTS

KILL_WHERE = ("before_build", "inside_build", "first_merge", "decode")
"""Where a kill case's culprit dies; the kill cases take them in turn (2 per world size: all four over 2 sizes)."""

TOLERANCE = {"float32": 2e-5, "float64": 1e-10}


# --------------------------------------------------------------------------- the cases (plain data)


def make_case(rng: random.Random, world: int, index: int, fault: str | None = None, kinds: tuple = FAULTS) -> dict:
    """One random case for ``world`` ranks: the valid call it starts from and the fault applied to it
    (drawn from ``kinds``)."""
    from megatron_tree.comm.strategies import STRATEGIES

    hkv = rng.choice((1, 2))
    return {
        "index": index,
        "fault": fault or rng.choice(kinds),
        "culprit": rng.randrange(world),
        "batch": rng.choice((1, 2, 3)),
        "seqlen_q": rng.choice((1, 1, 2)),
        "heads_kv": hkv,
        "heads_q": hkv * rng.choice((1, 2)),
        "head_dim": rng.choice((4, 8)),
        "shard_lens": [rng.choice((0, 1, 3, 5)) for _ in range(world)],
        "strategy": rng.choice(STRATEGIES),
        "overlap": rng.random() < 0.3,
        "dtype": rng.choice(("float32", "float32", "float64")),
        "warm": rng.random() < 0.6,
        "seed": rng.randrange(2 ** 31),
    }


def make_kill_case(rng: random.Random, world: int, index: int, where: str = "decode") -> dict:
    case = make_case(rng, world, index, fault="kill")
    case.update(steps=rng.randrange(2, 6), kill_step=rng.randrange(0, 4), how=rng.choice(("exit", "sigkill")),
                where=where)
    case["kill_step"] = min(case["kill_step"], case["steps"] - 1)
    return case


# --------------------------------------------------------------------------- one rank


def _tensors(case: dict, world: int):
    """q, every rank's (k, v) shard and cache_seqlens, and the fp64 exact (out, lse)."""
    import torch

    from megatron_tree.ops import reference

    g = torch.Generator().manual_seed(case["seed"])
    b, sq, hq, hkv, d = (case[k] for k in ("batch", "seqlen_q", "heads_q", "heads_kv", "head_dim"))
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    ks, vs, lens = [], [], []
    for r in range(world):
        n = case["shard_lens"][r]
        ks.append(torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64))
        vs.append(torch.randn(b, n, hkv, d, generator=g, dtype=torch.float64))
        lens.append(torch.randint(0, n + 1, (b,), generator=g, dtype=torch.int32))
    if case["fault"] == "nan_q" and b:
        q[0, 0, hq - 1] = float("nan")
    if case["fault"] == "nan_k":
        r = max(range(world), key=lambda x: case["shard_lens"][x])
        if case["shard_lens"][r]:
            ks[r][b - 1, 0, 0] = float("nan")
            lens[r][b - 1] = case["shard_lens"][r]
    parts = [reference.partial_attention(q, ks[r], vs[r], cache_seqlens=lens[r]) for r in range(world)]
    want = reference.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    return q, ks, vs, lens, want


def _compare(got, want) -> dict:
    import torch

    got = got.double()
    nan_ok = bool(torch.equal(torch.isnan(got), torch.isnan(want)))
    fine = ~torch.isnan(want)
    err = float((got[fine] - want[fine]).abs().max()) if bool(fine.any()) else 0.0
    return {"kind": "returned", "err": err, "nan_ok": nan_ok}


def _decode_case(case, rank, world, groups, T):
    """tree_decode with one fault; returns the call to time and how to judge what it returns."""
    import torch

    from megatron_tree.decode.attention import tree_decode

    dtype = getattr(torch, case["dtype"])
    q, ks, vs, lens, (want, want_lse) = _tensors(case, world)
    fault, me = case["fault"], rank == case["culprit"]
    kw = dict(strategy=case["strategy"], overlap=case["overlap"], cache_seqlens=lens[rank])
    if case["strategy"] == "shifted":
        kw["shift"] = want_lse.float()
    args = [q.to(dtype), ks[rank].to(dtype), vs[rank].to(dtype)]
    if case["warm"]:  # the faulty call then comes in steady state (the others go straight into collectives)
        tree_decode(*args, groups, **kw)
    if fault == "empty_batch":
        args = [a[:0] for a in args]
        kw["cache_seqlens"] = lens[rank][:0]
        if "shift" in kw:
            kw["shift"] = kw["shift"][:0]
        want = want[:0]
    elif me and fault == "heads":
        args[0] = torch.cat([args[0], args[0]], dim=2)
    elif me and fault == "batch":
        args = [torch.cat([a, a]) for a in args]
        kw["cache_seqlens"] = torch.cat([lens[rank], lens[rank]])
    elif me and fault == "dtype":
        args = [a.to(torch.float16 if dtype == torch.float32 else torch.float32) for a in args]
    elif me and fault == "strategy":
        kw["strategy"] = "allgather" if case["strategy"] != "allgather" else "packed"
        kw.pop("shift", None)
    elif me and fault == "backend":
        kw["backend"] = "reference"
    elif me and fault == "seqlens_shape":
        kw["cache_seqlens"] = torch.cat([lens[rank], lens[rank][:1]])
    elif me and fault == "seqlens_range":
        kw["cache_seqlens"] = lens[rank] + case["shard_lens"][rank] + 1
    elif me and fault == "seqlens_dtype":
        kw["cache_seqlens"] = lens[rank].long()
    elif me and fault == "block_table_1d":
        kw["block_table"] = torch.zeros(case["batch"], dtype=torch.int32)
    elif fault.startswith("shift_"):
        kw["strategy"] = "shifted"
        kw["shift"] = want_lse.float()
        if me and fault == "shift_values":
            kw["shift"] = kw["shift"] + 0.3
        elif me and fault == "shift_presence":
            kw["shift"] = None
        elif me and fault == "shift_device":
            kw["shift"] = torch.zeros(kw["shift"].shape, device="meta")

    def call():
        return _compare(tree_decode(*args, groups, **kw), want)

    return call


def _paged_case(case, rank, world, groups, T):
    import torch

    from megatron_tree.ops import reference
    from megatron_tree.decode.attention import tree_decode
    from megatron_tree.decode.paged import PagedKVCache

    hkv, d, hq = case["heads_kv"], case["head_dim"], case["heads_q"]
    g = torch.Generator().manual_seed(case["seed"])
    n = 3 + case["seed"] % 9
    keys = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    vals = torch.randn(n, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(1, 1, hq, d, generator=g, dtype=torch.float64)
    cache = PagedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=2, blocks_per_rank=4,
                         max_seq_len=64, cp_size=world, cp_rank=rank, dtype=torch.float64)
    want = reference.partial_attention(q, keys[None], vals[None])[0]

    def call():
        if case["fault"] == "pool":  # every rank's bookkeeping is the same: the same error everywhere
            cache.extend("big", 2 * 4 * world + 1)
        placed = cache.extend("r", n)
        if case["fault"] == "paged_write":  # one KV head for a cache of more: refused, nothing written
            cache.write(0, keys[:, :1].expand(n, 1, d) if hkv > 1 else keys[:-1], vals, placed)
        cache.write(0, keys, vals, placed)
        table, lens = cache.rows(["r"], torch.tensor([n - 1]))
        return _compare(tree_decode(q, cache.k[0], cache.v[0], groups, block_table=table, cache_seqlens=lens,
                                    strategy=case["strategy"] if case["strategy"] != "shifted" else "packed"), want)

    return call


def _prefill_case(case, rank, world, groups, T):
    import torch

    from megatron_tree.ops import reference
    from megatron_tree.decode.prefill import ring_prefill

    hkv, d, hq, b = case["heads_kv"], case["head_dim"], case["heads_q"], case["batch"]
    g = torch.Generator().manual_seed(case["seed"])
    per = 2
    total = per * world
    q = torch.randn(b, total, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, total, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, total, hkv, d, generator=g, dtype=torch.float64)
    pos = torch.arange(total)[None].expand(b, total)
    mine = slice(rank * per, (rank + 1) * per)
    want = reference.partial_attention(q[:, mine], k, v, q_positions=pos[:, mine], k_positions=pos)[0]
    kk, vv, kp = k[:, mine], v[:, mine], pos[:, mine]
    if rank == case["culprit"] and case["fault"] == "prefill_heads":
        kk, vv = kk[:, :, :1].repeat(1, 1, 2, 1), vv[:, :, :1].repeat(1, 1, 2, 1)
        if hkv == 2:
            kk, vv = kk[:, :, :1], vv[:, :, :1]
    if rank == case["culprit"] and case["fault"] == "prefill_kpos":
        kp = kp[:, :1]

    def call():
        return _compare(ring_prefill(q[:, mine], kk, vv, pos[:, mine], kp, groups), want)

    return call


def _generate_case(case, rank, world, groups, T):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    torch.manual_seed(0)
    model = HFTreeModel(LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval(), groups)
    prompts = [[1, 2, 3, 4], [5, 6]]
    kw = {}
    me = rank == case["culprit"]
    if me and case["fault"] == "generate_prompt":
        prompts = [[1, 2, 3, 4], [5, 7]]
    elif me and case["fault"] == "generate_sampling":
        kw = dict(do_sample=True, temperature=0.5)
    elif me and case["fault"] == "generate_bad_token":
        prompts = [[1, 2, 99, 4], [5, 6]]

    def call():
        generate(model, prompts, 2, progress=False, **kw)
        return {"kind": "returned", "err": 0.0, "nan_ok": True}  # only errors are expected here

    return call


def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval()


def _ckpt_case(case, rank, world, groups, T, work):
    """``load_hf_model`` of this rank's own copy of a checkpoint (the culprit's, or every rank's, broken)."""
    import torch
    from safetensors.torch import save_file

    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel, load_hf_model

    fault = case["fault"]
    src = _tiny_llama()
    with torch.no_grad():
        src.model.norm.weight.fill_(3.0)  # a re-initialised norm (ones) would show in the tokens
    path = os.path.join(work, f"ckpt{case['index']}", f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    src.config.save_pretrained(path)
    tensors = {k: v.detach().clone().contiguous() for k, v in src.state_dict().items()}
    bad = fault != "ckpt_ok" and (rank == case["culprit"] or case["seed"] % 2 == 1)
    if bad and fault == "ckpt_missing_tensor":
        del tensors["model.norm.weight"]
    elif bad and fault == "ckpt_misshapen":
        tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(31, 16)
    weights = os.path.join(path, "model.safetensors")
    save_file(tensors, weights, metadata={"format": "pt"})
    if bad and fault == "ckpt_truncated":
        os.truncate(weights, os.path.getsize(weights) // 2)
    elif bad and fault == "ckpt_random_bytes":
        with open(weights, "wb") as f:
            f.write(random.Random(case["seed"]).randbytes(4096))
    elif bad and fault == "ckpt_no_config":
        os.remove(os.path.join(path, "config.json"))
    prompts = [[1, 2, 3, 4], [5, 6]]

    def call():
        model = load_hf_model(path, groups)
        got = dict(model.hf.state_dict())
        err = max(float((got[k].double() - v.double()).abs().max()) for k, v in tensors.items())
        want = generate(HFTreeModel(src, groups), prompts, 3, progress=False).tokens
        if generate(model, prompts, 3, progress=False).tokens != want:
            err = float("inf")
        return {"kind": "returned", "err": err, "nan_ok": True}

    return call


def _spec_case(case, rank, world, groups, T):
    """``verify_attention`` of a draft tree over the sharded cache, against the fp64 attention of each
    draft row over every valid committed key and its own ancestors among the drafts."""
    import torch

    from megatron_tree.decode.speculative import tree_mask, verify_attention

    dtype = getattr(torch, case["dtype"])
    q0, ks, vs, lens, _ = _tensors({**case, "fault": "none"}, world)
    b, hq, hkv, d = q0.shape[0], case["heads_q"], case["heads_kv"], case["head_dim"]
    mask = tree_mask(1 + case["seed"] % 2, 1 + case["seed"] % 3)
    t = mask.shape[0]
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q = torch.randn(b, t, hq, d, generator=g, dtype=torch.float64)
    dk = torch.randn(b, t, hkv, d, generator=g, dtype=torch.float64)
    dv = torch.randn(b, t, hkv, d, generator=g, dtype=torch.float64)
    want = torch.empty(b, t, hq, d, dtype=torch.float64)
    for i in range(b):
        keys = torch.cat([ks[r][i, :int(lens[r][i])] for r in range(world)])
        vals = torch.cat([vs[r][i, :int(lens[r][i])] for r in range(world)])
        for j in range(t):
            kk = torch.cat([keys, dk[i, mask[j]]]).repeat_interleave(hq // hkv, dim=1)
            vv = torch.cat([vals, dv[i, mask[j]]]).repeat_interleave(hq // hkv, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[i, j], kk) / d ** 0.5, dim=-1)
            want[i, j] = torch.einsum("hn,nhd->hd", p, vv)
    me = rank == case["culprit"]
    kw = dict(cache_seqlens=lens[rank], strategy=case["strategy"] if case["strategy"] != "shifted" else "packed")
    args = [q.to(dtype), ks[rank].to(dtype), vs[rank].to(dtype), dk.to(dtype), dv.to(dtype), mask.clone()]
    if me and case["fault"] == "spec_not_tree":
        if t > 1:
            args[5][0, t - 1] = True  # the root sees a later row
        else:
            args[5][0, 0] = False  # the only row does not see itself
    elif me and case["fault"] == "spec_too_many":
        kw["room"] = t - 1
    elif me and case["fault"] == "spec_drafts_differ":
        args[3] = args[3] + 1

    def call():
        return _compare(verify_attention(*args, groups, **kw), want)

    return call


def _spec_generate_case(case, rank, world, groups, T):
    """Speculative generation (prompt lookup) against greedy ``generate`` on the same model and groups."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig, generate_speculative
    from megatron_tree.integrations.hf import HFTreeModel

    model = HFTreeModel(_tiny_llama(), groups)
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5]][:1 + case["seed"] % 2]
    cfg = SpeculativeConfig(width=1 + case["seed"] % 2, depth=2)
    if rank == case["culprit"] and case["fault"] == "spec_config":
        cfg = SpeculativeConfig(width=cfg.width, depth=3)

    def call():
        got = generate_speculative(model, prompts, 6, speculative=cfg, progress=False).tokens
        want = generate(model, prompts, 6, progress=False).tokens
        return {"kind": "returned", "err": 0.0 if got == want else float("inf"), "nan_ok": True}

    return call


def _compile_case(case, rank, world, groups, T):
    """A compiled decode step (``HFTreeModel(compile_step=...)``) against the eager one, or a setting it refuses."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]][:1 + case["seed"] % 2]
    fault, me = case["fault"], rank == case["culprit"]
    compiled = {"backend": "aot_eager"}
    if fault == "compile_ok":
        model = HFTreeModel(_tiny_llama(), groups, compile_step=compiled)
        generate(model, prompts, 3, progress=False)  # traced here, before the timed call
        eager = HFTreeModel(_tiny_llama(), groups)

        def call():
            got = generate(model, prompts, 5, progress=False).tokens
            want = generate(eager, prompts, 5, progress=False).tokens
            return {"kind": "returned", "err": 0.0 if got == want else float("inf"), "nan_ok": True}

        return call

    def call():
        if fault == "compile_shifted":
            model = HFTreeModel(_tiny_llama(), groups, strategy="shifted", compile_step=compiled)
        else:  # compile_split: only the culprit compiles its steps
            model = HFTreeModel(_tiny_llama(), groups, compile_step=compiled if me else False)
        generate(model, prompts, 3, progress=False)
        return {"kind": "returned", "err": 0.0, "nan_ok": True}  # only errors are expected here

    return call


def _launcher_env(case, rank, world) -> dict:
    """The launcher variables this rank's ``from_env`` sees (torchrun's, as a block placement)."""
    per = 2 if world == 4 else world
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per), "LOCAL_WORLD_SIZE": str(per),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    if rank == case["culprit"]:
        if case["fault"] == "env_local_size":
            env["LOCAL_WORLD_SIZE"] = str(1 if per > 1 else 2)
        elif case["fault"] == "env_local_rank":
            env["LOCAL_RANK"] = str((rank + 1) % per)
        elif case["fault"] == "env_unreadable":
            env["LOCAL_WORLD_SIZE"] = "two"
    return env


HALF_SET = (
    {"RANK": "0"},
    {"WORLD_SIZE": "2", "LOCAL_RANK": "0"},
    {"SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
    {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"},
    {"RANK": "3", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
)
"""Launcher variables set by halves (the same on every rank): each a ``LauncherEnvError`` before any wait."""


def _groups_for(case, rank, world, T):
    """The case's groups: ``TreeGroups.build``, or ``from_env`` for the launcher-variable cases
    (whose error, if any, is the case's outcome: ``(None, record)``)."""
    from megatron_tree.distributed import topology
    from megatron_tree.distributed.topology import TreeGroups

    fault = case["fault"]
    if not fault.startswith("env_"):
        return TreeGroups.build(intra_size=2 if world == 4 else None, timeout=T), None
    start = time.monotonic()
    try:
        if fault == "env_half":  # what from_env checks before any rendezvous when no group exists yet
            topology.launcher_rendezvous(HALF_SET[case["seed"] % len(HALF_SET)])
            raise AssertionError("half-set launcher variables were accepted")
        return TreeGroups.from_env(timeout=T, env=_launcher_env(case, rank, world)), None
    except Exception as e:  # noqa: BLE001
        rec = {"kind": "raised", "type": type(e).__name__, "comm": _is_comm(e), "message": str(e)[:2000]}
        rec["seconds"] = time.monotonic() - start
        return None, rec


def _run_case(case, rank, world, groups, T, work: str = "") -> dict:
    fault = case["fault"]
    if fault.startswith("ckpt_"):
        call = _ckpt_case(case, rank, world, groups, T, work)
    elif fault.startswith("compile_"):
        call = _compile_case(case, rank, world, groups, T)
    elif fault in ("spec_generate_ok", "spec_config"):
        call = _spec_generate_case(case, rank, world, groups, T)
    elif fault.startswith("spec_"):
        call = _spec_case(case, rank, world, groups, T)
    elif fault in ("pool", "paged_write", "none_paged"):
        call = _paged_case(case, rank, world, groups, T)
    elif fault.startswith("prefill_"):
        call = _prefill_case(case, rank, world, groups, T)
    elif fault.startswith("generate_"):
        call = _generate_case(case, rank, world, groups, T)
    else:
        call = _decode_case(case, rank, world, groups, T)
    if fault == "stuck" and rank == case["culprit"]:
        time.sleep(1.5 * T + 0.5)  # alive, but never makes the call
        return {"kind": "skipped", "seconds": 0.0}
    start = time.monotonic()
    try:
        rec = call()
    except Exception as e:  # noqa: BLE001 -- what every rank raised is the measurement
        rec = {"kind": "raised", "type": type(e).__name__, "comm": _is_comm(e), "message": str(e)[:2000]}
    rec["seconds"] = time.monotonic() - start
    return rec


def _is_comm(e: BaseException) -> bool:
    from megatron_tree.distributed.collectives import CommError

    return isinstance(e, CommError)


def _line_up(store, key: str, world: int, wait: float) -> None:
    """Every rank reached ``key`` (the rendezvous store: not the groups under test)."""
    store.add(key, 1)
    deadline = time.monotonic() + wait
    while int(store.add(key, 0)) < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks did not line up at {key} within {wait} s")
        time.sleep(0.01)


def _rank_main(rank: int, world: int, cases: list, opts: dict, out_dir: str) -> None:
    """One rank of a launch (``run_ranks`` made the default group, one thread, ``TRITON_INTERPRET``
    in its environment): every case in order, one JSON record per line in ``out_dir/rank{rank}.jsonl``."""
    import torch.distributed as dist

    from megatron_tree.integrations import hf  # noqa: F401 -- import transformers before the timed calls

    store = dist.distributed_c10d._get_default_store()
    T = opts["timeout"]
    open(os.path.join(out_dir, f"ready{rank}"), "w").close()  # imports and rendezvous done: the cases' clock starts
    path = os.path.join(out_dir, f"rank{rank}.jsonl")
    with open(path, "a") as f:
        for case in cases:
            _line_up(store, f"soak/{case['index']}", world, opts["pg_timeout"])
            if case["fault"] == "kill":  # the kill case builds its groups itself (its culprit may die inside)
                groups, rec = None, _kill_case(case, rank, world, T)
            else:
                groups, rec = _groups_for(case, rank, world, T)
                if rec is None:
                    rec = _run_case(case, rank, world, groups, T, out_dir)
            rec["index"] = case["index"]
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
            made = () if groups is None else (groups.cp_group, *(lvl.group for lvl in groups.levels))
            for pg in {id(x): x for x in made}.values():
                try:
                    dist.destroy_process_group(pg)
                except Exception:  # noqa: BLE001 -- a group a failed collective left broken
                    pass
    if cases and cases[-1]["fault"] == "kill":
        os._exit(0)  # a peer is gone: no orderly teardown of the default group (the launch expects no result)


def _kill_case(case, rank, world, T) -> dict:
    """The culprit dies (``where``): before ``TreeGroups.build`` (it never wrote its liveness record),
    inside it (as it starts creating the process groups), after it and before the first merge, or at
    ``kill_step`` of a decode loop. The survivors must raise a CommError naming it, within the bound."""
    import torch

    from megatron_tree.decode.attention import tree_decode
    from megatron_tree.distributed import collectives
    from megatron_tree.distributed.topology import TreeGroups

    where, me = case.get("where", "decode"), rank == case["culprit"]

    def die():
        if case["how"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(17)

    q, ks, vs, lens, (want, _) = _tensors({**case, "fault": "none"}, world)
    start = time.monotonic()
    try:
        if me and where == "before_build":
            die()
        if me and where == "inside_build":
            collectives.new_group = lambda *a, **k: die()
        groups = TreeGroups.build(intra_size=2 if world == 4 else None, timeout=T)
        if me and where == "first_merge":
            die()
        for step in range(case["steps"]):
            if me and where == "decode" and step == case["kill_step"]:
                die()
            start = time.monotonic()
            got = tree_decode(q.float(), ks[rank].float(), vs[rank].float(), groups, strategy=case["strategy"],
                              cache_seqlens=lens[rank], overlap=case["overlap"],
                              shift=None if case["strategy"] != "shifted" else torch.zeros(q.shape[0], q.shape[2], q.shape[1]))
        rec = _compare(got, want)
    except Exception as e:  # noqa: BLE001
        rec = {"kind": "raised", "type": type(e).__name__, "comm": _is_comm(e), "message": str(e)[:2000]}
    rec["seconds"] = time.monotonic() - start
    return rec


# --------------------------------------------------------------------------- the parent


def classify(case: dict, recs: dict, world: int, T: float) -> tuple[str, bool]:
    """(outcome, slow) of one case from every rank's record (rank -> record; missing: no record)."""
    expected_dead = {case["culprit"]} if case["fault"] == "kill" else set()
    live = [r for r in range(world) if r not in expected_dead]
    if any(r not in recs for r in live):
        return "native_crash", False
    got = [recs[r] for r in live if recs[r]["kind"] != "skipped"]
    seconds = max((g["seconds"] for g in got), default=0.0)
    if seconds > 3 * T:
        return "hang", True
    slow = seconds > 1.5 * T
    returned = [g for g in got if g["kind"] == "returned"]
    tol = TOLERANCE[case["dtype"]]
    if any(not g["nan_ok"] or g["err"] > tol for g in returned):
        return "silent_wrong", slow
    if len(returned) == len(got):
        return "exact", slow
    if returned:
        return "not_alike", slow
    if case["fault"] in VALID:
        return "spurious_error", slow
    if case["fault"] == "kill":  # every survivor: a CommError naming the dead rank
        named = all(g["comm"] and f"rank {case['culprit']}" in g["message"] for g in got)
        return ("clear_error_every_rank" if named else "not_alike"), slow
    if case["fault"] == "stuck" and all(g["comm"] for g in got):
        return "clear_error_every_rank", slow
    if len({(g["type"], g["message"]) for g in got}) == 1:
        return "clear_error_every_rank", slow
    return "not_alike", slow


def _launch(world: int, cases: list, opts: dict, out_dir: str) -> dict:
    """Run ``cases`` on ``world`` fresh ranks (``run_ranks``); returns {index: {rank: record}} and
    whether the launch was stopped as stalled."""
    from megatron_tree.utils.testing import RankFailure, run_ranks

    for r in range(world):
        open(os.path.join(out_dir, f"rank{r}.jsonl"), "w").close()
        if os.path.exists(os.path.join(out_dir, f"ready{r}")):
            os.remove(os.path.join(out_dir, f"ready{r}"))
    # Once every rank is ready (start-up on a loaded machine takes minutes, not a case's time): no rank
    # finished a case for ``stall`` seconds means the case in progress hangs.
    stall = 3 * opts["timeout"] + 60
    startup = time.monotonic() + opts.get("startup_s", 600)
    state = {"last": time.monotonic(), "seen": -1, "ready": False, "stalled": False}

    def watch():  # the harness calls it while the ranks run; a text stops them
        now = time.monotonic()
        if not state["ready"]:
            state["ready"] = all(os.path.exists(os.path.join(out_dir, f"ready{r}")) for r in range(world))
            state["last"] = now
            state["stalled"] = not state["ready"] and now > startup
        else:
            done = sum(_count_lines(os.path.join(out_dir, f"rank{r}.jsonl")) for r in range(world))
            if done != state["seen"]:
                state["seen"], state["last"] = done, now
            state["stalled"] = now - state["last"] > stall
        if state["stalled"]:
            return f"stalled: no case finished for {stall:.0f} s" if state["ready"] else "stalled in start-up"
        return None

    # A kill launch ends with the culprit dead and the survivors leaving without a result (os._exit).
    kill = any(c["fault"] == "kill" for c in cases)
    try:
        run_ranks(_rank_main, world, cases, opts, out_dir, timeout=float("inf"), pg_timeout=opts["pg_timeout"],
                  env={"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1"),
                       "MEGATRON_TREE_TRANSPORT": opts.get("transport", "backend")},
                  expect_dead=tuple(range(world)) if kill else (), watch=watch)
    except RankFailure as e:  # a crash or a stall: the records say which case was in progress
        print(f"CP {world} launch ended early:\n{e}", file=sys.stderr)
    results: dict = {}
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                results.setdefault(rec["index"], {})[r] = rec
    return {"records": results, "stalled": state["stalled"]}


def _count_lines(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def run(opts: dict) -> dict:
    rng = random.Random(opts["seed"])
    counts = {o: 0 for o in OUTCOMES}
    slow = 0
    by_fault: dict = {}
    examples: dict = {}
    errors: dict = {}
    slowest: dict = {}  # per fault kind: the longest any rank took from its call to its result or error
    started = time.monotonic()
    sizes = opts["ranks"]
    per_world = [opts["cases"] // len(sizes) + (1 if i < opts["cases"] % len(sizes) else 0) for i in range(len(sizes))]
    index = kill_no = 0
    with tempfile.TemporaryDirectory(prefix="mt_faults_") as tmp:
        for world, n in zip(sizes, per_world):
            kills = min(opts["kills"], n)
            cases = [make_case(rng, world, index + i, kinds=opts.get("faults") or FAULTS) for i in range(n - kills)]
            index += len(cases)
            batches = [cases] + [[make_kill_case(rng, world, index + j, KILL_WHERE[(kill_no + j) % len(KILL_WHERE)])]
                                 for j in range(kills)]
            kill_no += kills
            index += kills
            for batch in batches:
                todo = list(batch)
                while todo:
                    res = _launch(world, todo, opts, tmp)
                    finished = [c for c in todo if c["index"] in res["records"]
                                and len(res["records"][c["index"]]) >= world - (c["fault"] == "kill")]
                    for c in todo:
                        recs = res["records"].get(c["index"], {})
                        complete = c in finished
                        if not complete and c is not _first_unfinished(todo, finished):
                            continue
                        if complete:
                            outcome, was_slow = classify(c, recs, world, opts["timeout"])
                        else:
                            outcome, was_slow = ("hang" if res["stalled"] else "native_crash"), False
                        counts[outcome] += 1
                        slow += was_slow
                        kind = c["fault"] + (f":{c['where']}" if c["fault"] == "kill" else "")
                        by_fault.setdefault(kind, {}).setdefault(outcome, 0)
                        by_fault[kind][outcome] += 1
                        took = max((r.get("seconds", 0.0) for r in recs.values()), default=0.0)
                        slowest[kind] = round(max(slowest.get(kind, 0.0), took), 3)
                        raised = [recs[r] for r in sorted(recs) if recs[r].get("kind") == "raised"]
                        if raised and kind not in errors:  # the first error each kind gave, as users read it
                            errors[kind] = f"{raised[0]['type']}: {raised[0]['message'][:400]}"
                        if outcome not in ("clear_error_every_rank", "exact") or was_slow:
                            examples.setdefault(outcome, []).append({"case": c, "records": recs})
                        if opts.get("progress"):
                            print(f"CP {world} case {c['index']:4d} {c['fault']:>18}: {outcome}{' (slow)' if was_slow else ''}",
                                  file=sys.stderr)
                    stop = _first_unfinished(todo, finished)
                    todo = [] if stop is None else todo[todo.index(stop) + 1:]
    return {"command": opts.get("command"), "seed": opts["seed"], "ranks": sizes, "timeout_s": opts["timeout"],
            "cases": sum(counts.values()), "counts": counts, "slow_beyond_1.5T": slow, "by_fault": by_fault,
            "examples": {k: v[:5] for k, v in examples.items()}, "first_error": dict(sorted(errors.items())),
            "slowest_s": dict(sorted(slowest.items())),
            "seconds": round(time.monotonic() - started, 1)}


def markdown(report: dict) -> str:
    """The report as the docs page shows it: the command, the counts, and the counts by fault kind."""
    lines = [f"Command: `{report['command']}` (seed {report['seed']}, CP sizes {report['ranks']}, "
             f"T = {report['timeout_s']:g} s; {report['cases']} cases in {report['seconds']:.0f} s).", "",
             "| outcome | cases |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in report["counts"].items()]
    lines += [f"| (ended beyond 1.5 T, within 3 T) | {report['slow_beyond_1.5T']} |", "",
              "| fault | " + " | ".join(f"`{o}`" for o in OUTCOMES) + " |", "|---|" + "---|" * len(OUTCOMES)]
    lines[-2] += " slowest rank (s) |"
    lines[-1] += "---|"
    for fault in sorted(report["by_fault"]):
        row = report["by_fault"][fault]
        lines.append(f"| `{fault}` | " + " | ".join(str(row.get(o, 0)) for o in OUTCOMES)
                     + f" | {report.get('slowest_s', {}).get(fault, 0.0):.2f} |")
    return "\n".join(lines) + "\n"


def _first_unfinished(todo: list, finished: list):
    for c in todo:
        if c not in finished:
            return c
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=300, help="cases in all, split over the world sizes")
    p.add_argument("--ranks", default="2,3,4", help="world sizes (4 runs as 2 x 2)")
    p.add_argument("--kills", type=int, default=2, help="kill cases per world size (a launch each)")
    p.add_argument("--timeout", type=float, default=1.5, help="T: the groups' collective timeout, seconds")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="the default group's timeout, seconds")
    p.add_argument("--out", default=None, help="write the report (JSON) here")
    p.add_argument("--markdown", default=None, help="write the counts as a markdown table here")
    p.add_argument("--faults", default=None, help="comma-separated fault kinds to draw from (default: all of FAULTS)")
    p.add_argument("--progress", action="store_true")
    p.add_argument("--transport", choices=("auto", "backend", "shm"), default="backend",
                   help="the groups' transport in every case (TreeGroups.build(transport=))")
    args = p.parse_args(argv)
    kinds = tuple(args.faults.split(",")) if args.faults else None
    unknown = sorted(set(kinds or ()) - set(FAULTS))
    if unknown:
        p.error(f"unknown fault kinds {unknown}; expected some of {', '.join(FAULTS)}")
    opts = {"seed": args.seed, "cases": args.cases, "ranks": [int(x) for x in args.ranks.split(",")],
            "kills": args.kills, "timeout": args.timeout, "faults": kinds, "pg_timeout": args.pg_timeout, "progress": args.progress,
            "transport": args.transport,
            "command": "python -m benchmarks.faults " + " ".join(sys.argv[1:] if argv is None else argv)}
    report = run(opts)
    text = json.dumps(report, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(report))
    print(json.dumps({"counts": report["counts"], "slow_beyond_1.5T": report["slow_beyond_1.5T"],
                      "cases": report["cases"], "seconds": report["seconds"]}))
    bad = report["counts"]["silent_wrong"] + report["counts"]["hang"] + report["counts"]["native_crash"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
