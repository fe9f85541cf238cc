"""Chunks on the worker's side (issue 31): consecutive inputs of a piece that is not a batching node alone travel
as one `Chunk`, run one by one, and come back in `ChunkPart`s that the host reads as its pool does
(host/outcomes.py's `bundled`), each input with its own outcome. The chunk code runs here on real pieces (real
node code through nodecode, a real Interpreter, a real status page and shared-memory store), and every part
crosses the real codec and protocol."""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import NamedTuple

import pytest

from soma import Done, Node, Opaque
from soma.errors import Cancelled, NodeError, PostconditionError
from soma.local.host.outcomes import bundled
from soma.local.worker import chunks
from soma.local.worker.lanes import Lane, Lanes
from soma.local.worker.resources import DeviceSetup
from soma.local.worker.running import JobRunner
from soma.local.worker.segments import Segments
from soma.local.worker.turns import Turns
from soma.plan import Seq, Step
from soma.wire import codec, failures, nodecode, protocol
from soma.wire.protocol import (
    Chunk,
    ChunkPart,
    GiveBack,
    JobSpec,
    Outcome,
    Result,
    Task,
)
from soma.wire.shm import pool_prefix
from soma.wire.status import StatusPage

pytestmark = pytest.mark.timeout(60)

SECRET = b"k" * 32
PIECE = 7


class Half(Node):
    """x / 2, and a ZeroDivisionError (the node's own failure) for x == 13; records what it ran."""

    def __init__(self):
        self.ran: list = []

    def forward(self, x, ctx):
        self.ran.append(x)
        if x == 13:
            raise ZeroDivisionError("13 is unlucky")
        return Done(x / 2)


STARTED, GO = threading.Event(), threading.Event()  # (a node's copy is unpickled here: events cannot travel)


class Gate(Node):
    """Holds the input `hold` until GO is set (a straggler among cheap inputs); sleeps `nap` s on the others."""

    def __init__(self, hold=None, nap=0.0):
        self.hold, self.nap = hold, nap
        self.ran: list = []
        STARTED.clear()
        GO.clear()

    def forward(self, x, ctx):
        self.ran.append(x)
        if x == self.hold:
            STARTED.set()
            assert GO.wait(30), "the test never let the straggler go"
        elif self.nap:
            time.sleep(self.nap)
        return Done([x, x])


class Worker:
    """The worker's core with one piece of one node, as a real worker has it (no sockets)."""

    def __init__(self, node, tmp):
        self.segments = Segments(pool_prefix(os.getpid(), os.urandom(4).hex()), 1 << 20)
        self.runner = JobRunner("w9", StatusPage(os.path.join(tmp, "status"), create=True), DeviceSetup("cpu", 1),
                                self.segments.get_store, 0)
        self.runner.library.register({1: nodecode.dumps(node)},
                                     {PIECE: protocol.pack_piece(Step("n"), {"n": 1}, {})})
        self.node = self.runner.library.node("n", 1)  # (the worker's copy: its `ran` is what ran here)
        self.sent: list = []  # parts sent while the chunk ran

    def chunk(self, ids, xs, traced=False) -> chunks.ChunkRun:
        return chunks.ChunkRun(Chunk(ids, PIECE, codec.Encoder(self.segments.get_store).pack_each(xs), traced))

    def run(self, run):
        return chunks.run_chunk(self.runner, run, Lane(), Turns(), self.sent.append)

    def close(self):
        self.segments.close()


@pytest.fixture
def tmp():
    with tempfile.TemporaryDirectory() as path:
        yield path


class Read(NamedTuple):
    """One input of a part as the host reads it (host/outcomes.bundled, as WorkerPool does)."""

    job: int
    ok: bool
    value: object  # its output (decoded, or Undecodable), or its error
    seconds: float  # how long it ran in the worker (the part's own figure for it)
    spans: list | None  # a traced input's spans (the part's, as outcomes.bundled reads them)


