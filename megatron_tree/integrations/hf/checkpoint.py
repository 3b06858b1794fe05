"""The one check of a transformers checkpoint directory, run by every loader before it loads.

Invariant: a checkpoint that transformers would load wrongly -- a weight re-initialised
because its tensor is absent (``model.norm.weight`` set to ones), a tensor of another shape,
a tensor the model has no place for, a truncated or foreign file -- is a
:class:`CheckpointError` that lists every problem, naming the file, the tensor and both
shapes, before a tensor is read and before any collective. :func:`check_checkpoint` reads
only ``config.json``, the safetensors headers and the files' sizes, and builds the model
transformers would build from the config on the ``meta`` device (no memory, no weights) to
know the tensors it expects. :func:`check_checkpoint_alike` runs it on every rank of a group
and makes one rank's failure every rank's error (one all-gather, :func:`~megatron_tree.distributed.agreement.agree`).

What is checked, in order:

* the directory exists (a local directory: hub repository ids are not downloaded here);
* ``config.json`` exists, is UTF-8 JSON holding an object with a ``model_type``, transformers
  reads it, and its model type has a causal-LM class (``AutoModelForCausalLM``);
* the weight files transformers would read -- ``model.safetensors``, else the files named by
  ``model.safetensors.index.json`` (which must exist and hold the tensors the index places in
  them) -- each: an 8-byte header length, a JSON header, dtypes torch can hold, offsets that
  tile the data in order with each tensor's byte length matching its dtype and shape, and a
  file size equal to where the data ends (shorter: truncated; longer: trailing bytes);
* the tensors against the model's ``state_dict`` on the meta device, after transformers' own
  key renames (``conversion_mapping``) and base-model prefix: missing weights, unexpected
  tensors and tensors of other shapes. Not reported: a tied weight whose source is present
  (``lm_head.weight`` under ``tie_word_embeddings``), buffers (rotary ``inv_freq``, which
  transformers computes), and what the model class lists in
  ``_keys_to_ignore_on_load_missing``/``_keys_to_ignore_on_load_unexpected``.

:func:`load_checked` is what the loaders call: the check (alike on every rank of a group),
then transformers' ``from_pretrained``, whose own loading report is checked once more (a
parameter transformers still reports missing or of another shape is an error, never a
silently re-initialised weight).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["CheckpointError", "CheckedCheckpoint", "check_checkpoint", "check_checkpoint_alike", "load_checked",
           "MAX_LISTED"]

MAX_LISTED = 8
"""Most problems one error lists, and most tensors one problem names (the rest are counted)."""
MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header the safetensors library reads."""
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

