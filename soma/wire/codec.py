"""Values on the wire: how a node's input and output become bytes, and back.

msgpack, with five extension types:

    TUPLE   the mark that leads the list a tuple travels as (msgpack has only arrays; a tuple must come
            back a tuple): `(a, b)` packs as `[TUPLE, a, b]` in the same pass as the rest of the value
    TENSOR  a tensor handle (`soma.wire.tensors`): dtype, shape, stride, offset, and where the bytes are
    ARRAY   an ndarray handle (`soma.wire.buffers`): the same for exact numpy arrays
    PICKLE  anything else, by cloudpickle (protocol 5): a large stream and the large buffers its pickling
            exposes go in shared memory; tensors and arrays inside it travel as handles beside it
    REF     the same tensor or array once more in this message: it arrives as the same object

Which way a value goes (`route`): plain data (None, bools, ints, floats, strs,
small bytes; lists, tuples and dicts of them, tensors and arrays anywhere in
them) goes through msgpack, fast for small messages. A value msgpack would
change or that would make a big message goes whole as one PICKLE instead: one
holding a `bytearray` or `memoryview` (msgpack would turn them into `bytes`), a
`bytes` of at least the inline limit, more than MSGPACK_ITEMS items, more than
TUPLES_PICKLED tuples (msgpack has none: each costs a Python call on each side,
pickle makes them in C), or a msgpack form over BIG_MESSAGE bytes. A list of
values packed each on its own (`pack_each`: a batch's or a chunk's outputs)
that cannot go in one msgpack pass goes as one pickle when it is plain data
through and through (a pickle without memo shares nothing between them), else
value by value. Its large buffers then sit in shared
memory: nothing large crosses the socket, and a `bytes` is copied once on each
side (what ProcessPoolExecutor copies twice on each).

A tensor that requires grad and is not a leaf carries an autograd graph that
cannot cross processes: encoding it raises `GradCrossing`. The messages that
carry these bytes are `soma.wire.protocol`'s.
"""

from __future__ import annotations

import sys
import threading
from itertools import chain

import msgpack

from ..errors import SharedMemoryFull
from . import room
from .buffers import (
    INLINE_LIMIT,
    GradCrossing,
    array_segments,
    decode_array,
    dump_pickle,
    encode_array,
    load_pickle,
    loaded_torch,
    pickle_segments,
)
from .mapping import address_of
from .tensors import (
    SHARED_STORAGES,
    T_INLINE,
    T_META,
    T_SHM,
    T_TORCH,
    decode_tensor,
    encode_tensor,
    tensor_segments,
)

__all__ = ["INLINE_LIMIT", "GradCrossing", "Unsendable", "Encoder", "Decoder", "loaded_torch", "route",
           "T_INLINE", "T_SHM", "T_META", "T_TORCH"]

# value extension types
EXT_TUPLE, EXT_TENSOR, EXT_PICKLE, EXT_ARRAY, EXT_REF = 1, 2, 3, 4, 5

# More items than this in a value's lists and dicts (counted until the count is passed), and it travels as one
# pickle: decoding a dict of many str keys costs msgpack 2.5x what it costs pickle (msgpack interns every key).
MSGPACK_ITEMS = 4096
# A msgpack form bigger than this is made again as one pickle, in shared memory rather than through the socket.
BIG_MESSAGE = 1 << 20
# More tuples than this in a value, and it travels as one pickle: msgpack has no tuple, so each one costs a Python
# call on each side (a list of 2-tuples there and back: ~2 µs a tuple through msgpack, ~0.2 through pickle, whose
# Pickler costs ~20 µs more a message: the two meet at ~12 tuples, measured).
TUPLES_PICKLED = 16


class Unsendable(Exception):
    """A value cannot be encoded for another process (the message says why). `too_deep`: it is plain data
    that nests too deep, not something that cannot be pickled (the hint differs)."""

    too_deep = False


def nesting_depth(value, stop: int = 100_000) -> int:
    """How deep lists, tuples and dicts nest in `value` (walked without recursion; counting stops at `stop`)."""
    deepest, todo = 0, [(value, 1)]
    while todo and deepest < stop:
        item, depth = todo.pop()
        if type(item) in _CONTAINERS:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in (item.values() if type(item) is dict else item))
    return deepest


