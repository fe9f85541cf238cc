"""Running a plan in one process: the interpreter the in-process `Executor`, every `Local`
worker and every Ray actor share, so they cannot disagree about what a node's output is.

    Interpreter(nodes, devices).run(plan, x)      (the plan compiled once into nested calls, a fold)
                 ├ Step ─ invoke(node) ─ [setup once] ─ forward(x, ctx) ─ Done? ─ postcondition ─ unwrap
                 │  (a batching node's: to its Meeting, the node object's one in this process, where the
                 │   inputs there at once share invoke_batch ─ one forward_batch: soma.run.batching)
                 ├ Seq  ─ items in order, each on the previous output
                 └ Wave ─ one thread per branch, each branch whole on its thread;
                          wait for every branch, then raise the first failure in branch order

A node object runs one input (or one batch) at a time, whoever calls it: `invoke` and
`invoke_batch` hold the node's own lock around `setup` and `forward`, so a node needs no
locks of its own (docs/api.md, "Copies"). A run counts as coming at each batching node of
its interpreter until it gets there (`announce` counts inputs submitted and not started yet),
so the first input there waits for the others, and a lone one does not.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref

from ..ctx import Ctx
from ..errors import Cancelled, NodeError, SharedMemoryFull, traceback_text
from ..plan import Plan, Seq, Step, Wave, fold
from ..values import Done, Opaque
from .batching import Entry, Meeting, batch_outputs, failing, is_batching, max_batch_of
from .identity import ByNode
from .postcondition import UNCHECKED, check_postcondition
from .threads import kept_threads, on_threads


def count_in(counts: dict, key, delta: int) -> None:
    """Add `delta` to `counts[key]`, dropping the key at zero (a multiset of what runs now)."""
    n = counts.get(key, 0) + delta
    if n:
        counts[key] = n
    else:
        del counts[key]


class RunState:
    """What one run (one input) shares across its threads: the nodes running now, and a cancel flag.

    In-process it keeps the multiset of running nodes itself (a timeout names them).
    With an `observer` (a worker's status page) it tells it instead:
    `observer.enter(job, node)` / `observer.leave(job, node)`.
    """

    __slots__ = ("running", "cancelled", "job", "index", "owed", "began", "_lock", "_observer")

    def __init__(self, observer=None, job: int = 0, index=None):
        self.running: dict[str, int] = {}
        self.cancelled = False
        self.job = job
        self.index = index  # the input's position in a map (None for run): a batch's trace event lists them
        self.owed: set | None = None  # the Meetings that count this run as coming and it has not reached
        self.began = False  # it has held a node's copy (its code may have run: see `waits`)
        self._lock = threading.Lock() if observer is None else None
        self._observer = observer

    def enter(self, node_id: str) -> None:
        if self.cancelled:
            raise Cancelled(node_id)
        if self._observer is not None:
            self._observer.enter(self.job, node_id)
            return
        with self._lock:
            count_in(self.running, node_id, +1)

    @staticmethod
    def entered_together(states: list, node_id: str) -> None:
        """These runs entered `node_id` for one call (a batch), on this thread: a worker's status page names them
        all (each `enter` names the one run it is told of, so the call's thread named only the last)."""
        observer = states[0]._observer
        if observer is not None:
            observer.enter_batch([state.job for state in states], node_id)

    def waits(self, node_id: str) -> None:
        """The run waits for another input to let go of the node's copy. A worker's status page shows a run
        that has begun no node yet as not started meanwhile: were its worker to die now, it goes elsewhere
        without a try counted, as an input still queued there does (it was named as running the node, and
        failed WorkerDied with no retries, while only the input ahead of it had run)."""
        if self._observer is not None and not self.began:
            self._observer.leave(self.job, node_id, waiting=True)

    def holds(self, node_id: str) -> None:
        """The run has the node's copy after waiting for it (`waits`): the page names it again."""
        if self._observer is not None:
            self._observer.enter(self.job, node_id)

    def leave(self, node_id: str) -> None:
        if self._observer is not None:
            self._observer.leave(self.job, node_id)
            return
        with self._lock:
            count_in(self.running, node_id, -1)

    def running_now(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self.running)


class _Guard:
    """A node object's lock (one input at a time), whether its `setup` has run, and, for a batching node,
    where its inputs meet (one Meeting per node object in this process, whoever runs it)."""

    __slots__ = ("lock", "ready", "meeting", "__weakref__")

    def __init__(self):
        self.lock = threading.Lock()
        self.ready = False
        self.meeting: Meeting | None = None


_guards = ByNode()  # node object (by identity: two equal nodes are two nodes) → its guard
_pinned_guards: dict = {}  # id → (node, guard) of nodes that cannot be weakly referenced: kept as long as the process
_guards_lock = threading.Lock()


def guard_of(node) -> _Guard:
    guard = _found_guard(node)
    if guard is None:
        with _guards_lock:
            guard = _found_guard(node)
            if guard is None:
                guard = _Guard()
                try:
                    _guards.put(node, guard)
                except TypeError:  # not weakly referenceable (__slots__ without __weakref__)
                    _pinned_guards[id(node)] = (node, guard)
    return guard


def _found_guard(node) -> _Guard | None:
    guard = _guards.get(node)
    if guard is None:
        pinned = _pinned_guards.get(id(node))
        if pinned is not None and pinned[0] is node:
            guard = pinned[1]
    return guard


def meeting_of(node) -> Meeting:
    """The one place this batching node object's inputs meet in this process."""
    guard = guard_of(node)
    if guard.meeting is None:
        with _guards_lock:
            if guard.meeting is None:
                guard.meeting = Meeting(node)
    return guard.meeting


def _seq(_: Seq, items: list):
    def run_seq(x, state, spans):
        for run in items:
            x = run(x, state, spans)
        return x
    return run_seq


def wave_outcome(outcomes: list) -> tuple:
    """A wave's `(ok, value)` from its branches' `(ok, value)`, once every branch is over.

    The tuple of outputs; or the first failure in branch order (a SystemExit or
    KeyboardInterrupt first), the others attached as notes (a branch that only stopped
    because its run was abandoned is no failure of its own).
    """
    errors = [value for ok, value in outcomes if not ok]
    if not errors:
        return True, tuple(value for _, value in outcomes)
    # A branch's SystemExit or KeyboardInterrupt (in-process: the user's own exit and Ctrl-C) passes through,
    # whatever branch it came from: it was a note on an earlier branch's error, or raised, by branch order.
    first = next((e for e in errors if not isinstance(e, Exception)), None)
    if first is None:
        first = next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
    for other in errors:
        if other is not first and not isinstance(other, Cancelled):
            first.add_note(f"another branch of the same wave also failed: {other}")
    return False, first


class Interpreter:
    """Runs plans over a catalog with a placement, making each node's `Ctx`.

    `nodes`: id → Node. `devices`: id → device string for placed nodes.
    `worker`: the worker id for `ctx.worker` (None in-process). `allocate`: the
    worker's shared arena for `ctx.empty`. `remote`: in a worker, where the
    exception may not travel: keep its traceback text, and turn `SystemExit` and
    `KeyboardInterrupt` raised by a node into its `NodeError` too (in-process they
    are the user's own Ctrl-C and exit, and pass through). `on_thread`: called
    first on every branch thread (a worker pins its CUDA device).

    A plan is compiled once (`compile`, a fold over its tree) into nested calls:
    running it then costs one Python call per node, not a look at the tree.
    """

    def __init__(self, nodes, devices: dict, worker: str | None = None, allocate=None, remote: bool = False,
                 on_thread=None, page=None):
        self.nodes = nodes
        self.devices = devices
        self.worker = worker
        self.allocate = allocate
        self.remote = remote
        self.on_thread = on_thread
        self.page = page  # a worker's status page: `each`'s call waiting for a node's copy is off it (park)
        self._caught = BaseException if remote else Exception
        self._kept = kept_threads() if remote else None
        self._guards: dict = {}  # node id → its node's guard, found once
        self._forwards: dict = {}  # (node id, held) → (its forward call, its Ctx): _forward_of, made once
        self._compiled: dict = {}  # plan → its compiled call
        # node id → where that batching node's inputs meet (shared with every interpreter holding the node)
        self._meetings = {node_id: meeting_of(node) for node_id, node in nodes.items() if is_batching(node)}
        self.batching = bool(self._meetings)
        self._announced_lock = threading.Lock()
        self.announced = 0  # inputs said to be on their way (`announce`), counted as coming, not yet started

    def run(self, plan: Plan, x, state: RunState | None = None, spans: list | None = None):
        """Run `plan` on `x`. With `spans`, append one `span(...)` per node run (and per setup)."""
        run = self.compile(plan)
        state = state if state is not None else RunState()
        if not self.batching:
            return run(x, state, spans)
        # Counted as coming at each batching node until it gets there (or ends first): an announced input
        # was counted when announced; any other is counted now.
        with self._announced_lock:
            counted = self.announced > 0
            if counted:
                self.announced -= 1
        meetings = self._meetings.values()
        if not counted:
            for meeting in meetings:
                meeting.expect()
        state.owed = set(meetings)
        try:
            return run(x, state, spans)
        finally:
            for meeting in state.owed:  # (every branch is over: a wave waits for all of them)
                meeting.not_coming()
            state.owed = None

    def announce(self, n: int) -> None:
        """`n` inputs will start here soon (submitted to threads that have not taken them yet): a batching node
        waits for them (at most its batch_wait) rather than taking the first alone because the others' threads
        had not started yet. Each `run` that starts takes one announcement; `withdraw` those that never will."""
        if not self.batching or n <= 0:
            return
        with self._announced_lock:
            self.announced += n
        for meeting in self._meetings.values():
            meeting.expect(n)

    def withdraw(self, n: int) -> None:
        """`n` announced inputs will not start (cancelled before their thread took them)."""
        if not self.batching or n <= 0:
            return
        with self._announced_lock:
            # (a run that was never announced may have taken an announcement: then it did not count itself,
            # and fewer are left than were withdrawn; what is left is all there is to take back)
            n = min(n, self.announced)
            self.announced -= n
        for meeting in self._meetings.values():
            meeting.not_coming(n)

    @contextlib.contextmanager
    def arriving(self, n: int):
        """`n` inputs start on threads of their own in this block (`announce`); any not started by its end are
        withdrawn."""
        self.announce(n)
        try:
            yield
        finally:
            with self._announced_lock:
                left = self.announced  # (one block at a time: a copy or a worker's lane runs one such turn)
            self.withdraw(left)

    def each(self, plan: Plan):
        """`call(x)`: `run(plan, x)` for a one-node plan that takes no batches, untraced, inputs never cancelled
        once started (a worker's lone job, or a chunk's inputs): the node's forward call itself, without a
        RunState (the caller names the node on its status page itself). None for any other plan."""
        if type(plan) is not Step or self.batching:
            return None
        return self._forward_of(plan.id)[0]

    def each_held(self, plan: Plan):
        """`(the node's lock, call(x))`: `each`'s call for a caller that holds the lock around a run of inputs
        (a chunk's quick ones: one lock round for the run, where one per input was a tenth of a tiny input's
        cost). The caller must not wait for anything else while it holds the lock. None where `each` is."""
        if type(plan) is not Step or self.batching:
            return None
        return self._guard(plan.id, self.nodes[plan.id]).lock, self._forward_of(plan.id, held=True)[0]

    def compile(self, plan: Plan):
        """`plan` as one call `run(x, state, spans)` (made once per plan)."""
        found = self._compiled.get(plan)
        if found is None:
            found = self._compiled[plan] = fold(plan, self._step, _seq, self._wave)
        return found

    def _step(self, step: Step):
        node_id = step.id
        if node_id in self._meetings:
            return self._meet(node_id)
        invoke = self.invoke

        def run_step(x, state, spans):
            return invoke(node_id, x, state, spans)
        return run_step

    def _meet(self, node_id: str):
        """The step of batching node `node_id`: the input goes to the node's Meeting and shares a call with
        the inputs there with it (soma.run.batching)."""
        meeting = self._meetings[node_id]
        # Inputs of another interpreter share the call when it would be the same call: the same node id,
        # device and process-side context. A traced input only with its own interpreter's (its trace records it).
        same = (node_id, self.devices.get(node_id), self.worker, self.allocate, self.remote)

        def call(xs, entries):
            return self.invoke_batch(node_id, xs, entries)

        def run_step(x, state, spans):
            owed = state.owed
            expected = owed is not None and meeting in owed
            if expected:
                owed.discard(meeting)  # (counted as coming until here; now it waits there)
            key = same if spans is None else (same, self)
            return meeting.call(Entry(x, state, spans, key, call), expected)
        return run_step

    def _wave(self, _: Wave, branches: list):
        """Every branch whole on its own thread; all of them are waited for before raising."""
        on_thread, kept = self.on_thread, self._kept

        def run_wave(x, state, spans):
            def branch(run):
                def call():
                    if on_thread is not None:
                        on_thread()
                    return run(x, state, spans)
                return call

            ok, value = wave_outcome(on_threads([branch(run) for run in branches], kept))
            if not ok:
                try:
                    raise value
                finally:  # (the error's traceback holds this frame: the frame must not hold the error, a cycle)
                    value = None
            return value
        return run_wave

    def _guard(self, node_id: str, node):
        guard = self._guards.get(node_id)
        if guard is None:
            guard = self._guards[node_id] = guard_of(node)
        return guard

    def _forward_of(self, node_id: str, held: bool = False):
        """`(forward, its ctx)`, `forward(x, spans=None)`: setup once, forward, check it returned Done, check the
        postcondition: the Done's value unwrapped; under the node's lock, taken here unless the caller `held`
        it. Made once per node id, in one Python frame: what a chunk's tiny input costs beside its node is
        mostly calls (issue 31), so what is the same for every input is bound here."""
        found = self._forwards.get((node_id, held))
        if found is not None:
            return found
        node, device = self.nodes[node_id], self.devices.get(node_id)
        guard, caught, me = self._guard(node_id, node), self._caught, weakref.ref(self)
        acquire, release, unchecked, page = guard.lock.acquire, guard.lock.release, UNCHECKED, self.page
        # (`me`, weakly: these functions are kept in `_forwards`, and holding the interpreter they were a cycle
        # that kept a dropped graph's nodes, their weights too, until the garbage collector ran)
        ctx = Ctx(node_id, device, self.worker, self.allocate)  # (one for every input: it says the same to all)

        def called(x, spans: list | None = None):  # (the node's lock held: by `forward`, or by the caller)
            if not guard.ready:
                me().setup(node, node_id, ctx, spans)
                guard.ready = True
            try:
                out = node.forward(x, ctx)
            except caught as exc:
                raise me().node_failed(node_id, exc, device=device) from exc
            if type(out) is not Done:
                raise NodeError.failed(node_id, f"forward returned {type(out).__name__}, not Done")
            value = out.value
            if device is not None and type(value) not in unchecked:  # (unplaced, or a number: nothing to check)
                check_postcondition(node_id, device, value)
            return value.obj if type(value) is Opaque else value  # (unwrap's rule, without its call)

        def forward(x, spans: list | None = None):
            # One input at a time per node object (not `with`: its __exit__ costs as much again); one that waits
            # for it is not named running meanwhile (StatusPage.park: RunState.waits is `invoke`'s way)
            if not acquire(False):
                if page is None:
                    acquire()
                else:
                    job = page.park()
                    acquire()
                    page.unpark(job)
            try:
                return called(x, spans)
            finally:
                release()

        found = self._forwards[node_id, held] = (called if held else forward, ctx)
        return found

    def invoke(self, node_id: str, x, state: RunState, spans: list | None = None):
        """Run one node: setup once, forward, check it returned Done, check the postcondition, unwrap."""
        called, ctx = self._forward_of(node_id, held=True)
        guard = self._guard(node_id, self.nodes[node_id])
        lock = guard.lock
        state.enter(node_id)
        start = time.monotonic_ns() if spans is not None else 0
        outcome = "ok"
        try:
            if not lock.acquire(blocking=False):  # another input has the node's copy: this one waits its turn
                state.waits(node_id)
                lock.acquire()
                state.holds(node_id)
            if state.cancelled:  # (cancelled since `enter`, while it waited for the copy: it never starts it)
                lock.release()
                raise Cancelled(node_id)
            state.began = True
            try:
                if not guard.ready:
                    self.setup(self.nodes[node_id], node_id, ctx, spans)
                    guard.ready = True
                    # A setup may take seconds (a model loading): an input cancelled meanwhile never starts the
                    # node (its forward ran ~0.7 s after a cancel sent 0.3 s into a 1 s setup, cancel() True).
                    if state.cancelled:
                        raise Cancelled(node_id)
                    if spans is not None:
                        start = time.monotonic_ns()  # (the node's own span starts after its setup's)
                value = called(x, spans)
            finally:
                lock.release()
        except BaseException as exc:
            # What the node itself raised (under the NodeError that names it), or soma's own verdict.
            cause = exc.__cause__ if type(exc) is NodeError and exc.__cause__ is not None else exc
            outcome = type(cause).__name__
            cause = None  # (a cycle through the traceback: it held the input and the node's locals until gc)
            raise
        finally:
            state.leave(node_id)
            if spans is not None and start:
                spans.append(span(node_id, start, outcome))
        return value

    def is_set_up(self, node_id: str) -> bool:
        """Whether node `node_id`'s copy has run its `setup` (or has none to run), here."""
        return self._guard(node_id, self.nodes[node_id]).ready

    def set_up(self, node_id: str, spans: list | None = None) -> None:
        """Run node `node_id`'s `setup` now if its copy has not (under its lock; a failure raised as `setup`
        raises it, and the next input tries again). For a worker or an actor, which can look again after it
        whether the input is still wanted, before it decodes or runs it: a setup takes seconds (a model
        loading), and a Cancel that came meanwhile must drop an input that has not started its node."""
        node = self.nodes[node_id]
        guard = self._guard(node_id, node)
        if guard.ready:
            return
        device = self.devices.get(node_id)
        # (the Ctx its forward gets, for a node that takes one input at a time: a node may keep setup's)
        ctx = Ctx(node_id, device, self.worker, self.allocate) if is_batching(node) else \
            self._forward_of(node_id, held=True)[1]
        with guard.lock:
            if not guard.ready:
                self.setup(node, node_id, ctx, spans)
                guard.ready = True

    def setup(self, node, node_id: str, ctx: Ctx, spans: list | None = None) -> None:
        """`node.setup(ctx)`, once per node object, before its first forward (when the node defines it).

        Traced, it is a span of its own (kind "setup"): loading a model must not look like a slow forward.
        """
        setup = getattr(node, "setup", None)
        if setup is None:
            return
        start = time.monotonic_ns() if spans is not None else 0
        outcome = "ok"
        try:
            setup(ctx)
        except self._caught as exc:
            outcome = type(exc).__name__
            raise self.node_failed(node_id, exc, doing="setup raised") from exc
        finally:
            if spans is not None:
                spans.append(span(node_id, start, outcome, "setup"))

    def batch_node(self, plan: Plan) -> str | None:
        """The node id when `plan` is one step of a node that takes batches (its inputs need not meet on
        threads: `run_batch` hands them over in one call), else None."""
        if type(plan) is Step and is_batching(self.nodes[plan.id]):
            return plan.id
        return None

    def run_batch(self, node_id: str, xs: list, states: list | None = None, spans: list | None = None,
                  given_up: threading.Event | None = None) -> list:
        """Run the one-node plan of batching node `node_id` on several inputs at once, on this thread:
        `(ok, value)` per input, each its own outcome (its output, or its exception), in one
        `forward_batch` (in batches of at most `max_batch`). What a map's or a worker's inputs cost
        without a thread each to meet at the node. `states`: each input's RunState (one cancelled leaves
        the batch), or None for inputs nobody cancels one by one and nobody traces (a worker's: its host
        cancels a job before its turn; an Executor map's batch: `given_up` is set when the map is left, and
        a call not begun by then never begins, each input Cancelled)."""
        size = max(1, max_batch_of(self.nodes[node_id]))
        outcomes: list = []
        for first in range(0, len(xs), size):
            entries = None if states is None else [Entry(None, state, spans) for state in states[first:first + size]]
            outcomes += self.invoke_batch(node_id, xs[first:first + size], entries, given_up)
        return outcomes

    def invoke_batch(self, node_id: str, xs: list, entries: list | None,
                     given_up: threading.Event | None = None) -> list:
        """Run a batching node once on `xs`: `(ok, value)` per input (see soma.run.batching). Each input's
        state enters the node (a cancelled one leaves the batch); setup once; the node's lock; one span.
        `entries` None: plain inputs, none cancelled one by one, none traced (run_batch). `given_up`, once
        set, cancels every input of the call if it has not begun (checked holding the node's lock)."""
        node = self.nodes[node_id]
        device = self.devices.get(node_id)
        guard = self._guard(node_id, node)
        if entries is None:
            return self._call_batch(node, node_id, device, guard, xs, None, given_up)
        outcomes: list = [None] * len(xs)
        taken = []
        for i, entry in enumerate(entries):
            try:
                entry.state.enter(node_id)
                taken.append(i)
            except Cancelled as err:
                outcomes[i] = (False, err)
        if taken:  # (a worker's page: this thread's slot names every input of the call, not the last one entered)
            RunState.entered_together([entries[i].state for i in taken], node_id)
        traced = next((entries[i].spans for i in taken if entries[i].spans is not None), None)
        start = time.monotonic_ns()
        try:
            results = self._call_batch(node, node_id, device, guard, [xs[i] for i in taken], traced, given_up,
                                       [entries[i].state for i in taken])
        finally:
            for i in taken:
                entries[i].state.leave(node_id)
        for i, result in zip(taken, results):
            outcomes[i] = result
        if traced is not None and taken:
            failed = next((type(v).__name__ for ok, v in results if not ok), "ok")
            traced.append(span(node_id, start, failed, "batch") + [[entries[i].state.index for i in taken]])
        try:
            return outcomes
        finally:  # (a failure's traceback reaches this frame, through _call_batch's: it must not hold them)
            outcomes = results = result = entries = entry = xs = None

    def _call_batch(self, node, node_id: str, device, guard, xs: list, spans, given_up=None,
                    states: list | None = None) -> list:
        """`(ok, value)` per input of `xs`, in one forward_batch (setup first, once). `states`: each input's
        RunState, or None (see invoke_batch)."""
        n = len(xs)  # (counted now: the node may empty or extend its list, `xs.clear()` to let inputs go early)
        if not n:
            return []
        ctx = Ctx(node_id, device, self.worker, self.allocate)
        failure = None
        kept = None  # the positions of the inputs still wanted after a setup, when some were cancelled during it
        try:
            with guard.lock:  # one batch at a time per node object
                if given_up is not None and given_up.is_set():  # (it waited for the lock behind other calls)
                    return failing(n, lambda: Cancelled(node_id))
                if not guard.ready:
                    self.setup(node, node_id, ctx, spans)
                    guard.ready = True
                    # A setup may take seconds (a model loading): an input cancelled meanwhile never starts the
                    # node, as in `invoke`; the others go on without it.
                    if given_up is not None and given_up.is_set():
                        return failing(n, lambda: Cancelled(node_id))
                    if states is not None and any(state.cancelled for state in states):
                        kept = [i for i, state in enumerate(states) if not state.cancelled]
                        if not kept:
                            return failing(n, lambda: Cancelled(node_id))
                        xs = [xs[i] for i in kept]
                try:
                    out = node.forward_batch(xs, ctx)
                except self._caught as exc:
                    failure = exc
        except NodeError as setup_failed:  # every input of the batch fails with its setup's error
            failed = setup_failed
            try:
                return failing(n, lambda: _caused(NodeError(failed.node, failed.args[0],
                                                            remote_traceback=failed.remote_traceback),
                                                  failed.__cause__))
            finally:  # (the error's traceback holds this frame: the frame must not hold the error, a cycle)
                failed = None
        called = n if kept is None else len(kept)
        if failure is not None:  # each input its own NodeError, the node's exception its cause
            try:
                outcomes = failing(called, lambda: _caused(self.node_failed(node_id, failure, device=device),
                                                           failure))
            finally:
                failure = None
        else:
            outcomes = batch_outputs(node_id, out, called, device)
        try:
            if kept is None:
                return outcomes
            merged = failing(n, lambda: Cancelled(node_id))  # (those cancelled during the setup)
            for i, outcome in zip(kept, outcomes):
                merged[i] = outcome
            return merged
        finally:  # (a failure's traceback reaches this frame: it must not hold the failures, a cycle)
            outcomes = merged = outcome = None

    def node_failed(self, node_id: str, exc: BaseException, doing: str = "", device: str | None = None) -> NodeError:
        """The NodeError for an exception a node raised (a full /dev/shm has its own)."""
        if isinstance(exc, SharedMemoryFull):
            return SharedMemoryFull.again(node_id, exc, "a tensor it made with ctx.empty")
        text = traceback_text(exc) if self.remote else None
        what = f"{doing} {type(exc).__name__}" if doing else type(exc).__name__
        missing = missing_device(device)
        if missing:
            what = f"it is placed on `{device}`, but {missing}; {what}"
        return NodeError.failed(node_id, f"{what}: {exc}", remote_traceback=text)


def _caused(err: BaseException, cause) -> BaseException:
    err.__cause__ = cause
    return err


def span(node_id: str, start_ns: int, outcome: str, kind: str = "node") -> list:
    """What a trace records of one node's work, ending now on this thread:
    `[node, start ns, end ns, thread id, outcome, kind, thread name]`; kind "node" (a forward), "setup",
    or "load" (a worker loading the node's code)."""
    thread = threading.current_thread()
    return [node_id, start_ns, time.monotonic_ns(), thread.native_id, outcome, kind, thread.name]


def missing_device(device: str | None) -> str | None:
    """Why this process cannot reach `device` (a `cuda:N`), or None when it can or it is not CUDA.

    Asked only once a placed node has failed: the placement alone is no error (a node
    placed on cuda:0 that makes no tensors runs anywhere, and tests rely on that).
    """
    if not device or not device.startswith("cuda"):
        return None
    torch = sys.modules.get("torch")
    if torch is None:
        return "torch is not imported in this process, so no CUDA device is in use here"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "this machine has no CUDA device (torch.cuda.is_available() is False)"
    if int(device.split(":")[1]) >= count:
        return f"this machine has {count} CUDA device(s) (cuda:0 to cuda:{count - 1})"
    return None