# safetensors dtype name -> (torch dtype attribute, bytes per element)
_DTYPES = {
    "BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2), "U16": ("uint16", 2),
    "F16": ("float16", 2), "BF16": ("bfloat16", 2), "I32": ("int32", 4), "U32": ("uint32", 4),
    "F32": ("float32", 4), "F64": ("float64", 8), "I64": ("int64", 8), "U64": ("uint64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
}
SUPPORTED_DTYPES = tuple(k for k, (name, _) in _DTYPES.items() if hasattr(torch, name))
"""safetensors dtypes this torch can hold."""


class CheckpointError(ValueError):
    """A checkpoint directory transformers would not load as it is saved; the message lists every problem.

    ``problems``: each problem's text (every one names its file or tensor); ``path``: the directory.
    """

    def __init__(self, message: str, problems=(), path: str | None = None):
        super().__init__(message)
        self.problems = list(problems) or [message]
        self.path = path


@dataclass
class CheckedCheckpoint:
    """What :func:`check_checkpoint` found: a checkpoint transformers loads as saved."""

    path: str
    config: object
    """transformers' config object read from ``config.json``."""
    model_class: type
    """The causal-LM class transformers builds for it."""
    files: tuple
    """The weight files transformers reads (full paths)."""
    tensors: dict
    """Checkpoint tensor name -> (safetensors dtype, shape, file name)."""
    digest: str
    """A digest of config.json's content and the tensors' names, dtypes and shapes (compared across ranks)."""
    meta_model: object = field(default=None, repr=False)
    """The model built from the config on the meta device."""

    @property
    def max_position_embeddings(self) -> int:
        text = getattr(self.config, "get_text_config", lambda **_: self.config)(decoder=True)
        return int(getattr(text, "max_position_embeddings", None) or 2**31 - 1)


# --------------------------------------------------------------------------- the files


def _listed(items: list, limit: int = MAX_LISTED) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def _json_object(file: str, what: str) -> dict:
    """The JSON object in ``file``, or a CheckpointError naming the file and what is wrong."""
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{file} is not UTF-8 text ({e.reason} at byte {e.start}); expected {what} (JSON)") from None
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(file: str) -> tuple[dict, list]:
    """The tensors of one safetensors file from its header, and the problems found (no tensor is read).

    Returns ({name: (dtype, shape)}, [problem text, ...]); a header that cannot be read gives ({}, [why]).
    """
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return {}, [f"{file} is {size} bytes, too short for a safetensors header (truncated or empty)"]
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                return {}, [f"{file} announces a {n}-byte header but the file has {size} bytes: not a safetensors "
                            "file, or truncated"]
            raw = f.read(n)
    except OSError as e:
        return {}, [f"{file} cannot be read: {e}"]
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        return {}, [f"{file} is not a readable safetensors file: its {n}-byte header is not UTF-8 JSON ({e})"]
    if not isinstance(header, dict):
        return {}, [f"{file} is not a readable safetensors file: the header is not a JSON object"]
    tensors, problems, spans = {}, [], []
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and all(_is_count(d) for d in entry["shape"]) and isinstance(entry.get("data_offsets"), list)
                and len(entry["data_offsets"]) == 2 and all(_is_count(o) for o in entry["data_offsets"])):
            problems.append(f"{file}: tensor {key!r} has a malformed header entry {entry!r}; expected "
                            "{'dtype': ..., 'shape': [ints], 'data_offsets': [begin, end]}")
            continue
        dtype, shape, (begin, end) = entry.get("dtype"), tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in SUPPORTED_DTYPES:
            problems.append(f"{file}: tensor {key!r} has dtype {dtype!r}, which torch {torch.__version__} cannot "
                            f"hold; expected one of {list(SUPPORTED_DTYPES)}")
            continue
        want = _DTYPES[dtype][1]
        for d in shape:
            want *= d
        if end - begin != want:
            problems.append(f"{file}: tensor {key!r} ({dtype} {list(shape)}) spans bytes {begin}..{end} of the data, "
                            f"{end - begin} bytes; its dtype and shape need {want}")
        tensors[key] = (dtype, shape)
        spans.append((begin, end, key))
    spans.sort()
    at, last = 0, None  # where the data so far ends, and the span that reaches there
    for begin, end, key in spans:
        if begin < at:  # shares bytes with the span that reaches furthest so far: name both
            lb, le, lk = last
            problems.append(f"{file}: tensors {lk!r} (data bytes {lb}..{le}) and {key!r} (data bytes {begin}..{end}) "
                            f"share bytes {begin}..{min(end, le)}; expected each tensor's bytes to be its own (the "
                            "offsets tile the data in order, without gaps or overlaps)")
            break
        if begin > at:
            after = f"right after tensor {last[2]!r} (data bytes {last[0]}..{last[1]})" if last else "at the data's start"
            problems.append(f"{file}: tensor {key!r} starts at data byte {begin}, expected {at} ({after}): a gap of "
                            f"{begin - at} bytes (the offsets tile the data in order, without gaps or overlaps)")
            break
        at, last = end, (begin, end, key)
    data_end = 8 + n + max((e for _, e, _ in spans), default=0)
    if data_end > size:
        problems.append(f"{file} is truncated: its tensors end at byte {data_end}, the file has {size}")
    elif data_end < size:
        problems.append(f"{file} has {size - data_end} bytes after its last tensor (it ends at byte {data_end}, the "
                        f"file has {size}): not what safetensors wrote, or two files run together")
    return tensors, problems