def _too_deep(obj, err) -> Unsendable | None:
    """The error for a value that failed only because it nests deeper than pickle can follow, else None."""
    if not isinstance(err, RecursionError) and "recursion" not in str(err):
        return None
    depth = nesting_depth(obj)
    if depth < 100:  # (the recursion is in something else, an object's own pickling: said as it is)
        return None
    unsendable = Unsendable(
        f"{type(obj).__name__} nests {depth} levels deep, deeper than pickle can follow (Python's recursion limit "
        f"is {sys.getrecursionlimit()}): flatten it (rows in one list, not lists inside lists)")
    unsendable.too_deep = True
    return unsendable


# -- which way a value goes -----------------------------------------------------------------------

MSGPACK, PICKLE = 0, 1
_PLAIN = frozenset({int, float, str, bool, type(None)})
_CONTAINERS = frozenset({list, tuple, dict})
_CHANGED = frozenset({bytearray, memoryview})  # msgpack packs them as bytes: they would arrive as bytes
_chain = chain.from_iterable


def route(value) -> int:
    """MSGPACK when msgpack carries `value` exactly and small, else PICKLE (see the module's docstring).

    The walk goes a level of nesting at a time: every container's items on one level are gathered and their
    types looked at in C (`chain.from_iterable`, `set(map(type, ...))`), so a list of a thousand ints, or of a
    thousand small tuples or dicts, costs a few Python steps, not one per container (one per container was
    most of what encoding a list of tuples cost: ~1 µs a tuple). It stops once MSGPACK_ITEMS items are passed.
    """
    kind = type(value)
    if kind in _PLAIN:
        return MSGPACK
    if kind is bytes:
        return MSGPACK if len(value) < INLINE_LIMIT else PICKLE
    if kind not in _CONTAINERS:
        return PICKLE if kind in _CHANGED else MSGPACK  # (an object of its own: msgpack's default pickles it)
    budget, tuples = MSGPACK_ITEMS, TUPLES_PICKLED
    level, kinds = [value], {kind}  # the containers of one level of nesting, and the types among them
    while level:
        budget -= sum(map(len, level))  # (a dict's len: its keys; its values count below as items, not here)
        if tuple in kinds:
            tuples -= list(map(type, level)).count(tuple) if len(level) > 1 else 1
        if budget < 0 or tuples < 0:
            return PICKLE
        items = _items(level, kinds)
        kinds = set(map(type, items))
        if kinds <= _PLAIN:
            return MSGPACK
        if kinds & _CHANGED:
            return PICKLE
        if bytes in kinds and any(type(x) is bytes and len(x) >= INLINE_LIMIT for x in items):
            return PICKLE
        if not kinds & _CONTAINERS:
            return MSGPACK
        level = items if kinds <= _CONTAINERS else [x for x in items if type(x) in _CONTAINERS]
        kinds &= _CONTAINERS
    return MSGPACK


def _plain_only(value) -> bool:
    """Whether `value` holds nothing but plain data (None, bools, ints, floats, strs, bytes; lists, tuples and
    dicts of them): no tensor, array or object of its own, which two values pickled together could share.
    A level of nesting at a time, as `route` walks."""
    level, kinds = [value], {type(value)}
    while True:
        if not kinds <= _PLAIN_ONLY:
            return False
        if not kinds & _CONTAINERS:
            return True
        if not kinds <= _CONTAINERS:
            level, kinds = [x for x in level if type(x) in _CONTAINERS], kinds & _CONTAINERS
        level = _items(level, kinds)
        kinds = set(map(type, level))


def _items(level, kinds: set):
    """Every item of the containers of one level (`kinds`: their types), a dict's keys and values alike, gathered
    in C (one list or tuple alone: its own items)."""
    if dict not in kinds:
        return level[0] if len(level) == 1 else list(_chain(level))
    items = list(_chain(level))  # (a dict gives its keys here ...)
    items += _chain(map(dict.values, [c for c in level if type(c) is dict]))  # (... and its values)
    return items


_PLAIN_ONLY = _PLAIN | _CONTAINERS | {bytes}


