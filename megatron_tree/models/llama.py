"""Llama-family decoder (Llama 2 / 3 / 3.1 / 3.2 layouts, GQA) on a sequence-sharded KV cache.

Invariant: the model's weights are replicated on every CP rank and every step returns the
same logits on every rank; only the KV cache (``cache.py``) is split along the sequence.
Prefill runs each rank's prompt chunk through all layers with exact CP attention
(``prefill.py``), decode runs one token per row with ``tree_decode``. With ``groups=None``
or a CP group of one rank it is an ordinary single-process model, and ``model(input_ids)``
is the plain full-sequence forward that serves as the unsharded reference.

Parameter names are those of Hugging Face's ``LlamaForCausalLM``, so ``from_pretrained``
reads ``config.json`` and safetensors files (one file, or a sharded index) directly;
transformers is not needed at run time.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.nn import functional as F

from ..decode.cache import CacheConfig, ShardedKVCache
from ..comm import CommStats
from ..layer import ROPE_TYPES, RotaryEmbedding, TreeAttention
from ..decode.prefill import PREFILL_METHODS, assemble_logits
from ..sync_guard import CHECK_VALUES_ENV
from ..topology import TreeGroups

try:  # NVIDIA apex's fused kernel, used on CUDA tensors when it is installed
    from apex.normalization.fused_layer_norm import fused_rms_norm_affine as _apex_rms_norm
except Exception:  # noqa: BLE001 -- absent or broken apex: the torch path is exact anyway
    _apex_rms_norm = None

__all__ = ["LlamaConfig", "Llama", "RMSNorm", "CheckpointError", "SUPPORTED_ARCHITECTURES", "check_checkpoint",
           "safetensors_header"]

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)


class CheckpointError(ValueError):
    """A checkpoint directory that does not describe a model this module can build."""


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family model (the fields of Hugging Face's ``config.json``)."""

    vocab_size: int
    """Number of token ids."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int | None = None
    """KV heads (GQA when fewer than query heads); ``None`` means as many as query heads."""
    head_dim: int | None = None
    """Per-head width; ``None`` means ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rope_scaling: dict | None = None
    """``None`` or ``{"rope_type": "llama3" | "linear", ...}`` (see ``layer.rope_inv_freq``)."""
    max_position_embeddings: int = 4096
    """Longest sequence the model was trained for (informational; the cache sets the real limit)."""
    tie_word_embeddings: bool = False
    """Whether the output projection reuses the token embedding."""
    initializer_range: float = 0.02
    """Std of the normal init of a randomly initialised model."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive integer, got {value!r}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            scaling = dict(self.rope_scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {kind!r}; expected one of {ROPE_TYPES}")
            object.__setattr__(self, "rope_scaling", scaling)

    @classmethod
    def from_hf(cls, source) -> "LlamaConfig":
        """Build from a Hugging Face ``config.json`` (a dict, the file, or its directory).

        Accepts both the transformers 4 layout (``rope_theta`` + ``rope_scaling``) and the
        transformers 5 one (``rope_parameters``). Anything this model cannot reproduce
        (another architecture, biases, another activation) is a :class:`CheckpointError`.
        """
        if isinstance(source, (str, os.PathLike)):
            path = os.path.join(source, "config.json") if os.path.isdir(source) else os.fspath(source)
            if not os.path.isfile(path):
                raise CheckpointError(f"no config.json at {path}")
            hf = _read_json(path, "config.json")
            try:
                return cls._from_hf_dict(hf)
            except (ValueError, TypeError) as e:  # CheckpointError is a ValueError: name the file
                raise CheckpointError(f"{path}: {e}") from e
        if isinstance(source, dict):
            return cls._from_hf_dict(dict(source))
        raise TypeError(f"from_hf expects a dict or a path, got {type(source).__name__}")

    @classmethod
    def _from_hf_dict(cls, hf: dict) -> "LlamaConfig":
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise CheckpointError(
                f"unsupported architecture {archs} in config.json; expected one of {list(SUPPORTED_ARCHITECTURES)}"
            )
        if model_type is not None and model_type != "llama":
            raise CheckpointError(f"unsupported model_type {model_type!r} in config.json; expected 'llama'")
        if not archs and model_type is None:
            raise CheckpointError("config.json names neither 'architectures' nor 'model_type'; expected a Llama config")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"unsupported hidden_act {act!r}; Llama's SwiGLU MLP uses 'silu'")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise CheckpointError(f"{flag}=true is not supported; Llama layers have no biases")
        rope = hf.get("rope_parameters")
        if rope is not None:  # transformers >= 5
            if not isinstance(rope, dict):
                raise CheckpointError(f"rope_parameters must be an object, got {rope!r}")
            rope = dict(rope)
            theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
            scaling = rope if rope.get("rope_type", "default") != "default" else None
        else:
            theta = hf.get("rope_theta", 10000.0)
            scaling = hf.get("rope_scaling")
        known = {f.name for f in fields(cls)}
        kwargs = {k: hf[k] for k in known if k in hf and k not in ("rope_theta", "rope_scaling")}
        try:
            return cls(**kwargs, rope_theta=float(theta), rope_scaling=scaling)
        except TypeError as e:
            raise CheckpointError(f"config.json lacks a required field: {e}") from e


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32 (apex's fused kernel on CUDA when installed).

    x: (..., hidden) -> (..., hidden) in x.dtype
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _apex_rms_norm is not None and x.is_cuda:
            return _apex_rms_norm(x, self.weight, self.weight.shape, self.eps)
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``. x: (..., hidden) -> (..., hidden)."""

    def __init__(self, cfg: LlamaConfig, dtype):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, idx: int, rope: RotaryEmbedding, groups, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = TreeAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                       cfg.head_dim, rope, idx, groups, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = _MLP(cfg, dtype)

    def _finish(self, x, attn):
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


