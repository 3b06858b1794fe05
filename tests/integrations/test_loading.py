"""``integrations.loading.load_model``: a transformers model passed in (``model=``, as the eval does after its
checkpoint check) is wrapped with every setting asked for, as a checkpoint loaded from ``path`` is."""

from __future__ import annotations

import pytest
import torch

from megatron_tree.integrations.hf.forward import compiled_for
from megatron_tree.integrations.loading import load_model
from tests.helpers.hf_models import hf_model


@pytest.mark.parametrize("name, setting", [("aot_eager", {"backend": "aot_eager"}),
                                           ("reduce-overhead", {"mode": "reduce-overhead"})])
def test_a_model_passed_in_keeps_its_strategy_prefill_and_compile_step(name, setting):
    lm = load_model("hf", None, device="cpu", model=hf_model("llama"), strategy="allgather", prefill="allgather",
                    compile_step=name)
    binding = lm._binding
    assert (binding.strategy, binding.prefill) == ("allgather", "allgather")
    options = binding.compiled.options
    assert {k: options.get(k) for k in setting} == setting, options  # aot_eager: Dynamo only, not Inductor
    plain = load_model("hf", None, device="cpu", model=hf_model("llama"))._binding
    assert plain.strategy == "auto" and plain.compiled.auto  # the default: captured on a GPU, eager here
    assert compiled_for(plain, torch.device("cpu")) is None and compiled_for(plain, torch.device("cuda")) is not None
    eager = load_model("hf", None, device="cpu", model=hf_model("llama"), compile_step=False)._binding
    assert eager.compiled is None


def test_an_unknown_compile_step_name_is_refused_naming_the_names():
    with pytest.raises(ValueError, match=r"compile_step 'fast' is not one of \['aot_eager', 'reduce-overhead'\]"):
        load_model("hf", None, device="cpu", model=hf_model("llama"), compile_step="fast")
