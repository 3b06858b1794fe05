"""The local tier: one rank's attention over its own keys and values, and the exact merge of partial states.

Nothing here knows about process groups. ``triton/`` holds the kernels and their launchers;
``reference`` the pure-torch oracle and the one merge formula; ``contract`` the input checks
and dtype policy every entry shares; ``torch_decode`` and ``fused_prefill`` the CPU paths;
``dispatch`` picks a backend per call and registers the custom ops.
"""

from .dispatch import flash_decode, merge_states, prefill_attention, resolve_backend

__all__ = ["flash_decode", "merge_states", "prefill_attention", "resolve_backend"]
