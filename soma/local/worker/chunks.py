"""A chunk in this worker: consecutive inputs of one piece (not a batching node alone) that travel as one entry,
run one by one and answered in parts (the messages are soma.wire.protocol's `Chunk` and `ChunkPart`).

    accept ── Chunk ──▶ ChunkRun, waiting in its piece's lane like a job (lanes.py)
    its lane's turn: run_chunk ── its inputs decoded at once (one list), then each in order, on this thread:
                     │           a GIL-bound piece's input waits its turn (turns.py), Interpreter.run,
                     │           its own ok/error, seconds and spans
                     │  before an input starts: what is done goes in a part when the first of it is PART_S old
                     ▼
                   the last part, for run_lane to send with the lane's other outcomes
    the receiving thread, every PART_S while chunks are here: send_due, when an input runs long
    Cancel ───▶ answer_now: the named inputs that have not started are answered Cancelled at once, in a part
    GiveBack ─▶             with what is done so far; given back: dropped, and named in the Result's `returned`

Every input of a chunk is answered exactly once: in a part, or given back. An
input whose id is 0 is not wanted and is skipped. A part's outputs that ran ok
are encoded as one list (values.encode_listed, as a Bundle's are).
"""

from __future__ import annotations

import threading
import time

from ...errors import Cancelled, NodeError
from ...run.interpreter import RunState, span
from ...wire import failures
from ...wire.protocol import ChunkPart
from .turns import MIN_S
from .values import decode_input, encode_listed

PART_S = 0.02  # what is done waits at most this long (and one input) before it goes, while the chunk runs


class ChunkRun:
    """A Chunk in this worker: which of its inputs started, which were answered out of turn, what is done and
    not sent. `lock` guards all of it; `sending` keeps its parts in order (its lane's thread and the receiving
    thread both send them)."""

    __slots__ = ("chunk", "piece", "lock", "sending", "next", "running", "skip", "done", "part_since")

    def __init__(self, chunk):
        self.chunk = chunk
        self.piece = chunk.piece
        self.lock = threading.Lock()
        self.sending = threading.Lock()
        self.next = 0  # the position of the next input to start
        self.running = False  # one of its inputs is running now
        self.skip: set = set()  # ids answered out of turn (Cancelled, given back): they never start
        self.done: list = []  # (job id, ok, output or error body, spans, seconds): done, not sent yet
        self.part_since = 0.0  # when the first of `done` was done

    def named(self, wanted: set) -> bool:
        return not wanted.isdisjoint(self.chunk.ids)

    def unstarted(self, wanted: set) -> list:
        """The ids among `wanted` that have not started and were not answered (lock held)."""
        return [i for i in self.chunk.ids[self.next:] if i and i in wanted and i not in self.skip]

    def take(self) -> tuple:
        """`(what is done, whether an input is still to be answered after it)`, for a part (lock held)."""
        done, self.done = self.done, []
        return done, self.running or any(i and i not in self.skip for i in self.chunk.ids[self.next:])


def run_chunk(runner, run: ChunkRun, lane, turns, send) -> ChunkPart | None:
    """Run the chunk's inputs in order on this thread (`runner`: running.JobRunner; `lane`: its piece's, whose
    pace each input updates); `send(part)` sends a part while the chunk runs. Returns the last part, or None
    when nothing was left to answer."""
    chunk, piece_id = run.chunk, run.piece
    ids, traced = chunk.ids, chunk.traced
    with run.lock:
        if not any(i and i not in run.skip for i in ids):
            return None  # every input was answered out of turn (cancelled, given back) before it started
    piece, failure, loaded = _loaded(runner, run)
    xs = None
    if failure is None:
        try:
            xs = decode_input(chunk.payload, piece.entry, runner.id, runner.get_store)
            if type(xs) is not list or len(xs) != len(ids):
                raise NodeError.failed(piece.entry, f"its input could not be received in worker {runner.id}: a "
                                                    f"chunk of {len(ids)} inputs decoded to something else (a bug "
                                                    f"in soma: please report it)")
        except NodeError as err:
            failure = err
    producer = piece.producer if piece is not None else "?"
    # A one-node piece's inputs call its node directly, named on the status page by one store each (an input
    # traced, or on a CUDA device, runs as a job does: Interpreter.run with its RunState).
    call = piece.each if failure is None and not runner.cuda else None
    name = runner.status.naming(piece.entry) if call is not None else None
    lock, skip, clock = run.lock, run.skip, time.perf_counter
    done = None  # the input just done: (job id, ok, output or error body, spans, seconds)
    try:
        for position, job_id in enumerate(ids):
            with lock:  # (one holding per input: the last one's answer in, this one's start out)
                start = clock()
                if done is not None:
                    if not run.done:
                        run.part_since = start
                    run.done.append(done)
                    done = None
                run.next = position + 1
                if not job_id or job_id in skip:
                    run.running = False
                    continue
                run.running = True
                due = run.done and start - run.part_since >= PART_S
            if due:
                _send_part(runner, run, producer, send)
                start = clock()
            spans = None
            if failure is not None or runner.over_memory:  # (over max_memory: what has not started runs elsewhere)
                ok, value = False, failures.error_body(failure if failure is not None else Cancelled())
            else:
                if traced and traced[position]:
                    spans, loaded = loaded or [], None  # (the piece's load: a span of its first traced input)
                pace = lane.pace
                token = turns.enter(piece_id, pace) if pace is None or pace >= MIN_S else None
                if call is not None and spans is None:
                    name(job_id)
                    ok, value = _called(runner, piece, call, xs[position])
                else:
                    ok, value = _run_input(runner, piece, job_id, xs[position], spans,
                                           traced[position][0] if spans is not None else None)
                    name = runner.status.naming(piece.entry) if call is not None else None  # (it named nodes)
                if token is not None:
                    turns.leave(piece_id, token)
                xs[position] = None  # (its input goes as soon as it is done with)
            seconds = clock() - start
            lane.pace = seconds
            done = (job_id, ok, value, spans, seconds)
    finally:
        runner.status.leave()
        with run.lock:
            if done is not None:
                run.done.append(done)
            run.running = False
            run.next = len(ids)
    with run.sending:
        with run.lock:
            done, more = run.take()
        return _part(runner, done, more, producer) if done else None