class _Backbone(nn.Module):
    """``model.*`` of a Hugging Face checkpoint: embeddings, layers, final norm."""

    def __init__(self, cfg: LlamaConfig, rope: RotaryEmbedding, groups, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(_DecoderLayer(cfg, i, rope, groups, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Llama(nn.Module):
    """A Llama causal LM whose KV cache is sharded over the CP ranks of ``groups``."""

    def __init__(self, cfg: LlamaConfig, groups: TreeGroups | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = cfg
        self.groups = groups
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.model = _Backbone(cfg, self.rope, groups, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        if not any(p.is_meta for p in self.parameters()):
            self._init_weights()

    # ------------------------------------------------------------------ construction

    def _init_weights(self) -> None:
        std = self.config.initializer_range
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    m.weight.normal_(0.0, std)
                elif isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)

    @property
    def cp_size(self) -> int:
        return 1 if self.groups is None else self.groups.size

    @property
    def cp_rank(self) -> int:
        return 0 if self.groups is None else self.groups.rank

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @classmethod
    def from_pretrained(cls, path, groups: TreeGroups | None = None, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "Llama":
        """Load a Hugging Face Llama directory: ``config.json`` + ``model.safetensors`` or a sharded index.

        Every CP rank loads the full weights. The checkpoint is first validated by
        :func:`check_checkpoint` (headers only): an unreadable or invalid ``config.json``, a
        truncated or garbage safetensors file, missing or unexpected tensors, or tensors of
        the wrong shape raise :class:`CheckpointError` naming the file and what was wrong.
        """
        from safetensors import safe_open

        path = os.fspath(path)
        cfg, layout = _validate_checkpoint(path)
        with torch.device("meta"):
            model = cls(cfg, groups, dtype)
        state: dict[str, torch.Tensor] = {}
        for fname, names in layout.items():
            file = os.path.join(path, fname)
            try:
                with safe_open(file, framework="pt", device="cpu") as f:
                    for name in names:
                        state[name] = f.get_tensor(name)
            except Exception as e:  # noqa: BLE001 -- safetensors' own error types vary by release
                raise CheckpointError(f"cannot read {file}: {type(e).__name__}: {e}") from e
        state = {n: t.to(device=device, dtype=dtype) for n, t in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
        return model

    # ------------------------------------------------------------------ forward paths

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(h, w)

    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"{what} has token ids in [{int(ids.min())}, {int(ids.max())}], outside the vocabulary "
                f"[0, {self.config.vocab_size})"
            )

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain single-process causal forward of whole sequences, no cache, no communication.

        input_ids: (batch, seqlen) int64 -> logits (batch, seqlen, vocab) in the model dtype
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seqlen), got shape {tuple(input_ids.shape)}")
        self._check_ids(input_ids, "input_ids")
        b, s = input_ids.shape
        pos = torch.arange(s, device=input_ids.device)[None, :].expand(b, s)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer._finish(x, layer.self_attn(layer.input_layernorm(x), pos))
        return self._logits(self.model.norm(x))

    def new_cache(self, batch_size: int, max_seq_len: int, layout: str = "load_balanced",
                  block_size: int = 16) -> ShardedKVCache:
        """An empty KV cache for this model on this CP rank, holding 1/CP of ``max_seq_len`` per row."""
        cfg = self.config
        return ShardedKVCache(
            num_layers=cfg.num_hidden_layers, batch_size=batch_size, max_seq_len=max_seq_len,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, cp_size=self.cp_size,
            cp_rank=self.cp_rank, config=CacheConfig(layout=layout, block_size=block_size),
            dtype=self.dtype, device=self.device,
        )

    def _check_cache(self, cache: ShardedKVCache) -> None:
        if cache.cp_size != self.cp_size or cache.cp_rank != self.cp_rank:
            raise ValueError(
                f"cache was made for CP rank {cache.cp_rank} of {cache.cp_size}, but this model runs on "
                f"rank {self.cp_rank} of {self.cp_size}; create it with model.new_cache()"
            )
        if cache.num_layers != self.config.num_hidden_layers:
            raise ValueError(f"cache has {cache.num_layers} layers, the model {self.config.num_hidden_layers}")

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], cache: ShardedKVCache, method: str = "ring",
                stats: CommStats | None = None) -> torch.Tensor:
        """Run the prompts through the model, each CP rank its own chunk; fill ``cache``.

        prompts: ``batch`` token-id lists, lengths may differ (each >= 1)
        method: ``"ring"`` or ``"allgather"`` (CP attention across chunks, ``prefill.py``)
        stats: a ``CommStats`` to record the prefill's KV traffic into (level ``"cp"``)
        returns logits: (batch, vocab) of each row's last prompt token, identical on every CP rank
        """
        if method not in PREFILL_METHODS:
            raise ValueError(f"unknown prefill method {method!r}; expected one of {PREFILL_METHODS}")
        self._check_cache(cache)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        lengths = [len(p) for p in prompts]
        self._check_ids(torch.as_tensor([t for p in prompts for t in p], dtype=torch.int64), "prompts")
        local_pos = cache.start_prefill(lengths).cpu()  # (B, S) global positions, -1 = padding
        ids = torch.zeros(local_pos.shape, dtype=torch.int64)
        for b, p in enumerate(prompts):
            valid = local_pos[b] >= 0
            ids[b, valid] = torch.as_tensor(list(p), dtype=torch.int64)[local_pos[b, valid]]
        dev = self.device
        ids, local_pos = ids.to(dev), local_pos.to(dev)

        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            attn = layer.self_attn.prefill(layer.input_layernorm(x), local_pos, cache, method, stats)
            x = layer._finish(x, attn)
        x = self.model.norm(x)

        # Each row's last prompt token's logits, from the rank that holds it, on every rank (exact).
        last = torch.as_tensor(lengths, device=dev)[:, None] - 1
        hit = local_pos == last  # (B, S), at most one True per row
        pick = hit.to(torch.int64).argmax(dim=1, keepdim=True)  # (B, 1)
        h = x.gather(1, pick[..., None].expand(-1, -1, x.shape[-1]))  # (B, 1, hidden)
        held = torch.where(hit.any(dim=1, keepdim=True), last, torch.full_like(last, -1))
        logits = self._logits(h)
        # lengths: ranks handed rows of other lengths would place their chunks wrongly (a silent wrong answer)
        signature = ("Llama.prefill", ("batch", "hidden", "dtype", "prompt_lengths"),
                     (h.shape[0], h.shape[-1], h.dtype, tuple(lengths)))
        return assemble_logits(logits, held, last, self.groups, stats=stats, signature=signature)[:, 0].to(logits.dtype)

    @torch.no_grad()
    def decode_step(self, next_ids: torch.Tensor, cache: ShardedKVCache, step=None, *, strategy: str = "auto",
                    stats: CommStats | None = None) -> torch.Tensor:
        """Append one token per row and return the logits of the next one.

        next_ids: (batch,) int64 -- the same on every CP rank
        step: the loop's ``decode.generate.DecodeStep`` (every layer's attention is its ``attend``;
            ``generate``'s ``shifted`` redo rewinds the cache and calls this again); without one, a
            plain step of ``strategy``/``stats``
        returns logits: (batch, vocab), identical on every CP rank

        No host-device synchronisation (issue 13 item 5; ``megatron_tree.sync_guard``): token
        ids given as host data (a list) are range-checked on the host; a tensor's values are
        not read back (it usually comes from sampling on the device, within the vocabulary by
        construction), unless ``MEGATRON_TREE_CHECK_VALUES=1`` asks for that debug check.
        """
        self._check_cache(cache)
        host = not isinstance(next_ids, torch.Tensor)
        if host or os.environ.get(CHECK_VALUES_ENV) == "1":
            self._check_ids(torch.as_tensor(next_ids, dtype=torch.int64), "next_ids")
        next_ids = torch.as_tensor(next_ids, dtype=torch.int64, device=self.device).reshape(-1)
        if next_ids.numel() != cache.batch_size:
            raise ValueError(f"next_ids has {next_ids.numel()} tokens, the cache's batch size is {cache.batch_size}")
        positions, slots = cache.begin_decode_step()
        x = self.model.embed_tokens(next_ids)[:, None]  # (B, 1, hidden)
        for layer in self.model.layers:
            attn = layer.self_attn.decode(layer.input_layernorm(x), positions, slots, cache,
                                          strategy=strategy, stats=stats, step=step)
            x = layer._finish(x, attn)
        return self._logits(self.model.norm(x))[:, 0]


# --------------------------------------------------------------------------- checkpoint validation

_SAFETENSORS_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def _read_json(path: str, what: str) -> dict:
    """A JSON object from ``path``; anything else is a CheckpointError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"no {what} at {path}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); expected {what} (JSON)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                              f"expected {what}") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {what} {path}: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}; expected {what}")
    return data


def safetensors_header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{tensor name: (dtype, shape)}`` of a safetensors file, validated against the file's size.

    Reads only the header (8-byte length + JSON), never the tensors. A file too short for its
    header, a header that is not JSON, or a tensor whose bytes lie beyond the end of the file
    (a truncated download) is a :class:`CheckpointError` naming the file.
    """
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else None
            raw = f.read(n) if n is not None and 0 < n <= min(size - 8, _MAX_HEADER) else None
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    if n is None:
        raise CheckpointError(f"{path} is {size} bytes, too short for a safetensors header (truncated or empty)")
    if raw is None:
        raise CheckpointError(
            f"{path} announces a {n}-byte header but the file has {size} bytes: not a safetensors file, or truncated"
        )
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e}); not a safetensors file?") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
            itemsize = _SAFETENSORS_ITEMSIZE[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end) or any(x < 0 for x in shape):
            raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {shape} or offsets {[begin, end]}")
        if end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{path}: tensor {name!r} of {dtype} {shape} needs {math.prod(shape) * itemsize} bytes, "
                                  f"its offsets span {end - begin}")
        if end > data:
            raise CheckpointError(
                f"{path} is truncated: tensor {name!r} ends at byte {8 + n + end} of the file, but the file has "
                f"{size} bytes"
            )
        out[name] = (dtype, shape)
    return out


