"""Models built on the sequence-sharded KV cache; importing this package loads no weights."""

from .llama import CheckpointError, Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig", "CheckpointError"]
