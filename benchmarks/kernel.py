"""Kernel benchmark: the local decode (``ops.flash_decode``) against torch SDPA, side by side.

Invariant: every method in one configuration reads the same KV cache, methods are timed
interleaved round by round (round i starts with method i mod M) so machine noise hits all
of them alike, results are medians with ratios against ours, and every method's output is
checked against ours before it is timed. Bandwidth is *useful* KV bytes -- K and V of the
cache as stored, ``2 * B * N * Hkv * D * itemsize`` -- divided by time, so a method that
expands GQA heads is charged for its extra reads rather than credited for them.

Two modes:

* ``--device cuda`` (the GPU benchmark, run by ``bench/gpu_check.sh``): B in {1, 8},
  (Hq, Hkv) in {(32, 8), (64, 8)}, D=128, N in {4K, 32K, 128K, 512K}, bf16. Methods:
  ``ours`` (Triton split-KV kernel, eager: launch overhead included), ``ours_graph`` (the
  same call captured in a CUDA graph and replayed; its output must equal the eager one bit
  for bit), ``sdpa`` (``F.scaled_dot_product_attention(..., enable_gqa=True)`` on the same
  cache viewed as (B, H, N, D): no copy; the backend SDPA picked is recorded),
  ``flash_attn`` (``flash_attn_with_kvcache``, when importable). The ``ours`` row also
  carries the device time of each kernel (split vs merge, CUDA events around each launch)
  and the split count; every row carries ``wall_per_call_s``, the host time per call of
  back-to-back calls (launch overhead included: eager vs graph), and the ``ours`` row
  ``wall_per_call_jit_s``, the same with every launch through Triton's JIT (no fast launch). Before every timed call the L2 cache is flushed by *reading* a
  buffer larger than it (a write would leave dirty lines whose write-back overlaps the
  timed kernel). Bandwidth is reported in GB/s, as a fraction of ``--peak-tbps`` (H200:
  4.8 TB/s) and as a fraction of a device-to-device copy measured in the same run.
* ``--device cpu`` (the CPU hot path): fp32, B=1, Hq=32, Hkv=8, D=128, N in {32K, 128K}.
  Methods: ``ours`` (``ops.flash_decode`` with backend ``torch``: ``torch_decode.py``),
  ``sdpa_gqa`` (same cache, no copy, ``enable_gqa=True``) and ``sdpa_gqa_bhnd`` (SDPA given
  K/V already in its preferred contiguous (B, H, N, D) layout, i.e. a cache stored that
  way; its layout conversion is not timed).

Output: a table on stdout and ``kernel_bench_<device>.json`` under ``--out``, rewritten after
every configuration (``run(..., on_row=...)``), so a later failure loses nothing measured.
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

from megatron_tree.ops import dispatch as ops

__all__ = ["KernelBenchConfig", "Timer", "run", "main", "copy_bandwidth", "sdpa_backend"]


@dataclass(frozen=True)
class KernelBenchConfig:
    """One benchmark sweep."""

    device: str = "cuda"
    """``cuda`` (Triton kernel vs SDPA / flash-attn, bf16) or ``cpu`` (torch path vs SDPA, fp32)."""
    batch: tuple = (1, 8)
    """Batch sizes B."""
    seqlens: tuple = (4096, 32768, 131072, 524288)
    """KV cache lengths N."""
    heads: tuple = ((32, 8), (64, 8))
    """(query heads Hq, KV heads Hkv) pairs (GQA group Hq / Hkv)."""
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
            base = dict(device="cpu", batch=(1,), seqlens=(32768, 131072), heads=((32, 8),), dtype="float32",
                        rounds=9, warmup=2, peak_tbps=0.035)
        else:
            base = dict(device=device)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return KernelBenchConfig(**base)


def sdpa_backend(q, k, v) -> str:
    """Name of the backend ``F.scaled_dot_product_attention(q, k, v, enable_gqa=True)`` picks
    for these (B, H, N, D) inputs on CUDA (torch's own dispatcher, asked without running it)."""
    try:
        from torch.nn.attention import SDPBackend

        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=None, enable_gqa=True)
        return SDPBackend(choice).name
    except Exception as e:  # private API: record why it is unknown rather than fail the run
        return f"unknown ({type(e).__name__}: {str(e)[:80]})"


