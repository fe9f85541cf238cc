"""A chunk in this worker: consecutive inputs of one piece (not a batching node alone) that travel as one entry,
run one by one and answered in parts (the messages are soma.wire.protocol's `Chunk` and `ChunkPart`).

    accept ── Chunk ──▶ ChunkRun, waiting in its piece's lane like a job (lanes.py)
    its lane's turn: run_chunk ── its piece loaded and set up, its inputs decoded at once (one list), then
                     │           each in order, on this thread:
                     │           claimed (ChunkRun.waiting), a GIL-bound piece's input after its turn
                     │           (turns.py), its node called directly or Interpreter.run, its own
                     │           ok/error, seconds and spans
                     │  before an input starts: what is done goes in a part when the first of it is PART_S old
                     ▼
                   the last part, for run_lane to send with the lane's other outcomes
    the receiving thread, every PART_S while chunks are here: send_due, when an input runs long
    Cancel ───▶ answer_now: the named inputs that have not started are answered Cancelled at once, in a part
    GiveBack ─▶             with what is done so far; given back: dropped, and named in the Result's `returned`

Every input of a chunk is answered exactly once: in a part, or given back. An
input whose id is 0 is not wanted and is skipped. A part's outputs that ran ok
are encoded as one list (values.encode_listed, as a Bundle's are).

Why no lock per input: the loop over a chunk's inputs is all a tiny input costs
beside its node (issue 31 measures 20,000 of them against a process pool), and a
lock round was a tenth of it. An input is claimed instead by taking its id out of
`ChunkRun.waiting` (dict.pop: one C call, atomic under the GIL and in free-threaded
builds alike): the lane's thread pops it to start it, answer_now to answer it out
of turn, and only one of them gets it. What is done is appended by the lane's thread
alone and taken from the front (a copy, then a `del` of that many: what is appended
meanwhile stays), parts in order under `sending`.
"""

from __future__ import annotations

import threading
import time

from ...errors import Cancelled, NodeError
from ...run.interpreter import RunState, span
from ...wire import failures
from ...wire.protocol import ChunkPart
from .turns import MIN_S
from .values import decode_input, encode_listed, let_go

PART_S = 0.04  # what is done waits at most this long (and one input) before it goes, while the chunk runs
#               (above host/chunks.CHUNK_S: a chunk that takes what it should answers in one message)
FIELDS = 5  # an input done is this many items of ChunkRun.done: job id, ok, output or error body, spans, seconds
GROUP_S = 20e-6  # quick inputs read the clock once per group of about this long (`_quick`),
MAX_GROUP = 32  # and of at most this many inputs
QUICK_RUN = 64  # quick inputs run in stretches of at most this many (`_quick`): a part is looked at between them


class ChunkRun:
    """A Chunk in this worker: which of its inputs have neither started nor been answered, what is done and not
    sent (see the module's docstring for who touches what). `sending` keeps its parts in order (its lane's
    thread and the receiving thread both send them) and guards `left`."""

    __slots__ = ("chunk", "piece", "ids", "sending", "waiting", "left", "done", "part_since")

    def __init__(self, chunk):
        self.chunk = chunk
        self.piece = chunk.piece
        # Its ids as a list (they travel as a range when consecutive): the id objects the loop reads are the keys
        # of `waiting`, so claiming one finds it by identity (a range makes a new int at each read: +20 % an input)
        self.ids = list(chunk.ids)
        self.sending = threading.Lock()
        self.waiting = dict.fromkeys(self.ids, True)  # ids neither started nor answered (pop one: claimed)
        self.waiting.pop(0, None)  # (not wanted: never run, never answered)
        self.left = len(self.waiting)  # inputs not yet answered in a part nor given back
        self.done: list = []  # the inputs done and not sent, FIELDS items each, flat (a part slices its columns
        # out at C speed, where unzipping tuples cost as much again as building them)
        self.part_since = 0.0  # when the first of `done` was done

    def named(self, wanted: set) -> bool:
        return not wanted.isdisjoint(self.ids)

    def claim_unstarted(self, wanted: set) -> list:
        """The ids among `wanted` that have not started, in the chunk's order: taken, they never will."""
        waiting = self.waiting
        return [i for i in self.ids if i in wanted and waiting.pop(i, False)]

    def take(self, answered: int = 0) -> tuple:
        """`(what is done, whether an input is still to be answered after it)`, for a part that also answers or
        gives back `answered` claimed ids (`sending` held)."""
        done = self.done[:]
        del self.done[:len(done)]  # (not a new list: the lane's thread may be appending to this one)
        self.left -= len(done) // FIELDS + answered
        return done, self.left > 0


