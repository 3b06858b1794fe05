"""ops.py: backend choice, the fast torch path against the reference, and the custom ops
(fake implementations, torch.compile capture)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.helpers.ranks import run_ranks
import megatron_tree as mt
from megatron_tree.ops import dispatch as ops, reference, torch_decode

ROOT = Path(__file__).resolve().parents[2]


def test_resolve_backend_by_device_argument_and_environment(monkeypatch):
    monkeypatch.delenv(ops.ENV_BACKEND, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert ops.resolve_backend(cpu) == "torch"
    assert ops.resolve_backend(cuda) == "triton"
    assert ops.resolve_backend(cuda, "torch") == "torch"
    assert ops.resolve_backend(cpu, "triton") == "triton"  # the interpreter
    monkeypatch.setenv(ops.ENV_BACKEND, "torch")
    assert ops.resolve_backend(cuda) == "torch"
    assert ops.resolve_backend(cuda, "triton") == "triton"  # the argument wins
    monkeypatch.setenv(ops.ENV_BACKEND, "cutlass")
    with pytest.raises(ValueError, match=r"\$MEGATRON_TREE_BACKEND 'cutlass'"):
        ops.resolve_backend(cpu)
    with pytest.raises(ValueError, match="backend argument 'flash'"):
        ops.resolve_backend(cpu, "flash")


def test_no_gpu_no_interpreter_triton_raises_and_default_uses_torch():
    script = textwrap.dedent("""
        import torch
        from megatron_tree.ops import dispatch as ops, reference
        q, k = torch.randn(2, 1, 4, 16), torch.randn(2, 9, 2, 16)
        try:
            ops.flash_decode(q, k, k, backend="triton")
        except RuntimeError as e:
            assert "needs CUDA tensors" in str(e) and "TRITON_INTERPRET=1" in str(e), e
        else:
            raise AssertionError("backend='triton' on CPU without the interpreter did not raise")
        out, lse = ops.flash_decode(q, k, k)
        ref_o, ref_l = reference.partial_attention(q, k, k)
        assert torch.allclose(out, ref_o, atol=1e-6) and torch.allclose(lse, ref_l, atol=1e-6)
        out, _ = ops.merge_states(torch.stack([out, out]), torch.stack([lse, lse]))
        assert torch.allclose(out, ref_o, atol=1e-6)
        print("ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", ops.ENV_BACKEND)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)  # one interpreter; generous for a loaded machine
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-4000:]


def _inputs(dtype=torch.float32, b=3, sq=1, hq=8, hkv=2, d=32, n=57, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, n, hkv, d), mk(b, n, hkv, d)


