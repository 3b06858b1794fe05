"""The Python half of ``bench/gpu_check.sh``: one short run on one GPU that measures what matters.

Invariant: every step and every configuration inside a step is isolated -- an exception is
recorded in the results and the run moves on -- and ``gpu_check.json`` under ``--out`` is
rewritten after each configuration, so a crash, a hang killed by the shell's timeout, or a
variant that fails to compile never loses what was measured before it. Steps, in order:

1. ``env``: GPU, SM count and limits, torch / triton / CUDA versions, a device-to-device
   copy bandwidth (the practical ceiling);
2. ``kernel``: ``bench/kernel.py`` on N in {4K, 32K, 128K, 512K}, B in {1, 8}, GQA 32/8 and
   64/8, bf16, D 128 -- eager, CUDA-graph replay, split vs merge kernel device time, GB/s
   as fractions of the 4.8 TB/s peak and of the copy, torch SDPA with its backend;
3. ``sweep``: BLOCK_N x warps x stages of the split kernel at N = 32K and 512K (B 1, GQA 32/8);
4. ``merge``: the merge kernel alone, P in {2, 8, 64};
5. ``model_step``: one decode step of a small random transformers Llama (``HFTreeModel``)
   captured in a CUDA graph, its replay equal to the eager step.

``--dry-run`` runs every step on CPU with tiny shapes (the torch path for the benchmark,
the Triton interpreter for the sweep and the merge when ``TRITON_INTERPRET=1``, no graphs),
so the Python is exercised by ``tests/ops/test_ops.py`` before it ever meets a GPU. Needs only
torch + triton, and transformers for the model step (no deepspeed, megatron-core, wandb or
flash-attn).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

import torch

__all__ = ["main", "run"]


class Results:
    """The run's JSON document, rewritten to ``path`` after every change, and the deadline
    of the step being run (configurations past it are recorded as skipped, not run)."""

    def __init__(self, path: str | None):
        self.path = path
        self.doc = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": {}}
        self.deadline = float("inf")

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def put(self, step: str, key: str, value) -> None:
        self.doc["steps"].setdefault(step, {})[key] = value
        self.save()

    def save(self) -> None:
        if self.path:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.doc, f, indent=1, default=str)
            os.replace(tmp, self.path)


def _guard(results: Results, step: str, key: str, fn, log):
    """Run one configuration; record its value or its error, never raise."""
    if results.out_of_time():
        results.put(step, key, {"skipped": "time budget of the step used up"})
        return None
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 -- one variant's failure must not stop the run
        value = {"error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-3000:]}
        log(f"[{step}] {key}: ERROR {value['error']}")
    else:
        log(f"[{step}] {key}: {json.dumps(value, default=str)[:300]}")
    if isinstance(value, dict):
        value.setdefault("wall_s", time.perf_counter() - t0)
    results.put(step, key, value)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return value


# ---- steps --------------------------------------------------------------------------------------

def step_env(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as e:
        info["triton"] = f"missing: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update({
            "gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "memory_GB": props.total_memory / 1e9, "cuda": torch.version.cuda,
            **{name: getattr(props, name, None) for name in (
                "regs_per_multiprocessor", "max_threads_per_multi_processor", "shared_memory_per_multiprocessor",
                "shared_memory_per_block_optin", "L2_cache_size")},
        })
        from .kernel import copy_bandwidth

        info["copy_bandwidth_GBps"] = copy_bandwidth(device) / 1e9
    return info


def step_kernel(results: Results, device: torch.device, dry: bool, log) -> None:
    from .kernel import KernelBenchConfig, run

    if dry:
        cfg = KernelBenchConfig.for_device("cpu", seqlens=(256,), heads=((4, 2),), rounds=1, warmup=1)
    else:
        cfg = KernelBenchConfig.for_device("cuda", rounds=10)

    def one():
        # kernel.run saves itself after each configuration through on_row.
        return run(cfg, log=log, on_row=lambda partial: results.put("kernel", "bench", partial),
                   deadline=results.deadline)

    _guard(results, "kernel", "bench", one, log)


def _sweep_configs(dry: bool):
    if dry:
        return [{"BLOCK_N": bn, "num_warps": 4, "num_stages": 2} for bn in (32, 64)]
    return [{"BLOCK_N": bn, "num_warps": w, "num_stages": s} for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def step_sweep(results: Results, device: torch.device, dry: bool, log) -> None:
    from megatron_tree.ops.triton import flash_decode as fd
    from .kernel import Timer

    timer = Timer(device)
    dtype = torch.float32 if dry else torch.bfloat16
    for n in ((128,) if dry else (32768, 524288)):
        g = torch.Generator(device=device).manual_seed(n)
        q = torch.randn(1, 1, 32 if not dry else 4, 128, device=device, dtype=dtype, generator=g)
        k = torch.randn(1, n, 8 if not dry else 2, 128, device=device, dtype=dtype, generator=g)
        v = torch.randn_like(k)
        ref, _ = fd.flash_decode(q, k, v)
        kv_bytes = 2 * k.numel() * k.element_size()
        for config in _sweep_configs(dry):
            def one(config=config):
                out, _ = fd.flash_decode(q, k, v, config=config)  # compiles this variant
                err = (out.float() - ref.float()).abs().max().item()
                times = [timer(lambda: fd.flash_decode(q, k, v, config=config)) for _ in range(1 if dry else 10)]
                t = statistics.median(times)
                return {"seqlen": n, **config, "median_s": t, "kv_gbps": kv_bytes / t / 1e9, "max_abs_diff": err}

            key = f"N={n} BLOCK_N={config['BLOCK_N']} warps={config['num_warps']} stages={config['num_stages']}"
            _guard(results, "sweep", key, one, log)
        del q, k, v


def step_merge(results: Results, device: torch.device, dry: bool, log) -> None:
    from megatron_tree.ops.triton import merge as mk
    from .kernel import Timer

    timer = Timer(device)
    b, hq, d = (1, 2, 64) if dry else (8, 32, 128)
    for p in (2, 8, 64):
        def one(p=p):
            g = torch.Generator(device=device).manual_seed(p)
            outs = torch.randn(p, b, 1, hq, d, device=device, generator=g)
            lses = torch.randn(p, b, hq, 1, device=device, generator=g)
            out, lse = mk.merge_states(outs, lses)
            from megatron_tree.ops import reference

            ref_o, _ = reference.merge_states(outs, lses)
            times = [timer(lambda: mk.merge_states(outs, lses)) for _ in range(1 if dry else 20)]
            t = statistics.median(times)
            nbytes = outs.numel() * 4 + lses.numel() * 4 + out.numel() * out.element_size()
            return {"p": p, "median_s": t, "gbps": nbytes / t / 1e9,
                    "max_abs_diff": (out.float() - ref_o.float()).abs().max().item()}

        _guard(results, "merge", f"P={p}", one, log)


def _small_llama(device, dtype):
    """A small random transformers ``LlamaForCausalLM`` behind the library's decode protocol (no CP group)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_tree.integrations.hf import HFTreeModel

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    torch.manual_seed(0)
    # eager steps: step_model captures decode_step in a CUDA graph of its own (the default would compile it)
    return HFTreeModel(LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval(), None, compile_step=False)


