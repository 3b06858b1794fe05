"""The eval entry point with rank 1's output head negated, for test_launch.

Rank 1's greedy choices then differ from rank 0's (argmin instead of argmax), so the run
must record ``tokens_agree_across_ranks: false`` and exit non-zero on every rank: the
cross-rank agreement check is shown able to fail. Run under torchrun with 2 processes.
"""

import os
import sys

import torch

from megatron_tree import eval as E

_real_build_model = E.build_model


def _build_model(cfg, groups, device):
    model, lcfg = _real_build_model(cfg, groups, device)
    if int(os.environ["RANK"]) == 1:
        with torch.no_grad():
            model.lm_head.weight.neg_()
    return model, lcfg


if __name__ == "__main__":
    E.build_model = _build_model
    sys.exit(E.main(sys.argv[1:]))
