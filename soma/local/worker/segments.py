"""This worker's shared-memory segments (soma.wire.shm): its store made on first use, segments freed on the host's
word, free ones given back when another process wants room or the worker has been idle, every one unlinked when
the worker ends."""

from __future__ import annotations

import threading

from ...wire.shm import SegmentStore


class Segments:
    def __init__(self, prefix: str, arena: int):
        self.prefix, self.arena = prefix, arena
        self.store = None
        self.lock = threading.Lock()
        self.caller_held = 0  # bytes of /dev/shm the caller's results hold, as the host's last Task said
        self.room_s = None  # how long a reservation short of room waits for frees, as the host's last Task said

    def get_store(self, create: bool = True):
        """The worker's SegmentStore (made now when `create`), or None when none was needed yet."""
        if self.store is None and create:
            with self.lock:
                if self.store is None:
                    self.store = SegmentStore(self.prefix, self.arena, caller_held=lambda: self.caller_held,
                                              room_wait_s=self.room_s)
        return self.store

    def told(self, held: int, room_s: float | None) -> None:
        """What the host's last Task said: bytes the caller's results hold, and how long a reservation short of
        room waits for frees on their way before it spills (None: by its size; see protocol.Task)."""
        self.caller_held, self.room_s = held, room_s
        if self.store is not None:
            self.store.room_wait_s = room_s

    def free(self, frees: list) -> None:
        """The host no longer reads these segments (`[[name, n]]`: see soma.wire.shm)."""
        store = self.get_store()
        for name, n in frees:
            store.free(name, n)

    def releases(self) -> list:
        """Receipts whose storages died since the last call (they travel in the next Result)."""
        return self.store.releases() if self.store is not None else []

    def trim_if_idle(self, idle_s: float) -> None:
        """Between jobs (`idle_s`: how long nothing has run): the store gives back what it keeps for reuse when
        another process wants room, or when nothing ran for a while (`SegmentStore.idle`)."""
        store = self.store
        if store is not None:
            store.idle(idle_s)

    def close(self) -> None:
        """Unlink this worker's segments (it is ending)."""
        if self.store is not None:
            self.store.close()