def step_model(results: Results, device: torch.device, dry: bool, log) -> None:
    """``HFTreeModel.decode_step`` (transformers' whole forward of one token: embedding, layers,
    tree attention, cache append, logits) captured in a CUDA graph, replayed, and held to the
    eager step on a twin cache. It can be captured because it reads no device value on the host
    (``sync_guard``; tests/decode/test_host_sync.py); the cache's host bookkeeping runs once, at capture,
    so a replay repeats that step (same positions and slots) rather than advancing."""
    dtype = torch.float32 if dry else torch.bfloat16
    prompts = [list(range(1, 300)), list(range(5, 40))]

    def prepared(model):
        cache = model.new_cache(batch_size=2, max_seq_len=1024)
        ids = model.prefill(prompts, cache).argmax(-1)
        return cache, ids

    def hf_step():
        model = _small_llama(device, dtype)
        twin, ids = prepared(model)
        eager = model.decode_step(ids, twin)
        out = {"eager_finite": bool(torch.isfinite(eager).all())}
        if device.type != "cuda":
            # On CPU: the step against transformers' own forward over the whole sequences.
            plain = model.unsharded()
            with torch.no_grad():
                want = torch.stack([plain(torch.tensor([p + [int(t)]])).logits[0, -1] for p, t in zip(prompts, ids)])
            out["skipped"] = "no CUDA graphs on CPU"
            out["max_abs_diff_vs_unsharded"] = (eager.float() - want.float()).abs().max().item()
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch.cuda.graphs asks
            warm_cache, warm_ids = prepared(model)
            model.decode_step(warm_ids, warm_cache)
        torch.cuda.current_stream().wait_stream(side)
        cache, ids = prepared(model)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model.decode_step(ids, cache)
        graph.replay()
        torch.cuda.synchronize()
        out["replay_equals_eager"] = bool(torch.equal(captured, eager))
        out["max_abs_diff"] = (captured.float() - eager.float()).abs().max().item()
        replay_s = []
        for _ in range(20):
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            replay_s.append(time.perf_counter() - t0)
        eager_s = []
        for _ in range(5):
            c, i = prepared(model)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.decode_step(i, c)
            torch.cuda.synchronize()
            eager_s.append(time.perf_counter() - t0)
        out.update({"replay_median_s": statistics.median(replay_s), "eager_median_s": statistics.median(eager_s)})
        if not out["replay_equals_eager"]:
            raise AssertionError(f"CUDA-graph replay differs from eager: {out}")
        return out

    _guard(results, "model_step", "hf_decode_step_captured", hf_step, log)