def run_chunk(runner, run: ChunkRun, lane, turns, send) -> ChunkPart | None:
    """Run the chunk's inputs in order on this thread (`runner`: running.JobRunner; `lane`: its piece's, whose
    pace each input updates); `send(part)` sends a part while the chunk runs. Returns the last part, or None
    when nothing was left to answer."""
    if not run.waiting:  # every input was answered out of turn (cancelled, given back) before it started
        let_go(run.chunk.payload, runner.get_store)
        return None
    way = _Way(runner, run, turns)
    xs = way.inputs()
    # What is the same for every input is bound once, and one clock read ends an input and starts the next.
    # An input is plain when it calls its node directly (way.call: a one-node piece, loaded, not on a CUDA
    # device) untraced and takes no GIL turn (its lane's last input took under turns.MIN_S), the worker not
    # over max_memory; any other goes `way.run_one`. When every input may be plain (`direct`), quick inputs run
    # in stretches (`_quick`: a tight loop; parts looked at between them) and the node's lock is
    # taken once for a run of them (Interpreter.each_held), not once per input: it is let go before a part is
    # sent and before an input that is not quick (a GIL turn must never be waited for holding it), where another
    # thread that runs the same node object can take it (a lock is not fair: as with a round per input, nothing
    # promises that it does before the chunk ends; a chunk is ~25 ms of work).
    ids, claim, done, clock, producer = run.ids, run.waiting.pop, run.done, time.perf_counter, way.producer
    add = done.extend  # (one C call: a taker never sees part of an input)
    call, naming, could_not_run, watch_memory = way.call, way.naming, runner.could_not_run, runner.max_memory
    direct = call is not None and not run.chunk.traced and not watch_memory  # (plain whenever quick)
    lock, holding = None, False
    if direct:
        lock, call = way.piece.each_held
    pace = lane.pace
    quick = pace is not None and pace < MIN_S
    start = clock()
    due = start + PART_S  # (what is done goes in a part then, unless another thread took it: `done` is empty)
    count, position = len(ids), 0
    try:
        while position < count:
            if start >= due and done:
                if holding:
                    lock.release()
                    holding = False
                _send_part(runner, run, producer, send)
                start = clock()
            if quick and direct:  # a stretch of quick inputs (see _quick)
                if not holding:
                    holding = lock.acquire()
                if not done:
                    run.part_since, due = start, start + PART_S
                position, start, pace = _quick(ids, xs, position, min(count, position + QUICK_RUN), start, due, pace,
                                               claim, naming, call, add, clock, could_not_run, producer)
                quick = pace < MIN_S
                continue
            job_id = ids[position]
            if not claim(job_id, False):
                position += 1
                continue  # answered out of turn (Cancelled, given back) before it started, or not wanted (id 0)
            spans = None
            if quick and way.plain(position):  # (not direct: its call takes the node's lock itself)
                naming[0] = job_id  # (the status page: see StatusPage.naming)
                ok, value = _called(runner, way.piece, call, xs[position])
            else:
                if holding:
                    lock.release()
                    holding = False
                ok, value, spans = way.run_one(position, job_id, xs[position], pace)
                naming = way.naming  # (Interpreter.run named its nodes: the direct call names its own again)
            xs[position] = None  # (its input goes as soon as it is done with)
            position += 1
            now = clock()
            pace = now - start
            quick = pace < MIN_S
            if not done:
                run.part_since, due = now, now + PART_S
            add((job_id, ok, value, spans, pace))
            start = now
    finally:
        if holding:
            lock.release()
        runner.status.leave()
        lane.pace = pace
    with run.sending:
        done, more = run.take()
        return _part(runner, done, more, producer) if done else None


