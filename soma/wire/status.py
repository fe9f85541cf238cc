"""A worker's status page: which input and which node each of its threads is running now.

The host reads it when a worker dies or a run times out, so `WorkerDied` and
`RunTimeout` name the node (and the input) even though the worker can no longer
answer. It is a small file the worker maps shared (nothing is sent for it).

Layout: `SLOTS` slots of `SLOT` bytes, one per thread that runs nodes (a thread
runs one node at a time, for one job, or for the jobs of one batch: "job,job,... node").
A slot is `seq (4 bytes) + length (2) + pad (2) + job (8, signed) + "jobs node"`;
its thread bumps `seq` before and after writing the text (odd: being written), so a
reader never takes half a line, and threads never wait for each other. A thread that
runs one node for job after job (a chunk's inputs) writes the text " node" once (no
jobs: the slot's job field names the job) and then only stores each job's id into
the field: one 8-byte store, no seq (the node is the same before and after it), made
through a one-item view of the field (`naming`): a subscript store, where a call per
input cost four times as much (issue 31's tiny inputs). A job field of 0 names no job
(ids start at 1): leaving a job stores 0 and keeps the node's name for the next.
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
_JOB = struct.Struct("<q")
_TEXT = 16  # where a slot's text begins (after seq, length, pad and the job field)


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
        self._jobs = None  # the job fields as one array of int64 (memoryview.cast: a store is one C call)
        self._fields: list = [None] * SLOTS  # each slot's job field alone, a one-item view (made once: `naming`)
        self._free = list(range(SLOTS - 1, -1, -1))
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- writer side (the worker) ------------------------------------------------------------------
    def enter(self, job: int, node: str) -> None:
        """This thread now runs `node` for `job`."""
        mine = self._mine()
        if mine is None:
            return
        if mine.showing != node:
            mine.showing = node
            self._put(mine.slot, f" {node}".encode()[: SLOT - _TEXT], job)
        else:
            self._jobs[mine.field] = job

    def naming(self, node: str):
        """This thread now runs `node`, for job after job: a one-item int64 view, `job`, where `job[0] = id`
        names each (a chunk's inputs: the cheapest write there is, one store of the job's id). A thread
        without a slot gets a view of its own that no one reads (it goes unnamed, as in `enter`)."""
        mine = self._mine()
        if mine is None:
            return memoryview(bytearray(8)).cast("q")
        if mine.showing != node:
            mine.showing = node
            self._put(mine.slot, f" {node}".encode()[: SLOT - _TEXT], 0)
        field = self._fields[mine.slot]
        if field is None:
            field = self._fields[mine.slot] = self._jobs[mine.field:mine.field + 1]
        return field

    def enter_batch(self, jobs: list, node: str) -> None:
        """This thread now runs `node` for all of `jobs` at once (a batch)."""
        mine = self._mine()
        if mine is None:
            return
        ids, room = [], SLOT - _TEXT - 1 - len(node.encode())
        for job in jobs:
            room -= len(str(job)) + 1
            if room < 0:
                break  # the rest go unnamed, as a thread without a slot does
            ids.append(str(job))
        mine.showing = (tuple(jobs), node)  # (not a node's name: the next `enter` writes its text)
        self._put(mine.slot, f"{','.join(ids)} {node}".encode(), 0)

    def _mine(self):
        """This thread's slot (claimed on first use), or None when every slot is taken."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            with self._lock:
                if not self._free:
                    return None  # more threads than slots: this one goes unnamed
                if self._jobs is None:
                    self._jobs = memoryview(self._map).cast("q")
                mine = self._local.mine = _Slot(self._free.pop())
            # The thread's locals die with it (a wave's branch threads come and go): its slot comes back.
            weakref.finalize(mine, self._free.append, mine.slot)
        return mine

    def park(self) -> int:
        """This thread waits for a node's copy another input holds: off the page until `unpark(what this
        returns)`, so that were its worker to die meanwhile, its input goes elsewhere without a try counted, as
        one still queued there does (named while it waited, it failed WorkerDied behind a timed-out run, Dec 7)."""
        mine = getattr(self._local, "mine", None)
        if mine is None or type(mine.showing) is not str:
            return 0
        job, self._jobs[mine.field] = self._jobs[mine.field], 0
        return job

    def unpark(self, job: int) -> None:
        """Named again (`park`'s job), the copy now held."""
        if job:
            self._jobs[self._local.mine.field] = job

    def leave(self) -> None:
        """This thread runs nothing now. After one job, one store: its job field to 0 (no job has id 0); the
        node's name stays written, so the thread's next job of the same node is one store too (a run's two
        writes of the whole slot were a tenth of a worker's CPU for an empty round trip)."""
        mine = getattr(self._local, "mine", None)
        if mine is None:
            return
        showing = mine.showing
        if type(showing) is str:
            self._jobs[mine.field] = 0
        elif showing is not None:  # a batch's jobs are in the text: it is cleared
            mine.showing = None
            self._put(mine.slot, b"", 0)

    def _put(self, slot: int, data: bytes, job: int) -> None:
        base = slot * SLOT
        seq = self._seqs[slot] + 1
        _HEAD.pack_into(self._map, base, seq, len(data))  # odd: being written
        self._map[base + _TEXT:base + _TEXT + len(data)] = data
        self._jobs[_field(slot)] = job
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
                data = self._map[base + _TEXT:base + _TEXT + min(size, SLOT - _TEXT)]
                job = _JOB.unpack_from(self._map, base + 8)[0]
                if before % 2 == 0 and int.from_bytes(self._map[base:base + 4], "little") == before:
                    jobs, _, node = data.decode(errors="replace").partition(" ")
                    if node and not jobs:
                        if job:  # (one job: the field names it; 0: the thread is between jobs)
                            pairs.append((job, node))
                    elif node:
                        pairs += [(int(job), node) for job in jobs.split(",") if job.lstrip("-").isdigit()]
                    break
        return pairs

    def close(self) -> None:
        for field in self._fields:
            if field is not None:
                field.release()  # (an exported view keeps an mmap from closing: a writer's view is no use now)
        if self._jobs is not None:
            self._jobs.release()
        self._map.close()


def _field(slot: int) -> int:
    """The index of `slot`'s job field in the page as int64s."""
    return (slot * SLOT + 8) // 8


class _Slot:
    __slots__ = ("slot", "field", "showing", "__weakref__")

    def __init__(self, slot: int):
        self.slot = slot
        self.field = _field(slot)
        self.showing = None  # the node the slot names now (a batch's: a tuple; nothing: None)
