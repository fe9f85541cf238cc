"""An input's way through a program: the `Flow`, its `Job`s, and the walk that makes them.

    walk(program, x) ─ Piece ─ Job(piece, x encoded)             → queued by the scheduler
                     ├ Seq   ─ the first item now; each next one when the previous job's outcome arrives
                     └ Wave  ─ every branch now, on the same x (encoded once); the join when all are back:
                               the tuple, or the first failure in branch order with the others as notes

Continuations (`then(ok, value)`) carry outcomes on: the scheduler calls a job's
`then` when its outcome arrives, and the last one ends the flow.
"""

from __future__ import annotations

import itertools
import time

from ...errors import NodeError, SharedMemoryFull
from ...plan import Seq, Wave
from ...run.interpreter import wave_outcome
from ...wire import codec
from .program import Piece


class Flow:
    """One input on its way through a program."""

    __slots__ = ("index", "sink", "trace", "finished", "jobs", "started_ns", "end")

    def __init__(self, index, sink, trace, end):
        self.index = index
        self.sink = sink  # receives (index, ok, value) once
        self.trace = trace  # the runner's Trace when this input is traced, else None
        self.finished = False
        self.jobs: set = set()  # its jobs queued or outstanding
        self.started_ns = time.monotonic_ns() if trace is not None else 0
        self.end = end  # end(flow, ok, value): what ends it (the scheduler's)

    def __call__(self, ok, value) -> None:
        """The flow as the last continuation of its program's walk."""
        self.end(self, ok, value)


class Job:
    """One input for one piece: queued here, then outstanding at a worker."""

    __slots__ = ("id", "flow", "piece", "payload", "shared", "keep", "then", "slot", "sent_at", "sent_ns", "behind",
                 "traced")

    def __init__(self, job_id: int, flow: Flow, piece: Piece, encoded, then):
        self.id = job_id
        self.flow = flow
        self.piece = piece
        # `keep` holds the encoder until the send is counted: the shared-memory copies it made must
        # not look idle to their owner in between (it would reuse them under the worker).
        self.payload, self.shared, self.keep = encoded
        self.then = then  # called with (ok, value) when the job is over
        self.slot = None
        self.sent_at = 0.0
        self.behind = 0  # jobs already at its worker when it was sent (its wait there, unseen)
        self.sent_ns = 0  # when traced
        self.traced = flow.trace is not None


class Walker:
    """Turns a program and an input into jobs, and carries outputs on through `Seq`s and `Wave`s.

    `get_store` gives the host's shared-memory store (inputs are encoded here);
    `enqueue(jobs)` hands jobs made later, from an outcome, to the scheduler (its lock held).
    """

    def __init__(self, get_store, enqueue):
        self.get_store = get_store
        self.enqueue = enqueue
        self.job_ids = itertools.count(1)

    def walk(self, part, x, flow: Flow, then, jobs: list, encoded: dict) -> None:
        """Start `part` of a program on `x`; `then(ok, value)` hears its end. New jobs go to `jobs`."""
        if type(part) is Piece:
            jobs.append(Job(next(self.job_ids), flow, part, self.encode(x, part, flow, encoded), then))
        elif type(part) is Seq:
            self._walk_seq(part.items, 0, x, flow, then, jobs, encoded)
        else:
            self._walk_wave(part, x, flow, then, jobs, encoded)

    def _walk_seq(self, items, i: int, x, flow: Flow, then, jobs: list, encoded: dict) -> None:
        def after(ok, value):
            if not ok or i + 1 == len(items):
                then(ok, value)
            else:
                self._walk_later(lambda more: self._walk_seq(items, i + 1, value, flow, then, more, {}), then)

        self.walk(items[i], x, flow, after, jobs, encoded)

    def _walk_wave(self, wave: Wave, x, flow: Flow, then, jobs: list, encoded: dict) -> None:
        """Every branch on the same input; the output is the tuple, or the first failure in branch order."""
        results: list = [None] * len(wave.branches)
        left = [len(wave.branches)]

        def collect(i):
            def got(ok, value):
                results[i] = (ok, value)
                left[0] -= 1
                if not left[0]:
                    then(*wave_outcome(results))
            return got

        for i, branch in enumerate(wave.branches):
            self.walk(branch, x, flow, collect(i), jobs, encoded)

    def _walk_later(self, walk, then) -> None:
        """Walk on from an outcome (listener thread, lock held): queue what it makes, or end the flow."""
        jobs: list = []
        try:
            walk(jobs)
        except NodeError as err:
            then(False, err)
            return
        self.enqueue(jobs)

    def encode(self, x, piece: Piece, flow: Flow, encoded: dict):
        """`(payload, shared segment names, what keeps copies alive)`; once per value for a wave's pieces."""
        found = encoded.get(id(x))
        if found is not None:
            return found
        encoder = codec.Encoder(self.get_store)
        entry = piece.entry
        step = flow.trace.host_step("encode input", node=entry, input=flow.index) if flow.trace else None
        try:
            if step is not None:
                with step as args:
                    payload = encoder.pack(x)
                    args.update(bytes=len(payload), shm_copies=encoder.copied)
            else:
                payload = encoder.pack(x)
        except codec.GradCrossing as err:
            raise NodeError.failed(entry, err.reason("its input is")) from None
        except codec.Unsendable as err:
            raise NodeError.failed(entry, f"its input cannot be sent to a worker: {err}") from None
        except SharedMemoryFull as err:
            raise SharedMemoryFull.reserving(entry, err.nbytes, "its input") from None
        except OSError as err:  # a segment that could not be made or mapped (too many open files, ...)
            raise NodeError.failed(entry, f"its input could not be put in shared memory: {type(err).__name__}: "
                                          f"{err}") from err
        found = encoded[id(x)] = (payload, encoder.shared, encoder)
        return found
