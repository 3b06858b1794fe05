"""``benchmarks.launch_overhead`` times the GPU path's host parts on CPU: the GPU's launches (split counts of an
H200's wave), every part measured, and the kernel launch and wave lookup it stubs put back afterwards."""

from __future__ import annotations

import json

from benchmarks import launch_overhead


def test_the_parts_of_an_eager_gpu_calls_host_time_are_measured_and_the_stubs_undone(tmp_path):
    from megatron_tree.ops.triton import flash_decode as fd
    from megatron_tree.ops.triton import merge as mk

    from megatron_tree.ops import dispatch

    run, waves, moded = mk.Launch.run, fd.waves, dispatch._moded
    out = tmp_path / "lo.json"
    result = launch_overhead.main(["--rounds", "1", "--reps", "2", "--warmup", "1", "--out", str(out)])
    assert (mk.Launch.run, fd.waves, dispatch._moded) == (run, waves, moded)
    assert result["cuda_path"] == "direct"  # plain CUDA tensors skip the op boundary in eager calls
    assert {r["shape"]: r["launches"] for r in result["rows"]} == \
        {"llama8b_32k": 2, "llama8b_b8_4k": 2, "llama8b_b64_4k": 1}  # split + merge where the grid is small
    for r in result["rows"]:
        t = {k: v["median_us"] for k, v in r["times"].items()}
        assert all(v > 0 for v in t.values()), t
        assert r["flash_decode_total_us"] == t["flash_decode_direct"] + t["flash_decode_triton_binder"]
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    md = out.with_suffix(".md").read_text()
    assert "| flash_decode B 1, 32/8, D 128, N 32768 | 2 |" in md and "takes the **direct path**" in md
