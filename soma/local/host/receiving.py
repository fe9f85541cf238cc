"""Who receives on a pool's results socket, and when: the caller waiting for its outcome, or the listener.

    caller A: await_item ── nobody receives? ── yes ─▶ _lead: receive (≤ LEAD_S), handle every
                │                                        frame (outcomes go to their sinks), drain;
                │                                        leaving with work still out: hand the
                │ no                                     receiving to a waiting caller, or wake
                ▼                                        the listener
              sleep on its own sink ◀── its outcome, put there by whoever receives
                                    ◀── _LEAD: "you receive now"
    listener thread: sleeps while a caller receives; otherwise polls the socket's descriptor
                     (and a wake pipe for close()), drains, and looks at the workers every PUMP_S

One thread at a time holds `_recv_lock` and only it touches the socket. Every
hand-off between threads is a wake-up, which on two cores costs about as much as
the Python work of a small run: the caller that waits receives for itself.

A mixin of `WorkerPool` (pool.py), apart because it is one idea of its own; it
uses the pool's socket, locks and `_handle`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

from ..._log import warn

PUMP_S = 0.05  # the listener looks at the worker processes this often
LEAD_S = PUMP_S / 2  # a caller receives for this long at most before it leaves it to others
_LEAD = object()  # put in a waiting caller's sink: "nobody is receiving: you do"


class _Waiter:
    __slots__ = ("sink", "handed")

    def __init__(self, sink):
        self.sink = sink
        self.handed = False  # a leader has put _LEAD in its sink


class Receiving:
    """The receiving half of `WorkerPool`: `await_item` for callers, `_listen` for its listener thread."""

    def _init_receiving(self) -> None:
        self._recv_lock = threading.Lock()  # whoever holds it may use the results socket
        self._leading = False  # a caller holds it to receive its own outcome
        self._quiet = threading.Condition()  # the listener sleeps on it meanwhile
        self._waiters: deque = deque()  # callers asleep on their sinks, who could receive next
        self._waiters_lock = threading.Lock()

    def _listen(self) -> None:
        """The pool's receiver whenever no caller is: wake on the socket's descriptor, drain, watch workers.

        While a caller receives for itself (await_item), the listener keeps off the socket
        and sleeps: two threads woken by every message would cost a context switch each on
        a machine whose cores the workers need.
        """
        import select

        self.listener_tid = threading.get_native_id()
        poller = select.poll()
        poller.register(self._results.get(self._zmq.FD), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        last_check = 0.0
        try:
            while not self.closing:
                if self._leading:
                    with self._quiet:
                        if self._leading:
                            self._quiet.wait(PUMP_S)
                else:
                    poller.poll(int(PUMP_S * 1000))  # the descriptor says "look again", not "a message is there"
                if self._recv_lock.acquire(blocking=False):
                    try:
                        if not self.closing:
                            self._drain()
                            now = time.monotonic()
                            if now - last_check >= PUMP_S:
                                last_check = now
                                self._check_workers()
                    finally:
                        self._recv_lock.release()
                self.settle()
                self.flush_frees()
        except Exception as err:  # the pool cannot work without its listener: say so loudly
            warn("soma.local", "soma: the pool's listener stopped: %s: %s", type(err).__name__, err)
            raise
        finally:
            with self._recv_lock:
                self._results.close(0)

    def await_item(self, sink, timeout: float | None):
        """The next item put in `sink` (queue.Empty after `timeout` seconds), received on this thread.

        A caller waiting for its outcome receives it straight from the socket while nobody
        else is receiving (one thread hand-off fewer per run). Otherwise it sleeps on its
        sink until its outcome comes, or until the receiver hands it the receiving: leader
        and followers, with the listener for when no caller waits.
        """
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
        self._leading = True
        try:
            if self.closing:
                return
            deadline = time.monotonic() + seconds
            wait_ms = max(1, int(seconds * 1000))  # one receive timeout: changing it costs a call each time
            while not done() and time.monotonic() < deadline:
                frame = self._receiver.wait(wait_ms)
                if frame is not None:
                    self._handle(frame)
            self._drain()
        finally:
            self._leading = False
            self._recv_lock.release()
        if self.events.busy():
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
        receiver = self._receiver
        while receiver.ready():
            frame = receiver.now()
            if frame is None:
                break
            self._handle(frame)