class _Way:
    """How a chunk's inputs run on its lane's thread (what is the same for all of them): its piece, loaded
    here if it was not, or the failure that answers each input; the direct call of a one-node piece."""

    def __init__(self, runner, run: ChunkRun, turns):
        self.runner, self.run, self.turns = runner, run, turns
        self.piece, self.failure, self.loaded = _loaded(runner, run)
        self.producer = self.piece.producer if self.piece is not None else "?"
        self.call = self.naming = None

    def inputs(self) -> list:
        """The chunk's inputs, decoded at once (Nones when the piece could not load, or they cannot be
        decoded: `failure` says why); the direct call ready where the piece allows one."""
        piece, ids = self.piece, self.run.chunk.ids
        if self.failure is None:
            self.set_up()
        if self.failure is not None or not self.run.waiting:  # (its piece could not load, or every input was
            let_go(self.run.chunk.payload, self.runner.get_store)  # answered during the setup: never decoded)
            return [None] * len(ids)
        try:
            xs = decode_input(self.run.chunk.payload, piece.entry, self.runner.id, self.runner.get_store)
            if type(xs) is not list or len(xs) != len(ids):
                raise NodeError.failed(piece.entry, f"its input could not be received in worker {self.runner.id}:"
                                                    f" a chunk of {len(ids)} inputs decoded to something else (a "
                                                    f"bug in soma: please report it)")
        except NodeError as err:
            self.failure = err
            return [None] * len(ids)
        # A one-node piece's inputs call its node directly, named on the status page by one store each (an
        # input traced, or on a CUDA device, runs as a job does: Interpreter.run with its RunState).
        if not self.runner.cuda:
            self.call = piece.each  # (made once per piece as it loaded: library.Loaded)
            if self.call is not None:
                self.naming = self.runner.status.naming(piece.entry)
        return xs

    def set_up(self) -> None:
        """The piece's first node set up (`setup`, once per copy) before any input is claimed: an input cancelled
        during a setup (seconds: a model loading) is answered Cancelled by answer_now, unstarted (claimed first,
        its forward ran after the cancel). A setup that fails fails the first input still waiting; the next one
        tries again (as `setup` is tried before each)."""
        runner, run, piece = self.runner, self.run, self.piece
        first = None if piece.interpreter.is_set_up(piece.entry) else next((i for i in run.ids if i in run.waiting),
                                                                             None)
        if first is None:
            return
        runner.status.enter(first, piece.entry)  # (a death during the setup counts a try, as a job's does)
        runner.devices.on_thread()  # (a node's setup may touch CUDA: a cuda:N worker's device is per thread)
        spans, start, failure = [] if run.chunk.traced else None, time.perf_counter(), None
        try:  # (not `_called`: nothing ran that max_memory should be looked at after; once over it, no input runs)
            piece.interpreter.set_up(piece.entry, spans)
        except BaseException as err:  # (soma's own failure too: never lose an input, the host waits for it)
            failure = failures.error_body(err if isinstance(err, NodeError) else runner.could_not_run(piece.entry, err))
        if spans:  # (the first traced input's spans get it, with the load's)
            self.loaded = (self.loaded or []) + spans
        if failure is not None and run.waiting.pop(first, False):  # (else answered out of turn meanwhile)
            now = time.perf_counter()
            run.part_since = run.part_since if run.done else now
            run.done.extend((first, False, failure, None, now - start))  # (one C call, as run_chunk's `add`)

    def plain(self, position: int) -> bool:
        """Whether the input at `position` may call the node directly, its lane's last input having been quick:
        the piece allows it, the input is not traced, the worker is not over max_memory."""
        traced = self.run.chunk.traced
        return self.call is not None and not (traced and traced[position]) and not self.runner.over_memory

    def run_one(self, position: int, job_id: int, x, pace) -> tuple:
        """`(ok, output or error body, spans or None)` of an input that is not plain: the piece's failure, or
        Cancelled over max_memory (what has not started runs elsewhere); else run after its GIL turn (turns.py)
        when its lane's last input took `pace` of MIN_S or more, traced, or through Interpreter.run."""
        runner, piece, traced = self.runner, self.piece, self.run.chunk.traced
        if self.failure is not None or runner.over_memory:
            return False, failures.error_body(self.failure if self.failure is not None else Cancelled()), None
        spans = None
        if traced and traced[position]:
            spans, self.loaded = self.loaded or [], None  # (the piece's load: a span of its first traced input)
        token = self.turns.enter(self.run.piece, pace) if pace is None or pace >= MIN_S else None
        if self.call is not None and spans is None:
            self.naming[0] = job_id
            ok, value = _called(runner, piece, self.call, x)
        else:
            ok, value = _run_input(runner, piece, job_id, x, spans, traced[position][0] if spans is not None else None)
            if self.call is not None:
                self.naming = runner.status.naming(piece.entry)  # (Interpreter.run named it: name it again)
        if token is not None:
            self.turns.leave(self.run.piece, token)
        return ok, value, spans


def answer_now(runner, run: ChunkRun, wanted: set, give_back: bool, parts: list) -> list:
    """The host cancelled (`give_back` False) or wants back the ids `wanted`: those of this chunk that have not
    started are answered Cancelled, or given back (dropped here), now; the part that answers them, with the
    outputs done so far, is appended to `parts`. Returns the ids given back."""
    with run.sending:
        named = run.claim_unstarted(wanted)
        done, more = run.take(len(named))
        if not give_back:
            body = failures.error_body(Cancelled())
            for job_id in named:
                done += (job_id, False, body, None, 0.0)
        if done:
            parts.append(_part(runner, done, more, _producer(runner, run)))
    return named if give_back else []


