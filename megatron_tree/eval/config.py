"""Run configuration: frozen dataclasses that YAML files map onto one to one.

Invariant: a configuration is either fully valid or rejected here, before any process
group exists. Every key of a YAML file names a dataclass field (an unknown key is an
error naming its dotted path and the keys that exist), every value has the field's type
(a wrong type is an error naming the path and the expected type), and ``key=value``
overrides from the command line go through the same checks. Keeping every knob in one
place is what lets the launch scripts stay thin (docs/design.md, "How the code is written").

The defaults of :class:`RunConfig` are the tiny CPU eval (4 processes as 2 simulated
nodes x 2, a random-weight Megatron-Core GPTModel, wandb offline); ``configs/cpu_tiny.yaml``
spells the same values out (``configs/cpu_tiny_llama.yaml``: the same with a random transformers
``LlamaForCausalLM``, ``model.source: random``).

Only PyYAML, the standard library and the strategy names (``strategies.py``, which
imports nothing) are imported here, so a bad config is reported quickly, before torch is
even needed.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from ..comm.strategies import STRATEGIES
from ..utils import yaml_files

__all__ = [
    "ConfigError", "ModelConfig", "TopologyConfig", "DistConfig", "ExactnessConfig",
    "PasskeyConfig", "PerplexityConfig", "EvalConfig", "WandbConfig", "RunConfig",
    "load_config", "from_dict", "to_dict", "apply_overrides", "parse_overrides",
]

StrategyName = Literal[STRATEGIES]  # the names are listed once, in strategies.py


class ConfigError(ValueError):
    """A configuration key, value or combination that cannot run; the message names the key."""


_RETIRED = {
    ("ModelConfig", "source", "llama"): (
        "(the library's own Llama) was retired; use model.source=hf with the same model.path: transformers' "
        "LlamaForCausalLM reads that Hugging Face directory and runs it with tree attention "
        "(megatron_tree.integrations.hf)"
    ),
}
"""``(dataclass, field, value) -> what to use instead``: values that once ran, refused with a pointer."""


def _positive(obj, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v is not None and v < 1:
            raise ConfigError(f"{n}: must be a positive integer, got {v}")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to evaluate. The shape fields describe ``source: megatron`` and ``source: random``
    (an ``hf`` checkpoint brings its own ``config.json``)."""

    source: Literal["megatron", "random", "hf"] = "megatron"
    """``megatron``: a Megatron-Core ``GPTModel`` (Llama-style: RMSNorm, SwiGLU, no biases,
    RoPE, GQA) of the shape below, from the distributed checkpoint at ``path`` or with random
    weights when ``path`` is null; ``hf``: transformers' own model class for the checkpoint
    at ``path`` (``save_pretrained`` directory: Llama, Qwen2, Qwen3, Mistral, ...) with tree
    attention as its attention backend (``integrations.hf``); ``random``: transformers'
    ``LlamaForCausalLM`` with random weights of the shape below (seeded by ``seed``: the same
    weights on every rank), through the same backend. (``llama``, the library's own Llama, was
    retired: ``hf`` reads the same checkpoint directory.)"""
    path: str | None = None
    """``hf``: a checkpoint directory (``config.json`` + ``*.safetensors``); ``megatron``: a
    ``dist_checkpointing`` directory or a Megatron-LM ``--save`` directory (latest iteration
    from ``latest_checkpointed_iteration.txt``), loaded at the run's TP x CP layout."""
    tokenizer: str | None = None
    """``tokenizer.json`` to use; ``None`` takes ``<path>/tokenizer.json`` when it exists.
    Only passkey retrieval and perplexity need a tokenizer (random token ids otherwise)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype (CPU runs use float32: bf16 is ~10x slower there)."""
    seed: int = 0
    """Seed for random weights and random prompts (identical on every rank)."""
    vocab_size: int = 512
    """Vocabulary size (random weights)."""
    hidden_size: int = 64
    """Model width (random weights)."""
    intermediate_size: int = 128
    """SwiGLU inner width (random weights)."""
    num_hidden_layers: int = 2
    """Transformer layers (random weights)."""
    num_attention_heads: int = 4
    """Query heads (random weights)."""
    num_key_value_heads: int = 2
    """Key/value heads, a divisor of ``num_attention_heads`` (GQA; random weights)."""
    head_dim: int | None = None
    """Per-head width; ``None`` = hidden_size / num_attention_heads (random weights)."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon (random weights)."""
    rope_theta: float = 10000.0
    """RoPE base (random weights)."""
    rope_scaling: dict[str, Any] | None = None
    """Hugging Face ``rope_scaling`` dict, e.g. Llama-3 scaling (random weights)."""
    max_position_embeddings: int = 65536
    """Longest position the model is configured for (random weights)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head (random weights)."""
    initializer_range: float = 0.2
    """Std of the normal init of random weights (large enough that greedy decoding does
    not sit on near-ties, so sharded and unsharded runs pick the same tokens)."""
    compile_step: bool | Literal["auto", "aot_eager", "reduce-overhead"] = "auto"
    """Decode steps compiled whole (``enable_tree_attention(compile_step=)``; sources ``hf`` and
    ``random``): ``auto`` (default: captured in CUDA graphs on GPUs over NCCL, except ``shifted``'s
    steps and when ``eval.warmup_steps`` is 0; eager on CPU and over gloo), ``false`` (eager),
    ``true`` (Inductor), ``reduce-overhead`` (Inductor with CUDA graphs: the captured step, on CUDA
    devices over NCCL groups), ``aot_eager`` (Dynamo only, the eager kernels). Each (length bucket,
    batch, strategy) of the sweep is traced once, in its first warmup step (so an explicit setting
    needs ``eval.warmup_steps`` >= 1); its caches are static, sized by length bucket. An explicit
    setting does not run ``shifted`` in ``eval.strategies``."""

    def __post_init__(self):
        _positive(self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
        if self.source == "hf" and not self.path:
            raise ConfigError(f"path: source {self.source!r} needs a checkpoint directory, got none")
        if self.source == "megatron" and self.rope_scaling is not None:
            raise ConfigError("rope_scaling: not supported for source 'megatron' (plain RoPE); set it to null")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads: {self.num_key_value_heads} does not divide "
                f"num_attention_heads {self.num_attention_heads}"
            )


