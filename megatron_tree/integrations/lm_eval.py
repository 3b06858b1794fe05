"""lm-evaluation-harness backend ``megatron_tree``: lm-eval's requests on a CP-sharded transformers or Megatron model.

Invariant: for every request, the score or text each rank returns is what lm-eval's own ``hf``
backend returns for that request in one process on the same checkpoint (log-likelihoods to
float rounding, greedy flags and greedy generations token for token) -- for a Megatron-Core
checkpoint (``source=megatron``), what Megatron's own ``GPTModel`` at CP = 1 (its
``DotProductAttention``) scores and greedily generates -- while each rank of a
CP group holds 1/CP of the KV cache and runs the layers on 1/CP of every prompt. Nothing of
lm-eval is rewritten: the class is an ``lm_eval.api.model.TemplateLM`` registered under
``"megatron_tree"``, and it overrides the model's own distributed slots (``rank``,
``world_size``, ``all_gather``, ``gather_object``, ``barrier``) so that lm-eval's evaluator
shards documents over the data-parallel (DP) groups, never over CP peers.

World = DP x CP: ``cp_size`` consecutive global ranks form a CP group (``TreeGroups.build``,
``intra_size`` ranks per simulated or real node); the ranks with the same CP index form a DP
group. ``lm.rank`` / ``lm.world_size`` are the DP rank and size, so the CP peers of one DP rank
receive the same requests and run the same collectives; lm-eval's gathers of samples and
metrics run over the DP group. Results are kept by global rank 0 only (the launcher,
``megatron_tree.eval.lm_eval``, drops them on every other rank).

How each request type runs (the decode tier underneath, through ``integrations.hf`` or, for
``source=megatron``, ``integrations.megatron.model.MegatronLM``):

* ``loglikelihood`` -- context + continuation (minus its last token) is prefilled CP-sharded
  in one forward per batch of rows of different lengths (left-padded, pads never computed;
  a Megatron model prefills rows of equal length together, unpadded:
  ``MegatronLM.prefill_logits``); the forward returns the logits of the continuation
  positions only, assembled on every rank; log-probs and the greedy flag are computed from
  them. Identical (context, continuation) token pairs are scored once (lm-eval's padding of a
  DP rank's list repeats its last request), and pairs with the same model input (the
  one-token choices of one question) share one row: the context is prefilled once for all of
  them (``prefill_tokens`` against ``prefill_tokens_unshared``).
* ``loglikelihood_rolling`` -- lm-eval's own rolling windows of ``max_length`` tokens
  (``utils.get_rolling_token_windows``), each scored as above.
* ``generate_until`` -- CP prefill + tree-decoded steps (``decode.generate``: CP rank 0's token
  choice broadcast every step, so sampled tokens are the same on every rank); a row stops at
  EOS or at a token whose text contains a stop string; the text is cut at the first stop
  string as lm-eval's ``hf`` backend cuts it.
  With ``speculative=prompt_lookup`` the steps verify prompt-lookup drafts
  (``decode.speculative``): the same greedy text, sampled text from the same distribution.

A Megatron checkpoint (``source=megatron``): a ``dist_checkpointing`` directory or a Megatron-LM
``--save`` directory whose ``common.pt`` holds the training arguments (the model's shape is read
from them); the tokenizer is a transformers tokenizer directory (``tokenizer=``, required: the
checkpoint holds none). It is checked from metadata before any process group is made, then
loaded at the CP layout with ``dist_checkpointing`` (Megatron's ``parallel_state`` groups, CP
ranks consecutive as in the ``hf`` path). Its prefill is ``ring`` (``allgather`` is refused).

Not supported yet (refused with a message naming it): prefix sharing of a context across
continuations of more than one token (each prefills it again), ``batch_size=auto``, chat
templates (``--apply_chat_template``), generation kwargs other than ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
``until``, ``max_gen_toks``; serving a Megatron model at TP or PP > 1 (it runs at TP = PP = 1;
a checkpoint saved at another layout is resharded on load). A request longer than
``max_length`` is an error, never a truncation.

Why it lives here: lm-eval is an integration like transformers; nothing below imports it.
Importing this module imports lm-eval (>= 0.4.13) and registers the backend with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from ..utils.extras import require

require("lmeval", "megatron_tree.integrations.lm_eval")
try:
    from lm_eval import utils as lm_utils
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import (handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs,
                                      postprocess_generated_text, resolve_max_length)
except ImportError as e:  # pragma: no cover -- exercised only where lm-eval is absent
    raise ImportError(
        "megatron_tree.integrations.lm_eval needs lm-evaluation-harness 0.4.13 "
        f"(pip install 'megatron_tree[lmeval]' or 'lm-eval[ruler]==0.4.13'); importing it failed: {e}"
    ) from e

from ..distributed import collectives
from ..distributed.topology import TRANSPORTS, launcher_local_size
from ..comm.merge import STRATEGIES
from ..decode import PREFILL_METHODS, generate
from .loading import NAMED_COMPILE_STEPS, load_model, model_groups

__all__ = ["BACKEND_NAME", "CHAT_TEMPLATE_REFUSED", "ModelArgs", "ModelArgsError", "RequestError", "TreeLM", "check_checkpoint",
           "model_args_from"]

BACKEND_NAME = "megatron_tree"
"""The name lm-eval's ``--model`` takes."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GEN_KWARGS = ("do_sample", "temperature", "top_k", "top_p")
"""Generation kwargs served (``until`` and ``max_gen_toks`` are read before them)."""


