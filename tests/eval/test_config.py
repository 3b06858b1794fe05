"""Run configs: YAML maps 1:1 onto frozen dataclasses; unknown keys, wrong types and bad
combinations are errors that name the key; dotted overrides go through the same checks."""

import ast
import dataclasses
import inspect
import json
import os
import textwrap

import pytest

from megatron_tree.eval import config as C
from megatron_tree.eval.config import ConfigError, RunConfig, load_config
from megatron_tree.eval.tracking import NullTracker, make_tracker, resolve_wandb_settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")


def _yaml(tmp_path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(textwrap.dedent(text))
    return str(p)


def _err(path=None, overrides=()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def test_cpu_tiny_yaml_is_exactly_the_defaults():
    # The embedded default and the shipped file must not drift apart.
    assert load_config(os.path.join(CONFIGS, "cpu_tiny.yaml")) == RunConfig()
    d = RunConfig()
    assert d.topology.intra_size == 2 and d.model.source == "megatron" and d.wandb.mode == "offline"
    assert d.model.path is None and d.topology.tp_size == 1 and d.eval.prefill_method is None
    # A random transformers Llama is one CONFIG= away and otherwise the same run.
    llama = load_config(os.path.join(CONFIGS, "cpu_tiny_llama.yaml"))
    assert llama.model.source == "random" and llama.eval.prefill_method == "ring"
    assert llama.model.__class__(**{**vars(llama.model), "source": "megatron"}) == d.model
    assert llama.topology == d.topology and llama.wandb == d.wandb
    assert llama.eval.__class__(**{**vars(llama.eval), "prefill_method": None}) == d.eval


def test_shipped_configs_load_with_the_intended_topology():
    one = load_config(os.path.join(CONFIGS, "llama31_8b_1node.yaml"))
    many = load_config(os.path.join(CONFIGS, "llama31_8b_16nodes.yaml"))
    qwen = load_config(os.path.join(CONFIGS, "qwen3_8b_hf_1node.yaml"))
    assert qwen.model.source == "hf" and qwen.eval.engine == "static"  # transformers' own Qwen3 class
    for cfg in (one, many, qwen):
        assert cfg.model.source == "hf" and cfg.model.dtype == "bfloat16"  # transformers' own classes
        assert cfg.topology.intra_size is None  # tiers come from the launcher
        assert cfg.eval.exactness.max_context is not None
    assert max(many.eval.context_lengths) > max(one.eval.context_lengths)
    assert many.eval.allow_beyond_max_position and not one.eval.allow_beyond_max_position


def test_unknown_key_names_its_path(tmp_path):
    msg = _err(_yaml(tmp_path, """
        eval:
          exactness:
            sample_rat: 0.5
    """))
    assert "eval.exactness.sample_rat" in msg and "sample_rate" in msg
    assert "'topologyy'" in _err(_yaml(tmp_path, "topologyy: {}\n"))


@pytest.mark.parametrize("text, path, expected", [
    ("eval: {decode_steps: four}", "eval.decode_steps", "an integer"),
    ("eval: {decode_steps: true}", "eval.decode_steps", "an integer"),
    ("eval: {context_lengths: 256}", "eval.context_lengths", "a list of an integer"),
    ("eval: {context_lengths: [256, x]}", "eval.context_lengths[1]", "an integer"),
    ("eval: {strategies: [tree]}", "eval.strategies[0]", "'two_level'"),
    ("model: {dtype: fp8}", "model.dtype", "'bfloat16'"),
    ("wandb: {enabled: 1}", "wandb.enabled", "true/false"),
    ("topology: {intra_size: 2.5}", "topology.intra_size", "an integer or null"),
    ("model: {rms_norm_eps: tiny}", "model.rms_norm_eps", "a number"),
    ("eval: 3", "eval", "a mapping (EvalConfig)"),
])
def test_wrong_type_names_path_and_expected_type(tmp_path, text, path, expected):
    msg = _err(_yaml(tmp_path, text + "\n"))
    assert msg.startswith(path + ":"), msg
    assert expected in msg, msg


def test_values_are_read_not_guessed(tmp_path):
    cfg = load_config(_yaml(tmp_path, """
        model: {source: random, rms_norm_eps: 1e-6, rope_scaling: {rope_type: llama3, factor: 8.0}}
        topology: {timeout_s: 30}
        eval: {context_lengths: [64, 128]}
    """))
    assert cfg.model.rms_norm_eps == 1e-6  # YAML 1.1 reads "1e-6" as a string
    assert isinstance(cfg.topology.timeout_s, float) and cfg.topology.timeout_s == 30.0
    assert cfg.eval.context_lengths == (64, 128)  # tuples: the config is hashable and frozen
    assert cfg.model.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eval.decode_steps = 3


@pytest.mark.parametrize("overrides, fragment", [
    (["topology.cp_size=4", "topology.intra_size=3"], "topology.intra_size: 3 does not factor cp_size 4"),
    (["eval.exactness.sample_rate=1.5"], "eval.exactness.sample_rate: must be in [0, 1]"),
    (["eval.context_lengths=[]"], "eval.context_lengths: must not be empty"),
    (["eval.batch_sizes=[0]"], "eval.batch_sizes: must be positive"),
    (["model.source=hf"], "model.path: source 'hf' needs a checkpoint directory"),
    (["model.source=llama"], "model.source: 'llama' (the library's own Llama) was retired; use model.source=hf"),
    (["model.source=random", "eval.engine=dynamic"], "eval.engine: 'dynamic' is Megatron-Core's DynamicInferenceEngine"),
    (["model.rope_scaling={rope_type: linear, factor: 2.0}"], "model.rope_scaling: not supported for source 'megatron'"),
    (["topology.tp_size=0"], "topology.tp_size: must be a positive integer"),
    (["model.num_key_value_heads=3"], "model.num_key_value_heads: 3 does not divide"),
    (["eval.decode_steps=0"], "eval.decode_steps: must be a positive integer"),
    (["eval.warmup_steps=-1"], "eval.warmup_steps: must be >= 0"),
    (["eval.exactness.tolerance=-1e-3"], "eval.exactness.tolerance: must be >= 0"),
    (["eval.exactness.max_context=0"], "eval.exactness.max_context: must be a positive integer"),
    (["eval.passkey.context_lengths=[64, 0]"], "eval.passkey.context_lengths: must be positive"),
    (["topology.timeout_s=0"], "topology.timeout_s: must be positive"),
    (["topology.timeout_s=.nan"], "topology.timeout_s: must be positive (a finite number of seconds), got nan"),
    (["topology.timeout_s=inf"], "topology.timeout_s: must be positive (a finite number of seconds), got inf"),
    (["topology.timeout_s=1e300"], "topology.timeout_s: must be positive (a finite number of seconds), got 1e+300"),
    (["topology.transport=tcp"], "topology.transport: must be one of ['auto', 'backend', 'shm'], got 'tcp'"),
    (["topology.transport=shm"], "topology.transport: 'shm' needs model.source hf or random"),
    (["model.compile_step=true"], "model.compile_step: True compiles a transformers model's decode steps"),
    (["model.source=random", "model.compile_step=aot_eager"], "cannot run eval.strategies' 'shifted'"),
    (["model.source=random", "model.compile_step=true", "eval.strategies=[packed]", "eval.warmup_steps=0"],
     "eval.warmup_steps: 0 with model.compile_step True would time"),
    (["model.source=random", "model.compile_step=fast", "eval.strategies=[packed]"],
     "model.compile_step: expected"),
])
def test_combinations_that_cannot_run(overrides, fragment):
    assert fragment in _err(None, overrides)


def test_overrides_nested_lists_null_and_unknown():
    cfg = load_config(None, ["eval.context_lengths=[32, 64]", "topology.intra_size=null",
                             "eval.exactness.enabled=false", "wandb.tags=[a, b]", "name=x=y",
                             "model.path=/some/dir"])
    assert cfg.eval.context_lengths == (32, 64) and cfg.topology.intra_size is None
    assert not cfg.eval.exactness.enabled and cfg.wandb.tags == ("a", "b")
    assert cfg.name == "x=y" and cfg.model.path == "/some/dir"
    assert cfg.eval.decode_steps == RunConfig().eval.decode_steps  # untouched keys keep defaults
    assert "'eval.exactnes'" in _err(None, ["eval.exactnes.enabled=false"])
    assert "expected key=value" in _err(None, ["eval.decode_steps"])
    assert "has no sub-keys" in _err(None, ["eval.decode_steps.x=1"])
    assert "eval.decode_steps: expected an integer" in _err(None, ["eval.decode_steps=4.5"])


def test_a_mapping_given_to_a_section_changes_only_the_keys_it_names():
    """eval.exactness={tolerance: 0.7} on the 8B config must keep the YAML's sample_rate 0.25, max_context 8192
    (its reference materialises (batch, seq, vocab) logits: null meant a 124K-token reference) and
    fail_on_mismatch false; before, the mapping replaced the section and silently reset them to the defaults."""
    yaml_path = os.path.join(ROOT, "configs", "llama31_8b_1node.yaml")
    base = load_config(yaml_path).eval.exactness
    for override in ["eval.exactness={tolerance: 0.7}", "eval={exactness: {tolerance: 0.7}}"]:
        ex = load_config(yaml_path, [override]).eval.exactness
        assert ex == dataclasses.replace(base, tolerance=0.7), (override, ex)
    assert load_config(yaml_path, ["eval.exactness={}"]).eval.exactness == base
    assert load_config(yaml_path, ["eval={context_lengths: [64]}"]).eval.passkey == load_config(yaml_path).eval.passkey
    assert "unknown key 'eval.exactness.foo'" in _err(yaml_path, ["eval.exactness={tolerance: 0.7, foo: 1}"])
    # null given to a section would reset all of it (the YAML's keys too) to the defaults: refused, naming it
    for override in ["eval.exactness=null", "eval={exactness: null}"]:
        assert "eval.exactness=null: eval.exactness is a section of settings" in _err(yaml_path, [override])
    # a mapping-valued field that is not a section is still one value
    rope = load_config(None, ["model.source=random", "model.rope_scaling={rope_type: linear, factor: 2.0}"])
    assert rope.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_a_config_path_given_as_an_override_says_where_it_goes():
    """``python -m megatron_tree.eval configs/x.yaml key=value`` (the path without --config) names --config."""
    msg = _err(None, ["configs/cpu_tiny.yaml", "eval.decode_steps=2"])
    assert "override 'configs/cpu_tiny.yaml': expected key=value" in msg
    assert msg.endswith("a config file goes after --config: --config configs/cpu_tiny.yaml")
    assert "--config" not in _err(None, ["decode_steps"])  # another token without '=' gets no such hint


def test_an_empty_output_dir_is_refused():
    """output_dir=$OUT with OUT unset reads as ''; it put results.json, the plot and wandb's folder into the
    current directory (the repository root under launch/*.sh), and rank 0 deleted a results.json found there."""
    for value in ("output_dir=", "output_dir=' '"):
        assert "output_dir: must not be empty" in _err(None, [value]), value
    assert load_config(None, ["output_dir=."]).output_dir == "."


def test_override_wins_over_yaml(tmp_path):
    p = _yaml(tmp_path, "eval: {decode_steps: 7, warmup_steps: 1}\n")
    cfg = load_config(p, ["eval.decode_steps=3"])
    assert (cfg.eval.decode_steps, cfg.eval.warmup_steps) == (3, 1)


def test_a_key_written_twice_is_an_error_naming_it_and_its_lines(tmp_path):
    """Plain YAML keeps the last of two equal keys silently (the first ``model:`` section would be
    gone); the config reader refuses a repeat at any depth, naming its path and both lines."""
    msg = _err(_yaml(tmp_path, """
        model:
          hidden_size: 64
        model:
          hidden_size: 32
    """))
    assert "c.yaml" in msg and "duplicate key 'model' at line 4 (first at line 2)" in msg, msg
    msg = _err(_yaml(tmp_path, """
        eval:
          decode_steps: 4
          exactness: {tolerance: 1.0e-3, tolerance: 1.0e-2}
          decode_steps: 5
    """))
    assert "duplicate key 'eval.exactness.tolerance' at line 4 (first at line 4)" in msg, msg
    assert "duplicate key 'eval.decode_steps'" in _err(_yaml(tmp_path, "eval:\n  decode_steps: 4\n  decode_steps: 5\n"))
    assert "duplicate key 'eval.strategies[0].x'" in _err(_yaml(tmp_path, "eval: {strategies: [{x: 1, x: 2}]}\n"))
    # an override's value is read by the same rules
    assert "override 'model.rope_scaling={factor: 2.0, factor: 4.0}': duplicate key 'factor'" in _err(
        None, ["model.rope_scaling={factor: 2.0, factor: 4.0}"])
    # merge keys still override, as YAML means them to
    cfg = load_config(_yaml(tmp_path, """
        eval:
          <<: {decode_steps: 7, warmup_steps: 1}
          decode_steps: 3
    """))
    assert (cfg.eval.decode_steps, cfg.eval.warmup_steps) == (3, 1)


def test_missing_or_malformed_file(tmp_path):
    assert "does not exist" in _err(str(tmp_path / "nope.yaml"))
    assert "expected a mapping at the top level" in _err(_yaml(tmp_path, "- a\n- b\n"))
    assert "not valid YAML" in _err(_yaml(tmp_path, "eval: {a: [\n"))


def test_round_trip_through_plain_data():
    cfg = load_config(None, ["eval.strategies=[packed]", "model.source=random", "model.rope_scaling={rope_type: linear, factor: 2.0}"])
    data = C.to_dict(cfg)
    json.dumps(data)  # plain data only
    assert C.from_dict(RunConfig, data) == cfg


def test_every_field_has_a_docstring_and_choices_are_literals():
    classes = [obj for _, obj in inspect.getmembers(C, inspect.isclass)
               if dataclasses.is_dataclass(obj) and obj.__module__ == C.__name__]
    assert len(classes) >= 9
    tree = ast.parse(inspect.getsource(C))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(node.name == c.__name__ for c in classes):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                        f"{node.name}.{stmt.target.id} has no docstring"
    for cls in classes:
        assert cls.__dataclass_params__.frozen, cls


# ----------------------------------------------------------------------------- wandb settings


def test_ds_config_fills_only_what_yaml_leaves_open(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 1,
                              "wandb": {"enabled": True, "project": "ds-proj", "team": "ds-team", "group": "g1"}}))
    cfg = load_config(None, [f"wandb.ds_config={ds}", "wandb.project=yaml-proj"]).wandb
    s = resolve_wandb_settings(cfg, "run")
    assert (s["project"], s["entity"], s["group"], s["name"]) == ("yaml-proj", "ds-team", "g1", "run")
    ds.write_text(json.dumps({"wandb": {"enabled": False}}))
    assert not resolve_wandb_settings(cfg, "run")["enabled"]
    assert resolve_wandb_settings(RunConfig().wandb, "r")["project"] == "megatron-tree"
    ds.write_text("{not json")
    with pytest.raises(ConfigError, match="wandb.ds_config"):
        resolve_wandb_settings(cfg, "run")
    ds.write_text(json.dumps({"wandb": {"entity": "x"}}))  # DeepSpeed's name is team
    with pytest.raises(ConfigError, match=r"wandb.ds_config: .*unknown key.*'entity'"):
        resolve_wandb_settings(cfg, "run")


