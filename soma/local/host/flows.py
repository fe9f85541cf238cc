"""An input's way through a program: the `Flow`, its `Job`s, and the walk that makes them.

    start(program, x) ─ Piece ─ Job(piece, x)                    → handed to the core to queue
                      ├ Seq   ─ the first item now; each next one when the previous job's outcome arrives
                      └ Wave  ─ every branch now, on the same x (encoded once: twins); the join when all are
                                back: the tuple, or the first failure in branch order with the others as notes

A program is compiled once into a starter (a fold over its tree). Continuations
(`then(ok, value)`) carry outcomes on: the core calls a job's `then` when its
outcome arrives and gets back the jobs that outcome makes (a list: the next piece,
none while a wave waits for its other branches), or, once the walk has ended, the
input's outcome (a tuple `(ok, value)`: the last continuation is the flow itself),
which the core then delivers. Pure: nothing here encodes, sends or calls the core;
answers come back as return values.
"""

from __future__ import annotations

import itertools
import time

from ...plan import fold
from ...run.interpreter import wave_outcome
from .places import Places
from .program import Piece


class Flow:
    """One input on its way through a program.

    A try is one walk of the program from its start. `retries`: how many more tries the input
    gets when a worker dies while running it (the input `x` is kept for them); `tries`: how many
    have been made (the current one included). Jobs remember their try: those of an earlier try
    are stale, and their outcomes are dropped.
    """

    __slots__ = ("index", "sink", "trace", "finished", "jobs", "started_ns", "program", "x", "retries", "tries",
                 "graph")

    def __init__(self, index, sink, trace, program, x, retries: int = 0, graph=None):
        self.index = index
        # The graph its jobs' nodes are of, held while it is in flight: a node's code is shipped by its key
        # when a job of it is sent, and a node nobody holds any more is forgotten (its key with it); a job
        # waiting to be sent for a graph its caller let go (submit(Graph.somatize(Node()), x)) failed so.
        self.graph = graph
        self.sink = sink  # receives (index, ok, value) once
        self.trace = trace  # the runner's Trace when this input is traced, else None
        self.finished = False
        self.jobs: set = set()  # its jobs of the current try, queued or outstanding
        self.started_ns = time.monotonic_ns() if trace is not None else 0
        self.program = program
        self.x = x  # its input: until its first try starts, and kept after only for a try to come (retries)
        self.retries = retries
        self.tries = 1

    def __call__(self, ok, value) -> tuple:
        """The flow as the last continuation of its program's walk: the input's outcome, for the core to deliver."""
        return ok, value


class Chunk(Flow):
    """Consecutive inputs of a map, `index` on, through a program of one piece, as one flow: one job runs them
    at one worker, one after another, and their outputs come back in one message (see core.py, "Chunks").
    Each input still ends by itself: `open` holds the places (0 to count - 1) of those not ended yet.
    `retries` is each input's own, as for a Flow of one: `tried` holds the tries made of an input a dead
    worker was running (1 where absent); so is its timeout (core_chunks: `_expire_place`), and in a trace
    its spans (each input's own, as its worker measured them: outcomes.record_chunk)."""

    __slots__ = ("count", "open", "tried")

    def __init__(self, index, sink, program, xs: list, graph=None, retries: int = 0, trace=None):
        super().__init__(index, sink, trace, program, xs, retries, graph)
        self.count = len(xs)
        self.open = Places(self.count)
        self.tried: dict = {}  # place → tries made of it (its current one included), once one was lost


