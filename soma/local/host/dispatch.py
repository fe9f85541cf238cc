"""Which worker takes each waiting job, and what is out at each worker: the core's books of where jobs are.

    add(jobs) ──▶ lines (Waiting, below: a line per piece)
                   │ pump(usable, starting): a worker for each job from the front of each line (choose, below),
                   ▼ a batching node alone's filling a bundle at one worker before the next is chosen
                 [(slot, jobs, groups)] to send  and, for a worker still starting, jobs parked until its hello
    give_back(job): its outcome came, or its worker is gone: it is no longer out there

The lines (`Waiting`): one per piece, first come first served within it. The
pump takes each piece's jobs from the front while a worker takes them, and stops
at the first one none can: the rest of that line waits, without being looked at.
A piece's jobs all ask the same of a worker (its device, its copies, its lane),
so when none can take the first, none can take the ones behind it in the same
pump: a pump costs what it places plus one look per piece, not a look at every
job waiting (64 threads calling `run` while a batching node's inputs gather here
made each run's pump walk all the others).

The choice of a worker for a job: one pinned to the piece's CUDA device, if it
has one, and, for a batching node alone, one with none of its sends (bundles)
out, or one out while a full bundle waits (GATHER_SENDS: one running, the next
queued behind it): what comes meanwhile waits here and goes as one bundle (a
bundle fills at the worker chosen for its first job, `fits`, before the next
choice); among those, the one with the fewest jobs outstanding, preferring the
worker that already holds copies of most of the piece's nodes (their state lives
there), then the one that holds the fewest copies; a worker without a copy
qualifies only while the nodes' `copies` allow another. A worker runs its jobs of
one piece one after another (a lane), so at most the piece's depth of them wait
there (measures.py: measured from their pace), and at most `cap(piece)` jobs of
all pieces are out at it when it takes one more.

Pure, like the core that owns it (core.py): no locks, no I/O.
"""

from __future__ import annotations

from collections import deque

from .chunks import AHEAD
from .flows import SendCount, stale
from .measures import MAX_DEPTH

GATHER_SENDS = 2  # a batching node alone: its sends (bundles, or one job) out at a worker before the next waits


def cap(piece) -> int:
    """How many jobs a worker may have outstanding and still take one of `piece`'s: MAX_DEPTH, or two batches'
    worth for a piece with a batching node (one running, the next queued behind it: with one, the worker
    waited while its outcomes went and the next batch came). Also a piece's depth until it is measured."""
    return max(MAX_DEPTH, 2 * piece.batch)


