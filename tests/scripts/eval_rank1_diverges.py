"""The eval entry point with rank 1's output head negated, for test_launch.

Rank 1's greedy choices then differ from rank 0's (argmin instead of argmax), so the run
must record ``tokens_agree_across_ranks: false`` and exit non-zero on every rank: the
cross-rank agreement check is shown able to fail. Run under torchrun with 2 processes,
with a random transformers Llama (configs/cpu_tiny_llama.yaml, ``model.source: random``).
"""

import os
import sys

import torch

from megatron_tree.eval import launch, models

_real_build = models.build


def _build(*args, **kwargs):
    em = _real_build(*args, **kwargs)
    if int(os.environ["RANK"]) == 1:
        with torch.no_grad():
            em.lm.hf.lm_head.weight.neg_()
    return em


if __name__ == "__main__":
    models.build = _build
    sys.exit(launch.main(sys.argv[1:]))
