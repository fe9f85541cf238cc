"""Shared-memory segments: where large buffers (tensors, numpy arrays, bytes) live while they cross processes.

Every large buffer soma moves between processes sits in a *segment*: a file in
`/dev/shm` named `soma-<hostpid>-<pool>-<ownerpid>-<n>`, mode 0600, created by
one process of the pool (its *owner*) and mapped by the others. Values travel
as handles (segment name, size, where in it); their bytes never go through a
socket. This module knows bytes only: no torch, no numpy (a process that moves
only numpy arrays or bytes never imports torch).

A process sees a segment through at most two *views* at a time: a ctypes byte
array over a mapping of soma's own (`soma.wire.mapping`: why not Python's mmap),
for arrays and bytes, and the storage torch maps it into for tensors (a
`Mapper`'s view: `soma.wire.tensors.SharedStorages`, so that torch knows the
memory as shared). Everything made from a segment keeps its view alive: a
tensor its storage, an ndarray its `.base` chain (ending at the ctypes array),
a memoryview slice handed to the unpickler as an out-of-band buffer its managed
buffer. So "nobody in this process can still see the segment" is exactly "its
views died", which `weakref.finalize` on each view reports; each view counts
the receipts it was opened for.

Who frees what, and when (the rules `docs/local.md` explains at length):

* The owner keeps each segment mapped once (its *base* mapping) and reuses it
  for later values: a reused segment is already faulted in, which is what makes
  `ctx.empty` and heap copies cheap on a warm pool. (A tensor sent back to its
  owner is mapped apart, by torch: its pages fault in as they are touched.)
* A segment handed on outside soma (torch.multiprocessing asked for its file
  descriptor) is marked on its file; its owner then unlinks it instead of
  reusing it, since the other process may map it for as long as it likes.
* A segment is in use while any process holds a live view on it.
* The host is the lease authority. It counts, per segment, the receipts every
  process holds (`LeaseBook` in `soma.local`); when the count reaches zero it
  tells the owner `free(name, n)`, n being how many of the owner's sends that
  covers. The owner reuses the segment when that count is settled and its own
  views are dead. Workers report dead receipts to the host (`releases()`).
* When the pool closes, or a worker dies, its files are unlinked. Mappings
  survive an unlink, so results a caller still holds stay valid after `close()`.
  When every process of a pool died at once, the next pool unlinks them
  (`soma.wire.lifeline`).
* Where /dev/shm has no room for a segment, its file goes to the pool's spill
  directory on disk instead (`soma.wire.room`: what is given back and waited for
  first, and why a file): the same rules hold for it, except that it is never
  kept for reuse.

Small values do not use segments (see `soma.wire.codec`): a segment per 0-d tensor
would cost more than the bytes.
"""

from __future__ import annotations

import bisect
import os
import re
import threading
import weakref
from collections import deque

from ..errors import SharedMemoryFull
from . import room
from .mapping import (
    POPULATE_READ,
    POPULATE_WRITE,
    Mapper,
    map_failed,
    map_file,
    populate_pages,
    unmap,
    view_at,
)
from .room import exported, mark_exported, unlink_all, unlink_quietly  # noqa: F401  (re-exported: the pool and tensors.py use them)

SHM_DIR = room.SHM_DIR
GRANULE = 64 * 1024  # segment sizes are rounded up to this, so near sizes reuse one segment

# A process with nothing to do for this long gives back its free segments beyond IDLE_KEEP. Not sooner: a caller
# that runs every second or two (a notebook, an evaluation between training steps, a benchmark's other work) would
# otherwise get a fresh segment for each large value: reserving and mapping a fresh 256 MiB segment took 0.2-0.45 s
# here (posix_fallocate zeroes it, MADV_POPULATE_WRITE maps it; strace) against 20-30 ms for the copy into it, and
# a warm one costs neither (a 256 MiB tensor came back in 0.29x ProcessPoolExecutor's time warm, 1.15-1.33x fresh).
IDLE_TRIM_S = 5.0
IDLE_KEEP = 64 << 20  # (kept for reuse while busy: a hot loop's values reuse warm, mapped memory)

