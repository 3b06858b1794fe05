"""Megatron-Core integration: tree attention in Megatron-Core's module slots, its static and dynamic engines.

Importing this package imports megatron-core. The static-batching pieces are re-exported here;
the dynamic engine lives in :mod:`.dynamic`, model building and checkpoints in :mod:`.model`,
the source patches in :mod:`.patches`, the CPU shim in :mod:`.cpu`.
"""

from .static import *  # noqa: F401,F403
from .static import MARKER, __all__  # noqa: F401