def _validate_checkpoint(path: str) -> tuple[LlamaConfig, dict[str, list[str]]]:
    """The config and ``{file: [tensor names to load]}`` of a checkpoint directory, fully validated."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist (or is not a directory)")
    cfg = LlamaConfig.from_hf(path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index, "a safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} has no 'weight_map' object of tensor name -> file name")
        files = sorted(set(weight_map.values()))
        for fname in files:
            if not os.path.isfile(os.path.join(path, fname)):
                raise CheckpointError(f"{index} names {fname}, which is not in {path}")
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}")

    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in Llama(cfg).state_dict().items()}
    found: dict[str, tuple] = {}
    layout: dict[str, list[str]] = {}
    unexpected: list[str] = []
    for fname in files:
        for name, (_, shape) in safetensors_header(os.path.join(path, fname)).items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints store RoPE's buffer; it is recomputed
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # tied: the embedding is the output projection
            if name not in expected:
                unexpected.append(name)
                continue
            found[name] = shape
            layout.setdefault(fname, []).append(name)
    missing = sorted(set(expected) - set(found))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {missing}")
        if unexpected:
            parts.append(f"unexpected tensors {sorted(unexpected)}")
        raise CheckpointError(f"checkpoint {path} does not match Llama({cfg}): " + "; ".join(parts))
    wrong = [f"{n}: {s} (expected {expected[n]})" for n, s in found.items() if s != expected[n]]
    if wrong:
        raise CheckpointError(f"checkpoint {path} has tensors of the wrong shape: {wrong}")
    return cfg, layout


def check_checkpoint(path) -> LlamaConfig:
    """Validate a checkpoint directory without loading any tensor; return its config.

    Checks what :meth:`Llama.from_pretrained` needs: ``config.json`` readable, valid JSON and
    a supported Llama config; the safetensors file(s) (or the index and every file it
    names) with intact headers whose tensors fit inside each file; every expected tensor
    present, none unexpected, every shape right. Raises :class:`CheckpointError` naming the
    file and what was wrong. Costs a few kilobytes of reads: cheap enough to run on every
    rank before any process group starts (the eval CLI's pre-flight).
    """
    return _validate_checkpoint(os.fspath(path))[0]