@dataclass(frozen=True)
class TopologyConfig:
    """How the launched ranks form tensor- and context-parallel groups and the CP reduction levels."""

    tp_size: int = 1
    """Tensor-parallel ranks per model replica (``source: megatron`` only); CP groups are
    then the ranks of equal TP rank, as Megatron-Core builds them."""
    cp_size: int | None = None
    """Ranks per CP group; ``None`` = the launched world / tp_size. A divisor of that gives
    several CP groups side by side, each running the same eval."""
    intra_size: int | None = 2
    """CP ranks per (possibly simulated) node, passed to ``TreeGroups.from_env``;
    ``None`` = the real layout from the launcher (LOCAL_WORLD_SIZE, LOCAL_SIZE,
    SLURM_NTASKS_PER_NODE)."""
    timeout_s: float = 120.0
    """Seconds a collective may wait before the run fails (a dead peer, no hang)."""
    transport: str = "auto"
    """``auto`` (shared memory where a transformers or random model's CP ranks share a host: CPU, gloo;
    the backend elsewhere), ``shm`` (the same, refused with ``source: megatron``, whose groups are
    Megatron's) or ``backend`` (``TreeGroups.build(transport=)``): on CPU the decode merges then skip
    gloo's thread hand-offs per layer."""

    def __post_init__(self):
        _positive(self, "tp_size", "cp_size", "intra_size")
        if self.transport not in ("auto", "backend", "shm"):
            raise ConfigError(f"transport: must be one of ['auto', 'backend', 'shm'], got {self.transport!r}")
        if not 0 < self.timeout_s <= 8.64e13:  # NaN fails too; 8.64e13 s: datetime.timedelta's range
            raise ConfigError(f"timeout_s: must be positive (a finite number of seconds), got {self.timeout_s}")
        if self.cp_size is not None and self.intra_size is not None and self.cp_size % self.intra_size:
            raise ConfigError(
                f"intra_size: {self.intra_size} does not factor cp_size {self.cp_size}; "
                f"expected a divisor of {self.cp_size}"
            )


