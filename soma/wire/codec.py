"""Values on the wire: how a node's input and output become bytes, and back.

msgpack, with three extension types:

    TUPLE   a tuple (msgpack has only arrays; a tuple must come back a tuple)
    TENSOR  a tensor handle: dtype, shape, stride, offset, and where the bytes are:
              inline   small tensors: the bytes themselves (a segment per 0-d tensor costs more)
              shm      a shared-memory segment (`soma.wire.shm`): name and size, never the bytes
              meta     nothing but the shape
              torch    torch's own reduction (CUDA IPC handles, sparse and quantized tensors)
    PICKLE  anything else, by cloudpickle; tensors inside it still travel as handles

A tensor that requires grad and is not a leaf carries an autograd graph that
cannot cross processes: encoding it raises `GradCrossing`. The messages that
carry these bytes are `soma.wire.protocol`'s.
"""

from __future__ import annotations

import io
import sys
import threading

import msgpack

from ..errors import SharedMemoryFull

# value extension types
EXT_TUPLE, EXT_TENSOR, EXT_PICKLE = 1, 2, 3
# tensor handle kinds
T_INLINE, T_SHM, T_META, T_TORCH = 0, 1, 2, 3

# Below this many bytes a CPU tensor travels inline: one copy into the message is cheaper than
# creating or mapping a segment. Measured here (a tensor made in a worker and returned, medians):
# 4 KiB inline 347 us / shm 563 us; 16 KiB 494 / 516; 64 KiB 716 / 494; 256 KiB 1551 / 683.
INLINE_LIMIT = 32 * 1024


class GradCrossing(Exception):
    """A tensor with an autograd graph was about to cross a process boundary."""

    def reason(self, whose: str) -> str:
        """The sentence for a NodeError: `whose` is "its input is" or "it returned"."""
        fix = "return t.detach()" if whose == "it returned" else "send t.detach()"
        return (f"{whose} a tensor that requires grad and carries an autograd graph, which cannot cross into "
                f"another process (its graph would be cut silently). Training runs in-process: use soma.Executor "
                f"or soma.Trainer, or {fix} when only the values are meant to travel")


class Unsendable(Exception):
    """A value cannot be encoded for another process (the message says why)."""


def loaded_torch():
    """torch when it is imported far enough to have made tensors, else None (never imports it).

    A worker may be importing torch in the background: until `torch.Tensor` exists
    no value can be a tensor, and a half-imported module must not be touched.
    """
    torch = sys.modules.get("torch")
    return torch if torch is not None and hasattr(torch, "Tensor") and hasattr(torch, "multiprocessing") else None


class Encoder:
    """Encodes values for one message.

    `get_store(create)` gives this process's `SegmentStore`; with `create=False`
    it may answer None (no tensor has needed one yet).

    `shared` collects the segment names of every shm handle written, so the caller
    can count the lease after the message is built. Every tensor whose segment a
    handle names (one copied into a segment for this message, and one that was in
    a segment already) stays alive as long as the encoder does: keep the encoder
    until the sends are counted (`SegmentStore.note_sent`, the host's lease book),
    or the last holder could let go in between (the caller dropping its input, the
    host dropping a value it forwards from one piece to the next), the owner would
    see the segment idle and reuse it under the receiver.
    """

    def __init__(self, get_store):
        self._get_store = get_store
        self.shared: list[str] = []
        self.copied: list[int] = []  # bytes of each tensor copied into shared memory (for the trace)
        self._alive: list = []  # tensors the handles name, kept until the sends are counted (see above)

    def pack(self, value) -> bytes:
        local = _local
        try:
            if local.encoder is None:  # the thread's Packer is free (a value inside a value packs on its own)
                local.encoder = self
                try:
                    return local.pack(value)
                finally:
                    local.encoder = None
            return msgpack.packb(value, default=self._default, strict_types=True, use_bin_type=True)
        except (OverflowError, ValueError):
            # msgpack refuses nesting deeper than ~1,000 levels: pickle the whole value (Unsendable, saying
            # why, when pickle cannot either). Ints beyond 64 bits never get here: `_default` pickles them.
            return msgpack.packb(self._pickled(value), strict_types=True, use_bin_type=True)

    def _default(self, obj):
        kind = type(obj)
        if kind is tuple:
            return msgpack.ExtType(EXT_TUPLE, self.pack(list(obj)))
        torch = loaded_torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            return msgpack.ExtType(EXT_TENSOR, msgpack.packb(self.tensor(obj, torch), use_bin_type=True))
        return self._pickled(obj)

    def _pickled(self, obj) -> msgpack.ExtType:
        buf = io.BytesIO()
        handles: list = []
        pickler = _tensor_pickler()(buf, self, handles)
        try:
            pickler.dump(obj)
        except (GradCrossing, SharedMemoryFull, MemoryError):
            raise
        except Exception as err:
            raise Unsendable(f"{type(obj).__name__} cannot be sent to another process: {type(err).__name__}: {err}") from err
        return msgpack.ExtType(EXT_PICKLE, msgpack.packb([buf.getvalue(), handles], use_bin_type=True))

    def tensor(self, t, torch) -> list:
        if t.requires_grad and not t.is_leaf:
            raise GradCrossing()
        dtype = str(t.dtype).rpartition(".")[2]
        if t.device.type == "meta":
            return [T_META, dtype, list(t.shape), list(t.stride()), t.storage_offset(), t.requires_grad]
        if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized:
            from torch.multiprocessing.reductions import ForkingPickler

            # CUDA tensors travel as CUDA IPC handles (the producer keeps the block alive), sparse
            # and quantized ones through their parts; torch's reductions know how.
            return [T_TORCH, bytes(ForkingPickler.dumps(t))]
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()  # the lazy bits would be lost on the way
        nbytes = t.numel() * t.element_size()
        store = self._get_store(False)
        # Already in a segment: its name travels, whatever its size (and the receiver aliases it, as
        # it aliases any shared tensor). Otherwise small ones travel inline, large ones are copied in.
        found = store.locate(t) if store is not None and nbytes else None
        if found is None and nbytes < INLINE_LIMIT:
            import ctypes

            flat = t.contiguous()
            data = ctypes.string_at(flat.data_ptr(), nbytes) if nbytes else b""
            return [T_INLINE, dtype, list(t.shape), t.requires_grad, data]
        if found is not None:
            name, seg_bytes = found
            stride, offset = list(t.stride()), t.storage_offset()
        else:
            t, name, seg_bytes = self._get_store(True).copy_in(t)
            self.copied.append(nbytes)
            stride, offset = list(t.stride()), 0
        self._alive.append(t)
        self.shared.append(name)
        return [T_SHM, dtype, list(t.shape), stride, offset, t.requires_grad, name, seg_bytes]


