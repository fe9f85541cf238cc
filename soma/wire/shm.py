"""Shared-memory segments: where tensors live while they cross processes.

Every CPU tensor soma moves between processes sits in a *segment*: a file in
`/dev/shm` named `soma-<hostpid>-<pool>-<ownerpid>-<n>`, mode 0600, created by
one process of the pool (its *owner*) and mapped by the others. Tensors travel
as handles (segment name, size, dtype, shape, stride, offset); their bytes never
go through a socket.

Who frees what, and when (the rules `docs/local.md` explains at length):

* The owner keeps each segment mapped once (its *base* mapping) and reuses it
  for later tensors: a reused segment is already faulted in, which is what makes
  `ctx.empty` and heap-tensor copies cheap on a warm pool.
* A segment is in use while any process holds a live storage on it. Each process
  tracks its own storages with `weakref.finalize` on the storage object (torch
  keeps a storage's Python object alive exactly as long as its C++ storage, so
  every view, slice and `detach()` counts).
* The host is the lease authority. It counts, per segment, the receipts every
  process holds (`LeaseBook` in `soma.local`); when the count reaches zero it
  tells the owner `free(name, n)`, n being how many of the owner's sends that
  covers. The owner reuses the segment when that count is settled and its own
  storages are dead. Workers report dead receipts to the host (`releases()`).
* When the pool closes, or a worker dies, its files are unlinked. Mappings
  survive an unlink, so results a caller still holds stay valid after `close()`.

Small tensors do not use segments (see `soma.wire.codec`): a segment per 0-d tensor
would cost more than the bytes.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import weakref

from ..errors import SharedMemoryFull

SHM_DIR = "/dev/shm"
GRANULE = 64 * 1024  # segment sizes are rounded up to this, so near sizes reuse one segment


def pool_prefix(host_pid: int, token: str) -> str:
    return f"soma-{host_pid}-{token}"


def owner_pid(name: str) -> int:
    """The pid of the process that created segment `name`."""
    return int(name.rsplit("-", 2)[1])


def unlink_quietly(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def unlink_all(prefix: str, owner: int | None = None, keep: set | frozenset = frozenset()) -> int:
    """Unlink this pool's segment files (one owner's only, when `owner` is given), except `keep`."""
    head = f"{prefix}-" if owner is None else f"{prefix}-{owner}-"
    removed = 0
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(head) and name not in keep:
            unlink_quietly(name)
            removed += 1
    return removed


class ShmError(RuntimeError):
    """A handle names a segment this process must not or cannot map."""


class _Segment:
    """A segment this process created: its base mapping, and who still uses it."""

    __slots__ = ("name", "nbytes", "base", "sent", "local_live", "in_pool")

    def __init__(self, name: str, nbytes: int, base):
        self.name = name
        self.nbytes = nbytes
        self.base = base  # the owner's permanent mapping: already faulted in when reused
        self.sent = 0  # handles sent and not yet settled by the host's free()
        self.local_live = 0  # live storages of this process on the segment
        self.in_pool = False  # free and waiting for reuse

    @property
    def busy(self) -> bool:
        return self.sent > 0 or self.local_live > 0


class _Storage:
    """Bookkeeping for one live storage object of this process on a segment."""

    __slots__ = ("name", "receipts", "owned")

    def __init__(self, name: str, owned: bool):
        self.name = name
        self.receipts = 0  # handles received for it, to report once it dies
        self.owned = owned


class SegmentStore:
    """One per process: the segments it owns, the ones it maps, and the receipts it must report.

    `prefix` is the pool's (`pool_prefix`); names outside it are refused. `cap`
    bounds the bytes of free segments kept for reuse; beyond it a freed segment is
    unlinked. `on_release` is called (from any thread, lock not held) when a
    storage holding receipts dies; it receives `(name, n)`.
    """

    def __init__(self, prefix: str, cap: int, on_release=None):
        import torch  # only a process that moves tensors builds a store

        self._torch = torch
        self.prefix = prefix
        self.cap = cap
        self.pid = os.getpid()
        self._on_release = on_release
        self._name_re = re.compile(rf"^{re.escape(prefix)}-\d+-\d+$")
        self._lock = threading.RLock()
        self._counter = 0
        self._owned: dict[str, _Segment] = {}
        self._pool: list[_Segment] = []  # free owned segments, reusable
        self._pooled_bytes = 0
        self._by_ptr: dict[int, _Storage] = {}  # data_ptr of a live storage → its record
        self._by_name: dict[str, tuple] = {}  # name → (weakref to a mapping storage, record)
        self._pending: list[tuple[str, int]] = []
        self.closed = False

    # -- owner side ----------------------------------------------------------------------
    def allocate(self, nbytes: int):
        """A fresh storage of at least `nbytes` in a segment this process owns (reused when one is free)."""
        seg = self._take_free(nbytes) or self._create(nbytes)
        return self._alias(seg)

    def _take_free(self, nbytes: int):
        with self._lock:
            best = None
            for seg in self._pool:
                # Reuse only a segment that is not much larger: a 1 GiB segment kept for a 4 MiB tensor wastes memory.
                if nbytes <= seg.nbytes <= max(2 * nbytes, nbytes + GRANULE) and (best is None or seg.nbytes < best.nbytes):
                    best = seg
            if best is not None:
                self._pool.remove(best)
                self._pooled_bytes -= best.nbytes
                best.in_pool = False
            return best

    def _create(self, nbytes: int) -> _Segment:
        size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        with self._lock:
            self._counter += 1
            name = f"{self.prefix}-{self.pid}-{self._counter}"
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a sparse file on a full /dev/shm would SIGBUS on first touch instead.
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            os.close(fd)
            unlink_quietly(name)
            raise SharedMemoryFull.reserving(None, size, f"a segment ({err.strerror})") from None
        os.close(fd)
        base = self._torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
        seg = _Segment(name, size, base)
        with self._lock:
            self._owned[name] = seg
        return seg

    def _alias(self, seg: _Segment):
        """A storage over the owner's base mapping (no new mapping, so no new page faults)."""
        buf = (ctypes.c_char * seg.nbytes).from_address(seg.base.data_ptr())
        storage = self._torch.frombuffer(buf, dtype=self._torch.uint8).untyped_storage()
        self._track(storage, seg.name, owned=True)
        return storage

    def free(self, name: str, n: int) -> None:
        """The host settled `n` of this process's sends of segment `name`."""
        with self._lock:
            seg = self._owned.get(name)
            if seg is None:
                return
            seg.sent -= n
            self._maybe_reusable(seg)

    def _maybe_reusable(self, seg: _Segment) -> None:
        # lock held
        if seg.busy or seg.in_pool:
            return
        if self.closed or self._pooled_bytes + seg.nbytes > self.cap:
            del self._owned[seg.name]
            seg.base = None
            unlink_quietly(seg.name)
            return
        seg.in_pool = True
        self._pool.append(seg)
        self._pooled_bytes += seg.nbytes

    # -- sender side -----------------------------------------------------------------------
    def locate(self, tensor):
        """`(name, segment bytes)` when the tensor's storage is one this process holds on a segment, else None."""
        storage = tensor.untyped_storage()
        with self._lock:
            rec = self._by_ptr.get(storage.data_ptr())
            if rec is None:
                return None
            seg = self._owned.get(rec.name)
            return rec.name, seg.nbytes if seg is not None else storage.nbytes()

    def copy_in(self, tensor):
        """A contiguous copy of `tensor` in a segment of this process: `(copy, name, segment bytes)`."""
        nbytes = tensor.numel() * tensor.element_size()
        storage = self.allocate(nbytes)
        copy = self._torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape)
        copy.copy_(tensor)
        return copy, self._by_ptr[storage.data_ptr()].name, storage.nbytes()

    def note_sent(self, name: str) -> None:
        """This process sent a handle to segment `name` (counted when it is the owner)."""
        with self._lock:
            seg = self._owned.get(name)
            if seg is not None:
                seg.sent += 1

    # -- receiver side ---------------------------------------------------------------------
    def open(self, name: str, nbytes: int):
        """A live storage of this process on segment `name` (an existing one when there is), counting a receipt."""
        if not self._name_re.match(name):
            raise ShmError(f"segment name {name!r} is not one of this pool's ({self.prefix}-*)")
        with self._lock:
            found = self._by_name.get(name)
            storage = found[0]() if found is not None else None
            if storage is not None:
                found[1].receipts += 1
                return storage
        path = os.path.join(SHM_DIR, name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise ShmError(f"segment {name} is gone (its owner died or the pool closed)") from None
        if size < nbytes:
            # Mapping a larger size than the file would silently grow it.
            raise ShmError(f"segment {name} holds {size} bytes, the handle claims {nbytes}")
        storage = self._torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
        rec = self._track(storage, name, owned=name in self._owned)
        with self._lock:
            rec.receipts += 1
            self._by_name[name] = (weakref.ref(storage), rec)
        return storage

    def _track(self, storage, name: str, owned: bool) -> _Storage:
        rec = _Storage(name, owned)
        ptr = storage.data_ptr()
        with self._lock:
            self._by_ptr[ptr] = rec
            seg = self._owned.get(name)
            if seg is not None:
                seg.local_live += 1
        weakref.finalize(storage, self._storage_died, ptr, rec)
        return rec

    def _storage_died(self, ptr: int, rec: _Storage) -> None:
        # Runs in whichever thread dropped the last view; only bookkeeping here.
        with self._lock:
            if self._by_ptr.get(ptr) is rec:
                del self._by_ptr[ptr]
            found = self._by_name.get(rec.name)
            if found is not None and found[1] is rec:
                del self._by_name[rec.name]
            seg = self._owned.get(rec.name)
            if seg is not None:
                seg.local_live -= 1
                self._maybe_reusable(seg)
            receipts, rec.receipts = rec.receipts, 0
            if receipts and self._on_release is None:
                self._pending.append((rec.name, receipts))
        if receipts and self._on_release is not None:
            self._on_release(rec.name, receipts)

    def releases(self) -> list[tuple[str, int]]:
        """Receipts whose storages died since the last call: `[(name, n)]`, to report to the host."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Unlink every segment this process owns. Mappings still in use stay valid."""
        with self._lock:
            self.closed = True
            for name in list(self._owned):
                unlink_quietly(name)
            self._pool.clear()
            self._pooled_bytes = 0
