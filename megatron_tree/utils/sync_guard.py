"""``no_host_sync()``: fail on any host-device synchronisation inside a block of code, on CPU too.

Why it exists: a decode step that CUDA graphs can capture must never make the host wait for
the device: no ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``,
``bool(t)``/``int(t)``/``float(t)``, no op whose output shape depends on values
(``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave``
without ``output_size``), no device-to-host copy. On a CUDA machine such a call stalls the
stream or aborts a capture; on a CPU machine it costs nothing and goes unnoticed, so a
CPU test needs a guard that raises on the *call*, whatever the device. This module only
imports torch, so every layer may use it.

How: a ``TorchFunctionMode`` sees the Python-level calls (``Tensor.tolist`` and
``Tensor.cpu`` never reach the dispatcher on CPU tensors), a ``TorchDispatchMode`` sees
the aten ops underneath (``aten._local_scalar_dense`` behind every scalar read,
``aten.nonzero``, bool-indexed ``aten.index``, device-to-host ``aten._to_copy``).

Opaque ops: torch runs an op that a dispatch mode handles with the modes off, so the
insides of a custom op (``torch.library``) are invisible; the guard therefore fails on any
op outside aten/prims/c10d unless it is listed in ``opaque``. Listed by default: the local
attention and merge ops (``megatron_tree::flash_decode``, ``megatron_tree::merge_states``). On CUDA they are the Triton
kernels, whose launchers read no tensor values; on CPU they are the torch
path, which reads ``cache_seqlens`` to slice each row (that is what makes it fast) and
checks the values there. Everything around them -- cache append, merge collectives, model
code -- is guarded.

Collectives on gloo are not syncs in this sense (they are the step's communication) and
pass. So do tensors made from host data (``torch.tensor(list)``): the cache's host-side
bookkeeping reaches the device that way, in one asynchronous copy per step.

``CHECK_VALUES_ENV``: debug checks that must read device values (e.g. token ids in the
vocabulary) run only when ``MEGATRON_TREE_CHECK_VALUES=1``; off by default.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "no_host_sync", "CHECK_VALUES_ENV", "OPAQUE_OPS"]

CHECK_VALUES_ENV = "MEGATRON_TREE_CHECK_VALUES"
"""Set to ``1`` to run the debug value checks that read device tensors (off by default: each is a host sync)."""

OPAQUE_OPS = ("megatron_tree::flash_decode", "megatron_tree::merge_states")
"""Ops whose insides the guard does not look at (see the module docstring)."""


class HostSyncError(RuntimeError):
    """Code inside :func:`no_host_sync` read a tensor's values back to the host or sized an output by them."""


_T = torch.Tensor
_FUNCTIONS = {
    _T.item: "Tensor.item()", _T.tolist: "Tensor.tolist()", _T.cpu: "Tensor.cpu()", _T.numpy: "Tensor.numpy()",
    _T.__bool__: "bool(tensor)", _T.__int__: "int(tensor)", _T.__float__: "float(tensor)",
    _T.__index__: "operator.index(tensor)", _T.__complex__: "complex(tensor)", _T.__array__: "numpy.asarray(tensor)",
    _T.nonzero: "Tensor.nonzero()", torch.nonzero: "torch.nonzero", _T.argwhere: "Tensor.argwhere()",
    torch.argwhere: "torch.argwhere", _T.masked_select: "Tensor.masked_select()", torch.masked_select: "torch.masked_select",
    _T.unique: "Tensor.unique()", torch.unique: "torch.unique", torch.unique_consecutive: "torch.unique_consecutive",
    _T.__repr__: "repr(tensor)", _T.__format__: "format(tensor)",
}

_aten = torch.ops.aten
_ATEN = {
    _aten._local_scalar_dense.default: "a scalar read (aten._local_scalar_dense: item/int/float/bool)",
    _aten.nonzero.default: "aten.nonzero (output sized by values)",
    _aten.masked_select.default: "aten.masked_select (output sized by values)",
    _aten.is_nonzero.default: "aten.is_nonzero (bool of a tensor)",
    _aten.equal.default: "aten.equal (returns a host bool)",
    _aten._unique2.default: "aten._unique2 (output sized by values)",
    _aten.unique_consecutive.default: "aten.unique_consecutive (output sized by values)",
    _aten.unique_dim.default: "aten.unique_dim (output sized by values)",
}


_KNOWN_NAMESPACES = ("aten", "prim", "prims", "c10d", "_c10d_functional")
"""Ops of these namespaces are looked at one by one; any other op must be listed as opaque."""


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class _Guard:
    def __init__(self, opaque, where: str):
        self.opaque = frozenset(opaque)
        self.where = where
        self.seen: list[str] = []

    def fail(self, what: str):
        self.seen.append(what)
        raise HostSyncError(f"host sync inside {self.where}: {what}. A CUDA-graph-capturable step must not read "
                            "tensor values on the host or size outputs by them (megatron_tree.utils.sync_guard)")


class _Functions(TorchFunctionMode):
    def __init__(self, guard: _Guard):
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _FUNCTIONS.get(func)
        if what is not None:
            self.guard.fail(what)
        if func is torch.where and len(args) + len(kwargs) == 1:
            self.guard.fail("torch.where(condition) (output sized by values)")
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, guard: _Guard):
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        g = self.guard
        name = func._schema.name
        namespace = name.split("::")[0]
        if name in g.opaque:  # runs with both modes off: torch pops them inside a handled op
            return func(*args, **kwargs)
        if namespace not in _KNOWN_NAMESPACES:
            g.fail(f"{name}, an op the guard cannot see into (add it to opaque= only if its CUDA path reads "
                   "no tensor values)")
        what = _ATEN.get(func)
        if what is not None:
            g.fail(what)
        packet = func.overloadpacket
        if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_) and \
                len(args) > 1 and _bool_index(args[1]):
            g.fail(f"{name} with a boolean mask (output sized by values)")
        if packet is _aten.repeat_interleave and kwargs.get("output_size") is None and \
                isinstance(args[0], torch.Tensor) and len(args) == 1:
            g.fail("aten.repeat_interleave without output_size (output sized by values)")
        if packet in (_aten._to_copy, _aten.copy_):
            src = args[1] if packet is _aten.copy_ else args[0]
            dst_dev = args[0].device if packet is _aten.copy_ else kwargs.get("device")
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_dev is not None \
                    and torch.device(dst_dev).type == "cpu":
                g.fail(f"{name} from {src.device} to the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync(where: str = "a decode step", *, opaque=OPAQUE_OPS):
    """Raise :class:`HostSyncError` on any host-device synchronisation in the block.

    where: names the guarded code in the message; opaque: op names (``ns::name``) whose
    insides are not guarded. Yields the guard; the error names the offending call.
    """
    guard = _Guard(opaque, where)
    with _Functions(guard), _Dispatch(guard):
        yield guard
