"""An input's way through a program: the `Flow`, its `Job`s, and the walk that makes them.

    start(program, x) ─ Piece ─ Job(piece, x encoded)             → handed to the scheduler to queue
                      ├ Seq   ─ the first item now; each next one when the previous job's outcome arrives
                      └ Wave  ─ every branch now, on the same x (encoded once); the join when all are back:
                                the tuple, or the first failure in branch order with the others as notes

A program is compiled once into a starter (a fold over its tree). Continuations
(`then(ok, value)`) carry outcomes on: the scheduler calls a job's `then` when its
outcome arrives and gets back the jobs that outcome makes (the next piece, none
while a wave waits for its other branches). The last continuation is the flow
itself: it records the input's outcome, which the scheduler then delivers. Nothing
here calls the scheduler; answers come back as return values.
"""

from __future__ import annotations

import itertools
import time

from ...errors import NodeError, SharedMemoryFull
from ...plan import fold
from ...run.interpreter import wave_outcome
from ...wire import codec
from .program import Piece


class Flow:
    """One input on its way through a program.

    A try is one walk of the program from its start. `retries`: how many more tries the input
    gets when a worker dies while running it (the input `x` is kept for them); `tries`: how many
    have been made (the current one included). Jobs remember their try: those of an earlier try
    are stale, and their outcomes are dropped.
    """

    __slots__ = ("index", "sink", "trace", "finished", "jobs", "started_ns", "outcome", "program", "x", "retries",
                 "tries", "graph")

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
        self.outcome = None  # (ok, value) once its walk has ended, until the scheduler delivers it
        self.program = program
        self.x = x if retries else None  # (kept only for a try to come)
        self.retries = retries
        self.tries = 1

    def __call__(self, ok, value) -> list:
        """The flow as the last continuation of its program's walk: the input's outcome is known."""
        self.outcome = (ok, value)
        return []


class Job:
    """One input for one piece: queued, then outstanding at a worker.

    A job of a bundled piece (`piece.bundle`, a batching node alone) is not encoded when it is made:
    it keeps its input (`value`) until it is sent, when the jobs going to one worker are encoded
    together into a `Bundle` (`Walker.bundle`); from then on it is `position` in that bundle.
    """

    __slots__ = ("id", "flow", "try_", "piece", "payload", "shared", "keep", "then", "slot", "sent_at", "sent_ns",
                 "behind", "traced", "value", "bundle", "position", "send")

    def __init__(self, job_id: int, flow: Flow, piece: Piece, encoded, then, value=None):
        self.id = job_id
        self.flow = flow
        self.try_ = flow.tries  # the try of its flow it belongs to
        self.piece = piece
        # `keep` holds the encoder as long as the job lives: every tensor its handles name stays held by
        # the host until the job is over, so a segment cannot be reused under the worker (before the send
        # is counted), and a job its worker never started can be sent again, as it is, to another.
        self.payload, self.shared, self.keep = encoded
        self.then = then  # then(ok, value) → the jobs it makes, when the job is over
        self.slot = None
        self.sent_at = 0.0
        self.behind = 0  # jobs already at its worker when it was sent (its wait there, unseen)
        self.sent_ns = 0  # when traced
        self.traced = flow.trace is not None
        self.value = value  # a bundled piece's input, until it is encoded in a bundle
        self.bundle = None  # that Bundle, once it is
        self.position = 0  # its input's place in the bundle's payload
        self.send = None  # the Send it went out in, while it is out (a batching node alone's: Scheduler)

    def wire(self) -> tuple:
        """The JobSpec's fields (protocol.JobSpec), as the pool packs them."""
        return self.id, self.piece.id, self.payload, [self.flow.index] if self.traced else False


class Bundle:
    """Inputs of a bundled piece encoded together: one payload (a list), the segments it lends, and the
    encoder that keeps what its handles name alive (every job of the bundle holds it: see Job.keep)."""

    __slots__ = ("piece", "payload", "shared", "keep", "size")

    def __init__(self, piece: Piece, payload: bytes, encoder, size: int):
        self.piece, self.payload, self.shared, self.keep, self.size = piece, payload, encoder.shared, encoder, size


class Send:
    """One send of a batching node alone's inputs to a worker (a bundle, or one job): how many of its jobs are
    still out there. When none is, the worker has one send fewer out (WorkerChoice.send_over)."""

    __slots__ = ("slot", "piece_id", "left")

    def __init__(self, slot: int, piece_id: int, left: int):
        self.slot, self.piece_id, self.left = slot, piece_id, left


class BundleSend:
    """What one send of a bundle carries: its payload, and the ids of the jobs of it that run now (0 for an
    input whose job is elsewhere or over: a bundle sent again after its worker left carries its whole
    payload, and the worker runs only the inputs named)."""

    __slots__ = ("bundle", "ids", "piece", "shared", "jobs")

    def __init__(self, bundle: Bundle, jobs: list):
        self.bundle, self.piece, self.shared, self.jobs = bundle, bundle.piece, bundle.shared, jobs
        self.ids = [0] * bundle.size
        for job in jobs:
            self.ids[job.position] = job.id

    def wire(self) -> tuple:
        """The Bundle's fields (protocol.Bundle), as the pool packs them."""
        return self.ids, self.piece.id, self.bundle.payload