def _weight_files(path: str, problems: list) -> tuple[list, dict]:
    """The weight files transformers reads from ``path`` (full paths) and the index's tensor -> file map."""
    single, index = os.path.join(path, WEIGHTS), os.path.join(path, INDEX)
    if os.path.isfile(single):
        return [single], {}
    if os.path.isdir(single):
        problems.append(f"{single} is a directory, expected a safetensors file")
        return [], {}
    if not os.path.isfile(index):
        found = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".pt", ".pth")))
        problems.append(f"{path!r} has neither {WEIGHTS} nor {INDEX} (found {found or 'no weight files'}); "
                        "transformers reads the weights from one of those (safetensors only)")
        return [], {}
    try:
        weight_map = _json_object(index, "a safetensors index").get("weight_map")
    except CheckpointError as e:
        problems.append(str(e))
        return [], {}
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        problems.append(f"{index} has no 'weight_map' object of tensor name -> file name")
        return [], {}
    files = []
    for fname in sorted(set(weight_map.values())):
        full = os.path.join(path, fname)
        if os.path.isfile(full):
            files.append(full)
        elif os.path.isdir(full):
            problems.append(f"{full} is a directory, expected a safetensors file ({index} names it)")
        else:
            held = sorted(k for k, v in weight_map.items() if v == fname)
            problems.append(f"{index} names {fname}, which is not in {path} (it should hold {len(held)} tensors: "
                            f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''})")
    return files, weight_map


# --------------------------------------------------------------------------- the config and the model


def _config(path: str):
    """(config dict, transformers config, causal-LM class); CheckpointError naming config.json otherwise."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise CheckpointError(f"{path!r} has no config.json (expected a transformers checkpoint directory: config.json "
                              f"and {WEIGHTS} or {INDEX})")
    raw = _json_object(file, "a transformers config.json")
    if not isinstance(raw.get("model_type"), str) or not raw["model_type"]:
        raise CheckpointError(f"{file} has no 'model_type' (a string naming the architecture, e.g. 'llama'); "
                              f"got {raw.get('model_type')!r}")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cfg = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- transformers' config errors (validation, unknown type) vary by release
        raise CheckpointError(f"transformers cannot read {file}: {e}") from None
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)]
    except KeyError:
        raise CheckpointError(
            f"unsupported architecture: {file} describes model_type {cfg.model_type!r}, which has no causal-LM class "
            "in transformers (AutoModelForCausalLM); expected a decoder-only causal LM such as Llama, Qwen2, Mistral"
        ) from None
    return raw, cfg, cls


def _meta_model(cls, cfg, file: str):
    try:
        with torch.device("meta"):
            return cls(cfg)
    except Exception as e:  # noqa: BLE001 -- a config transformers parsed but cannot build a model of
        raise CheckpointError(f"transformers cannot build {cls.__name__} from {file}: {type(e).__name__}: {e}") from None


def _renamer(model, expected: dict):
    """``key -> (name in the model, converted)``: transformers' renames of checkpoint keys for ``model``
    (its ``conversion_mapping``, then the base-model prefix added or dropped). ``converted``: the key
    feeds a weight converter (e.g. experts stacked into one tensor), whose shapes differ by design."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        mapping = get_model_conversion_mapping(model)
        renames = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
    except Exception:  # noqa: BLE001 -- another transformers release: the prefix rule alone
        rename_source_key = None

    def plain(key: str) -> str:
        if key in expected:
            return key
        if prefix and key.startswith(prefix + ".") and key[len(prefix) + 1:] in expected:
            return key[len(prefix) + 1:]
        if prefix and f"{prefix}.{key}" in expected:
            return f"{prefix}.{key}"
        return key

    def rename(key: str) -> tuple[str, bool]:
        if rename_source_key is None:
            return plain(key), False
        try:
            new, pattern = rename_source_key(key, renames, converters, prefix, expected)
        except Exception:  # noqa: BLE001
            return plain(key), False
        if new not in expected and key in expected:
            return plain(key), False
        return new, pattern is not None

    return rename


