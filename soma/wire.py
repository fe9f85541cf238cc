"""The wire format between the host and its workers. Both sides import this module and nothing else
decides what goes on a socket.

A message is one ZeroMQ frame, `mac + body` (one frame: fewer copies and wakeups than two):

    body = msgpack([kind, *fields])

    host → worker   [TASK, task_id, {node key: code}, [branch spec], input, [[segment, n]] frees,
                     [node key] forget]
                    [FREE, [[segment, n]]]          [STOP]
    worker → host   [HELLO, worker id, pid, device]
                    [RESULT, worker id, task_id, [[True, output] | [False, error]], releases]
    mac  = blake2b(body, key=pool secret, digest_size=16)

A frame whose mac does not verify, or whose body does not decode, is dropped and
logged; nothing in it is ever unpickled (pickle runs only on authenticated bodies).

Values (a node's input and output) are msgpack with three extension types:

    TUPLE   a tuple (msgpack has only arrays; a tuple must come back a tuple)
    TENSOR  a tensor handle: dtype, shape, stride, offset, and where the bytes are:
              inline   small tensors: the bytes themselves (a segment per 0-d tensor costs more)
              shm      a shared-memory segment (`soma.shm`): name and size, never the bytes
              meta     nothing but the shape
              torch    torch's own reduction (CUDA IPC handles, sparse and quantized tensors)
    PICKLE  anything else, by cloudpickle; tensors inside it still travel as handles

A tensor that requires grad and is not a leaf carries an autograd graph that
cannot cross processes: encoding it raises `GradCrossing`.
"""

from __future__ import annotations

import io
import os
import sys

import msgpack

from ._log import warn

try:  # keyed BLAKE2 straight from its module: hashlib would load OpenSSL first (5 ms per worker start)
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - every CPython has it, other interpreters may not
    from hashlib import blake2b
try:
    from _operator import _compare_digest as compare_digest
except ImportError:  # pragma: no cover
    from hmac import compare_digest


# message kinds
HELLO, TASK, STOP, FREE, RESULT = range(1, 6)
KIND_NAMES = {HELLO: "HELLO", TASK: "TASK", STOP: "STOP", FREE: "FREE", RESULT: "RESULT"}

# value extension types
EXT_TUPLE, EXT_TENSOR, EXT_PICKLE = 1, 2, 3
# tensor handle kinds
T_INLINE, T_SHM, T_META, T_TORCH = 0, 1, 2, 3

# Below this many bytes a CPU tensor travels inline: one copy into the message is cheaper than
# creating or mapping a segment. Measured here (a tensor made in a worker and returned, medians):
# 4 KiB inline 347 us / shm 563 us; 16 KiB 494 / 516; 64 KiB 716 / 494; 256 KiB 1551 / 683.
INLINE_LIMIT = 32 * 1024

SECRET_ENV = "SOMA_SECRET"
MAC_SIZE = 16


class GradCrossing(Exception):
    """A tensor with an autograd graph was about to cross a process boundary."""


class Unsendable(Exception):
    """A value cannot be encoded for another process (the message says why)."""


# -- envelopes -------------------------------------------------------------------------------

def mac(secret: bytes, body: bytes) -> bytes:
    return blake2b(body, key=secret, digest_size=MAC_SIZE).digest()


def seal(secret: bytes, message: list) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return mac(secret, body) + body


def unseal(secret: bytes, frames: list, origin: str) -> list | None:
    """The message in `frames`, or None (logged) when it does not authenticate or decode."""
    if len(frames) != 1 or len(frames[0]) < MAC_SIZE:
        warn("soma.wire", "soma: dropped a message from %s of %d frames (expected one sealed frame)", origin, len(frames))
        return None
    frame = frames[0]
    tag, body = frame[:MAC_SIZE], frame[MAC_SIZE:]
    if not compare_digest(tag, mac(secret, body)):
        warn("soma.wire", "soma: dropped a message from %s that failed authentication", origin)
        return None
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False, use_list=True)
    except Exception as err:
        warn("soma.wire", "soma: dropped an authenticated message from %s that did not decode: %s", origin, err)
        return None
    if not isinstance(message, list) or not message or message[0] not in KIND_NAMES:
        warn("soma.wire", "soma: dropped a message from %s of unknown shape", origin)
        return None
    return message


def context():
    """A ZeroMQ context for one side of the pool, its I/O thread started under SCHED_BATCH.

    Every send wakes libzmq's I/O thread; under the default policy Linux preempts the
    sender right there (wakeup preemption), so each send costs two context switches
    on a busy core. A SCHED_BATCH I/O thread does not preempt: it runs when the sender
    blocks, which it does right after sending anyway (measured here: raw round trips
    ~20% faster, the worker's CPU per round trip down by a third).
    """
    import zmq

    ctx = zmq.Context(1)
    try:
        ctx.set(zmq.THREAD_SCHED_POLICY, SCHED_BATCH)
        ctx.set(zmq.THREAD_PRIORITY, 0)  # SCHED_BATCH takes priority 0 only
    except (AttributeError, zmq.ZMQError):  # an older libzmq: the default policy still works
        pass
    return ctx