class Walker:
    """Turns a program and an input into jobs, and carries outputs on through `Seq`s and `Wave`s.

    `get_store` gives the host's shared-memory store (inputs are encoded here).
    """

    def __init__(self, get_store):
        self.get_store = get_store
        self.job_ids = itertools.count(1)
        self._starters: dict = {}  # program → its starter

    def start(self, flow: Flow, x) -> list:
        """The first jobs of a try of `flow` on input `x` (a NodeError when `x` cannot be sent)."""
        program = flow.program
        starter = self._starters.get(program)
        if starter is None:
            starter = self._starters[program] = fold(program, self._piece, _seq, _wave)
        return starter(x, flow, flow, {})

    @staticmethod
    def stale(job: Job) -> bool:
        """Whether `job` is of no use any more: its flow is over, or it belongs to an earlier try."""
        return job.flow.finished or job.try_ != job.flow.tries

    def _piece(self, piece: Piece):
        def start_piece(x, flow: Flow, then, encoded: dict) -> list:
            if piece.bundle and flow.trace is None:  # encoded with the others that go where it goes (bundle)
                return [Job(next(self.job_ids), flow, piece, _UNENCODED, then, x)]
            return [Job(next(self.job_ids), flow, piece, self.encode(x, piece, flow, encoded), then)]
        return start_piece

    def encode(self, x, piece: Piece, flow: Flow, encoded: dict):
        """`(payload, shared segment names, what keeps copies alive)`; once per value for a wave's pieces."""
        found = encoded.get(id(x))
        if found is not None:
            return found
        encoder = codec.Encoder(self.get_store)
        step = flow.trace.host_step("encode input", node=piece.entry, input=flow.index) if flow.trace else None
        if step is not None:
            with step as args:
                payload = _packed(encoder.pack, x, piece.entry)
                args.update(bytes=len(payload), shm_copies=encoder.copied)
        else:
            payload = _packed(encoder.pack, x, piece.entry)
        found = encoded[id(x)] = (payload, encoder.shared, encoder)
        return found

    def bundle(self, piece: Piece, jobs: list) -> tuple[list, list]:
        """Encode the inputs of `jobs` (of one bundled piece, going to one worker) together: `(the jobs now
        in a bundle, [(job, the NodeError its input raised)])`. One encoder pass for all; when that fails,
        each input goes in a bundle of its own, so a bad input fails by itself and the others still go."""
        try:
            return self._bundled(piece, jobs), []
        except NodeError:
            pass
        bundled, failed = [], []
        for job in jobs:
            try:
                bundled += self._bundled(piece, [job])
            except NodeError as err:
                failed.append((job, err))
        return bundled, failed

    def _bundled(self, piece: Piece, jobs: list) -> list:
        encoder = codec.Encoder(self.get_store)
        payload = _packed(encoder.pack_each, [job.value for job in jobs], piece.entry)
        bundle = Bundle(piece, payload, encoder, len(jobs))
        for position, job in enumerate(jobs):
            job.bundle, job.position, job.keep, job.value = bundle, position, encoder, None
        return jobs


_UNENCODED = (None, (), None)  # a bundled piece's job before its bundle: no payload, no segments, nothing kept


def _packed(pack, x, entry: str) -> bytes:
    """`pack(x)` (an encoder's); what stops it is a NodeError of node `entry` that says why."""
    try:
        return pack(x)
    except codec.GradCrossing as err:
        raise NodeError.failed(entry, err.reason("its input is")) from None
    except codec.Unsendable as err:
        raise NodeError.failed(entry, f"its input cannot be sent to a worker: {err}") from None
    except SharedMemoryFull as err:
        raise SharedMemoryFull.reserving(entry, err.nbytes, "its input") from None
    except OSError as err:  # a segment that could not be made or mapped (too many open files, ...)
        raise NodeError.failed(entry, f"its input could not be put in shared memory: {type(err).__name__}: "
                                      f"{err}") from err


def _seq(_, items: list):
    """A sequence: the first item now; each next one on the previous one's output, when it comes."""
    def start_seq(x, flow: Flow, then, encoded: dict) -> list:
        return items[0](x, flow, _Next(items, 0, flow, then), encoded)
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

    def __call__(self, ok, value) -> list:
        items, i = self.items, self.i
        if not ok or i + 1 == len(items):
            return self.then(ok, value)
        try:
            return items[i + 1](value, self.flow, _Next(items, i + 1, self.flow, self.then), {})
        except NodeError as err:  # the next piece's input cannot be sent: the input fails there
            return self.then(False, err)


def _wave(_, branches: list):
    """A wave: every branch now, on the same input; the join once every branch is back."""
    def start_wave(x, flow: Flow, then, encoded: dict) -> list:
        join = _Join(len(branches), then)
        return [job for i, branch in enumerate(branches) for job in branch(x, flow, _Branch(join, i), encoded)]
    return start_wave


class _Join:
    """A wave's outputs as they come back; the wave's outcome once every branch is over."""

    __slots__ = ("results", "left", "then")

    def __init__(self, n: int, then):
        self.results: list = [None] * n
        self.left = n
        self.then = then

    def branch_over(self, i: int, ok, value) -> list:
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

    def __call__(self, ok, value) -> list:
        return self.join.branch_over(self.i, ok, value)