CHAT_TEMPLATE_REFUSED = (f"--apply_chat_template is not supported by --model {BACKEND_NAME} (its requests are scored "
                         "and generated on the prompt text as the task gives it); run without it")
_MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")
"""lm-eval's names of the generation budget (``normalize_gen_kwargs``), in its order of priority."""


def _sampling(kw: dict, asked: dict, i: int) -> tuple[bool, float, int | None, float | None]:
    """(do_sample, temperature, top_k, top_p) of one request's normalized gen kwargs ``kw``, read as transformers'
    ``generate`` (lm-eval's ``hf``) reads them: sampling needs ``do_sample`` and a temperature above 0 (else
    greedy, the rest ignored); ``top_k`` 0 or None is no top-k and ``top_p`` 1.0 or None no top-p. A value
    transformers refuses when sampling (a temperature below 0, a ``top_k`` below 0 or not an integer, a
    ``top_p`` outside (0, 1]) is a :class:`RequestError` naming the key as the request (``asked``) gave it."""

    def bad(name, why):
        return RequestError(f"generate_until request {i}: {name}={asked.get(name, kw.get(name))!r} {why}")

    try:
        temperature = float(kw["temperature"]) if kw.get("temperature") is not None else 1.0
    except (TypeError, ValueError):
        raise bad("temperature", "is not a number") from None
    if not bool(kw.get("do_sample", False)) or temperature == 0:
        return False, 1.0, None, None
    if not temperature > 0:
        raise bad("temperature", "must be >= 0 (0: greedy)")
    top_k, top_p = kw.get("top_k"), kw.get("top_p")
    if top_k is not None:
        try:
            whole = float(top_k) == int(top_k)
        except (TypeError, ValueError):
            whole = False
        if not whole or isinstance(top_k, bool) or int(top_k) < 0:
            raise bad("top_k", "must be an integer >= 0 (0: no top-k)")
        top_k = int(top_k) or None
    if top_p is not None:
        try:
            top_p = float(top_p)
        except (TypeError, ValueError):
            raise bad("top_p", "is not a number") from None
        if not 0 < top_p <= 1:
            raise bad("top_p", "must lie in (0, 1] (1: no top-p)")
        top_p = None if top_p == 1 else top_p
    return True, temperature, top_k, top_p


_COMPILE_STEP = {"auto": "auto", "false": False, "true": True, **NAMED_COMPILE_STEPS}
"""``compile_step`` model_arg -> ``enable_tree_attention(compile_step=)``."""


class ModelArgsError(ValueError):
    """A ``model_args`` key or value this backend does not take (it names the key and what is expected)."""


class RequestError(ValueError):
    """A request this backend cannot serve exactly (too long, empty, an unsupported generation kwarg)."""