def pool_prefix(host_pid: int, token: str) -> str:
    return f"soma-{host_pid}-{token}"


def owner_pid(name: str) -> int:
    """The pid of the process that created segment `name`."""
    return int(name.rsplit("-", 2)[1])


class ShmError(RuntimeError):
    """A handle names a segment this process must not or cannot map."""


class _Segment:
    """A segment this process created: its base mapping, and who still uses it."""

    __slots__ = ("name", "nbytes", "address", "sent", "local_live", "in_pool", "spilled")

    def __init__(self, name: str, nbytes: int, address: int, spilled: bool = False):
        self.name = name
        self.spilled = spilled  # its file is in the spill directory: never kept for reuse
        self.nbytes = nbytes
        self.address = address  # the owner's permanent mapping: already faulted in when reused
        self.sent = 0  # handles sent and not yet settled by the host's free()
        self.local_live = 0  # live views of this process on the segment (its bytes view, its storage: 0 to 2)
        self.in_pool = False  # free and waiting for reuse

    @property
    def busy(self) -> bool:
        return self.sent > 0 or self.local_live > 0


class _View:
    """Bookkeeping for one live view of a segment in this process: its bytes view (a ctypes array), or a
    mapping someone else made and unmaps (a `Mapper`'s: torch's shared storage), one of each per segment."""

    __slots__ = ("name", "start", "nbytes", "receipts", "ref", "seg", "unmaps", "mapper")

    def __init__(self, name: str, start: int, nbytes: int, view, seg, unmaps: bool, mapper):
        self.name = name
        self.start = start
        self.nbytes = nbytes
        self.receipts = 0  # handles received for it, to report once it dies
        self.ref = weakref.ref(view)
        self.seg = seg  # the _Segment when this process owns it (its local_live counts this view), else None
        self.unmaps = unmaps  # a mapping of the store's own, unmapped when the view dies (not the base, not a Mapper's)
        self.mapper = mapper

    @property
    def key(self) -> tuple:
        return self.name, self.mapper is not None