@dataclass(frozen=True)
class DistConfig:
    """How torch.distributed is initialised (the launcher sets RANK/WORLD_SIZE/MASTER_*)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """``auto``: nccl when CUDA is available, else gloo."""
    init: Literal["torch", "deepspeed"] = "torch"
    """``torch``: ``init_process_group(env://)``, works under torchrun, the deepspeed
    launcher and Slurm; ``deepspeed``: ``deepspeed.init_distributed`` (compiles a
    shared-memory op with g++ the first time on a CPU machine)."""


@dataclass(frozen=True)
class ExactnessConfig:
    """Comparison of sampled decode steps against an unsharded replica of the model."""

    enabled: bool = True
    """Compare decode logits against a single-process forward over the full sequence."""
    sample_rate: float = 0.5
    """Fraction of decode steps compared (the last step is always compared when enabled)."""
    tolerance: float = 1e-3
    """Largest allowed max |delta logits| (fp32; raise it for bf16 runs)."""
    max_context: int | None = None
    """Skip the check above this context length (the reference materialises full logits)."""
    fail_on_mismatch: bool = True
    """Exit non-zero (on every rank) when a compared step exceeds ``tolerance``."""

    def __post_init__(self):
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ConfigError(f"sample_rate: must be in [0, 1], got {self.sample_rate}")
        if self.tolerance < 0:
            raise ConfigError(f"tolerance: must be >= 0, got {self.tolerance}")
        _positive(self, "max_context")


@dataclass(frozen=True)
class PasskeyConfig:
    """Passkey retrieval: a number hidden in filler text, asked for at the end (needs a tokenizer)."""

    enabled: bool = False
    """Run passkey retrieval (only with a real checkpoint and tokenizer)."""
    context_lengths: tuple[int, ...] = ()
    """Context lengths in tokens; empty = ``eval.context_lengths``."""
    trials: int = 5
    """Prompts per context length (passkey depths spread evenly over the context)."""
    new_tokens: int = 8
    """Tokens generated greedily for the answer."""

    def __post_init__(self):
        _positive(self, "trials", "new_tokens")
        if any(c < 1 for c in self.context_lengths):
            raise ConfigError(f"context_lengths: must be positive, got {list(self.context_lengths)}")


@dataclass(frozen=True)
class PerplexityConfig:
    """Perplexity of the sharded decode path on a text file (needs a tokenizer)."""

    text_file: str | None = None
    """UTF-8 text file; ``None`` = no perplexity."""
    prefix_tokens: int = 1024
    """Tokens prefilled (context-parallel) before scoring."""
    eval_tokens: int = 64
    """Following tokens scored one decode step at a time (teacher forcing)."""

    def __post_init__(self):
        _positive(self, "prefix_tokens", "eval_tokens")


@dataclass(frozen=True)
class EvalConfig:
    """The sweep: every (context length, batch size, strategy) is one run."""

    context_lengths: tuple[int, ...] = (256, 1024, 4096)
    """Prompt lengths in tokens (random ids for random weights)."""
    batch_sizes: tuple[int, ...] = (1, 2)
    """Sequences decoded together."""
    strategies: tuple[StrategyName, ...] = STRATEGIES
    """Merge strategies (docs/design.md §4), by default every one; ``auto`` is the cost model's
    pick, recorded per run; ``shifted`` runs one SUM per layer per step after the first, a step
    whose check fails is run again with ``packed`` (the dynamic engine runs it as ``packed``)."""
    decode_steps: int = 16
    """Greedy decode steps timed per run."""
    warmup_steps: int = 2
    """Untimed decode steps before the timed ones."""
    allow_beyond_max_position: bool = False
    """Allow context lengths past the model's ``max_position_embeddings`` (speed and
    exactness runs; RoPE extrapolates, answer quality is not meaningful there). For RoPE models: Megatron's
    ``GPTModel`` and transformers models (``enable_tree_attention(allow_beyond_window=True)``); a transformers
    model whose positions are a learned table (GPT-2, OPT) is refused before launch. With dynamic-NTK RoPE,
    the exactness check must stop inside the window (``exactness.max_context``): its one-forward reference
    differs there by design."""
    prefill_method: Literal["ring", "allgather"] | None = None
    """Context-parallel prefill; ``None`` = the model's own (``ring`` for transformers models, ``allgather``
    for Megatron models, whose core attention all-gathers the prompt's keys/values)."""
    engine: Literal["static", "dynamic"] = "static"
    """How a Megatron model (``model.source: megatron``) generates: ``static`` -- the library's
    decode loop over a ``TreeInferenceContext`` (a contiguous CP-sharded cache, rows prefilled
    at full length); ``dynamic`` -- Megatron-Core's ``DynamicInferenceEngine`` over the paged,
    CP-sharded KV cache (``integrations.megatron_dynamic``), every row a request. Other sources
    have the static path only."""
    cache_layout: Literal["load_balanced", "contiguous"] = "load_balanced"
    """Placement of prompt tokens on CP ranks (static engine; the paged cache of the dynamic
    engine places every token round-robin by block)."""
    block_size: int = 16
    """KV cache block (decode appends go round-robin by block); with ``engine: dynamic``, the
    paged cache's block on one rank (Megatron schedules blocks of CP x block_size tokens)."""
    exactness: ExactnessConfig = field(default_factory=ExactnessConfig)
    """Comparison against the unsharded model."""
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)
    """Passkey retrieval (real checkpoints)."""
    perplexity: PerplexityConfig = field(default_factory=PerplexityConfig)
    """Perplexity on a text file (real checkpoints)."""
    progress: bool = True
    """tqdm bars on rank 0 over the sweep and the decode steps, in a terminal session only (stdout and stderr terminals)."""
    attention_baselines: bool = True
    """After the sweep, time the decode step's attention alone at each context length and at 4x and 16x
    the longest (up to 64K): tree decode, its all-gather merge, the ring and all-gather-KV baselines
    (``eval.baselines``; the plot's right panel, the crossovers)."""
    log_all_ranks: bool = False
    """Also print every other rank's summary lines (rank 0 alone prints by default)."""

    def __post_init__(self):
        _positive(self, "decode_steps", "block_size")
        if self.warmup_steps < 0:
            raise ConfigError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        for name in ("context_lengths", "batch_sizes", "strategies"):
            if not getattr(self, name):
                raise ConfigError(f"{name}: must not be empty")
        for name in ("context_lengths", "batch_sizes"):
            if any(v < 1 for v in getattr(self, name)):
                raise ConfigError(f"{name}: must be positive integers, got {list(getattr(self, name))}")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases tracking, on rank 0 only."""

    enabled: bool = True
    """Track the run in wandb (results.json is written either way)."""
    mode: Literal["offline", "online"] = "offline"
    """``offline`` writes the run under ``<output_dir>/wandb`` and needs no account."""
    project: str | None = None
    """wandb project; ``None`` = the ds_config's (DeepSpeed's default ``deepspeed`` when its section
    names none), else ``megatron-tree``."""
    entity: str | None = None
    """wandb entity (team); ``None`` = the ds_config's ``team``, else wandb's default."""
    group: str | None = None
    """wandb group; ``None`` = the ds_config's."""
    name: str | None = None
    """Run name; ``None`` = ``<run name>-<cp size>cp``."""
    tags: tuple[str, ...] = ()
    """wandb tags."""
    ds_config: str | None = None
    """A DeepSpeed config JSON whose ``wandb`` section (project, team, group, enabled) fills the
    fields above that are left ``None``, read as DeepSpeed reads it: wandb is off unless the
    section says ``enabled: true``."""


