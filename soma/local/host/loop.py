"""The host's one loop: the only code that locks, and the only code that touches the sockets and the core.

    any thread: start / cancel / forget ──▶ inbox (events) ──┐
                                                             ▼  whoever holds `lock` takes the inbox in,
    the holder of `lock` (a caller waiting for its outcome,     hands every event to the core (core.py),
    or the listener thread when no caller waits)                and carries out the actions it gets back:
          │  frames ◀── pool.receiver (PULL) ◀── workers          Send → sending.encode → pool.send (to
          │  pool.handle(frame) → Ready / Outcomes events           the worker the core chose, only)
          │                                                       CancelAt → pool.cancel (Cancel, GiveBack)
          │  pool.find_dead() every PUMP_S → core.lost             Retire → pool.end → core.lost, then a
          ▼                                                                  replacement: core.spawned
    release the lock, then Deliver each outcome into its sink (a queue, a future, an event loop):
    a future's done-callback runs with no lock held, so it may start or even wait for the next input

A caller waiting for its outcome receives it itself while nobody else does (one
thread hand-off fewer per run: on two cores a wake-up costs about what a small
run's Python does; `Local.run`'s caller looks at the socket before it blocks while
outcomes come quickly and a core is free: the spin, transport.Receiver.wait);
otherwise it sleeps on its sink until its outcome comes, or
until the receiver leaving with work still out hands it the receiving (`_LEAD`).
The listener receives when no caller does; it polls the socket's descriptor
outside the lock and never blocks while holding it.

A thread that posts an event and cannot take the lock never waits for it: the
holder takes the inbox in before it lets go, and looks once more after letting
go (so nothing posted meanwhile is stranded).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque

from ...errors import SomaError
from ...wire.transport import cores_wanted
from .core import HostCore
from .events import CancelAt, Deliver, Outcomes, Ready, Retire, Send, Spawn
from .flows import Flow
from .listener import PUMP_S, Listener
from .loop_maps import MapHints
from .loop_workers import WorkerLife
from .sending import encode

LEAD_S = PUMP_S / 2  # a caller receives for this long at most before it leaves it to others
_LEAD = object()  # put in a waiting caller's sink: "nobody is receiving: you do"


class HostLoop(WorkerLife, MapHints):
    """The owner of the host's state (see the module's docstring): `core` and the pool's sockets."""

    def __init__(self, pool, worker_devices: list[str]):
        self.pool = pool
        self.core = HostCore(worker_devices)
        self.lock = threading.Lock()  # its holder runs the core and uses the sockets
        self.inbox: deque = deque()  # (core method, args) posted by threads that did not get the lock
        self.trace = None  # the runner's open trace block (a worker's start is shown in it), set by the runner
        self.closing = False
        self.all_ready = threading.Event()  # every slot has a worker that said hello
        self._deliveries: list = []  # outcomes to put in their sinks once the lock is let go
        self._unreachable: dict = {}  # slot → items its worker's connection did not take yet (tried again)
        self.leading = False  # a caller holds the lock to receive its own outcome (the listener sleeps)
        self._waiters: deque = deque()  # callers asleep on their sinks, who could receive next
        self._looked_at = 0.0
        self.listener = Listener(self)

    # -- life ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn every worker and open the sockets; the listener receives their hellos."""
        for slot in range(len(self.core.state)):
            self._spawn(slot)
        self.pool.open_sockets()
        self._act()
        self.listener.start()

    def close(self, error: SomaError) -> None:
        """Every input in flight gets `error`; STOP to every worker; the listener lets go of the socket and ends."""
        with self._held():
            self.core.close(error)
            self.closing = True
            self.pool.stop_workers()
        self.listener.stop()  # (it lets go of the results socket on the way out)

    # -- what callers post ------------------------------------------------------------------------------
    def start_inputs(self, program, items, sink, trace, retries: int, graph) -> dict:
        """Start `(index, x)` inputs; each one's `(index, ok, value)` goes to `sink` once. Returns index → Flow."""
        flows = {index: Flow(index, sink, trace, program, x, retries, graph) for index, x in items}
        self._started(program, list(flows.values()))
        return flows

    def start_one(self, program, x, sink, trace, retries: int, graph, lead: float = 0.0) -> Flow:
        """Start input `x` (Local.run, submit): its `(None, ok, value)` goes to `sink` once. Returns its Flow.

        `lead`: the caller waits for it next (Local.run): when the lock is free it keeps it and receives for up
        to that many seconds right away (one taking of the lock for the whole run, not two)."""
        flow = Flow(None, sink, trace, program, x, retries, graph)
        self._started(program, [flow], lead)
        return flow

    def run_one(self, program, x, trace, retries: int, graph, timeout: float | None) -> tuple:
        """`Local.run`'s input: start `x`, wait for it, and return its `(None, ok, value)` (this thread receives
        while the lock is free: start_one's `lead`, then await_item). Its time up first: the input is stopped
        (`expire`) and its outcome is its RunTimeout, unless it ended meanwhile. Interrupted: it is cancelled."""
        sink = queue.SimpleQueue()
        flow = self.start_one(program, x, sink, trace, retries, graph, lead=timeout or 1.0)
        try:
            return self.await_item(sink, timeout)
        except queue.Empty:
            err = self.expire([(flow, None)], timeout)[0]
            item = self.take_nowait(sink)  # it may have ended while it was being stopped
            return item if item is not None else (None, False, err)  # (raised by the caller: a short traceback)
        except KeyboardInterrupt:  # the caller gave up: its input is not wanted any more
            self.cancel([flow])
            raise

    def _started(self, program, flows: list, lead: float = 0.0) -> None:
        if lead and self.lock.acquire(blocking=False):
            try:
                if self.inbox:
                    self._take_inbox()
                self.core.start(program, flows)
            except BaseException:  # (never leave the lock held: every later run would wait for it forever)
                self._release()
                raise
            self._lead(min(lead, LEAD_S), spin=True)
        else:
            self._post(self.core.start, program, flows)

    def cancel(self, flows) -> None:
        self._post(self.core.cancel, list(flows))

    def forget(self, keys: list) -> None:
        """Nodes the host let go: the core and the workers forget their copies."""
        self._post(self._forget, keys)

    def _forget(self, keys: list) -> None:
        self.pool.forget(keys)
        self.core.forget(keys)

    def expire(self, inputs: list, timeout: float) -> list:
        """These inputs' time is up (`(flow, place)`: a chunk's input at `place`, else None): each one's RunTimeout
        naming what still ran, their workers replaced once all are looked at (a batch's inputs each name their node)."""
        with self._held():
            running = {slot: self.pool.running(slot) for slot in {s for f, _ in inputs for s in self.core.where(f)}}
            return [self.core.expire(flow, timeout, running, place) for flow, place in inputs]

    def at(self, when: float, call) -> None:
        """Call `call()` on the listener thread once time.monotonic() reaches `when` (within ~PUMP_S)."""
        self.listener.at(when, call)

    def _post(self, method, *args) -> None:
        self.inbox.append((method, args))
        while self.inbox and self.lock.acquire(blocking=False):
            self._release()

    # -- callers waiting for outcomes (whoever waits receives for everyone while nobody else does) ---------
    def await_item(self, sink, timeout: float | None):
        """The next item put in `sink` (queue.Empty after `timeout` seconds), received on this thread while
        nobody else receives; else asleep on the sink until it comes or the receiving is handed over."""
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = _Waiter(sink)
        while True:
            item = self.take_nowait(sink)
            if item is not None:
                return item
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise queue.Empty
            if self.lock.acquire(blocking=False):
                self._lead(LEAD_S if remaining is None else min(LEAD_S, remaining))
                continue
            waiter.handed = False
            self._waiters.append(waiter)
            try:
                item = sink.get(timeout=remaining)
            except queue.Empty:
                item = None
            if not waiter.handed:
                try:
                    self._waiters.remove(waiter)
                except ValueError:  # (popped by `_pass_on`: handed the receiving just now, or passed by)
                    pass
            if item is _LEAD or item is None:
                continue
            if waiter.handed:
                self._pass_on()
            return item

    def take_nowait(self, sink):
        """The next item in `sink` if there is one, else None; never a hand-off token (one found here came after
        its caller stopped waiting: it is passed on, so nobody is left thinking someone receives)."""
        while True:
            try:
                item = sink.get_nowait()
            except queue.Empty:
                return None
            if item is not _LEAD:
                return item
            self._pass_on()

    def _lead(self, seconds: float, spin: bool = False) -> None:
        """Receive on this thread (lock held on entry) until an outcome is ready to deliver or `seconds` pass;
        then let go, deliver, and hand the receiving on when work is still out there. `spin`: a run's caller,
        who looks at the socket before it sleeps while frames come quickly (transport.Receiver.wait).

        The look at the workers now and then comes first, once what the core decided is sent: done while the
        workers work, not between an outcome's arrival and its caller (a run's way back: on two cores, each step
        on it is a run's time); frames queued already come next, in the order they came. After the outcome,
        what is queued behind it is taken too while work is out (other callers' outcomes, a map's next ones:
        delivered together); with none out, what may still come (a stale job's Result, its releases) is the
        next holder's (its first step) or the listener's (within PUMP_S)."""
        self.leading = True
        try:
            if not self.closing:
                spin = spin and not cores_wanted()  # (asked before sending: this side's threads are calm)
                self._act()
                self._now_and_then()
                deadline = time.monotonic() + seconds
                wait_ms = max(1, int(seconds * 1000))
                receive = self.pool.receiver.wait
                while not self._deliveries and time.monotonic() < deadline:
                    frame = receive(wait_ms, spin)
                    if frame is not None:
                        self._on_frame(frame)
                if self.core.busy():
                    self._drain()
        finally:
            self.leading = False
            self._release()
        self._pass_on()

    def _pass_on(self) -> None:
        """Nobody receives now: a waiting caller is handed the receiving (not one whose outcome is in its sink
        already: it would only hand it on, a wake-up each), or the listener is woken, when work is still out."""
        if not self.core.busy() or self.lock.locked():
            return
        while True:
            try:
                waiter = self._waiters.popleft()
            except IndexError:
                self.listener.notify()
                return
            if waiter.sink.empty():
                break
        waiter.handed = True
        waiter.sink.put(_LEAD)

    # -- holding the lock -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _held(self):
        """The lock, waited for (the listener is woken so it lets go soon: it never waits while holding it),
        let go the one way (`_release`)."""
        if not self.lock.acquire(blocking=False):
            self.listener.wake()
            self.lock.acquire()
        self._take_inbox()
        try:
            yield
        finally:
            self._release()

    def _take_inbox(self) -> None:
        """Hand the posted events to the core, in order; consecutive starts as one (`HostCore.start_all`: one pump)."""
        inbox = self.inbox
        start = self.core.start
        while inbox:
            method, args = inbox.popleft()
            if method == start and inbox and inbox[0][0] == start:
                starts = [args]
                while inbox and inbox[0][0] == start:
                    starts.append(inbox.popleft()[1])
                self.core.start_all(starts)
                continue
            method(*args)

    def _act(self) -> None:
        """Carry out what the core decided, until it decides nothing more (lock held)."""
        out = self.core.out  # (the core's deque of actions, popped here: no call a turn to take them)
        if self.inbox:
            self._take_inbox()
        while True:
            while out:
                action = out.popleft()
                kind = type(action)
                if kind is Deliver:
                    self._deliveries.append(action)
                elif kind is Send:
                    # Not to a worker that took the slot since the core chose: the core sends these jobs again
                    # as it hears of the end of the one it meant (HostCore.lost), and sent here too they ran
                    # twice. (Two workers found dead in one look: the first's end sent its jobs to the second,
                    # whose end replaced it before this Send was carried out; a retried chunk, 5 maps of 6.)
                    if self.pool.workers[action.slot] is action.worker:  # (read, not asked: a call less a run)
                        self._send(action.slot, action.jobs, action.groups)
                elif kind is CancelAt:
                    self.pool.cancel(action.slot, action.job_ids, action.give_back)
                elif kind is Retire:
                    if self.pool.workers[action.slot] is action.worker:  # (as a Send: not its replacement)
                        self._end(action.worker, action.why)
                elif kind is Spawn:
                    self._start_due(action.slot, wanted=True)
            if not self.inbox:
                return
            self._take_inbox()

    def _release(self) -> None:
        """Take in what was posted, carry out the actions, let go of the lock, then deliver the outcomes; look
        once more at the inbox after letting go (something posted meanwhile would wait for the next holder)."""
        while True:
            try:
                self._act()
            finally:
                deliveries, self._deliveries = self._deliveries, []
                self.lock.release()
            for delivery in deliveries:
                delivery.sink.put(delivery.item)
            if not self.inbox or not self.lock.acquire(blocking=False):
                return

    def _send(self, slot: int, jobs: list, groups: list) -> None:
        now = time.monotonic()
        for job in jobs:
            job.sent_at = now
            if job.traced:
                job.sent_ns = time.monotonic_ns()
        items, failed, weights = encode(self._input_store, groups)
        for job, err in failed:
            self.core.unsent([job], err)
        for piece, shm, message in weights:
            self.core.weigh_inputs(piece, shm, message)
        if items and self.pool.send(slot, items) is None:  # its connection is still completing: soon again
            self._unreachable.setdefault(slot, []).extend(items)

    def _input_store(self, create: bool = True):
        """The host's store, for an input about to be copied into /dev/shm: the frees the host owes the workers
        go first (segments of outputs the caller dropped, told otherwise with their worker's next Task or at the
        next look: a new map's first inputs spilled while the last map's outputs still held the room)."""
        self.pool.flush_frees()
        return self.pool.get_store(create)

    def _send_unreachable(self) -> None:
        for slot in list(self._unreachable):
            items = self._unreachable.pop(slot)
            if self.pool.send(slot, items) is None:
                self._unreachable[slot] = items

    def _on_frame(self, frame: bytes) -> None:
        for event in self.pool.handle(frame):
            if type(event) is Outcomes:
                self.core.outcomes(event.slot, event.worker, event.arrived, time.monotonic(), event.returned)
                if event.leaving:
                    self.core.leaving(event.slot)
            elif type(event) is Ready:
                self._ready(event.slot)
        self._act()

    def _drain(self) -> None:
        """Handle every frame queued now (lock held)."""
        queued = self.pool.receiver.queued
        frame = queued()
        while frame is not None:
            self._on_frame(frame)
            frame = queued()

    def service(self) -> None:
        """The listener's turn, when no caller receives: take the lock if it is free, handle what came, look at
        the workers now and then, let go."""
        if self.closing or not self.lock.acquire(blocking=False):
            return
        try:
            self._drain()
            self._now_and_then()
        finally:
            self._release()

    def let_go_of_results(self) -> None:
        """The listener's last act: the results socket is closed, by the lock's holder, for good."""
        with self.lock:
            self.pool.close_results()

    def _now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._looked_at >= PUMP_S:
            self._looked_at = now
            self._look_at_workers()
            for slot, job in self.core.stragglers(now):
                self.core.hand_on(job, self.pool.running(slot))
            if self._unreachable:
                self._send_unreachable()
            self.pool.flush_frees()
            self.pool.trim_if_idle(self.core.busy())


class _Waiter:
    __slots__ = ("sink", "handed")

    def __init__(self, sink):
        self.sink = sink
        self.handed = False  # a leader has put _LEAD in its sink
