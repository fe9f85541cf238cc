"""Callers waiting for outcomes: whoever waits receives for everyone while nobody else does (leader and
followers), so a run costs no hand-off between threads; the others sleep on their sinks until an outcome or
the receiving is handed to them. Part of HostLoop (a base of it: the same lock, pool and core)."""

from __future__ import annotations

import queue
import time

from .listener import PUMP_S

LEAD_S = PUMP_S / 2  # a caller receives for this long at most before it leaves it to others
_LEAD = object()  # put in a waiting caller's sink: "nobody is receiving: you do"


class Receiving:
    """HostLoop's half for callers that wait (its `lock`, `pool`, `core`, `listener` and `_waiters`)."""

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
                except ValueError:  # (handed the receiving just now: take it)
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

    def _lead(self, seconds: float) -> None:
        """Receive on this thread (lock held on entry) until an outcome is ready to deliver or `seconds` pass;
        then let go, deliver, and hand the receiving on when work is still out there."""
        self.leading = True
        try:
            if not self.closing:
                self._act()
                deadline = time.monotonic() + seconds
                wait_ms = max(1, int(seconds * 1000))
                pool = self.pool
                while not self._deliveries and time.monotonic() < deadline:
                    frame = pool.frame(wait_ms)
                    if frame is not None:
                        self._on_frame(frame)
                self._drain()
                self._now_and_then()
        finally:
            self.leading = False
            self._release()
        self._pass_on()

    def _pass_on(self) -> None:
        """Nobody receives now: a waiting caller is handed the receiving, or the listener is woken, when work is
        still out there."""
        if not self.core.busy() or self.lock.locked():
            return
        try:
            waiter = self._waiters.popleft()
        except IndexError:
            self.listener.notify()
            return
        waiter.handed = True
        waiter.sink.put(_LEAD)


class _Waiter:
    __slots__ = ("sink", "handed")

    def __init__(self, sink):
        self.sink = sink
        self.handed = False  # a leader has put _LEAD in its sink