BUDGET_SHARES = {"env": 0.05, "kernel": 0.42, "sweep": 0.30, "merge": 0.06, "model_step": 0.17}
"""Fraction of ``--budget-s`` each step may use; time a step leaves unused passes to the next."""


def run(out_dir: str | None, dry: bool, steps: tuple, log=print, budget_s: float = float("inf")) -> dict:
    device = torch.device("cpu" if dry else "cuda")
    results = Results(os.path.join(out_dir, "gpu_check.json") if out_dir else None)
    results.doc.update({"dry_run": dry, "budget_s": budget_s})
    results.save()
    start = time.monotonic()
    used_share = 0.0

    def open_step(name):
        nonlocal used_share
        used_share += BUDGET_SHARES[name]
        results.deadline = start + used_share * budget_s

    if "env" in steps:
        open_step("env")
        _guard(results, "env", "info", lambda: step_env(device), log)
    for name, fn in (("kernel", step_kernel), ("sweep", step_sweep), ("merge", step_merge),
                     ("model_step", step_model)):
        if name in steps:
            open_step(name)
            try:
                fn(results, device, dry, log)
            except Exception as e:  # noqa: BLE001 -- setup of a step failed: record, go on
                results.put(name, "setup_error", f"{type(e).__name__}: {e}")
                log(f"[{name}] setup ERROR {e}")
    results.doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    results.save()
    return results.doc


STEPS = ("env", "kernel", "sweep", "merge", "model_step")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "./gpu_out"))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, no GPU needed")
    p.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    p.add_argument("--budget-s", type=float, default=float("inf"), help="time for all steps (split by BUDGET_SHARES)")
    a = p.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    doc = run(a.out, a.dry_run, tuple(a.steps), log=lambda s: print(s, flush=True), budget_s=a.budget_s)
    errors = [f"{s}/{k}" for s, entries in doc["steps"].items() for k, v in entries.items()
              if isinstance(v, dict) and "error" in v or k == "setup_error"]
    print(f"# wrote {os.path.join(a.out, 'gpu_check.json')}; errors: {errors or 'none'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
