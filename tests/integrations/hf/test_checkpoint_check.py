"""The checkpoint check every transformers loader runs (``integrations.hf.checkpoint``), on real files.

Every checkpoint here is written by a real transformers ``LlamaForCausalLM`` (``save_pretrained``)
into ``tmp_path``, then broken the way a user's copy breaks: a missing directory or
``config.json``, a config that is not JSON or names no model type, a truncated or random-bytes
``model.safetensors``, a weight missing (``model.norm.weight``: transformers alone re-initialises
it to ones), a tensor the model has no place for, a tensor of another shape, an index naming a
file that is not there. Each must be a ``CheckpointError`` from ``mt.hf.load_hf_model`` naming the
file or tensor and what is wrong; the good checkpoint must load to the very weights and logits of
the model that saved it. The 2-rank test: only rank 1's directory is bad, and both ranks raise the
same error within a bound.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from tests.helpers.ranks import outcome, run_ranks

NORM = 3.0
"""``model.norm.weight``'s saved value: a re-initialised one (ones) would show in the logits."""


def _llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie))
    with torch.no_grad():
        model.model.norm.weight.fill_(NORM)
    return model.eval()


def _save(path, tie: bool = False, **kwargs):
    model = _llama(tie)
    model.save_pretrained(str(path), **kwargs)
    return model