def answer_now(runner, run: ChunkRun, wanted: set, give_back: bool, parts: list) -> list:
    """The host cancelled (`give_back` False) or wants back the ids `wanted`: those of this chunk that have not
    started are answered Cancelled, or given back (dropped here), now; the part that answers them, with the
    outputs done so far, is appended to `parts`. Returns the ids given back."""
    with run.sending:
        with run.lock:
            named = run.unstarted(wanted)
            run.skip.update(named)
            done, more = run.take()
        if not give_back:
            body = failures.error_body(Cancelled())
            done += [(job_id, False, body, None, 0.0) for job_id in named]
        if done:
            parts.append(_part(runner, done, more, _producer(runner, run)))
    return named if give_back else []


def send_due(runner, run: ChunkRun, send) -> None:
    """While one of its inputs runs long, send what is done once the first of it is PART_S old (the receiving
    thread looks: the lane's thread is busy with that input)."""
    if run.done and run.running and time.perf_counter() - run.part_since >= PART_S:
        _send_part(runner, run, _producer(runner, run), send)


def _producer(runner, run: ChunkRun) -> str:
    piece = runner.library.pieces.get(run.piece)
    return piece.producer if piece is not None else "?"


def _loaded(runner, run: ChunkRun) -> tuple:
    """`(the piece, None, its load span or None)`, loaded here if it was not; `(None, the NodeError, None)`
    when it cannot be (each input of the chunk gets that error)."""
    library = runner.library
    piece = library.pieces.get(run.piece)
    if piece is not None:
        return piece, None, None
    entry, loading = "?", time.monotonic_ns()
    try:
        plan, steps, entry, producer = library.describe(run.piece)
        runner.status.enter(next(i for i in run.chunk.ids if i), entry)
        runner.devices.on_thread()  # (a node's code may touch CUDA as it loads)
        piece = library.load(run.piece, plan, steps, entry, producer)
        return piece, None, [span(entry, loading, "ok", "load")]
    except NodeError as err:
        return None, err, None
    except BaseException as err:  # never lose an input: the host is waiting for it
        return None, runner.could_not_run(entry, err), None


def _run_input(runner, piece, job_id: int, x, spans, index) -> tuple:
    """`(ok, its output or its error body)` of one input: the piece run on it (the status page names the job
    with each node it enters: RunState tells it)."""
    if runner.cuda:
        runner.devices.on_thread()  # a cuda:N worker's current device is per thread: this one's too
    return _called(runner, piece, piece.interpreter.run, piece.plan, x, RunState(runner.observer, job_id, index),
                   spans)


def _called(runner, piece, call, *args) -> tuple:
    """`(ok, call(*args) or its error body)`: an input run (its NodeError, or soma's own failure, named)."""
    try:
        return True, call(*args)
    except NodeError as err:
        return False, failures.error_body(err)
    except BaseException as err:  # never lose an input: the host is waiting for it
        return False, failures.error_body(runner.could_not_run(piece.producer, err))
    finally:
        if runner.max_memory:
            runner.check_memory()


def _send_part(runner, run: ChunkRun, producer: str, send) -> None:
    with run.sending:
        with run.lock:
            done, more = run.take()
        if done:
            send(_part(runner, done, more, producer))


def _part(runner, done: list, more: bool, producer: str) -> ChunkPart:
    """One part of a chunk's answer from `done` ((job id, ok, output or error body, spans, seconds) each): the
    outputs of those that ran ok encoded as one list (each alone when the list cannot be), each input's own
    answer, spans and seconds (each output's share of the encoding added to its input's)."""
    ids, oks, said, spans, seconds = (list(column) for column in zip(*done))  # (said: an error body where
    # not ok; outputs replaced below)
    every = False not in oks  # (the common case: no pass in Python to pick the outputs)
    at = range(len(done)) if every else [k for k, ok in enumerate(oks) if ok]
    body = None
    if at:
        start = time.perf_counter()
        body, listed = encode_listed(said if every else [said[k] for k in at], producer, runner.get_store)
        share = (time.perf_counter() - start) / len(at)
        if every:
            said, seconds = listed, [s + share for s in seconds]
        else:
            for k, answer in zip(at, listed):
                said[k] = answer
                seconds[k] += share
    return ChunkPart(ids, said, body, None if spans.count(None) == len(spans) else spans, seconds, more)