def _methods(cfg: KernelBenchConfig) -> dict:
    """name -> (prepare(q, k, v) -> call() -> out (B, Sq, Hq, D), description)."""
    def ours(q, k, v):
        backend = "torch" if cfg.device == "cpu" else None
        return lambda: ops.flash_decode(q, k, v, backend=backend)[0]

    def ours_graph(q, k, v):
        call = ours(q, k, v)
        call()  # compile and fill the split-count cache outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # allocator warm-up on a side stream, as torch's docs do
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call()
        eager = call()
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, eager):
            raise AssertionError(f"CUDA-graph replay differs from eager by {(out.float() - eager.float()).abs().max()}")

        def replay():
            graph.replay()
            return out

        replay.graph = graph  # keep the graph (and its memory pool) alive with the call
        return replay

    def sdpa_gqa(q, k, v):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copy
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

    def sdpa_gqa_bhnd(q, k, v):
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)

    if cfg.device == "cpu":
        found = {
            "ours": (ours, "ops.flash_decode (torch_decode.py)"),
            "sdpa_gqa": (sdpa_gqa, "torch SDPA, enable_gqa=True, same (B,N,H,D) cache viewed as (B,H,N,D), no copy"),
            "sdpa_gqa_bhnd": (sdpa_gqa_bhnd, "torch SDPA, enable_gqa=True, K/V pre-laid-out as contiguous (B,H,N,D)"),
        }
    else:
        found = {
            "ours": (ours, "ops.flash_decode (Triton split-KV + merge), eager"),
            "ours_graph": (ours_graph, "the same call captured in a CUDA graph, replayed"),
            "sdpa": (sdpa_gqa, "torch SDPA, enable_gqa=True, same (B,N,H,D) cache viewed as (B,H,N,D), no copy"),
        }
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


