"""Buffers on the wire: numpy arrays, bytes-like values, and the pickle stream with its out-of-band buffers.

    ARRAY   an exact `numpy.ndarray` (no object fields), as a handle: dtype, shape, strides (bytes),
            where its first element sits, whether it was writable, and where the bytes are:
              inline   the bytes themselves (under the inline limit)
              shm      a segment's name and size (`soma.wire.shm`), never the bytes
    PICKLE  anything else (and, whole, a value too big or too varied for msgpack), by cloudpickle with
            protocol 5: the stream itself inline or in a segment of its own; every buffer the pickling
            exposes (`PickleBuffer`: numpy, pandas, pyarrow) of at least the inline limit out of band,
            each in a segment; tensors and exact arrays inside it as handles beside it ("parts")

An array's form travels as it is where that is free: a dense array (C or
Fortran order, or any permutation of its axes: an HWC image transposed to CHW)
and a broadcast one (stride 0) cross as the span of memory they cover, strides
kept; an array with gaps (`a[::3]`) is compacted to C order, since copying the
gaps would cost more than the values. An array that already lives in a segment
(received, or made with `ctx.empty_array`) travels by name with its strides,
whatever its size. The receiver gets an ndarray over its own view of the
segment: writable unless it was sent read-only, with the sender's alignment.
"""

from __future__ import annotations

import ctypes
import functools
import pickle
import sys
import threading

import msgpack

from .mapping import address_of


class GradCrossing(Exception):
    """A tensor with an autograd graph was about to cross a process boundary."""

    def reason(self, whose: str) -> str:
        """The sentence for a NodeError: `whose` is "its input is" or "it returned"."""
        fix = "return t.detach()" if whose == "it returned" else "send t.detach()"
        return (f"{whose} a tensor that requires grad and carries an autograd graph, which cannot cross into "
                f"another process (its graph would be cut silently). Training runs in-process: use soma.Executor "
                f"or soma.Trainer; when only the values are meant to travel, run the model under "
                f"`with torch.no_grad():`, freeze it with model.requires_grad_(False), or {fix} "
                f"(soma.torch.Module and Batched do this for you on workers)")

# Below this many bytes a value's bytes travel inline: one copy into the message is cheaper than creating or
# mapping a segment. Measured here (a tensor made in a worker and returned, medians):
# 4 KiB inline 347 us / shm 563 us; 16 KiB 494 / 516; 64 KiB 716 / 494; 256 KiB 1551 / 683.
INLINE_LIMIT = 32 * 1024
ALIGN = 64  # a copy keeps its source's address modulo this (SIMD loads stay aligned)

# array handle kinds
A_INLINE, A_SHM = 0, 1


def loaded_torch():
    """torch when it is imported far enough to have made tensors, else None (never imports it).

    A worker may be importing torch in the background: until `torch.Tensor` exists
    no value can be a tensor, and a half-imported module must not be touched.
    """
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "Tensor") and hasattr(torch, "multiprocessing") else None


# -- addresses of buffers ----------------------------------------------------------------------------

class _PyBuffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = None


def buffer_address(obj) -> int:
    """The address of the first byte of a contiguous buffer (bytes, bytearray, memoryview, PickleBuffer, ...).

    Valid while `obj` lives and is not resized: the caller keeps it. Read-only buffers too (ctypes'
    `from_buffer` refuses those), and without numpy.
    """
    global _get_buffer
    if _get_buffer is None:
        api = ctypes.pythonapi
        api.PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
        api.PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
        _get_buffer = api
    view = _PyBuffer()
    _get_buffer.PyObject_GetBuffer(obj, ctypes.byref(view), 0)  # PyBUF_SIMPLE: contiguous bytes, or an error
    try:
        return view.buf or 0
    finally:
        _get_buffer.PyBuffer_Release(ctypes.byref(view))


def span(shape, strides, itemsize: int) -> tuple[int, int]:
    """`(lo, hi)`: the bytes an array reaches, relative to its first element (`lo` <= 0 with negative strides)."""
    lo = hi = 0
    for size, stride in zip(shape, strides):
        if size == 0:
            return 0, 0
        reach = (size - 1) * stride
        if reach < 0:
            lo += reach
        else:
            hi += reach
    return lo, hi + itemsize


# -- numpy arrays ------------------------------------------------------------------------------------

_dtypes: dict = {}


def _dtype_field(dtype):
    """`dtype.str` when it says everything (plain dtypes, byte order, datetime units); else the pickled dtype."""
    if dtype.names is None and dtype.subdtype is None and dtype.metadata is None:
        return dtype.str
    return pickle.dumps(dtype, protocol=5)