class Job:
    """One input for one piece: queued, then outstanding at a worker.

    A job carries its input as a value (`value`) until it is sent: then the loop encodes it (sending.py),
    alone (`spec`: its JobSpec's fields as they travel, the encoded input among them; `shared`, `keep`) or,
    for a batching node alone, together with the others going to the same worker into a bundle (`packed`,
    and its `position` there). `twins`: the jobs made from the same value in one step (a wave's branches)
    share one encoding through it.
    """

    __slots__ = ("id", "flow", "try_", "piece", "spec", "shared", "keep", "then", "slot", "sent_at", "sent_ns",
                 "behind", "traced", "value", "twins", "packed", "position", "send", "base", "places", "pending",
                 "pace", "asked_back")

    def __init__(self, job_id: int, flow: Flow, piece: Piece, then, value, twins: dict):
        self.id = job_id
        self.flow = flow
        self.try_ = flow.tries  # the try of its flow it belongs to
        self.piece = piece
        # Once encoded, `keep` holds the encoder as long as the job lives: every tensor its handles name stays
        # held by the host until the job is over, so a segment cannot be reused under the worker (before the
        # send is counted), and a job its worker never started can be sent again, as it is, to another.
        self.spec, self.shared, self.keep = None, (), None
        self.then = then  # then(ok, value) → the jobs it makes, when the job is over
        self.slot = None
        self.sent_at = 0.0
        self.behind = 0  # jobs already at its worker when it was sent (its wait there, unseen)
        self.sent_ns = 0  # when traced
        self.traced = flow.trace is not None
        self.value = value  # its input, until it is encoded
        self.twins = twins  # id(value) → its encoding, shared by the jobs made from it in one step
        self.packed = None  # the bundle its input was encoded in (sending.Packed), if any
        self.position = 0  # its input's place in that bundle's payload
        self.send = None  # the SendCount it went out in, while it is out (a batching node alone's)
        # A Chunk's job: the places in its chunk of the inputs it runs (`places`, ascending); the input at place
        # p travels as job id `base + p` (the job's own `id` never travels). `pending`: its places whose
        # outcomes have not come back (a worker answers a chunk in parts). None for a job of one input.
        self.base, self.places, self.pending = 0, None, None
        # ... and (inputs, typical seconds) of its part with the most inputs so far: the chunk's pace, measured
        # when it is over (core_chunks), so a straggler answered alone in the last part does not count as it.
        self.pace = (0, 0.0)
        self.asked_back = False  # its worker was asked to give back what it has not begun, and has not answered

    def chunk_ids(self) -> list:
        """The job ids of the inputs it still owes, as they travel (a Chunk's job)."""
        base = self.base
        return [base + p for p in sorted(self.pending)]

    def drop_place(self, place: int) -> None:
        """A chunk's job no longer runs the input at `place` (its time ran out), wherever it is sent from now on
        (a job with no place left is stale: dropped)."""
        at = self.places.index(place)
        if self.packed is None:  # (its inputs not encoded yet: `value` is in the order of `places`)
            self.value = self.value[:at] + self.value[at + 1:]
        self.places = self.places[:at] + self.places[at + 1:]  # (a new list: a packed payload's stays as it is)
        self.pending.discard(place)


class SendCount:
    """One send of a batching node alone's inputs to a worker (a bundle, or one job): how many of its jobs are
    still out there. When none is, the worker has one send fewer out (Dispatch.give_back)."""

    __slots__ = ("slot", "piece_id", "left")

    def __init__(self, slot: int, piece_id: int, left: int):
        self.slot, self.piece_id, self.left = slot, piece_id, left


MAX_CHUNK = 4096  # inputs in one chunk at most (chunks.size: why so many)
CHUNK_IDS = 1 << 48  # chunks' job ids: blocks of MAX_CHUNK from here, apart from single jobs' (from 1)


def chunk_base(job_id: int) -> int | None:
    """The `base` of the chunk a job id travelling from a worker is of, or None for a single job's id."""
    if job_id < CHUNK_IDS:
        return None
    return job_id - (job_id - CHUNK_IDS) % MAX_CHUNK


