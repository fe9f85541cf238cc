"""Room for segments: where a segment's file lives, how much /dev/shm has, and what happens when it has too little.

A segment is a file in /dev/shm, or, when it cannot have room there, a file in
the pool's *spill directory* on disk (`spill_dir`: `<tmp>/<pool prefix>-spill`,
mode 0700, `$SOMA_SPILL_DIR` or the system's temporary directory), the way Ray's
object store falls back to /tmp. Both kinds are mapped the same way by every
process of the pool and freed by the same rules (`soma.wire.shm`); a spilled
segment's number is led by `d` (`soma-<hostpid>-<pool>-<ownerpid>-d<n>`), so its
name says where its file is.

Why a file on disk and not the socket in pieces, for what cannot have room in
/dev/shm: a 100 MiB array written into a fresh file in /tmp and mapped by its
reader took 188-200 ms here; sent through a ZeroMQ socket in 4 MiB pieces and
copied out, 418-546 ms (a heap copy: 48-56 ms). The file's pages sit in the page
cache, its reader gets a mapping and no copy, and everything else about a segment
stays as it is. (A spilled segment kept for reuse may have its pages written to
disk now and then, the kernel's writeback of dirty pages; it is given back after
5 s with nothing to do.)

How a reservation in /dev/shm that fails goes on (`SegmentStore._create`):

    1. the reserving process gives back its own segments kept for reuse;
    2. it says room is wanted (`RoomWanted`: a flag file every process of the pool
       looks at when it next reserves and while it idles; each gives back what it
       keeps for reuse, and what it is handed back to keep while room is wanted:
       `SegmentStore.free`) and waits for room others free, about as long as the spill
       would take (`room_wait_s`: 40 ms for 20 MiB, at most ROOM_WAIT_S);
    3. then, when the caller's own results hold the room it lacks (the host knows
       that, `SegmentStore.caller_held`) and half of /dev/shm or more, `SharedMemoryFull`
       naming what they hold: only the caller can free that room, and silently going slow
       would hide it (less than half is results held a moment, a few threads' each: those
       failed runs that keep nothing, 7 of 18 with three threads of a wave in 64 MiB);
    4. else the segment goes to the spill directory. The process that makes that
       directory (one per pool: `mkdir` is atomic) logs the one warning, naming the
       value's size, the room in /dev/shm and `--shm-size`.

A value larger than /dev/shm can ever hold skips 1-3. A reservation that spilled
starts a *spill streak* in its store (`SpillStreak`): for STREAK_S, the next one
short of room skips step 2 while /dev/shm has no more free than when the last
one spilled (no frees came: waiting again would end the same way), unless its
process was told to wait for frees on their way (`told_wait`).
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time

from .._log import warn
from ..errors import SharedMemoryFull, size_text

SHM_DIR = "/dev/shm"
SPILLED = "d"  # leads the number of a segment whose file is in the spill directory
# How long a reservation waits for room others free before it spills (step 2): about what the spill would cost
# (a 100 MiB file written and mapped: ~0.2 s here, so SPILL_BYTES_PER_S), within [ROOM_WAIT_MIN_S, ROOM_WAIT_S]. Waiting
# as long as the other way costs, then taking it, is never worse than twice the better of the two (the ski-rental
# rule); a longer wait often cannot end: an ordered map's consumer holds an output until the next one arrives, and
# that one may be the one waiting. Measured on a map of 20 MiB outputs at 64 MiB: with a flat 2 s wait, 60 MiB/s;
# with this one, see benchmarks/shm.py.
SPILL_BYTES_PER_S = 500 << 20
ROOM_WAIT_MIN_S = 0.02
ROOM_WAIT_S = 2.0
# A spill streak (see the docstring): a map whose caller kept more outputs than /dev/shm holds had the host copy 190
# inputs in a row into no room, each spilling after its 20 ms wait: 3.8 s without an output (Dec 6, 64 MiB).
STREAK_S = 0.5


class SpillStreak:
    """When a store last spilled a segment, and /dev/shm's free bytes then (see the module's docstring)."""

    __slots__ = ("at", "free")

    def __init__(self):
        self.at, self.free = float("-inf"), 0

    def holds(self, now: float, free: int) -> bool:
        """A reservation short of room now spills without waiting: no frees came since the last spill."""
        return now - self.at < STREAK_S and free <= self.free

    def spilled(self, now: float, free: int) -> None:
        self.at, self.free = now, free


def room_wait_s(size: int) -> float:
    """How long a reservation of `size` bytes waits for room before it spills (see SPILL_BYTES_PER_S)."""
    return min(ROOM_WAIT_S, max(ROOM_WAIT_MIN_S, size / SPILL_BYTES_PER_S))


def spill_dir(prefix: str) -> str:
    """The pool's spill directory (every process of the pool computes the same: they share the environment)."""
    return os.path.join(os.environ.get("SOMA_SPILL_DIR") or tempfile.gettempdir(), f"{prefix}-spill")


