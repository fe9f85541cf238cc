"""The host's core (soma/local/host/core.py) driven without processes: every event, in random interleavings.

Hypothesis's stateful testing plays the loop: it starts inputs on real programs (compiled from real graphs),
spawns workers and has them say hello, answers jobs (ok, failed, or handed back unstarted), kills workers at
any point (with or without a readable status page), cancels and expires inputs, and carries out every action
the core asks for as the loop would: its Sends encoded as the loop encodes them (host/sending.py), and each worker
answering from what its input decodes to, as a worker does. After each step it checks the invariants:

  * every input ends at most once, with its own outcome (the plan computed on its input) or a named error;
  * nothing is sent to a worker that is not ready (a starting worker's jobs are parked until its hello);
  * what the core counts as out at each worker is what was sent there and not answered;
  * a cancelled or expired input is never delivered;
and at the end, with every worker made to answer, that every input not cancelled ends.
"""

from __future__ import annotations

import threading

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from soma import Done, Graph, Node  # noqa: E402
from soma.errors import Cancelled, NodeError, RunTimeout, SomaError, WorkerDied  # noqa: E402
from soma.local.host.core import HostCore  # noqa: E402
from soma.local.host.core_workers import ASKED, DOWN, READY, STARTING  # noqa: E402
from soma.local.host.events import (  # noqa: E402
    Arrived,
    Bundled,
    CancelAt,
    Deliver,
    Retire,
    Send,
    Spawn,
)
from soma.local.host.flows import Chunk, Flow  # noqa: E402
from soma.local.host.program import compile_program, pieces  # noqa: E402
from soma.local.host.sending import BundleSend, encode  # noqa: E402
from soma.plan import Seq, Step, Wave  # noqa: E402
from soma.run.mapping import Span  # noqa: E402
from soma.wire import codec  # noqa: E402


class A(Node):
    def forward(self, x, ctx):
        return Done(x)


class B(A):
    pass


class C(A):
    pass


class D(A):
    pass


class One(A):
    copies = 1  # a piece of its own


class Batch(Node):
    max_batch = 4

    def forward_batch(self, xs, ctx):
        return Done(xs)


def _programs():
    graphs = [
        (Graph.somatize(A()), True),  # one piece
        (Graph.somatize(A() >> One() >> B()), False),  # [a] >> [one] >> [b]
        (Graph.somatize(A() >> (B() | C()) >> D()), False),  # [a] >> ([b] | [c]) >> [d]
        (Graph.somatize(Batch()), False),  # a batching node alone: bundles
    ]
    return [compile_program(g, id, ["cpu", "cpu"], whole) for g, whole in graphs]


PROGRAMS = _programs()
UNSENDABLE = threading.Lock()  # an input that cannot be encoded for a worker (its job fails: HostCore.unsent)


def evaluate(plan, x):
    """What a worker computes for `plan` on `x`: each node wraps its input in its id."""
    if isinstance(plan, Step):
        return f"{plan.id}({x!r})"
    if isinstance(plan, Seq):
        for item in plan.items:
            x = evaluate(item, x)
        return x
    if isinstance(plan, Wave):
        return tuple(evaluate(b, x) for b in plan.branches)
    return evaluate(plan.plan, x)  # a Piece


class Proc:
    """A fake worker process: what the core needs of one (`.id`, `.pid`)."""

    def __init__(self, slot: int, n: int):
        self.slot, self.id, self.pid = slot, f"w{slot}", 1000 * (slot + 1) + n


class Sink:
    def __init__(self, machine):
        self.machine = machine

    def put(self, item):
        self.machine.delivered(item)


class CoreMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.core = HostCore(["cpu", "cpu"])
        self.procs = [None, None]
        self.spawns = 0
        self.inbox = [[], []]  # per slot: jobs sent to its worker and not yet answered (in order)
        self.sent = {}  # id(a chunk's job) → the places it was sent with (its worker answers each once)
        self.answered = [set(), set()]  # per slot: job ids of chunks' inputs its worker answered
        self.started = [set(), set()]  # per slot: ids of jobs its worker began
        self.cancelled_ids = [set(), set()]  # per slot: ids the core asked it to drop
        self.asked_back = [[], []]  # per slot: ids the core asked it to give back, per ask, not yet answered
        self.retiring = []  # slots the core asked to retire, whose end the loop has not reported yet
        self.asked = []  # slots the core asked to start again, not yet answered
        self.inputs = {}  # index → (program, x, retries)
        self.flows = {}  # index → Flow
        self.given_up = set()  # indices cancelled or expired by their caller
        self.outcomes = {}  # index → (ok, value)
        self.next_index = 0
        self.sink = Sink(self)
        self.travelled = {}  # job id → the input its last Send carried, decoded (what its worker runs on)

    # -- the loop's side: carrying out actions ---------------------------------------------------------
    def delivered(self, item):
        index, ok, value = item
        if type(value) is Span:  # a chunk's consecutive ok outputs
            assert ok and value, item
            for i, one in enumerate(value):
                self.delivered((index + i, True, one))
            return
        assert index not in self.outcomes, f"input {index} delivered twice"
        assert index not in self.given_up, f"input {index} was given up by its caller but delivered"
        self.outcomes[index] = (ok, value)

    def act(self):
        for action in self.core.take():
            if type(action) is Send:
                assert self.core.state[action.slot] == READY, f"sent to w{action.slot}, {self.core.state[action.slot]}"
                went = self.carry(action)
                self.inbox[action.slot] += went
                for job in went:
                    if job.places is not None:
                        self.sent[id(job)] = sorted(job.pending)
                        # (a worker runs every place its job names: never one whose input was given up)
                        given_up = [job.flow.index + p for p in job.places if job.flow.index + p in self.given_up]
                        assert not given_up, f"inputs {given_up} were given up by their caller but sent to run"
            elif type(action) is CancelAt and action.give_back:
                self.asked_back[action.slot].append(list(action.job_ids))
            elif type(action) is CancelAt:
                self.cancelled_ids[action.slot].update(action.job_ids)
            elif type(action) is Retire:
                self.retiring.append(action.slot)
            elif type(action) is Deliver:
                action.sink.put(action.item)
            elif type(action) is Spawn:
                assert self.core.state[action.slot] == ASKED
                self.asked.append(action.slot)
            else:
                raise AssertionError(f"unknown action {action!r}")

    def carry(self, send: Send) -> list:
        """Encode a Send's inputs as the loop does (small values: inline, no store), note what each job's input
        decodes to (a job sent again after its worker's death goes as it was encoded the first time: a batching
        node's lone input encoded alone went again in a bundle as None, Dec 7), hand the core those that could
        not be encoded (`unsent`, as the loop does: an unsendable input), and return the jobs that went."""
        items, failed, _ = encode(lambda create=True: None, send.groups)
        decoder = codec.Decoder(lambda create=True: None)
        went = []
        for item in items:
            if type(item) is BundleSend:
                went += item.jobs
                if item.packed.places is not None:
                    continue  # (a chunk's: its worker runs its places' inputs, answer_chunk)
                for job_id, x in zip(item.ids, decoder.unpack(item.packed.payload)):
                    if job_id:
                        self.travelled[job_id] = x
            else:
                went.append(item)
                self.travelled[item.id] = decoder.unpack(item.spec[2])
        for job, err in failed:
            self.core.unsent([job], err)
        if failed:
            self.act()
        return went

    def answer(self, slot: int, job, ok: bool):
        if job.places is not None:
            self.answer_chunk(slot, job, ok)
            return
        if job.id in self.cancelled_ids[slot] and job.id not in self.started[slot]:
            arrived = Arrived(job.id, True, Cancelled(), None, 0.0, None)
        elif ok:
            arrived = Arrived(job.id, True, evaluate(job.piece, self.travelled[job.id]), None, 1e-4, None)
        else:
            arrived = Arrived(job.id, False, NodeError.failed(job.piece.entry, "boom"), None, 1e-4, None)
        self.inbox[slot].remove(job)
        self.core.outcomes(slot, self.procs[slot], [arrived], 0.0)
        self.act()

    def answer_chunk(self, slot: int, job, ok: bool, part: int | None = None):
        """A chunk's answer: each place's output (the last one fails unless `ok`), or Cancelled for a place
        the core asked to drop that had not started (as the worker does); `part`: only its first `part` places
        still owed (the worker sends what it has done when asked to drop the rest)."""
        ids, oks, values = [], [], []
        chunk = job.flow
        places = self.owed(slot, job)  # (what it was sent with: places handed on meanwhile too)
        whole = part is None or part >= len(places)
        for place in places if whole else places[:part]:
            job_id = job.base + place
            x = self.inputs[chunk.index + place][1]
            ids.append(job_id)
            if job_id in self.cancelled_ids[slot] and job_id not in self.started[slot]:
                oks.append(False)
                values.append(Cancelled())
            elif ok or place != places[-1]:
                oks.append(True)
                values.append(evaluate(job.piece, x))
            else:
                oks.append(False)
                values.append(NodeError.failed(job.piece.entry, "boom"))
        self.answered[slot].update(ids)
        if whole:
            self.inbox[slot].remove(job)
        self.core.outcomes(slot, self.procs[slot], [Bundled(ids, oks, values, 1e-4, None, all(oks))], 0.0)
        self.act()

    def owed(self, slot: int, job) -> list:
        """The places of a chunk's job its worker has not answered yet (of those it was sent)."""
        return [p for p in self.sent[id(job)] if job.base + p not in self.answered[slot]]

    def running(self, slot: int) -> list:
        """What the worker's status page shows: a job it began (a chunk's: the last input it began)."""
        shown = []
        for job in self.inbox[slot]:
            if job.places is None:
                if job.id in self.started[slot]:
                    shown.append((job.id, "?"))
                continue
            begun = [job.base + p for p in self.owed(slot, job) if job.base + p in self.started[slot]]
            if begun:
                shown.append((begun[-1], "?"))
        return shown

    def give_back(self, slot: int) -> None:
        """The worker answers the oldest give-back asked of it, as a worker does (soma.local.worker.chunks): the
        named inputs it has neither begun nor answered are dropped and named in `returned` (their chunk's job
        owes them no more); the others it answers as it runs them."""
        named = set(self.asked_back[slot].pop(0))
        returned = []
        for job in list(self.inbox[slot]):
            if job.places is None:
                continue
            back = [job.base + p for p in self.owed(slot, job)
                    if job.base + p in named and job.base + p not in self.started[slot]]
            self.answered[slot].update(back)
            returned += back
            if not self.owed(slot, job):
                self.inbox[slot].remove(job)
        self.core.outcomes(slot, self.procs[slot], [], 0.0, returned)
        self.act()

    def end_worker(self, slot: int, readable: bool, down: str | None = None):
        running = self.running(slot) if readable else None
        proc = self.procs[slot]
        self.asked_back[slot] = []
        self.inbox[slot], self.started[slot], self.cancelled_ids[slot] = [], set(), set()
        self.answered[slot] = set()
        self.core.lost(slot, proc, "was killed by signal 9 (SIGKILL)", running, down)
        self.act()

    # -- rules: the events ---------------------------------------------------------------------------
    @initialize()
    def spawn_all(self):
        for slot in (0, 1):
            self.spawn(slot)

    def spawn(self, slot: int):
        self.spawns += 1
        self.procs[slot] = Proc(slot, self.spawns)
        self.core.spawned(slot, self.procs[slot])
        self.act()

    @rule(program=st.integers(0, len(PROGRAMS) - 1), n=st.integers(1, 6), retries=st.integers(0, 2),
          together=st.booleans(), bad=st.integers(0, 11))
    def start(self, program, n, retries, together, bad=-1):
        """`n` inputs of a program: in one start, or (`together`) in as many taken at once, as the loop hands
        the core the starts posted by several threads (`start_all`); the one at `bad`, if any, cannot be sent."""
        items = []
        for i in range(n):
            index = self.next_index
            self.next_index += 1
            x = UNSENDABLE if i == bad else f"x{index}"
            items.append((index, x))
            self.inputs[index] = (PROGRAMS[program], x, retries)
        flows = {index: Flow(index, self.sink, None, PROGRAMS[program], x, retries) for index, x in items}
        if together:
            self.core.start_all([(PROGRAMS[program], [flow]) for flow in flows.values()])
        else:
            self.core.start(PROGRAMS[program], list(flows.values()))
        self.flows.update(flows)
        self.act()

    @rule(n=st.integers(1, 6), retries=st.integers(0, 2), bad=st.sets(st.integers(0, 7)))
    def start_chunk(self, n, retries, bad=frozenset()):
        """Consecutive inputs of a map in one chunk (a program of one piece, no timeout), each with `retries`
        of its own (an input lost with its worker every try ends WorkerDied with retries + 1 tries: checked);
        those at the places in `bad` cannot be sent (every one of them, some, or none)."""
        first, xs = self.next_index, []
        for i in range(n):
            index = self.next_index
            self.next_index += 1
            xs.append(UNSENDABLE if i in bad else f"x{index}")
            self.inputs[index] = (PROGRAMS[0], xs[-1], retries)
        chunk = Chunk(first, self.sink, PROGRAMS[0], xs, retries=retries)
        self.core.start(PROGRAMS[0], [chunk])
        for i in range(n):
            self.flows[first + i] = chunk
        self.act()

    @rule(slot=st.integers(0, 1))
    def hello(self, slot):
        if self.core.state[slot] == STARTING:
            self.core.ready(slot)
            self.act()

    @rule(slot=st.integers(0, 1), pick=st.integers(0, 63))
    def begin(self, slot, pick):
        """The worker begins a job (a chunk's: its next input; the worker runs a chunk's inputs in order)."""
        waiting = []
        for job in self.inbox[slot]:
            if job.places is None:
                if job.id not in self.started[slot]:
                    waiting.append((job.id, None))
                continue
            left = [p for p in self.owed(slot, job) if job.base + p not in self.started[slot]]
            if left:
                waiting.append((job.base + left[0], job.flow.index + left[0]))
        if waiting:
            job_id, index = waiting[pick % len(waiting)]
            if index is not None:  # (a chunk's input never runs at two workers at once: see HostCore.hand_on)
                other = 1 - slot
                assert not any(job.flow.index + p == index and job.base + p in self.started[other]
                               for job in self.inbox[other] if job.places is not None
                               for p in self.owed(other, job)), (
                    f"input {index} began at w{slot} while it runs at w{other}")
            self.started[slot].add(job_id)

    @rule(slot=st.integers(0, 1), pick=st.integers(0, 63), ok=st.booleans())
    def finish(self, slot, pick, ok):
        if self.inbox[slot]:
            self.answer(slot, self.inbox[slot][pick % len(self.inbox[slot])], ok)

    @rule(slot=st.integers(0, 1), pick=st.integers(0, 63), part=st.integers(1, 5))
    def answer_part(self, slot, pick, part):
        """A worker answers the first places a chunk's job still owes (the rest come later)."""
        owing = [j for j in self.inbox[slot] if j.places is not None and len(self.owed(slot, j)) > 1]
        if owing:
            self.answer_chunk(slot, owing[pick % len(owing)], True, part)

    @rule()
    def stragglers(self):
        """Chunks out for long while a worker idles: what they have not started goes to that worker."""
        for slot, job in self.core.stragglers(1e9):
            self.core.hand_on(job, self.running(slot))
        self.act()

    @rule(slot=st.integers(0, 1))
    def answer_give_back(self, slot):
        if self.asked_back[slot]:
            self.give_back(slot)

    @rule(slot=st.integers(0, 1), pick=st.integers(0, 63))
    def hand_back(self, slot, pick):
        """The worker drops a job it has not started (over max_memory, say): Cancelled, it goes elsewhere."""
        waiting = [j for j in self.inbox[slot] if j.id not in self.started[slot] and not (
            j.places is not None and any(j.base + p in self.started[slot] for p in j.places))]
        if waiting:
            job = waiting[pick % len(waiting)]
            self.inbox[slot].remove(job)
            if job.places is not None:  # a chunk none of whose inputs began: each handed back
                ids = [job.base + p for p in self.owed(slot, job)]
                back = Bundled(ids, [False] * len(ids), [Cancelled() for _ in ids], 0.0)
                self.core.outcomes(slot, self.procs[slot], [back], 0.0)
            else:
                self.core.outcomes(slot, self.procs[slot], [Arrived(job.id, True, Cancelled(), None, 0.0, None)],
                                   0.0)
            self.act()

    @rule(slot=st.integers(0, 1), readable=st.booleans())
    def die(self, slot, readable):
        if self.core.state[slot] not in (DOWN, ASKED):
            self.end_worker(slot, readable)
            self.spawn(slot)

    @rule(slot=st.integers(0, 1), readable=st.booleans())
    def die_and_stay_down(self, slot, readable):
        """The worker dies and no replacement can be started (out of file descriptors, say)."""
        if self.core.state[slot] not in (DOWN, ASKED):
            self.end_worker(slot, readable, down="could not be started again: OSError: [Errno 24]")

    @precondition(lambda self: self.asked)
    @rule(works=st.booleans())
    def answer_spawn(self, works):
        slot = self.asked.pop(0)
        if works:
            self.spawn(slot)
        else:
            self.core.down(slot, "could not be started again: OSError: [Errno 24]")
            self.act()

    @precondition(lambda self: self.retiring)
    @rule(readable=st.booleans())
    def retired(self, readable):
        slot = self.retiring.pop(0)
        if self.core.state[slot] not in (DOWN, ASKED):
            self.end_worker(slot, readable)
            self.spawn(slot)

    @rule(slot=st.integers(0, 1))
    def over_memory(self, slot):
        if self.core.state[slot] == READY:
            self.core.leaving(slot)
            self.act()

    @rule(pick=st.integers(0, 1 << 16))
    def cancel(self, pick):
        live = [i for i in self.flows if i not in self.outcomes and i not in self.given_up]
        if live:
            index = live[pick % len(live)]
            flow = self.flows[index]
            # (a chunk is cancelled whole: every input of it not delivered yet is given up)
            self.given_up.update(i for i, f in self.flows.items() if f is flow and i not in self.outcomes)
            self.core.cancel([flow])
            self.act()

    @rule(pick=st.integers(0, 1 << 16))
    def expire(self, pick):
        """An input's time runs out (a chunk's: that input alone; the chunk's others go on)."""
        live = [i for i in self.flows if i not in self.outcomes and i not in self.given_up]
        if live:
            index = live[pick % len(live)]
            flow = self.flows[index]
            self.given_up.add(index)
            if type(flow) is Chunk:
                running = {slot: self.running(slot) for slot in self.core.where(flow)}
                place = index - flow.index
                ran_at = [slot for slot, shown in running.items() for job in self.inbox[slot] if job.flow is flow
                          for job_id, _ in shown if job_id == job.base + place and place in job.pending]
                err = self.core.expire(flow, 1.0, running, place)
                if ran_at:  # (its worker runs it now: that worker is replaced, and the error says where it ran)
                    assert err.nodes and f"on worker w{ran_at[0]}" in str(err), err
                    assert ran_at[0] in self.retiring or any(
                        type(a) is Retire and a.slot == ran_at[0] for a in self.core.out), (ran_at, err)
                else:
                    assert not err.nodes, err
            else:
                running = {slot: [(j.id, j.piece.entry) for j in self.inbox[slot] if j.id in self.started[slot]]
                           for slot in self.core.where(flow)}
                err = self.core.expire(flow, 1.0, running)
            assert isinstance(err, RunTimeout) and str(err).startswith("run timed out after 1.0 s")
            self.act()

    # -- invariants -------------------------------------------------------------------------------------
    @invariant()
    def outcomes_are_right(self):
        for index, (ok, value) in self.outcomes.items():
            program, x, retries = self.inputs[index]
            if x is UNSENDABLE:  # (it fails as it is encoded, or before: no worker could ever take it)
                assert not ok and ("its input cannot be sent to a worker" in str(value)
                                   or isinstance(value, WorkerDied)), (index, value)
            elif ok:
                assert value == evaluate(program, x), (index, value)
            else:
                assert isinstance(value, (NodeError, WorkerDied)), value
                if isinstance(value, WorkerDied) and str(value).startswith("no worker can run"):
                    assert "could not be started again" in str(value), value  # (it says why)
                elif isinstance(value, WorkerDied):
                    assert value.tries == retries + 1 and value.worker in ("w0", "w1"), value

    @invariant()
    def in_flight_counts_the_inputs_not_ended(self):
        """What Local.snapshot shows: the inputs started and not ended (a chunk's each by itself), the jobs out."""
        inputs, jobs, waiting = self.core.in_flight()
        assert inputs == sum(1 for i in self.inputs if i not in self.outcomes and i not in self.given_up)
        assert jobs == self.core.dispatch.load and waiting >= 0

    @invariant()
    def counted_out_is_what_was_sent(self):
        core = self.core
        for slot in (0, 1):
            out = [j for j in core.dispatch.outstanding.values() if j.slot == slot and j not in core.dispatch.parked[slot]]
            # (a chunk's job whose every place was answered or handed on is over for the core, though its
            # worker still answers the places handed on: Cancelled, or what ran before the Cancel came)
            held = [j for j in self.inbox[slot] if j.places is None or j.pending]
            assert sorted(j.id for j in out) == sorted(j.id for j in held), slot
            assert core.dispatch.load[slot] == len(out) + len(core.dispatch.parked[slot]), slot

    def teardown(self):
        """Liveness: every worker says hello and answers everything (no more deaths): every input ends."""
        for _ in range(10_000):
            moved = False
            while self.asked:
                self.spawn(self.asked.pop(0))
                moved = True
            for slot in (0, 1):
                if self.retiring and self.retiring[0] == slot:
                    self.retiring.pop(0)
                    self.end_worker(slot, True)
                    self.spawn(slot)
                    moved = True
                if self.core.state[slot] == DOWN:  # (it could not be started: now it can)
                    self.spawn(slot)
                    moved = True
                if self.core.state[slot] == STARTING:
                    self.core.ready(slot)
                    self.act()
                    moved = True
                if self.asked_back[slot]:
                    self.give_back(slot)
                    moved = True
                elif self.inbox[slot]:
                    self.answer(slot, self.inbox[slot][0], True)
                    moved = True
            if not moved:
                break
        left = [i for i in self.inputs if i not in self.outcomes and i not in self.given_up]
        assert not left, f"inputs that never ended: {left}"
        assert not self.core.dispatch.outstanding and not self.core.busy()


CoreMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_core_keeps_its_invariants_in_every_interleaving = CoreMachine.TestCase


def test_a_closed_core_ends_every_input_with_its_error():
    core = HostCore(["cpu"])
    core.spawned(0, Proc(0, 1))
    core.ready(0)
    core.take()
    got = []

    class Into:
        put = staticmethod(got.append)

    core.start(PROGRAMS[0], [Flow(0, Into, None, PROGRAMS[0], "a"), Flow(1, Into, None, PROGRAMS[0], "b")])
    sent = [a for a in core.take() if type(a) is Send]
    assert len(sent) == 1 and len(sent[0].jobs) == 2
    error = SomaError("closed")
    core.close(error)
    core.start(PROGRAMS[0], [Flow(2, Into, None, PROGRAMS[0], "c")])
    for action in core.take():
        action.sink.put(action.item)
    assert got == [(0, False, error), (1, False, error), (2, False, error)]


def test_starts_taken_at_once_are_placed_at_once_a_batching_nodes_inputs_in_bundles_over_the_workers():
    """Eight callers' inputs of a batching node (max_batch 4), posted while the loop was busy and handed to the
    core together, go as two bundles of four, one per idle worker; started one by one (one pump per start), the
    first two go alone and the rest in smaller bundles, or wait."""

    def sends(start) -> list:
        core = HostCore(["cpu", "cpu"])
        for slot in (0, 1):
            core.spawned(slot, Proc(slot, 1))
            core.ready(slot)
        core.take()
        program = PROGRAMS[3]
        flows = [Flow(i, Sink(None), None, program, f"x{i}") for i in range(8)]
        start(core, program, flows)
        return sorted((action.slot, len(action.jobs)) for action in core.take() if type(action) is Send)

    assert sends(lambda core, program, flows: core.start_all([(program, [flow]) for flow in flows])) == [(0, 4),
                                                                                                         (1, 4)]
    one_by_one = sends(lambda core, program, flows: [core.start(program, [flow]) for flow in flows])
    assert len(one_by_one) > 2 and max(n for _, n in one_by_one) < 4, one_by_one


