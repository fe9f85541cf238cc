"""Lanes: each piece's jobs waiting in this worker, in arrival order, and which of them run next (a turn).

    accept ── Lanes.add(entry) ──▶ its piece's Lane (made on first use) ──▶ runnable, when nobody runs it
    a serving thread ── Lanes.take_turn(lane) ──▶ the lane's next entry, or a batching piece's next entries
                        up to its max_batch inputs (fill_turn), with the ids the host cancelled meanwhile
    Cancel ── Lanes.cancel(ids): what still waits is dropped when its turn comes (answered Cancelled), and
              a job whose turn has come is added to its turn's dropped set (running.py looks again once
              its node is loaded and set up, before it decodes the input: until then it has not started);
              the chunks that hold one of them are answered now (chunks.answer_now); with `coming`, the
              same for jobs of Tasks read with their Cancels, before they are queued (read_behind)
    GiveBack ─ Lanes.give_back(ids): waiting jobs named are dropped (given back), and the chunks named
    forget ── Lanes.forget(known): idle lanes of pieces the host let go are dropped

An entry is what a Task's `jobs` holds: a JobSpec (one input), a Bundle (several
inputs of a batching node alone), or a Chunk (several inputs of another piece:
kept as a chunks.ChunkRun, which runs as a turn of its own). The worker's lock is
held around every call: Lanes has none of its own.
"""

from __future__ import annotations

from collections import deque

from ...wire.protocol import Bundle, Chunk, JobSpec
from .chunks import ChunkRun


class Lane:
    """The entries of one piece waiting in this worker: run in arrival order, by one thread at a time."""

    __slots__ = ("jobs", "busy", "pace", "taken")

    def __init__(self):
        self.jobs: deque = deque()
        self.busy = False  # a thread is running its jobs
        self.pace: float | None = None  # seconds its last job took here (whether outcomes may wait; turns.py)
        self.taken: list = []  # the job ids of its turn running now (Lanes.started's keys)


class Lanes:
    def __init__(self):
        self.lanes: dict[int, Lane] = {}  # piece id → its lane
        self.runnable: deque = deque()  # lanes with jobs and nobody running them
        self.cancelled: set = set()  # job ids the host no longer wants (dropped unless started)
        # job id → the dropped set of the turn running it: a Cancel that comes while its node's code loads or its
        # setup runs (seconds: a model) still drops it (JobRunner looks again before the input is decoded)
        self.started: dict[int, set] = {}
        self.chunks: set = set()  # the ChunkRuns waiting or running here

    def add(self, entry) -> None:
        """Queue an entry in its piece's lane (runnable if nobody runs that lane)."""
        if type(entry) is Chunk:
            entry = ChunkRun(entry)
            self.chunks.add(entry)
        lane = self.lanes.get(entry.piece)
        if lane is None:
            lane = self.lanes[entry.piece] = Lane()
        lane.jobs.append(entry)
        if not lane.busy:
            lane.busy = True
            self.runnable.append(lane)

    def take_turn(self, lane: Lane, pieces: dict):
        """`(turn, dropped)`: the lane's next entry (a batching piece's: its next entries that fit a batch), and
        the job ids among them the host cancelled; None when the lane is empty (nobody runs it now)."""
        if lane.taken:  # (its previous turn is over: the lane's one thread asks only once it is)
            for i in lane.taken:
                self.started.pop(i, None)
            lane.taken = []
        if not lane.jobs:
            lane.busy = False
            return None
        turn = [lane.jobs.popleft()]
        if type(turn[0]) is ChunkRun:
            return turn, set()  # (a chunk's cancels are its own)
        loaded = pieces.get(turn[0].piece)
        if loaded is not None and loaded.batch:  # a batching node's jobs run together: they share calls
            fill_turn(turn, lane.jobs, loaded.batch)
        dropped = set()
        if self.cancelled:
            dropped = {i for entry in turn for i in ids_of(entry) if i in self.cancelled}
            self.cancelled -= dropped
        lane.taken = [turn[0].id] if len(turn) == 1 and type(turn[0]) is JobSpec else \
            [i for entry in turn for i in ids_of(entry)]
        for i in lane.taken:
            self.started[i] = dropped
        return turn, dropped

    def cancel(self, wanted: set, coming: list = ()) -> list:
        """Only what has not started can be dropped (a Cancel comes after its Task, on the same socket): what
        still waits in a lane; a job whose turn has come, while its node loads and sets up (`started`: its turn
        looks again before it starts the node); and the jobs of `coming`, Tasks read with the Cancel but not
        queued yet (Worker.read_behind: each comes to a turn, so none is kept for good). The rest has started
        or is done, and its id need not be kept.
        Returns the chunks that hold one of the ids (for chunks.answer_now: what of them has not started is
        answered at once; a chunk's cancels are its own)."""
        waiting = (entry for lane in self.lanes.values() for entry in lane.jobs)
        read = (entry for task in coming for entry in task.jobs)
        self.cancelled.update(i for entries in (waiting, read) for entry in entries for i in ids_of(entry)
                              if i in wanted)
        started = self.started
        for i in wanted:  # (its turn has come: dropped still, unless its node has started by the time it looks)
            dropped = started.get(i)
            if dropped is not None:
                dropped.add(i)
        return [run for run in self.chunks if run.named(wanted)]

    def give_back(self, wanted: set) -> tuple:
        """`(the waiting jobs named: dropped, the chunks named)`: the host takes these inputs back if they have
        not started (a Bundle's inputs are not given back: they run in one call, as sent)."""
        returned = []
        for lane in self.lanes.values():
            if any(type(entry) is JobSpec and entry.id in wanted for entry in lane.jobs):
                kept = [entry for entry in lane.jobs if type(entry) is not JobSpec or entry.id not in wanted]
                returned += [entry for entry in lane.jobs if type(entry) is JobSpec and entry.id in wanted]
                lane.jobs.clear()
                lane.jobs.extend(kept)
        self.cancelled.difference_update(entry.id for entry in returned)
        return returned, [run for run in self.chunks if run.named(wanted)]

    def finished(self, run: ChunkRun) -> None:
        """A chunk has run (every input of it answered or given back)."""
        self.chunks.discard(run)

    def forget(self, known: dict) -> None:
        """Drop the idle lanes of pieces not in `known` (the host let them go)."""
        for piece_id in [p for p, lane in self.lanes.items() if not lane.busy and not lane.jobs]:
            if piece_id not in known:
                del self.lanes[piece_id]


def fill_turn(turn: list, queued: deque, batch: int) -> None:
    """Take the lane's next entries into `turn` while its inputs stay within `batch` (a Bundle counts its inputs);
    a traced job and a Bundle never share a turn (a Bundle's inputs run in one call, untraced)."""
    bundled = type(turn[0]) is Bundle
    traced = not bundled and bool(turn[0].traced)
    size = size_of(turn[0])
    while queued:
        item = queued[0]
        if type(item) is ChunkRun:
            break  # (a chunk runs as a turn of its own)
        if type(item) is Bundle:
            if traced:
                break
            bundled = True
        elif item.traced:
            if bundled:
                break
            traced = True
        size += size_of(item)
        if size > batch:
            break
        turn.append(queued.popleft())


def ids_of(entry) -> list:
    """The job ids an entry stands for: a JobSpec's one, a Bundle's named ones (a chunk's cancels are its own)."""
    if type(entry) is JobSpec:
        return [entry.id]
    return [i for i in entry.ids if i] if type(entry) is Bundle else []


def size_of(entry) -> int:
    """How many inputs an entry brings to a turn."""
    return sum(1 for i in entry.ids if i) if type(entry) is Bundle else 1
