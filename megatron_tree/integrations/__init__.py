"""Integrations with large-model frameworks: Megatron-Core (``.megatron``) and DeepSpeed (``.deepspeed``).

Invariant: importing this package imports neither framework (both are heavy and print
warnings at import); each submodule imports its framework when it is itself imported, and
refuses framework versions it was not written against with a message naming both.
"""

__all__ = ["megatron", "deepspeed", "patches"]