def host_reads(*parts, returned=()) -> tuple:
    """What the host makes of the parts: one sealed Result crossing the protocol, then each part read as the
    host's pool reads it (`bundled`): `({job: Read}, the Result)`."""
    frame = protocol.pack(SECRET, Result("w9", 1, list(parts), [], False, list(returned)))
    result = protocol.parse(SECRET, frame, "a test")
    return reads(result), result


def reads(result) -> dict:
    decoder = codec.Decoder(lambda create=True: None)
    got = {}
    for part in result.outcomes:
        assert type(part) is ChunkPart
        one = bundled(decoder, part.ids, part.said, part.body, 0.0, part.spans)
        spans = one.spans if one.spans is not None else [None] * len(part.ids)
        for job, ok, value, spans_of in zip(one.jobs, one.oks, one.values, spans):
            got[job] = Read(job, ok, value, part.seconds, spans_of)
    return got


def test_a_chunk_runs_each_input_in_order_and_answers_each_alone(tmp):
    w = Worker(Half(), tmp)
    try:
        part = w.run(w.chunk([11, 0, 12, 13, 14], [2, 99, 4, 13, 6.5]))
        assert w.node.ran == [2, 4, 13, 6.5]  # in order; the input of id 0 is not wanted
        assert part.more is False and all(sent.more for sent in w.sent)  # (a part went early on a slow machine)
        got, _ = host_reads(*w.sent, part)
        assert list(got) == [11, 12, 13, 14]
        assert got[11] == Read(11, True, 1.0, got[11].seconds, None) and got[14].value == 3.25
        assert got[12].ok and got[12].value == 2.0
        failed = got[13]
        assert not failed.ok
        err = failed.value
        assert isinstance(err, NodeError) and err.node == "n" and "13 is unlucky" in str(err)
        assert all(o.seconds > 0 for o in got.values())  # (its part's typical input's)
    finally:
        w.close()


class Picky(Node):
    """Each way an input can end: an output (an Opaque's object too), the node's own exception, a forward that
    returns no Done, a KeyboardInterrupt (in a worker: the node's failure, not the worker's)."""

    def forward(self, x, ctx):
        if x == 13:
            raise ZeroDivisionError("13 is unlucky")
        if x == 5:
            return x
        if x == 7:
            raise KeyboardInterrupt("seven")
        if x == 9:
            return Done(Opaque([ctx.node, ctx.worker, ctx.device]))
        return Done(x / 2)


def test_a_one_node_chunk_answers_each_input_as_it_would_run_alone(tmp):
    """A one-node piece's inputs call the node directly (Interpreter.each): each outcome the same as the input
    run alone as a job (run_job; test_lone_jobs holds that to Interpreter.run's), errors included, in the middle
    of a chunk."""
    xs = [1, 13, 5, 2, 7, 9, 4]
    w = Worker(Picky(), tmp)
    try:
        part = w.run(w.chunk(list(range(1, len(xs) + 1)), xs))
        piece = w.runner.library.pieces[PIECE]
        assert piece.interpreter.each(piece.plan) is not None  # (the one-node call ran them)
        chunked, _ = host_reads(*w.sent, part)
        enc = codec.Encoder(w.segments.get_store)
        decoder = codec.Decoder(lambda create=True: None)
        for job, x in enumerate(xs, 1):
            alone = w.runner.run_job(JobSpec(100 + job, PIECE, enc.pack(x), False))
            got = chunked[job]
            assert got.ok == alone.ok, x
            if alone.ok:
                assert got.value == decoder.unpack(alone.body), x
            else:
                mine, theirs = got.value, failures.error_from(alone.body)
                assert type(mine) is type(theirs) is NodeError and mine.node == theirs.node == "n"
                assert str(mine) == str(theirs), x
        assert chunked[6].value == ["n", "w9", None]
        assert "not Done" in str(chunked[3].value)
        assert "KeyboardInterrupt" in str(chunked[5].value)
    finally:
        w.close()


class Watches(Node):
    """Records what the status page says while it runs (the host reads the same page when a worker dies)."""

    def __init__(self, page: str):
        self.page = page
        self.seen: list = []

    def forward(self, x, ctx):
        reader = StatusPage(self.page, create=False)
        try:
            self.seen.append(reader.read())
        finally:
            reader.close()
        return Done(x + 1)


