"""A worker's status page: which input and which node each of its threads is running now.

The host reads it when a worker dies or a run times out, so `WorkerDied` and
`RunTimeout` name the node (and the input) even though the worker can no longer
answer. It is a small file the worker maps shared (nothing is sent for it).

Layout: `SLOTS` slots of `SLOT` bytes, one per thread that runs nodes (a thread
runs one node at a time, for one job, or for the jobs of one batch: "job,job,... node").
A slot is `seq (4 bytes) + length (2) + "job node"`;
its thread bumps `seq` before and after writing (odd: being written), so a reader
never takes half a line, and threads never wait for each other.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import weakref

SLOT = 1024  # a batch's job ids fit: ~140 of 6 digits (the ones past that go unnamed)
SLOTS = 64
_HEAD = struct.Struct("<IH")  # seq, length
_SEQ = struct.Struct("<I")


class StatusPage:
    SIZE = SLOT * SLOTS

    def __init__(self, path: str, create: bool):
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, self.SIZE)
            self._map = mmap.mmap(fd, self.SIZE)
        finally:
            os.close(fd)
        self._seqs = [0] * SLOTS
        self._free = list(range(SLOTS - 1, -1, -1))
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- writer side (the worker) ------------------------------------------------------------------
    def enter(self, job: int, node: str) -> None:
        """This thread now runs `node` for `job`."""
        mine = self._mine()
        if mine is not None and mine.showing != (job, node):
            mine.showing = (job, node)
            self._put(mine.slot, f"{job} {node}".encode()[: SLOT - 6])

    def enter_batch(self, jobs: list, node: str) -> None:
        """This thread now runs `node` for all of `jobs` at once (a batch)."""
        mine = self._mine()
        if mine is None:
            return
        ids, room = [], SLOT - 7 - len(node.encode())
        for job in jobs:
            room -= len(str(job)) + 1
            if room < 0:
                break  # the rest go unnamed, as a thread without a slot does
            ids.append(str(job))
        mine.showing = (tuple(jobs), node)
        self._put(mine.slot, f"{','.join(ids)} {node}".encode())

    def _mine(self):
        """This thread's slot (claimed on first use), or None when every slot is taken."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            with self._lock:
                if not self._free:
                    return None  # more threads than slots: this one goes unnamed
                mine = self._local.mine = _Slot(self._free.pop())
            # The thread's locals die with it (a wave's branch threads come and go): its slot comes back.
            weakref.finalize(mine, self._free.append, mine.slot)
        return mine

    def leave(self) -> None:
        """This thread runs nothing now."""
        mine = getattr(self._local, "mine", None)
        if mine is not None and mine.showing is not None:
            mine.showing = None
            self._put(mine.slot, b"")

    def _put(self, slot: int, data: bytes) -> None:
        base = slot * SLOT
        seq = self._seqs[slot] + 1
        _HEAD.pack_into(self._map, base, seq, len(data))  # odd: being written
        self._map[base + 6:base + 6 + len(data)] = data
        self._seqs[slot] = seq + 1
        _SEQ.pack_into(self._map, base, seq + 1)

    # -- reader side (the host) ---------------------------------------------------------------------
    def read(self) -> list[tuple[int, str]]:
        """What runs now, as `(job id, node id)` pairs."""
        pairs = []
        for slot in range(SLOTS):
            base = slot * SLOT
            for _ in range(100):
                before = int.from_bytes(self._map[base:base + 4], "little")
                size = int.from_bytes(self._map[base + 4:base + 6], "little")
                data = self._map[base + 6:base + 6 + min(size, SLOT - 6)]
                if before % 2 == 0 and int.from_bytes(self._map[base:base + 4], "little") == before:
                    jobs, _, node = data.decode(errors="replace").partition(" ")
                    if node:
                        pairs += [(int(job), node) for job in jobs.split(",") if job.lstrip("-").isdigit()]
                    break
        return pairs

    def close(self) -> None:
        self._map.close()


class _Slot:
    __slots__ = ("slot", "showing", "__weakref__")

    def __init__(self, slot: int):
        self.slot = slot
        self.showing = None  # what the slot says now