CASES = {
    "plain": dict(),
    "ragged_with_empty_row": dict(cache_seqlens=torch.tensor([0, 57, 13], dtype=torch.int32)),
    "scale": dict(softmax_scale=0.05),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_path_matches_reference(case, dtype):
    q, k, v = _inputs(dtype)
    kw = CASES[case]
    out, lse = torch_decode.flash_decode(q, k, v, **kw)
    ref_o, ref_l = reference.partial_attention(q, k, v, **kw)
    assert out.dtype == ref_o.dtype and lse.dtype == ref_l.dtype
    tol = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(out.double(), ref_o.double(), atol=tol, rtol=0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert torch.allclose(lse[fin].double(), ref_l[fin].double(), atol=tol, rtol=0)


@pytest.mark.parametrize("hkv", [1, 2, 8])  # MQA, GQA, MHA
def test_torch_path_causal_several_queries_strided_cache(hkv):
    q, _, _ = _inputs(sq=4, hq=8)
    big = torch.randn(3, 80, 2 * hkv, 32)
    k, v = big[:, :57, :hkv], big[:, 3:60, hkv:]  # non-contiguous slices of one buffer
    kw = dict(cache_seqlens=torch.tensor([57, 20, 40], dtype=torch.int32),
              q_positions=torch.tensor([[53, 54, 55, 56], [-2, -1, 0, 1], [30, 31, 32, 33]]),
              k_positions=torch.arange(57))
    out, lse = torch_decode.flash_decode(q, k, v, **kw)
    ref_o, ref_l = reference.partial_attention(q, k, v, **kw)
    assert torch.allclose(out, ref_o, atol=2e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    assert torch.isneginf(lse[1, :, :2]).all() and (out[1, :2] == 0).all()  # no key visible yet
    fin = torch.isfinite(ref_l)
    assert torch.allclose(lse[fin], ref_l[fin], atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_dim_with_a_stride_reads_the_right_elements(dtype):
    """q, k, v whose head dim is strided (views like ``x[..., ::2]``): ATen's fused CPU flash kernel, behind the
    float32 decode and every CPU prefill, does not check that the head dim has unit stride and read the wrong
    elements (decode 1.6, prefill 2.7 off); now such inputs are copied first. Against the fp64 reference."""
    g = torch.Generator().manual_seed(0)
    wide = lambda *shape: torch.randn(*shape[:-1], 2 * shape[-1], generator=g, dtype=dtype)[..., ::2]  # noqa: E731
    q, k, v = wide(2, 1, 4, 8), wide(2, 6, 2, 8), wide(2, 6, 2, 8)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    want, want_lse = reference.partial_attention(*(t.double() for t in (q, k, v)), cache_seqlens=lens)
    out, lse = mt.flash_decode(q, k, v, cache_seqlens=lens)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-6)
    torch.testing.assert_close(mt.tree_decode(q, k, v, None, cache_seqlens=lens).double(), want, rtol=0, atol=1e-6)
    pos = torch.arange(6)[None].expand(2, -1)
    qp = wide(2, 6, 4, 8)
    want, _ = reference.partial_attention(*(t.double() for t in (qp, k, v)), q_positions=pos, k_positions=pos)
    got = ops.prefill_attention(qp, k, v, q_positions=pos, k_positions=pos)
    got = got[0] if isinstance(got, tuple) else got
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [4, 16])
def test_torch_path_paged_equals_contiguous_and_reference(page, dtype):
    """The paged torch path against the same rows stored contiguously and the fp64 reference:
    random block table, blocks shared by no row, spare blocks and tails full of NaN, ragged
    rows (one empty), GQA 8/2, two query tokens causal by per-row positions."""
    from tests.helpers.paged import to_paged

    q, k, v = _inputs(dtype, sq=2, n=57)
    sl = torch.tensor([57, 0, 22], dtype=torch.int32)
    k_pool, v_pool, table = to_paged(k, v, sl, page, seed=page)
    n_paged = table.shape[1] * page
    k_pos = torch.stack([torch.arange(n_paged) + off for off in (0, 7, 40)])
    q_pos = torch.tensor([[55, 56], [9, 10], [50, 61]])
    kw = dict(cache_seqlens=sl, q_positions=q_pos)
    out, lse = ops.flash_decode(q, k_pool, v_pool, block_table=table, k_positions=k_pos, **kw)
    want_o, want_l = ops.flash_decode(q, k, v, k_positions=k_pos[:, :57], **kw)
    ref_o, ref_l = reference.partial_attention(q.double(), k.double(), v.double(), k_positions=k_pos[:, :57], **kw)
    assert out.dtype == dtype and not torch.isnan(out).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)) and torch.isneginf(lse[1]).all()
    fin = torch.isfinite(ref_l)
    tol = 2e-6 if dtype == torch.float32 else 0.0  # bf16: both round the same fp32 result
    assert (out.double() - want_o.double()).abs().max() <= tol
    assert (lse[fin] - want_l[fin]).abs().max() <= 2e-6
    tol_ref = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of values below 2
    assert (out.double() - ref_o).abs().max() <= tol_ref and (lse[fin].double() - ref_l[fin]).abs().max() <= 2e-6
    # The reference's own paged path agrees too.
    rp_o, rp_l = reference.partial_attention(q, k_pool, v_pool, block_table=table, k_positions=k_pos, **kw)
    assert (rp_o.double() - out.double()).abs().max() <= tol_ref and torch.equal(torch.isneginf(rp_l), torch.isneginf(lse))


def test_out_dtype_through_ops_and_one_rounding_in_tree_decode():
    q, k, v = _inputs(torch.bfloat16, n=57)
    out32, lse = ops.flash_decode(q, k, v, out_dtype=torch.float32)
    out16, lse16 = ops.flash_decode(q, k, v)
    assert out32.dtype == torch.float32 and out16.dtype == torch.bfloat16 and torch.equal(lse, lse16)
    assert torch.equal(out32.bfloat16(), out16) and not torch.equal(out32, out16.float())
    reports = run_ranks(_one_rounding_body, 2)
    for rep in reports:
        assert rep["ours_vs_once"] == 0.0, rep  # bit for bit the fp32 merge rounded once
        assert rep["twice_vs_once"] > 0.0, rep  # rounding the partials first would differ