@pytest.mark.parametrize("ds", [{}, {"wandb": {}}, {"wandb": {"project": "p"}}, {"wandb": {"enabled": True}},
                                {"wandb": {"enabled": False, "team": "t"}}])
def test_the_eval_reads_a_ds_config_wandb_section_as_deepspeed_does(tmp_path, ds):
    """One reader of the section (integrations.deepspeed.wandb_settings): a section without
    ``enabled`` is off for the eval as it is for DeepSpeed, and its project default is DeepSpeed's."""
    from megatron_tree.integrations.deepspeed import wandb_settings

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    got = resolve_wandb_settings(load_config(None, [f"wandb.ds_config={path}"]).wandb, "run")
    theirs = wandb_settings(ds)
    assert (got["enabled"], got["project"], got["entity"], got["group"]) == \
        (theirs.enabled, theirs.project, theirs.entity, theirs.group)
    assert got["enabled"] == (ds.get("wandb", {}).get("enabled") is True)


@pytest.mark.parametrize("var, value", [("WANDB_MODE", "disabled"), ("WANDB_MODE", "Disabled"),
                                        ("WANDB_DISABLED", "true"), ("WANDB_DISABLED", "1")])
def test_wandb_switched_off_in_the_environment_wins_over_the_yaml(tmp_path, monkeypatch, var, value):
    """``WANDB_MODE=disabled`` (wandb's own switch, also transformers') or ``WANDB_DISABLED=true``: no run and no
    files on rank 0, whatever the YAML's wandb.enabled/mode say, and the summary says why; before, the eval set
    WANDB_MODE to the YAML's ``offline`` and wrote a run. (An inherited ``WANDB_MODE=online`` does not beat the
    YAML's offline: the next test.)"""
    from megatron_tree.eval import report
    from megatron_tree.eval.tracking import env_disabled

    monkeypatch.setenv(var, value)
    cfg = load_config(None, []).wandb
    assert cfg.enabled and cfg.mode == "offline"
    assert resolve_wandb_settings(cfg, "run")["enabled"] is False
    t = make_tracker(cfg, rank=0, output_dir=str(tmp_path), config={}, default_name="x")
    assert isinstance(t, NullTracker) and list(tmp_path.iterdir()) == []
    assert env_disabled() == f"{var}={value}"
    assert report.wandb_line(None, "offline") == f"wandb:   disabled ({var}={value} in the environment)"
    assert report.wandb_record(None, "offline") == {"enabled": False, "mode": "disabled", "run_dir": None,
                                                    "disabled_by": f"{var}={value}"}
    for other in ({"WANDB_MODE": "offline"}, {"WANDB_MODE": "online"}, {"WANDB_DISABLED": "false"}, {}):
        assert env_disabled(other) is None, other


