"""The sharded forward that replaces ``model.forward``: a forward that starts a sequence runs each
CP rank on its chunk of the (unpadded) prompt and assembles the requested logits on every rank;
a forward on a filled cache appends one token per row."""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import logging
import operator

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from .common import (_SETTINGS, UnsupportedModelError, _Binding, _comm_device, _describe, _same_groups, _text_config,
                     position_window, rotary_positions)
from .cache import TreeCache

from ...comm.merge import CompileError
from ...distributed import agreement
from ...distributed.collectives import CommStats, StatsSlot
from ...decode.generate import DecodeStep
from ...decode.cache import static_length
from ...decode.prefill import assemble_logits
from ...ops import resolve_backend
from ...ops.contract import no_backward
from ...utils import user_compile

log = logging.getLogger("megatron_tree.integrations")


def _mask_lengths(mask: torch.Tensor, batch: int, seq: int) -> list[int]:
    """Real tokens per row of a left-padded 2-D mask; anything else is an error."""
    if mask.dim() != 2 or tuple(mask.shape) != (batch, seq):
        raise ValueError(
            f"attention_mask must be a 2-D (batch, seq) = {(batch, seq)} padding mask at the start of a sequence, "
            f"got shape {tuple(mask.shape)}"
        )
    m = mask.to(torch.bool)
    n = m.sum(dim=1)
    want = torch.arange(seq, device=m.device)[None, :] >= (seq - n)[:, None]
    bad = (m != want).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"attention_mask rows {bad} are not left-padded (zeros, then ones); tree attention drops padding by "
            "position and needs left padding, as generate does (tokenizer.padding_side = 'left'). Without an "
            "attention_mask, generate makes one from pad_token_id: a prompt that holds the pad token id among its "
            "tokens needs its attention_mask passed"
        )
    empty = (n == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask rows {empty} have no tokens; every row needs at least one")
    return n.tolist()


def _normalise_call(orig, args, kwargs) -> dict:
    sig = inspect.signature(orig)
    bound = sig.bind_partial(*args, **kwargs)
    call = dict(bound.arguments)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in call:
            call.update(call.pop(name))
    return call


def _pop_cache(call: dict):
    caches = [call.pop(n) for n in ("cache", "past_key_values") if n in call]
    caches = [c for c in caches if c is not None]
    if len(caches) > 1:
        raise ValueError("pass the cache once, as `cache` or `past_key_values`, not both")
    return caches[0] if caches else None


def _sharded_forward(model, orig, binding: _Binding, args, kwargs, prior=None):
    """One call of the tree-enabled ``model.forward``. ``prior``: the frame-evaluation callback of a
    ``torch.compile`` around that forward (``utils.user_compile``), taken aside while this runs; its
    decode steps' device halves run under it, so they are compiled with that call's settings."""
    if torch.compiler.is_compiling():
        raise CompileError(
            "torch.compile was given the forward of a model running tree attention: its prefill plans the "
            "prompt's placement and checks every rank's call on the host, which a graph cannot hold. Compile "
            "the decode step instead: enable_tree_attention(model, groups, compile_step=True) (or a dict of "
            "torch.compile arguments, e.g. {'mode': 'reduce-overhead'}); generate then runs compiled steps"
        )
    call = _normalise_call(orig, args, kwargs)
    cache = _pop_cache(call)
    for name in ("labels", "output_attentions", "output_hidden_states"):
        if call.get(name) is not None and call.get(name) is not False:
            raise NotImplementedError(
                f"{name} is not supported with tree attention (inference only: outputs are assembled for the "
                "requested logits, not for per-layer states or a loss)"
            )
    return_dict = call.pop("return_dict", None)
    use_cache = call.pop("use_cache", None)
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    src = ids if ids is not None else embeds
    if src is None:
        raise ValueError("pass input_ids or inputs_embeds")
    batch, q_len = src.shape[0], src.shape[1]

    returned = not (use_cache is False and cache is None)  # else a one-off cache, dropped after this forward
    if cache is None or (not isinstance(cache, TreeCache) and cache.get_seq_length() == 0):
        # static (shapes fixed, what a compiled step needs) when steps are compiled -- compile_step, or
        # a torch.compile around this forward -- or when the caller handed a compileable cache
        # (generate(cache_implementation="static"): transformers then compiles the decode calls itself)
        static = (compiled_for(binding, src.device) is not None or user_compile.compiling(prior)
                  or (cache is not None and bool(getattr(cache, "is_compileable", False))))
        cache = TreeCache(model, binding.groups, layout=binding.layout, block_size=binding.block_size,
                          new_tokens=binding.new_tokens_hint, static=static, pool=binding.pool)
    elif not isinstance(cache, TreeCache):
        raise ValueError(
            f"got a {type(cache).__name__} holding {cache.get_seq_length()} tokens; tree attention continues only "
            "a TreeCache (the other cache's keys were computed without sharding)"
        )
    if not _same_groups(cache.groups, binding.groups):
        alike = (cache.groups is not None and binding.groups is not None
                 and cache.groups.cp_ranks == binding.groups.cp_ranks)
        why = ("; the same ranks, but another process group: the cache's TreeGroups and the model's were built "
               "separately" if alike else "")
        raise ValueError(
            f"this TreeCache was made for {_describe(cache.groups, alike)}, but the model runs tree attention over "
            f"{_describe(binding.groups, alike)}{why}; create the cache with the model's groups"
        )
    if cache.num_layers != binding.num_layers:
        raise ValueError(f"TreeCache has {cache.num_layers} layers, the model {binding.num_layers}")

    filled = cache.get_seq_length() > 0
    if filled:
        out = _decode(orig, binding, cache, call, batch, q_len, prior)
    else:
        out = _prefill(model, orig, binding, cache, call, batch, q_len)
    if not (filled and q_len == 1) and user_compile.compiling(prior):  # (one new token per row: the compiled step)
        user_compile.ran_whole(prior)  # a fullgraph=True compile around a forward that traced nothing
    if torch.is_grad_enabled() and isinstance(out.get("logits"), torch.Tensor):
        _refuse_backward(model, binding, out, embeds, filled, q_len)
    out[binding.cache_kwarg] = cache if returned else None
    return out if return_dict is not False else out.to_tuple()


def _refuse_backward(model, binding: _Binding, out, embeds, filled: bool, q_len: int) -> None:
    """Where a forward with gradients on read keys that record none -- the peers' (CP > 1, by collectives), a cache
    it continues, or the earlier windows of a chunked prefill (stored in the cache) -- its logits become views whose
    backward raises (``contract.no_backward``) instead of a gradient that silently lacks those keys' part. They
    are tied to every parameter that records gradients (and to ``inputs_embeds``), so every rank's logits refuse
    alike, also those that arrive by a collective. A one-rank prefill in one forward reads no such key: its
    gradient is transformers' own."""
    chunk = prefill_chunk(binding.max_prefill_tokens, binding.cp_size)
    cp = binding.groups is not None and binding.groups.size > 1
    if not (cp or filled or chunk is not None and q_len > chunk):
        return
    inputs = tuple(p for p in model.parameters() if p.requires_grad)
    inputs += (embeds,) if isinstance(embeds, torch.Tensor) and embeds.requires_grad else ()
    what = ("a transformers forward with tree attention at CP > 1" if cp else
            "a transformers forward with tree attention over a cache" if filled else
            "a chunked prefill (max_prefill_tokens) with tree attention")
    out["logits"], = no_backward(what, (out["logits"],), inputs)


def _length_dependent(rotary) -> bool:
    """Whether a rotary module picks its frequencies from the largest position it is handed."""
    kinds = rotary.rope_type.values() if isinstance(rotary.rope_type, dict) else [rotary.rope_type]
    return any("dynamic" in str(k) or k == "longrope" for k in kinds)


@contextlib.contextmanager
def _rope_sees(rotaries, last: torch.Tensor):
    """While the sharded prefill runs, every length-dependent rotary module also sees position ``last``.

    transformers' ``dynamic`` and ``longrope`` RoPE choose (and for ``dynamic`` remember) their
    frequencies from ``max(position_ids) + 1``: on a CP rank that is its chunk's largest position,
    not the prompt's. Each call gets one extra column holding ``last`` (the largest position the
    single-process forward is handed, a device scalar: no host read) and its cos/sin lose that column
    again, so the module updates exactly as it would in one process and the chunk's own positions
    are rotated with those frequencies.
    """
    patched = [m for m in rotaries if _length_dependent(m)]

    def wrap(m):
        inner = m.forward

        def forward(x, position_ids, *args, **kwargs):
            if position_ids.dim() != 2:
                raise UnsupportedModelError(
                    f"{type(m).__name__} got position_ids of shape {tuple(position_ids.shape)}; length-dependent "
                    "RoPE is supported for (batch, seq) positions"
                )
            extra = last.to(position_ids.device, position_ids.dtype).reshape(1, 1).expand(position_ids.shape[0], 1)
            cos, sin = inner(x, torch.cat([position_ids, extra], dim=1), *args, **kwargs)
            return cos[:, :-1], sin[:, :-1]

        m.forward = forward

    try:
        for m in patched:
            wrap(m)
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)


