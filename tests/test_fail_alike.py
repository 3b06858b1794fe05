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


# --------------------------------------------------------------------------- multi-rank: one launch

import os  # noqa: E402
import pickle  # noqa: E402
import time  # noqa: E402

from distributed import run_ranks  # noqa: E402

T = 3.0  # seconds: the TreeGroups timeout of the cases that must fail within a bound
WORLD = 3


def _outcome(fn):
    """(exception type name or "returned", message, seconds) of calling fn."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test asserts on type and message
        return type(e).__name__, str(e), time.monotonic() - start
    return "returned", "", time.monotonic() - start


def _shards(world, b=2, sq=1, hq=4, hkv=2, d=8, seed=0):
    """q and every rank's uneven (k, v) shard (rank r holds r + 1 keys per row... and rank 0 none)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g)
    ks = [torch.randn(b, r, hkv, d, generator=g) for r in range(world)]  # rank 0's shard is empty
    return q, ks


def fail_alike_body(rank, world, outdir):
    import megatron_tree as mt
    from megatron_tree import reference

    out: dict = {}
    import torch.distributed as dist

    sync = dist.barrier

    # -- shifted: the shift's values are compared on the merge's one SUM --
    g = mt.TreeGroups.build(timeout=T)
    q, ks = _shards(world, hq=4, hkv=2)  # GQA
    full = torch.cat(ks, 1)
    want, lse = reference.partial_attention(q, full, full)
    k = ks[rank]
    got, merged = mt.tree_decode(q, k, k, g, strategy="shifted", shift=lse.float(), return_lse=True)
    out["shift_same_err"] = float((got - want).abs().max())
    moved = lse.float() + (0.3 if rank == 1 else 0.0)  # finite, moderate: a wrong answer if unnoticed
    out["shift_differ"] = _outcome(lambda: mt.tree_decode(q, k, k, g, strategy="shifted", shift=moved))
    out["shift_differ_overlap"] = _outcome(
        lambda: mt.tree_decode(q, k, k, g, strategy="shifted", shift=moved, overlap=True))
    one_row = lse.float().clone()
    if rank == 2:
        one_row[1, 3, 0] += 1e-3  # one value of one row, one rank
    out["shift_one_value"] = _outcome(lambda: mt.tree_decode(q, k, k, g, strategy="shifted", shift=one_row))
    flags: list = []
    got = mt.tree_decode(q, k, k, g, strategy="shifted", shift=moved, deferred=flags)
    out["shift_deferred_flag"] = [bool(f) for f in flags]
    # the same values held in another dtype are the same shift
    same = lse.double() if rank == 0 else lse.float()
    got = mt.tree_decode(q, k, k, g, strategy="shifted", shift=same.float() if rank else same)
    out["shift_dtype_err"] = float((got - want).abs().max())
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(out, f)
    sync()
    return out


@pytest.fixture(scope="module")
def fail_alike(tmp_path_factory):
    outdir = tmp_path_factory.mktemp("fail_alike")
    return run_ranks(fail_alike_body, WORLD, str(outdir), timeout=240, pg_timeout=60.0)


def _same_everywhere(results, case, ranks=None):
    got = [results[r][case] for r in (range(WORLD) if ranks is None else ranks)]
    assert len({o[0] for o in got}) == 1 and len({o[1] for o in got}) == 1, f"{case}: ranks differ: {got}"
    return got[0][0], got[0][1], max(o[2] for o in got)


def test_shift_values_that_differ_between_ranks_are_an_error_on_every_rank(fail_alike):
    for res in fail_alike:
        assert res["shift_same_err"] < 1e-5 and res["shift_dtype_err"] < 1e-5
        assert res["shift_deferred_flag"] == [True]  # under a decode loop: the step is redone with packed
    for case in ("shift_differ", "shift_differ_overlap", "shift_one_value"):
        kind, message, seconds = _same_everywhere(fail_alike, case)
        assert kind == "DisagreementError", message
        assert "ranks disagree on merge: shift (a digest of its values): " in message, message
        assert seconds < T  # seen on the merge's own SUM: no timeout waited out
    _, message, _ = _same_everywhere(fail_alike, "shift_differ")
    assert "on ranks [0, 2]" in message and "on rank 1" in message, message
    _, message, _ = _same_everywhere(fail_alike, "shift_one_value")
    assert "on ranks [0, 1]" in message and "on rank 2" in message, message
