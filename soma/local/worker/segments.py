"""This worker's shared-memory segments (soma.wire.shm): its store made on first use, segments freed on the host's
word, free ones given back when the worker has been idle, every one unlinked when the worker ends."""

from __future__ import annotations

import threading

from ...wire.shm import IDLE_KEEP, IDLE_TRIM_S, SegmentStore


class Segments:
    def __init__(self, prefix: str, arena: int):
        self.prefix, self.arena = prefix, arena
        self.store = None
        self.lock = threading.Lock()

    def get_store(self, create: bool = True):
        """The worker's SegmentStore (made now when `create`), or None when none was needed yet."""
        if self.store is None and create:
            with self.lock:
                if self.store is None:
                    self.store = SegmentStore(self.prefix, self.arena)
        return self.store

    def free(self, frees: list) -> None:
        """The host no longer reads these segments (`[[name, n]]`: see soma.wire.shm)."""
        store = self.get_store()
        for name, n in frees:
            store.free(name, n)

    def releases(self) -> list:
        """Receipts whose storages died since the last call (they travel in the next Result)."""
        return self.store.releases() if self.store is not None else []

    def trim_if_idle(self, idle_s: float) -> None:
        """Nothing ran for IDLE_TRIM_S (`idle_s`: how long nothing has): give back the free segments kept for
        reuse beyond IDLE_KEEP, so that an idle pool does not keep /dev/shm full of values its caller dropped."""
        store = self.store
        if store is not None and idle_s >= IDLE_TRIM_S and store.pooled_bytes() > IDLE_KEEP:
            store.trim(IDLE_KEEP)

    def close(self) -> None:
        """Unlink this worker's segments (it is ending)."""
        if self.store is not None:
            self.store.close()