def _dtype_of(field):
    found = _dtypes.get(field)
    if found is None:
        import numpy

        found = numpy.dtype(field) if isinstance(field, str) else pickle.loads(field)
        if isinstance(field, str):
            _dtypes[field] = found
    return found


def encode_array(enc, a) -> list:
    """The handle of an exact ndarray (object dtypes never get here: numpy pickles their elements)."""
    dtype = a.dtype
    shape, strides = list(a.shape), list(a.strides)
    address = a.__array_interface__["data"][0]
    lo, hi = span(shape, strides, dtype.itemsize)
    nbytes = hi - lo
    field = _dtype_field(dtype)
    writeable = bool(a.flags.writeable)
    if nbytes == 0:
        return [A_INLINE, field, shape, strides, 0, writeable, b""]
    start = address + lo
    where = enc.found(start, nbytes, a)
    if where is None and nbytes <= a.nbytes:  # dense or broadcast: its span, strides kept
        if nbytes < INLINE_LIMIT:
            return [A_INLINE, field, shape, strides, -lo, writeable, ctypes.string_at(start, nbytes)]
        where = enc.copy_in(start, nbytes, pad=start % ALIGN)
    if where is None:  # gaps between its elements: compacted, C order
        import numpy

        compact = [a.itemsize] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            compact[i] = compact[i + 1] * shape[i + 1]
        if a.nbytes < INLINE_LIMIT:
            return [A_INLINE, field, shape, compact, 0, writeable, numpy.ascontiguousarray(a).tobytes()]
        view, name, seg_bytes = enc.fresh(a.nbytes)
        numpy.copyto(numpy.ndarray(a.shape, dtype, buffer=view), a)
        return [A_SHM, field, shape, compact, 0, writeable, name, seg_bytes]
    name, seg_bytes, offset = where
    return [A_SHM, field, shape, strides, offset - lo, writeable, name, seg_bytes]


def array_segments(handle: list) -> list[str]:
    """The segment an array handle names (one receipt `decode_array` would count), or none: see tensor_segments."""
    return [handle[6]] if handle[0] == A_SHM else []


def pickle_segments(body: bytes, ext_hook) -> list[str]:
    """The segments a PICKLE extension's body names by buffer (its stream, when in a segment, and its out-of-band
    buffers), one per receipt `load_pickle` would count; its parts' handles go through `ext_hook`, unpickling
    nothing (codec.segments_named)."""
    stream, _, oob = msgpack.unpackb(body, ext_hook=ext_hook, raw=False, use_list=True)
    return [handle[0] for handle in oob] + ([stream[0]] if not isinstance(stream, bytes) else [])


def decode_array(dec, handle: list):
    import numpy

    kind, field, shape, strides, offset, writeable = handle[:6]
    dtype = _dtype_of(field)
    lo, hi = span(shape, strides, dtype.itemsize)
    if kind == A_INLINE:
        data = handle[6]
        if hi == lo:
            a = numpy.empty(shape, dtype)
        else:
            a = numpy.ndarray(shape, dtype, buffer=bytearray(data), offset=offset, strides=strides)
    elif kind == A_SHM:
        name, seg_bytes = handle[6], handle[7]
        if offset + lo < 0 or offset + hi > seg_bytes:
            raise ValueError(f"array handle for {name} reaches outside its segment")
        view = dec.open(name, seg_bytes)
        a = numpy.ndarray(shape, dtype, buffer=view, offset=offset, strides=strides)
    else:
        raise ValueError(f"unknown array handle kind {kind}")
    if not writeable:
        a.flags.writeable = False
    return a


# -- the pickle stream ---------------------------------------------------------------------------------

class _Chunks:
    """Where the pickler writes: a list of what it wrote, large payloads (a big `bytes`, an in-band buffer)
    by reference, so the stream is copied once, into its segment, and not first into one big bytes."""

    __slots__ = ("chunks", "size")

    def __init__(self):
        self.chunks: list = []
        self.size = 0

    def write(self, data) -> int:
        n = len(data) if type(data) is bytes else memoryview(data).nbytes
        self.chunks.append(data)
        self.size += n
        return n


_PICKLER = None


