"""Values on Ray's wire, on the driver and in the actors alike: soma's serializer for torch tensors registered
with Ray (their bytes out of band, strides kept, as in `Local`: docs/ray.md), and what Ray hands back from its
read-only object store made writable. Imports Ray and torch only once they are in use."""

from __future__ import annotations

import sys

from ..wire.buffers import array_of, castable, reduce_subclass

_shared_out_of_band = False


def tensors_out_of_band() -> None:
    """Register soma's tensor serializer with Ray in this process, once torch is imported (never imports it)."""
    global _shared_out_of_band
    if _shared_out_of_band or "torch" not in sys.modules:
        return
    import ray
    import torch

    ray.util.register_serializer(torch.Tensor, serializer=tensor_to_store, deserializer=tensor_from_store)
    _shared_out_of_band = True


def tensor_to_store(t):
    """A CPU tensor as `(uint8 numpy view of the bytes it covers, dtype, shape, stride, requires_grad)`, strides
    kept for a dense or expanded one (compacted when it has gaps, as in Local); anything else (CUDA, sparse,
    quantized, nested) as torch's own reduction, and whether it requires grad."""
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_nested:  # (a nested one
        # says strided, and has no one shape)
        return None, t.__reduce_ex__(5), t.requires_grad  # (torch's sparse rebuild drops requires_grad)
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    grad = t.requires_grad
    t = t.detach()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
    if extent > t.numel():
        t = t.contiguous()
        extent = t.numel()
    size = t.element_size()
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage(), t.storage_offset() * size, (extent * size,))
    return raw.numpy(), str(t.dtype).rpartition(".")[2], tuple(t.shape), tuple(t.stride()), grad


def tensor_from_store(parts):
    import torch

    raw, *rest = parts
    if raw is None:
        (rebuild, args), grad = rest
        t = rebuild(*args)
        return t.requires_grad_() if grad and not t.requires_grad else t
    dtype, shape, stride, grad = rest
    import numpy

    own = torch.from_numpy(numpy.array(raw, copy=True))  # out of Ray's read-only store, into memory of its own
    t = torch.empty(0, dtype=getattr(torch, dtype)).set_(own.untyped_storage(), 0, shape, stride)
    return t.requires_grad_() if grad else t


def _each(value, replace, memo: dict | None = None):
    """`value` with each leaf (loose, or in tuples, lists and dicts) that `replace(leaf)` replaces (it returns None
    for the ones it keeps) replaced, one replacement per object (one object twice stays one); a container none of
    whose leaves changed is kept as it is (a dict is rebuilt). What `writable` and `exact` share."""
    kind = type(value)
    if kind in _AS_IS:
        return value
    if kind is tuple or kind is list:
        memo = {} if memo is None else memo
        items = [_each(item, replace, memo) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)
    if kind is dict:
        memo = {} if memo is None else memo
        return {k: _each(v, replace, memo) for k, v in value.items()}
    memo = {} if memo is None else memo
    found = memo.get(id(value))
    if found is None:
        found = replace(value)
        if found is None:
            return value
        memo[id(value)] = found
    return found


_AS_IS = frozenset({int, float, str, bool, type(None), bytes, complex})


def writable(value):
    """`value` with every read-only numpy array in it (loose, or in tuples, lists and dicts) replaced by a
    writable copy: what Ray hands back lives in its read-only object store. One array twice is one copy."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return value
    ndarray = numpy.ndarray
    return _each(value, lambda leaf: leaf.copy(order="K") if type(leaf) is ndarray and not leaf.flags.writeable
                 else None)  # (its layout kept: a Fortran-ordered array came back C-ordered)


def exact(value):
    """`value` as it goes to Ray, made to arrive as it is (SPEC 5): what Ray's own serializer would change goes
    in a form it pickles instead. A bytearray or a memoryview (Ray's msgpack makes them bytes) is rebuilt on
    arrival, writability, format and shape kept; so is a Parameter's subclass (torch's pickle makes it a
    Parameter); a numpy array of the other byte order that is not contiguous goes as a contiguous copy (Ray made
    its dtype native). Loose, or in tuples, lists and dicts (as `writable`); one object twice stays one."""
    return _each(value, _exact_leaf)


def _exact_leaf(leaf):
    kind = type(leaf)
    if kind is bytearray or kind is memoryview:
        return _Exact(leaf)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(leaf, torch.nn.Parameter) and kind is not torch.nn.Parameter:
        return _Exact(leaf)  # (torch's pickle makes a Parameter's subclass a Parameter)
    numpy = sys.modules.get("numpy")
    if numpy is not None and kind is numpy.ndarray and leaf.dtype.byteorder not in "=|" \
            and not (leaf.flags.c_contiguous or leaf.flags.f_contiguous):
        return numpy.ascontiguousarray(leaf)
    return None


class _Exact:
    """A bytearray, a memoryview or a Parameter's subclass on its way through Ray, pickled as itself (see
    `exact`)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __reduce__(self):
        value = self.value
        if type(value) is not bytearray and type(value) is not memoryview:  # (a Parameter's subclass)
            return reduce_subclass(value, sys.modules["torch"])
        if type(value) is bytearray:
            return bytearray, (bytes(value),)
        format, shape, readonly = value.format, value.shape, value.readonly
        numpy = sys.modules.get("numpy")
        array = array_of(numpy, value) if not castable(value) and numpy is not None else None
        if array is not None:  # (a struct's, float16's, ...: as the array it views)
            return _view_of, (numpy.array(array), readonly)
        data = value.tobytes()
        return _memoryview_of, (data if readonly else bytearray(data), format, shape, readonly)


def _view_of(array, readonly: bool) -> memoryview:
    view = memoryview(array if array.flags.writeable or readonly else array.copy())
    return view.toreadonly() if readonly else view


def _memoryview_of(data, format: str, shape, readonly: bool) -> memoryview:
    view = memoryview(data).cast("B")
    try:
        view = view.cast(format, shape)
    except (TypeError, ValueError):  # (a format cast cannot make, numpy not loaded to send it: its bytes)
        pass
    return view.toreadonly() if readonly else view
