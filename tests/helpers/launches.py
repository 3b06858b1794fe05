"""decode_launches and merge_states calls that differ one argument at a time, shared by the launch-plan tests."""

from __future__ import annotations

import torch


def decode_launch_calls():
    """decode_launches calls that differ from the first in one argument each: ``name -> (q, k, v, kwargs)``."""
    g = torch.Generator().manual_seed(3)

    def t(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = t(2, 1, 8, 64), t(2, 96, 2, 64), t(2, 96, 2, 64)
    lens, pos = torch.tensor([90, 7], dtype=torch.int32), torch.tensor([[95], [95]])
    wide = t(2, 96, 4, 64)
    return {
        "base": (q, k, k, {"cache_seqlens": lens}),
        "own v": (q, k, v, {"cache_seqlens": lens}),
        "fp16": (q.half(), k.half(), k.half(), {"cache_seqlens": lens}),
        "k strided": (q, wide[:, :, ::2], k, {"cache_seqlens": lens}),
        "v head dim 32": (q, k, k[..., :32], {"cache_seqlens": lens}),
        # one signature part each: a slice keeps the strides, a strided view the shape; the plan does not check dtypes
        "q 4 heads": (q[:, :, :4], k, k, {"cache_seqlens": lens}),
        "q strided": (t(2, 1, 16, 64)[:, :, ::2], k, k, {"cache_seqlens": lens}),
        "q fp16": (q.half(), k, k, {"cache_seqlens": lens}),
        "k N 80": (q, k[:, :80], k, {"cache_seqlens": lens}),
        "k fp16": (q, k.half(), k, {"cache_seqlens": lens}),
        "v strided": (q, k, wide[:, :, 1::2], {"cache_seqlens": lens}),
        "v fp16": (q, k, k.half(), {"cache_seqlens": lens}),
        "seqlens int64": (q, k, k, {"cache_seqlens": lens.long()}),
        "seqlens strided": (q, k, k, {"cache_seqlens": torch.stack([lens, lens.flip(0)], dim=1)[:, 0]}),
        "N 160": (q, t(2, 160, 2, 64), t(2, 160, 2, 64), {"cache_seqlens": lens}),
        "B 3": (t(3, 1, 8, 64), t(3, 96, 2, 64), t(3, 96, 2, 64), {"cache_seqlens": torch.tensor([1, 2, 3]).int()}),
        "Sq 2": (t(2, 2, 8, 64), k, k, {"cache_seqlens": lens}),
        "MQA": (q, k[:, :, :1], k[:, :, :1], {"cache_seqlens": lens}),
        "no seqlens": (q, k, k, {}),
        "starts": (q, k, k, {"cache_seqlens": lens, "cache_starts": torch.tensor([3, 0], dtype=torch.int32)}),
        "paged": (q, t(7, 16, 2, 64), t(7, 16, 2, 64),
                  {"cache_seqlens": lens, "block_table": torch.tensor([[0, 1, 2, 3, 4, 5], [6, 5, 4, 3, 2, 1]]).int()}),
        "paged, table strided": (q, t(7, 16, 2, 64), t(7, 16, 2, 64),
                                 {"cache_seqlens": lens, "block_table": (torch.arange(24).view(2, 12) % 7).int()[:, :6]}),
        "paged, 5 blocks a row": (q, t(7, 16, 2, 64), t(7, 16, 2, 64),
                                  {"cache_seqlens": lens,
                                   "block_table": torch.tensor([[0, 1, 2, 3, 4, 5], [6, 5, 4, 3, 2, 1]]).int()[:, :5]}),
        "positions": (q, k, k, {"cache_seqlens": lens, "q_positions": pos, "k_positions": torch.arange(96)}),
        "q positions strided": (q, k, k, {"cache_seqlens": lens, "q_positions": torch.tensor([[95, 0], [95, 0]])[:, :1],
                                          "k_positions": torch.arange(96)}),
        "positions 2D": (q, k, k, {"cache_seqlens": lens, "q_positions": pos,
                                   "k_positions": torch.arange(96).expand(2, 96)}),
        "positions 2D, own rows": (q, k, k, {"cache_seqlens": lens, "q_positions": pos,
                                             "k_positions": torch.arange(192).view(2, 96) % 96}),
        "window": (q, k, k, {"cache_seqlens": lens, "q_positions": pos, "k_positions": torch.arange(96),
                             "window": 16}),
        "softcap": (q, k, k, {"cache_seqlens": lens, "softcap": 30.0}),
        "scale": (q, k, k, {"cache_seqlens": lens, "softmax_scale": 0.5}),
        "out fp32": (q, k, k, {"cache_seqlens": lens, "out_dtype": torch.float32}),
        "lse fp64": (q, k, k, {"cache_seqlens": lens, "lse_dtype": torch.float64}),
        "3 splits": (q, k, k, {"cache_seqlens": lens, "num_splits": 3}),
        "block_n 16": (q, k, k, {"cache_seqlens": lens, "block_n": 16}),
        "8 warps": (q, k, k, {"cache_seqlens": lens, "config": {"num_warps": 8}}),
    }


def merge_calls():
    """merge_states calls that differ from the first in one part of a signature each (the number of states with
    the same strides, the dtype, a strided outs or lses, float64 lses): ``name -> (outs, lses)``."""
    g = torch.Generator().manual_seed(2)
    outs, lses = torch.randn(3, 2, 1, 4, 16, generator=g), torch.randn(3, 2, 4, 1, generator=g)
    return {
        "base": (outs, lses),
        "2 states, same strides": (outs[:2], lses[:2]),
        "bf16": (outs.bfloat16(), lses),
        "outs strided": (torch.randn(3, 2, 1, 4, 32, generator=g)[..., ::2], lses),
        "lses strided": (outs, torch.randn(3, 2, 4, 2, generator=g)[..., 1:]),
        "lses float64": (outs, lses.double()),
    }
