"""The host's listener thread: it receives for the loop when no caller does, and keeps the timers.

    listener thread:  poll (outside the lock) ── the results socket's descriptor, or the wake pipe
                        │  (asleep on a condition instead while a caller receives: `loop.leading`)
                        ▼
                      loop.service(): the lock if free (never waited for), what came handled, the
                      workers looked at now and then (deaths), the lock let go
    timers:           at(when, call): a submitted input's timeout, called on this thread, outside the lock
    wake():           close(), a new timer, or a caller waiting for the lock: look now

It never blocks while holding the loop's lock, so a caller that wants the lock
gets it within one pass. Two threads woken by every message would cost a context
switch each on a machine whose cores the workers need: hence the sleep while a
caller receives.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time

PUMP_S = 0.05  # how often the workers are looked at (a death nobody reported is found within this)


class Listener:
    """The loop's receiver of last resort (see the module's docstring)."""

    def __init__(self, loop):
        self.loop = loop
        self._quiet = threading.Condition()  # it sleeps on it while a caller receives
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._timers: list = []  # heap of (when, n, call): called on this thread once their time has come
        self._timers_lock = threading.Lock()  # (callers push while this thread pops)
        self._timer_count = itertools.count()
        self._thread = None
        self._faults = _FaultLog()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._listen, name="listener", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The loop is closing: wake, and wait until it has let go of the results socket and ended."""
        self.wake()
        self.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5 * PUMP_S + 1)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def at(self, when: float, call) -> None:
        """Call `call()` on this thread once time.monotonic() reaches `when` (within ~PUMP_S)."""
        with self._timers_lock:
            heapq.heappush(self._timers, (when, next(self._timer_count), call))
        self.wake()

    def wake(self) -> None:
        """Look now (the poll returns)."""
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass

    def notify(self) -> None:
        """A caller stopped receiving: if asleep because of it, look now."""
        with self._quiet:
            self._quiet.notify()

    def _listen(self) -> None:
        import select

        loop = self.loop
        poller = select.poll()
        poller.register(loop.pool.results_fd(), select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while not loop.closing:
                try:
                    self._listen_once(poller)
                except Exception as err:  # never silent, never dead: the pool cannot work without its listener
                    self._faults.note(err)
                    time.sleep(PUMP_S)  # (a resource that ran out is given time to come back)
        finally:
            loop.let_go_of_results()

    def _listen_once(self, poller) -> None:
        loop = self.loop
        wait_s = self._due()
        if loop.leading:
            with self._quiet:
                if loop.leading:
                    self._quiet.wait(wait_s)
        elif poller.poll(int(wait_s * 1000)):  # the descriptor says "look again", not "a message is there"
            self._empty_wake_pipe()
        loop.service()

    def _due(self) -> float:
        """Run the timers whose time has come (outside the lock: they take it); seconds until the next one."""
        now = time.monotonic()
        due = []
        with self._timers_lock:
            timers = self._timers
            while timers and timers[0][0] <= now:
                due.append(heapq.heappop(timers)[2])
            left = timers[0][0] - now if timers else PUMP_S
        for call in due:
            call()
        return min(PUMP_S, max(0.0, left))

    def _empty_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass


class _FaultLog:
    """The listener's own failures: the first one at once, with its traceback; then one line per interval with
    how many came since, so a lasting fault is not a flood."""

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