def _run(orig, binding, cache, call):
    binding.active = cache
    call[binding.cache_kwarg] = cache
    try:
        out = orig(**call, use_cache=True, return_dict=True)
        cache._finish()
    finally:
        binding.active = None
        cache.metadata = None
    return out


def _checksum(t: torch.Tensor | None):
    """A position-weighted sum of ``t``'s values (host int or float): equal inputs give equal sums."""
    if t is None:
        return None
    flat = t.detach().reshape(-1)
    w = torch.arange(1, flat.numel() + 1, device=flat.device)
    if flat.is_floating_point():
        return float((flat.double() * w).sum())
    return int(((flat.long() + 1) * w).sum())


_WIDTHS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")
"""Model widths every CP rank's replica must share (compared at prefill)."""


def _prefill(model, orig, binding: _Binding, cache: TreeCache, call: dict, batch: int, seq: int):
    """The forward that starts a sequence, each CP rank on its chunk.

    Per rank (every rank passes the same call):

    input_ids: (batch, seq) or inputs_embeds: (batch, seq, hidden) -- the left-padded prompt
    attention_mask: (batch, seq) 2-D padding mask or None; position_ids: (batch|1, seq) or None
    runs the model on (batch, W) tokens, W = this rank's largest share of a row (pads dropped)
    returns the model's output with logits: (batch, K, vocab) for the K positions asked for
        (``logits_to_keep``), identical on every rank; 0 at pad positions

    Collectives (CP > 1): an all-gather of the call's arguments and of whether this rank's checks of
    them passed (``agreement.agree``), the prefill method's per layer
    (``prefill.cp_prefill``), one all-reduce SUM of (batch, K, vocab) float32 (float64 for a float64 model).
    """
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    device = (ids if ids is not None else embeds).device
    mask = call.pop("attention_mask", None)
    pos_ids = call.pop("position_ids", None)
    ltk = call.pop("logits_to_keep", 0) if binding.accepts_logits_to_keep else 0
    checked = {}

    def signature():
        """This rank's checks of the call; the values every CP rank must pass alike.

        Ranks handed different prompts would each compute their chunk of another prompt.
        max_new_tokens: generate's budget (None outside generate); ranks with different budgets
        would run in step until the first stops, then the others would wait in a collective for it.
        """
        lengths = [seq] * batch if mask is None else _mask_lengths(mask, batch, seq)
        pos = pos_ids
        if pos is None:  # what transformers uses without position_ids: 0..seq-1 on the padded row
            pos = torch.arange(seq, device=device)[None, :]
        if pos.dim() != 2 or pos.shape[-1] != seq or pos.shape[0] not in (1, batch):
            raise NotImplementedError(
                f"position_ids of shape {tuple(pos.shape)} are not supported; expected (batch, seq) or (1, seq)"
            )
        window = position_window(cfg)  # None: dynamic NTK RoPE is built to run past it
        if window is not None and max(lengths) > window:
            rotary = rotary_positions(cfg)
            if not (binding.allow_beyond_window and rotary):
                how = ("shorten it, use a model configured for longer contexts, or pass enable_tree_attention("
                       "allow_beyond_window=True) (its RoPE is computed for any position)" if rotary else
                       "its position embeddings are a table of that many rows: shorten it or use a model configured "
                       "for longer contexts")
                raise ValueError(f"a prompt has {max(lengths)} tokens, more than the model's window "
                                 f"(max_position_embeddings = {window}); {how} (nothing is truncated)")
        cache._check_prefill(lengths)
        # Which padded positions' logits to return.
        if isinstance(ltk, int):
            wanted = torch.arange(seq - ltk if 0 < ltk <= seq else 0, seq, device=device)
        else:
            wanted = torch.as_tensor(ltk, device=device).reshape(-1) % seq
        checked.update(lengths=lengths, pos_ids=pos.expand(batch, seq), wanted=wanted)
        return (batch, seq, _checksum(ids), _checksum(embeds), _checksum(mask), _checksum(pos.expand(batch, seq)),
                _checksum(wanted),
                binding.strategy, binding.prefill, binding.layout, binding.block_size, binding.new_tokens_hint,
                binding.max_prefill_tokens, None if binding.compiled is None else binding.compiled.setting(),
                *(getattr(cfg, n, None) for n in _WIDTHS),
                *(binding.settings_hint or (None,) * len(_SETTINGS)))

    # The model's shape too: replicas whose attention shapes agree but whose widths do not would pass every
    # collective of the forward (chunks' keys, the logits' SUM) and return a mixture of two models.
    cfg = _text_config(model.config)
    names = ("batch", "seq", "input_ids", "inputs_embeds", "attention_mask", "position_ids", "logits_wanted",
             "strategy", "prefill", "layout", "block_size", "max_new_tokens", "max_prefill_tokens", "compile_step",
             *_WIDTHS,
             *_SETTINGS)
    g = binding.groups
    group, ranks = (None, ()) if g is None else (g.cp_group, g.cp_ranks)
    agreement.agree("hf.prefill", names, signature, group, ranks, stats=binding.stats,
                    device=None if g is None else _comm_device(g, device))
    lengths, pos_ids, wanted = checked["lengths"], checked["pos_ids"], checked["wanted"]
    chunk = prefill_chunk(binding.max_prefill_tokens, binding.cp_size)
    local = cache._begin_prefill(lengths, seq, chunk).to(device)  # (B, W) unpadded positions, -1 = filler
    pad = seq - torch.as_tensor(lengths, device=device)
    compact = wanted[None, :] - pad[:, None]  # (B, K) unpadded position, < 0 for a pad
    if chunk is None or max(lengths) <= chunk:
        windows = [None]
    else:
        windows = _windows(local, chunk, -(-max(lengths) // chunk))
    inputs = {name: call.get(name) for name in ("input_ids", "inputs_embeds")}
    parts, part_pos = [], []
    for w, window in enumerate(windows):
        if window is None:
            qpos = local
        else:
            slots, kv_end = window
            qpos = cache._begin_window(slots, kv_end, last=w == len(windows) - 1, padded=seq)
        idx = pad[:, None] + qpos.clamp(min=0)  # index into the padded row
        if inputs["input_ids"] is not None:
            call["input_ids"] = inputs["input_ids"].gather(1, idx)
        else:
            emb = inputs["inputs_embeds"]
            call["inputs_embeds"] = emb.gather(1, idx[..., None].expand(-1, -1, emb.shape[-1]))
        call["position_ids"] = pos_ids.gather(1, idx)
        call["attention_mask"] = None
        # Which of the wanted positions this rank holds: the model computes logits only there.
        needed = ((qpos[:, :, None] == compact[:, None, :]) & (compact[:, None, :] >= 0)).any(dim=2).any(dim=0)
        local_pos = qpos
        if binding.accepts_logits_to_keep:
            rows_local = needed.nonzero().flatten()  # local slots some row needs
            call["logits_to_keep"] = rows_local
            local_pos = qpos[:, rows_local]
        with _rope_sees(binding.rotary, pos_ids.max()):
            out = _run(orig, binding, cache, call)
        parts.append(out.logits)  # (B, |rows_local| or W, V)
        part_pos.append(local_pos)
    logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    local_pos = part_pos[0] if len(part_pos) == 1 else torch.cat(part_pos, dim=1)
    out.logits = assemble_logits(logits, local_pos, compact, g, stats=binding.stats,
                                 device=None if g is None else _comm_device(g, device)).to(logits.dtype)
    return out


def prefill_chunk(max_prefill_tokens: int | None, cp_size: int) -> int | None:
    """The window a chunked prefill runs per forward: ``max_prefill_tokens`` rounded down to a multiple
    of ``2 * cp_size`` (so every window's load-balanced chunks are equal and no rank holds more than
    its share), and at least ``2 * cp_size`` (one chunk pair per rank: a smaller window cannot be
    balanced, and a rank would be handed more of the prompt than its cache holds); None: no chunking."""
    if max_prefill_tokens is None:
        return None
    unit = 2 * cp_size
    return max(unit, max_prefill_tokens - max_prefill_tokens % unit)


def _windows(local: torch.Tensor, chunk: int, count: int) -> list:
    """Per window of a chunked prefill: this rank's storage slots of its tokens (B, S), -1 = filler, and
    the slot end its attention reads. local: (B, W) positions in slot order (ascending), -1 = filler.

    A window's tokens are consecutive slots of each row (the layout keeps positions ascending); S is
    at least 1 so that every rank runs every window's forward (its collectives), with fillers."""
    valid = local >= 0
    out = []
    for w in range(count):
        lo, hi = w * chunk, (w + 1) * chunk
        start = (valid & (local < lo)).sum(dim=1)  # (B,) first slot of the window
        n = (valid & (local >= lo) & (local < hi)).sum(dim=1)
        width = max(1, int(n.max()))
        j = torch.arange(width, device=local.device)[None, :]
        slots = torch.where(j < n[:, None], start[:, None] + j, -1)
        out.append((slots, max(1, int((start + n).max()))))
    return out


def _decode(orig, binding: _Binding, cache: TreeCache, call: dict, batch: int, q_len: int, prior=None):
    """New tokens on a filled cache: input_ids (batch, q_len) -> logits (batch, q_len, vocab) (or those
    ``logits_to_keep`` asks for).

    The same on every rank; one ``tree_decode`` merge per layer (its strategy's collectives). Several
    new tokens per row (``q_len > 1``: assisted decoding's verification forward) go through
    :func:`_decode_chain`. The device half (:func:`device_step`) runs compiled when ``compile_step``
    asked for it, or when a ``torch.compile`` surrounds the forward (``prior``, its callback): then
    with that compile's settings, one trace per step shape.
    """
    mask = call.pop("attention_mask", None)
    if mask is not None and mask.dim() != 2:
        raise NotImplementedError(
            f"a {mask.dim()}-D attention_mask is not supported; tree attention takes the 2-D padding mask only "
            "(causality and padding come from global token positions)"
        )
    if mask is not None and mask.shape[-1] >= q_len:
        _check_unpadded(mask, q_len)
    if q_len != 1:
        return _decode_chain(orig, binding, cache, call, batch, q_len)
    cache._begin_decode(batch, binding.windows)
    before = cache.get_seq_length()
    try:
        return _placed_step(orig, binding, cache, call, batch, prior)
    except BaseException:
        if cache.get_seq_length() == before:  # the step never finished: the cache is put back as before it
            cache._abandon_decode()
        raise


def _placed_step(orig, binding: _Binding, cache: TreeCache, call: dict, batch: int, prior=None):
    """The forward of one new token per row that :meth:`TreeCache._begin_decode` has placed: eager, or the
    compiled device half (:func:`device_step`). input_ids (batch, 1) -> logits (batch, 1, vocab)."""
    call["attention_mask"] = None
    step = binding.step
    # the package loop's step carries the shifts; transformers' generate hands none, its strategy decides
    strategy = getattr(step, "strategy", binding.strategy)
    compiled = compiled_for(binding, cache.storage.k.device, strategy)
    if compiled is not None and compiled.auto and not cache.static:
        compiled = None  # a cache made dynamic (by its caller): the default runs its steps eagerly
    users = user_compile.compiling(prior) and (binding.compiled is None or binding.compiled.auto)
    if not users and (compiled is None or not compiled.runs(batch)):
        return _run(orig, binding, cache, call)
    what = "torch.compile around model.forward" if users else "compile_step"
    if not cache.static:
        raise ValueError(f"a compiled decode step ({what}) needs a static TreeCache (TreeCache(..., static=True), "
                         "what the model makes itself when its prefill runs compiled or compile_step is set): its "
                         "shapes must not change; this cache is not static (made with static=False, or filled by an "
                         "uncompiled prefill)")
    shifted = strategy == "shifted" or getattr(step, "shifts", None) is not None
    if shifted and binding.cp_size > 1:  # (one rank: no merge)
        raise CompileError(f"strategy='shifted' carries every layer's lse between steps in host state and cannot "
                           f"run in a compiled step ({what}); use 'packed', 'auto' or another strategy, or "
                           f"{'leave model.forward uncompiled' if users else 'compile_step=False'}")
    ids = call.pop("input_ids", None)
    # (one token per row: logits_to_keep of 0 or 1 both mean its logits)
    rest = {k: v for k, v in call.items() if v is not None and k not in ("position_ids", binding.cache_kwarg)
            and not (k == "logits_to_keep" and isinstance(v, int) and v in (0, 1))}
    if ids is None or rest:
        raise NotImplementedError(f"a compiled decode step takes input_ids only (position_ids come from the cache); "
                                  f"got {sorted(rest) or ['inputs_embeds']}")
    if ids.stride() != (ids.shape[-1], 1):
        # A trace is specialised to its inputs' strides: the slice ``seq[:, -1:]`` of a growing sequence has a new
        # one at every step (a recompilation each, and an explicit setting's error at the recompile limit)
        ids = ids.clone(memory_format=torch.contiguous_format)
    binding.active = cache
    # The traced step sees a step of the same strategy whose stats are the binding's slot, the same object at
    # every step: the step's own CommStats (a new one per eval run) would be a new constant -- a new trace
    stats = binding.stats if step is None else step.stats
    if stats is not None and binding.stats_slot is None:
        binding.stats_slot = StatsSlot()
    slot = None if stats is None else binding.stats_slot
    binding.step = DecodeStep(binding.strategy if step is None else step.strategy, slot)
    replayed = slot is not None and not users and compiled.captures  # (its op bodies do not run at a replay)
    if slot is not None:
        slot.target = compiled.recording() if replayed else stats
    try:
        if users:
            if binding.user_steps is None:
                binding.user_steps = UserSteps(binding)
            logits = binding.user_steps(prior, ids, cache.metadata.q_positions, cache)
            if logits.is_cuda:  # the user's compile may capture (reduce-overhead): copied out, as below
                logits = logits.clone()
        else:
            with torch.no_grad():  # (inference only: a step traced with grad enabled would be a training graph)
                logits = compiled(ids, cache.metadata.q_positions, cache)
            if compiled.captures:
                # A CUDA graph's outputs live in its memory pool and the next replay writes over them; a
                # caller may keep a step's logits (a hook, the eval's exactness check): (batch, vocab) copied out
                logits = logits.clone()
            if replayed:
                compiled.account(ids, cache, binding.step.strategy, slot.target, stats)
        # (an 'auto' step whose compilation failed just now ran eagerly: its merges counted their calls)
        traced = users or compiled.failed is None
        if slot is not None and traced and binding.groups is not None and binding.cp_size == 1:
            # a one-rank group: the traced merges issue no collective and record nothing (comm.merge), while the
            # eager step counts one merge call per layer; counted here, outside the graph, the same
            stats.calls += binding.num_layers
        cache._finish()
    finally:
        binding.active = None
        binding.step = step
        if slot is not None:
            slot.target = None
        cache.metadata = None
    return CausalLMOutputWithPast(logits=logits[:, None])


_PADDED_NEW = ("the attention_mask marks a new (decoded) token as padding, or a token after a row's first real one; "
               "only prompts may be padded, at their start (generate makes the mask from pad_token_id when none is "
               "passed: a generated token equal to the pad token id then looks like padding -- pass the "
               "attention_mask, e.g. the ones of the generate that made the tokens)")


def _check_unpadded(mask: torch.Tensor, q_len: int) -> None:
    """The decode forward's (batch, seq) attention_mask: every entry of its last ``q_len`` columns (the new tokens)
    is 1 and every row is left-padded (zeros, then ones: the cache holds every token after a row's padding, and
    attends to all of them), checked without a host read: ``torch._assert_async`` (a decode step reads no device
    value on the host). On CPU it raises at once, here a ValueError; on CUDA a 0 is a device-side assert,
    surfacing at the step's next sync. (A hole in the mask -- a decoded token equal to the pad token id, in a mask
    generate made from the ids -- would otherwise be attended to here and masked by transformers.)"""
    ok = mask[:, -q_len:].all()
    if mask.shape[-1] > 1:
        ok = ok & (mask[:, 1:] >= mask[:, :-1]).all()
    try:
        torch._assert_async(ok, _PADDED_NEW)
    except RuntimeError as e:
        if _PADDED_NEW not in str(e):
            raise
        raise ValueError(_PADDED_NEW) from None


def _decode_chain(orig, binding: _Binding, cache: TreeCache, call: dict, batch: int, q_len: int):
    """``q_len > 1`` new tokens per row on a filled cache, a chain: token ``i`` sees the whole cache and new
    tokens ``0..i`` (what a single-process forward over a ``DynamicCache`` computes; assisted decoding's
    verification of its candidates); on a sliding-window layer only the keys its window holds (by the
    global positions: token ``i`` of a row at the row's length plus ``i``).

    input_ids: (batch, q_len) or inputs_embeds: (batch, q_len, hidden); position_ids as the model would
    take them (or None: from the cache's global length) -> the model's output, logits identical on
    every rank. The new tokens are kept aside while the layers run (the speculative verification's
    phase: ``decode.speculative.verify_attention`` with a lower-triangular mask, the drafts counted on
    CP rank 0 only) and then appended to the cache, each as an ordinary decode step placed alike on
    every rank; ``TreeCache.crop`` takes back those the caller rejects.

    Collectives: one all-gather comparing the call across the CP group (``agreement.agree``: the new
    tokens, positions and the cache's length; ranks handed different candidates would store different
    keys), then per layer one merge carrying all ``q_len`` rows.
    """
    from ...decode.speculative import _VerifyStep

    ids, embeds, pos = call.get("input_ids"), call.get("inputs_embeds"), call.get("position_ids")
    device = (ids if ids is not None else embeds).device
    g = binding.groups
    group, ranks = (None, ()) if g is None else (g.cp_group, g.cp_ranks)
    agreement.agree("hf.decode_chain", ("batch", "new_tokens", "input_ids", "inputs_embeds", "position_ids",
                                        "cache_length"),
                    (batch, q_len, _checksum(ids), _checksum(embeds), _checksum(pos), cache.get_seq_length()),
                    group, ranks, stats=binding.stats, device=None if g is None else _comm_device(g, device))
    cache._begin_chain(batch, q_len)
    chain = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
    previous = binding.step
    binding.step = _VerifyStep(cache, chain, binding.strategy, binding.stats)
    call["attention_mask"] = None
    try:
        out = _run(orig, binding, cache, call)
    except BaseException:
        cache._drafts = {}
        raise
    finally:
        binding.step = previous
    cache._commit_chain(q_len)
    return out


def device_step(binding: _Binding, ids: torch.Tensor, positions: torch.Tensor, cache: TreeCache) -> torch.Tensor:
    """The device half of a decode step: the model's own forward over a step the cache has placed (what
    ``compile_step`` compiles: it reads only the cache's ``StepMetadata`` buffers and storage).

    ids, positions: (batch, 1) int64 -> logits (batch, vocab) of the next token."""
    out = binding.orig_forward(input_ids=ids, position_ids=positions, use_cache=True, return_dict=True,
                               **{binding.cache_kwarg: cache})
    return out.logits[:, -1]


AUTO = "auto"
"""The default ``compile_step``: decode steps captured in CUDA graphs where they can be (:data:`AUTO_OPTIONS`
on a CUDA cache whose CP group runs NCCL, or one process), eager everywhere else (:meth:`CompiledSteps.applies`)."""

AUTO_OPTIONS = {"mode": "reduce-overhead"}
"""What :data:`AUTO` compiles with where it applies: Inductor, its output replayed as a CUDA graph."""


def compiled_for(binding: _Binding, device: torch.device, strategy: str | None = None) -> CompiledSteps | None:
    """The model's compiled steps if decode steps on a cache on ``device`` with ``strategy`` (default: the
    model's) run compiled (:meth:`CompiledSteps.applies`), else None (eager)."""
    compiled = binding.compiled
    if compiled is None or compiled.applies(device, strategy or binding.strategy):
        return compiled
    return None


def compile_step(binding: _Binding, setting, batch_buckets=None) -> "CompiledSteps | None":
    """:func:`device_step` compiled as ``compile_step`` asks: ``False``/``None`` -> None (eager steps),
    ``True`` -> ``torch.compile(..., fullgraph=True, dynamic=False)``, a dict -> the same with ``setting``
    added (``backend``, ``mode``, ...), ``"auto"`` -> :data:`AUTO_OPTIONS` where a step can be captured and
    eager steps elsewhere. ``batch_buckets``: the batch sizes steps are compiled for
    (:class:`CompiledSteps`; None: any batch, a padded batch reusing a compiled one)."""
    buckets = _batch_buckets(batch_buckets)
    if setting == AUTO and isinstance(setting, str):
        return CompiledSteps(binding, {**AUTO_OPTIONS, "dynamic": False, "fullgraph": True}, buckets, auto=True)
    if setting is False or setting is None:
        if buckets is not None:
            raise ValueError(f"batch_buckets={batch_buckets!r} sizes compiled decode steps, but compile_step is "
                             f"{setting!r}: set compile_step ('auto', the default, True or a dict of torch.compile "
                             "arguments) or drop batch_buckets")
        return None
    if setting is True:
        setting = {}
    if not isinstance(setting, dict):
        hint = ""
        if isinstance(setting, str):  # the eval's and lm-eval's names of a setting are dicts here
            hint = (f"; a backend or mode is given as a dict, e.g. {{'backend': {setting!r}}} or "
                    f"{{'mode': {setting!r}}}")
        raise TypeError(f"compile_step must be a bool, 'auto' or a dict of torch.compile arguments, got "
                        f"{type(setting).__name__} {setting!r}{hint}")
    if setting.get("fullgraph") is False:
        raise ValueError("compile_step compiles the whole step (fullgraph=True): a graph break would run part "
                         "of it eagerly every step; drop fullgraph=False")
    # Static shapes: each cache shape gets its own graph (a new capacity is a new trace, as with
    # transformers' static cache); a symbolic trace makes the storage views' base sizes symbolic, which
    # the backends cannot trace back to an input (aot_eager: "... is not tracked with proxy").
    if setting.get("dynamic"):
        raise ValueError("compile_step traces each decode step shape once with static shapes (every cache shape "
                         "has its own graph); dynamic=True cannot trace the cache's storage views: drop dynamic")
    options = {**setting, "dynamic": False, "fullgraph": True}
    _check_compile_arguments(setting, options)
    return CompiledSteps(binding, options, buckets)


def _never_called():
    """What :func:`_check_compile_arguments` hands ``torch.compile``: a function that is never run, so never traced."""


def _check_compile_arguments(setting: dict, options: dict) -> None:
    """``torch.compile``'s own checks of ``options`` (an argument it does not take, a backend not registered, a mode
    Inductor does not know, ``mode`` with ``options``), made when the setting is given: the steps' ``torch.compile``
    runs at the first decode step, after the prompt's whole prefill, and its error named neither ``compile_step``
    nor the setting. Wrapping a function traces nothing (the first call does); a backend is looked up, not run."""
    try:
        torch.compile(_never_called, **options)
    except Exception as e:  # noqa: BLE001 -- whatever torch.compile refuses, said as the setting's error
        why = str(e)
        why = why if len(why) <= 300 else why[:300] + " ..."
        raise ValueError(f"compile_step={setting!r}: torch.compile refuses these arguments "
                         f"({type(e).__name__}: {why})") from e


def _batch_buckets(value) -> tuple[int, ...] | None:
    """``batch_buckets`` checked: None, or a non-empty iterable of distinct positive integers (ints, numpy
    integers, a ``range``) -> sorted tuple of ints."""
    if value is None:
        return None
    problem = None
    try:
        items = tuple(operator.index(b) for b in value) if not isinstance(value, (str, bytes)) else None
    except TypeError:  # not iterable, or an item that is not an integer (a float, a bool is one)
        items = None
    if items is None or any(isinstance(b, bool) for b in value):
        problem = "a list of integers"
    elif not items:
        problem = "non-empty"
    elif min(items) < 1:
        problem = f"positive (got {min(items)})"
    elif len(set(items)) != len(items):
        problem = "without repeats"
    if problem is not None:
        raise ValueError(f"batch_buckets must be a non-empty list of distinct positive batch sizes (e.g. "
                         f"(1, 2, 4, 8)) or None; it must be {problem}, got {value!r}")
    return tuple(sorted(items))


class _ShapeSteps:
    """A model's decode-step functions, one per step shape (the cache's storage shape and dtype, the batch),
    each over a code object of its own.

    Dynamo keeps its traces per code object and stops at ``recompile_limit`` (8) of them; with
    ``fullgraph=True`` the ninth is an error. One function shared by every model and cache would reach
    it after eight caches of different sizes (an eval sweeping context lengths, a soak making models
    case after case). Here each shape is traced once, by its own function, whatever came before.
    """

    def __init__(self, binding: _Binding):
        self.binding = binding
        self.steps: dict = {}

    def _for(self, ids: torch.Tensor, cache: TreeCache):
        """(the step function of this shape, whether it was made now: its first call traces it)."""
        key = _step_shape(ids, cache)
        fn = self.steps.get(key)
        if fn is None:
            fn = self.steps[key] = self._make(_fresh_step(self.binding, len(self.steps)), cache)
            return fn, True
        return fn, False

    @staticmethod
    def _traced() -> None:
        """After a step's first call, which traced it: collect the trace's garbage. Dynamo's variable trackers
        of the trace hold the cache it ran on in reference cycles, which Python's garbage collector frees only in
        a full pass (it counts objects, not the GPU memory they hold): until then that cache's storage -- GBs
        at long context -- stayed allocated after its generate returned, and its storage did not return to
        the model's pool (``decode.cache.StoragePool``) for the next cache. Once per step shape."""
        gc.collect()

    def _make(self, step, cache: TreeCache):
        return step


class CompiledSteps(_ShapeSteps):
    """The compiled decode steps of one model (``compile_step``): one ``torch.compile`` of :func:`device_step`
    per step shape.

    Batch sizes, as serving engines bucket them. Each batch size is its own trace (and, captured, its own
    CUDA graph), so the package loop runs a batch of ``n`` rows at :meth:`batch_for` ``(n)`` rows, the
    shortest prompt repeated in the extra rows (``decode.generate``; their tokens are dropped):

    * ``batches=None`` (default): at the smallest batch already compiled for a cache of the same length
      bucket that is at least ``n`` and at most ``2n`` (an eval's last, partial batch reuses the full
      batches' step), else at ``n`` (a new trace either way: padding would only cost rows);
    * ``batches`` given (``enable_tree_attention(batch_buckets=...)``): at the smallest bucket that holds
      ``n``. Steps are compiled only at those sizes; a step of any other batch (one larger than every
      bucket, transformers' own ``generate`` or the package's with a cache passed in, neither padded) runs
      eagerly, said once per model in a warning of the ``megatron_tree.integrations`` logger.

    With ``auto`` (the default ``compile_step="auto"``), the steps are captured (:data:`AUTO_OPTIONS`) only where
    :meth:`applies`, and a step whose compilation fails runs eagerly from then on, said once in a warning: the
    user asked for nothing, so nothing is refused. An explicit setting raises instead.
    """

    capture_devices = ("cuda",)
    """The device kinds :data:`AUTO` captures on (CUDA graphs record CUDA work only)."""
    capture_backends = ("nccl",)
    """The process-group backends :data:`AUTO` captures a CP > 1 step over (a CUDA graph records NCCL's
    collectives; gloo copies CUDA tensors through the host)."""

    def __init__(self, binding: _Binding, options: dict, batches: tuple[int, ...] | None = None, auto: bool = False):
        super().__init__(binding)
        self.options = options
        self.batches = batches
        self.auto = auto
        self.told = False
        self.said: set[str] = set()
        """The reasons :meth:`say_eager` gave (each said once)."""
        self.failed: str | None = None
        """Why an ``auto`` step's compilation failed (its steps run eagerly since), or None."""
        self.made: set[tuple[int, int | None]] = set()
        """(batch, length bucket of the cache's ``max_seq_len``) of every step compiled so far."""
        self._backends: tuple[str, ...] | None = None
        self.captures = _captures(options)
        """Whether the steps replay as CUDA graphs: the merge op's body, which records the traffic, runs when a
        step is traced and recorded, not at its replays; :meth:`account` counts the replays."""
        self.traffic: dict = {}
        """(step shape, strategy) -> the traffic of one such step, as its op bodies recorded it."""
        self._recorded = CommStats()

    def recording(self) -> CommStats:
        """The cleared record a captured step's op bodies write into (handed to :meth:`account` after it)."""
        self._recorded.reset()
        return self._recorded

    def account(self, ids: torch.Tensor, cache: TreeCache, strategy: str, recorded: CommStats,
                stats: CommStats) -> None:
        """Add one captured step's traffic to ``stats``: what its op bodies ``recorded`` when they ran (a trace,
        Inductor's warmup run, the graph's recording), remembered per step shape and strategy; else (a replay,
        nothing recorded) what the same step recorded when they last ran."""
        key = (_step_shape(ids, cache), strategy)
        if recorded.calls or recorded.levels:
            remembered = self.traffic[key] = CommStats()
            remembered.add(recorded)
            stats.add(recorded)
        elif key in self.traffic:
            stats.add(self.traffic[key])

    def applies(self, device: torch.device, strategy: str | None = None) -> bool:
        """Whether decode steps on a cache on ``device`` (with the merge ``strategy``) run compiled: always for an
        explicit setting (its refusals are raised where they apply); for ``auto``, where the step can be
        captured -- a device of :attr:`capture_devices`, a CP group of one rank or on NCCL, a strategy that
        keeps no host state between steps (not ``shifted`` at CP > 1), on CUDA the triton kernels (not
        ``MEGATRON_TREE_BACKEND=torch``) -- and no compilation has failed."""
        if not self.auto:
            return True
        if self.failed is not None or (strategy == "shifted" and self.binding.cp_size > 1):
            return False
        if device.type not in self.capture_devices:  # (before the groups' backends are read)
            return False
        return _capture_obstacle(device, self._group_backends(), self.capture_devices, self.capture_backends) is None

    def _group_backends(self) -> tuple[str, ...]:
        groups = self.binding.groups
        if groups is None or groups.size == 1:
            return ()
        if self._backends is None:  # read once: a model's groups do not change
            self._backends = tuple(_cuda_backends(groups))
        return self._backends

    def batch_for(self, n: int, max_seq_len: int | None = None) -> int:
        """The batch the package loop runs ``n`` rows at, for a cache of ``max_seq_len`` tokens per row
        (>= ``n``; ``n`` where no compiled size fits)."""
        if self.batches is not None:
            return next((b for b in self.batches if b >= n), n)
        bucket = None if max_seq_len is None else static_length(max_seq_len)
        traced = sorted(b for b, length in self.made if length == bucket)
        return next((b for b in traced if n <= b <= 2 * n), n)

    def _make(self, step, cache: TreeCache):
        _check_capturable(self.options, cache.storage.k.device, self.binding.groups)
        length = None if cache.max_seq_len is None else static_length(cache.max_seq_len)
        self.made.add((cache.storage.batch_size, length))
        return torch.compile(step, **self.options)

    def runs(self, batch: int) -> bool:
        """Whether a step of ``batch`` rows runs compiled; the first time one does not, a warning says why."""
        if self.batches is None or batch in self.batches:
            return True
        if not self.told:
            self.told = True
            why = (f"larger than every bucket of batch_buckets={self.batches}" if batch > self.batches[-1]
                   else f"not one of batch_buckets={self.batches}")
            log.warning("a decode step of %d rows runs eagerly (not compiled): the batch is %s; the package's "
                        "generate pads a batch up to a bucket only in a cache it makes itself (not in a cache "
                        "passed to it), transformers' generate does not. Said once per model.", batch, why)
        return False

    def say_eager(self, why: str) -> None:
        """Warn, once per model and reason, that steps of an explicit setting run eagerly because ``why`` (the
        default, ``auto``, says nothing: nothing was asked for)."""
        if self.auto or why in self.said:
            return
        self.said.add(why)
        asked = {k: _named(v) for k, v in self.options.items() if k not in ("dynamic", "fullgraph")}
        log.warning("compile_step=%s is set, but %s: nothing is compiled there. Said once per model.",
                    asked or True, why)

    def setting(self) -> str:
        """The compile setting as every CP rank must have it alike (checked at each prefill)."""
        opts = ", ".join(f"{k}={_named(v)}" for k, v in sorted(self.options.items()))
        return f"{AUTO + ': ' if self.auto else ''}{opts}; batch_buckets={self.batches}"

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: TreeCache) -> torch.Tensor:
        fn, new = self._for(ids, cache)
        try:
            out = fn(ids, positions, cache)
        except torch._dynamo.exc.TorchDynamoException as e:
            if not self.auto:  # an explicit setting: the error is the user's to see
                raise
            # Raised while tracing or compiling, before the step's graph ran: nothing was written or sent, and
            # every rank compiles the same step alike. Eager from here on.
            # (a backend's own error, which BackendCompilerFailed wraps)
            cause = getattr(e, "inner_exception", None) or e.__cause__ or e
            first = next((line for line in str(cause).splitlines() if line.strip()), "")
            self.failed = f"{type(e).__name__}" + (f", {type(cause).__name__}: {first}" if cause is not e else
                                                   f": {first}")
            log.warning("compile_step='auto' could not compile the decode step (%s); this model's decode steps run "
                        "eagerly from now on. compile_step=False skips the attempt; an explicit setting (True, or "
                        "a dict of torch.compile arguments) raises the error instead.", self.failed)
            return device_step(self.binding, ids, positions, cache)
        if new:
            self._traced()
        return out


class UserSteps(_ShapeSteps):
    """The decode steps a user's ``torch.compile`` around ``model.forward`` compiles: per step shape a
    function of its own, called with that compile's frame-evaluation callback in place -- Dynamo traces
    it with the user's backend, mode and ``fullgraph``; the forward's host half around it never reaches Dynamo."""

    def __call__(self, prior, ids: torch.Tensor, positions: torch.Tensor, cache: TreeCache) -> torch.Tensor:
        fn, new = self._for(ids, cache)
        # Static shapes whatever the user's dynamic= says: each step shape has its own function already, and a
        # symbolic trace of the step makes the storage views' base sizes symbolic, which the backends cannot
        # trace back to an input (an error, or a graph that reads the wrong slots)
        with _STATIC_SHAPES:
            out = user_compile.with_callback(prior, fn, ids, positions, cache)
        if new:
            self._traced()
        return out


_STATIC_SHAPES = torch._dynamo.config.patch(assume_static_by_default=True, automatic_dynamic_shapes=False)
"""Dynamo's settings for a user-compiled step's trace, made once: a patch object is reusable, and making one
per step cost ~20 us of a step's host time (entering it ~10 us)."""


def _named(value) -> str:
    """A compile option as text that is the same on every rank and tells settings apart: a callable backend by
    its name, not its address, with its settings -- a ``functools.partial``'s arguments, an object's text
    attributes (``CompileCounterWithBackend("inductor")``'s backend) -- never counters that change as it runs."""
    if isinstance(value, functools.partial):
        args = [_named(a) for a in value.args] + [f"{k}={_named(v)}" for k, v in sorted(value.keywords.items())]
        return f"partial({_named(value.func)}, {', '.join(args)})"
    if callable(value):
        name = getattr(value, "__qualname__", None)
        if name is not None:  # a function or a class
            return f"{getattr(value, '__module__', '')}.{name}"
        attrs = vars(value) if hasattr(value, "__dict__") else {}
        texts = sorted((k, v) for k, v in attrs.items() if isinstance(v, str))
        return f"{type(value).__module__}.{type(value).__qualname__}({', '.join(f'{k}={v!r}' for k, v in texts)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_named(v)}" for k, v in sorted(value.items())) + "}"
    return repr(value)


