"""A decode forward that raises leaves the TreeCache as it was before it: the next step is exact.

A decode forward places its new tokens (host bookkeeping, the rows' placement) before the layers run, and
the layers that do run store their keys there. If a later layer raises, the global length must not grow and
the placement must be taken back, or the next step lands one slot further and every later step reads a
stray key (wrong logits, no error). Three gloo ranks (CP 3) run a tiny random Mistral with a sliding window
and a prefill window below the prompts, on a left-padded batch of ragged prompts (29, 17 and 1 tokens);
layer 1 raises once in a decode forward, then decoding goes on on the same cache: a forward of two new tokens
per row (assisted decoding's chain), then single steps. Each forward's logits are compared with a
single-process forward of the row's unpadded tokens. A decode step refused before its
layers run (a compiled step on a cache that is not static) must leave no forward behind either: no
metadata, the rows' lengths as before, ``crop`` allowed.
"""

from __future__ import annotations

import torch

from tests.helpers.ranks import run_ranks

STEPS = 4


def _rank(rank, world):
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import HFTreeModel
    from tests.helpers.hf_models import batch, hf_model

    ref = hf_model("mistral", sliding_window=5)
    hf = hf_model("mistral", sliding_window=5)
    hf.generation_config.eos_token_id = None
    m = HFTreeModel(hf, TreeGroups.build(), max_prefill_tokens=6)
    ids, mask = batch()
    rows = [ids[b][mask[b].bool()].tolist() for b in range(ids.shape[0])]
    with torch.no_grad():
        out = m.hf.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                            return_dict_in_generate=True)
        cache = out.past_key_values
        for b, row in enumerate(rows):
            row += out.sequences[b, ids.shape[1]:].tolist()
        length = cache.get_seq_length()

        def step():  # each row's last token at its own position (the prompts are left-padded)
            return m.hf(input_ids=torch.tensor([[r[-1]] for r in rows]),
                        position_ids=torch.tensor([[len(r) - 1] for r in rows]), past_key_values=cache,
                        use_cache=True).logits[:, -1]

        def boom(module, args):
            raise RuntimeError("layer 1 failed")

        hook = m.hf.model.layers[1].register_forward_pre_hook(boom)
        try:
            step()
            raised = None
        except RuntimeError as e:
            raised = str(e)
        finally:
            hook.remove()
        after = {"raised": raised, "metadata": cache.metadata, "length": cache.get_seq_length() - length}
        # first two new tokens per row in one forward (assisted decoding's chain: it reads the shard as it
        # stands, so the taken-back token must not count), then one token per step
        chain = m.hf(input_ids=torch.tensor([[r[-1], 7] for r in rows]),
                     position_ids=torch.tensor([[len(r) - 1, len(r)] for r in rows]), past_key_values=cache,
                     use_cache=True).logits
        want = torch.stack([ref(input_ids=torch.tensor([r + [7]]), use_cache=False).logits[0, -2:] for r in rows])
        diffs = [float((chain - want).abs().max())]
        for r, t in zip(rows, want[:, -1].argmax(-1).tolist()):
            r += [7, t]
        for _ in range(STEPS):
            got = step()
            want = torch.stack([ref(input_ids=torch.tensor([r]), use_cache=False).logits[0, -1] for r in rows])
            diffs.append(float((got - want).abs().max()))
            for r, t in zip(rows, want.argmax(-1).tolist()):
                r.append(t)
    return {"after": after, "diffs": diffs}


def test_a_decode_forward_that_raises_leaves_the_cache_as_before():
    for r in run_ranks(_rank, 3, timeout=600):
        assert r["after"] == {"raised": "layer 1 failed", "metadata": None, "length": 0}, r["after"]
        assert max(r["diffs"]) < 5e-5, r["diffs"]  # every step after the failed one exact


def _refused_compiled_step(rank, world):
    from megatron_tree.distributed.topology import TreeGroups
    from megatron_tree.integrations.hf import HFTreeModel, TreeCache
    from tests.helpers.hf_models import hf_model

    hf = hf_model("llama")
    groups = TreeGroups.build()
    m = HFTreeModel(hf, groups, compile_step=True)
    cache = TreeCache(hf, groups, static=False)  # a compiled step refuses it, before anything is traced
    with torch.no_grad():
        out = m.hf(input_ids=torch.tensor([[5, 17, 99, 3, 42, 7, 8]]), past_key_values=cache, use_cache=True)
        length, rows = cache.get_seq_length(), list(cache.storage.lengths)
        try:
            m.hf(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            error = None
        except ValueError as e:
            error = str(e)
        state = {"metadata": cache.metadata, "length": cache.get_seq_length() == length,
                 "rows": list(cache.storage.lengths) == rows}
        cache.crop(-1)  # between forwards: allowed
    return {"error": error, "state": state, "cropped": list(cache.storage.lengths)}


def test_a_refused_compiled_step_leaves_no_forward_behind():
    for r in run_ranks(_refused_compiled_step, 2, timeout=300):
        assert r["error"] is not None and "needs a static TreeCache" in r["error"], r["error"]
        assert r["state"] == {"metadata": None, "length": True, "rows": True}, r["state"]
        assert r["cropped"] == [6], r["cropped"]