@dataclass(frozen=True)
class ModelArgs:
    """What ``--model_args key=value,...`` (and lm-eval's ``--batch_size``/``--device``) may set."""

    pretrained: str
    """A transformers checkpoint directory (``save_pretrained``: ``config.json`` + safetensors), or with
    ``source=megatron`` a Megatron-Core distributed checkpoint (or Megatron-LM ``--save``) directory."""
    tokenizer: str | None = None
    """Tokenizer directory (default: ``pretrained``; required with ``source=megatron``)."""
    source: Literal["hf", "megatron"] = "hf"
    """``hf``: through transformers' own classes. ``megatron``: a Megatron-Core ``GPTModel`` with tree attention."""
    cp_size: int = 1
    """Ranks of one CP group; the world must be a multiple of it (DP = world / cp_size)."""
    intra_size: int | None = None
    """CP ranks per node (``None``: the real layout); a smaller divisor simulates nodes."""
    transport: Literal["auto", "backend", "shm"] = "auto"
    """``auto``: the CP groups' small collectives (the decode merges) through shared memory where a CP
    group's ranks share a host (CPU, gloo), the backend elsewhere; ``shm`` the same (``source=hf`` only);
    ``backend`` (``TreeGroups.build(transport=)``)."""
    strategy: str = "auto"
    """The ``tree_decode`` merge of every decode step (one of ``comm.STRATEGIES``)."""
    prefill: str | None = None
    """CP attention over the prompt chunks: ``ring`` or ``allgather`` (default: ``ring``, the only one for
    ``source=megatron``)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights and activations."""
    max_length: int | None = None
    """Longest sequence a request may need (default: the model config's, as lm-eval's ``hf`` resolves it)."""
    max_gen_toks: int = 256
    """Tokens ``generate_until`` may produce when a task does not say (lm-eval's ``hf`` default)."""
    seed: int = 1234
    """Seeds the sampling of ``generate_until`` (each batch draws with ``seed`` + its index)."""
    batch_size: int = 1
    """Rows per forward (lm-eval's ``--batch_size``; ``auto`` is not supported)."""
    max_batch_size: int | None = None
    """Accepted from lm-eval's CLI; unused (no automatic batch size)."""
    device: str | None = None
    """``cpu``, ``cuda`` (each rank takes ``cuda:LOCAL_RANK``) or ``None`` (CUDA where available)."""
    speculative: Literal["prompt_lookup"] | None = None
    """``prompt_lookup``: ``generate_until`` drafts from n-gram matches in the context and verifies the
    drafts in one decode step each (``decode.speculative``): greedy outputs are the same, sampled ones
    follow the same distribution. ``source=hf`` only."""
    speculative_width: int = 1
    """Draft chains per step (the tree's branching) with ``speculative``."""
    speculative_depth: int = 4
    """Draft tokens per chain with ``speculative``."""
    compile_step: Literal["auto", "false", "true", "aot_eager", "reduce-overhead"] = "auto"
    """Decode steps compiled whole (``enable_tree_attention(compile_step=)``, ``source=hf``): ``auto``
    (default: captured in CUDA graphs on a GPU over NCCL, eager elsewhere), ``false`` (eager), ``true``
    (Inductor), ``reduce-overhead`` (Inductor with CUDA graphs: a captured step on a GPU), ``aot_eager``
    (Dynamo without code generation, for checking); one compilation per cache shape, so it pays where
    a shape serves many steps."""