def path_of(name: str) -> str:
    """Where segment `name`'s file is: in /dev/shm, or in its pool's spill directory."""
    pool, _, number = name.rpartition("-")
    if number.startswith(SPILLED):
        return os.path.join(spill_dir(pool.rpartition("-")[0]), name)
    return os.path.join(SHM_DIR, name)


def is_spilled(name: str) -> bool:
    return name.rpartition("-")[2].startswith(SPILLED)


def shm_room() -> tuple[int, int]:
    """`(free, total)` bytes of /dev/shm."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0, 0
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def make_spill_dir(prefix: str, nbytes: int) -> str:
    """The pool's spill directory, made now when it is not there yet (the one warning of the pool, then)."""
    path = spill_dir(prefix)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        # Someone else's directory, or one others can write, is not where this pool's values go.
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} is not a private directory of this user: soma will not put values "
                                  f"there (set SOMA_SPILL_DIR to a directory of your own)") from None
        return path
    free, total = shm_room()
    warn("soma.shm", "a value of %s does not fit in /dev/shm (%s free of %s): it, and any other value that does "
         "not fit, goes through a file in %s on disk instead, which is slower. Give the container more shared "
         "memory (docker run --shm-size=8g, or shm_size in docker-compose, or a larger emptyDir with medium: "
         "Memory in Kubernetes).", size_text(nbytes), size_text(free), size_text(total), path)
    return path


class RoomWanted:
    """The pool's flag that a reservation lacks room in /dev/shm: a file `<prefix>-wanted` in /dev/shm (empty:
    it needs no room), touched by whoever lacks it, looked at by every process (`heard`) when it next
    reserves and while it idles. The pool's close unlinks it with its segments (its name starts like theirs)."""

    def __init__(self, prefix: str):
        self.path = os.path.join(SHM_DIR, f"{prefix}-wanted")
        self.seen = 0  # the flag's time when this process last heard it

    def say(self) -> None:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
            os.utime(self.path)
        except OSError:
            pass  # (a hint only: the reservation waits, then spills, whether or not others hear it)
        self.seen = self._stamp()

    def heard(self) -> bool:
        """Room was wanted since this process last heard (or said) it."""
        stamp = self._stamp()
        if stamp > self.seen:
            self.seen = stamp
            return True
        return False

    def _stamp(self) -> int:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return 0


def wait_for_room(nbytes: int, deadline, wanted: RoomWanted) -> bool:
    """Wait a moment, and on until /dev/shm has `nbytes` free, or `deadline()` (monotonic, read at each look: it
    may move) passes; True when it has (the caller tries again: the room may be gone again, or
    fragmented by others' reservations). Room is said to be wanted at each look: a process that heard it before
    the segment it keeps came free hears it again as that segment comes free (SegmentStore.free), not only at
    its next idle look."""
    pause = 0.005
    while True:
        left = deadline() - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
        if shm_room()[0] >= nbytes:
            return True
        wanted.say()