class Timer:
    """Times one call: CUDA events around it after an L2 flush by reading, or perf_counter on CPU."""

    def __init__(self, device: torch.device, flush_bytes: int = 512 * 1024 * 1024):
        self.device = device
        if device.type == "cuda":
            # Larger than any L2 (H200: 60 MB); reading it evicts the KV cache's lines clean.
            self.flush_buf = torch.ones(flush_bytes // 4, dtype=torch.float32, device=device)
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def flush(self) -> None:
        if self.device.type == "cuda":
            self.sink = self.flush_buf.sum()

    def __call__(self, fn, flush: bool = True) -> float:
        if self.device.type == "cuda":
            if flush:
                self.flush()
            self.start.record()
            fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 1024**3, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting each byte read and written
    (median of ``reps`` copies of ``nbytes``): the practical ceiling a streaming kernel meets."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    timer = Timer(device)
    dst.copy_(src)
    times = [timer(lambda: dst.copy_(src)) for _ in range(reps)]
    del src, dst
    return 2 * nbytes / statistics.median(times)


def _kernel_times(q, k, v, timer: Timer, rounds: int) -> dict:
    """Device time of each kernel of one ours-call: the split kernel after an L2 flush, the
    merge right after it (its fp32 partials still in L2, as in a real call)."""
    from megatron_tree.ops.triton import flash_decode as fd

    _, _, launches = fd.decode_launches(q, k, v)
    split, merge = [], []
    for _ in range(rounds):
        split.append(timer(launches[0].run))
        if len(launches) > 1:
            merge.append(timer(launches[1].run, flush=False))
    return {"num_splits": launches[0].grid[1], "split_kernel_s": statistics.median(split),
            "merge_kernel_s": statistics.median(merge) if merge else 0.0,
            "config": {k: v for k, v in launches[0].kwargs.items() if k.isupper() or k.startswith("num_")}}


def _wall_per_call(call, reps: int = 20) -> float:
    """Host wall time per call of ``reps`` back-to-back calls, synchronised at the end: where
    launch overhead exceeds the kernel (short caches) this is what eager decode costs, and
    what a CUDA graph saves. (The timed rounds flush L2 first, which hides launch overhead
    behind the flush; they measure device time.)"""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def run(cfg: KernelBenchConfig, log=print, on_row=None, deadline: float | None = None) -> dict:
    """Run the sweep; returns ``{"meta": ..., "rows": [...]}`` (one row per configuration x method).

    on_row(result): called with the partial result after every configuration.
    deadline: a ``time.monotonic()`` after which remaining configurations are recorded as
    skipped instead of run.
    """
    device = torch.device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    methods = _methods(cfg)
    timer = Timer(device)
    meta = _meta(cfg, methods)
    if device.type == "cuda":
        meta["copy_bandwidth_Bps"] = copy_bandwidth(device)
        log(f"device-to-device copy: {meta['copy_bandwidth_Bps'] / 1e9:.0f} GB/s (read + write)")
    result = {"meta": meta, "rows": []}
    for hq, hkv in cfg.heads:
        for b in cfg.batch:
            for n in cfg.seqlens:
                if deadline is not None and time.monotonic() > deadline:
                    result["rows"].append({"batch": b, "seqlen": n, "nheads_q": hq, "nheads_kv": hkv,
                                           "skipped": "time budget used up"})
                    continue
                rows = _one_config(cfg, methods, timer, device, dtype, b, n, hq, hkv, meta, log)
                result["rows"] += rows
                if on_row is not None:
                    on_row(result)
    return result


def _one_config(cfg, methods, timer, device, dtype, b, n, hq, hkv, meta, log) -> list[dict]:
    base = {"batch": b, "seqlen": n, "nheads_q": hq, "nheads_kv": hkv, "headdim": cfg.headdim, "dtype": cfg.dtype}
    g = torch.Generator(device=device).manual_seed(0)
    shape_kv = (b, n, hkv, cfg.headdim)
    try:
        q = torch.randn(b, 1, hq, cfg.headdim, device=device, dtype=dtype, generator=g)
        k = torch.randn(shape_kv, device=device, dtype=dtype, generator=g)
        v = torch.randn(shape_kv, device=device, dtype=dtype, generator=g)
    except torch.OutOfMemoryError as e:
        log(f"B={b} N={n} Hq={hq}: cache does not fit ({str(e)[:100]}); skipped")
        return [{**base, "method": name, "error": "OutOfMemoryError (inputs)"} for name in methods]
    kv_bytes = 2 * k.numel() * k.element_size()
    calls, errors, extra = {}, {}, {}
    ref = None
    for name, (prepare, _) in methods.items():
        try:
            call = prepare(q, k, v)
            out = call()
            for _ in range(cfg.warmup - 1):
                call()
            if ref is None:
                ref = out.float()
            calls[name] = (call, (out.float() - ref).abs().max().item())
            if name == "sdpa" and device.type == "cuda":
                extra[name] = {"sdpa_backend": sdpa_backend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))}
            if name == "ours" and device.type == "cuda":
                extra[name] = _kernel_times(q, k, v, timer, cfg.rounds)
            if device.type == "cuda":
                extra.setdefault(name, {})["wall_per_call_s"] = _wall_per_call(call)
            if name == "ours" and device.type == "cuda":  # the same calls with every launch through Triton's JIT
                from megatron_tree.ops.triton import launch as launch_path

                fast = launch_path.FAST_LAUNCH
                launch_path.FAST_LAUNCH = False
                try:
                    extra[name]["wall_per_call_jit_s"] = _wall_per_call(call)
                finally:
                    launch_path.FAST_LAUNCH = fast
        except Exception as e:  # OOM or an unsupported backend: recorded, not fatal
            errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = {name: [] for name in calls}
    names = list(calls)
    for r in range(cfg.rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            times[name].append(timer(calls[name][0]))
    ours_t = statistics.median(times["ours"]) if "ours" in times else None
    rows = []
    for name in methods:
        row = {**base, "method": name, "kv_bytes": kv_bytes, **extra.get(name, {})}
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
            if "copy_bandwidth_Bps" in meta:
                row["fraction_of_copy"] = bw / meta["copy_bandwidth_Bps"]
            if "split_kernel_s" in row:
                row["split_kernel_gbps"] = kv_bytes / row["split_kernel_s"] / 1e9
        rows.append(row)
        log(_fmt(row))
    del q, k, v, calls
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _quantile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _fmt(row) -> str:
    head = f"B={row['batch']:<2} N={row['seqlen']:<7} Hq={row['nheads_q']:<3} {row['method']:<14}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    text = (f"{head} {row['median_s'] * 1e3:9.3f} ms  {row['kv_gbps']:8.1f} GB/s  "
            f"{100 * row['fraction_of_peak']:5.1f}% of peak  x{row['time_vs_ours']:.2f} time vs ours  "
            f"maxdiff {row['max_abs_diff_vs_first']:.1e}")
    if "split_kernel_s" in row:
        text += (f"  [splits {row['num_splits']}: split {row['split_kernel_s'] * 1e6:.1f} us, "
                 f"merge {row['merge_kernel_s'] * 1e6:.1f} us]")
    if "sdpa_backend" in row:
        text += f"  [{row['sdpa_backend']}]"
    if "wall_per_call_s" in row:
        text += f"  host {row['wall_per_call_s'] * 1e6:.0f} us/call"
    if "wall_per_call_jit_s" in row:
        text += f" ({row['wall_per_call_jit_s'] * 1e6:.0f} with every launch through Triton's JIT)"
    return text


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
    p.add_argument("--heads", type=str, nargs="+", help="Hq/Hkv pairs, e.g. 32/8 64/8")
    p.add_argument("--rounds", type=int)
    p.add_argument("--peak-tbps", type=float, help="peak memory bandwidth, TB/s (default 4.8 on cuda)")
    p.add_argument("--methods", nargs="+")
    p.add_argument("--out", default=None, help="folder for kernel_bench_<device>.json")
    a = p.parse_args(argv)
    heads = tuple(tuple(int(x) for x in h.split("/")) for h in a.heads) if a.heads else None
    cfg = KernelBenchConfig.for_device(
        a.device, batch=tuple(a.batch) if a.batch else None, seqlens=tuple(a.seqlens) if a.seqlens else None,
        heads=heads, rounds=a.rounds, peak_tbps=a.peak_tbps, methods=tuple(a.methods) if a.methods else None)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    print(f"# kernel benchmark on {cfg.device}: {cfg}", flush=True)
    path = os.path.join(a.out, f"kernel_bench_{cfg.device}.json") if a.out else None
    if path:
        os.makedirs(a.out, exist_ok=True)

    def save(result):
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=1)

    result = run(cfg, log=lambda s: print(s, flush=True), on_row=save)
    save(result)
    if path:
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