def _rewrite(src, dst, edit):
    """A copy of checkpoint ``src`` whose model.safetensors went through ``edit(tensors)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good")
    return path, _save(path)


def _error(path) -> str:
    from megatron_tree.integrations.hf import CheckpointError, load_hf_model

    with pytest.raises(CheckpointError) as e:
        load_hf_model(path, None)
    return str(e.value)


def test_good_checkpoint_loads_the_saved_weights_and_logits(good):
    from megatron_tree.integrations.hf import load_hf_model

    path, saved = good
    lm = load_hf_model(path, None)
    state = lm.hf.state_dict()
    assert all(torch.equal(state[n], t) for n, t in saved.state_dict().items())
    assert float(state["model.norm.weight"][0]) == NORM
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = saved(ids).logits
        assert torch.equal(lm.unsharded()(input_ids=ids).logits, want)  # the same class and attention: bit for bit
        torch.testing.assert_close(lm.hf(ids, use_cache=False).logits, want, rtol=0, atol=5e-5)  # tree attention
    assert load_hf_model(path, None, dtype="bfloat16").hf.dtype == torch.bfloat16  # a dtype's name, as transformers
    for bad in ("bf16", torch.int8, 16):
        with pytest.raises(TypeError, match=r"load_hf_model: dtype must be a floating-point torch.dtype or its name"):
            load_hf_model(path, None, dtype=bad)


def test_tied_embeddings_and_transformers_ignored_keys_are_not_reported(tmp_path):
    from megatron_tree.integrations.hf import check_checkpoint, load_hf_model

    saved = _save(tmp_path / "tied", tie=True)
    assert "lm_head.weight" not in check_checkpoint(tmp_path / "tied").tensors  # absent from the file: tied
    lm = load_hf_model(tmp_path / "tied", None)
    assert lm.hf.lm_head.weight.data_ptr() == lm.hf.model.embed_tokens.weight.data_ptr()
    assert torch.equal(lm.hf.lm_head.weight, saved.model.embed_tokens.weight)

    def old_rotary(t):  # older checkpoints stored RoPE's inv_freq per layer; transformers ignores it
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)

    _rewrite(tmp_path / "tied", tmp_path / "inv_freq", old_rotary)
    check_checkpoint(tmp_path / "inv_freq")


def test_missing_directory_is_named_not_a_hub_repo_id(tmp_path):
    msg = _error(tmp_path / "nowhere")
    assert f"checkpoint directory '{tmp_path / 'nowhere'}' does not exist" in msg, msg
    assert "repo id" not in msg.lower().replace("repository ids are not downloaded", ""), msg


@pytest.mark.parametrize("case,content,needles", [
    ("missing", None, ["has no config.json"]),
    ("not_json", b'{"model_type": "llama",', ["config.json is not valid JSON", "line 1"]),
    ("not_object", b"[1, 2]", ["config.json must hold a JSON object, got list"]),
    ("no_model_type", b'{"vocab_size": 32}', ["config.json has no 'model_type'", "got None"]),
])
def test_bad_config_json_is_named(good, tmp_path, case, content, needles):
    path = tmp_path / case
    shutil.copytree(good[0], path)
    if content is None:
        os.remove(path / "config.json")
    else:
        (path / "config.json").write_bytes(content)
    msg = _error(path)
    for needle in needles:
        assert needle in msg, msg
    assert str(path) in msg and "model_type key" not in msg, msg


def test_truncated_and_random_bytes_safetensors_name_the_file(good, tmp_path):
    blob = (good[0] / "model.safetensors").read_bytes()
    (n,) = __import__("struct").unpack("<Q", blob[:8])
    for name, content, needles in [
        ("truncated", blob[:-100], [f"model.safetensors is truncated: its tensors end at byte {len(blob)}, "
                                    f"the file has {len(blob) - 100}"]),
        ("header_cut", blob[: 8 + n // 2], ["model.safetensors announces a", "not a safetensors file, or truncated"]),
        ("random", torch.randint(0, 256, (len(blob),), generator=torch.Generator().manual_seed(3),
                                 dtype=torch.uint8).numpy().tobytes(),
         ["model.safetensors announces a", "-byte header but the file has"]),
        ("empty", b"", ["model.safetensors is 0 bytes, too short for a safetensors header"]),
        ("trailing", blob + b"\0" * 7, ["model.safetensors has 7 bytes after its last tensor"]),
    ]:
        path = tmp_path / name
        shutil.copytree(good[0], path)
        (path / "model.safetensors").write_bytes(content)
        msg = _error(path)
        for needle in needles:
            assert needle in msg, (name, msg)
        assert str(path / "model.safetensors") in msg, (name, msg)


def test_unsupported_dtype_is_named(good, tmp_path):
    blob = bytearray((good[0] / "model.safetensors").read_bytes())
    (n,) = __import__("struct").unpack("<Q", bytes(blob[:8]))
    header = json.loads(bytes(blob[8:8 + n]))
    header["model.norm.weight"]["dtype"] = "F4"  # a dtype torch cannot hold; same byte count kept below
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    path = tmp_path / "f4"
    shutil.copytree(good[0], path)
    (path / "model.safetensors").write_bytes(bytes(blob[:8]) + text + bytes(blob[8 + n:]))
    msg = _error(path)
    assert "tensor 'model.norm.weight' has dtype 'F4', which torch" in msg and "'F32'" in msg, msg


def test_missing_norm_weight_is_an_error_not_a_reinitialised_one(good, tmp_path):
    path = _rewrite(good[0], tmp_path / "no_norm", lambda t: t.pop("model.norm.weight"))
    msg = _error(path)
    assert f"'{path}' holds no tensor for 1 weight(s) of LlamaForCausalLM" in msg, msg
    assert "re-initialise" in msg and "model.norm.weight [16]" in msg, msg


def test_unexpected_tensor_is_named(good, tmp_path):
    def add(t):
        t["model.layers.1.mlp.extra_proj.weight"] = torch.zeros(4, 16)

    msg = _error(_rewrite(good[0], tmp_path / "extra", add))
    assert "holds 1 tensor(s) that LlamaForCausalLM" in msg and "has no weight for" in msg, msg
    assert "model.layers.1.mlp.extra_proj.weight [4, 16] in model.safetensors" in msg, msg


def test_misshapen_tensor_names_both_shapes(good, tmp_path):
    def misshape(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(24, 16)

    path = _rewrite(good[0], tmp_path / "shape", misshape)
    msg = _error(path)
    assert f"the tensors disagree with {path / 'config.json'} (1 of other shapes)" in msg, msg
    assert "model.layers.0.mlp.up_proj.weight is [24, 16] in model.safetensors, config.json gives [32, 16]" in msg


def test_every_problem_is_listed(good, tmp_path):
    def several(t):
        t.pop("model.norm.weight")
        t["model.embed_tokens.weight"] = torch.zeros(33, 16)
        t["stray"] = torch.zeros(1)

    msg = _error(_rewrite(good[0], tmp_path / "several", several))
    assert msg.startswith("3 problems with the checkpoint"), msg
    assert "(1) the tensors disagree" in msg and "(2) " in msg and "(3) " in msg, msg
    assert "model.norm.weight [16]" in msg and "stray [1]" in msg and "is [33, 16]" in msg, msg


def test_sharded_checkpoint_with_an_index_naming_a_missing_file(tmp_path):
    from megatron_tree.integrations.hf import check_checkpoint

    path = tmp_path / "sharded"
    saved = _save(path, max_shard_size="2KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) > 1
    assert set(check_checkpoint(path).tensors) == set(saved.state_dict())  # the good sharded one passes
    held = sorted(k for k, v in index.items() if v == files[-1])
    os.remove(path / files[-1])
    msg = _error(path)
    assert f"model.safetensors.index.json names {files[-1]}, which is not in {path}" in msg, msg
    assert f"it should hold {len(held)} tensors: {held[0]}" in msg, msg
    assert "problems with" not in msg, msg  # its tensors are not also listed as missing weights


def test_the_check_reads_no_tensor(good, monkeypatch):
    """Headers and config only: the check passes with safetensors' tensor reading made impossible."""
    import safetensors

    from megatron_tree.integrations.hf import check_checkpoint

    def no_loading(*a, **k):
        raise AssertionError("the check must not load tensors")

    monkeypatch.setattr(safetensors, "safe_open", no_loading)
    start = time.monotonic()
    checked = check_checkpoint(good[0])
    assert checked.model_class.__name__ == "LlamaForCausalLM" and len(checked.tensors) == 21
    assert time.monotonic() - start < 10