def test_the_status_page_names_each_input_of_a_chunk_and_its_node_while_it_runs(tmp):
    w = Worker(Watches(os.path.join(tmp, "status")), tmp)
    try:
        ids = [21, 0, 22, 23]
        part = w.run(w.chunk(ids, [1, 2, 3, 4]))
        got, _ = host_reads(*w.sent, part)
        assert [got[i].value for i in (21, 22, 23)] == [2, 4, 5]
        assert w.node.seen == [[(21, "n")], [(22, "n")], [(23, "n")]]
        assert StatusPage(os.path.join(tmp, "status"), create=False).read() == []  # (nothing runs after it)
    finally:
        w.close()


def test_a_chunk_of_a_two_node_piece_names_each_node_and_answers_each_input(tmp):
    """A piece of two nodes runs each input through Interpreter.run (not the one-node call): the status page
    names the node running, each input its own outcome."""
    w = Worker(Half(), tmp)
    try:
        w.runner.library.register({2: nodecode.dumps(Watches(os.path.join(tmp, "status")))},
                                  {PIECE + 1: protocol.pack_piece(Seq([Step("w"), Step("n")]), {"w": 2, "n": 1}, {})})
        run = chunks.ChunkRun(Chunk([5, 6, 7], PIECE + 1, codec.Encoder(w.segments.get_store).pack_each([1, 12, 3]),
                                    False))
        last = w.run(run)  # (first: parts it sends while it runs, after PART_S under load, are in w.sent then)
        got, _ = host_reads(*w.sent, last)
        assert [got[5].value, got[7].value] == [1.0, 2.0] and not got[6].ok
        assert "13 is unlucky" in str(got[6].value)
        assert w.runner.library.node("w", 2).seen == [[(5, "w")], [(6, "w")], [(7, "w")]]
    finally:
        w.close()


def test_a_traced_chunk_gives_each_traced_input_its_own_spans(tmp):
    w = Worker(Half(), tmp)
    try:
        part = w.run(w.chunk([1, 2, 3], [0, 2, 4], traced=[[40], False, [42]]))
        got, _ = host_reads(*w.sent, part)
        assert got[2].spans is None
        for job in (1, 3):
            names = [s[0] for s in got[job].spans]
            assert "n" in names
        assert len(got[1].spans) > len(got[3].spans)  # the piece's load is a span of its first traced input
    finally:
        w.close()


def test_a_cancel_answers_the_unstarted_input_cancelled_at_once_and_it_never_runs(tmp):
    w = Worker(Half(), tmp)
    try:
        run = w.chunk([1, 2, 3], [2, 4, 6])
        parts: list = []
        assert chunks.answer_now(w.runner, run, {2, 99}, False, parts) == []
        got, _ = host_reads(*parts)
        assert list(got) == [2] and not got[2].ok
        assert isinstance(got[2].value, Cancelled)
        assert parts[0].more is True
        last = w.run(run)
        rest, _ = host_reads(*w.sent, last)
        assert list(rest) == [1, 3] and w.node.ran == [2, 6]
    finally:
        w.close()


SETTING_UP, SET_UP = threading.Event(), threading.Event()


class SlowSetup(Node):
    """Its setup waits for SET_UP (a model loading, held by the test); `fail` times, it raises instead."""

    def __init__(self, fail=0):
        self.fail = fail
        self.ran: list = []
        SETTING_UP.clear()
        SET_UP.clear()

    def setup(self, ctx):
        SETTING_UP.set()
        assert SET_UP.wait(30), "the test never let the setup end"
        if self.fail:
            self.fail -= 1
            raise OSError("no weights")

    def forward(self, x, ctx):
        self.ran.append(x)
        return Done(x)


