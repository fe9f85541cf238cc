"""`runner.map(g, xs)`: many inputs through one graph, the same way on every runner.

The runner supplies an *in-flight set* (`Inflight`): something that starts
inputs and reports what became of them. This module does the rest, once for
every runner: taking inputs lazily from `xs` within the window, order, errors
in their place with their `.index`, per-input timeouts, progress, and stopping
cleanly when the caller leaves the loop.

    xs ──take (only while taken - yielded < window)──▶ inflight.start([(index, x), ...])
                                                            │  (the runner's workers)
    caller ◀── yield in input order (or as ready) ◀── inflight.wait() → [(index, ok, value)]
"""

from __future__ import annotations

import sys
import time
from collections import deque

from ..errors import SomaError


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


def map_outputs(inflight: Inflight, xs, *, window=None, ordered=True, progress=False, timeout=None):
    """The iterator behind every runner's `map` (see SPEC 7.4)."""
    window = _checked_window(window)
    total = _length(xs)
    source = iter(xs)  # a TypeError for something that is not iterable, here, before anything starts
    report = _progress(progress, total)
    return _outputs(inflight, source, window, ordered, report, timeout)


def _outputs(inflight: Inflight, source, window, ordered, report, timeout):
    taken = yielded = 0
    exhausted = False
    source_error = None  # xs itself raised: the caller gets it after every earlier output
    failure = None  # (index, error) of the earliest input known to have failed
    pending: set = set()  # started and not finished
    done: dict = {}  # index → (ok, value): finished and not yet yielded
    arrived: deque = deque()  # ordered=False: finished indices in arrival order (failures aside)
    deadlines: dict = {}  # index → deadline, in the order taken (one timeout for all: the first is next)
    next_index = 0  # ordered=True: the index to yield next
    try:
        while True:
            # 1. Take inputs while there is room; in chunks, so a deep window ships in batches.
            if not exhausted and failure is None:
                limit = window or default_window(inflight.parallelism())
                in_window = taken - yielded
                if in_window == 0 or in_window <= limit - max(1, limit // 4):
                    items = []
                    while in_window + len(items) < limit:
                        try:
                            x = next(source)
                        except StopIteration:
                            exhausted = True
                            break
                        except Exception as exc:
                            exhausted, source_error = True, exc
                            break
                        items.append((taken, x))
                        taken += 1
                    if items:
                        if timeout is not None and not inflight.enforces_timeout:
                            deadline = time.monotonic() + timeout
                            deadlines.update((index, deadline) for index, _ in items)
                        pending.update(index for index, _ in items)
                        inflight.start(items)

            # 2. Yield what may be yielded now; an input's error is raised in its place.
            if ordered:
                while next_index in done:
                    ok, value = done.pop(next_index)
                    if not ok:
                        raise _indexed(value, next_index)
                    next_index += 1
                    yielded += 1
                    report(yielded)
                    yield value
            else:
                while arrived:
                    index = arrived.popleft()
                    ok, value = done.pop(index)
                    if failure is not None and index > failure[0]:
                        continue  # after a failure: cancelled with the rest
                    yielded += 1
                    report(yielded)
                    yield value
                if failure is not None and not any(i < failure[0] for i in pending):
                    raise _indexed(failure[1], failure[0])
            if not pending and not done and (exhausted or failure is not None):
                if source_error is not None:
                    raise source_error
                return
            if not pending or (not exhausted and failure is None and taken - yielded <= limit - max(1, limit // 4)):
                continue  # room for more inputs: take them before waiting

            # 3. Wait for what the runner finishes, or for the oldest input's deadline.
            wait_s = None
            if deadlines:
                wait_s = max(0.0, deadlines[next(iter(deadlines))] - time.monotonic())
            finished = inflight.wait(wait_s)
            now = time.monotonic()
            while deadlines:
                index = next(iter(deadlines))
                if deadlines[index] > now:
                    break
                del deadlines[index]
                if index in pending and not any(f[0] == index for f in finished):
                    finished.append((index, False, inflight.expire(index)))
            for index, ok, value in finished:
                if index not in pending:
                    continue
                pending.discard(index)
                deadlines.pop(index, None)
                done[index] = (ok, value)
                if not ok:
                    if failure is None or index < failure[0]:
                        failure = (index, value)
                    if not ordered:
                        del done[index]
                elif not ordered:
                    arrived.append(index)
    finally:
        inflight.close()
        report(None)


def default_window(parallelism: int) -> int:
    """The window of a `map` given none: twice the inputs the runner can work on at once (SPEC 7.4)."""
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


def _progress(progress, total):
    """A callable taking the number of outputs so far (None at the end)."""
    if progress is False or progress is None:
        return lambda done: None
    if progress is True:
        return _Bar(total) if sys.stderr.isatty() else (lambda done: None)
    if callable(progress):
        return lambda done: None if done is None else progress(done, total)
    raise TypeError(f"map's progress must be True, False or a callable progress(done, total), got {progress!r}")


class _Bar:
    """One line on stderr: done (of total), rate, elapsed, and time left when the total is known."""

    EVERY_S = 0.1

    def __init__(self, total):
        self.total = total
        self.start = time.monotonic()
        self.last = 0.0
        self.done = 0

    def __call__(self, done) -> None:
        now = time.monotonic()
        if done is not None:
            self.done = done
            if now - self.last < self.EVERY_S and done != self.total:
                return
        self.last = now
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        text = f"soma map: {self.done}"
        if self.total is not None:
            text += f"/{self.total}"
        text += f" done, {rate:,.1f}/s, {elapsed:.1f} s"
        if self.total is not None and rate > 0 and self.done < self.total:
            text += f", {(self.total - self.done) / rate:.1f} s left"
        sys.stderr.write("\r" + text + "\x1b[K" + ("\n" if done is None else ""))
        sys.stderr.flush()
