"""`Ray.submit`: a Future at once; one thread of the driver settles every submitted input.

    submit(g, x) ──▶ Submission (every call sent) ──▶ InputFuture, returned at once
                     each output ref: ref.future()   Ray's own callback, on Ray's thread, only says so:
                                                     ("ready", input) into the settler's queue
    settler thread   (one per driver, whatever the number of inputs in flight)
      ready    ──▶ the values Ray's futures hold → Tries.after_values (soma.ray.tries): the input's
                   outcome into its InputFuture, or the input sent again (watched again)
      deadline ──▶ one heap of the inputs' deadlines (timeout counts from the input's start, tries
                   included): RunTimeout, its running nodes' actors stopped (driver.expire)
      cancel   ──▶ future.cancel(): the input's calls not started are cancelled, its result dropped

Why a thread of its own and not Ray's callback: a Ray call made from the callback's
thread waits for that very thread (measured: a `ray.get` there never returned), and
settling may call Ray (a failure's culprit, a dead actor's record, the next try).
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time

from ..errors import SomaError
from ..run.aio import FutureSink, InputFuture
from .submission import ActorGraph, Submission, value_of


class Submitted:
    """One input given by `submit`: its tries (its Submission now), its future and deadline."""

    __slots__ = ("tries", "future", "deadline", "timeout", "ray_futures", "source")

    def __init__(self, tries, future: InputFuture, timeout, source):
        self.tries, self.future, self.timeout = tries, future, timeout
        self.source = source  # the Graph: its nodes must live while the input is in flight
        self.deadline = time.monotonic() + timeout if timeout is not None else None
        self.ray_futures: list = []  # Ray's futures of the submission's output refs

    @property
    def submission(self) -> Submission:
        return self.tries.submission


class Settler:
    """The driver's one thread for submitted inputs (started with the first)."""

    def __init__(self, driver):
        self.driver = driver
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.inputs: set = set()  # Submitted inputs not settled yet (touched by the settler thread only)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._order = itertools.count()

    def add(self, graph: ActorGraph, submission: Submission, timeout, source=None) -> InputFuture:
        """The future of a submitted input (its outcome set by the settler)."""
        future = InputFuture()
        one = Submitted(self.driver.tries(graph, submission), future, timeout, source)
        future.on_cancel = lambda: self.events.put(("cancel", one, None))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="ray settler", daemon=True)
                self._thread.start()
        self.events.put(("add", one, None))
        return future

    def close(self, error: SomaError) -> None:
        """Every input not settled gets `error`; the thread ends."""
        if self._thread is not None:
            self.events.put(("close", None, error))
            self._thread.join(10)

    # -- the thread ----------------------------------------------------------------------------
    def _serve(self) -> None:
        deadlines: list = []  # heap of (deadline, order, Submitted)
        while True:
            wait = max(0.0, deadlines[0][0] - time.monotonic()) if deadlines else None
            try:
                what, one, extra = self.events.get(timeout=wait)
            except queue.Empty:
                what = None
            if what == "close":
                for left in list(self.inputs):
                    self._end(left, False, extra)
                return
            if what == "add":
                self.inputs.add(one)
                if one.deadline is not None:
                    heapq.heappush(deadlines, (one.deadline, next(self._order), one))
                self._watch(one)
            elif what == "ready" and one in self.inputs and one.submission is extra:
                try:
                    self._ready(one)
                except Exception as err:  # (a bug: the future says so rather than never being set)
                    self._end(one, False, err)
            elif what == "cancel" and one in self.inputs:
                self.inputs.discard(one)
                self.driver.abandon(one.submission)
            now = time.monotonic()
            while deadlines and deadlines[0][0] <= now:
                _, _, late = heapq.heappop(deadlines)
                if late in self.inputs:
                    self._end(late, False, self.driver.expire(late.submission, late.timeout), release=False)

    def _watch(self, one: Submitted) -> None:
        """Ask Ray to say when every output ref of the input's submission now is ready."""
        submission = one.submission
        one.ray_futures = [ref.future() for ref in submission.refs]
        left = [len(one.ray_futures)]
        lock = threading.Lock()

        def done(_):  # (on Ray's thread: hand over, nothing more)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.events.put(("ready", one, submission))

        for ray_future in one.ray_futures:
            ray_future.add_done_callback(done)

    def _ready(self, one: Submitted) -> None:
        done = one.tries.after_values([value_of(f) for f in one.ray_futures])
        if done is None:
            self._watch(one)  # sent again: its new try's refs
            return
        self._end(one, *done)

    def _end(self, one: Submitted, ok: bool, value, release: bool = True) -> None:
        self.inputs.discard(one)
        if release:  # (Tries.after released it already when it finished there; again costs nothing)
            self.driver.release(one.submission, "ok" if ok else type(value).__name__)
        FutureSink(one.future).put((None, ok, value))

