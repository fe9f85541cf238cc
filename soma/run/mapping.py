"""`runner.map(g, xs)`: many inputs through one graph, the same way on every runner.

The runner supplies an *in-flight set* (`Inflight`): something that starts
inputs and reports what became of them. This module does the rest, once for
every runner: taking inputs lazily from `xs` within the window, order, errors
in their place with their `.index`, per-input timeouts, progress, and stopping
cleanly when the caller leaves the loop.

    xs ──1. take (only while taken - yielded < window)──▶ inflight.start([(index, x), ...])
                                                               │  (the runner's workers)
    caller ◀──2. yield in input order (or as ready)◀── 3. inflight.wait() → [(index, ok, value)]

`MapLoop` keeps the books of those three steps (the window, the order, the
deadlines); `map_outputs` drives it with a plain iterator. Each step is a method
of its own, so another driver (an async one) walks the same loop.
"""

from __future__ import annotations

import time
from collections import deque

from ..errors import SomaError
from .progress import reporter

ERRORS = ("raise", "yield")


class Inflight:
    """What a runner provides for `map`. Every method is called from the iterating thread."""

    # The runner enforces `timeout` itself (map then never calls `expire`).
    enforces_timeout = False

    def parallelism(self) -> int:
        """How many inputs the runner can usefully work on at once (the default window is twice this)."""
        raise NotImplementedError

    def start(self, items: list) -> None:
        """Start these `(index, x)` inputs."""
        raise NotImplementedError

    def wait(self, timeout: float | None) -> list:
        """`(index, ok, value)` for inputs that finished, at least one unless `timeout` (seconds) passed first."""
        raise NotImplementedError

    def expire(self, index: int) -> BaseException:
        """Input `index` ran out of time: stop it, and return the error to raise for it."""
        raise NotImplementedError

    def close(self) -> None:
        """The map is over: cancel what has not started, let the rest finish, release everything."""


def map_outputs(inflight: Inflight, xs, *, window=None, ordered=True, progress=False, timeout=None, errors="raise"):
    """The iterator behind every runner's `map` (see docs/design.md, "Many inputs")."""
    loop = MapLoop(inflight, xs, window=window, ordered=ordered, progress=progress, timeout=timeout, errors=errors)
    source = iter(xs)  # a TypeError for something that is not iterable, here, before anything starts
    return _drive(loop, source)


def _drive(loop: "MapLoop", source):
    try:
        while True:
            wanted = loop.wanted()
            if wanted:
                loop.start(_take(source, wanted, loop))
            yield from loop.outputs()
            if loop.over():
                return
            if not loop.must_wait():
                continue  # room for more inputs: take them before waiting
            loop.finished(loop.inflight.wait(loop.wait_s()))
    except KeyboardInterrupt:  # Ctrl-C while waiting: the traceback stops here, not deep in the runner
        raise KeyboardInterrupt from None
    finally:
        loop.close()


def _take(source, wanted: int, loop: "MapLoop") -> list:
    """Up to `wanted` inputs from `source`; its end, or its own exception, is told to the loop."""
    items = []
    while len(items) < wanted:
        try:
            x = next(source)
        except StopIteration:
            loop.source_ended()
            break
        except Exception as exc:
            loop.source_ended(exc)
            break
        items.append(x)
    return items


WINDOW_LOOK_S = 0.05  # how often a map without `window=` asks the runner how many inputs it works on at once

