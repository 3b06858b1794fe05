"""GPU check of one CP prefill step: which fused kernel each piece runs, its error, its speed.

    python -m benchmarks.prefill_gpu [--tokens 16384] [--cp 2] [--out DIR]

Invariant: runs only what a CUDA machine can check and a CPU cannot -- the CUDA launchers of
``fused_prefill`` (aten flash / memory-efficient attention, flash-attn when importable) on a real
GPU. For each dtype (bf16, fp16, fp32) and a SmolLM2-135M and a Llama-8B attention shape:

* rank 0's share of a ``--tokens`` prompt at CP ``--cp`` in the load-balanced layout, over every
  rank's KV block in ring order: the kernel launches counted (``ops.prefill_attention(calls=)``)
  and asserted to be ``fused_prefill.select_kernel``'s choice (a masked piece may take the
  memory-efficient kernel, a ``cuda_cudnn`` piece below ``CUDNN_MIN_FLOP`` flash), never ``decode``
  for an ordinary prompt;
* the merged result against float64 attention on a 2048-token prompt (error printed and stored;
  within 2x the error of the same-dtype SDPA, flash-attention's rule);
* seconds per ring of local steps against causal SDPA over the whole prompt in one call (what one
  GPU does without CP), CUDA events, medians of 5;
* for fp16/bf16, the same ring on every fused kernel that can run it (``cuda_flash``, ``cuda_cudnn``
  on every piece, ``flash_attn`` when importable): its error against float64 on the short prompt,
  the first call's seconds (cuDNN builds a plan per new shape) and the median of the next 5 -- the
  measurement ``fused_prefill.CUDNN_ARCHS`` and ``CUDNN_MIN_FLOP`` are to be checked against.

Writes ``prefill_gpu.json`` to ``--out``; exits 1 if a dispatch or error check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

from megatron_tree.ops import fused_prefill, dispatch as ops, reference
from megatron_tree.decode.placement import prefill_ranges

SHAPES = {"smollm2_135m": (9, 3, 64), "llama_8b": (32, 8, 128)}


def _positions(tokens, cp, rank):
    return torch.cat([torch.arange(s, e) for s, e in prefill_ranges(tokens, cp, "load_balanced")[rank]])


def ring_of_rank0(q, k, v, tokens, cp, calls, kernel=None):
    """Rank 0's queries over every rank's block, merged: what ``ring_prefill`` computes on rank 0.
    A forced ``kernel`` runs every piece it can take (cuDNN's small pieces too: ``cudnn_min_flop=0``)."""
    qpos = _positions(tokens, cp, 0).cuda()
    outs, lses = [], []
    for r in range(cp):
        kp = _positions(tokens, cp, r).cuda()
        forced = {} if kernel is None else {"kernel": kernel, "cudnn_min_flop": 0}
        o, l = ops.prefill_attention(q[:, qpos], k[:, kp], v[:, kp], q_positions=qpos[None], k_positions=kp[None],
                                     calls=calls, **forced)
        outs.append(o)
        lses.append(l)
    return ops.merge_states(torch.stack(outs), torch.stack(lses))[0], qpos


def _first(fn):
    """Seconds of one call, synchronised: the first call of a kernel on new shapes."""
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3


def _kernels_for(dtype):
    names = ["cuda_flash", "cuda_cudnn"] if dtype != torch.float32 else []
    if names and fused_prefill._flash_attn_func() is not None:
        names.append("flash_attn")
    return names


def _time(fn, reps=5):
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here", file=sys.stderr)
        return 2
    rows, ok = [], True
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape, (hq, hkv, d) in SHAPES.items():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            want_kernel = fused_prefill.select_kernel("cuda", dtype, d)
            row = {"shape": shape, "dtype": str(dtype), "select_kernel": want_kernel}
            # error on a short prompt against float64
            n = 2048
            q, k, v = (torch.randn(1, n, h, d, device="cuda", generator=g) for h in (hq, hkv, hkv))
            calls = {}
            out, qpos = ring_of_rank0(q.to(dtype), k.to(dtype), v.to(dtype), n, args.cp, calls)
            pos = torch.arange(n, device="cuda")[None]
            ref, _ = reference.partial_attention(q.double(), k.double(), v.double(), q_positions=pos, k_positions=pos)
            ref = ref[:, qpos]
            sdpa = F.scaled_dot_product_attention(q.to(dtype).transpose(1, 2), k.to(dtype).transpose(1, 2),
                                                  v.to(dtype).transpose(1, 2), is_causal=True,
                                                  enable_gqa=True).transpose(1, 2)[:, qpos]
            row["err"] = float((out.double() - ref).abs().max())
            row["kernels"] = {}
            for name in _kernels_for(dtype):
                try:
                    o2, _ = ring_of_rank0(q.to(dtype), k.to(dtype), v.to(dtype), n, args.cp, None, name)
                    row["kernels"][name] = {"err": float((o2.double() - ref).abs().max())}
                except Exception as e:  # noqa: BLE001 -- a kernel this GPU or torch lacks: recorded, not fatal
                    row["kernels"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            row["sdpa_err"] = float((sdpa.double() - ref).abs().max())
            row["calls_2k"] = dict(calls)
            if row["err"] > max(2 * row["sdpa_err"], 1e-5):
                ok = False
                row["fail"] = "error above 2x same-dtype SDPA"
            # cuDNN's pieces below CUDNN_MIN_FLOP (all of a 2K prompt's) run on flash
            allowed = {want_kernel, "cuda_efficient"} | ({fused_prefill._flash_kernel()}
                                                         if want_kernel == "cuda_cudnn" else set())
            if not calls or not set(calls) <= allowed:
                ok = False
                row["fail"] = f"dispatch: ran {calls}, expected {sorted(allowed)}"
            # speed on the long prompt
            n = args.tokens
            q, k, v = (torch.randn(1, n, h, d, device="cuda", generator=g, dtype=dtype) for h in (hq, hkv, hkv))
            calls = {}
            ring_of_rank0(q, k, v, n, args.cp, calls)
            row["calls"] = dict(calls)
            row["ring_rank0_s"] = _time(lambda: ring_of_rank0(q, k, v, n, args.cp, None))
            for name, rec in row["kernels"].items():
                if "error" in rec:
                    continue
                try:
                    rec["first_call_s"] = _first(lambda: ring_of_rank0(q, k, v, n, args.cp, None, name))
                    rec["ring_rank0_s"] = _time(lambda: ring_of_rank0(q, k, v, n, args.cp, None, name))
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            row["sdpa_whole_prompt_s"] = _time(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                                      enable_gqa=True))
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefill_gpu.json"), "w") as f:
        json.dump({"tokens": args.tokens, "cp": args.cp, "torch": torch.__version__,
                   "device": torch.cuda.get_device_name(), "rows": rows, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