# --------------------------------------------------------------------------- two ranks, one bad directory

BOUND_S = 20.0
"""Both ranks raise within this many seconds of calling load_hf_model (the group's timeout is 60 s)."""


def _one_bad_rank(rank, world, good_path, bad_path):
    import megatron_tree as mt
    from megatron_tree.integrations.hf import load_hf_model

    groups = mt.TreeGroups.build(timeout=60)
    path = bad_path if rank == 1 else good_path
    kind, message, seconds = outcome(lambda: load_hf_model(path, groups))
    # the group is still in step afterwards: the same good checkpoint loads on both ranks
    ok = load_hf_model(good_path, groups).vocab_size
    return kind, message, seconds, ok


def test_one_ranks_bad_checkpoint_is_every_ranks_error(good, tmp_path):
    bad = _rewrite(good[0], tmp_path / "bad_on_rank1", lambda t: t.pop("model.norm.weight"))
    results = run_ranks(_one_bad_rank, 2, str(good[0]), str(bad), timeout=180, pg_timeout=60)
    kinds = {r[0] for r in results}
    messages = {r[1] for r in results}
    assert kinds == {"CheckpointError"}, results
    assert len(messages) == 1, results  # the same text on both ranks
    (message,) = messages
    assert message.startswith("rank 1: ") and "model.norm.weight [16]" in message, message
    assert all(r[2] < BOUND_S for r in results), [r[2] for r in results]
    assert [r[3] for r in results] == [32, 32]


def test_integer_tensor_for_a_floating_weight_is_refused(good, tmp_path):
    """A floating weight saved as int32 (from_pretrained would cast it: the bit pattern of small floats
    becomes zeros) is an error naming the tensor and its dtype, not a silently zeroed projection."""
    name = "model.layers.0.self_attn.q_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name].view(torch.int32)

    path = _rewrite(good[0], tmp_path / "int32", edit)
    msg = _error(path)
    assert f"hold integers where" in msg and f"{name} is I32 in model.safetensors" in msg, msg


# --------------------------------------------------------------------------- the messages name the right thing


def _header(blob: bytes) -> tuple[int, dict]:
    (n,) = __import__("struct").unpack("<Q", blob[:8])
    return n, json.loads(blob[8:8 + n])


def _rewrite_header(src, dst, edit):
    """A copy of checkpoint ``src`` whose model.safetensors header went through ``edit(header)`` (the
    header's byte length kept: the new JSON padded with spaces); returns the old header."""
    blob = (src / "model.safetensors").read_bytes()
    n, header = _header(blob)
    old = json.loads(json.dumps(header))
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    shutil.copytree(src, dst)
    (dst / "model.safetensors").write_bytes(blob[:8] + text + b" " * (n - len(text)) + blob[8 + n:])
    return old


GATE, UP, NEXT = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                  "model.layers.0.post_attention_layernorm.weight")
"""Two [32, 16] weights saved one after the other, and the tensor after them (safetensors orders by name)."""