def model_args_from(args: dict) -> ModelArgs:
    """A :class:`ModelArgs` from lm-eval's parsed ``model_args`` (plus ``batch_size``/``device``).

    Every rank parses the same string, so every rank raises the same :class:`ModelArgsError`
    before any collective.
    """
    fields = {f.name: f for f in dataclasses.fields(ModelArgs)}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ModelArgsError(
            f"unknown model_args key(s) {unknown} for --model {BACKEND_NAME}; expected some of {sorted(fields)}"
        )
    if "pretrained" not in args or not args["pretrained"]:
        raise ModelArgsError(f"--model {BACKEND_NAME} needs model_args pretrained=<checkpoint directory>")
    a = dict(args)
    for name in ("cp_size", "max_length", "max_gen_toks", "seed", "intra_size", "batch_size", "max_batch_size",
                 "speculative_width", "speculative_depth"):
        v = a.get(name)
        if v is None:
            continue
        if name == "batch_size" and isinstance(v, str) and v.startswith("auto"):
            raise ModelArgsError("batch_size=auto is not supported by the megatron_tree backend; pass an integer")
        try:
            iv = int(v)
        except (TypeError, ValueError):
            raise ModelArgsError(f"model_args {name} must be an integer, got {v!r}") from None
        if iv != float(v) or (iv < 1 and name != "seed"):
            raise ModelArgsError(f"model_args {name} must be a positive integer, got {v!r}")
        a[name] = iv
    for name in ("pretrained", "tokenizer", "device"):
        if a.get(name) is not None:
            a[name] = str(a[name])
    if a.get("strategy", "auto") not in STRATEGIES:
        raise ModelArgsError(f"model_args strategy={a['strategy']!r} is not one of {list(STRATEGIES)}")
    if a.get("prefill") is not None and a["prefill"] not in PREFILL_METHODS:
        raise ModelArgsError(f"model_args prefill={a['prefill']!r} is not one of {list(PREFILL_METHODS)}")
    if a.get("dtype", "float32") not in _DTYPES:
        raise ModelArgsError(f"model_args dtype={a['dtype']!r} is not one of {sorted(_DTYPES)}")
    if a.get("speculative") in ("", "none", "None"):
        a["speculative"] = None
    if a.get("speculative") not in (None, "prompt_lookup"):
        raise ModelArgsError(f"model_args speculative={a['speculative']!r} is not one of ['prompt_lookup'] (or unset)")
    if a.get("speculative") and a.get("source") == "megatron":
        raise ModelArgsError("model_args speculative is available with source=hf only (the draft verification step "
                             "runs through transformers' layers)")
    a["compile_step"] = str(a.get("compile_step", ModelArgs.compile_step)).lower()
    if a["compile_step"] not in _COMPILE_STEP:
        raise ModelArgsError(f"model_args compile_step={args['compile_step']!r} is not one of {sorted(_COMPILE_STEP)}")
    if a["compile_step"] not in ("auto", "false") and a.get("source") == "megatron":
        raise ModelArgsError("model_args compile_step is available with source=hf only (Megatron-Core's engine "
                             "runs its own decode step)")
    if a["compile_step"] not in ("auto", "false") and a.get("speculative"):
        raise ModelArgsError(f"model_args compile_step={a['compile_step']} compiles one-token decode steps, but "
                             f"speculative={a['speculative']} verifies drafts in several-token forwards, which run "
                             "eagerly: nothing would be compiled; drop compile_step (or set it to auto or false) or "
                             "speculative")
    if a.get("transport", "auto") not in TRANSPORTS:
        raise ModelArgsError(f"model_args transport={a['transport']!r} is not one of {list(TRANSPORTS)}")
    if a.get("transport") == "shm" and a.get("source") == "megatron":
        raise ModelArgsError("model_args transport=shm is available with source=hf only (source=megatron runs on "
                             "Megatron-Core's own process groups)")
    if a.get("source", "hf") not in ("hf", "megatron"):
        raise ModelArgsError(f"model_args source={a['source']!r} is not one of ['hf', 'megatron']")
    if a.get("source") == "megatron":
        if a.get("prefill") not in (None, "ring"):
            raise ModelArgsError(f"model_args prefill={a['prefill']!r} is not available with source=megatron (its "
                                 "core attention runs the ring prefill over each rank's chunks); use prefill=ring")
        a["prefill"] = "ring"
        if not a.get("tokenizer"):
            raise ModelArgsError("source=megatron needs model_args tokenizer=<transformers tokenizer directory> (a "
                                 "Megatron checkpoint holds no tokenizer)")
    elif a.get("prefill") is None:
        a["prefill"] = "ring"
    return ModelArgs(**a)


def check_checkpoint(args: ModelArgs):
    """Refuse what cannot load before any process group is made (the same on every rank).

    returns, for ``source=megatron``, ``(GPTShape, CheckpointInfo)``: the shape read from the
    stored training arguments and the checked checkpoint (metadata only, no tensor); else None.
    """
    if args.source == "megatron":
        try:
            from .megatron import checkpoint as mc
        except ImportError as e:
            raise ModelArgsError(f"source=megatron needs megatron-core (pip install 'megatron_tree[megatron]'); "
                                 f"importing it failed: {e}") from None
        try:
            shape = mc.shape_from_checkpoint(args.pretrained)
            return shape, mc.check_checkpoint(args.pretrained, shape)
        except mc.CheckpointError as e:
            raise ModelArgsError(f"pretrained={args.pretrained!r} (source=megatron) cannot be loaded: {e}") from None
    # the check load_hf_model repeats on every rank of the CP group; here before any process group exists
    from .hf.checkpoint import CheckpointError, check_checkpoint as check_hf

    try:
        checked = check_hf(args.pretrained)
    except CheckpointError as e:
        raise ModelArgsError(f"pretrained={args.pretrained!r} is not a transformers checkpoint directory that loads as "
                             f"saved: {e}") from None
    from .hf.common import position_window

    window = position_window(checked.config)
    if args.max_length is not None and window is not None and args.max_length > window:
        # the CP prefill refuses longer prompts: the first request beyond the window would fail mid-evaluation
        raise ModelArgsError(
            f"model_args max_length={args.max_length} is beyond the model's window (max_position_embeddings = "
            f"{window}, {args.pretrained}/config.json), which this backend's CP prefill does not run past; use "
            f"max_length <= {window} or a model configured for longer contexts")


