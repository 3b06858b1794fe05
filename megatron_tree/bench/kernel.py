"""Kernel benchmark: the local decode (``ops.flash_decode``) against torch SDPA, side by side.

Invariant: every method in one configuration reads the same KV cache, methods are timed
interleaved round by round (round i starts with method i mod M) so machine noise hits all
of them alike, results are medians with ratios against ours, and every method's output is
checked against ours before it is timed. Bandwidth is *useful* KV bytes -- K and V of the
cache as stored, ``2 * B * N * Hkv * D * itemsize`` -- divided by time, so a method that
expands GQA heads is charged for its extra reads rather than credited for them.

Two modes:

* ``--device cuda`` (the issue's GPU benchmark; < 5 min on an H200): B in {1, 8}, Hq=32,
  Hkv=8, D=128, N in {8K, 32K, 128K, 512K}, bf16. Methods: ``ours`` (Triton split-KV
  kernel), ``sdpa_gqa`` (``F.scaled_dot_product_attention(..., enable_gqa=True)`` on the
  same cache viewed as (B, H, N, D): no copy, SDPA picks its backend), ``flash_attn``
  (``flash_attn_with_kvcache``, when importable). The L2 cache is flushed before every
  timed call (an H200's 50 MB L2 would otherwise hold the N=8K cache), and each call is
  timed alone with CUDA events. Reports achieved bandwidth and its fraction of
  ``--peak-tbps`` (H200: 4.8 TB/s).
* ``--device cpu`` (the CPU hot path): fp32, B=1, Hq=32, Hkv=8, D=128, N in {32K, 128K}.
  Methods: ``ours`` (``ops.flash_decode`` with backend ``torch``: ``torch_decode.py``),
  ``sdpa_gqa`` (same cache, no copy, ``enable_gqa=True``) and ``sdpa_gqa_bhnd`` (SDPA given
  K/V already in its preferred contiguous (B, H, N, D) layout, i.e. a cache stored that
  way; its layout conversion is not timed).

Output: a table on stdout and ``kernel_bench_<device>.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .. import ops

__all__ = ["KernelBenchConfig", "run", "main"]


@dataclass(frozen=True)
class KernelBenchConfig:
    """One benchmark sweep."""

    device: str = "cuda"
    """``cuda`` (Triton kernel vs SDPA / flash-attn, bf16) or ``cpu`` (torch path vs SDPA, fp32)."""
    batch: tuple = (1, 8)
    """Batch sizes B."""
    seqlens: tuple = (8192, 32768, 131072, 524288)
    """KV cache lengths N."""
    nheads_q: int = 32
    """Query heads Hq."""
    nheads_kv: int = 8
    """KV heads Hkv (GQA group Hq / Hkv)."""
    headdim: int = 128
    """Head dim D."""
    dtype: str = "bfloat16"
    """Cache and query dtype."""
    rounds: int = 15
    """Timed rounds per configuration (each round times every method once)."""
    warmup: int = 3
    """Untimed calls per method before the rounds (compilation, allocator warm-up)."""
    peak_tbps: float = 4.8
    """Peak memory bandwidth of the device in TB/s (H200 HBM3e: 4.8), for the fraction of peak."""
    methods: tuple = field(default=())
    """Methods to run (empty: all available for the device)."""

    @staticmethod
    def for_device(device: str, **overrides) -> "KernelBenchConfig":
        if device == "cpu":
            base = dict(device="cpu", batch=(1,), seqlens=(32768, 131072), dtype="float32", rounds=9,
                        warmup=2, peak_tbps=0.035)
        else:
            base = dict(device=device)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return KernelBenchConfig(**base)


def _methods(cfg: KernelBenchConfig) -> dict:
    """name -> (prepare(q, k, v) -> call() -> out (B, Sq, Hq, D), description)."""
    def ours(q, k, v):
        backend = "torch" if cfg.device == "cpu" else None
        return lambda: ops.flash_decode(q, k, v, backend=backend)[0]

    def sdpa_gqa(q, k, v):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copy
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

    def sdpa_gqa_bhnd(q, k, v):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

    found = {
        "ours": (ours, "ops.flash_decode (" + ("torch_decode.py" if cfg.device == "cpu" else "Triton split-KV") + ")"),
        "sdpa_gqa": (sdpa_gqa, "torch SDPA, enable_gqa=True, same (B,N,H,D) cache viewed as (B,H,N,D), no copy"),
    }
    if cfg.device == "cpu":
        found["sdpa_gqa_bhnd"] = (sdpa_gqa_bhnd, "torch SDPA, enable_gqa=True, K/V pre-laid-out as contiguous (B,H,N,D)")
    else:
        try:
            from flash_attn import flash_attn_with_kvcache  # optional

            def flash_attn(q, k, v):
                return lambda: flash_attn_with_kvcache(q, k, v)

            found["flash_attn"] = (flash_attn, "flash_attn_with_kvcache (same cache, no copy)")
        except ImportError:
            pass
    if cfg.methods:
        unknown = set(cfg.methods) - set(found)
        if unknown:
            raise ValueError(f"unknown or unavailable methods {sorted(unknown)}; available: {sorted(found)}")
        found = {k: found[k] for k in cfg.methods}
    return found


class _Timer:
    """Times one call: CUDA events around it after an L2 flush, or perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            self.flush.zero_()  # evict the cache from L2
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def run(cfg: KernelBenchConfig, log=print) -> dict:
    """Run the sweep; returns ``{"meta": ..., "rows": [...]}`` (one row per configuration x method)."""
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    methods = _methods(cfg)
    timer = _Timer(device)
    rows = []
    for b in cfg.batch:
        for n in cfg.seqlens:
            g = torch.Generator(device=device).manual_seed(0)
            shape_kv = (b, n, cfg.nheads_kv, cfg.headdim)
            try:
                q = torch.randn(b, 1, cfg.nheads_q, cfg.headdim, device=device, dtype=dtype, generator=g)
                k = torch.randn(shape_kv, device=device, dtype=dtype, generator=g)
                v = torch.randn(shape_kv, device=device, dtype=dtype, generator=g)
            except torch.OutOfMemoryError as e:
                log(f"B={b} N={n}: cache does not fit ({e}); skipped")
                continue
            kv_bytes = 2 * k.numel() * k.element_size()
            calls, errors = {}, {}
            ref = None
            for name, (prepare, _) in methods.items():
                try:
                    call = prepare(q, k, v)
                    out = call()
                    for _ in range(cfg.warmup - 1):
                        call()
                    if ref is None:
                        ref = out.float()
                    err = (out.float() - ref).abs().max().item()
                    calls[name] = (call, err)
                except Exception as e:  # OOM or an unsupported backend: recorded, not fatal
                    errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
                if device.type == "cuda":
                    torch.cuda.synchronize()
            times = {name: [] for name in calls}
            names = list(calls)
            for r in range(cfg.rounds):
                for i in range(len(names)):
                    name = names[(r + i) % len(names)]
                    times[name].append(timer(calls[name][0]))
            ours_t = statistics.median(times["ours"]) if "ours" in times else None
            for name in methods:
                row = {"batch": b, "seqlen": n, "nheads_q": cfg.nheads_q, "nheads_kv": cfg.nheads_kv,
                       "headdim": cfg.headdim, "dtype": cfg.dtype, "method": name, "kv_bytes": kv_bytes}
                if name in errors:
                    row["error"] = errors[name]
                else:
                    t = statistics.median(times[name])
                    bw = kv_bytes / t
                    row.update({
                        "median_s": t, "p10_s": _quantile(times[name], 0.1), "p90_s": _quantile(times[name], 0.9),
                        "kv_gbps": bw / 1e9, "fraction_of_peak": bw / (cfg.peak_tbps * 1e12),
                        "time_vs_ours": t / ours_t if ours_t else None,
                        "max_abs_diff_vs_first": calls[name][1],
                    })
                rows.append(row)
                log(_fmt(row))
            del q, k, v, calls
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"meta": _meta(cfg, methods), "rows": rows}


