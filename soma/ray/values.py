"""Values on Ray's wire, on the driver and in the actors alike: soma's serializer for torch tensors registered
with Ray (their bytes out of band, strides kept, as in `Local`: docs/ray.md), and what Ray hands back from its
read-only object store made writable. Imports Ray and torch only once they are in use."""

from __future__ import annotations

import sys

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
    quantized) as torch's own reduction."""
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
        return None, t.__reduce_ex__(5)
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
        rebuild, args = rest[0]
        return rebuild(*args)
    dtype, shape, stride, grad = rest
    import numpy

    own = torch.from_numpy(numpy.array(raw, copy=True))  # out of Ray's read-only store, into memory of its own
    t = torch.empty(0, dtype=getattr(torch, dtype)).set_(own.untyped_storage(), 0, shape, stride)
    return t.requires_grad_() if grad else t


def writable(value):
    """`value` with every read-only numpy array in it (loose, or in tuples, lists and dicts) replaced by a
    writable copy: what Ray hands back lives in its read-only object store."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return value
    kind = type(value)
    if kind is numpy.ndarray:
        return value.copy() if not value.flags.writeable else value
    if kind is tuple or kind is list:
        items = [writable(item) for item in value]
        return value if all(a is b for a, b in zip(items, value)) else kind(items)
    if kind is dict:
        return {k: writable(v) for k, v in value.items()}
    return value