def _value_pickler():
    """cloudpickle's Pickler, protocol 5, with tensors and exact arrays sent as handles beside the pickle and
    large out-of-band buffers in shared memory. Built on first use: a worker that never pickles a value never
    imports cloudpickle."""
    global _PICKLER
    if _PICKLER is None:
        import cloudpickle

        class ValuePickler(cloudpickle.Pickler):
            def __init__(self, file, enc, parts: list, oob: list):
                # The callback must not be a method of ours: a pickler holding its own bound method is a cycle,
                # and the encoder (with the buffers it keeps alive) would then wait for the garbage collector,
                # whose clearing of a memoryview that still exports its buffer crashed a worker (SIGSEGV).
                super().__init__(file, protocol=5, buffer_callback=functools.partial(_out_of_band, enc, oob))
                self._enc, self._parts = enc, parts
                self._torch = loaded_torch()
                numpy = sys.modules.get("numpy")
                self._ndarray = getattr(numpy, "ndarray", None)

            def reducer_override(self, obj):
                # Called for objects of types the pickler does not handle itself (never for ints, strs, ...).
                kind = type(obj)
                torch = self._torch
                if (kind is self._ndarray and not obj.dtype.hasobject) or (
                        torch is not None and (kind is torch.Tensor or kind is torch.nn.Parameter)):
                    self._parts.append(self._enc.ext(obj))  # (an nn.Parameter as one: its handle says so)
                    return _part, (len(self._parts) - 1,)
                if torch is not None and isinstance(obj, torch.Tensor):
                    return reduce_subclass(obj, torch)
                if kind is memoryview:  # (pickle refuses them)
                    return _reduce_memoryview(obj)
                if kind is self._ndarray and not obj.flags.writeable:  # (objects in it: numpy's pickle, which
                    rebuild, args, state = obj.__reduce_ex__(5)  # makes it writable; an exact array's handle
                    return rebuild, args, state, None, None, _set_read_only  # says so)
                return super().reducer_override(obj)

        _PICKLER = ValuePickler
    return _PICKLER


def reduce_subclass(t, torch) -> tuple:
    """A tensor subclass's reduction (a torchvision BoundingBoxes, a Parameter's subclass): its data as a plain
    tensor (a handle beside the pickle, in a segment when large), its class, whether it requires grad, and its
    state (`__dict__` and slots), made again as torch's own pickling makes one. (A handle describes plain tensors
    only: sent as one, a subclass arrived as a plain tensor, its class and attributes lost, Dec 7.)"""
    if t.requires_grad and not t.is_leaf:
        raise GradCrossing()
    return _subclass, (t.detach().as_subclass(torch.Tensor), type(t), t.requires_grad,
                       torch._utils._get_obj_state(t))


def _subclass(plain, cls, grad: bool, state):
    """`reduce_subclass`'s tensor again: `plain` as a `cls`, its state set (by its own `__setstate__` if it has
    one, as torch's `_rebuild_from_type_v2` does), requiring grad as it did (a leaf: made from plain data)."""
    import torch

    t = plain.as_subclass(cls)
    if getattr(cls, "__setstate__", torch.Tensor.__setstate__) is not torch.Tensor.__setstate__:
        t.__setstate__(state)
    elif state:
        t = torch._utils._set_obj_state(t, state)
    return t.requires_grad_() if grad else t


def _set_read_only(array, state) -> None:
    """A read-only numpy array of objects, made again by numpy's own reduction, gets its state, and is read-only
    again (a node could write into what its caller sent read-only). A state setter, not a wrapper: pickle has
    the array in its memo by then, so one that holds itself still pickles."""
    array.__setstate__(state)
    array.flags.writeable = False


def _out_of_band(enc, oob: list, buffer) -> bool:
    """The pickler's buffer callback: a large buffer goes in a segment (found there, or copied in), out of band."""
    raw = buffer.raw()
    if raw.nbytes < INLINE_LIMIT:
        return True  # in band: a segment costs more than the bytes
    start = buffer_address(raw)
    where = enc.found(start, raw.nbytes, buffer) or enc.copy_in(start, raw.nbytes, pad=start % ALIGN)
    oob.append([*where, raw.nbytes])
    return False