def test_a_chunk_cancelled_while_its_node_sets_up_runs_none_of_its_inputs(tmp):
    """The node is set up before any input is claimed: a Cancel that comes during the setup (seconds: a model)
    answers every input Cancelled at once, unstarted. Claimed first, the first input ran after its cancel."""
    w = Worker(SlowSetup(), tmp)
    try:
        run = w.chunk([1, 2, 3], [10, 20, 30])
        out: list = []
        thread = threading.Thread(target=lambda: out.append(w.run(run)))
        thread.start()
        assert SETTING_UP.wait(30)
        parts: list = []
        assert chunks.answer_now(w.runner, run, {1, 2, 3}, False, parts) == []
        SET_UP.set()
        thread.join(30)
        got, _ = host_reads(*parts, *w.sent, *[part for part in out if part is not None])
        assert sorted(got) == [1, 2, 3] and all(isinstance(got[i].value, Cancelled) for i in got)
        assert w.node.ran == []
    finally:
        SET_UP.set()
        w.close()


def test_a_setup_that_fails_fails_the_first_input_of_a_chunk_and_the_next_tries_again(tmp):
    """As for lone inputs (docs/api.md, setup): that input gets the NodeError, and the copy calls setup again
    before its next input."""
    w = Worker(SlowSetup(fail=1), tmp)
    try:
        SET_UP.set()
        got, _ = host_reads(*w.sent, w.run(w.chunk([1, 2, 3], [10, 20, 30])))
        assert [got[i].ok for i in (1, 2, 3)] == [False, True, True]
        assert "setup raised OSError: no weights" in str(got[1].value)
        assert w.node.ran == [20, 30]
    finally:
        w.close()