SCHED_BATCH = 3  # os.SCHED_BATCH on Linux


class Receiver:
    """Receives from one socket with as few calls as possible: both sides' hot path.

    A blocking `recv` with a receive timeout is one call where `poll` + `recv`
    is two (and `socket.poll` builds a new poller each time); `ready()` asks the
    socket whether more is queued instead of ending every batch on a raised
    `zmq.Again`.
    """

    def __init__(self, sock):
        import zmq

        self._again = zmq.Again
        # Plain ints and the backend's get/set: pyzmq's getsockopt builds enums on every call.
        self._rcvtimeo = int(zmq.RCVTIMEO)
        self._events, self._pollin = int(zmq.EVENTS), int(zmq.POLLIN)
        self.sock = sock
        self._timeout_ms = None

    def wait(self, timeout_ms: int) -> list | None:
        """The next message's frames, or None when none came within `timeout_ms`."""
        sock = self.sock
        if timeout_ms != self._timeout_ms:
            sock.set(self._rcvtimeo, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            # One frame: a sealed message is one frame, and each frame of anything longer is garbage
            # that unseal drops on its own.
            return [sock.recv()]
        except self._again:
            return None

    def ready(self) -> bool:
        return bool(self.sock.get(self._events) & self._pollin)


# -- values ------------------------------------------------------------------------------------

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
    can count the lease after the message is built.
    """

    def __init__(self, get_store):
        self._get_store = get_store
        self.shared: list[str] = []
        self._copies: list = []

    def pack(self, value) -> bytes:
        try:
            return msgpack.packb(value, default=self._default, strict_types=True, use_bin_type=True)
        except (OverflowError, ValueError):
            # msgpack refuses ints beyond 64 bits and very deep nesting: pickle the whole value.
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
        except GradCrossing:
            raise
        except Exception as err:
            raise Unsendable(f"{type(obj).__name__} cannot be sent to another process: {type(err).__name__}: {err}") from err
        return msgpack.ExtType(EXT_PICKLE, msgpack.packb([buf.getvalue(), handles], use_bin_type=True))

    def tensor(self, t, torch) -> list:
        if t.requires_grad and not t.is_leaf:
            raise GradCrossing(
                "a tensor that requires grad and carries an autograd graph cannot cross into another process "
                "(its graph would be cut silently). Training runs in-process: use soma.Executor or soma.Trainer, "
                "or send t.detach() when only the values are meant to travel"
            )
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
            self._copies.append(t)
            stride, offset = list(t.stride()), 0
        self.shared.append(name)
        return [T_SHM, dtype, list(t.shape), stride, offset, t.requires_grad, name, seg_bytes]


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


class StatusPage:
    """A page of shared memory where a worker publishes the nodes it is running.

    The host reads it when the worker dies or a run times out, so `WorkerDied`
    and `RunTimeout` name the node even though the worker can no longer answer.
    Layout: a sequence number, a length, then the ids separated by newlines; the
    writer bumps the sequence before and after writing (odd = being written).
    """

    SIZE = 4096

    def __init__(self, path: str, create: bool):
        import mmap

        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self._seq = 0

    def write(self, names) -> None:
        data = "\n".join(names).encode()[: self.SIZE - 8]
        self._seq += 1
        self._map[0:4] = self._seq.to_bytes(4, "little")
        self._map[4:8] = len(data).to_bytes(4, "little")
        self._map[8 : 8 + len(data)] = data
        self._seq += 1
        self._map[0:4] = self._seq.to_bytes(4, "little")

    def read(self) -> list[str]:
        for _ in range(100):
            before = int.from_bytes(self._map[0:4], "little")
            size = int.from_bytes(self._map[4:8], "little")
            data = self._map[8 : 8 + min(size, self.SIZE - 8)]
            if before % 2 == 0 and int.from_bytes(self._map[0:4], "little") == before:
                return [n for n in data.decode(errors="replace").split("\n") if n]
        return []

    def close(self) -> None:
        self._map.close()


def pickle_exception(exc: BaseException) -> bytes | None:
    """The exception, cloudpickled, or None when it cannot travel (its text always does)."""
    import pickle

    import cloudpickle

    try:
        data = cloudpickle.dumps(exc)
        pickle.loads(data)  # an exception that pickles but cannot be rebuilt is as good as none
        return data
    except Exception:
        return None