def send_due(runner, run: ChunkRun, send) -> None:
    """While one of its inputs runs long, send what is done once the first of it is PART_S old (the receiving
    thread looks: the lane's thread is busy with that input; between inputs it sends its own)."""
    if run.done and time.perf_counter() - run.part_since >= PART_S:
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


def _quick(ids: list, xs: list, first: int, end: int, start: float, due: float, pace: float, claim, naming, call,
           add, clock, could_not_run, producer) -> tuple:
    """Inputs `first` to `end` of a chunk while they stay quick, called directly one after another (their
    node's lock held by the caller), each added to what is done as it ends (a give-back finds it there): the
    loop of `run_chunk` without what only a slow input or a part needs (it looks at those between stretches of
    up to QUICK_RUN inputs, and once a part is `due`). `(the next position, when the last input ended, the
    seconds of one)`.

    The clock is read once per group of inputs, as many as take about GROUP_S at the last pace (at most
    MAX_GROUP; a read was a fifth of a tiny input's loop): each input's seconds are the last group's mean (the
    host sizes chunks by their median), and a group that took MIN_S in all ends the stretch as an input that
    took it would (any one of them may have: the next input takes its GIL turn)."""
    group = max(1, min(MAX_GROUP, int(GROUP_S / pace))) if pace > 0 else 1
    ungrouped = group
    for position in range(first, end):
        job_id = ids[position]
        if claim(job_id, False):  # (else answered out of turn: Cancelled, given back; or not wanted: id 0)
            naming[0] = job_id  # (the status page: see StatusPage.naming)
            try:
                value = call(xs[position])
                ok = True
            except NodeError as err:
                ok, value = False, failures.error_body(err)
            except BaseException as err:  # never lose an input: the host is waiting for it
                ok, value = False, failures.error_body(could_not_run(producer, err))
            xs[position] = None  # (its input goes as soon as it is done with)
            add((job_id, ok, value, None, pace))
            ungrouped -= 1
            if not ungrouped:
                now = clock()
                took = now - start
                if took >= MIN_S or now >= due:  # (an input of the group may have taken it all: not quick)
                    return position + 1, now, took  # (a GIL turn for the next input, or a part: run_chunk's loop)
                pace, start, ungrouped = took / group, now, group
    if ungrouped != group:
        now = clock()
        took = now - start
        pace, start = took if took >= MIN_S else took / (group - ungrouped), now
    return end, start, pace


def _send_part(runner, run: ChunkRun, producer: str, send) -> None:
    with run.sending:
        done, more = run.take()
        if done:
            send(_part(runner, done, more, producer))


def _part(runner, done: list, more: bool, producer: str) -> ChunkPart:
    """One part of a chunk's answer from `done` (ChunkRun.done's FIELDS items per input): the outputs of those
    that ran ok encoded as one list (each alone when the list cannot be), each input's own answer (None for
    all when every one is in the list) and spans, and the typical input's seconds with its share of the
    encoding: the median of at most ~32 inputs' seconds, evenly spread (the host sizes chunks by it; sending
    every input's cost as much to pack and parse as its output did, and sorting them all ~3 % of the host)."""
    ids, oks, said, spans, seconds = (done[k::FIELDS] for k in range(FIELDS))  # (said: an error body where
    # not ok; outputs replaced below)
    if ids[-1] - ids[0] == len(ids) - 1:  # consecutive (a part's ids ascend, each once: claimed in the chunk's
        ids = range(ids[0], ids[-1] + 1)  # order, then those answered out of turn): two integers on the wire
    every = False not in oks  # (the common case: no pass in Python to pick the outputs)
    at = range(len(ids)) if every else [k for k, ok in enumerate(oks) if ok]
    body, share = None, 0.0
    if at:
        start = time.perf_counter()
        body, listed = encode_listed(said if every else [said[k] for k in at], producer, runner.get_store)
        share = (time.perf_counter() - start) / len(at)
        if every:
            said = None if body is not None else listed  # (a body: every output is in it, said True)
        else:
            for k, answer in zip(at, listed):
                said[k] = answer
    seconds = sorted(seconds[::len(seconds) // 32 + 1])
    return ChunkPart(ids, said, body, None if spans.count(None) == len(spans) else spans,
                     seconds[len(seconds) // 2] + share, more)
