"""``benchmarks.launch_overhead`` times the GPU path's host parts on CPU: the GPU's launches (split counts of an
H200's wave), every part measured, and the kernel launch and wave lookup it stubs put back afterwards."""

from __future__ import annotations

import collections
import json
import os

import torch

from benchmarks import launch_overhead


def test_the_parts_of_an_eager_gpu_calls_host_time_are_measured_and_the_stubs_undone(tmp_path):
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    from megatron_tree.ops import dispatch

    run, waves, moded = mk.Launch.run, fd.waves, dispatch._moded
    out = tmp_path / "lo.json"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = launch_overhead.main(["--rounds", "1", "--reps", "2", "--warmup", "1", "--out", str(out)])
    # the *_via_op calls, and only they, go through the op: (1 warmup + 1 round x 2 reps) x 3 shapes each
    ops = collections.Counter(e.name for e in prof.events() if e.name.startswith("megatron_tree::"))
    assert ops == {"megatron_tree::flash_decode": 9, "megatron_tree::merge_states": 9}, ops
    assert (mk.Launch.run, fd.waves, dispatch._moded) == (run, waves, moded)
    assert result["cuda_path"] == "direct"  # plain CUDA tensors skip the op boundary in eager calls
    assert {r["shape"]: r["launches"] for r in result["rows"]} == \
        {"llama8b_32k": 2, "llama8b_b8_4k": 2, "llama8b_b64_4k": 1}  # split + merge where the grid is small
    for r in result["rows"]:
        t = {k: v["median_us"] for k, v in r["times"].items()}
        assert all(v > 0 for v in t.values()), t
        assert r["flash_decode_total_us"] == t["flash_decode_direct"] + t["flash_decode_fast_launch"]
        assert r["merge_states_total_us"] == t["merge_states_direct"] + t["merge_states_fast_launch"]
        assert r["flash_decode_total_jit_us"] == t["flash_decode_direct"] + t["flash_decode_triton_binder"]
        assert r["merge_states_total_jit_us"] == t["merge_states_direct"] + t["merge_states_triton_binder"]
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    md = out.with_suffix(".md").read_text()
    assert "| flash_decode B 1, 32/8, D 128, N 32768 | 2 |" in md and "takes the **direct path**" in md

    # --before: the earlier file's times on the path a CUDA tensor took there (as it recorded)
    before = os.path.join(os.path.dirname(launch_overhead.__file__), "results", "launch_overhead_before.json")
    with open(before, encoding="utf-8") as f:
        old = json.load(f)
    result = launch_overhead.main(["--rounds", "1", "--reps", "1", "--warmup", "0", "--before", before])
    o = old["rows"][0]["times"][f"flash_decode_{old['cuda_path']}"]["median_us"]
    t = result["rows"][0]["times"]["flash_decode_direct"]["median_us"]
    assert f"| flash_decode B 1, 32/8, D 128, N 32768 | {o:.1f} -> {t:.1f} |" in launch_overhead._markdown(result)
