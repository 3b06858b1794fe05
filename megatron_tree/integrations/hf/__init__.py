"""transformers integration: any decoder with transformers' attention interface, CP-sharded.

Importing this package imports transformers (>= 5.17) and registers ``"megatron_tree"`` with its
``AttentionInterface``.
"""

from .core import *  # noqa: F401,F403
from .core import __all__  # noqa: F401