class Dispatch:
    """The lines of waiting jobs, the jobs out at each worker (sent, or parked for one starting), and what the
    choice of a worker counts: their loads and lanes, the copies each holds, a batching node alone's sends."""

    def __init__(self, worker_devices: list[str], measures):
        self.worker_devices = worker_devices
        self.depths = measures.depths  # piece id → its measured depth (measures.py: read, never written here)
        self.waiting = Waiting()  # jobs waiting for a worker, a line per piece
        self.outstanding: dict = {}  # job id → job given to a worker (sent, or parked for it)
        self.parked: list = [[] for _ in worker_devices]  # jobs for a worker that has not said hello yet
        self.load = [0] * len(worker_devices)  # jobs outstanding per worker (sent, or parked)
        self.lanes: dict = {}  # (slot, piece id) → that piece's jobs outstanding at that worker
        self.holders: dict[int, set] = {}  # node key → slots holding a copy
        self.copies_at = [0] * len(worker_devices)  # copies held per worker
        self.sends: dict = {}  # (slot, piece id) → a batching node alone's sends out at that worker (see choose)
        self.widest = MAX_DEPTH  # the largest cap of the pieces admitted (pump: whether any worker has room)

    def at(self, slot: int) -> list:
        """The jobs out at the worker of `slot` (sent, or parked for it)."""
        return [job for job in self.outstanding.values() if job.slot == slot]

    def admit(self, pieces: list) -> None:
        """These pieces' jobs are coming: a worker has room while its load is under the largest `cap` of any."""
        for piece in pieces:
            self.widest = max(self.widest, cap(piece))

    def pump(self, usable: tuple, starting: tuple) -> list:
        """Give queued jobs to workers that can take them: `[(slot, jobs, groups)]` to send (`sent`), none when
        no worker has room for any. Jobs for a worker still starting are parked here instead, so a wave still
        spreads over the pool right after a death."""
        if not self.has_room(usable):
            return []
        places: dict[int, list] = {}
        waiting = self.waiting
        for piece, line in waiting.snapshot():
            self._place_line(piece, line, usable, places)
            waiting.settle(piece)
        sends, chunked = [], []
        for slot, jobs in places.items():
            if slot in starting:
                self.parked[slot].extend(jobs)
            elif len(jobs) > 1 and jobs[0].places is not None:
                chunked.append((slot, jobs))
            else:
                sends.append((slot, jobs, self.sent(slot, jobs)))
        # A map's chunks go one a Task, the first of each worker's before any worker's second: a worker starts
        # on its first while the host encodes the next ones (all of one worker's encoded before its one Task
        # left, the second worker began ~1.8 ms into a 12 ms map, the first ~0.9 ms before it).
        for k in range(max(len(jobs) for _, jobs in chunked) if chunked else 0):
            for slot, jobs in chunked:
                if k < len(jobs):
                    sends.append((slot, [jobs[k]], self.sent(slot, [jobs[k]])))
        return sends

    def has_room(self, usable) -> bool:
        """Whether any of these workers can take one more job at all."""
        load, widest = self.load, self.widest
        for slot in usable:  # (a loop, not any() over a generator: a pump runs twice a run)
            if load[slot] < widest:
                return True
        return False

    def _place_line(self, piece, line, usable, places: dict) -> None:
        """Give `piece`'s waiting jobs to workers from the front of its line until no worker takes the next
        (then none takes the ones behind it in this pump: loads only grow during it, and they wait unlooked at).

        A batching node alone's jobs fill a bundle at one worker before the next worker is chosen (a bundle of
        the waiting jobs' share of the workers that can take them, up to max_batch: `_gather`): consecutive
        inputs travel and come back together, and a bundle costs one choice, not one per input."""
        depth = self.depths.get(piece.id) or cap(piece)
        ahead = min(depth, AHEAD)  # a chunk's job: one running and the next ones behind it at a worker
        gather = size = 0
        if piece.bundle:
            workers = len(usable) if piece.cuda is None else len(set(usable).intersection(self.serving(piece)))
            gather, size = _gather(piece, self.waiting.waiting(piece), workers)
        filling, filled = None, 0  # the slot a bundle fills now, and how many it has
        lanes, load, outstanding = self.lanes, self.load, self.outstanding
        while line:
            job = line[0]
            if stale(job):
                line.popleft()
                continue
            bundled = piece.bundle and not job.traced
            if bundled and filling is not None and filled < size and self.fits(piece, filling, depth):
                slot = filling
                filled += 1
            else:
                slot = self.choose(piece, usable, ahead if job.places is not None else depth,
                                   gather if bundled else 0)
                if slot is None:
                    return
                if bundled:
                    filling, filled = slot, 1
            line.popleft()
            lane = (slot, piece.id)  # (the job goes to `slot`: counted in its lane and load)
            job.slot = slot
            job.behind = lanes.get(lane, 0)  # the piece's jobs it will wait behind there
            lanes[lane] = job.behind + 1
            load[slot] += 1
            outstanding[job.id] = job
            places.setdefault(slot, []).append(job)

    def choose(self, piece, usable, depth: int, gather: int = 0):
        """A worker for a job of `piece`, or None; the copies it will hold there are counted. `gather`: the
        job is a batching node alone's (untraced), and a worker takes it only while fewer than `gather` of
        the piece's sends are out there (1: none, the next bundle goes only to a worker with nothing of it
        to run; GATHER_SENDS when a full bundle is waiting). What arrives meanwhile gathers into the next
        bundle; a lone input finds nothing out and goes at once."""
        best, best_rank = None, None
        keys = piece.keys.values()
        holders, lanes, loads, copies_at = self.holders, self.lanes, self.load, self.copies_at
        sends = self.sends if gather else None
        most, piece_id, cuda, limited, wanted = cap(piece), piece.id, piece.cuda, piece.max_copies, len(keys)
        for slot in usable:
            load = loads[slot]
            if (load >= most or lanes.get((slot, piece_id), 0) >= depth
                    or (cuda is not None and self.worker_devices[slot] != cuda)
                    or (sends and sends.get((slot, piece_id), 0) >= gather)):
                continue
            holds = 0
            for key in keys:
                if slot in holders.get(key, ()):
                    holds += 1
            if holds < wanted and limited is not None and not self._may_copy(piece, slot):
                continue
            rank = (load, -holds, copies_at[slot], slot)
            if best_rank is None or rank < best_rank:
                best, best_rank = slot, rank
        if best is not None:
            for key in keys:
                slots = holders.get(key)
                if slots is None:
                    slots = holders[key] = set()
                if best not in slots:
                    slots.add(best)
                    copies_at[best] += 1
        return best

    def fits(self, piece, slot: int, depth: int) -> bool:
        """Whether the worker of `slot`, chosen for one of `piece`'s jobs in this pump, takes one more of them."""
        return self.load[slot] < cap(piece) and self.lanes.get((slot, piece.id), 0) < depth

    def _may_copy(self, piece, slot: int) -> bool:
        """Whether another copy of the piece's limited nodes may be made on `slot`."""
        return all(len(self.holders.get(key, ())) < piece.max_copies or slot in self.holders.get(key, ())
                   for key in piece.keys.values())

    def serving(self, piece) -> list[int]:
        """The slots whose workers could ever run `piece` (its CUDA device's, or all)."""
        return [s for s in range(len(self.load)) if piece.cuda is None or self.worker_devices[s] == piece.cuda]

    def sent(self, slot: int, jobs: list) -> list:
        """The jobs go to the worker of `slot`, grouped as they will travel (`entries`: returned); a batching
        node alone's sends are counted (a bundle, or one job, is one send: see `choose`)."""
        groups = entries(jobs)
        for group in groups:
            first = group[0]
            if first.piece.bundle and not first.traced:
                count = SendCount(slot, first.piece.id, len(group))
                for job in group:
                    job.send = count
                key = (slot, first.piece.id)
                self.sends[key] = self.sends.get(key, 0) + 1
        return groups

    def unpark(self, slot: int) -> list:
        """The jobs parked for the worker of `slot` (it said hello, or it is gone)."""
        parked, self.parked[slot] = self.parked[slot], []
        return parked

    def give_back(self, job) -> None:
        """`job` is no longer at its worker (its outcome came, or the worker is gone)."""
        del self.outstanding[job.id]
        lane = (job.slot, job.piece.id)
        left = self.lanes[lane] - 1
        if left:
            self.lanes[lane] = left
        else:
            del self.lanes[lane]
        self.load[job.slot] -= 1
        count = job.send
        if count is not None:
            job.send = None
            count.left -= 1
            if not count.left:  # every job of that send is back (answered, lost, or handed back)
                key = (count.slot, count.piece_id)
                left = self.sends.get(key, 0) - 1
                if left > 0:
                    self.sends[key] = left
                else:
                    self.sends.pop(key, None)

    def slot_lost(self, slot: int) -> None:
        """The worker of `slot` is gone: the copies it held are gone with it."""
        for slots in self.holders.values():
            slots.discard(slot)
        self.copies_at[slot] = 0

    def forget(self, keys: list) -> None:
        """Nodes the host let go: nobody holds their copies any more."""
        for key in keys:
            for slot in self.holders.pop(key, ()):
                self.copies_at[slot] -= 1


