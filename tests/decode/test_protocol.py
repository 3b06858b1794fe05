"""The written model protocol of the one generation loop (``decode/generate.py``), single process.

Every adapter ``generate`` drives provides :class:`DecodeModel` and makes :class:`DecodeCache`
caches (MegatronLM is checked inside ``test_megatron.py``'s run, which has built one); a plain
``DecodeStep`` is ``tree_decode``; and the loop's redo goes through ``cache.rewind_step()``, so an
adapter's ``decode_step`` run again after a rewind returns the first try's logits exactly.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from megatron_tree.decode.generate import DecodeCache, DecodeModel, DecodeStep, StepRunner


def test_the_protocol_is_written_down():
    for proto in (DecodeModel, DecodeCache):
        for name, member in vars(proto).items():
            if name.startswith("_"):
                continue
            fn = member.fget if isinstance(member, property) else member
            assert callable(fn) and inspect.getdoc(fn), f"{proto.__name__}.{name} says nothing"


def _hf_model():
    transformers = pytest.importorskip("transformers")
    from megatron_tree.integrations.hf import HFTreeModel

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return HFTreeModel(transformers.LlamaForCausalLM(cfg).eval(), None)


def test_adapters_provide_the_protocol_and_redo_through_the_cache():
    model = _hf_model()
    assert isinstance(model, DecodeModel)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    cache = model.new_cache(2, 12)
    assert isinstance(cache, DecodeCache)
    ids = model.prefill(prompts, cache).argmax(-1)
    first = model.decode_step(ids, cache, DecodeStep("packed"))
    lengths = list(cache.lengths)
    cache.rewind_step()  # what the loop's redo does: the same token again, on the same slots
    assert [n - 1 for n in lengths] == list(cache.lengths)
    again = model.decode_step(ids, cache, DecodeStep("packed"))
    assert torch.equal(first, again) and list(cache.lengths) == lengths
    # a runner over no CP group is a plain step: nothing to redo, no shift carried
    runner = StepRunner("shifted", model.groups)
    logits, redone = runner.run(model, again.argmax(-1), cache)
    assert not redone and runner.shifts is None and logits.shape == (2, model.vocab_size)