def test_give_back_returns_what_has_not_started_behind_a_straggler_with_what_is_done(tmp):
    w = Worker(Gate(hold=3), tmp)
    try:
        run = w.chunk([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
        answer: list = []
        runner = threading.Thread(target=lambda: answer.append(w.run(run)))
        runner.start()
        assert STARTED.wait(20)  # input 3 runs, and runs long
        parts: list = []
        returned = chunks.answer_now(w.runner, run, {1, 2, 3, 4, 5}, True, parts)
        assert returned == [4, 5]  # not started: dropped here, for the host to send elsewhere
        # (what was done went with the answer, or earlier when inputs 1 and 2 took PART_S on a slow machine)
        got, result = host_reads(*w.sent, *parts, returned=returned)
        assert list(got) == [1, 2] and got[1].value == [1, 1] and result.returned == [4, 5]
        assert all(part.more for part in w.sent + parts)  # input 3 is still to come
        GO.set()
        runner.join(20)
        last, _ = host_reads(answer[0])
        assert list(last) == [3] and last[3].value == [3, 3] and answer[0].more is False
        assert w.node.ran == [1, 2, 3]
    finally:
        GO.set()
        w.close()


def test_what_is_done_goes_in_parts_while_a_long_chunk_runs(tmp):
    w = Worker(Gate(nap=0.008), tmp)
    try:
        ids = list(range(1, 9))
        last = w.run(w.chunk(ids, ids))
        assert w.sent, "every output waited for the whole chunk"
        assert all(part.more for part in w.sent) and last.more is False
        got, _ = host_reads(*w.sent, last)
        assert sorted(got) == ids  # each input answered once, across the parts
        assert [o.value for o in got.values()] == [[i, i] for i in ids]
    finally:
        w.close()


class Spins(Node):
    """Records what it ran, after a few µs of work: tiny inputs, for races at the boundary between two."""

    def __init__(self):
        self.ran: list = []

    def forward(self, x, ctx):
        sum(range(20))
        self.ran.append(x)
        return Done(x)


def test_cancels_and_give_backs_racing_a_chunk_answer_each_input_exactly_once(tmp):
    """The lane's thread claims each input as it starts, while another thread answers the ones just ahead of it
    out of turn (answer_now, as the receiving thread does), with a thread switch forced every µs: each input
    is answered once (in a part, or given back); what was answered out of turn never ran; what ran is its own
    output."""
    import collections
    import random
    import sys

    w = Worker(Spins(), tmp)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(30):
            ids = list(range(trial * 1000 + 1, trial * 1000 + 301))
            run = w.chunk(ids, ids)
            w.node.ran.clear()
            w.sent.clear()
            last: list = []
            lane = threading.Thread(target=lambda: last.append(w.run(run)))
            parts, returned, rng = [], [], random.Random(trial)
            lane.start()
            while lane.is_alive():
                at = len(w.node.ran)  # (about where the lane's thread is: aim just ahead of it)
                wanted = set(ids[at:at + rng.randint(1, 4)])
                returned += chunks.answer_now(w.runner, run, wanted, rng.random() < 0.5, parts)
            lane.join()
            answered = [i for part in w.sent + parts + [p for p in last if p] for i in part.ids] + returned
            twice = [i for i, n in collections.Counter(answered).items() if n > 1]
            assert not twice, f"answered twice: {twice}"
            assert sorted(answered) == ids
            got, _ = host_reads(*w.sent, *parts, *[p for p in last if p])
            ran = set(w.node.ran)
            assert len(ran) == len(w.node.ran)  # (none ran twice)
            assert ran == {i for i, o in got.items() if o.ok} and not ran & set(returned)
            assert all(got[i].value == i for i in ran)
            assert all(isinstance(o.value, Cancelled) for o in got.values() if not o.ok)
    finally:
        sys.setswitchinterval(switch)
        w.close()


def test_over_max_memory_the_inputs_not_started_are_answered_cancelled(tmp):
    """max_memory is checked after every input: once over it, what has not started is Cancelled (the host runs
    it on the worker that replaces this one), and never runs here."""
    w = Worker(Half(), tmp)
    try:
        w.runner.max_memory = 1  # (bytes: over it after the first input)
        got, _ = host_reads(*w.sent, w.run(w.chunk([1, 2, 3], [2, 4, 6])))
        assert w.node.ran == [2] and w.runner.over_memory
        assert got[1].ok and got[1].value == 1.0
        assert [type(got[i].value) for i in (2, 3)] == [Cancelled, Cancelled]
    finally:
        w.close()


class Naps(Node):
    """Sleeps `x` seconds; `took`: how long each call took, in order (in-process workers only)."""

    def __init__(self):
        self.took: list = []

    def forward(self, x, ctx):
        start = time.perf_counter()
        time.sleep(x)
        self.took.append(time.perf_counter() - start)
        return Done(x)


def test_an_input_takes_a_gil_turn_only_after_one_that_was_not_quick(tmp):
    """As a lane's jobs do (turns.py): an input waits its turn when its lane's last input took turns.MIN_S or
    more, or none ran yet; not after a quick one. The lane keeps the last input's pace."""
    from soma.local.worker.turns import MIN_S

    class Counted(Turns):
        def __init__(self):
            super().__init__()
            self.entered: list = []

        def enter(self, piece_id, pace):
            self.entered.append(pace)
            return super().enter(piece_id, pace)

    w = Worker(Naps(), tmp)
    try:
        lane, turns = Lane(), Counted()
        part = chunks.run_chunk(w.runner, w.chunk([1, 2, 3, 4, 5], [0, 0, 2 * MIN_S, 0, 0]), lane, turns,
                                w.sent.append)
        got, _ = host_reads(*w.sent, part)
        took = w.node.took  # (each call's own time: the worker's pace of an input is at least that)
        assert sorted(got) == [1, 2, 3, 4, 5] and took[2] >= 2 * MIN_S
        entered = turns.entered
        assert entered[0] is None and any(pace is not None and pace >= 2 * MIN_S for pace in entered)  # (input 4)
        assert all(pace is None or pace >= MIN_S for pace in entered)  # never after a quick input
        # (2, but on a busy machine a call of no sleep may take MIN_S too; the worker's pace adds its own steps)
        assert len(entered) <= 1 + sum(t >= MIN_S / 2 for t in took[:4])
        assert lane.pace >= took[4]  # (the last input's pace: its call and the worker's steps around it)
        before = len(entered)
        chunks.run_chunk(w.runner, w.chunk([6, 7], [0, 0]), lane, turns, w.sent.append)
        assert None not in entered[before:]  # (the lane's pace carries over to its next chunk)
    finally:
        w.close()


def test_a_chunk_whose_piece_cannot_load_fails_each_input_with_that_error(tmp):
    w = Worker(Half(), tmp)
    try:
        run = chunks.ChunkRun(Chunk([1, 2], 404, codec.Encoder(w.segments.get_store).pack_each([1, 2]), False))
        last = chunks.run_chunk(w.runner, run, Lane(), Turns(), w.sent.append)
        got, _ = host_reads(*w.sent, last)
        assert [o.ok for o in got.values()] == [False, False]
        assert "never told about" in str(got[1].value)
    finally:
        w.close()


class Mixed(Node):
    """By input: an int, a numpy array, bytes, a str, a list holding an array, or an object that says it is on
    `meta` (no torch needed: anything with `.device` is checked)."""

    def forward(self, x, ctx):
        import numpy as np

        class Elsewhere:
            device = "meta"

        return Done([x, np.full(3, x), bytes([x]), str(x), [x, np.zeros(2)], Elsewhere()][x % 6])


def placed(w: Worker, node, piece: int, device: str = "cpu") -> None:
    """`node` registered as piece `piece` of w's worker, one node placed on `device`."""
    w.runner.library.register({piece: nodecode.dumps(node)},
                              {piece: protocol.pack_piece(Step("p"), {"p": piece}, {"p": device})})


def test_a_placed_nodes_chunk_checks_every_output_whatever_its_type(tmp):
    """The postcondition runs on each output of a chunk (a number is answered by its type alone, Interpreter's
    UNCHECKED): ints, arrays, bytes and lists pass on `cpu`; the one output that says it is elsewhere fails
    that input alone, with the named placement error, in the middle of the chunk."""
    import numpy as np

    w = Worker(Half(), tmp)
    try:
        placed(w, Mixed(), 70)
        xs = list(range(12))
        run = chunks.ChunkRun(Chunk(list(range(1, 13)), 70, codec.Encoder(w.segments.get_store).pack_each(xs), False))
        got, _ = host_reads(*w.sent, w.run(run))
        for job, x in enumerate(xs, 1):
            if x % 6 == 5:
                err = got[job].value
                assert not got[job].ok and type(err) is PostconditionError
                assert (err.node, err.declared, err.actual) == ("p", "cpu", "meta")
                continue
            assert got[job].ok, (x, got[job].value)
            want = [x, np.full(3, x), bytes([x]), str(x), [x, np.zeros(2)]][x % 6]
            body = got[job].value
            if x % 6 == 1:
                assert np.array_equal(body, want)
            elif x % 6 == 4:
                assert body[0] == x and np.array_equal(body[1], want[1])
            else:
                assert body == want and type(body) is type(want)
    finally:
        w.close()


class Misplaces(Node):
    """A tensor of x on cpu, but on `meta` for the input `wrong`."""

    def __init__(self, wrong):
        self.wrong = wrong

    def forward(self, x, ctx):
        import torch

        return Done(torch.full((2,), float(x), device="meta" if x == self.wrong else "cpu"))


def test_a_wrong_device_tensor_fails_exactly_its_input_of_a_chunk_with_the_placement_error(tmp):
    torch = pytest.importorskip("torch")
    w = Worker(Half(), tmp)
    try:
        placed(w, Misplaces(wrong=3), 71)
        xs = [1, 2, 3, 4, 5]
        run = chunks.ChunkRun(Chunk([11, 12, 13, 14, 15], 71, codec.Encoder(w.segments.get_store).pack_each(xs),
                                    False))
        got, _ = host_reads(*w.sent, w.run(run))
        assert [got[i].ok for i in (11, 12, 13, 14, 15)] == [True, True, False, True, True]
        err = got[13].value
        assert type(err) is PostconditionError and (err.node, err.declared, err.actual) == ("p", "cpu", "meta")
        assert str(err) == "node `p` failed: it declared `cpu` but returned a value on `meta`"
        for job, x in zip((11, 12, 14, 15), (1, 2, 4, 5)):
            assert torch.equal(got[job].value, torch.full((2,), float(x)))
    finally:
        w.close()


def test_the_nodes_lock_held_over_quick_inputs_is_let_go_before_each_part_and_at_the_end(tmp, monkeypatch):
    """A chunk's quick inputs share one round of their node's lock (Interpreter.each_held), not one each: it
    is free whenever a part is sent (another thread running the same node object gets its turn there, and a
    send never waits holding it), free after the chunk, also after a failed input, and another thread that runs
    the same node all along (the lone job's call, which takes the lock itself) never deadlocks with it."""
    monkeypatch.setattr(chunks, "PART_S", 0.0005)  # (a part every half millisecond: many of them)
    w = Worker(Half(), tmp)
    try:
        piece = w.runner.library.pieces.get(PIECE) or w.runner.library.load(PIECE, *w.runner.library.describe(PIECE))
        lock, _ = piece.each_held
        free_at_send: list = []

        def send(part):
            free = lock.acquire(blocking=False)
            if free:
                lock.release()
            free_at_send.append(free)
            w.sent.append(part)

        ids = list(range(1, 3001))
        xs = [13 if i % 100 == 0 else 1000 + i for i in ids]  # (13: a failed input now and then)
        last = chunks.run_chunk(w.runner, w.chunk(ids, xs), Lane(), Turns(), send)
        assert len(free_at_send) > 1 and all(free_at_send)
        assert lock.acquire(blocking=False)  # (free after the chunk)
        lock.release()
        got, _ = host_reads(*w.sent, last)
        assert sorted(got) == ids
        assert [got[i].ok for i in ids] == [x != 13 for x in xs]
        assert [got[i].value for i in ids if got[i].ok] == [x / 2 for x in xs if x != 13]

        stop, beside = threading.Event(), []

        def other():  # the same node object, through the call that takes its lock per input
            while not stop.is_set():
                beside.append(piece.each(4))

        thread = threading.Thread(target=other)
        thread.start()
        w.sent.clear()
        ids = [i + 5000 for i in ids]
        try:
            last = chunks.run_chunk(w.runner, w.chunk(ids, xs), Lane(), Turns(), w.sent.append)
        finally:
            stop.set()
            thread.join(20)
        assert not thread.is_alive() and beside and set(beside) == {2.0}
        got, _ = host_reads(*w.sent, last)
        assert [got[i].ok for i in ids] == [x != 13 for x in xs]
        assert [got[i].value for i in ids if got[i].ok] == [x / 2 for x in xs if x != 13]
    finally:
        w.close()


def test_lanes_give_back_waiting_jobs_and_name_the_chunks_that_hold_an_id():
    lanes = Lanes()
    lanes.add(JobSpec(1, PIECE, b"", False))
    lanes.add(Chunk([2, 3], PIECE, b"", False))
    lanes.add(JobSpec(4, PIECE, b"", False))
    lanes.cancel({4})
    returned, named = lanes.give_back({1, 3, 4})
    assert sorted(job.id for job in returned) == [1, 4] and len(named) == 1 and named[0].chunk.ids == [2, 3]
    turn, dropped = lanes.take_turn(lanes.lanes[PIECE], {})
    assert turn == named and dropped == set()  # the chunk, a turn of its own; job 4 is gone, not cancelled
    assert lanes.take_turn(lanes.lanes[PIECE], {}) is None


def test_chunk_messages_cross_the_protocol():
    task = Task({}, {}, [JobSpec(1, 2, b"x", False), Chunk([3, 0, 4], 2, b"xs", [[0], False, [2]])], [], [])
    parsed = protocol.parse(SECRET, protocol.pack(SECRET, task), "a test")
    assert parsed.jobs == task.jobs and [type(j) for j in parsed.jobs] == [JobSpec, Chunk]
    assert protocol.parse(SECRET, protocol.pack(SECRET, GiveBack([3, 4])), "a test") == GiveBack([3, 4])
    plain = Result("w0", 1, [Outcome(5, True, b"\x01", None, 0.5)], [], False)
    assert protocol.parse(SECRET, protocol.pack(SECRET, plain), "a test") == plain._replace(returned=[])


class FileGate(Node):
    """In a real worker: holds the input `hold` until the file `go` exists (a straggler), doubles the others."""

    def __init__(self, hold, go):
        self.hold, self.go = hold, go

    def forward(self, x, ctx):
        if x == self.hold:
            deadline = time.monotonic() + 30
            while not os.path.exists(self.go) and time.monotonic() < deadline:
                time.sleep(0.002)
        return Done(x * 2)


def test_a_real_worker_answers_a_chunk_and_gives_back_what_a_straggler_holds_up(tmp):
    """A real `soma-worker` process, driven through its sockets as a host drives it: a chunk whose third input
    runs long; a GiveBack gets the two done outputs and the three unstarted ids at once, while it runs; a Cancel
    of one id in a second chunk answers it Cancelled; then the straggler's output comes, and nothing else."""
    import json
    import subprocess
    import sys

    import zmq

    zctx = zmq.Context()
    tasks, results = zctx.socket(zmq.ROUTER), zctx.socket(zmq.PULL)
    for sock in (tasks, results):
        sock.setsockopt(zmq.LINGER, 0)
    tasks.bind(f"ipc://{tmp}/tasks")
    results.bind(f"ipc://{tmp}/results")
    env = dict(os.environ, SOMA_SECRET=SECRET.hex(), SOMA_SYS_PATH=json.dumps([p or os.getcwd() for p in sys.path]))
    worker = subprocess.Popen([sys.executable, "-m", "soma.local.worker", "--tasks", f"ipc://{tmp}/tasks",
                               "--results", f"ipc://{tmp}/results", "--id", "w9", "--host-pid", str(os.getpid()),
                               "--prefix", pool_prefix(os.getpid(), os.urandom(4).hex()),
                               "--status", os.path.join(tmp, "status")], env=env, stdin=subprocess.DEVNULL)

    def receive():
        assert results.poll(20_000), "the worker did not answer within 20 s"
        return protocol.parse(SECRET, results.recv(), "the worker")

    def send(message):
        tasks.send_multipart([f"w9.{worker.pid}".encode(), protocol.pack(SECRET, message)])

    try:
        assert type(receive()) is protocol.Hello
        go = os.path.join(tmp, "go")
        payload = codec.Encoder(lambda create=True: None).pack_each
        send(Task({1: nodecode.dumps(FileGate(3, go))}, {PIECE: protocol.pack_piece(Step("n"), {"n": 1}, {})},
                  [Chunk([1, 2, 3, 4, 5, 6], PIECE, payload([1, 2, 3, 4, 5, 6]), False),
                   Chunk([7, 8], PIECE, payload([7, 8]), False)], [], []))
        outcomes: dict = {}
        returned: list = []

        def take(result):
            for part in result.outcomes:
                for job, o in reads(result._replace(outcomes=[part])).items():
                    assert job not in outcomes, f"job {job} answered twice"
                    outcomes[job] = o
            returned.extend(result.returned)

        while {1, 2} - set(outcomes):  # a part, unasked: what is done does not wait for the straggler
            take(receive())
        assert 3 not in outcomes
        send(protocol.Cancel([8]))
        take(receive())
        assert not outcomes[8].ok and isinstance(outcomes[8].value, Cancelled)
        send(GiveBack([3, 4, 5, 6, 7]))
        take(receive())
        assert sorted(returned) == [4, 5, 6, 7]  # not started: 3 runs, the others are the host's again
        open(go, "w").close()
        while 3 not in outcomes:
            take(receive())
        assert {j: o.value for j, o in outcomes.items() if o.ok} == {1: 2, 2: 4, 3: 6}
        send(Task({}, {}, [JobSpec(9, PIECE, codec.Encoder(lambda create=True: None).pack(5), False)], [], []))
        last = receive()
        assert [o.job for o in last.outcomes] == [9] and not results.poll(200)  # nothing of the chunks came again
    finally:
        worker.kill()
        worker.wait(10)
        zctx.destroy(0)
