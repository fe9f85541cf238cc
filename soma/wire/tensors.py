"""Tensors on the wire: a handle per tensor (dtype, shape, stride, offset, and where the bytes are).

    inline   the bytes themselves, for what covers under the inline limit
    shm      a shared-memory segment (`soma.wire.shm`): name and size, never the bytes; the receiver's
             tensor is over torch's own mapping of it (`SharedStorages`), so torch calls it shared
    meta     nothing but the shape
    torch    torch's own reductions, for what soma's handles do not describe: CUDA tensors (CUDA IPC
             handles: the producer keeps the block alive until consumers release it), sparse ones
             (COO, CSR, CSC, BSR, BSC: torch.multiprocessing's reduction of their parts) and quantized ones
             (torch's ordinary pickling, which keeps the quantizer: torch.multiprocessing's loses it). Every
             CPU part they contain (indices, values, a quantized tensor's storage, per-channel scales)
             travels as a soma handle beside the pickle, through shared memory like any other tensor.

The form a tensor keeps: a dense tensor (contiguous, transposed, `channels_last`,
any permutation of its dims) and an expanded one (stride 0) cross as the span
of storage they cover, strides kept: `zeros(1).expand(10**7)` crosses as 4
bytes and arrives expanded. A view with gaps (`t[::3]`) is compacted
(contiguous), since copying the gaps would cost more than the values; the whole
base storage is what torch.multiprocessing sends. A tensor already in a segment
travels by name, strides kept, whatever its size.
"""

from __future__ import annotations

import ctypes
import functools
import io
import os
import pickle
import weakref

from .buffers import INLINE_LIMIT, GradCrossing
from .mapping import Mapper
from .shm import mark_exported

# tensor handle kinds
T_INLINE, T_SHM, T_META, T_TORCH = 0, 1, 2, 3


_KINDS: dict = {}  # torch dtype → (its name, bytes per element, complex?): str(dtype) costs more than the lookup


def _kind(dtype) -> tuple:
    kind = _KINDS.get(dtype)
    if kind is None:
        kind = _KINDS[dtype] = (str(dtype).rpartition(".")[2], dtype.itemsize, dtype.is_complex)
    return kind


