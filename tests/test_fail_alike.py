"""No silent wrong answer, one error on every rank: values ranks share are compared, bad writes refused.

Single-process cases: the paged cache's writes (shapes, row counts, layer indices; nothing written
on a bad call). Multi-rank cases run in one launch (``fail_alike``) on 3 gloo ranks (a world that
is not a power of two) and return, for each case, what every rank raised and how long it took.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tree.decode.paged import PagedKVCache


# --------------------------------------------------------------------------- paged cache writes


def _paged(layers=2, hkv=2, d=4):
    return PagedKVCache(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=4, blocks_per_rank=4,
                        max_seq_len=32, cp_size=2, cp_rank=0)


@pytest.mark.parametrize("call,kind,needle", [
    (lambda c, p: c.write(0, torch.ones(3, 1, 4), torch.ones(3, 2, 4), p), ValueError,
     r"write: k must have shape \(3, 2, 4\) \(tokens placed, num_kv_heads, head_dim\), got \(3, 1, 4\)"),
    (lambda c, p: c.write(0, torch.ones(5, 2, 4), torch.ones(5, 2, 4), p), ValueError,
     r"write: k must have shape \(3, 2, 4\).*got \(5, 2, 4\)"),
    (lambda c, p: c.write(0, torch.ones(3, 2, 4), torch.ones(2, 2, 4), p), ValueError,
     r"write: v must have shape \(3, 2, 4\).*got \(2, 2, 4\)"),
    (lambda c, p: c.write(-1, torch.ones(3, 2, 4), torch.ones(3, 2, 4), p), ValueError,
     r"write: layer index -1 is outside \[0, 2\)"),
    (lambda c, p: c.write(2, torch.ones(3, 2, 4), torch.ones(3, 2, 4), p), ValueError,
     r"write: layer index 2 is outside \[0, 2\)"),
    (lambda c, p: c.write(True, torch.ones(3, 2, 4), torch.ones(3, 2, 4), p), TypeError,
     r"write: layer must be an integer index in \[0, 2\), got bool True"),
    (lambda c, p: c.write(0, torch.ones(3, 2, 4, dtype=torch.int64), torch.ones(3, 2, 4), p), TypeError,
     r"write: k must be a floating-point tensor, got torch.int64"),
    (lambda c, p: c.write(0, torch.ones(3, 2, 4), torch.ones(3, 2, 4), [0, 1, 2]), TypeError,
     r"write: placed must be the TokenSlots of extend\(\), got list"),
])
def test_paged_write_refuses_bad_shapes_rows_and_layers_and_writes_nothing(call, kind, needle):
    c = _paged()
    placed = c.extend("r", 3)
    before = (c.k.clone(), c.v.clone())
    with pytest.raises(kind, match=needle):
        call(c, placed)
    assert torch.equal(c.k, before[0]) and torch.equal(c.v, before[1])  # nothing written
    c.write(1, torch.ones(3, 2, 4), torch.full((3, 2, 4), 2.0), placed)  # the good call still works
    mine = int((placed.owners == 0).sum())
    assert int((c.k[1] != 0).any(-1).any(-1).sum()) == mine and not bool((c.k[0] != 0).any())
