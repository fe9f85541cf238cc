"""The host's lease book: who holds each shared segment, and when its owner may reuse it.

The host sees every handle that crosses (all messages pass through it), so it
counts, per segment, the receipts each process holds: its own (decoded results)
and each worker's (inputs it sent). Workers report receipts whose storages died
(in their RESULTs); the host's own are reported by its `SegmentStore`. When nobody holds
a segment any more, the owner is told `FREE(name, n)`: n is how many of the
owner's sends that settles, so a send still in flight keeps the segment busy.
`HostSegments` is the host's own side of it: its store, its receipts, its idle trim.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import defaultdict, deque

from ...wire.room import ROOM_WAIT_S
from ...wire.shm import owner_pid, unlink_quietly


class _Entry:
    __slots__ = ("from_owner", "held")

    def __init__(self):
        self.from_owner = 0  # the owner's sends this entry covers
        self.held: dict[int, int] = defaultdict(int)  # holder pid → receipts


class LeaseBook:
    def __init__(self, host_pid: int):
        self.host_pid = host_pid
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        # owner pid → [(name, n)] to tell it; read without the lock as "anything to tell?" (a stale answer only
        # delays a free)
        self.frees: dict[int, list] = defaultdict(list)
        self._dead: set[int] = set()
        # Segments the host holds a received view of that a worker holds too: values on their way through
        # the host (an output that is a later piece's input, a wave's), not results the caller keeps (`passing`)
        self._passing: set[str] = set()

    def received(self, name: str, sender: int) -> None:
        """The host decoded a handle to `name` sent by process `sender`."""
        with self._lock:
            entry = self._entries.setdefault(name, _Entry())
            if owner_pid(name) == sender:
                entry.from_owner += 1
            entry.held[self.host_pid] += 1
            if len(entry.held) > 1:
                self._passing.add(name)

    def lent(self, name: str, to: int) -> None:
        """The host sent a handle to `name` to process `to`."""
        with self._lock:
            entry = self._entries.setdefault(name, _Entry())
            if owner_pid(name) == self.host_pid:
                entry.from_owner += 1
            entry.held[to] += 1
            if self.host_pid in entry.held and to != self.host_pid:
                self._passing.add(name)

    def released(self, holder: int, name: str, n: int) -> None:
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            entry.held[holder] -= n
            if entry.held[holder] <= 0:
                del entry.held[holder]
                self._still_passing(name, entry)
            self._free_if_unheld(name, entry)

    def holder_gone(self, pid: int) -> None:
        """Process `pid` died: it holds nothing any more, and the segments it owned cannot be reused."""
        with self._lock:
            self._dead.add(pid)
            self.frees.pop(pid, None)
            for name, entry in list(self._entries.items()):
                entry.held.pop(pid, None)
                self._still_passing(name, entry)
                self._free_if_unheld(name, entry)

    def passing(self) -> list[str]:
        """Segments the host has received and a worker holds too: values on their way through the host."""
        if not self._passing:
            return []
        with self._lock:
            return list(self._passing)

    def _still_passing(self, name: str, entry: _Entry) -> None:
        # lock held
        if name in self._passing and (len(entry.held) < 2 or self.host_pid not in entry.held):
            self._passing.discard(name)

    def _free_if_unheld(self, name: str, entry: _Entry) -> None:
        # lock held
        if entry.held:
            return
        del self._entries[name]
        owner = owner_pid(name)
        if owner in self._dead:
            unlink_quietly(name)  # nobody maps it through a name any more; its owner cannot reuse it
        else:
            self.frees[owner].append((name, entry.from_owner))

    def give_back_frees(self, owner: int, frees: list) -> None:
        """Frees taken for a message that did not go: told with the next one instead."""
        if frees and owner not in self._dead:
            with self._lock:
                self.frees[owner][:0] = frees

    def take_frees(self, owner: int) -> list:
        if owner not in self.frees:
            return []
        with self._lock:
            return self.frees.pop(owner, [])

    def held_names(self) -> set[str]:
        with self._lock:
            return set(self._entries)


class HostSegments:
    """The host's own segments: its SegmentStore (made on first need), the receipts it lets go (its
    decoded results dying), and the free segments it keeps for reuse, given back once the pool is idle."""

    def __init__(self, prefix: str, arena: int, book: LeaseBook):
        self.prefix, self.arena, self.book = prefix, arena, book
        self.store = None
        self._lock = threading.Lock()
        self._released: deque = deque()
        self._busy_at = time.monotonic()  # when a job was last queued or out (trim_if_idle)
        self.maps_open = weakref.WeakSet()  # the in-flight sets of the maps open now (caller_held)
        self.held_back = weakref.WeakSet()  # those of them held back by memory (room_s)

    def get_store(self, create: bool = True):
        if self.store is None and create:
            with self._lock:
                if self.store is None:
                    from ...wire.shm import SegmentStore

                    # Inputs are encoded on the loop's thread, after it told the workers of what the host let go
                    # (HostLoop._input_store): a reservation short of room waits for those frees as long as a
                    # spill would take (by its size: soma.wire.room), then spills. (Frees of the host's own
                    # segments come in Results this thread would receive: a wait does not bring those.)
                    self.store = SegmentStore(self.prefix, self.arena, on_release=self._release)
        return self.store

    def note_sent(self, name: str) -> None:
        if self.store is not None:
            self.store.note_sent(name)

    def received(self) -> int:
        """Bytes of /dev/shm in other processes' segments the host maps now (results the caller keeps, outputs
        waiting in maps' windows, values on their way): SegmentStore.received_bytes."""
        return self.store.received_bytes() if self.store is not None else 0

    def kept(self, items=()) -> int:
        """What `received` counts less the values on their way through the host (received, and lent to a worker
        now, LeaseBook.passing, or by the Task about to go with `items`): bytes the caller's results hold."""
        received = self.received()
        if not received:
            return 0
        passing = set(self.book.passing()).union(*[item.shared for item in items])
        return max(0, received - self.store.received_of(passing)) if passing else received

    def for_task(self, items=()) -> tuple:
        """`(held, room_s)`, what a Task tells its worker of the host's memory, once the host's own dead receipts
        are applied (`apply_releases`: so the frees the Task carries are current). One call for a Task's way.

        `items`: what the Task carries (each `.shared`: the segments it lends). `held`: bytes of /dev/shm the
        caller's results hold (a worker short of that room raises SharedMemoryFull saying so, rather than spill).
        What the host's store received and still maps, less what it lends to a worker now (an output on its way
        into a later piece: a wave's branches' input, counted as the caller's before Dec 6, and their outputs,
        short of room, failed SharedMemoryFull with nothing kept), is the caller's while no map is open; with one
        open, some of it waits in the map's window and reorder buffer, which the map frees itself as its caller
        consumes: then 0 (a worker short of room spills).

        `room_s`: how long a worker's reservation short of room waits for frees on their way: while a map held
        back by memory is open, ROOM_WAIT_S, for its window counted room for each output it started and the room
        lacking is the frees of outputs its caller dropped, on their way to their owners (under load they took
        longer than the spill's time: issue 31's CI beside two CPU burners); else None (by the value's size:
        soma.wire.room)."""
        self.apply_releases()
        return (0 if self.maps_open else self.kept(items)), (ROOM_WAIT_S if self.held_back else None)

    def trim_if_idle(self, busy: bool) -> None:
        """The host's side of what each worker does (`SegmentStore.idle`, called by whoever listens): what it
        keeps for reuse goes back when another process wants room, busy or not (a map whose caller waits for a
        straggler keeps the host's input copies free while its workers lack room for outputs), and beyond its
        idle keep once no job was queued or out for IDLE_TRIM_S."""
        now = time.monotonic()
        if busy:
            self._busy_at = now
        store = self.store
        if store is not None:  # (busy: idle for 0 s, so only a want of room is heard)
            store.idle(now - self._busy_at)

    def _release(self, name: str, n: int) -> None:
        self._released.append((name, n))  # any thread, maybe inside GC: only queue it

    def apply_releases(self) -> None:
        """Apply the host's own dead receipts, and hand segments the host owns back to its store."""
        if not self._released and not self.book.frees:
            return
        while self._released:
            try:
                name, n = self._released.popleft()
            except IndexError:
                break
            self.book.released(self.book.host_pid, name, n)
        if self.store is not None:
            for name, n in self.book.take_frees(self.book.host_pid):
                self.store.free(name, n)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
