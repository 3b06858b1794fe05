"""``torch.compile(fullgraph=True)`` of the decode step's entry points on CPU: no graph break, one
compilation over a decode loop's changing lengths, the local attention and the merge as one opaque
op node each, and the eager result bit for bit.

``aot_eager`` runs Dynamo and AOTAutograd (the ops' fake implementations included) without
Inductor's code generation, so a graph break, a host read of a tensor value (``fullgraph=True``
makes it an error) or a guard on a value (a recompilation per step) shows here cheaply.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

import megatron_tree as mt

from tests.helpers.ranks import run_ranks

STEPS = 12


def _inputs(b=2, hq=4, hkv=2, d=16, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 1, hq, d, generator=g), torch.randn(b, n, hkv, d, generator=g),
            torch.randn(b, n, hkv, d, generator=g))


def _loop(fn, n=24):
    """Compile ``fn(lens)`` with fullgraph=True and call it over STEPS decode steps whose lengths
    change (shapes fixed); returns (compilations, whether every step equalled eager bitwise, the
    op names in the captured graphs)."""
    torch._dynamo.reset()
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    captured = torch.compile(fn, fullgraph=True, backend=capture)
    equal = True
    for step in range(STEPS):
        lens = torch.tensor([step, n - step // 2], dtype=torch.int32)
        want = fn(lens)
        equal &= all(torch.equal(a, b) for a, b in zip(compiled(lens), want))
        equal &= all(torch.equal(a, b) for a, b in zip(captured(lens), want))
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    return counter.frame_count, equal, ops


def test_flash_decode_compiles_once_as_one_op():
    q, k, v = _inputs()
    frames, equal, ops = _loop(lambda lens: mt.flash_decode(q, k, v, cache_seqlens=lens, lse_dtype=torch.float64))
    assert frames == 1 and equal
    assert "megatron_tree.flash_decode.default" in ops


def test_two_shards_and_their_merge_compile_once():
    """Two partial states of one sequence (keys 0..11 and 12..23) and merge_states: the exact
    attention over all 24 keys, compiled whole."""
    q, k, v = _inputs()

    def step(lens):
        head = mt.flash_decode(q, k[:, :12], v[:, :12], cache_seqlens=lens.clamp(max=12), lse_dtype=torch.float64)
        tail = mt.flash_decode(q, k[:, 12:], v[:, 12:], cache_seqlens=(lens - 12).clamp(min=0),
                               lse_dtype=torch.float64)
        return mt.merge_states(torch.stack([head[0], tail[0]]), torch.stack([head[1], tail[1]]))

    frames, equal, ops = _loop(step)
    assert frames == 1 and equal
    assert {"megatron_tree.flash_decode.default", "megatron_tree.merge_states.default"} <= ops
    whole = mt.flash_decode(q, k, v, cache_seqlens=torch.tensor([5, 20], dtype=torch.int32))
    merged = step(torch.tensor([5, 20], dtype=torch.int32))
    assert torch.allclose(merged[0], whole[0], atol=1e-6) and torch.allclose(merged[1].float(), whole[1], atol=1e-6)


def test_merge_of_one_state_compiles_without_the_op():
    outs, lses = torch.randn(1, 2, 1, 4, 16), torch.randn(1, 2, 4, 1)
    frames, equal, ops = _loop(lambda lens: mt.merge_states(outs * lens[0], lses))
    assert frames == 1 and equal
    assert "megatron_tree.merge_states.default" not in ops


def _tree_decode_rank(rank, world):
    import torch

    import megatron_tree as mt

    groups = mt.TreeGroups.build()
    q, k, v = _inputs()
    qp = torch.tensor([[30], [31]])
    kp = torch.arange(24)
    plain = _loop(lambda lens: mt.tree_decode(q, k, v, groups, cache_seqlens=lens, return_lse=True))
    causal = _loop(lambda lens: mt.tree_decode(q, k, v, groups, cache_seqlens=lens, q_positions=qp, k_positions=kp,
                                               window=8, return_lse=True))
    return plain, causal


def test_tree_decode_at_world_1_compiles_once():
    """A real one-rank gloo group: tree_decode (plain, and causal with a sliding window) compiles
    with no graph break, once over 12 steps, to the local op alone, equal to eager."""
    [(plain, causal)] = run_ranks(_tree_decode_rank, 1)
    for frames, equal, ops in (plain, causal):
        assert frames == 1 and equal
        assert "megatron_tree.flash_decode.default" in ops and "megatron_tree.merge_states.default" not in ops