def _step_shape(ids: torch.Tensor, cache: TreeCache) -> tuple:
    """What a compiled step's graph is specialised to: the storage's shapes, strides, dtype and device, the batch."""
    st = cache.storage
    return (tuple(st.k.shape), tuple(st.v.shape), st.k.stride(), st.k.dtype, str(st.k.device), tuple(ids.shape))


_CAPTURING_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes whose Inductor output replays as a CUDA graph."""


def _captures(options: dict) -> bool:
    """Whether ``torch.compile`` arguments ask for CUDA graphs."""
    return options.get("mode") in _CAPTURING_MODES or bool((options.get("options") or {}).get("triton.cudagraphs"))


def _check_capturable(options: dict, device: torch.device, groups=None) -> None:
    """A compile setting that asks for CUDA graphs where they cannot be captured is an error naming the
    setting (Inductor would skip the capture with a log line and run the step uncaptured, or the capture
    would fail inside a collective: not what was asked for):

    * a cache that is not on a CUDA device (CUDA graphs record CUDA work only);
    * at CP > 1, a CP group (or one of its levels) whose backend is not NCCL: the captured step holds every
      layer's merge, and only NCCL's collectives can be recorded (gloo copies CUDA tensors through the host);
    * on CUDA, kernels other than triton's (``MEGATRON_TREE_BACKEND=torch`` reads the rows' lengths on the host).

    The rule itself is :func:`_capture_obstacle`'s. Every rank checks the same setting on the same kind of device and groups, so all raise alike."""
    mode = options.get("mode")
    if not _captures(options):
        return
    what = f"mode={mode!r}" if mode in _CAPTURING_MODES else "options={'triton.cudagraphs': True}"
    problem = _capture_obstacle(device, _cuda_backends(groups) if groups is not None and groups.size > 1 else ())
    if problem is not None:
        raise ValueError(f"compile_step with {what} captures the decode step in a CUDA graph{problem}")