# --------------------------------------------------------------------------- process groups


def _world() -> tuple[int, int]:
    """(global rank, world size): the process group's, else the launcher's environment, else one process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _device(args: ModelArgs) -> torch.device:
    want = args.device
    if want is None:
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cpu":
        return torch.device("cpu")
    if want.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelArgsError(f"device={want!r} but CUDA is not available here; pass --device cpu")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(dev)  # NCCL's object collectives (lm-eval's gather) use the current device
        return dev
    raise ModelArgsError(f"device={want!r} is not supported; expected cpu or cuda")


def _hierarchical(args: ModelArgs) -> list[int] | None:
    """Megatron's ``hierarchical_context_parallel_sizes`` for ``intra_size`` (``None``: one level)."""
    intra = args.intra_size
    return [intra, args.cp_size // intra] if intra is not None and 1 < intra < args.cp_size else None


def _check_world(args: ModelArgs) -> tuple[int, int]:
    """(global rank, world size), refusing a CP layout the world cannot hold (no collective)."""
    rank, world = _world()
    if world % args.cp_size:
        raise ModelArgsError(
            f"cp_size={args.cp_size} does not divide the world of {world} ranks (world = DP x CP); launch a "
            f"multiple of {args.cp_size} ranks or change cp_size"
        )
    if args.intra_size is not None and args.cp_size % args.intra_size:
        raise ModelArgsError(f"intra_size={args.intra_size} does not divide cp_size={args.cp_size}")
    return rank, world


def _build_groups(args: ModelArgs, device: torch.device, rank: int, world: int):
    """(CP groups or None, DP group or None, DP rank, DP size); every rank calls it alike.

    rank, world: from :func:`_check_world` (the layout already checked against the world).

    ``source=megatron``: Megatron's ``parallel_state`` is initialised (TP = PP = 1, CP =
    ``cp_size``: its CP groups are the same consecutive ranks) and the CP groups are its own;
    a one-process world gets a one-rank gloo group (Megatron's modules need one).
    """
    megatron = args.source == "megatron"
    if world == 1 and not megatron:
        return None, None, 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    cp, dp_size = args.cp_size, world // args.cp_size
    per_node = launcher_local_size(os.environ)[0] if megatron else None  # names Megatron's flat groups' level
    groups = model_groups(args.source, cp, hierarchical=_hierarchical(args), intra_size=args.intra_size,
                          timeout_s=collectives.group_timeout().total_seconds(), transport=args.transport,
                          cp_ranks=[list(range(d * cp, (d + 1) * cp)) for d in range(dp_size)], per_node=per_node)
    dp_group = None
    if dp_size > 1:
        td = collectives.group_timeout()
        for c in range(cp):  # every rank makes every DP group, in the same order
            g = collectives.new_group([d * cp + c for d in range(dp_size)], timeout=td)
            if rank % cp == c:
                dp_group = g
    return groups, dp_group, rank // cp, dp_size


# --------------------------------------------------------------------------- the backend


@register_model(BACKEND_NAME)
class TreeLM(TemplateLM):
    """lm-eval's ``LM`` over a transformers checkpoint, CP-sharded with tree attention (module docstring)."""

    def __init__(self, **kwargs):
        super().__init__()
        self.args = args = model_args_from(kwargs)
        megatron = check_checkpoint(args)
        rank, world = _check_world(args)
        self._device = _device(args)
        if args.compile_step == "reduce-overhead" and self._device.type != "cuda":
            raise ModelArgsError(f"model_args compile_step=reduce-overhead captures the decode step in a CUDA graph, "
                                 f"but the device is {self._device.type}; use compile_step=true (compiled, not "
                                 "captured) there")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.pretrained)
        if megatron is not None and len(self.tokenizer) > megatron[0].vocab_size:
            raise ModelArgsError(
                f"tokenizer={args.tokenizer!r} has {len(self.tokenizer)} tokens but the checkpoint's vocabulary "
                f"(padded_vocab_size) is {megatron[0].vocab_size}: its ids would fall outside the embedding"
            )
        self._stack = contextlib.ExitStack()
        """What a Megatron model needs while it lives (the CPU shim of ``megatron_on_cpu``); see :meth:`close`."""
        if megatron is not None and self._device.type == "cpu":
            from .megatron.cpu import megatron_on_cpu

            self._stack.enter_context(megatron_on_cpu())
        self.groups, self._dp_group, self._rank, self._world_size = _build_groups(args, self._device, rank, world)
        if megatron is not None:
            shape, info = megatron
            self.model = load_model("megatron", self.groups, device=self._device, dtype=_DTYPES[args.dtype],
                                    shape=shape, dist_dir=info.dist_dir, cp_size=args.cp_size,
                                    hierarchical=_hierarchical(args), strategy=args.strategy, seed=args.seed)
            self._max_length = args.max_length or megatron[0].max_position_embeddings
        else:
            self.model = load_model("hf", self.groups, path=args.pretrained, dtype=_DTYPES[args.dtype],
                                    device=self._device, strategy=args.strategy, prefill=args.prefill,
                                    compile_step=_COMPILE_STEP[args.compile_step])
            self._max_length = args.max_length or resolve_max_length(self.model.hf.config, self.tokenizer)
        self.batch_size = args.batch_size
        self.scored = 0
        """Requests (context, continuation token pairs) this rank scored: each unique pair once."""
        self.prefill_tokens = 0
        """Tokens this rank's CP group prefilled for scoring and generation (whole rows, pads excluded)."""
        self.prefill_tokens_unshared = 0
        """Tokens scoring would have prefilled with one row per (context, continuation) pair."""
        self._generations = 0
        self._stop_ids_of: dict = {}
        """Stop strings (sorted) -> the stop token ids :meth:`_stop_ids` found for them."""
        self._vocab_texts: list | None = None
        """(id, text) of every token but the special ones, decoded at the first ``generate_until`` with a stop."""

    def close(self) -> None:
        """Leave Megatron's CPU shim and destroy its model-parallel groups (``source=megatron``); idempotent."""
        if self.args.source == "megatron" and getattr(self, "_stack", None) is not None:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            self._stack.close()
            self._stack = None

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        """``model_args`` over lm-eval's ``--batch_size`` / ``--max_batch_size`` / ``--device``
        (``additional_config``): a key in both takes the ``model_args`` value (lm-eval's CLI always passes
        ``batch_size``, 1 by default, so the flag's value alone cannot say whether it was given)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**dict(arg_dict), **extra)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """Chat templates are refused (:class:`ModelArgsError` naming ``--apply_chat_template``): lm-eval asks
        here first when the flag is given."""
        if chat_template:
            raise ModelArgsError(CHAT_TEMPLATE_REFUSED)
        return None

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        raise ModelArgsError(CHAT_TEMPLATE_REFUSED)

    # ------------------------------------------------------------------ lm-eval's distributed slots

    @property
    def rank(self) -> int:
        """The DP rank: documents are sharded over DP groups; CP peers share one."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The DP size (world / cp_size)."""
        return self._world_size

    @property
    def cp_rank(self) -> int:
        return 0 if self.groups is None else self.groups.rank

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every DP rank's ``tensor`` concatenated along dim 0 (a 0-d tensor gives (dp,))."""
        if self._dp_group is None:
            return tensor
        t = tensor.reshape(1) if tensor.dim() == 0 else tensor
        out = collectives.all_gather(t.to("cpu") if self._device.type == "cpu" else t, self._dp_group,
                                     level="dp", what="lm-eval: all_gather over the DP group")
        return out.reshape(-1, *t.shape[1:])

    def gather_object(self, obj, dst: int = 0):
        """Every DP rank's ``obj`` on DP rank ``dst`` (a list in DP-rank order), ``None`` elsewhere."""
        if self._dp_group is None:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        cp = self.args.cp_size
        dist.gather_object(obj, out, dst=dst * cp + self.cp_rank, group=self._dp_group)
        return out

    def barrier(self) -> None:
        if self._dp_group is not None:
            dist.barrier(group=self._dp_group)

    # ------------------------------------------------------------------ tokens

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self.args.max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As lm-eval's ``hf`` encodes: the tokenizer's own special tokens, none when ``string`` starts with BOS."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special = {"add_special_tokens": False}
        return self.tokenizer.encode(string, **special)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def get_model_info(self) -> dict:
        return {"source": self.args.source, "cp_size": self.args.cp_size, "dp_size": self._world_size,
                "strategy": self.args.strategy,
                "prefill": self.args.prefill, "dtype": self.args.dtype, "max_length": self._max_length}

    # ------------------------------------------------------------------ scoring

    def _forward_rows(self, rows: list[tuple[tuple[int, ...], int]]) -> list[torch.Tensor]:
        """Log-probs of each row's last ``k`` predictions, one CP-sharded forward.

        rows: (input tokens, k); the inputs are left-padded to the longest and the forward returns
        the logits of the last max(k) positions only: (batch, K, vocab), identical on every CP rank.
        returns per row: (k, vocab) float32 log-probs of the tokens after its last k positions.
        """
        seq = max(len(i) for i, _ in rows)
        kmax = max(k for _, k in rows)
        ids = torch.zeros(len(rows), seq, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, (inp, _) in enumerate(rows):
            ids[b, seq - len(inp):] = torch.as_tensor(inp, dtype=torch.long)
            mask[b, seq - len(inp):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        dev = self._device
        cache = self.model.new_cache(len(rows), seq)
        if self.args.source == "megatron":  # unpadded rows, only the last kmax positions' logits computed
            logprobs = torch.log_softmax(self.model.prefill_logits([i for i, _ in rows], cache, kmax), dim=-1)
            self.prefill_tokens += sum(len(i) for i, _ in rows)
            return [logprobs[b, kmax - k:] for b, (_, k) in enumerate(rows)]
        with torch.no_grad():
            out = self.model.hf(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev),
                                past_key_values=cache, logits_to_keep=torch.arange(seq - kmax, seq, device=dev))
        logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # (B, K, V)
        self.prefill_tokens += sum(len(i) for i, _ in rows)
        return [logprobs[b, kmax - k:] for b, (_, k) in enumerate(rows)]

    def _check_scored(self, requests) -> None:
        for i, (key, ctx, cont) in enumerate(requests):
            if len(ctx) == 0 or len(cont) == 0:
                raise RequestError(f"loglikelihood request {i} ({key!r}) has an empty context or continuation")
            if len(ctx) + len(cont) - 1 > self.max_length:
                raise RequestError(
                    f"loglikelihood request {i} needs {len(ctx) + len(cont) - 1} tokens (context {len(ctx)} + "
                    f"continuation {len(cont)} - 1), beyond max_length={self.max_length}; this backend never "
                    "truncates: raise max_length (model_args) or shorten the task's contexts"
                )

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """lm-eval's token-level scoring: requests are ((context, continuation) | None, ctx_ids, cont_ids).

        Each unique (context, continuation) pair is scored once. Pairs whose model input
        (context + continuation[:-1]) is the same -- the choices of a multiple-choice question
        whose continuations are one token each -- share one row of one forward: the context is
        prefilled once and each continuation is read from the same logits.
        """
        self._check_scored(requests)
        pairs: dict[tuple, tuple] = {}  # (ctx, cont) -> its model input
        need: dict[tuple, int] = {}  # model input -> positions to score
        for _, ctx, cont in requests:
            key = (tuple(ctx), tuple(cont))
            if key not in pairs:
                inp = (key[0] + key[1])[:-1]
                pairs[key] = inp
                need[inp] = max(need.get(inp, 0), len(cont))
        by_row: dict[tuple, list[tuple]] = {}
        for key, inp in pairs.items():
            by_row.setdefault(inp, []).append(key)
        rows = sorted(need, key=lambda i: (-len(i), i))  # longest first, as hf batches
        scores: dict[tuple, tuple[float, bool]] = {}
        for i in range(0, len(rows), self.batch_size):
            chunk = rows[i:i + self.batch_size]
            for inp, lp_row in zip(chunk, self._forward_rows([(inp, need[inp]) for inp in chunk])):
                for key in by_row[inp]:
                    cont = key[1]
                    lp = lp_row[lp_row.shape[0] - len(cont):]  # (len(cont), V)
                    want = torch.as_tensor(cont, dtype=torch.long, device=lp.device)
                    scores[key] = (float(lp.gather(1, want[:, None]).sum()), bool((lp.argmax(-1) == want).all()))
        self.scored += len(pairs)
        self.prefill_tokens_unshared += sum(len(inp) for inp in pairs.values())
        res = []
        for key, ctx, cont in requests:
            r = scores[(tuple(ctx), tuple(cont))]
            res.append(r)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log-probs of each document, over lm-eval's rolling windows of ``max_length`` tokens."""
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            ws = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            windows.extend((None, ctx, cont) for ctx, cont in ws)
            counts.append(len(ws))
        scores = self._loglikelihood_tokens(windows, disable_tqdm=True)
        out, at = [], 0
        for req, n in zip(requests, counts):
            total = sum(s for s, _ in scores[at:at + n])
            at += n
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    # ------------------------------------------------------------------ generation

    def _stop_ids(self, until: list[str]) -> list[int]:
        """EOS and every token whose own text contains a stop string (the row's text is cut there anyway).
        Remembered per set of stop strings: a task repeats one set for every request, and finding its tokens
        reads the text of the whole vocabulary (the vocabulary's texts are decoded once per backend)."""
        terms = tuple(sorted({t for t in until if t}))
        cache = self._stop_ids_of
        if terms in cache:
            return list(cache[terms])
        ids = {self.eot_token_id}
        gc = getattr(getattr(self.model, "hf", None), "generation_config", None)
        eos = getattr(gc, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
        if terms:
            if self._vocab_texts is None:
                special = set(self.tokenizer.all_special_ids)
                texts = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))])
                self._vocab_texts = [(i, s) for i, s in enumerate(texts) if i not in special]
            ids.update(i for i, s in self._vocab_texts if any(t in s for t in terms))
        vocab = getattr(self.model, "vocab_size", None)  # a tokenizer may know ids past the model's logits
        cache[terms] = sorted(i for i in ids if i is not None and (vocab is None or 0 <= i < vocab))
        return list(cache[terms])

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, **kw) -> list[list[int]]:
        """Each prompt's new tokens (up to and including a stop token): the decode tier's one loop."""
        if self.args.speculative:
            from ..decode.speculative import SpeculativeConfig

            kw["speculative"] = SpeculativeConfig(method=self.args.speculative, width=self.args.speculative_width,
                                                  depth=self.args.speculative_depth)
        return generate(self.model, prompts, max_new_tokens, strategy=self.args.strategy, progress=False, **kw).tokens

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy or sampled continuations, cut at the first stop string (every CP rank returns the same)."""
        args = [req.args for req in requests]
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        plans = []
        for i, (context, gen_kwargs) in enumerate(args):  # every request checked before any forward
            if not isinstance(gen_kwargs, dict):
                raise RequestError(f"generate_until request {i}: gen_kwargs must be a dict, got {gen_kwargs!r}")
            try:
                kw = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            except (TypeError, ValueError) as e:  # e.g. max_gen_toks=ten: int() of it
                raise RequestError(f"generate_until request {i}: gen_kwargs {gen_kwargs!r}: {e}") from None
            until = handle_stop_sequences(kw.pop("until", None), eos=eos)
            max_gen = int(kw.pop("max_gen_toks"))
            if max_gen < 1:  # lm-eval's hf would still generate one token (max_length = the context's)
                name = next((n for n in _MAX_TOKEN_KEYS if gen_kwargs.get(n) is not None), "max_gen_toks")
                raise RequestError(f"generate_until request {i}: {name}={gen_kwargs.get(name, max_gen)!r} must be a "
                                   "positive integer (tokens to generate)")
            other = sorted(set(kw) - set(_GEN_KWARGS))
            if other:
                raise RequestError(
                    f"generate_until request {i} asks for generation kwargs {other}; the megatron_tree backend "
                    f"serves {['until', 'max_gen_toks', *_GEN_KWARGS]}"
                )
            sampling = _sampling(kw, gen_kwargs, i)
            ctx = self.tok_encode(context)
            if not ctx:
                raise RequestError(f"generate_until request {i} has an empty context")
            if len(ctx) + max_gen > self.max_length:
                raise RequestError(
                    f"generate_until request {i} has a context of {len(ctx)} tokens; with max_gen_toks={max_gen} it "
                    f"needs {len(ctx) + max_gen}, beyond max_length={self.max_length}; this backend never truncates"
                )
            plans.append((ctx, until, max_gen, *sampling))
        res: list[str | None] = [None] * len(args)
        groups: dict[str, list[int]] = {}  # one batch never mixes generation kwargs (lm-eval's hf neither)
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(repr(sorted(gen_kwargs.items(), key=lambda kv: kv[0])), []).append(i)
        batches = []
        for members in groups.values():
            members.sort(key=lambda i: (-len(plans[i][0]), args[i][0]))  # longest first, as hf batches
            batches.extend(members[j:j + self.batch_size] for j in range(0, len(members), self.batch_size))
        for chunk in batches:
            _, until, max_gen, sample, temp, top_k, top_p = plans[chunk[0]]
            seed = self.args.seed + self._generations
            self._generations += 1
            out = self._generate([plans[i][0] for i in chunk], max_gen, do_sample=sample, temperature=temp,
                                 top_k=top_k, top_p=top_p, stop_token_ids=self._stop_ids(until), seed=seed)
            self.prefill_tokens += sum(len(plans[i][0]) for i in chunk)
            for i, toks in zip(chunk, out):
                s = postprocess_generated_text(self.tok_decode(toks), until, None)
                res[i] = s
                self.cache_hook.add_partial("generate_until", args[i], s)
        return res
