"""How exact a merge stays when attention scores are huge, side by side.

    python -m benchmarks.precision [--backend torch|triton] [--device cpu|cuda] [--tokens N] [--out DIR]

For rows whose scores are ``magnitude + small integer`` (exact in float32, so one attention
call over all keys is as accurate at 1e5 as at 1), the sequence is cut into P uneven
shards, each shard's partial state is computed with ``ops.flash_decode`` and the P states
are merged with ``ops.merge_states`` (the local merge of ``allgather``; the all-reduce
strategies use the same two halves of the formula). Three numbers per (magnitude, P), all
the largest absolute output error against float64 attention on the unsharded inputs:

* ``one_call``: one ``flash_decode`` over every key (no merge): the floor;
* ``merge_lse32``: partials whose lse is float32 (what a merge carried before lse travelled in float64);
* ``merge_lse64``: partials whose lse is float64 (what ``tree_decode`` carries now).

``--backend triton`` runs the Triton kernels (on a GPU, or under ``TRITON_INTERPRET=1`` on
CPU, set before the import) with several KV splits per call, so the kernel's own split merge
is measured too. Writes ``precision.json`` and prints a markdown table. The inputs are
:func:`large_score_inputs`, which the tests use as well.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_tree.ops import dispatch as ops, reference

__all__ = ["large_score_inputs", "lse_tolerance", "uneven_cuts", "HEAD_DIM", "measure", "markdown", "main"]

HEAD_DIM = 16
"""Head dim of :func:`large_score_inputs`: its default softmax scale, 1/4, is exact."""


def large_score_inputs(magnitudes, lengths, sq: int = 1, hq: int = 8, hkv: int = 2, seed: int = 0):
    """float64 q (B, sq, hq, 16), k, v (B, max(lengths), hkv, 16) and int32 lengths (B,) whose
    row-b scores are ``magnitudes[b]`` plus an integer in [-15, 15], every value exact in float32.

    q's first coordinate is ``4 * magnitude`` and every key's is 1; the other coordinates are
    integers in [-1, 1]; v is random (rounded to float32). Scores within a few units of each
    other sit on every shard (near ties), so the weights of the partial states matter. Exact
    while ``4 * |magnitude| + 15 <= 2^24`` (|magnitude| up to ~4.19e6); larger ones are refused.
    """
    if len(magnitudes) != len(lengths):
        raise ValueError(f"one magnitude per row: {len(magnitudes)} magnitudes for {len(lengths)} rows")
    too_big = [m for m in magnitudes if 4 * abs(m) + 15 > 2 ** 24]
    if too_big:
        raise ValueError(f"magnitudes {too_big} are too large: scores are exact in float32 only while "
                         f"4 * |magnitude| + 15 <= 2^24 (|magnitude| <= {(2 ** 24 - 15) / 4:.0f})")
    g = torch.Generator().manual_seed(seed)
    b, n = len(lengths), max(lengths)
    q = torch.randint(-1, 2, (b, sq, hq, HEAD_DIM), generator=g).double()
    k = torch.randint(-1, 2, (b, n, hkv, HEAD_DIM), generator=g).double()
    q[..., 0] = 4 * torch.tensor(magnitudes, dtype=torch.float64)[:, None, None]
    k[..., 0] = 1.0
    v = torch.randn(b, n, hkv, HEAD_DIM, generator=g, dtype=torch.float64).float().double()
    return q, k, v, torch.tensor(lengths, dtype=torch.int32)


def lse_tolerance(lse: torch.Tensor) -> torch.Tensor:
    """How close a float32 lse can be to ``lse``: 1e-5 plus one rounding (2^-24 relative)."""
    return lse.abs() * 2.0 ** -24 + 1e-5


def uneven_cuts(n: int, p: int, empty: int | None = None) -> list[int]:
    """Cuts of [0, n) into p uneven shards (p + 1 bounds): shard r gets a share ~ (r + 1),
    shard ``empty`` (when given) none."""
    weights = [0 if r == empty else r + 1 for r in range(p)]
    cuts, acc = [0], 0
    for w in weights:
        acc += w
        cuts.append(round(n * acc / sum(weights)))
    return cuts


def measure(magnitudes=(1.0, 1e2, 1e3, 1e4, 1e5, -1e5), worlds=(2, 4, 8), n: int = 512,
            backend: str = "torch", device: str = "cpu") -> list[dict]:
    """One row per (magnitude, P): ``one_call``, ``merge_lse32``, ``merge_lse64`` (module docstring)."""
    q, k, v, lens = large_score_inputs(list(magnitudes), [n] * len(magnitudes))
    want, _ = reference.partial_attention(q, k, v)
    qf, kf, vf = (t.float().to(device) for t in (q, k, v))

    def err(out):  # per row
        return (out.double().cpu() - want).abs().amax(dim=(1, 2, 3)).tolist()

    one = err(ops.flash_decode(qf, kf, vf, backend=backend)[0])
    rows = []
    for p in worlds:
        cuts = uneven_cuts(n, p, empty=1 if p > 2 else None)
        merged = {}
        for name, lse_dtype in (("merge_lse32", torch.float32), ("merge_lse64", torch.float64)):
            parts = [ops.flash_decode(qf, kf[:, a:b], vf[:, a:b], out_dtype=torch.float32, lse_dtype=lse_dtype,
                                      backend=backend) for a, b in zip(cuts, cuts[1:])]
            out, _ = ops.merge_states(torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts]),
                                      backend=backend)
            merged[name] = err(out)
        for i, mag in enumerate(magnitudes):
            rows.append({"magnitude": mag, "P": p, "one_call": one[i],
                         "merge_lse32": merged["merge_lse32"][i], "merge_lse64": merged["merge_lse64"][i]})
    return rows


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (errors in scientific notation)."""
    lines = ["| scores ~ | P | one call (floor) | merge, fp32 lse | merge, fp64 lse |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['magnitude']:g} | {r['P']} | {r['one_call']:.1e} | {r['merge_lse32']:.1e} "
                     f"| {r['merge_lse64']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=ops.BACKENDS, default="torch",
                        help="torch, or triton (on a GPU; on CPU only with TRITON_INTERPRET=1 set)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=512, help="keys per row, at least 8 (default 512)")
    parser.add_argument("--out", type=Path, default=None, help="directory for precision.json")
    args = parser.parse_args(argv)
    if args.tokens < 8:
        parser.error(f"--tokens must be at least 8 (one key per shard of the largest P), got {args.tokens}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
    try:
        ops.resolve_backend(torch.device(args.device), args.backend)
    except (RuntimeError, ValueError) as e:
        parser.error(str(e))
    rows = measure(n=args.tokens, backend=args.backend, device=args.device)
    print(markdown(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"backend": args.backend, "device": args.device, "tokens": args.tokens, "head_dim": HEAD_DIM}
        (args.out / "precision.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.out / 'precision.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