def test_a_batching_nodes_lone_input_whose_worker_died_goes_again_with_its_own_value():
    """The sequence behind a server's None answers (Dec 7), played on the machine: a batching node's lone input
    goes alone (encoded alone), its worker dies before starting it, more inputs come while the replacement
    starts (parked with it), and at its hello they all go: the lone one went in their bundle as None."""
    m = CoreMachine()
    m.spawn_all()
    m.hello(0)
    m.hello(1)
    batch = PROGRAMS.index(next(p for p in PROGRAMS if pieces(p)[0].bundle))
    m.start(batch, 1, 0, False)
    slot = 0 if m.inbox[0] else 1
    m.start(batch, 1, 0, False)
    m.start(batch, 4, 0, False)
    m.die(slot, True)  # (nothing it had was started: all of it waits again, parked for the replacement)
    m.start(batch, 4, 0, False)
    m.hello(slot)
    for s in (0, 1):
        while m.inbox[s]:
            m.answer(s, m.inbox[s][0], True)
    m.outcomes_are_right()
    assert sorted(m.outcomes) == list(range(10))


def test_an_event_out_of_order_is_a_named_error():
    core = HostCore(["cpu"])
    core.spawned(0, Proc(0, 1))
    with pytest.raises(SomaError, match=r"^worker w0 was spawned while the slot was starting"):
        core.spawned(0, Proc(0, 2))