def reserve(name: str, size: int) -> None:
    """Make segment file `name` with its `size` bytes reserved (OSError, and no file, when it cannot be):
    a sparse file on a full /dev/shm would SIGBUS on first touch instead."""
    fd = os.open(path_of(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        unlink_quietly(name)
        raise
    finally:
        os.close(fd)


def reserve_in_shm(name: str, size: int, give_back, wanted: RoomWanted, caller_held, told_wait=None,
                   streak: SpillStreak | None = None) -> str | None:
    """`name`, made in /dev/shm with `size` bytes reserved after giving back and waiting for room as this
    module's docstring says (`give_back(0)`: the bytes this process gave back of what it keeps); None when the
    segment is to go to the spill directory. SharedMemoryFull when the room it lacks is held by results the
    caller keeps (`caller_held()`, when there is such a measure). `told_wait()`: how long to wait, in seconds,
    as this process is told now (None, or no `told_wait`: `room_wait_s(size)`), read at each look: a worker
    told to wait long for frees on their way stops once its host says none are coming (a map's caller keeps
    the room). `streak`: the store's SpillStreak (step 2 is skipped while it holds and no wait was told)."""
    free, total = shm_room()
    if total and size > total:
        return None  # it can never fit
    started = None

    def deadline() -> float:
        told = told_wait() if told_wait is not None else None
        return started + (room_wait_s(size) if told is None else told)

    while True:
        try:
            reserve(name, size)
            return name
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.ENOMEM):
                raise  # not a want of room (too many open files, ...): said as it is by whoever knows the node
        if started is None:
            started = time.monotonic()
            if give_back(0):
                continue  # (1) what this process kept for reuse first
            wanted.say()  # (2) and what the others keep
            if streak is not None and streak.holds(started, shm_room()[0]) and (
                    told_wait is None or told_wait() is None):
                break  # (a spill streak: no frees came since the last spill, and none was said to be on its way)
        if not wait_for_room(size, deadline, wanted):
            break
    free, total = shm_room()
    held = caller_held() if caller_held is not None else 0
    if held and held + free >= size and 2 * held >= total:
        raise SharedMemoryFull.caller_holds(size, held, free, total)  # (3)
    if streak is not None:
        streak.spilled(time.monotonic(), free)
    return None  # (4)


def unlink_quietly(name: str) -> None:
    try:
        os.unlink(path_of(name))
    except FileNotFoundError:
        pass


def unlink_all(prefix: str, owner: int | None = None, keep: set | frozenset = frozenset(),
               spill: str | None = None) -> int:
    """Unlink this pool's segment files, in /dev/shm and its spill directory (`spill`: this process's
    `spill_dir(prefix)` unless given; one owner's only, when `owner` is given), except `keep`; the whole
    pool's also removes its spill directory and its room-wanted flag."""
    head = f"{prefix}-" if owner is None else f"{prefix}-{owner}-"
    removed = 0
    spill = spill or spill_dir(prefix)
    for where in (SHM_DIR, spill):
        try:
            names = os.listdir(where)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            if name.startswith(head) and name not in keep:
                try:
                    os.unlink(os.path.join(where, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    if owner is None:
        try:
            os.rmdir(spill)
        except OSError:
            pass  # (not there; or not empty: a file kept by `keep`)
    return removed


# A segment handed on outside soma (torch.multiprocessing received its file descriptor) is marked so on its
# file: another process may map it for as long as it likes, so its owner never reuses it, only unlinks it.
_EXPORTED_BIT = 0o100


def mark_exported(path: str) -> None:
    """Segment file `path` was handed on outside soma: its owner must not reuse it (see `_EXPORTED_BIT`)."""
    try:
        os.chmod(path, 0o600 | _EXPORTED_BIT)
    except FileNotFoundError:
        pass  # unlinked already: nobody can reuse it


def exported(name: str) -> bool:
    """Segment `name` was handed on outside soma (`mark_exported`)."""
    try:
        return bool(os.stat(path_of(name)).st_mode & _EXPORTED_BIT)
    except FileNotFoundError:
        return False