def test_tensors_sharing_bytes_are_both_named_with_their_spans(good, tmp_path):
    """One tensor's offsets point at another's bytes: the error names those two tensors and both
    byte spans -- not the tensor after them, and not only one of the pair."""
    def share(header):
        header[UP]["data_offsets"] = list(header[GATE]["data_offsets"])  # up_proj now reads gate_proj's bytes

    old = _rewrite_header(good[0], tmp_path / "shared", share)
    assert old[UP]["data_offsets"][0] == old[GATE]["data_offsets"][1] == old[NEXT]["data_offsets"][0] - 2048
    lo, hi = old[GATE]["data_offsets"]
    msg = _error(tmp_path / "shared")
    assert (f"tensors {GATE!r} (data bytes {lo}..{hi}) and {UP!r} (data bytes {lo}..{hi}) share bytes {lo}..{hi}; "
            "expected each tensor's bytes to be its own") in msg, msg
    assert repr(NEXT) not in msg, msg  # the tensor after them is not blamed


def test_a_gap_in_the_data_names_the_tensor_before_it(good, tmp_path):
    norm, after = "model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight"

    def shrink(header):  # input_layernorm keeps 15 of its 16 floats: 4 bytes nobody owns
        begin, end = header[norm]["data_offsets"]
        header[norm].update(shape=[15], data_offsets=[begin, end - 4])

    old = _rewrite_header(good[0], tmp_path / "gap", shrink)
    begin, end = old[norm]["data_offsets"]
    assert old[after]["data_offsets"][0] == end
    msg = _error(tmp_path / "gap")
    assert (f"tensor {after!r} starts at data byte {end}, expected {end - 4} (right after tensor {norm!r} (data "
            f"bytes {begin}..{end - 4})): a gap of 4 bytes") in msg, msg


def test_weights_file_that_is_a_directory_is_named_as_one(good, tmp_path):
    path = tmp_path / "dir_weights"
    shutil.copytree(good[0], path)
    os.remove(path / "model.safetensors")
    os.mkdir(path / "model.safetensors")
    assert _error(path) == f"{path / 'model.safetensors'} is a directory, expected a safetensors file"


def test_tensor_in_two_shards_names_the_folder_and_both_files(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "twice"
    _save(path, max_shard_size="2KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(index.values()))
    assert len(files) > 1
    name = sorted(k for k, v in index.items() if v == files[0])[0]
    last = load_file(str(path / files[-1]))
    last[name] = load_file(str(path / files[0]))[name]  # the same tensor saved in a second shard too
    save_file(last, str(path / files[-1]), metadata={"format": "pt"})
    msg = _error(path)
    assert (f"tensor {name!r} is in two weight files of {str(path)!r}: {files[0]} and {files[-1]}; expected it in "
            f"exactly one (the index places it in {files[0]})") in msg, msg


def _every_rank_bad(rank, world, paths):
    import megatron_tree as mt
    from megatron_tree.integrations.hf import load_hf_model

    groups = mt.TreeGroups.build(timeout=60)
    return outcome(lambda: load_hf_model(paths[rank], groups))


def test_every_ranks_bad_checkpoint_is_one_error_naming_each_rank(good, tmp_path):
    """Each rank's own copy broken in its own way: every rank raises the same text, each rank's problem
    named with its rank (not each rank its own error, which a launcher would show as ranks disagreeing)."""
    no_config = tmp_path / "no_config"
    shutil.copytree(good[0], no_config)
    os.remove(no_config / "config.json")
    truncated = tmp_path / "truncated"
    shutil.copytree(good[0], truncated)
    os.truncate(truncated / "model.safetensors", 1000)
    results = run_ranks(_every_rank_bad, 2, [str(no_config), str(truncated)], timeout=180, pg_timeout=60)
    assert {r[0] for r in results} == {"CheckpointError"}, results
    assert len({r[1] for r in results}) == 1, results
    message = results[0][1]
    assert message.startswith(f"rank 0: '{no_config}' has no config.json"), message
    assert f"rank 1: {truncated / 'model.safetensors'} announces a" in message or \
        f"rank 1: {truncated / 'model.safetensors'} is truncated" in message, message
    assert all(r[2] < BOUND_S for r in results), [r[2] for r in results]