# -- encoding -----------------------------------------------------------------------------------

class Encoder:
    """Encodes values for one message.

    `get_store(create)` gives this process's `SegmentStore`; with `create=False`
    it may answer None (no value has needed one yet).

    `shared` collects the segment name of every handle written (one entry per
    handle), so the caller can count the lease after the message is built. Every
    value whose segment a handle names (a copy made into a segment for this
    message, and one that was in a segment already) stays alive as long as the
    encoder does: keep the encoder until the sends are counted
    (`SegmentStore.note_sent`, the host's lease book), or the last holder could
    let go in between (the caller dropping its input, the host dropping a value
    it forwards from one piece to the next), the owner would see the segment idle
    and reuse it under the receiver.
    """

    __slots__ = ("_get_store", "shared", "copied", "_alive", "_copies", "_numbered", "_order", "_scope", "_tied")

    def __init__(self, get_store):
        self._get_store = get_store
        self.shared: list[str] = []
        self.copied: list[int] = []  # bytes of each value copied into shared memory (for the trace)
        self._alive: list = []  # what the handles name, kept until the sends are counted (see above)
        self._copies: list = []  # (start, end, name, segment bytes, offset): heap bytes copied for this message
        self._numbered: dict = {}  # id of a tensor or array sent in this message → its number (for REF)
        self._order: list = []  # those objects, in order (alive, so their ids stay theirs)
        self._scope = 0  # the first of `_copies` the value being packed may reuse (see pack_each)
        self._tied = False  # a REF, or a view of a copy made for this message, was written (see pack_each)

    def pack(self, value) -> bytes:
        checkpoint = self.checkpoint()
        if route(value) == MSGPACK:
            try:
                data = self._pack_plain(value)
                if len(data) <= BIG_MESSAGE:
                    return data
            except (OverflowError, ValueError):
                pass  # msgpack refuses nesting deeper than ~1,000 levels: pickle the whole value
            self.rollback(checkpoint)
        return msgpack.packb(self._pickled(value, fast=True), strict_types=True, use_bin_type=True)

    def pack_each(self, values: list) -> bytes:
        """The list `values`, each one encoded as `pack` would encode it alone (its own way, msgpack or
        pickle; a REF only to what it holds itself): they arrive as the same values, sharing nothing with
        one another, as if each had been sent on its own (a node that changes its input in place changes
        only its own)."""
        # One msgpack pass over the whole list when that is what each value would get alone (the list goes
        # that way) and no value was tied to another (no REF, no view of a copy made for this message: two
        # values could share one only through those); else each value on its own.
        checkpoint = self.checkpoint()
        if route(values) == MSGPACK:
            self._tied = False
            try:
                data = self._pack_plain(values)
                if not self._tied and len(data) <= BIG_MESSAGE:
                    return data
            except (OverflowError, ValueError):
                pass
            self.rollback(checkpoint)
        if _plain_only(values):  # (many tuples, or many items: plain data shares nothing in a pickle without memo)
            return msgpack.packb(self._pickled(values, fast=True), strict_types=True, use_bin_type=True)
        parts = [_handles.packer.pack_array_header(len(values))]  # (msgpack's own; the items follow it)
        for value in values:
            self._numbered = {}  # no REF to another value's tensors ...
            self._scope = len(self._copies)  # ... and no view of the copies made for another value
            parts.append(self.pack(value))
        return b"".join(parts)

    def _pack_plain(self, value) -> bytes:
        local = _local
        if local.encoder is None:  # the thread's Packer is free (a value inside a value packs on its own)
            local.encoder = self
            try:
                return local.pack(value)
            finally:
                local.encoder = None
        return msgpack.packb(value, default=self._default, strict_types=True, use_bin_type=True)

    def _default(self, obj):
        if type(obj) is tuple:  # a list led by the TUPLE mark: packed in the same pass (no Packer of its own)
            return [_TUPLE_MARK, *obj]
        return self.ext(obj)

    def ext(self, obj) -> msgpack.ExtType:
        """The extension for a value msgpack does not know: a tensor, an array, a REF to one, or a PICKLE."""
        number = self._numbered.get(id(obj))
        if number is not None:
            self._tied = True
            return _ext(EXT_REF, msgpack.packb(number))
        torch = loaded_torch()
        try:
            kind = type(obj)
            if torch is not None and (kind is torch.Tensor or kind is torch.nn.Parameter):  # (a subclass: PICKLE)
                code, body = EXT_TENSOR, _handles.pack(encode_tensor(self, obj, torch))
            elif kind is _ndarray() and not obj.dtype.hasobject:
                code, body = EXT_ARRAY, _handles.pack(encode_array(self, obj))
            else:
                return self._pickled(obj, fast=False)
        except _PASSED_ON:
            raise
        except Exception as err:  # (torch's reductions for a CUDA, sparse or quantized tensor, say): never raw
            raise Unsendable(f"{type(obj).__name__} cannot be sent to another process: {type(err).__name__}: "
                             f"{err}") from err
        self._numbered[id(obj)] = len(self._order)
        self._order.append(obj)
        return _ext(code, body)

    def _pickled(self, obj, fast: bool) -> msgpack.ExtType:
        try:
            return _ext(EXT_PICKLE, dump_pickle(self, obj, fast))
        except _PASSED_ON:
            raise
        except Exception as err:
            too_deep = _too_deep(obj, err)
            if too_deep is not None:
                raise too_deep from None
            raise Unsendable(f"{type(obj).__name__} cannot be sent to another process: {type(err).__name__}: {err}") from err

    # -- where bytes go (for soma.wire.tensors and soma.wire.buffers) ----------------------------------
    def found(self, start: int, nbytes: int, keep):
        """`(name, segment bytes, offset)` when the bytes at `start` are in a segment already (a live view of
        this process, or a copy made for this message), lent with this message (`keep` stays alive); else None."""
        where = None
        copies = self._copies if not self._scope else self._copies[self._scope:]
        for lo, hi, name, seg_bytes, offset in copies:
            if lo <= start and start + nbytes <= hi:
                where = name, seg_bytes, offset + start - lo
                self._tied = True
                break
        else:
            store = self._get_store(False)
            where = store.locate(start, nbytes) if store is not None else None
        if where is not None:
            self._alive.append(keep)
            self.shared.append(where[0])
        return where

    def unfound(self, where) -> None:
        """Take back the last `found` (the caller copies the value after all)."""
        self._alive.pop()
        self.shared.pop()

    def copy_in(self, start: int, nbytes: int, pad: int = 0):
        """`(name, segment bytes, offset)` of a copy of the bytes at `start`, `pad` bytes into a new segment."""
        view, name, seg_bytes = self.fresh(nbytes + pad)
        import ctypes

        ctypes.memmove(address_of(view) + pad, start, nbytes)  # (releases the GIL)
        self._copies.append((start, start + nbytes, name, seg_bytes, pad))
        return name, seg_bytes, pad

    def fresh(self, nbytes: int):
        """`(view, name, segment bytes)`: a segment for this message to copy `nbytes` into."""
        view, name = self._get_store(True).allocate(nbytes)
        self._alive.append(view)
        self.shared.append(name)
        self.copied.append(nbytes)
        return view, name, len(view)

    def checkpoint(self) -> tuple:
        return len(self.shared), len(self.copied), len(self._alive), len(self._copies), len(self._order)

    def rollback(self, checkpoint: tuple) -> None:
        """Forget every handle made since `checkpoint` (they will not be sent; their copies may be reused)."""
        shared, copied, alive, copies, order = checkpoint
        del self.shared[shared:], self.copied[copied:], self._alive[alive:], self._copies[copies:]
        for obj in self._order[order:]:
            del self._numbered[id(obj)]
        del self._order[order:]