def test_an_inherited_wandb_mode_online_does_not_beat_the_yamls_offline(tmp_path, monkeypatch):
    """The YAML's ``mode: offline`` (the default) stays offline under a shell's ``WANDB_MODE=online``: a run
    written under the output directory, nothing sent."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    t = make_tracker(load_config(None, []).wandb, rank=0, output_dir=str(tmp_path), config={}, default_name="x")
    try:
        assert os.environ["WANDB_MODE"] == "offline" and t.run.settings.mode == "offline"
        assert t.run_dir.startswith(str(tmp_path.resolve() / "wandb"))
    finally:
        t.finish()
    assert any(f.startswith("run-") and f.endswith(".wandb") for f in os.listdir(t.run_dir))


def test_ranks_other_than_zero_get_a_silent_tracker(tmp_path):
    t = make_tracker(RunConfig().wandb, rank=1, output_dir=str(tmp_path), config={}, default_name="x")
    assert isinstance(t, NullTracker) and t.run_dir is None
    t.log({"a": 1}, step=0)
    t.table("t", ["a"], [[1]])
    t.summary({"a": 1})
    t.finish()
    assert list(tmp_path.iterdir()) == []  # nothing written by a non-zero rank
    off = load_config(None, ["wandb.enabled=false"]).wandb
    assert isinstance(make_tracker(off, rank=0, output_dir=str(tmp_path), config={}, default_name="x"), NullTracker)