class MapLoop:
    """The books of one map: what was taken, what is in flight, what is done and not yet handed out.

    `errors="raise"`: a failed input's error is raised in its place (after every earlier output, in
    order), and no input after it is taken. `errors="yield"`: the error object is handed out in its
    place (`.index` set) and the map goes on. The iterable's own exception is raised either way.
    """

    def __init__(self, inflight: Inflight, xs, *, window, ordered: bool, progress, timeout, errors: str):
        if errors not in ERRORS:
            raise ValueError(f"map's errors must be 'raise' or 'yield', got {errors!r}")
        self.inflight = inflight
        self.window = _checked_window(window)
        self.ordered = ordered
        self.timeout = timeout
        self.yield_errors = errors == "yield"
        self.report = reporter(progress, _length(xs), "soma map")
        self.taken = self.yielded = 0
        self.exhausted = False
        self.source_error = None  # xs itself raised: the caller gets it after every earlier output
        self.failure = None  # (index, error) of the earliest input known to have failed (errors="raise")
        self.pending: set = set()  # started and not finished
        self.done: dict = {}  # index → (ok, value): finished and not yet handed out
        self.arrived: deque = deque()  # ordered=False: finished indices in arrival order
        self.deadlines: dict = {}  # index → deadline, in the order taken (one timeout for all: the first is next)
        self.next_index = 0  # ordered=True: the index to hand out next
        self._default = 0  # the default window, as last looked at (`_limit`)
        self._look_at = 0.0  # when to look again

    # -- 1. taking inputs ----------------------------------------------------------------------------------
    def _limit(self) -> int:
        if self.window:
            return self.window
        # The default window follows what the runner measures, looked at most every WINDOW_LOOK_S: asking on
        # every turn took the scheduler's lock once per chunk of outputs (a tenth of a tiny map's host time).
        now = time.monotonic()
        if now >= self._look_at:
            self._default = default_window(self.inflight.parallelism())
            self._look_at = now + WINDOW_LOOK_S
        return self._default

    def wanted(self) -> int:
        """How many inputs to take now: none until a quarter of the window is free (inputs ship in chunks)."""
        if self.exhausted or self.failure is not None:
            return 0
        limit = self._limit()
        in_window = self.taken - self.yielded
        if in_window == 0 or in_window <= limit - max(1, limit // 4):
            return limit - in_window
        return 0

    def source_ended(self, error: Exception | None = None) -> None:
        self.exhausted = True
        self.source_error = error

    def start(self, xs: list) -> None:
        """Start inputs just taken from the source."""
        if not xs:
            return
        items = [(self.taken + i, x) for i, x in enumerate(xs)]
        self.taken += len(items)
        if self.timeout is not None and not self.inflight.enforces_timeout:
            deadline = time.monotonic() + self.timeout
            self.deadlines.update((index, deadline) for index, _ in items)
        self.pending.update(index for index, _ in items)
        self.inflight.start(items)

    # -- 2. handing outputs out ----------------------------------------------------------------------------
    def outputs(self):
        """Every output that may be handed out now, in its turn; a failure is raised in its place."""
        if self.ordered:
            while self.next_index in self.done:
                ok, value = self.done.pop(self.next_index)
                index = self.next_index
                self.next_index += 1
                if not ok and not self.yield_errors:
                    raise _indexed(value, index)
                yield self._handed(value if ok else _indexed(value, index))
            return
        while self.arrived:
            index = self.arrived.popleft()
            ok, value = self.done.pop(index)
            if self.failure is not None and index > self.failure[0]:
                continue  # after a failure: cancelled with the rest
            yield self._handed(value if ok else _indexed(value, index))
        if self.failure is not None and not any(i < self.failure[0] for i in self.pending):
            raise _indexed(self.failure[1], self.failure[0])

    def _handed(self, value):
        self.yielded += 1
        self.report(self.yielded)
        return value

    def over(self) -> bool:
        """Whether the map has ended (its source's own exception, if any, is raised here)."""
        if self.pending or self.done or not (self.exhausted or self.failure is not None):
            return False
        if self.source_error is not None:
            raise self.source_error
        return True

    # -- 3. waiting for the runner ---------------------------------------------------------------------------
    def must_wait(self) -> bool:
        """Whether nothing can be done before the runner finishes something (no room to take more)."""
        if not self.pending:
            return False
        if self.exhausted or self.failure is not None:
            return True
        limit = self._limit()
        return self.taken - self.yielded > limit - max(1, limit // 4)

    def wait_s(self) -> float | None:
        """How long to wait at most: until the oldest input's deadline (None: as long as it takes)."""
        if not self.deadlines:
            return None
        return max(0.0, self.deadlines[next(iter(self.deadlines))] - time.monotonic())

    def finished(self, results: list) -> None:
        """What the runner reports finished, and inputs whose time ran out meanwhile."""
        now = time.monotonic()
        deadlines = self.deadlines
        while deadlines:
            index = next(iter(deadlines))
            if deadlines[index] > now:
                break
            del deadlines[index]
            if index in self.pending and not any(r[0] == index for r in results):
                results.append((index, False, self.inflight.expire(index)))
        for index, ok, value in results:
            if index not in self.pending:
                continue
            self.pending.discard(index)
            deadlines.pop(index, None)
            if not ok and not self.yield_errors:
                if self.failure is None or index < self.failure[0]:
                    self.failure = (index, value)
                if not self.ordered:
                    continue  # raised in its turn by outputs(), never handed out as a value
            self.done[index] = (ok, value)
            if not self.ordered:
                self.arrived.append(index)

    def close(self) -> None:
        self.inflight.close()
        self.report(None)


def default_window(parallelism: int) -> int:
    """The window of a `map` given none: twice the inputs the runner can work on at once."""
    return 2 * max(1, parallelism)


def _indexed(err: BaseException, index: int) -> BaseException:
    if isinstance(err, SomaError):
        err.index = index
    return err


def _checked_window(window):
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"map's window must be a positive number of inputs, got {window!r}")
    return window


def _length(xs):
    try:
        return len(xs)
    except TypeError:
        return None
