"""A ``torch.compile`` the user wrapped around a function whose host half must run eagerly.

A forward that plans placement and checks its ranks on the host cannot be traced whole, but its
device half can. When the user writes ``model.forward = torch.compile(model.forward, fullgraph=True)``
around such a forward, Dynamo calls it with its frame-evaluation callback set (the callback
compiles each Python frame it is handed, with the user's backend, mode and ``fullgraph``). This
module lets that forward take the callback aside for its host half and hand it back for its device
half, so that the device half is compiled exactly as the user asked and nothing else is:

    prior = set_eval_frame(None)      # first statement: a C call, so no Python frame sees the callback
    try:
        ...host half...               # eager
        with_callback(prior, device_half, *args)   # traced and compiled by the user's torch.compile
    finally:
        set_eval_frame(prior)

The forward itself must not be traced (its frame would be the first the callback sees):
:func:`host_frame` marks its code so Dynamo skips that frame but still hands the callback the frames it
calls. A traced caller that reaches the forward (``torch.compile(model)`` rather than of
``model.forward``) gets a graph break there, an error under ``fullgraph=True`` with ``reason`` in it.

``set_eval_frame`` is Dynamo's own primitive (what ``torch.compiler.disable`` uses); where a torch
build lacks it, the stand-in returns None and the forward cannot tell a surrounding compile: its
own ``torch.compiler.is_compiling()`` refusal then applies.
"""

from __future__ import annotations

import types

import torch

try:
    from torch._C._dynamo import eval_frame as _eval_frame
    from torch._C._dynamo.eval_frame import set_eval_frame
    from torch._dynamo.decorators import skip as _skip
except ImportError:  # a torch build without Dynamo
    def set_eval_frame(callback):  # the same contract, nothing to suspend
        return None

    def _skip(fn):
        return fn

    _eval_frame = None

__all__ = ["compiling", "host_frame", "own_code", "ran_whole", "set_eval_frame", "with_callback"]


def host_frame(fn, reason: str):
    """Mark ``fn``'s code so Dynamo never traces its frame (it still sees the frames ``fn`` calls);
    ``reason`` is what Dynamo says when a traced frame calls ``fn``. Returns ``fn``."""
    _skip(fn)
    fn._torchdynamo_disable_msg = reason
    return fn


def compiling(prior) -> bool:
    """Whether ``prior`` (what ``set_eval_frame(None)`` returned) is a compiling callback: a
    ``torch.compile`` is around the call. ``None`` is no compile, ``False`` Dynamo's run-only mode
    (cached graphs, no new traces): neither compiles."""
    return prior is not None and prior is not False and callable(prior)


def with_callback(prior, fn, *args):
    """``fn(*args)`` with ``prior`` (a surrounding compile's callback) in place, so Dynamo traces
    ``fn``'s frame with that compile's settings; the callback is taken aside again afterwards."""
    set_eval_frame(prior)
    try:
        return fn(*args)
    finally:
        set_eval_frame(None)


def ran_whole(prior) -> None:
    """Count a forward that traced nothing (a prefill: its host half runs eagerly by design) as one frame
    of the surrounding compile, whose callback is ``prior``.

    torch >= 2.12 counts the frames a ``fullgraph=True`` call compiled or found compiled, and raises
    "found no compiled frames" at zero. Where torch keeps that count (``set_fullgraph_compiled_frame_count``
    exists), the identity of a 0-d CPU tensor runs under ``prior``: traced once (an empty graph, no
    code generated; one frame in the compile's count), a cache hit after that. Elsewhere nothing runs."""
    if getattr(_eval_frame, "set_fullgraph_compiled_frame_count", None) is not None:
        with_callback(prior, _whole_for(prior), _TOKEN)


def _whole(token):
    return token


_WHOLES: dict = {}
"""id(callback) -> the identity function its compile traces (a code object of its own per compile)."""


def _whole_for(prior):
    """The identity, as a function with a code object of its own for the compile whose callback is ``prior``.

    Dynamo keeps its traces per code object and, under ``fullgraph=True``, fails past ``recompile_limit`` (8)
    of them: one identity shared by every compile failed at the ninth model compiled in one process (an eval
    making model after model). At most 64 are kept; past that the memory starts afresh (a callback whose entry
    went, or whose id a new one took, gets a fresh function: one trace more, never a wrong one)."""
    fn = _WHOLES.get(id(prior))
    if fn is None:
        if len(_WHOLES) >= 64:
            _WHOLES.clear()
        fn = _WHOLES[id(prior)] = own_code(_whole, f"tree_forward_ran_whole_{len(_WHOLES)}")
    return fn


def own_code(fn, name: str):
    """``fn`` (closure and defaults included) over a copy of its code object named ``name``: Dynamo keeps
    its traces, and counts them against ``recompile_limit``, per code object, so each copy is traced on
    its own."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


_TOKEN = torch.zeros(())