def test_a_straggler_answered_alone_in_its_chunks_last_part_leaves_the_chunks_of_its_piece_as_they_were():
    """A chunk's pace is its typical input's (the median of its largest part), so one slow input answered alone
    (after the rest was handed on, or behind them) does not shrink the piece's next chunks, and with them a map's
    window; every input slow does."""
    core = HostCore(["cpu"])
    proc = Proc(0, 1)
    core.spawned(0, proc)
    core.ready(0)
    core.take()
    program = PROGRAMS[0]
    [piece] = pieces(program)
    got, taken = [], [0]

    class Into:
        put = staticmethod(got.append)

    def chunk_answered(parts: list) -> None:
        """A chunk of as many inputs as `parts` count, answered in those parts: (inputs, each one's seconds)."""
        first, count = taken[0], sum(n for n, _ in parts)
        taken[0] += count
        xs = [f"x{first + i}" for i in range(count)]
        core.start(program, [Chunk(first, Into, program, xs)])
        [job] = [job for action in core.take() if type(action) is Send for job in action.jobs]
        place = 0
        for n, seconds in parts:
            ids = [job.base + p for p in range(place, place + n)]
            values = [evaluate(piece, xs[p]) for p in range(place, place + n)]
            core.outcomes(0, proc, [Bundled(ids, [True] * n, values, seconds, None, True)], 0.0)
            place += n
        for action in core.take():
            action.sink.put(action.item)
        delivered = [y for index, ok, span in got if index >= first for y in span]
        assert delivered == [evaluate(piece, x) for x in xs]

    chunk_answered([(10, 1e-4)])  # (a piece's first job loads its code: not its pace)
    chunk_answered([(10, 1e-4)])
    cheap = core.chunk(piece)
    assert cheap > 100
    chunk_answered([(9, 1e-4), (1, 0.3)])  # one straggler, answered alone after the others
    assert core.chunk(piece) == cheap
    chunk_answered([(1, 0.3), (9, 1e-4)])  # ... or first, alone
    assert core.chunk(piece) == cheap
    chunk_answered([(10, 0.01)])  # every input slow: the next chunks are smaller at once
    assert core.chunk(piece) < cheap // 10


