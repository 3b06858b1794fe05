"""Integrations with large-model frameworks: Megatron-Core (``.megatron``), DeepSpeed (``.deepspeed``), transformers (``.hf``).

Invariant: importing this package imports no framework (they are heavy and print
warnings at import); each submodule imports its framework when it is itself imported, and
refuses framework versions it was not written against with a message naming both.
"""

__all__ = ["megatron", "deepspeed", "hf", "patches"]