def dump_pickle(enc, obj, fast: bool) -> bytes:
    """The PICKLE extension's body for `obj`: `[stream, parts, out-of-band buffers]`.

    `fast` pickles without a memo (no table of every object seen: a dict of a million
    keys pickles 3-5x faster); an object referenced twice then arrives as two copies,
    as it does through msgpack. Whatever fails that way is pickled again with its memo,
    which then says what is wrong, if anything: a cycle cannot be pickled without one,
    nor can a class pickled by value (a script's or a function's own: cloudpickle's
    class refers to itself, "excessively deep recursion"), and CPython's pickler
    raises KeyError for frozensets in fast mode.
    """
    checkpoint = enc.checkpoint()
    chunks, parts, oob = _Chunks(), [], []
    pickler = _value_pickler()(chunks, enc, parts, oob)
    pickler.fast = fast
    try:
        pickler.dump(obj)
    except Exception:
        if not fast:
            raise
        enc.rollback(checkpoint)
        return dump_pickle(enc, obj, fast=False)
    if chunks.size < INLINE_LIMIT:
        stream = b"".join(chunks.chunks)
    else:
        view, name, seg_bytes = enc.fresh(chunks.size)
        at = address_of(view)
        for chunk in chunks.chunks:
            n = len(chunk) if type(chunk) is bytes else memoryview(chunk).nbytes
            ctypes.memmove(at, buffer_address(chunk), n)  # (releases the GIL: other threads run meanwhile)
            at += n
        stream = [name, seg_bytes, 0, chunks.size]
    return msgpack.packb([stream, parts, oob], use_bin_type=True)


def _reduce_memoryview(obj: memoryview) -> tuple:
    """A memoryview's reduction: its bytes (out of band when large), format, shape and writability. A writable
    one that is not contiguous goes as a writable copy (it arrived read-only, as `tobytes()`). One of a format
    `memoryview.cast` cannot make (a struct's, as a structured numpy array's) goes as the array numpy reads from
    it, when numpy is loaded (it arrived as bytes, format "B"), and is a view of that array again; so does one of
    a format or shape cast cannot make (float16's "e", complex, "2s", a 0 in its shape: `castable`)."""
    format = obj.format
    if not castable(obj):
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            array = array_of(numpy, obj)
            if array is not None and not array.dtype.hasobject:
                return memoryview, (array,)
    if obj.c_contiguous:
        return _memoryview, (pickle.PickleBuffer(obj), format, obj.shape, False)
    data = obj.tobytes() if obj.readonly else bytearray(obj.tobytes())
    return _memoryview, (pickle.PickleBuffer(data), format, obj.shape, obj.readonly)


def array_of(numpy, view: memoryview):
    """The numpy array `view` views (no copy), or None when numpy cannot read it. numpy cannot read back some
    formats it writes itself, a packed struct's (empty, or made by `frombuffer`: `T{h:a:B:b:}` without its
    `=`, "Item size 3 ... does not match the dtype V item size 4"): those are read with the dtype of the array
    the view was made from (they were refused as unsendable)."""
    try:
        return numpy.asarray(view)
    except (TypeError, ValueError, NotImplementedError, RuntimeError):
        pass
    base = getattr(view, "obj", None)
    if type(base) is not numpy.ndarray or base.dtype.itemsize != view.itemsize or not view.c_contiguous:
        return None
    return numpy.frombuffer(view.cast("B"), dtype=base.dtype).reshape(view.shape)


_CASTS = frozenset("bBchHiIlLqQnNfd?P")  # the formats memoryview.cast makes (not "e", "Zd", "2s", "T{...}")


def castable(view: memoryview) -> bool:
    """Whether `view` can be made again from its bytes by `memoryview.cast` (its format one of those cast makes, no
    0 in its shape); else it goes as the numpy array it views (`_reduce_memoryview`, soma.ray.values)."""
    return view.format.lstrip("@") in _CASTS and 0 not in view.shape


def _memoryview(buffer, format: str, shape, readonly: bool) -> memoryview:
    """A memoryview as it went: over the shared memory its bytes came in when they were large."""
    view = memoryview(buffer)
    if readonly:
        view = view.toreadonly()
    try:
        return view.cast("B").cast(format, shape)
    except (TypeError, ValueError):  # a format cast cannot make (numpy was not loaded to send it): its bytes
        return view.cast("B")


_loading = threading.local()


def _part(i: int):
    """What a pickle made by `dump_pickle` calls to get back a tensor or array that travelled beside it."""
    return _loading.parts[-1][i]


def load_pickle(dec, body: bytes):
    stream, parts, oob = msgpack.unpackb(body, ext_hook=dec.ext_hook, raw=False, use_list=True)
    buffers = [dec.buffer(handle) for handle in oob]
    source = stream if isinstance(stream, bytes) else dec.buffer(stream)
    stack = getattr(_loading, "parts", None)
    if stack is None:
        stack = _loading.parts = []
    stack.append(parts)
    try:
        return pickle.loads(source, buffers=buffers)
    finally:
        stack.pop()