# Errors the callers name themselves (OSError: a segment could not be made); every other one becomes Unsendable.
_PASSED_ON = (GradCrossing, Unsendable, SharedMemoryFull, MemoryError, OSError)


def _ndarray():
    numpy = sys.modules.get("numpy")
    return getattr(numpy, "ndarray", None)


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
        try:
            data = self.packer.pack(value)
        except BaseException:
            self.packer = msgpack.Packer(**self.options)  # (what it had packed so far must not lead the next)
            raise
        if len(data) > self.KEEP_BYTES:
            self.packer = msgpack.Packer(**self.options)
        return data


def _ext(code: int, data: bytes) -> msgpack.ExtType:
    """`msgpack.ExtType(code, data)` without its argument checks (0.5 µs against 0.15): soma's codes and bytes."""
    return _new_tuple(msgpack.ExtType, (code, data))


_new_tuple = tuple.__new__
_TUPLE_MARK = _ext(EXT_TUPLE, b"")  # first item of the list a tuple travels as


def _default_of_thread(obj):
    if type(obj) is tuple:  # (Encoder._default's first case, a call sooner: a tuple is the common one)
        return [_TUPLE_MARK, *obj]
    return _local.encoder.ext(obj)


_local = ThreadPacker(default=_default_of_thread, strict_types=True, use_bin_type=True)
# A handle is plain data (no `default`: packing one never calls back in), packed by a Packer of its own: the
# thread's value Packer is mid-value when a handle is made. (msgpack.packb makes a Packer per call: 0.7 µs.)
_handles = ThreadPacker(use_bin_type=True)