def encode_tensor(enc, t, torch) -> list:
    # Small tensors are the common case (a row, an embedding, a label): every property read below costs
    # 0.2-1 µs of torch's Python binding, so each is read once and the cheap ones decide first.
    grad = t.requires_grad
    if grad and not t.is_leaf:
        raise GradCrossing()
    if type(t) is torch.nn.Parameter:  # (its handle's grad field says so too: PARAMETER | requires_grad)
        grad = PARAMETER | grad
    dtype, itemsize, is_complex = _kind(t.dtype)
    if not _described(t, torch):
        if t.is_meta:
            return [T_META, dtype, list(t.shape), list(t.stride()), t.storage_offset(), grad]
        return _by_torch(enc, t, torch, grad)
    if t.is_neg() or (is_complex and t.is_conj()):
        t = t.resolve_conj().resolve_neg()  # the lazy bits would be lost on the way
    shape, stride = list(t.shape), list(t.stride())
    numel = t.numel()
    if t.is_contiguous():
        extent = numel
    else:
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if numel else 0  # elements its span covers
    nbytes = extent * itemsize
    start = t.data_ptr()
    # Already in a segment (this process's view, or copied for this message): by name, whatever its size;
    # the receiver aliases it, as it aliases any shared tensor.
    where = enc.found(start, nbytes, t) if nbytes else None
    if where is not None and where[2] % itemsize:
        enc.unfound(where)  # (a tensor over an odd offset of a segment: torch.from_numpy can make one)
        where = None
    if where is None and extent <= numel:  # dense or expanded: its span, strides kept
        if nbytes < INLINE_LIMIT:
            data = ctypes.string_at(start, nbytes) if nbytes else b""
            return [T_INLINE, dtype, shape, stride, 0, grad, data]
        where = enc.copy_in(start, nbytes)
    if where is None:  # gaps: a compact (contiguous) copy
        if numel * itemsize < INLINE_LIMIT:
            flat = t.contiguous()
            data = ctypes.string_at(flat.data_ptr(), numel * itemsize)
            return [T_INLINE, dtype, shape, list(flat.stride()), 0, grad, data]
        view, name, seg_bytes = enc.fresh(numel * itemsize)
        copy = tensor_over(torch, view, t.dtype, 0, shape, None)
        copy.copy_(t)
        return [T_SHM, dtype, shape, list(copy.stride()), 0, grad, name, seg_bytes]
    name, seg_bytes, offset = where
    return [T_SHM, dtype, shape, stride, offset // itemsize, grad, name, seg_bytes]


def _described(t, torch) -> bool:
    """Whether a handle describes `t` (a CPU tensor, dense, one shape: strided layout, not quantized, not nested:
    a nested one of strided layout says strided); else torch's own reduction carries it (`_by_torch`)."""
    return t.is_cpu and t.layout == torch.strided and not t.is_quantized and not t.is_nested


def tensor_over(torch, buffer, dtype, offset: int, shape, stride):
    """A tensor over a buffer (a segment's view, a bytearray): the buffer lives as long as its storage."""
    storage = torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()
    t = torch.empty(0, dtype=dtype)
    return t.set_(storage, offset, shape, stride) if stride is not None else t.set_(storage, offset, shape)


class SharedStorages(Mapper):
    """How a segment becomes a tensor's storage on the receiving side: torch maps the segment's file itself
    (`UntypedStorage.from_file(path, shared=True)`, MAP_SHARED), so the storage is what torch calls shared
    (`is_shared()`): `share_memory_()` leaves it where it is, and torch.multiprocessing hands it on by file
    descriptor, no copy. The storage is this process's view of the segment (`SegmentStore.open`): it dies
    with the last tensor over it (torch keeps a storage's Python object as long as its tensors), and its
    death releases the segment's receipts, as a ctypes view's does.

    Handed on outside soma (its descriptor asked for: a torch.multiprocessing queue, a DataLoader worker's
    result, `share_memory_()`), the segment is marked on its file, so its owner unlinks it once soma lets
    go instead of reusing it: the other process may still map it.
    """

    def map(self, path: str, nbytes: int):
        import torch

        storage = torch.UntypedStorage.from_file(path, True, nbytes)
        # torch's MapAllocator closed the file after mapping it (no descriptor per storage held), so it
        # would answer -1: open one when, and only when, torch hands the storage on.
        storage._share_fd_cpu_ = functools.partial(_hand_on, path, storage.data_ptr(), weakref.ref(storage))
        return storage

    def address(self, storage) -> int:
        return storage.data_ptr()


SHARED_STORAGES = SharedStorages()


def _hand_on(path: str, start: int, ref) -> tuple:
    """`storage._share_fd_cpu_()` of a segment's storage: `(descriptor, bytes)` (the descriptor stays open as
    long as the storage), and the segment marked as handed on outside soma."""
    storage = ref()
    if storage.data_ptr() != start:  # torch moved its bytes (share_memory_ under file_system): torch's own
        return type(storage)._share_fd_cpu_(storage)
    fd = storage.__dict__.get("_soma_fd")
    if fd is None:
        mark_exported(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:  # unlinked (its pool closed): this process's own mapping still names the file
            start = storage.data_ptr()
            try:
                fd = os.open(f"/proc/self/map_files/{start:x}-{start + storage.nbytes():x}", os.O_RDWR)
            except OSError as err:
                raise OSError(err.errno, f"this tensor's shared memory ({os.path.basename(path)}) was unlinked when "
                                         f"its soma pool closed, and this system does not let it be opened again "
                                         f"({err.strerror}): hand on a copy (t.clone()) instead") from None
        storage._soma_fd = fd
        weakref.finalize(storage, os.close, fd)
    return fd, storage.nbytes()


_DTYPES: dict = {}  # a dtype's name on the wire → the torch dtype


def decode_tensor(dec, handle: list):
    import torch  # (not sys.modules: another thread may be importing it, and `import` waits for that to end)

    kind = handle[0]
    if kind == T_TORCH:
        return _from_torch(dec, handle, torch)
    dtype = _DTYPES.get(handle[1])
    if dtype is None:
        dtype = _DTYPES[handle[1]] = getattr(torch, handle[1])
    if kind == T_INLINE:
        _, _, shape, stride, offset, grad, data = handle
        if not data:
            t = torch.empty(shape, dtype=dtype)
        else:
            # One torch call for the common small tensor (one dimension, dense) instead of three.
            t = torch.frombuffer(bytearray(data), dtype=dtype)
            if offset or len(shape) != 1 or stride[0] != 1 or shape[0] != t.shape[0]:
                t = t.as_strided(shape, stride, offset)
        return _autograd(t, grad, torch) if grad else t
    if kind == T_META:
        _, _, shape, stride, offset, grad = handle
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    elif kind == T_SHM:
        _, _, shape, stride, offset, grad, name, seg_bytes = handle
        itemsize = dtype.itemsize
        extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
        if offset < 0 or any(st < 0 for st in stride) or (offset + extent) * itemsize > seg_bytes:
            raise ValueError(f"tensor handle for {name} reaches outside its segment")
        t = torch.empty(0, dtype=dtype).set_(dec.storage(name, seg_bytes), offset, shape, stride)
    else:
        raise ValueError(f"unknown tensor handle kind {kind}")
    return _autograd(t, grad, torch) if grad else t


PARAMETER = 2  # in a handle's grad field (with requires_grad as bit 1): the tensor was an nn.Parameter


def _autograd(t, grad: int, torch):
    """`t` as its handle's grad field says: requiring grad, and an nn.Parameter (a module's weight) again. The
    handle makes one tensor whichever way it is reached (twice in a value: a REF to it), so weights tied in a
    module, or one Parameter twice in a tuple, stay one Parameter."""
    if grad & PARAMETER:
        return torch.nn.Parameter(t, requires_grad=bool(grad & 1))
    return t.requires_grad_()


# -- what soma's handles do not describe: torch's own reductions ---------------------------------------

_TORCH_PICKLER = None


def _torch_pickler(torch):
    """A pickler of CUDA, sparse and quantized tensors with torch's reductions; their CPU parts as soma handles.

    torch.multiprocessing no longer re-exports `ForkingPickler` from its `reductions`
    (torch 2.13); its reducers are what we need, and they live on there.
    """
    global _TORCH_PICKLER
    if _TORCH_PICKLER is None:
        import copyreg

        from torch.multiprocessing.reductions import reduce_tensor

        def reduce(t):
            if t.is_quantized and t.device.type == "cpu":
                return t.__reduce_ex__(5)  # torch's own pickling: `_rebuild_qtensor` keeps scale, zero point, axis
            return reduce_tensor(t)  # CUDA IPC for CUDA tensors (and CUDA parts); the parts of a sparse one

        class TorchPickler(pickle.Pickler):
            dispatch_table = copyreg.dispatch_table.copy()
            dispatch_table[torch.Tensor] = reduce
            dispatch_table[torch.nn.Parameter] = reduce

            def __init__(self, file, enc, parts: list):
                super().__init__(file, protocol=5)
                self._enc, self._parts = enc, parts

            def persistent_id(self, obj):
                # CPU parts: a plain strided tensor, or a storage (a quantized tensor's), as soma handles.
                if isinstance(obj, torch.Tensor):
                    if not _described(obj, torch):
                        return None  # the tensor being reduced, or a part torch must reduce itself
                    self._parts.append(encode_tensor(self._enc, obj, torch))
                    return len(self._parts) - 1
                # (a TypedStorage's own properties warn "TypedStorage is deprecated" to the caller: its bytes')
                if isinstance(obj, torch.TypedStorage) and obj._untyped_storage.device.type == "cpu":
                    self._parts.append(["storage", str(obj.dtype).rpartition(".")[2],
                                        encode_tensor(self._enc, _bytes_of(torch, obj._untyped_storage), torch)])
                    return len(self._parts) - 1
                if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu":
                    self._parts.append(["untyped", encode_tensor(self._enc, _bytes_of(torch, obj), torch)])
                    return len(self._parts) - 1
                return None

        _TORCH_PICKLER = TorchPickler
    return _TORCH_PICKLER


def _bytes_of(torch, storage):
    """A uint8 tensor over a whole storage (how a storage travels: as the tensor of its bytes)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),))


def _by_torch(enc, t, torch, grad: int) -> list:
    """Torch's own reduction of `t` (CUDA, sparse, quantized), and its grad field: torch's sparse rebuild drops
    `requires_grad` (a sparse leaf that required grad arrived without it)."""
    buf, parts = io.BytesIO(), []
    _torch_pickler(torch)(buf, enc, parts).dump(t)
    return [T_TORCH, buf.getvalue(), parts, grad]


def tensor_segments(handle: list) -> list[str]:
    """The segments a tensor handle names, one per receipt `decode_tensor` would count (torch's reductions:
    each part's), without opening any: a payload a worker never decodes is let go by them (codec.segments_named)."""
    kind = handle[0]
    if kind == T_SHM:
        return [handle[6]]
    if kind != T_TORCH:
        return []
    names = []
    for part in handle[2]:
        names += tensor_segments(part[2] if part[0] == "storage" else part[1] if part[0] == "untyped" else part)
    return names


def _from_torch(dec, handle: list, torch):
    _, payload, parts, grad = handle
    loaded = []
    for part in parts:
        if part[0] == "storage":
            loaded.append(torch.TypedStorage(wrap_storage=decode_tensor(dec, part[2]).untyped_storage(),
                                             dtype=getattr(torch, part[1]), _internal=True))
        elif part[0] == "untyped":
            loaded.append(decode_tensor(dec, part[1]).untyped_storage())
        else:
            loaded.append(decode_tensor(dec, part))
    unpickler = pickle.Unpickler(io.BytesIO(payload))
    unpickler.persistent_load = loaded.__getitem__
    t = unpickler.load()
    if grad & 1 and not t.requires_grad:  # (torch's sparse rebuild drops it)
        t.requires_grad_()
    return t
