"""Which worker takes each waiting job, and what is out at each worker: the core's books of where jobs are.

    queue(jobs) ──▶ lines (Waiting, below: a line per piece)
                     │ pump(usable, starting): a worker for each job from the front of each line (choice.py),
                     ▼ a batching node alone's filling a bundle at one worker before the next is chosen
                   { slot: jobs to send }   and, for a worker still starting, jobs parked until its hello
    give_back(job): its outcome came, or its worker is gone: it is no longer out there

The lines (`Waiting`): one per piece, first come first served within it.

    add(jobs) ──▶ {piece: deque of its jobs}  (pieces in the order their first waiting job came)
                   │ the pump takes each piece's jobs from the front while a worker takes them, and stops
                   ▼ at the first one none can: the rest of that line waits, without being looked at

A piece's jobs all ask the same of a worker (its device, its copies, its lane), so
when none can take the first, none can take the ones behind it in the same pump:
a pump costs what it places plus one look per piece, not a look at every job
waiting (64 threads calling `run` while a batching node's inputs gather here
made each run's pump walk all the others).

Pure, like the core that owns it (core.py): no locks, no I/O.
"""

from __future__ import annotations

from collections import deque

from .choice import GATHER_SENDS, WorkerChoice
from .chunks import AHEAD
from .flows import SendCount, entries, stale


class Dispatch:
    """The lines of waiting jobs, the jobs out at each worker (sent, or parked for one starting), the choice."""

    def __init__(self, worker_devices: list[str]):
        self.choice = WorkerChoice(worker_devices)
        self.waiting = Waiting()  # jobs waiting for a worker, a line per piece
        self.outstanding: dict = {}  # job id → job given to a worker (sent, or parked for it)
        self.parked: list = [[] for _ in worker_devices]  # jobs for a worker that has not said hello yet

    def at(self, slot: int) -> list:
        """The jobs out at the worker of `slot` (sent, or parked for it)."""
        return [job for job in self.outstanding.values() if job.slot == slot]

    def pump(self, usable: tuple, starting: tuple):
        """Give queued jobs to workers that can take them: `{slot: jobs}` to send (jobs for a worker still
        starting are parked here instead, so a wave still spreads over the pool right after a death), or None
        when no worker has room for any."""
        if not self.choice.has_room(usable):
            return None
        places: dict[int, list] = {}
        for piece, line in self.waiting.snapshot():
            self._place_line(piece, line, usable, places)
            self.waiting.settle(piece)
        sends = {}
        for slot, jobs in places.items():
            if slot in starting:
                self.parked[slot].extend(jobs)
            else:
                sends[slot] = jobs
        return sends

    def _place_line(self, piece, line, usable, places: dict) -> None:
        """Give `piece`'s waiting jobs to workers from the front of its line until no worker takes the next
        (then none takes the ones behind it in this pump: loads only grow during it, and they wait unlooked at).

        A batching node alone's jobs fill a bundle at one worker before the next worker is chosen (a bundle of
        the waiting jobs' share of the workers that can take them, up to max_batch: `_gather`): consecutive
        inputs travel and come back together, and a bundle costs one choice, not one per input."""
        choice = self.choice
        depth = choice.depth(piece)
        ahead = min(depth, AHEAD)  # a chunk's job: one running and the next behind it at a worker
        workers = len(usable) if piece.cuda is None else len(set(usable).intersection(choice.serving(piece)))
        gather, size = _gather(piece, self.waiting.waiting(piece), workers)
        filling, filled = None, 0  # the slot a bundle fills now, and how many it has
        while line:
            job = line[0]
            if stale(job):
                line.popleft()
                continue
            bundled = piece.bundle and not job.traced
            if bundled and filling is not None and filled < size and choice.fits(piece, filling, depth):
                slot = filling
                filled += 1
            else:
                slot = choice.choose(piece, usable, ahead if job.places is not None else depth,
                                     gather if bundled else 0)
                if slot is None:
                    return
                if bundled:
                    filling, filled = slot, 1
            line.popleft()
            choice.take(job, slot)
            self.outstanding[job.id] = job
            places.setdefault(slot, []).append(job)

    def sent(self, slot: int, jobs: list) -> list:
        """The jobs go to the worker of `slot`, grouped as they will travel (flows.entries: returned); a batching
        node alone's sends are counted there (a bundle, or one job, is one send: `WorkerChoice.sent`)."""
        groups = entries(jobs)
        for group in groups:
            first = group[0]
            if first.piece.bundle and not first.traced:
                count = SendCount(slot, first.piece.id, len(group))
                for job in group:
                    job.send = count
                self.choice.sent(slot, first.piece.id)
        return groups

    def unpark(self, slot: int) -> list:
        """The jobs parked for the worker of `slot` (it said hello, or it is gone)."""
        parked, self.parked[slot] = self.parked[slot], []
        return parked

    def give_back(self, job) -> None:
        """`job` is no longer at its worker (its outcome came, or the worker is gone)."""
        del self.outstanding[job.id]
        self.choice.give_back(job)
        count = job.send
        if count is not None:
            job.send = None
            count.left -= 1
            if not count.left:
                self.choice.send_over(count.slot, count.piece_id)


def _gather(piece, waiting: int, workers: int) -> tuple:
    """`(how many of a batching node alone's sends a worker may have out and still take its jobs now, how many
    of them a bundle holds in this pump)`; (0, 0) for any other piece. One send running and the next behind it
    when a full bundle waits, else none (what the other inputs wait for gathers into one bundle; a lone input
    finds nothing out and goes at once); a bundle is the waiting jobs' share of the workers, up to max_batch
    (ten waiting for two idle workers go five and five, not ten to one while the other idles)."""
    if not piece.bundle:
        return 0, 0
    size = min(piece.bundle, max(1, -(-waiting // max(1, workers))))
    return (GATHER_SENDS if waiting >= piece.bundle else 1), size


class Waiting:
    """Jobs waiting for a worker, per piece (the core's books: dispatch.py)."""

    __slots__ = ("lines",)

    def __init__(self):
        self.lines: dict = {}  # piece → deque of its waiting jobs (never empty: an emptied line is removed)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, jobs) -> None:
        """New jobs, each at the back of its piece's line."""
        for job in jobs:
            self._line(job.piece).append(job)

    def add_first(self, jobs: list) -> None:
        """Jobs that were out at a worker and come back unstarted: at the front of their lines, in order."""
        for job in reversed(jobs):
            self._line(job.piece).appendleft(job)

    def _line(self, piece) -> deque:
        line = self.lines.get(piece)
        if line is None:
            line = self.lines[piece] = deque()
        return line

    def waiting(self, piece) -> int:
        """How many of `piece`'s jobs wait (stale ones not yet dropped included)."""
        line = self.lines.get(piece)
        return len(line) if line is not None else 0

    def snapshot(self) -> list:
        """`(piece, line)` of every piece with jobs waiting; a line emptied meanwhile is dropped by `settle`."""
        return list(self.lines.items())

    def settle(self, piece) -> None:
        """Drop `piece`'s line if nothing is left in it."""
        line = self.lines.get(piece)
        if line is not None and not line:
            del self.lines[piece]

    def take(self, piece) -> deque:
        """Remove and return `piece`'s whole line."""
        return self.lines.pop(piece, deque())

    def clear(self) -> None:
        self.lines.clear()