_SCALARS = frozenset({int, float, bool, type(None), str})
_SCALAR_CHARS = BIG_MESSAGE // 8  # (a str's UTF-8 takes at most 4 bytes a character: well under BIG_MESSAGE)


def pack_scalar(value) -> bytes | None:
    """What `Encoder.pack(value)` returns for a lone None, bool, int, float or str of at most an eighth of
    BIG_MESSAGE characters (msgpack's bytes of it: no handle, nothing shared), without an Encoder: a worker's
    output that is one number; None for any other value, and for one msgpack cannot hold (an int beyond 64 bits,
    a str with a lone surrogate: `Encoder.pack` pickles those)."""
    kind = type(value)
    if kind not in _SCALARS or (kind is str and len(value) > _SCALAR_CHARS):
        return None
    try:
        return _handles.pack(value)  # (the handle Packer: never mid-value when a value packs, no callbacks)
    except (OverflowError, ValueError):
        return None


# The first bytes of msgpack's None, bools, ints, floats and strs (fixints, nil, bools, float 32/64, ints of 8-64
# bits, fixstr and str 8/16/32): what `pack_scalar` makes, and what `unpack_scalar` reads without a Decoder.
_SCALAR_LEADS = frozenset([*range(0x00, 0x80), *range(0xe0, 0x100), 0xc0, 0xc2, 0xc3, 0xca, 0xcb,
                           *range(0xcc, 0xd4), *range(0xa0, 0xc0), 0xd9, 0xda, 0xdb])
NOT_SCALAR = object()  # unpack_scalar's answer for any other value


def unpack_scalar(data: bytes):
    """The value of `data` when it is one msgpack None, bool, int, float or str (what `pack_scalar` makes: a
    run's number, or its short string), decoded without a Decoder (no handle, segment or tuple can be in it);
    NOT_SCALAR for anything else (a Decoder's). A value's way back costs one call, not a Decoder and two."""
    if not data or data[0] not in _SCALAR_LEADS:
        return NOT_SCALAR
    return msgpack.unpackb(data, raw=False)


# -- decoding -----------------------------------------------------------------------------------

_MARKED = object()  # what the TUPLE mark decodes to: the list it leads is a tuple


def _tuple_if_marked(items: list):
    """msgpack's list hook: a list led by the TUPLE mark was a tuple (every other list stays as it is)."""
    return tuple(items[1:]) if items and items[0] is _MARKED else items


def segments_named(data: bytes) -> list[str]:
    """The segments the handles in `data` (one body, as `Encoder.pack` made it) name, one per receipt a Decoder
    would count, found without opening any or unpickling anything: what a worker that will never decode an input
    reports released (the host lent them with it; never received, they stayed counted held until that worker
    ended, and the host's own segments were never reused: /dev/shm grew with every input dropped unstarted)."""
    names: list = []

    def hook(code: int, body: bytes):
        if code == EXT_TENSOR:
            names.extend(tensor_segments(msgpack.unpackb(body, raw=False, use_list=True)))
        elif code == EXT_ARRAY:
            names.extend(array_segments(msgpack.unpackb(body, raw=False, use_list=True)))
        elif code == EXT_PICKLE:
            names.extend(pickle_segments(body, hook))
        return None

    if data and data[0] not in _SCALAR_LEADS:
        msgpack.unpackb(data, ext_hook=hook, raw=False, strict_map_key=False, use_list=True)
    return names


