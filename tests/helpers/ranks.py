"""``run_ranks`` as the tests use it: the library's harness with the frameworks preloaded by the fork server.

Many tests build transformers models or Megatron-Core modules on every rank; importing transformers and
megatron.core once in the fork server instead of once per rank saves seconds of CPU per rank on a 2-core
machine (megatron.core alone: about 4 s, with the torch compiler stack it imports). The fork server skips
a module that does not import, so a lane without megatron-core runs the same tests.
"""

from __future__ import annotations

import functools

from megatron_tree.utils import testing
from megatron_tree.utils.testing import RankFailure, outcome  # noqa: F401 -- re-exported for the tests

PRELOAD = ("torch", "torch.distributed", "megatron.core", "transformers", "transformers.modeling_utils",
           "transformers.generation", "transformers.models.llama.modeling_llama")

run_ranks = functools.partial(testing.run_ranks, preload=PRELOAD)