@dataclass(frozen=True)
class RunConfig:
    """One eval invocation: model, topology, sweep and tracking."""

    name: str = "cpu_tiny"
    """Run name (wandb run name prefix, results.json ``name``)."""
    output_dir: str = "outputs/cpu_tiny"
    """Where results.json, the plot and the wandb directory go (relative to the cwd)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    """CP groups and levels."""
    dist: DistConfig = field(default_factory=DistConfig)
    """torch.distributed initialisation."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The sweep and its checks."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Tracking."""

    def __post_init__(self):
        ev = self.eval
        if not self.output_dir.strip():  # e.g. output_dir=$OUT with OUT unset: the outputs would land in the cwd
            raise ConfigError("output_dir: must not be empty (an unset shell variable in output_dir=$DIR?); an empty "
                              "path would put results.json, the plot and wandb's folder in the current directory "
                              "(the repository root under launch/*.sh); write output_dir=. to mean that")
        if self.model.compile_step not in (False, "auto"):
            if self.model.source == "megatron":
                raise ConfigError(f"model.compile_step: {self.model.compile_step!r} compiles a transformers model's "
                                  "decode steps (model.source hf or random); Megatron-Core's engines run eagerly here: "
                                  "set it to false")
            if ev.warmup_steps < 1:
                raise ConfigError(f"eval.warmup_steps: 0 with model.compile_step {self.model.compile_step!r} would time "
                                  "each (batch, strategy)'s first step with its compilation inside (a trace takes "
                                  "seconds, a step milliseconds); set eval.warmup_steps to 1 or more")
            if "shifted" in ev.strategies:
                raise ConfigError(f"model.compile_step: {self.model.compile_step!r} cannot run eval.strategies' "
                                  "'shifted' (it carries every layer's lse between steps in host state); drop shifted "
                                  "from eval.strategies, e.g. eval.strategies=[packed,two_level,allgather,auto]")
        if self.topology.transport == "shm" and self.model.source == "megatron":
            raise ConfigError("topology.transport: 'shm' needs model.source hf or random (source megatron runs on "
                              "Megatron-Core's own process groups); set it to backend")
        if ev.engine == "dynamic":
            if self.model.source != "megatron":
                raise ConfigError(
                    f"eval.engine: 'dynamic' is Megatron-Core's DynamicInferenceEngine and needs model.source "
                    f"megatron, got {self.model.source!r}; use eval.engine=static for this source"
                )
            if ev.prefill_method is not None:
                raise ConfigError(
                    f"eval.prefill_method: {ev.prefill_method!r} does not apply to eval.engine dynamic (Megatron's "
                    "engine prefills through the paged cache, chunk by chunk); set it to null"
                )
            if ev.cache_layout != "load_balanced":
                raise ConfigError(
                    f"eval.cache_layout: {ev.cache_layout!r} does not apply to eval.engine dynamic (the paged cache "
                    "places every token round-robin by block); leave it at load_balanced"
                )
            if self.topology.tp_size != 1:
                raise ConfigError(
                    f"eval.engine: 'dynamic' runs at topology.tp_size 1 (the paged CP-sharded engine is built and "
                    f"tested at TP 1), got tp_size {self.topology.tp_size}; use eval.engine=static for TP > 1"
                )


# --------------------------------------------------------------------------- loading


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_type_name(args[0])}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string"}.get(tp, str(tp))


def _join(path: str, key) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else (f"{path}.{key}" if path else str(key))


def _wrong(path: str, tp, value) -> ConfigError:
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _coerce(tp, value, path: str):
    """``value`` checked (and lightly converted: int -> float, list -> tuple) against ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _wrong(path, tp, value)
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(a, value, path)
            except ConfigError:
                continue
        raise _wrong(path, tp, value)
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        raise _wrong(path, tp, value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _wrong(path, tp, value)
        return tuple(_coerce(args[0], v, _join(path, i)) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong(path, tp, value)
        return {str(k): _coerce(args[1], v, _join(path, k)) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _wrong(path, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _wrong(path, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise _wrong(path, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _wrong(path, tp, value)
    raise TypeError(f"config field {path} has an unsupported annotation {tp!r}")  # a bug here, not in the YAML


def from_dict(cls, data, path: str = ""):
    """Build dataclass ``cls`` from a (YAML-loaded) mapping, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _wrong(path or "config", cls, data)
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown key {_join(path, key)!r}; expected one of {names}")
    for key, value in data.items():
        hint = _RETIRED.get((cls.__name__, key, value)) if isinstance(value, str) else None
        if hint is not None:
            raise ConfigError(f"{_join(path, key)}: {value!r} {hint}")
    kwargs = {k: _coerce(hints[k], v, _join(path, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}.{e}" if path else str(e)) from None


def to_dict(cfg) -> dict:
    """Plain data (lists, not tuples) of a config dataclass, for YAML, JSON and wandb."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def parse_overrides(items) -> list[tuple[str, Any]]:
    """``["eval.decode_steps=4", ...]`` -> ``[("eval.decode_steps", 4), ...]`` (values read as YAML)."""
    out = []
    for item in items:
        if "=" not in item:
            hint = f"; a config file goes after --config: --config {item}" \
                if item.lower().endswith((".yaml", ".yml")) else ""
            raise ConfigError(f"override {item!r}: expected key=value, e.g. eval.decode_steps=4{hint}")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override {item!r}: the key is empty")
        try:
            value = yaml_files.load(raw) if raw.strip() else ""
        except yaml_files.DuplicateKeyError as e:
            raise ConfigError(f"override {item!r}: {e}") from None
        except yaml.YAMLError:
            value = raw
        out.append((key, value))
    return out


def apply_overrides(data: dict, overrides, cls=None) -> dict:
    """A copy of raw config ``data`` with dotted ``(key, value)`` overrides applied.

    Keys are checked against the dataclass schema (``cls``, default :class:`RunConfig`), so
    a misspelt override fails with the key's path even when the YAML does not set it.
    """
    cls = RunConfig if cls is None else cls
    import copy

    data = copy.deepcopy(data) if data else {}
    for key, value in _section_mappings_as_keys(overrides, cls):
        parts = key.split(".")
        node, schema, path = data, cls, ""
        for i, part in enumerate(parts):
            names = [f.name for f in dataclasses.fields(schema)]
            if part not in names:
                raise ConfigError(f"unknown key {_join(path, part)!r} in override {key}=...; expected one of {names}")
            path = _join(path, part)
            if i == len(parts) - 1:
                node[part] = value
                break
            sub = typing.get_type_hints(schema)[part]
            if not dataclasses.is_dataclass(sub):
                raise ConfigError(f"override {key}: {path} is {_type_name(sub)}, it has no sub-keys")
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node, schema = node[part], sub
    return data


def _section_mappings_as_keys(overrides, cls) -> list[tuple[str, Any]]:
    """A mapping given to a section (``eval.exactness={tolerance: 0.5}``) as one override per key it names
    (``eval.exactness.tolerance=0.5``): it changes those keys and keeps the section's others, which the YAML
    may have set (a mapping that replaced the section silently reset them to the defaults). A mapping for a
    field that is not a section (``model.rope_scaling``) is a value and stays whole."""
    out = []
    for key, value in overrides:
        schema = cls
        for part in key.split("."):
            fields = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set()
            schema = typing.get_type_hints(schema)[part] if part in fields else None
        if isinstance(value, dict) and dataclasses.is_dataclass(schema):
            out.extend(_section_mappings_as_keys([(f"{key}.{k}", v) for k, v in value.items()], cls))
        elif value is None and dataclasses.is_dataclass(schema):
            # null as a section would reset every key of it to the defaults, the YAML's too, silently
            names = [f.name for f in dataclasses.fields(schema)]
            raise ConfigError(f"{key}=null: {key} is a section of settings, not one value; set the keys to change "
                              f"({key}.<key>=..., or {key}={{<key>: ...}}), one of {names}")
        else:
            out.append((key, value))
    return out


def load_config(path: str | os.PathLike | None = None, overrides=()) -> RunConfig:
    """Read a YAML file (``None``: the defaults) and ``key=value`` overrides into a RunConfig."""
    data: dict = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {str(path)!r} does not exist (cwd {os.getcwd()})")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml_files.load(f) or {}
            except yaml_files.DuplicateKeyError as e:  # YAML itself would keep the last one silently
                raise ConfigError(f"config file {str(path)!r}: {e}") from None
            except yaml.YAMLError as e:
                raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level, got {type(data).__name__}")
    data = apply_overrides(data, parse_overrides(overrides) if overrides and isinstance(overrides[0], str) else overrides)
    return from_dict(RunConfig, data)