class Decoder:
    """Decodes values of one message; `get_store(create)` gives this process's `SegmentStore`."""

    def __init__(self, get_store):
        self._get_store = get_store
        self.received: list[str] = []  # segment names, one per handle, for the host's lease book
        self._objects: list = []  # the tensors and arrays of the body being decoded, in order (REF names them)
        # What the values decoded so far take of /dev/shm (a map's back-pressure by memory measures it; a spilled
        # segment's file takes none): bytes of the distinct segments in /dev/shm, and how many were spilled.
        self._shm_bytes = self._spilled = 0
        self._sized: set = set()

    def unpack(self, data: bytes):
        """One body, as one `Encoder.pack` or `pack_each` made it. Its REFs number the tensors and arrays of that
        body alone, from 0, as its Encoder did: a Decoder that decodes several bodies (a Result's outcomes, each
        encoded by an Encoder of its own) starts the numbering again with each, or a REF of one would name
        another's object (an output holding one array twice came back with another input's array)."""
        self._objects = []
        return msgpack.unpackb(data, ext_hook=self.ext_hook, list_hook=_tuple_if_marked, raw=False,
                               strict_map_key=False, use_list=True)

    def ext_hook(self, code: int, data: bytes):
        if code == EXT_TUPLE:
            return _MARKED
        if code == EXT_TENSOR or code == EXT_ARRAY:
            handle = msgpack.unpackb(data, raw=False, use_list=True)
            obj = decode_tensor(self, handle) if code == EXT_TENSOR else decode_array(self, handle)
            self._objects.append(obj)
            return obj
        if code == EXT_REF:
            return self._objects[msgpack.unpackb(data)]
        if code == EXT_PICKLE:
            return load_pickle(self, data)
        return msgpack.ExtType(code, data)

    def tensor(self, handle: list):
        return decode_tensor(self, handle)

    def open(self, name: str, seg_bytes: int):
        """This process's view of a segment a handle names (its receipt counted)."""
        view = self._get_store(True).open(name, seg_bytes)
        self._received(name, seg_bytes)
        return view

    def storage(self, name: str, seg_bytes: int):
        """This process's torch storage over a segment a tensor handle names (its receipt counted): what
        torch calls shared (see `tensors.SharedStorages`)."""
        storage = self._get_store(True).open(name, seg_bytes, SHARED_STORAGES)
        self._received(name, seg_bytes)
        return storage

    def _received(self, name: str, seg_bytes: int) -> None:
        self.received.append(name)
        if name not in self._sized:
            self._sized.add(name)
            if room.is_spilled(name):
                self._spilled += 1
            else:
                self._shm_bytes += seg_bytes

    def unpack_weighed(self, data: bytes) -> tuple:
        """`(unpack(data), what its segments take of /dev/shm: see shm_taken)`: one value's way (one call)."""
        mark = self.shm_mark()
        return self.unpack(data), self.shm_taken(mark)

    def shm_mark(self) -> tuple:
        return self._shm_bytes, self._spilled

    def shm_taken(self, mark: tuple) -> int | None:
        """Bytes of /dev/shm the segments named since `mark` (`shm_mark()`) take; None when one of them was
        spilled (what a value would take there is then not known: it found no room, or could never fit)."""
        return None if self._spilled != mark[1] else self._shm_bytes - mark[0]

    def buffer(self, handle: list) -> memoryview:
        """The bytes a buffer handle `[name, segment bytes, offset, bytes]` names, writable, over the segment."""
        name, seg_bytes, offset, nbytes = handle
        if offset < 0 or nbytes < 0 or offset + nbytes > seg_bytes:
            raise ValueError(f"buffer handle for {name} reaches outside its segment")
        return memoryview(self.open(name, seg_bytes)).cast("B")[offset:offset + nbytes]