def _one_rounding_body(rank, world):
    import megatron_tree as mt

    q, k, v = _inputs(torch.bfloat16, b=4, hq=16, hkv=4, d=64, n=400, seed=11)
    groups = mt.TreeGroups.build()
    shard = slice(rank * 200, (rank + 1) * 200)
    ours = mt.tree_decode(q, k[:, shard], v[:, shard], groups, strategy="allgather")
    parts = [ops.flash_decode(q, k[:, s], v[:, s], out_dtype=torch.float32, lse_dtype=torch.float64)
             for s in (slice(0, 200), slice(200, 400))]
    once = reference.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))[0]
    twice = reference.merge_states(torch.stack([p[0].bfloat16() for p in parts]),
                                   torch.stack([p[1] for p in parts]))[0]
    return {"ours_vs_once": float((ours.float() - once.bfloat16().float()).abs().max()),
            "twice_vs_once": float((twice.float() - once.bfloat16().float()).abs().max())}


def test_float64_partial_lse_keeps_a_merge_exact_at_large_scores():
    """Large scores: shards of rows whose scores are ~1e2, 1e4, 1e5 and -1e5 (exact in fp32),
    merged from partials with a float64 lse, stay within 1e-5 of float64; the same partials
    with a float32 lse are off by more wherever |s| >= 1e4 (what the float64 lse removes)."""
    from benchmarks import precision

    q, k, v, lens = precision.large_score_inputs([1e2, 1e4, 1e5, -1e5], [90, 77, 64, 90])
    want, want_lse = reference.partial_attention(q, k, v, cache_seqlens=lens)
    one, _ = ops.flash_decode(q.float(), k.float(), v.float(), cache_seqlens=lens)
    assert (one.double() - want).abs().max() <= 1e-6  # one call over all keys: the inputs are exact
    ref = reference.partial_attention(q.float(), k.float(), v.float(), cache_seqlens=lens, lse_dtype=torch.float64)[1]
    assert ref.dtype == torch.float64 and (ref - want_lse).abs().max() <= 1e-6  # the reference keeps m + log l whole
    cuts = [0, 13, 13, 50, 90]  # uneven, one empty shard, shards past some rows' ends
    errs = {}
    for lse_dtype in (torch.float32, torch.float64):
        parts = [ops.flash_decode(q.float(), k[:, a:b].float(), v[:, a:b].float(), lse_dtype=lse_dtype,
                                  cache_seqlens=(lens - a).clamp(0, b - a).to(torch.int32))
                 for a, b in zip(cuts, cuts[1:])]
        assert all(p[1].dtype == lse_dtype for p in parts)
        out, lse = ops.merge_states(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
        assert lse.dtype == lse_dtype
        errs[lse_dtype] = (out.double() - want).abs().amax(dim=(1, 2, 3))  # per row
        if lse_dtype == torch.float64:
            assert ((lse - want_lse).abs() <= 1e-6).all(), (lse - want_lse).abs().max()
    assert (errs[torch.float64] <= 1e-5).all(), errs[torch.float64]
    assert (errs[torch.float32][1:] > 1e-5).all(), errs[torch.float32]
    # tree_decode's result merged again (a cascade: keys held elsewhere): exact with lse_dtype=float64;
    # the default float32 lse is rounded once for the caller, and merging that again is not exact.
    tail = [ops.flash_decode(q.float(), k[:, 50:].float(), v[:, 50:].float(), lse_dtype=torch.float64,
                             cache_seqlens=(lens - 50).clamp(min=0).to(torch.int32))]
    for lse_dtype, ok in ((torch.float64, True), (None, False)):
        head = mt.tree_decode(q.float(), k[:, :50].float(), v[:, :50].float(), None, return_lse=True,
                              cache_seqlens=lens.clamp(max=50), lse_dtype=lse_dtype)
        assert head[1].dtype == (lse_dtype or torch.float32)
        out, _ = ops.merge_states(torch.stack([head[0], tail[0][0]]), torch.stack([head[1].double(), tail[0][1]]))
        err = (out.double() - want).abs().amax(dim=(1, 2, 3))
        assert bool((err[1:] <= 1e-5).all()) == ok and bool((err[1:] > 1e-5).all()) != ok, (lse_dtype, err)


def test_lse_dtype_reaches_the_ops_and_their_fakes():
    """lse_dtype as the ops and their fake kernels (what torch.compile traces
    with) report it: float64 when asked for, or for float64 lses in merge_states; float64 input
    never gets an lse narrower than its own accumulation dtype."""
    q, k, v = _inputs(sq=2, n=9)
    sl = torch.tensor([5, 9, 0], dtype=torch.int32)
    torch.library.opcheck(torch.ops.megatron_tree.flash_decode.default,
                          (q, k, v, sl, None, None, None, "torch", None, torch.float32, torch.float64))
    outs, lses = torch.randn(3, 3, 2, 8, 32), torch.randn(3, 3, 8, 2, dtype=torch.float64)
    torch.library.opcheck(torch.ops.megatron_tree.merge_states.default, (outs, lses, "torch"))
    assert ops.flash_decode(q, k, v, cache_seqlens=sl, lse_dtype=torch.float64)[1].dtype == torch.float64
    assert ops.merge_states(outs, lses)[1].dtype == torch.float64
    q64, k64, v64 = (t.double() for t in (q, k, v))
    assert ops.flash_decode(q64, k64, v64, lse_dtype=torch.float32)[1].dtype == torch.float64
    assert reference.partial_attention(q64, k64, v64, lse_dtype=torch.float32)[1].dtype == torch.float64


def test_ops_validates_inputs_on_cpu():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, 57\]"):
        ops.flash_decode(q, k, v, cache_seqlens=torch.tensor([0, 58, 1], dtype=torch.int32))
    with pytest.raises(TypeError, match="cache_seqlens must be int32"):
        ops.flash_decode(q, k, v, cache_seqlens=torch.tensor([0, 5, 1]))
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        ops.flash_decode(q[:, :, :7], k, v)
    with pytest.raises(ValueError, match=r"merge_states expects outs \(P, B, Sq, Hq, D\)"):
        ops.merge_states(torch.zeros(2, 3), torch.zeros(2))
    with pytest.raises(TypeError, match=r"lse_dtype must be one of .*float32.*float64.* or None, got torch.float16"):
        ops.flash_decode(q, k, v, lse_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"k and v must have at least one KV head, got shape \(3, 57, 0, 32\)"):
        ops.flash_decode(q[:, :, :0], k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="head dims must be at least 1, got q/k 0 and v 0"):
        ops.flash_decode(q[..., :0], k[..., :0], v[..., :0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_query_rows_give_empty_outputs(backend):
    """A call with no query token (seqlen_q 0), no query head or no batch row returns empty outputs of the contract's
    shapes (ATen's fused CPU kernel would trap on seqlen_q 0 and end the process); tree_decode too."""
    q, k, v = _inputs()
    lens = torch.tensor([0, 20, 57], dtype=torch.int32)
    b, _, hq, d = q.shape
    for sl, want in ((q[:, :0], ((b, 0, hq, d), (b, hq, 0))), (q[:0], ((0, 1, hq, d), (0, hq, 1)))):
        kv = (k, v) if sl.shape[0] else (k[:0], v[:0])
        out, lse = ops.flash_decode(sl, *kv, cache_seqlens=lens[:sl.shape[0]], backend=backend)
        assert (tuple(out.shape), tuple(lse.shape)) == want
    assert tuple(mt.tree_decode(q[:, :0], k, v, None, cache_seqlens=lens, backend=backend).shape) == (b, 0, hq, d)


def test_custom_ops_pass_opcheck():
    from tests.helpers.paged import to_paged

    q, k, v = _inputs(sq=2)
    sl = torch.tensor([5, 57, 0], dtype=torch.int32)
    qp, kp = torch.tensor([[10, 11]] * 3), torch.arange(57)
    torch.library.opcheck(torch.ops.megatron_tree.flash_decode.default, (q, k, v, sl, None, None, None, "torch"))
    torch.library.opcheck(torch.ops.megatron_tree.flash_decode.default, (q, k, v, None, 0.3, qp, kp, "torch"))
    k_pool, v_pool, table = to_paged(k, v, sl, 8)
    torch.library.opcheck(torch.ops.megatron_tree.flash_decode.default,
                          (q, k_pool, v_pool, sl, None, None, None, "torch", table, torch.float64))
    outs, lses = torch.randn(3, 3, 2, 8, 32), torch.randn(3, 3, 8, 2)
    torch.library.opcheck(torch.ops.megatron_tree.merge_states.default, (outs, lses, "torch"))
    torch.library.opcheck(torch.ops.megatron_tree.merge_states.default, (outs[:1], lses[:1], "torch"))


def test_fake_implementations_give_contract_shapes_and_dtypes():
    with FakeTensorMode():
        q = torch.empty(4, 2, 16, 64, dtype=torch.bfloat16)
        k = torch.empty(4, 1000, 4, 64, dtype=torch.bfloat16)
        out, lse = torch.ops.megatron_tree.flash_decode(q, k, k, None, None, None, None, "triton")
        assert out.shape == (4, 2, 16, 64) and out.dtype == torch.bfloat16
        assert lse.shape == (4, 16, 2) and lse.dtype == torch.float32
        pool, table = torch.empty(30, 16, 4, 64, dtype=torch.bfloat16), torch.empty(4, 8, dtype=torch.int32)
        out, lse = torch.ops.megatron_tree.flash_decode(q, pool, pool, None, None, None, None, "triton", table,
                                                        torch.float32)
        assert out.shape == (4, 2, 16, 64) and out.dtype == torch.float32 and lse.shape == (4, 16, 2)
        mo, ml = torch.ops.megatron_tree.merge_states(torch.empty(8, 4, 2, 16, 64), torch.empty(8, 4, 16, 2), "triton")
        assert mo.shape == (4, 2, 16, 64) and ml.shape == (4, 16, 2) and ml.dtype == torch.float32


def _decode_step(q, k, v, sl):
    # A decode step with two "shards" of one cache, merged: flash_decode + merge_states.
    o1, l1 = ops.flash_decode(q, k[:, :30], v[:, :30], cache_seqlens=sl.clamp(max=30))
    o2, l2 = ops.flash_decode(q, k[:, 30:], v[:, 30:], cache_seqlens=(sl - 30).clamp(min=0))
    return ops.merge_states(torch.stack([o1, o2]), torch.stack([l1, l2]))


def test_decode_step_captured_by_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = _inputs(n=57)
    sl = torch.tensor([57, 31, 12], dtype=torch.int32)
    compiled = torch.compile(_decode_step, fullgraph=True, backend="aot_eager")
    out, lse = compiled(q, k, v, sl)
    ref_o, ref_l = reference.partial_attention(q, k, v, cache_seqlens=sl)
    assert torch.allclose(out, ref_o, atol=2e-6) and torch.allclose(lse, ref_l, atol=2e-6)
    sl2 = torch.tensor([1, 57, 30], dtype=torch.int32)  # new values, same graph
    out2, _ = compiled(q, k, v, sl2)
    assert torch.allclose(out2, reference.partial_attention(q, k, v, cache_seqlens=sl2)[0], atol=2e-6)


def test_gpu_check_script_is_valid_and_selects_the_cuda_tests():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "TRITON_INTERPRET=0" in text and "-k cuda" in text and "benchmarks.gpu_check --out" in text
    # Time limits of the parts after the end-to-end run add up to at most 9 minutes.
    limits = [int(t) for t in re.findall(r"^timeout (\d+) ", text, flags=re.M)]
    assert len(limits) == 5 and sum(limits) <= 9 * 60, limits
    # every timed part keeps its exit status, reports it and fails the script when it failed
    codes = re.findall(r"^(\w+_rc)=\$\?$", text, flags=re.MULTILINE)
    status = next(line for line in text.splitlines() if line.startswith('echo "gpu_check='))
    last = text.rstrip().splitlines()[-1]
    assert len(codes) == len(limits) and len(set(codes)) == len(codes), codes
    assert all(f"=${c} " in status and f'[ "${c}" -eq 0 ]' in last for c in codes), (codes, status, last)
    assert last.count("-eq 0 ]") == len(codes), last
    assert "benchmarks.prefill_gpu" in text and "tests/ops/test_prefill_kernel.py -k cuda" in text
    assert "benchmarks.precision --backend triton --device cuda" in text
    for banned in ("deepspeed", "megatron.core", "wandb"):  # absent on the GPU machine
        assert f"import {banned}" not in text
    from tests.ops import test_kernels  # what "-k cuda" selects: the test_cuda_* functions, and nothing that runs on CPU

    selected = [n for n in dir(test_kernels) if n.startswith("test") and "cuda" in n]
    assert len(selected) >= 6 and all(n.startswith("test_cuda_") for n in selected), selected
    # and in the transformers compile tests, the captured step's CUDA test alone (the others run on CPU)
    from tests.integrations.hf import test_compile_step

    assert "tests/integrations/hf/test_compile_step.py -k cuda" in text
    assert [n for n in dir(test_compile_step) if n.startswith("test") and "cuda" in n] == [
        "test_captured_step_on_cuda_equals_eager"]


def test_gpu_check_records_a_failing_variant_and_keeps_the_others(tmp_path, monkeypatch):
    from benchmarks import gpu_check

    bad, good = {"BLOCK_N": 24, "num_warps": 4, "num_stages": 2}, {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    monkeypatch.setattr(gpu_check, "_sweep_configs", lambda dry: [bad, good])
    assert gpu_check.main(["--dry-run", "--steps", "sweep", "--out", str(tmp_path)]) == 1
    sweep = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["sweep"]
    assert "error" in sweep["N=128 BLOCK_N=24 warps=4 stages=2"]
    kept = sweep["N=128 BLOCK_N=64 warps=4 stages=2"]
    assert kept["max_abs_diff"] < 1e-5 and kept["median_s"] > 0 and "error" not in kept
    # An exhausted time budget skips configurations instead of running them.
    assert gpu_check.main(["--dry-run", "--steps", "merge", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    merge = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["merge"]
    assert all(v == {"skipped": "time budget of the step used up"} for v in merge.values()) and len(merge) == 3


def test_kernel_benchmark_cpu_mode_runs_and_reports(tmp_path):
    from benchmarks import kernel as kb

    code = kb.main(["--device", "cpu", "--seqlens", "512", "--rounds", "2", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads((tmp_path / "kernel_bench_cpu.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"ours", "sdpa_gqa", "sdpa_gqa_bhnd"} and len(result["rows"]) == 3
    assert rows["ours"]["kv_bytes"] == 2 * 512 * 8 * 128 * 4 and rows["ours"]["time_vs_ours"] == 1.0
    for r in rows.values():  # every method agreed with ours before being timed
        assert r["max_abs_diff_vs_first"] < 1e-5 and r["median_s"] > 0 and r["kv_gbps"] > 0


def test_gpu_check_needs_no_deepspeed_megatron_or_wandb(tmp_path):
    # The GPU machine has none of them: the package, the CUDA test module and every step of
    # the GPU check (dry run: tiny shapes on CPU, interpreter for the kernels) must work with
    # those imports failing.
    script = textwrap.dedent(f"""
        import json, sys
        for name in ("deepspeed", "megatron", "megatron.core", "wandb", "flash_attn"):
            sys.modules[name] = None  # makes `import name` raise ImportError
        import megatron_tree, megatron_tree.ops, benchmarks.kernel
        from benchmarks import gpu_check
        from tests.ops import test_kernels
        assert gpu_check.main(["--dry-run", "--out", {str(tmp_path)!r}]) == 0
        doc = json.load(open({str(tmp_path / "gpu_check.json")!r}))
        print(json.dumps(doc["steps"], default=str))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    steps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(steps) == {"env", "kernel", "sweep", "merge", "model_step"}
    methods = {r["method"] for r in steps["kernel"]["bench"]["rows"]}
    assert methods == {"ours", "sdpa_gqa", "sdpa_gqa_bhnd"}
    assert all(v["max_abs_diff"] < 1e-5 for v in steps["sweep"].values()) and len(steps["sweep"]) == 2
    assert all(v["max_abs_diff"] < 1e-5 for v in steps["merge"].values()) and len(steps["merge"]) == 3
    # The transformers decode step (HFTreeModel) the GPU captures equals transformers' own forward here.
    assert steps["model_step"]["hf_decode_step_captured"]["max_abs_diff_vs_unsharded"] < 1e-5