def _compare(model, cls_name: str, tensors: dict, file: str, path: str) -> list:
    """Problems of the checkpoint's tensors against ``model``'s: other shapes, missing, unexpected."""
    state = model.state_dict()
    expected = {n: tuple(t.shape) for n, t in state.items()}
    floating = {n for n, t in state.items() if t.is_floating_point()}
    quantized = getattr(model.config, "quantization_config", None) is not None
    buffers = {n for n, _ in model.named_buffers()}
    rename = _renamer(model, expected)
    present, wrong, kinds, unexpected = set(), [], [], []
    for key in sorted(tensors):
        dtype, shape, where = tensors[key]
        target, converted = rename(key)
        if target not in expected:
            unexpected.append((key, shape, where))
            continue
        present.add(target)
        if not converted and tuple(shape) != expected[target]:
            renamed = f" (loaded as {target})" if target != key else ""
            wrong.append(f"{key}{renamed} is {list(shape)} in {where}, config.json gives {list(expected[target])}")
        elif target in floating and not quantized and not _DTYPES[dtype][0].startswith(("float", "bfloat")):
            # an integer tensor for a floating weight: from_pretrained casts it (an int32 bit pattern of
            # small floats becomes zeros); only a quantized checkpoint stores integers on purpose
            kinds.append(f"{key} is {dtype} in {where}")
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    ignore_missing = list(getattr(model, "_keys_to_ignore_on_load_missing", None) or [])
    ignore_unexpected = list(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or [])
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):  # older checkpoints stored it per layer
        ignore_unexpected.append(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        ignore_unexpected.append(r"(^|\.)position_ids$")
    miss_re = re.compile("|".join(f"({p})" for p in ignore_missing)) if ignore_missing else None
    unexp_re = re.compile("|".join(f"({p})" for p in ignore_unexpected)) if ignore_unexpected else None
    missing = [n for n in sorted(expected) if n not in present and n not in buffers
               and not (n in tied and tied[n] in present) and not (miss_re and miss_re.search(n))]
    unexpected = [u for u in unexpected if not (unexp_re and unexp_re.search(u[0]))]
    problems = []
    if tensors and not present:  # another model's weights altogether: one line says so, not two long lists
        names = sorted(tensors)
        return [f"none of the checkpoint's {len(tensors)} tensors is a weight of {cls_name} as {file} describes it "
                f"(the checkpoint holds {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}; the model's "
                f"weights are named like {next(iter(expected))}); transformers would build it with every weight "
                "re-initialised"]
    if wrong:
        problems.append(f"the tensors disagree with {file} ({len(wrong)} of other shapes): {_listed(wrong)}. The "
                        "weights and config.json are from different models")
    if kinds:
        problems.append(f"{len(kinds)} tensor(s) hold integers where {cls_name}'s weights are floating point: "
                        f"{_listed(kinds)}. transformers would cast them (an int32 bit pattern of small floats becomes "
                        "zeros); only a checkpoint with a quantization_config in config.json stores integers on purpose")
    if missing:
        shown = [f"{n} {list(expected[n])}" for n in missing]
        problems.append(f"{path!r} holds no tensor for {len(missing)} weight(s) of {cls_name} as {file} describes it "
                        f"(transformers would re-initialise them instead of loading them): {_listed(shown)}")
    if unexpected:
        shown = [f"{k} {list(s)} in {w}" for k, s, w in unexpected]
        problems.append(f"{path!r} holds {len(unexpected)} tensor(s) that {cls_name} as {file} describes it has no "
                        f"weight for (transformers would drop them): {_listed(shown)}")
    return problems


# --------------------------------------------------------------------------- the check


def _raise(path: str, problems: list):
    if len(problems) == 1:
        raise CheckpointError(problems[0], problems, path)
    listed = " ".join(f"({i}) {p}" for i, p in enumerate(problems[:MAX_LISTED], 1))
    more = f" (and {len(problems) - MAX_LISTED} more)" if len(problems) > MAX_LISTED else ""
    raise CheckpointError(f"{len(problems)} problems with the checkpoint {path!r}: {listed}{more}", problems, path)


def check_checkpoint(path, *, check_model=None) -> CheckedCheckpoint:
    """Check the transformers checkpoint directory ``path`` (module docstring); no tensor is read.

    Returns a :class:`CheckedCheckpoint`; raises :class:`CheckpointError` listing every problem.
    Runs on this rank alone, without any collective (see :func:`check_checkpoint_alike`).
    check_model: called with the meta-device model before its tensors are compared; what it raises
    (e.g. ``UnsupportedModelError``: an architecture tree attention cannot run) is raised as it is.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise CheckpointError(f"expected a checkpoint directory path, got {type(path).__name__} {path!r}") from None
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint directory {path!r} does not exist (a local directory with config.json and "
                              "safetensors weights; hub repository ids are not downloaded here)", path=path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is a file; expected a checkpoint directory (config.json and safetensors "
                              "weights)", path=path)
    problems, raw, cfg, cls = [], None, None, None
    try:
        raw, cfg, cls = _config(path)
    except CheckpointError as e:
        problems.append(str(e))
    before = len(problems)
    files, weight_map = _weight_files(path, problems)
    tensors, readable = {}, len(problems) == before  # a weight file missing: its tensors are unknown
    for full in files:
        found, bad = read_header(full)
        problems += bad
        readable = readable and not bad
        name = os.path.basename(full)
        for key, (dtype, shape) in found.items():
            if key in tensors:
                where = f" (the index places it in {weight_map[key]})" if key in weight_map else ""
                problems.append(f"tensor {key!r} is in two weight files of {path!r}: {tensors[key][2]} and {name}; "
                                f"expected it in exactly one{where}")
            tensors[key] = (dtype, shape, name)
        if readable:
            misplaced = sorted(k for k, v in weight_map.items() if v == name and k not in found)
            if misplaced:
                problems.append(f"{os.path.join(path, INDEX)} places {len(misplaced)} tensor(s) in {name}, whose "
                                f"header does not hold them: {_listed(misplaced)}")
    model = None
    if cls is not None:
        file = os.path.join(path, "config.json")
        try:
            model = _meta_model(cls, cfg, file)
        except CheckpointError as e:
            problems.append(str(e))
        if model is not None and check_model is not None:
            check_model(model)
        if model is not None and files and readable:  # a file's tensors unknown: comparing would list noise
            problems += _compare(model, cls.__name__, tensors, file, path)
    if problems:
        _raise(path, problems)
    listing = sorted((k, d, list(s)) for k, (d, s, _) in tensors.items())
    digest = hashlib.blake2b(json.dumps([raw, listing], sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    return CheckedCheckpoint(path, cfg, cls, tuple(files), tensors, digest, model)


def _group_device(group) -> torch.device:
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_checkpoint_alike(path, group=None, ranks=(), *, site: str = "loading a checkpoint") -> CheckedCheckpoint:
    """:func:`check_checkpoint` on every rank of ``group`` (global ``ranks``), failing alike.

    A rank whose check fails makes every rank raise its :class:`CheckpointError`, naming the rank
    (``rank 1: ...``), the same text everywhere; ranks whose checkpoints differ (config.json or the
    tensors' names, dtypes, shapes) raise ``DisagreementError``. One all-gather of a few int64 on
    ``group`` after the local check; without a group (or a group of one) the local check alone.
    """
    from ...distributed.agreement import agree

    ranks = tuple(ranks)
    if group is None or len(ranks) <= 1:
        return check_checkpoint(path)
    out = {}

    def mine():
        out["checked"] = check_checkpoint(path)
        return (out["checked"].digest,)

    agree(site, ("checkpoint (a digest of config.json and the tensors' names, dtypes and shapes)",), mine, group,
          ranks, device=_group_device(group))
    return out["checked"]


def load_checked(path, dtype: torch.dtype = torch.float32, group=None, ranks=(), *, site: str = "loading a checkpoint"):
    """transformers' model for the checkpoint at ``path``, checked first (alike on every rank of ``group``).

    Returns ``(model, checked)``. After ``from_pretrained``, a parameter transformers reports
    missing or of another shape is a :class:`CheckpointError` too (it would have been re-initialised).
    """
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point
            or isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
            and getattr(torch, dtype).is_floating_point):
        raise TypeError(f"{site}: dtype must be a floating-point torch.dtype or its name (e.g. torch.bfloat16 or "
                        f"'bfloat16'), got {dtype!r}")
    checked = check_checkpoint_alike(path, group, ranks, site=site)
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(checked.path, dtype=dtype, output_loading_info=True)
    buffers = {n for n, _ in model.named_buffers()}
    missing = sorted(k for k in (info.get("missing_keys") or ()) if k not in buffers)
    mismatched = sorted(str(k[0] if isinstance(k, (tuple, list)) else k) for k in (info.get("mismatched_keys") or ()))
    if missing or mismatched:
        what = ([f"missing {_listed(missing)}"] if missing else []) + ([f"of other shapes {_listed(mismatched)}"]
                                                                      if mismatched else [])
        raise CheckpointError(f"transformers loaded {type(model).__name__} from {checked.path!r} with weights it "
                              f"re-initialised ({'; '.join(what)}), which the check before loading did not find",
                              path=checked.path)
    return model, checked