class ThreadPacker(threading.local):
    """A msgpack Packer per thread, reused: making one costs more than packing a small value (0.7 µs
    against 0.3). A Packer keeps the largest buffer it ever grew; after a value over KEEP_BYTES the
    thread gets a fresh one, so a big message once does not stay allocated in every thread that sent it.
    `encoder` is the codec's: the Encoder packing on this thread now (see `_default_of_thread`).
    """

    KEEP_BYTES = 256 * 1024

    def __init__(self, **options):
        self.options = options
        self.packer = msgpack.Packer(**options)
        self.encoder = None

    def pack(self, value) -> bytes:
        data = self.packer.pack(value)
        if len(data) > self.KEEP_BYTES:
            self.packer = msgpack.Packer(**self.options)
        return data


def _default_of_thread(obj):
    return _local.encoder._default(obj)


_local = ThreadPacker(default=_default_of_thread, strict_types=True, use_bin_type=True)


_PICKLER = None


def _tensor_pickler():
    """cloudpickle's Pickler, with every tensor it meets sent as a handle beside the pickle.

    Built on first use: a worker that never pickles a value never imports cloudpickle.
    """
    global _PICKLER
    if _PICKLER is None:
        import cloudpickle

        class TensorPickler(cloudpickle.Pickler):
            def __init__(self, file, encoder: Encoder, handles: list):
                super().__init__(file, protocol=5)
                self._encoder = encoder
                self._handles = handles
                self._torch = loaded_torch()

            def persistent_id(self, obj):
                torch = self._torch
                if torch is not None and isinstance(obj, torch.Tensor):  # subclasses arrive as plain tensors
                    self._handles.append(self._encoder.tensor(obj, torch))
                    return len(self._handles) - 1
                return None

        _PICKLER = TensorPickler
    return _PICKLER


class Decoder:
    """Decodes values of one message; `get_store(create)` gives this process's `SegmentStore`."""

    def __init__(self, get_store):
        self._get_store = get_store
        self.received: list[str] = []  # segment names, for the host's lease book

    def unpack(self, data: bytes):
        return msgpack.unpackb(data, ext_hook=self._ext, raw=False, strict_map_key=False, use_list=True)

    def _ext(self, code: int, data: bytes):
        if code == EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == EXT_TENSOR:
            return self.tensor(msgpack.unpackb(data, raw=False, use_list=True))
        if code == EXT_PICKLE:
            payload, handles = msgpack.unpackb(data, raw=False, use_list=True)
            tensors = [self.tensor(h) for h in handles]
            return _tensor_unpickler()(io.BytesIO(payload), tensors).load()
        return msgpack.ExtType(code, data)

    def tensor(self, handle: list):
        import torch

        kind = handle[0]
        if kind == T_TORCH:
            import pickle

            return pickle.loads(handle[1])
        dtype = getattr(torch, handle[1])
        if kind == T_META:
            _, _, shape, stride, offset, grad = handle
            t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
            return t.requires_grad_() if grad else t
        if kind == T_INLINE:
            _, _, shape, grad, data = handle
            if not data:
                t = torch.empty(shape, dtype=dtype)
            else:
                t = torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
            return t.requires_grad_() if grad else t
        if kind == T_SHM:
            _, _, shape, stride, offset, grad, name, seg_bytes = handle
            itemsize = torch.empty(0, dtype=dtype).element_size()
            extent = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
            if offset < 0 or any(st < 0 for st in stride) or (offset + extent) * itemsize > seg_bytes:
                raise ValueError(f"tensor handle for {name} reaches outside its segment")
            storage = self._get_store(True).open(name, seg_bytes)
            self.received.append(name)
            t = torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)
            return t.requires_grad_() if grad else t
        raise ValueError(f"unknown tensor handle kind {kind}")


_UNPICKLER = None


def _tensor_unpickler():
    """pickle's Unpickler, taking tensors from beside the pickle (built on first use, like the pickler)."""
    global _UNPICKLER
    if _UNPICKLER is None:
        import pickle

        class TensorUnpickler(pickle.Unpickler):
            def __init__(self, file, tensors: list):
                super().__init__(file)
                self._tensors = tensors

            def persistent_load(self, pid):
                return self._tensors[pid]

        _UNPICKLER = TensorUnpickler
    return _UNPICKLER