def _capture_obstacle(device: torch.device, backends, devices=("cuda",), allowed=("nccl",)) -> str | None:
    """What keeps a decode step on a cache on ``device``, at CP > 1 over groups whose CUDA collectives run on
    ``backends`` (empty: one rank), from being captured in a CUDA graph -- the rest of a sentence, what to do
    included -- or None. The one rule of :func:`_check_capturable` (which raises it) and
    :meth:`CompiledSteps.applies` (which runs such steps eagerly); ``devices`` and ``allowed``: the device kinds
    and backends that capture (:attr:`CompiledSteps.capture_devices`, :attr:`CompiledSteps.capture_backends`)."""
    if device.type not in devices:
        return (f", but the KV cache is on {device.type}: CUDA graphs need CUDA tensors. Use compile_step=True "
                "(compiled, not captured) here, or move the model to a GPU")
    kernels = resolve_backend(device) if device.type == "cuda" else "triton"
    if kernels != "triton":
        return (f", but its attention runs the {kernels!r} kernels (MEGATRON_TREE_BACKEND), which read the rows' "
                "lengths on the host: a capture cannot hold that. Unset MEGATRON_TREE_BACKEND (triton on CUDA), or "
                "use compile_step=True (compiled, not captured)")
    if not set(backends) <= set(allowed):
        return (f", every layer's CP merge with it, but the CP group's collectives run on {', '.join(backends)}: "
                "only NCCL's collectives can be captured. Initialise the process groups with NCCL for CUDA tensors "
                "(TreeGroups.from_env does when CUDA is available), or use compile_step=True (compiled, not captured)")
    return None


def _cuda_backends(groups) -> list[str]:
    """groups: a ``TreeGroups`` -> the backends that run CUDA tensors' collectives in its CP group and its levels'
    groups, distinct, sorted (``["nccl"]``: capturable).

    Read from each group's backend config, not its backend name: a group made with ``"cpu:gloo,cuda:nccl"``
    is named by that text, and one of ``init_process_group()`` without a backend on a GPU machine
    ``undefined`` (config ``cuda:nccl``), while both run CUDA tensors on NCCL. A group with no backend for
    CUDA tensors is named by its whole config (e.g. ``cpu:gloo``)."""
    import torch.distributed as dist

    out = set()
    for g in groups.process_groups:
        config = str(dist.get_backend_config(g))
        devices = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
        out.add(devices.get("cuda", config) if devices else config)
    return sorted(out)


def _fresh_step(binding: _Binding, n: int):
    def step(ids, positions, cache):
        return device_step(binding, ids, positions, cache)

    return user_compile.own_code(step, f"tree_decode_step_{n}")  # a code object, and Dynamo cache, of its own
