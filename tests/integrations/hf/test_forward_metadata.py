"""Each forward's attention metadata in the transformers integration: built once by the cache, one object that
every layer's attention reads, of the forward's kind, and gone between forwards.

Two gloo ranks (CP 2) run a tiny random Llama enabled with a prefill window far below the prompt (so the
prompt takes several forwards) through transformers' ``generate``, then one forward of three new tokens per
row on the filled cache (what assisted decoding verifies its candidates with: kept aside, not stored). A spy
in place of the registered attention function records, for each layer's call, the cache's ``metadata``
object and its ``mode`` (and, once, tries a crop: refused while the forward runs). Then a decode step, a
chain and a speculative verification whose attention raises: they too leave no metadata behind (a crop
after them is not refused as one made during a forward).
"""

from __future__ import annotations

import torch

from tests.helpers.ranks import run_ranks

CHUNK = 8  # windows of 8 prompt tokens at CP 2
NEW = 10


class _Broken(RuntimeError):
    """What the failing attention raises (told apart from any other error)."""


def _rank(rank, world):
    from transformers import AttentionInterface

    from megatron_tree.decode.metadata import (
        PrefillMetadata,
        StepMetadata,
        VerifyMetadata,
    )
    from megatron_tree.decode.speculative import verify_forward
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import HFTreeModel, TreeCache
    from megatron_tree.integrations.hf.attention import tree_attention_forward
    from megatron_tree.integrations.hf.common import _MARK, ATTN_IMPLEMENTATION
    from tests.helpers.hf_models import hf_model

    calls, inside = [], []

    def spy(module, *args, **kwargs):
        active = getattr(module, _MARK).active
        meta = active.metadata
        calls.append((module.layer_idx, meta))
        if meta.mode == "verify" and not inside:  # a crop while the chain's layers run is refused
            try:
                active.crop(-1)
                inside.append(None)
            except RuntimeError as e:
                inside.append(str(e))
        return tree_attention_forward(module, *args, **kwargs)

    hf = hf_model("llama")
    hf.generation_config.eos_token_id = None
    m = HFTreeModel(hf, TreeGroups.build(), max_prefill_tokens=CHUNK)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])
    AttentionInterface.register(ATTN_IMPLEMENTATION, spy)
    try:
        with torch.no_grad():
            out = m.hf.generate(prompt, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                                return_dict_in_generate=True)
            chain = m.hf(input_ids=out.sequences[:, -3:], past_key_values=out.past_key_values, use_cache=True)
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
    layers = hf.config.num_hidden_layers
    forwards = [calls[i:i + layers] for i in range(0, len(calls), layers)]
    kinds = {PrefillMetadata: "prefill", StepMetadata: "decode", VerifyMetadata: "verify"}
    cache = out.past_key_values
    # a write outside a forward is refused: there is no forward metadata to write by
    try:
        cache.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), 0)
        stray = None
    except (RuntimeError, ValueError) as e:  # RuntimeError expected; any other is recorded for the assertion
        stray = str(e)
    after = getattr(cache.metadata, "mode", cache.metadata)  # (its mode: no tensors sent back)
    # a forward whose attention raises (a decode step, a 3-token chain, a verification) leaves no metadata behind either:
    # the next crop is not taken for one made during a forward
    failed = []

    def broken(module, *args, **kwargs):
        raise _Broken(f"layer {module.layer_idx}")

    AttentionInterface.register(ATTN_IMPLEMENTATION, broken)
    try:
        for ids in (out.sequences[:, -1:], out.sequences[:, -3:]):
            try:
                with torch.no_grad():
                    m.hf(input_ids=ids, past_key_values=cache, use_cache=True)
            except _Broken as e:
                failed.append((str(e), getattr(cache.metadata, "mode", cache.metadata)))  # (no tensors back)
        try:  # speculative decoding's verification forward (two drafts, a chain), started on its own path
            verify_forward(m, cache, out.sequences[:, -2:], torch.ones(2, 2, dtype=torch.bool).tril())
        except _Broken as e:
            failed.append((str(e), getattr(cache.metadata, "mode", cache.metadata)))
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
    length = cache.get_seq_length()
    try:
        cache.crop(-1)
        cropped = length - cache.get_seq_length()
    except RuntimeError as e:
        cropped = str(e)
    return {
        "complete": len(calls) % layers == 0,
        "layer_order": all([i for i, _ in f] == list(range(layers)) for f in forwards),
        "one_object": all(len({id(meta) for _, meta in f}) == 1 for f in forwards),
        "mode_matches_type": all(meta.mode == kinds[type(meta)] for _, meta in calls),
        "modes": [f[0][1].mode for f in forwards],
        "is_tree_cache": isinstance(cache, TreeCache),
        "after": after,
        "stray": stray,
        "tokens": out.sequences.tolist(),
        "chain_logits": chain.logits.shape,
        "failed": failed,
        "cropped": cropped,
        "crop_inside": inside,
    }


def test_every_forward_hands_its_layers_one_metadata_object_of_its_kind():
    results = run_ranks(_rank, 2, timeout=300)
    for r in results:
        assert r["complete"] and r["layer_order"], r
        assert r["one_object"]  # built once per forward, shared by every layer
        assert r["mode_matches_type"]
        modes = r["modes"]
        # the 22-token prompt in windows (several forwards), then NEW - 1 decode steps, then the chain
        w = len(modes) - NEW
        assert w > 1 and modes == ["prefill"] * w + ["decode"] * (NEW - 1) + ["verify"], modes
        assert tuple(r["chain_logits"]) == (1, 3, 128), r["chain_logits"]
        assert r["is_tree_cache"] and r["after"] is None  # no forward metadata between forwards
        assert r["stray"] is not None and "outside a forward" in r["stray"]
        # a failed forward's metadata is dropped too (else the crop would be refused as made during a forward)
        assert r["failed"] == [("layer 0", None)] * 3, r["failed"]
        assert r["cropped"] == 1, r["cropped"]
        assert len(r["crop_inside"]) == 1 and "during a forward" in str(r["crop_inside"][0]), r["crop_inside"]
    assert results[0]["tokens"] == results[1]["tokens"]