def test_a_stragglers_chunk_inputs_go_elsewhere_only_as_its_worker_gives_them_back():
    """A chunk's job out for long while the other worker idles (`stragglers`): its worker is asked to give back
    the inputs after the one it runs; nothing goes elsewhere until it answers, and then only what it gave back
    (before, the rest went at once, and the inputs its worker began before the ask came ran on both)."""
    m = CoreMachine()
    m.spawn_all()
    m.hello(0)
    m.hello(1)
    m.start_chunk(n=6, retries=0)
    slot = next(s for s in (0, 1) if m.inbox[s])
    job = m.inbox[slot][0]
    assert sorted(job.pending) == [0, 1, 2, 3, 4, 5]
    m.started[slot].add(job.base)  # its worker runs the first input, and runs it long
    assert m.core.stragglers(1e9) == [(slot, job)]
    m.core.hand_on(job, m.running(slot))
    m.act()
    assert m.asked_back[slot] == [[job.base + p for p in range(1, 6)]]
    assert not m.inbox[1 - slot] and m.core.stragglers(1e9) == []  # (asked once, and nothing sent before it answers)
    m.started[slot].update([job.base + 1, job.base + 2])  # it began two more before the ask came
    m.give_back(slot)  # it gives back the three it had not begun
    sent = m.inbox[1 - slot]
    assert len(sent) == 1 and sorted(sent[0].places) == [3, 4, 5] and sorted(job.pending) == [0, 1, 2]
    m.teardown()  # (every input ends once, its own outcome)
    assert sorted(m.outcomes) == list(range(6)) and all(ok for ok, _ in m.outcomes.values())
