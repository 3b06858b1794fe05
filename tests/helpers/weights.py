"""Seeded weights for the tests' tiny models: the same values at every layout (set by parameter
name, in name order, from one generator), large enough that greedy choices are decided by clear
margins rather than float rounding. 1-D parameters (norms) ~ 1 + 0.1 N(0, 1); matrices
N(0, 1) * 1.5 / sqrt(fan_in)."""

import math

import torch


def seed_weights(model, seed: int = 7):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[-1])))
    return model
