"""The lm-eval backend's ``speculative=prompt_lookup`` switch: ``generate_until`` drafts, same outputs.

One process (world 1), a tiny Llama over the word-level test tokenizer whose attention outputs are
scaled down (its greedy text cycles, so prompt lookup finds drafts in the context): the backend with
``speculative=prompt_lookup`` against the same backend without it on the same greedy requests
(identical strings, drafts accepted), sampled requests through the speculative loop, and the bad
model_args. The decode tier's own tests check the speculative loop at CP 2, 3 and 2 x 2.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.lm_eval import Req, build_tokenizer, offline_env

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'megatron_tree[lmeval]')")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = str(tmp_path_factory.mktemp("lm_eval_spec"))
    tok = build_tokenizer(os.path.join(root, "tok"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      initializer_range=0.2, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-3)
    model.save_pretrained(os.path.join(root, "llama"))
    return os.path.join(root, "llama"), os.path.join(root, "tok")


CONTEXTS = ["the cat sees the dog and the cat sees the dog and the cat", "red blue green red blue green red",
            "one two", "my old house is by the river so my old house is"]


def _lm(checkpoint, extra=""):
    from megatron_tree.integrations import lm_eval as backend

    llama, tok = checkpoint
    return backend.TreeLM.create_from_arg_string(f"pretrained={llama},tokenizer={tok},max_length=128{extra}",
                                                 {"device": "cpu", "batch_size": 2})


def test_prompt_lookup_generate_until_equals_plain(checkpoint, monkeypatch):
    offline_env()
    from megatron_tree.decode.speculative import SpeculativeConfig

    seen = []
    original = SpeculativeConfig.generate

    def recording(self, *a, **kw):
        r = original(self, *a, **kw)
        seen.append((self.width, self.depth, r.steps, sum(r.accepted)))
        return r

    monkeypatch.setattr(SpeculativeConfig, "generate", recording)
    reqs = [Req(c, {"until": ["."], "max_gen_toks": 16}) for c in CONTEXTS] + \
        [Req(c, {"until": ["zebra"], "max_gen_toks": 16}) for c in CONTEXTS[:2]]
    plain = _lm(checkpoint).generate_until(reqs)
    assert not seen
    spec = _lm(checkpoint, ",speculative=prompt_lookup,speculative_width=2,speculative_depth=3").generate_until(reqs)
    assert spec == plain
    assert seen and all(w == 2 and d == 3 for w, d, _, _ in seen), seen
    assert any(acc > steps for _, _, steps, acc in seen), f"no draft was accepted: {seen}"  # drafting did happen

    sampled = [Req(c, {"until": ["."], "max_gen_toks": 12, "do_sample": True, "temperature": 0.8}) for c in CONTEXTS]
    lm = _lm(checkpoint, ",speculative=prompt_lookup,seed=7")
    seen.clear()
    a = lm.generate_until(sampled)
    assert len(a) == len(sampled) and all(isinstance(s, str) for s in a) and seen


def test_speculative_model_args_bad_input(checkpoint):
    offline_env()
    from megatron_tree.integrations import lm_eval as backend

    llama, tok = checkpoint
    for extra, message in ((",speculative=medusa", "speculative='medusa' is not one of ['prompt_lookup']"),
                           (",speculative=prompt_lookup,speculative_depth=0", "speculative_depth must be a positive"),
                           (f",speculative=prompt_lookup,source=megatron,tokenizer={tok}",
                            "speculative is available with source=hf only")):
        with pytest.raises(backend.ModelArgsError) as e:
            backend.TreeLM.create_from_arg_string(f"pretrained={llama}{extra}")
        assert message in str(e.value), (extra, str(e.value))


def test_compile_step_generate_until_equals_plain(checkpoint):
    """``compile_step=aot_eager``: ``generate_until``'s decode steps run compiled (Dynamo, one trace per cache
    shape), with the eager backend's strings; a bad value or ``source=megatron`` is refused by name (not the
    default, ``auto``, nor ``false``: Megatron's engine runs them as it runs its own step)."""
    offline_env()
    from megatron_tree.integrations import lm_eval as backend

    reqs = [Req(c, {"until": ["."], "max_gen_toks": 10}) for c in CONTEXTS]
    default = _lm(checkpoint)
    plain = default.generate_until(reqs)
    steps = default.model._binding.compiled  # the default, auto: captured on a GPU, eager on this CPU
    assert default.args.compile_step == "auto" and steps.auto and not steps.steps
    assert _lm(checkpoint, ",compile_step=false").generate_until(reqs) == plain
    llama, tok = checkpoint
    for extra in ({}, {"compile_step": "auto"}, {"compile_step": "false"}):
        args = backend.model_args_from({"pretrained": llama, "tokenizer": tok, "source": "megatron", **extra})
        assert args.compile_step == extra.get("compile_step", "auto"), (extra, args.compile_step)
    lm = _lm(checkpoint, ",compile_step=aot_eager")
    assert lm.generate_until(reqs) == plain
    assert lm.model._binding.compiled.steps, "no decode step was compiled"
    for extra, message in ((",compile_step=yes", "compile_step='yes' is not one of"),
                           (",source=megatron,compile_step=true", "compile_step is available with source=hf only"),
                           (",compile_step=reduce-overhead", "captures the decode step in a CUDA graph, but the "
                                                             "device is cpu")):
        with pytest.raises(backend.ModelArgsError, match=message):
            backend.TreeLM.create_from_arg_string(f"pretrained={llama},tokenizer={tok}{extra}", {"device": "cpu"})


def test_speculative_with_an_explicit_compile_step_is_refused_by_name(checkpoint):
    """``speculative=prompt_lookup`` runs every decode step as a several-token verification forward, which runs
    eagerly: an explicit ``compile_step`` (true, aot_eager, reduce-overhead) would compile nothing, silently (no
    step of the run was compiled). Refused naming both; ``auto`` and ``false`` are taken as they are."""
    from megatron_tree.integrations import lm_eval as backend

    llama, tok = checkpoint
    base = {"pretrained": llama, "tokenizer": tok, "speculative": "prompt_lookup"}
    for setting in ("true", "aot_eager", "reduce-overhead"):
        with pytest.raises(backend.ModelArgsError, match=f"compile_step={setting}.*speculative=prompt_lookup"):
            backend.model_args_from({**base, "compile_step": setting})
    for setting in ("auto", "false"):
        assert backend.model_args_from({**base, "compile_step": setting}).compile_step == setting
