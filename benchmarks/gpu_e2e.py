"""End to end decode on one GPU: transformers against tree attention, eager and compiled, at world 1.

A Llama-shaped model (Llama-3.1-8B's layer dimensions: hidden 4096, 32 query heads, 8 KV heads of
128, MLP 14336, vocabulary 128256; ``--layers`` of them, random bf16 weights) generates greedily
after a prompt of ``--context`` random tokens. Four runs on the same model, one after the other
in one process, per context:

- ``hf_eager``: transformers' ``generate`` with SDPA (its flash backend where it applies);
- ``hf_static_compiled``: ``cache_implementation="static"``, which makes transformers compile the
  decode forward itself (``torch.compile``, ``mode="reduce-overhead"``: CUDA graphs);
- ``tree_eager``: ``enable_tree_attention`` on a one-rank process group (NCCL on CUDA);
- ``tree_compiled``: the same with ``compile_step={"mode": "reduce-overhead"}``;
- ``tree_static_compiled`` (not in the default set): the tree-enabled model with
  ``cache_implementation="static"`` -- transformers' own documented fast path, whose automatic
  compile of the decode calls reaches the tree forward's device half (its host half stays eager).

Each step is stamped inside the one ``generate`` call (a logits processor that waits for the
device and reads the clock); reported are the median ms/token over the steps after ``--warmup``,
the prefill time (start to the first stamp), the ratio of each run to the better transformers run,
the byte floor (weights + KV bytes read per token / ``--hbm-tbps``), and whether every run's tokens
equal ``hf_eager``'s. ``--device cpu --tiny`` runs the same code on a tiny model (a smoke test of the
script on a machine without a GPU; its times mean nothing).

    python -m benchmarks.gpu_e2e --contexts 32768 131072 --layers 8 --new-tokens 32 --out gpu_out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

__all__ = ["main"]

LLAMA_8B_LAYER = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=256, rope_theta=10000.0, rms_norm_eps=1e-6)


def _model(dims: dict, layers: int, max_len: int, dtype, device):
    import transformers

    cfg = transformers.LlamaConfig(**dims, num_hidden_layers=layers, max_position_embeddings=max_len,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


class _Stamps:
    """A logits processor that stamps each step (after waiting for the device): one per generated token."""

    def __init__(self, device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def _generate(model, ids, new_tokens, warmup, **kw) -> dict:
    from transformers import LogitsProcessorList

    stamps = _Stamps(ids.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([stamps]), **kw)
    t = stamps.times
    steps = [b - a for a, b in zip(t, t[1:])]
    return {"tokens": out[0, ids.shape[1]:].tolist(), "prefill_ms": 1e3 * (t[0] - start),
            "ms_per_token": 1e3 * statistics.median(steps[warmup:]) if len(steps) > warmup else float("nan"),
            "steps_ms": [round(1e3 * s, 3) for s in steps]}


def _floor_ms(model, context: int, tbps: float) -> float:
    """Weights plus the KV cache's bytes read per decode token, at ``tbps`` TB/s (ms)."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * cfg.num_hidden_layers * context * cfg.num_key_value_heads * cfg.head_dim * model.dtype.itemsize
    return 1e3 * (weights + kv) / (tbps * 1e12)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke test of this script)")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="the byte floor's bandwidth (H200: 4.8 TB/s)")
    p.add_argument("--runs", nargs="+", default=["hf_eager", "hf_static_compiled", "tree_eager", "tree_compiled"],
                   choices=["hf_eager", "hf_static_compiled", "tree_eager", "tree_compiled", "tree_static_compiled"])
    p.add_argument("--out", default=None, help="a folder for gpu_e2e.json and gpu_e2e.md")
    args = p.parse_args(argv)
    import torch.distributed as dist

    import megatron_tree as mt
    from megatron_tree.integrations.hf import disable_tree_attention, enable_tree_attention

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    groups = mt.TreeGroups.build()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dims = TINY if args.tiny else LLAMA_8B_LAYER
    compiled = {"mode": "reduce-overhead"} if device.type == "cuda" else {"backend": "aot_eager"}
    model = _model(dims, args.layers, max(args.contexts) + args.new_tokens + 8, dtype, device)
    result = {"command": "python -m benchmarks.gpu_e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
              "model": f"{'a tiny Llama' if args.tiny else 'Llama-3.1-8B layer dims'} x {args.layers} layers, random {dtype}", "device": str(device),
              "name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "contexts": {}}
    for context in args.contexts:
        g = torch.Generator().manual_seed(context)
        ids = torch.randint(1, dims["vocab_size"], (1, context), generator=g).to(device)
        runs = {}
        for name in args.runs:
            print(f"[gpu_e2e] context {context}: {name}", file=sys.stderr, flush=True)
            try:
                if name == "hf_eager":
                    runs[name] = _generate(model, ids, args.new_tokens, args.warmup)
                elif name == "hf_static_compiled":
                    runs[name] = _generate(model, ids, args.new_tokens, args.warmup, cache_implementation="static")
                else:
                    enable_tree_attention(model, groups, compile_step=compiled if name == "tree_compiled" else False)
                    static = {"cache_implementation": "static"} if name == "tree_static_compiled" else {}
                    try:
                        runs[name] = _generate(model, ids, args.new_tokens, args.warmup, **static)
                    finally:
                        disable_tree_attention(model)
            except Exception as e:  # noqa: BLE001 -- one run's failure is reported, the others still run
                runs[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        ok = {k: v for k, v in runs.items() if "error" not in v}
        ref = ok.get("hf_eager", {}).get("tokens")
        best_hf = min((ok[k]["ms_per_token"] for k in ("hf_eager", "hf_static_compiled") if k in ok),
                      default=float("nan"))
        for v in ok.values():
            v["tokens_equal"] = v["tokens"] == ref
            v["vs_best_transformers"] = v["ms_per_token"] / best_hf
        result["contexts"][str(context)] = {"floor_ms": _floor_ms(model, context, args.hbm_tbps), "runs": runs}
        if args.out:
            _write(result, args.out)
    print(json.dumps({c: {k: {f: v.get(f) for f in ("ms_per_token", "prefill_ms", "tokens_equal", "error")}
                          for k, v in r["runs"].items()} for c, r in result["contexts"].items()}, indent=1))
    return result


def _write(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_e2e.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# gpu_e2e: {result['model']} on {result['name']}", "", f"`{result['command']}`", "",
             "| context | run | ms/token | vs better transformers | prefill ms | tokens equal |", "|---|---|---|---|---|---|"]
    for context, r in result["contexts"].items():
        for name, v in r["runs"].items():
            if "error" in v:
                lines.append(f"| {context} | {name} | error: {v['error'][:120]} | | | |")
            else:
                lines.append(f"| {context} | {name} | {v['ms_per_token']:.3f} | {v['vs_best_transformers']:.2f}x | "
                             f"{v['prefill_ms']:.1f} | {v['tokens_equal']} |")
        lines.append(f"| {context} | byte floor | {r['floor_ms']:.3f} | | | |")
    with open(os.path.join(out, "gpu_e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
