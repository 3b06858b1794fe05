"""``run_ranks`` as the tests use it: the library's harness with transformers preloaded by the fork server.

Many tests build transformers models on every rank; importing transformers once in the fork server
instead of once per rank saves seconds of CPU per launch on a 2-core machine.
"""

from __future__ import annotations

import functools

from megatron_tree.utils import testing
from megatron_tree.utils.testing import RankFailure, outcome  # noqa: F401 -- re-exported for the tests

PRELOAD = ("torch", "torch.distributed", "transformers", "transformers.modeling_utils",
           "transformers.generation", "transformers.models.llama.modeling_llama")

run_ranks = functools.partial(testing.run_ranks, preload=PRELOAD)