def entries(jobs: list) -> list:
    """How jobs going to one worker travel, as lists of jobs: each job alone, and a batching node alone's
    untraced ones in bundles of at most its max_batch (those sent before, whose worker left before starting
    them, as they went: in that bundle again, or alone when encoded alone). The sends are counted by these;
    the loop encodes them."""
    if len(jobs) == 1 and (jobs[0].places is not None or not jobs[0].piece.bundle):
        return [[jobs[0]]]  # (a run's one job: alone)
    out, fresh, again = [], {}, {}
    for job in jobs:
        if job.places is not None:
            out.append([job])  # a chunk: one entry (sending.py)
        elif job.packed is not None:
            again.setdefault(id(job.packed), []).append(job)
        elif job.spec is not None:  # (encoded alone, as a bundle of one: its value is in its spec, not `value`.
            out.append([job])  # In a bundle now it went as None: a worker's death, then a wrong answer, Dec 7)
        elif job.piece.bundle and not job.traced:
            fresh.setdefault(job.piece, []).append(job)
        else:
            out.append([job])
    for piece, members in fresh.items():
        for first in range(0, len(members), piece.bundle):
            out.append(members[first:first + piece.bundle])
    out += again.values()
    return out


def _gather(piece, waiting: int, workers: int) -> tuple:
    """`(how many of a batching node alone's sends a worker may have out and still take its jobs now, how many
    of them a bundle holds in this pump)`. One send running and the next behind it
    when a full bundle waits, else none (what the other inputs wait for gathers into one bundle; a lone input
    finds nothing out and goes at once); a bundle is the waiting jobs' share of the workers, up to max_batch
    (ten waiting for two idle workers go five and five, not ten to one while the other idles)."""
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