class SegmentStore:
    """One per process: the segments it owns, the ones it maps, and the receipts it must report.

    `prefix` is the pool's (`pool_prefix`); names outside it are refused. `cap`
    bounds the bytes of free segments kept for reuse (and a quarter of /dev/shm
    does: a small /dev/shm is for values, not for what one process keeps); beyond
    it a freed segment is unlinked. `on_release` is called (from any thread, lock
    not held) when a view holding receipts dies; it receives `(name, n)`.

    `caller_held`: None, or a callable giving the bytes of /dev/shm that results
    the caller keeps hold (the host's measure); a reservation that lacks room the
    caller holds raises `SharedMemoryFull` naming it instead of spilling (see
    `soma.wire.room`). `room_wait_s`: how long a reservation waits for room
    others free before it spills (default: by its size, see `room.room_wait_s`;
    0 for a thread that must not wait: one that passes on the very frees it
    would wait for).
    """

    def __init__(self, prefix: str, cap: int, on_release=None, caller_held=None, room_wait_s: float | None = None):
        self.prefix = prefix
        self.shm_bytes = room.shm_room()[1]
        self.arena = cap
        self.cap = min(cap, self.shm_bytes // 4) if self.shm_bytes else cap
        self.idle_keep = min(IDLE_KEEP, self.shm_bytes // 16) if self.shm_bytes else IDLE_KEEP
        self.caller_held = caller_held
        self.room_wait_s = room_wait_s  # (None: `room.room_wait_s`, by the value's size)
        self.wanted = room.RoomWanted(prefix)
        self.streak = room.SpillStreak()  # (values short of room spill at once while no frees come: soma.wire.room)
        self.pid = os.getpid()
        self._on_release = on_release
        self._name_re = re.compile(rf"^{re.escape(prefix)}-\d+-{room.SPILLED}?\d+$")
        # Not reentrant: a finalizer that runs inside one of our critical sections (the garbage collector runs
        # where it likes) must not change the books under it; it leaves the view for later instead (`_dead`).
        self._lock = threading.Lock()
        self._dead: deque = deque()  # records of views that died while the lock was taken
        self._counter = 0
        self._owned: dict[str, _Segment] = {}
        self._pool: list[_Segment] = []  # free owned segments in /dev/shm, reusable
        self._pooled_bytes = 0
        self._spills: list[_Segment] = []  # free owned spilled segments, reusable
        self._spilled_bytes = 0
        self._views: dict[tuple, _View] = {}  # (segment, by a Mapper?) → this process's live view of it
        self._starts: list[int] = []  # sorted start addresses of the live views (for `locate`)
        self._at: dict[int, _View] = {}  # start address → its view's record
        self._pending: list[tuple[str, int]] = []
        self._received_bytes = 0  # of the views over other processes' segments (received_bytes)
        self.closed = False

    # -- owner side ----------------------------------------------------------------------
    def allocate(self, nbytes: int):
        """`(view, name)`: a fresh view of at least `nbytes` in a segment this process owns (reused when one is
        free; in the spill directory when /dev/shm has no room, see `soma.wire.room`). The view spans the whole
        segment and stays this process's view of it until it dies."""
        self._give_back_if_wanted()  # (another process lacking room: what this one keeps goes first)
        seg = self._take_free(nbytes) or self._create(nbytes)
        return self._view(seg), seg.name

    def _take_free(self, nbytes: int):
        with self._lock:
            self._bury_dead()
            for pool in (self._pool, self._spills):  # (one in /dev/shm first)
                best = None
                for seg in pool:
                    # Reuse only a segment that is not much larger: a 1 GiB segment kept for a 4 MiB value wastes
                    # memory.
                    if nbytes <= seg.nbytes <= max(2 * nbytes, nbytes + GRANULE) and (
                            best is None or seg.nbytes < best.nbytes):
                        best = seg
                if best is not None:
                    pool.remove(best)
                    if pool is self._pool:
                        self._pooled_bytes -= best.nbytes
                    else:
                        self._spilled_bytes -= best.nbytes
                    best.in_pool = False
                    return best
            return None

    def _create(self, nbytes: int) -> _Segment:
        size = max(GRANULE, -(-nbytes // GRANULE) * GRANULE)
        name = room.reserve_in_shm(self._name(), size, self.trim, self.wanted, self.caller_held,
                                   lambda: self.room_wait_s, self.streak)  # (read at each look: the host may say
        #                                                                   otherwise)
        if name is None:  # no room in /dev/shm, and not the caller's to free (see soma.wire.room)
            name = self._name(room.SPILLED)
            try:
                room.make_spill_dir(self.prefix, nbytes)
                room.reserve(name, size)
            except OSError as err:
                raise SharedMemoryFull.reserving(None, size, "a segment", f", nor on disk in "
                                                 f"{room.spill_dir(self.prefix)} ({err.strerror or err})") from None
        try:
            address = map_file(room.path_of(name), size, POPULATE_WRITE)  # (the value is copied in next)
        except OSError:
            unlink_quietly(name)
            raise
        seg = _Segment(name, size, address, spilled=room.is_spilled(name))
        with self._lock:
            self._owned[name] = seg
        return seg

    def _name(self, kind: str = "") -> str:
        with self._lock:
            self._counter += 1
            return f"{self.prefix}-{self.pid}-{kind}{self._counter}"

    def free(self, name: str, n: int) -> None:
        """The host settled `n` of this process's sends of segment `name`."""
        with self._lock:
            self._bury_dead()
            seg = self._owned.get(name)
            if seg is None:
                return
            seg.sent -= n
            self._maybe_reusable(seg)
        if seg.in_pool:
            # A segment that comes free while another process lacks room is given back at once, not kept until
            # this process next reserves or idles (under load that look came after the other's wait for room
            # had ended: a 20 MiB output spilled, CI beside two CPU burners).
            self._give_back_if_wanted()

    def _maybe_reusable(self, seg: _Segment) -> None:
        # lock held
        if seg.busy or seg.in_pool:
            return
        # A spilled one is kept apart, up to the whole arena: it takes no room in /dev/shm, and a warm one costs
        # what a warm segment in /dev/shm does (its pages are in memory), a fresh one what a fresh one does.
        kept = self._spilled_bytes + seg.nbytes > self.arena if seg.spilled else self._pooled_bytes + seg.nbytes > self.cap
        if self.closed or kept or exported(seg.name):
            del self._owned[seg.name]
            unlink_quietly(seg.name)
            unmap(seg.address, seg.nbytes)  # nothing of this process sees it any more (no live view)
            return
        seg.in_pool = True
        if seg.spilled:
            self._spills.append(seg)
            self._spilled_bytes += seg.nbytes
        else:
            self._pool.append(seg)
            self._pooled_bytes += seg.nbytes

    # -- sender side -----------------------------------------------------------------------
    def locate(self, address: int, nbytes: int):
        """`(name, segment bytes, offset)` when `[address, address + nbytes)` lies in a live view of this
        process (the offset is `address` from the segment's start), else None."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            rec = self._at[self._starts[i]]
            # A view that is dying (its finalizer has not run yet) answers None: its memory may be gone.
            view = rec.ref()
            if address + nbytes > rec.start + rec.nbytes or view is None:
                return None
            if rec.mapper is not None and rec.mapper.address(view) != rec.start:
                return None  # (torch moved its bytes elsewhere: share_memory_ under the file_system strategy)
            return rec.name, rec.nbytes, address - rec.start

    def note_sent(self, name: str) -> None:
        """This process sent a handle to segment `name` (counted when it is the owner)."""
        with self._lock:
            seg = self._owned.get(name)
            if seg is not None:
                seg.sent += 1

    # -- receiver side ---------------------------------------------------------------------
    def open(self, name: str, nbytes: int, mapper: Mapper | None = None):
        """This process's live view of segment `name` (the existing one when there is), counting a receipt:
        a ctypes byte array, or with `mapper` the object it maps the segment into (one of each per segment)."""
        if not self._name_re.match(name):
            raise ShmError(f"segment name {name!r} is not one of this pool's ({self.prefix}-*)")
        key = name, mapper is not None
        with self._lock:
            found = self._views.get(key)
            view = found.ref() if found is not None else None
            if view is not None:
                if found.nbytes < nbytes:
                    raise ShmError(f"segment {name} holds {found.nbytes} bytes, the handle claims {nbytes}")
                found.receipts += 1
                return view
            seg = self._owned.get(name)
        path = room.path_of(name)
        if seg is not None:  # one of ours sent back
            if nbytes > seg.nbytes:
                raise ShmError(f"segment {name} holds {seg.nbytes} bytes, the handle claims {nbytes}")
            if mapper is None:
                view = self._view(seg)  # a view of the base mapping: no new faults
            else:  # (its pages are in memory: they fault in as they are touched, none if none is)
                view = self._view(seg, mapped=self._mapped(path, seg.nbytes, mapper, False), mapper=mapper)
        else:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise ShmError(f"segment {name} is gone (its owner died or the pool closed)") from None
            if st.st_size < nbytes:
                # Mapping beyond the end of the file would raise SIGBUS when touched.
                raise ShmError(f"segment {name} holds {st.st_size} bytes, the handle claims {nbytes}")
            if mapper is None:
                view = self._view(None, name=name, address=map_file(path, nbytes, POPULATE_READ),
                                  nbytes=nbytes)
            else:
                view = self._view(None, name=name, nbytes=nbytes, mapper=mapper,
                                  mapped=self._mapped(path, nbytes, mapper, True, st.st_ino))
        with self._lock:
            self._views[key].receipts += 1
        return view

    @staticmethod
    def _mapped(path: str, nbytes: int, mapper: Mapper, populate: bool, inode: int | None = None):
        """`mapper`'s mapping of segment file `path` (inode `inode` when known), checked to be that file (a mapper
        may create a file of that name when it is gone: that one is unlinked again, and the segment reported
        gone)."""
        try:
            before = inode if inode is not None else os.stat(path).st_ino
            obj = mapper.map(path, nbytes)
            after = os.stat(path).st_ino
        except FileNotFoundError:
            after = None
        except RuntimeError as err:  # (torch's: "unable to mmap ... Cannot allocate memory (12)")
            if "(12)" not in str(err):
                raise
            raise map_failed(path, 12, str(err)) from None
        if after != before:
            if after is not None:
                unlink_quietly(os.path.basename(path))
            raise ShmError(f"segment {os.path.basename(path)} is gone (its owner died or the pool closed)")
        if populate:
            populate_pages(mapper.address(obj), nbytes, POPULATE_READ)  # (as map_file does)
        return obj

    def _view(self, seg: _Segment | None, name: str = "", address: int = 0, nbytes: int = 0, mapped=None,
              mapper: Mapper | None = None):
        """Register a new view: over the base mapping of `seg`, over `address` (a mapping of ours), or the
        object `mapped` (a `mapper`'s mapping of a whole segment); the view registered first is the answer."""
        if seg is not None:
            name, nbytes = seg.name, seg.nbytes
            if mapped is None:
                address = seg.address
        if mapped is not None:
            view, address = mapped, mapper.address(mapped)
        else:
            view = view_at(address, nbytes)
        rec = _View(name, address, nbytes, view, seg, unmaps=seg is None and mapped is None, mapper=mapper)
        with self._lock:
            old = self._views.get(rec.key)
            alive = old.ref() if old is not None else None
            if alive is not None:
                # Two threads opened it at once: keep the first view, let this one go.
                if rec.unmaps:
                    unmap(address, nbytes)
                return alive
            self._views[rec.key] = rec
            if address not in self._at:  # (a dying view of the same base mapping may still be listed)
                bisect.insort(self._starts, address)
            self._at[address] = rec
            if seg is not None:
                seg.local_live += 1
            elif not room.is_spilled(name):
                self._received_bytes += nbytes
        # Not at exit: a finalizer run then would unmap memory that arrays still alive at exit point into.
        weakref.finalize(view, self._view_died, rec).atexit = False
        return view

    def _view_died(self, rec: _View) -> None:
        # Runs in whichever thread dropped the last reference, maybe inside the garbage collector, maybe while
        # that thread or another holds the lock: never wait for it. A view left in `_dead` keeps its memory
        # mapped and its segment busy until the next operation buries it.
        if not self._lock.acquire(blocking=False):
            self._dead.append(rec)
            return
        try:
            released = self._bury(rec)
            while self._dead:
                released += self._bury(self._dead.popleft())
            if self._on_release is None:
                self._pending += released
        finally:
            self._lock.release()
        if self._on_release is not None:
            for name, receipts in released:
                self._on_release(name, receipts)

    def _bury_dead(self) -> None:
        # lock held: the views that died while it was taken
        while self._dead:
            for name, receipts in self._bury(self._dead.popleft()):
                if self._on_release is None:
                    self._pending.append((name, receipts))
                else:
                    self._on_release(name, receipts)  # (the host's: it only queues them)

    def _bury(self, rec: _View) -> list:
        """Forget a dead view (lock held): `[(name, receipts)]` to report, or []."""
        if self._at.get(rec.start) is rec:
            del self._at[rec.start]
            i = bisect.bisect_left(self._starts, rec.start)
            if i < len(self._starts) and self._starts[i] == rec.start:
                del self._starts[i]
        if self._views.get(rec.key) is rec:
            del self._views[rec.key]
        receipts, rec.receipts = rec.receipts, 0
        if rec.seg is not None:
            rec.seg.local_live -= 1
            if self._owned.get(rec.name) is rec.seg:
                self._maybe_reusable(rec.seg)
        else:
            if not room.is_spilled(rec.name):
                self._received_bytes -= rec.nbytes
            if rec.unmaps:
                unmap(rec.start, rec.nbytes)  # forgotten first, unmapped after: no moment where both hold
        return [(rec.name, receipts)] if receipts else []

    def release_unopened(self, names: list) -> None:
        """Handles this process was sent and will never open (an input dropped unstarted: codec.segments_named),
        reported with the next `releases()` as if views of them had died: their holders' counts drop."""
        counts: dict = {}
        for name in names:
            counts[name] = counts.get(name, 0) + 1
        with self._lock:
            self._pending += counts.items()

    def releases(self) -> list[tuple[str, int]]:
        """Receipts whose views died since the last call: `[(name, n)]`, to report to the host."""
        with self._lock:
            self._bury_dead()
            out, self._pending = self._pending, []
        return out

    def segment_of(self, address: int) -> str | None:
        """The segment a live view of this process holds `address` in (for tests and benchmarks)."""
        found = self.locate(address, 1)
        return found[0] if found is not None else None

    def pooled_bytes(self) -> int:
        """Bytes of free segments kept for reuse."""
        return self._pooled_bytes

    def received_of(self, names) -> int:
        """Bytes of `received_bytes` that views of segments `names` hold."""
        total = 0
        with self._lock:
            for name in names:
                for rec in (self._views.get((name, False)), self._views.get((name, True))):  # (as counted there)
                    if rec is not None and rec.seg is None and not room.is_spilled(name) and rec.ref() is not None:
                        total += rec.nbytes
        return total

    def received_bytes(self) -> int:
        """Bytes of /dev/shm in other processes' segments this process holds live views of (in the host: what
        the caller keeps of results, and values on their way through; a `caller_held` measure). Kept as views
        come and go: the host asks with every Task it sends."""
        return self._received_bytes

    def idle(self, idle_s: float) -> None:
        """This process has had nothing to do for `idle_s` seconds (its owner calls this every so often while it
        idles): give back what it keeps for reuse when another process wants room, and after IDLE_TRIM_S all
        but `idle_keep` of it, so that an idle pool does not keep /dev/shm full of values its caller dropped."""
        if self._give_back_if_wanted():
            return
        if idle_s >= IDLE_TRIM_S and (self._pooled_bytes > self.idle_keep or self._spills):
            self.trim(self.idle_keep, spilled=True)

    def _give_back_if_wanted(self) -> bool:
        """Give back every segment kept for reuse in /dev/shm when another process of the pool said it lacks room
        since this one last heard it (`RoomWanted`); True when it did."""
        if self._pool and self.wanted.heard():
            self.trim(0)
            return True
        return False

    def trim(self, keep: int, spilled: bool = False) -> int:
        """Give back free segments kept for reuse in /dev/shm (largest first) until at most `keep` bytes of them
        are left, and with `spilled` every spilled one kept: unlinked and unmapped (nothing sees them). Returns
        the bytes of /dev/shm given back."""
        given = 0
        with self._lock:
            self._bury_dead()
            self._pool.sort(key=lambda seg: seg.nbytes)
            while self._pool and self._pooled_bytes > keep:
                seg = self._pool.pop()
                self._pooled_bytes -= seg.nbytes
                self._give_back(seg)
                given += seg.nbytes
            while spilled and self._spills:
                seg = self._spills.pop()
                self._spilled_bytes -= seg.nbytes
                self._give_back(seg)
        return given

    def _give_back(self, seg: _Segment) -> None:
        # lock held; a free segment kept for reuse: nothing sees it
        del self._owned[seg.name]
        unlink_quietly(seg.name)
        unmap(seg.address, seg.nbytes)

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Unlink every segment this process owns. Mappings still in use stay valid."""
        with self._lock:
            self.closed = True
            for name in list(self._owned):
                unlink_quietly(name)
            for seg in self._pool + self._spills:
                del self._owned[seg.name]
                unmap(seg.address, seg.nbytes)  # idle: nothing sees it
            self._pool.clear()
            self._spills.clear()
            self._pooled_bytes = self._spilled_bytes = 0