def _quantile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _fmt(row) -> str:
    head = f"B={row['batch']:<2} N={row['seqlen']:<7} {row['method']:<14}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    return (f"{head} {row['median_s'] * 1e3:9.3f} ms  {row['kv_gbps']:8.1f} GB/s  "
            f"{100 * row['fraction_of_peak']:5.1f}% of peak  x{row['time_vs_ours']:.2f} time vs ours  "
            f"maxdiff {row['max_abs_diff_vs_first']:.1e}")


def _meta(cfg, methods) -> dict:
    meta = {
        "config": asdict(cfg), "methods": {k: d for k, (_, d) in methods.items()},
        "torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
        "threads": torch.get_num_threads(),
        "bandwidth": "useful KV bytes (2*B*N*Hkv*D*itemsize) / median time",
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if cfg.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name()
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--batch", type=int, nargs="+")
    p.add_argument("--seqlens", type=int, nargs="+")
    p.add_argument("--rounds", type=int)
    p.add_argument("--peak-tbps", type=float, help="peak memory bandwidth, TB/s (default 4.8 on cuda)")
    p.add_argument("--methods", nargs="+")
    p.add_argument("--out", default=None, help="folder for kernel_bench_<device>.json")
    a = p.parse_args(argv)
    cfg = KernelBenchConfig.for_device(
        a.device, batch=tuple(a.batch) if a.batch else None, seqlens=tuple(a.seqlens) if a.seqlens else None,
        rounds=a.rounds, peak_tbps=a.peak_tbps, methods=tuple(a.methods) if a.methods else None)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    print(f"# kernel benchmark on {cfg.device}: {cfg}", flush=True)
    result = run(cfg, log=lambda s: print(s, flush=True))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, f"kernel_bench_{cfg.device}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
