"""Who receives from the workers, and when: the caller waiting for its outcome, or the listener thread.

    caller A: await_item ── nobody receives? ── yes ─▶ _lead: receive (≤ LEAD_S); each frame:
                │                                        pool.handle(frame) → events → scheduler
                │                                        (outcomes go to their sinks); drain;
                │ no                                     leaving with work still out: hand the
                ▼                                        receiving to a waiting caller, or wake
              sleep on its own sink ◀── its outcome,     the listener
                                        put there by whoever receives
                                    ◀── _LEAD: "you receive now"
    listener thread: sleeps while a caller receives; otherwise polls the socket's descriptor
                     (and a wake pipe for close()), drains, and every PUMP_S asks the pool for
                     dead workers: each one's `Lost` goes to the scheduler; then the pool starts
                     the workers that are due (a slot waiting after deaths before hello)

One thread at a time holds `_recv_lock` and only it touches the results socket
(through the pool). Every hand-off between threads is a wake-up, which on two
cores costs about as much as the Python work of a small run: the caller that
waits receives for itself.

Calls go down: this module asks the pool for frames and hands what they mean to
the scheduler; neither of them calls back up here.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
import time
from collections import deque

from ...errors import SomaError
from .pool import PUMP_S

LEAD_S = PUMP_S / 2  # a caller receives for this long at most before it leaves it to others
_LEAD = object()  # put in a waiting caller's sink: "nobody is receiving: you do"


class _Waiter:
    __slots__ = ("sink", "handed")

    def __init__(self, sink):
        self.sink = sink
        self.handed = False  # a leader has put _LEAD in its sink


class Receiving:
    """Receives the pool's frames for the scheduler: `await_item` for callers, a listener thread otherwise."""

    def __init__(self, pool, scheduler):
        self.pool = pool
        self.scheduler = scheduler
        self.closing = False
        self._recv_lock = threading.Lock()  # whoever holds it may use the results socket
        self._receiver = None  # the thread holding it (check_can_wait)
        self._leading = False  # a caller holds it to receive its own outcome
        self._quiet = threading.Condition()  # the listener sleeps on it meanwhile
        self._waiters: deque = deque()  # callers asleep on their sinks, who could receive next
        self._waiters_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()  # close() and new timers wake the listener through it at once
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._listener = None
        self._looked_at = 0.0  # when the workers were last looked at (by the listener or a leading caller)
        self._faults = _FaultLog()
        self._timers: list = []  # heap of (when, n, call): the listener calls each once its time has come
        self._timers_lock = threading.Lock()
        self._timer_count = itertools.count()

    # -- life ------------------------------------------------------------------------------------
    def start(self) -> None:
        self._listener = threading.Thread(target=self._listen, name="listener", daemon=True)
        self._listener.start()

    def close(self) -> None:
        """Stop receiving: the listener lets go of the results socket and ends (within a few PUMP_S)."""
        self.closing = True
        try:
            os.write(self._wake_w, b"\0")  # the listener, asleep on its poll: look now
        except OSError:
            pass
        with self._quiet:
            self._quiet.notify_all()  # ... or asleep while a caller was receiving
        listener = self._listener
        if listener is not None and listener is not threading.current_thread():
            listener.join(5 * PUMP_S + 1)  # it closes the results socket on the way out
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def at(self, when: float, call) -> None:
        """Call `call()` on the listener thread once time.monotonic() reaches `when` (within ~PUMP_S): how a
        submitted input's timeout is kept without a thread waiting for it."""
        with self._timers_lock:
            heapq.heappush(self._timers, (when, next(self._timer_count), call))
        try:
            os.write(self._wake_w, b"\0")  # (the listener may be asleep for longer than this timer waits)
        except OSError:
            pass

    def _due(self) -> float:
        """Run the timers whose time has come; seconds until the next one (PUMP_S at most)."""
        now = time.monotonic()
        due = []
        with self._timers_lock:
            while self._timers and self._timers[0][0] <= now:
                due.append(heapq.heappop(self._timers)[2])
            left = self._timers[0][0] - now if self._timers else PUMP_S
        for call in due:
            call()
        return min(PUMP_S, max(0.0, left))

    # -- the listener --------------------------------------------------------------------------------
    def _listen(self) -> None:
        """The pool's receiver whenever no caller is: wake on the socket's descriptor, drain, watch workers.

        While a caller receives for itself (await_item), the listener keeps off the socket
        and sleeps: two threads woken by every message would cost a context switch each on
        a machine whose cores the workers need.
        """
        import select

        pool = self.pool
        poller = select.poll()
        poller.register(pool.results_fd(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not self.closing:
                try:
                    self._listen_once(poller)
                except Exception as err:  # never silent, never dead: the pool cannot work without its listener
                    self._faults.note(err)
                    time.sleep(PUMP_S)  # (a resource that ran out is given time to come back)
        finally:
            with self._recv_lock:
                pool.close_results()

    def _listen_once(self, poller) -> None:
        wait_s = self._due()
        if self._leading:
            with self._quiet:
                if self._leading:
                    self._quiet.wait(wait_s)
        else:
            if poller.poll(int(wait_s * 1000)):  # the descriptor says "look again", not "a message is there"
                self._empty_wake_pipe()
        if self._recv_lock.acquire(blocking=False):
            self._receiver = threading.get_ident()
            try:
                if not self.closing:
                    self._drain()
                    self._look_at_workers_now_and_then()
            finally:
                self._receiver = None
                self._recv_lock.release()
        self.pool.apply_host_releases()
        self.pool.flush_frees()
        self.pool.trim_if_idle(self.scheduler.busy())

    def _empty_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _look_at_workers_now_and_then(self) -> None:
        """Every PUMP_S, whoever receives (the listener, or a caller that leads for long) looks for dead
        workers: a caller busy with a stream of outputs must not keep a death from being noticed."""
        now = time.monotonic()
        if now - self._looked_at >= PUMP_S:
            self._looked_at = now
            self._look_at_workers()

    def _look_at_workers(self) -> None:
        """Dead workers: what they sent before dying is received first (still a result), then their end; and
        slots whose next worker is due (after a wait, or when none could be started) start it."""
        dead = self.pool.find_dead()
        if dead:
            self._drain()
            for worker in dead:
                lost = self.pool.retire_worker(worker)
                if lost is not None:
                    self.scheduler.handle([lost])
        self.pool.restart_due()

    # -- callers ---------------------------------------------------------------------------------------
    def check_can_wait(self, what: str) -> None:
        """Refuse to wait for an outcome on the thread that is receiving outcomes: there, a future's
        done-callback (which concurrent.futures runs on the thread that sets the result) would wait for a
        result only it could receive, forever."""
        if self._receiver == threading.get_ident():
            raise SomaError(
                f"{what} cannot wait on the thread that receives soma.Local's results (a done-callback of a "
                f"future from Local.submit runs there): that thread cannot receive while it waits, so it would "
                f"wait forever. In a callback, start the next input with Local.submit and chain on its future, "
                f"or wait from another thread")

    def await_item(self, sink, timeout: float | None, what: str = "Local.run"):
        """The next item put in `sink` (queue.Empty after `timeout` seconds), received on this thread
        (`what` waits: named in the error on the thread that receives, check_can_wait).

        A caller waiting for its outcome receives it straight from the socket while nobody
        else is receiving (one thread hand-off fewer per run). Otherwise it sleeps on its
        sink until its outcome comes, or until the receiver hands it the receiving: leader
        and followers, with the listener for when no caller waits.
        """
        self.check_can_wait(what)
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter = _Waiter(sink)
        while True:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                item = self.take_nowait(sink)  # (its time is up, but its outcome may be there)
                if item is None:
                    raise queue.Empty
                return item
            self._lead(lambda: not sink.empty(), LEAD_S if remaining is None else min(LEAD_S, remaining))
            item = self.take_nowait(sink)  # it came while this thread received: no need to wait in line
            if item is not None:
                return item
            waiter.handed = False
            with self._waiters_lock:
                self._waiters.append(waiter)
            try:
                item = sink.get(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                item = None
            with self._waiters_lock:
                if not waiter.handed:
                    self._waiters.remove(waiter)
            if item is _LEAD:
                continue
            if waiter.handed:  # handed the receiving as its outcome came: take it and pass it on
                self._lead(lambda: True, 0.0)
            if item is not None:
                return item

    def take_nowait(self, sink):
        """The next item in `sink` if there is one, else None; never a hand-off token.

        A token found here came after its caller stopped waiting (its outcome, or its
        time, came first): the hand-off is honoured (this thread drains what is queued
        and passes the receiving on), so nobody is left thinking someone receives.
        """
        while True:
            try:
                item = sink.get_nowait()
            except queue.Empty:
                return None
            if item is not _LEAD:
                return item
            self._lead(lambda: True, 0.0)

    def _lead(self, done, seconds: float) -> None:
        """Receive on this thread until `done()` or `seconds` pass, if nobody else is receiving; then
        hand the receiving to a waiting caller, or wake the listener, when work is still out there.

        It drains what is queued before it lets go: the socket's descriptor signals new
        arrivals only, so whoever receives next must not find old ones it was never told of.
        """
        if not self._recv_lock.acquire(blocking=False):
            return
        self._leading, self._receiver = True, threading.get_ident()
        try:
            if self.closing:
                return
            pool, handle = self.pool, self.scheduler.handle
            deadline = time.monotonic() + seconds
            wait_ms = max(1, int(seconds * 1000))  # one receive timeout: changing it costs a call each time
            while not done() and time.monotonic() < deadline:
                frame = pool.frame(wait_ms)
                if frame is not None:
                    handle(pool.handle(frame))
            self._drain()
            try:
                self._look_at_workers_now_and_then()
            except Exception as err:  # another worker's end is not this caller's failure: the listener's way
                self._faults.note(err)
        finally:
            self._leading, self._receiver = False, None
            self._recv_lock.release()
        if self.scheduler.busy():
            with self._waiters_lock:
                waiter = self._waiters.popleft() if self._waiters else None
                if waiter is not None:
                    waiter.handed = True
            if waiter is not None:
                waiter.sink.put(_LEAD)
            else:
                with self._quiet:
                    self._quiet.notify()

    def _drain(self) -> None:
        """Handle every frame queued now (receive lock held)."""
        pool, handle = self.pool, self.scheduler.handle
        frame = pool.frame_now()
        while frame is not None:
            handle(pool.handle(frame))
            frame = pool.frame_now()


class _FaultLog:
    """The listener's own failures (a resource ran out under it, or a bug): the first one at once, with its
    traceback; then one line per interval with how many came since, so a lasting fault is not a flood."""

    INTERVAL_S = 10.0

    def __init__(self):
        self.since = 0
        self.last = float("-inf")

    def note(self, err: BaseException) -> None:
        now = time.monotonic()
        if now - self.last < self.INTERVAL_S:
            self.since += 1
            return
        more = f" ({self.since} more since the last report)" if self.since else ""
        first = self.last == float("-inf")
        self.since, self.last = 0, now
        import logging

        logging.getLogger("soma.local").warning(
            "soma: the pool's listener met %s: %s%s; it goes on (runs it touches fail with a SomaError that says "
            "why)", type(err).__name__, err, more, exc_info=err if first else None)