class Walker:
    """Turns a program and an input into jobs, and carries outputs on through `Seq`s and `Wave`s.

    Pure: a job carries its input as a value (`Job.value`) until it is sent; the loop encodes it then
    (sending.py), once per value for a wave's pieces (`Job.twins`), a batching node's together in a Bundle.
    """

    def __init__(self):
        self.job_ids = itertools.count(1)
        self.chunk_bases = itertools.count(CHUNK_IDS, MAX_CHUNK)  # a block of job ids for each chunk
        self._starters: dict = {}  # program → its starter

    def start_chunk(self, chunk: Chunk) -> Job:
        """The job that runs every input of `chunk` (its program is one piece)."""
        if chunk.count > MAX_CHUNK:  # (its ids would be the next chunk's: chunks.size never makes one)
            raise ValueError(f"a chunk of {chunk.count} inputs: {MAX_CHUNK} at most (a bug in soma: please report it)")
        job = Job(next(self.job_ids), chunk, chunk.program, None, chunk.x, {})
        chunk.x = None  # (the job holds the inputs until they are encoded)
        job.base = next(self.chunk_bases)
        job.places = list(range(chunk.count))
        job.pending = Places(chunk.count)
        return job

    def rest_of(self, job: Job, places: list) -> Job:
        """A job for these places of `job`'s chunk (which it ran, or was to run), to go elsewhere: the same
        encoded payload travels, the worker runs only the places named, under ids of a block of its own."""
        rest = Job(next(self.job_ids), job.flow, job.piece, None, job.value, {})
        rest.base, rest.places, rest.pending = next(self.chunk_bases), places, Places(job.flow.count, places)
        rest.packed, rest.keep, rest.shared = job.packed, job.keep, job.shared
        return rest

    def start(self, flow: Flow, x) -> list:
        """The first jobs of a try of `flow` on input `x`."""
        program = flow.program
        starter = self._starters.get(program)
        if starter is None:
            starter = self._starters[program] = fold(program, self._piece, _seq, _wave)
        return starter(x, flow, flow, {})

    def _piece(self, piece: Piece):
        def start_piece(x, flow: Flow, then, twins: dict) -> list:
            return [Job(next(self.job_ids), flow, piece, then, x, twins)]
        return start_piece


def _seq(_, items: list):
    """A sequence: the first item now; each next one on the previous one's output, when it comes."""
    def start_seq(x, flow: Flow, then, twins: dict) -> list:
        return items[0](x, flow, _Next(items, 0, flow, then), twins)
    return start_seq


class _Next:
    """A sequence's continuation after item `i`: start item i + 1 on its output (or end the sequence).

    Continuations are small objects, not closures that name themselves: a closure that refers to
    itself is a reference cycle, and a cycle frees the values it holds (outputs mapped from shared
    memory) only when the garbage collector runs, not when the last job lets go of them.
    """

    __slots__ = ("items", "i", "flow", "then")

    def __init__(self, items: list, i: int, flow: Flow, then):
        self.items, self.i, self.flow, self.then = items, i, flow, then

    def __call__(self, ok, value) -> list | tuple:
        items, i = self.items, self.i
        if not ok or i + 1 == len(items):
            return self.then(ok, value)
        return items[i + 1](value, self.flow, _Next(items, i + 1, self.flow, self.then), {})


def _wave(_, branches: list):
    """A wave: every branch now, on the same input; the join once every branch is back."""
    def start_wave(x, flow: Flow, then, twins: dict) -> list:
        join = _Join(len(branches), then)
        return [job for i, branch in enumerate(branches) for job in branch(x, flow, _Branch(join, i), twins)]
    return start_wave


class _Join:
    """A wave's outputs as they come back; the wave's outcome once every branch is over."""

    __slots__ = ("results", "left", "then")

    def __init__(self, n: int, then):
        self.results: list = [None] * n
        self.left = n
        self.then = then

    def branch_over(self, i: int, ok, value) -> list | tuple:
        self.results[i] = (ok, value)
        self.left -= 1
        if self.left:
            return []
        results, self.results = self.results, None  # (nothing of the wave stays held by the join)
        return self.then(*wave_outcome(results))


class _Branch:
    """The continuation of branch `i` of a wave."""

    __slots__ = ("join", "i")

    def __init__(self, join: _Join, i: int):
        self.join, self.i = join, i

    def __call__(self, ok, value) -> list | tuple:
        return self.join.branch_over(self.i, ok, value)


def stale(job: Job) -> bool:
    """Whether `job` is of no use any more: its flow is over, it belongs to an earlier try, or it is a chunk's
    job left with no input to run (Job.drop_place)."""
    return job.flow.finished or job.try_ != job.flow.tries or job.places == []
