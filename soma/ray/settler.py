"""`Ray.submit`: a Future at once; one thread of the driver settles every submitted input.

    submit(g, x) ──▶ Submission (every call sent) ──▶ InputFuture, returned at once
                     each output ref: ref.future()   Ray's own callback, on Ray's thread, only says so:
                                                     ("ready", input) into the settler's queue
    settler thread   (one per driver, whatever the number of inputs in flight)
      ready    ──▶ Tries.ready (soma.ray.tries): the input's outcome into its InputFuture, or the input
                   sent again (watched again)
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
from .submission import ActorGraph, Submission


class Submitted:
    """One input given by `submit`: its tries (its Submission now, its deadline) and its future."""

    __slots__ = ("tries", "future", "source")

    def __init__(self, tries, future: InputFuture, source):
        self.tries, self.future = tries, future
        self.source = source  # the Graph: its nodes must live while the input is in flight


class Settler:
    """The driver's one thread for submitted inputs (started with the first)."""

    def __init__(self, driver):
        self.driver = driver
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.inputs: dict = {}  # Tries → its Submitted, for inputs not settled yet (the settler thread's only)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._order = itertools.count()

    def add(self, graph: ActorGraph, submission: Submission, timeout, source=None) -> InputFuture:
        """The future of a submitted input (its outcome set by the settler)."""
        future = InputFuture()
        deadline = time.monotonic() + timeout if timeout is not None else None
        one = Submitted(self.driver.tries(graph, submission, timeout, deadline), future, source)
        future.cancels_with(lambda: self.events.put(("cancel", one.tries, None)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="ray settler", daemon=True)
                self._thread.start()
        self.events.put(("add", one.tries, one))
        return future

    def close(self, error: SomaError) -> None:
        """Every input not settled gets `error`; the thread ends."""
        if self._thread is not None:
            self.events.put(("close", None, error))
            self._thread.join(10)

    # -- the thread ----------------------------------------------------------------------------
    def _ready(self, tries, submission: Submission) -> None:  # (on Ray's thread: hand over, nothing more)
        self.events.put(("ready", tries, submission))

    def _serve(self) -> None:
        deadlines: list = []  # heap of (deadline, order, Tries)
        while True:
            wait = max(0.0, deadlines[0][0] - time.monotonic()) if deadlines else None
            try:
                what, tries, extra = self.events.get(timeout=wait)
            except queue.Empty:
                what = None
            if what == "close":
                for left in list(self.inputs):
                    self._end(left, False, extra)
                return
            if what == "add":
                self.inputs[tries] = extra
                if tries.deadline is not None:
                    heapq.heappush(deadlines, (tries.deadline, next(self._order), tries))
                tries.watch(self._ready)
            elif what == "ready" and tries in self.inputs and tries.submission is extra:
                try:
                    done = tries.ready(self._ready)
                except Exception as err:  # (a bug: the future says so rather than never being set)
                    done = (False, err)
                if done is not None:
                    self._end(tries, *done)
            elif what == "cancel" and tries in self.inputs:
                del self.inputs[tries]
                tries.abandon()
            now = time.monotonic()
            while deadlines and deadlines[0][0] <= now:
                _, _, late = heapq.heappop(deadlines)
                if late in self.inputs:
                    self._end(late, False, late.expire())
            # (while it waits for the next event, this frame must not hold the last input and its outcome)
            tries = extra = done = late = None

    def _end(self, tries, ok: bool, value) -> None:
        one = self.inputs.pop(tries)
        tries.release("ok" if ok else type(value).__name__)  # (released already where it finished: no-op)
        FutureSink(one.future).put((None, ok, value))
