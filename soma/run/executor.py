"""`Executor`: runs a graph in this process.

A sequence runs in order on the caller's thread; a wave runs each branch whole on
a thread of its own (torch's current device is thread-local, so a branch never
hops threads). See `soma.run.interpreter` for the interpreter itself. `map` runs one
input at a time: in one process there is one instance of each node and one GIL,
so there is nothing to overlap (use `Local` for that); it has the same laziness,
order and errors as every runner's `map`.
"""

from __future__ import annotations

import os
import threading
import time
import weakref

from ..errors import RunTimeout
from .base import RunnerBase, as_graph, checked_retries
from .interpreter import Interpreter, RunState
from .mapping import Inflight, map_outputs
from .trace import Trace


class Executor(RunnerBase):
    """The in-process runner: `Executor().run(g, x)`, `Executor().map(g, xs)`."""

    def __init__(self):
        self._interpreters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph → (version, it)

    def run(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """Run graph `g` on input `x` and return its output.

        With `timeout`, the run happens on a helper thread and `RunTimeout` names
        the nodes still running when it expires. Threads cannot be killed: a
        node already running finishes, and no further node of that run starts.
        """
        checked_retries(retries)  # (accepted, and changes nothing: no worker to lose here)
        g = as_graph(g, "Executor.run")
        return self._run(g, g.devices(), x, timeout, index=None)

    def map(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None, retries=0, errors="raise"):
        """The outputs for the inputs of `xs`, lazily, one input at a time (docs/design.md, "Many inputs")."""
        checked_retries(retries)
        g = as_graph(g, "Executor.map")
        return map_outputs(ExecutorInflight(self, g, g.devices(), timeout), xs, window=window, ordered=ordered,
                           progress=progress, timeout=timeout, errors=errors)

    def _run(self, g, devices: dict, x, timeout, index):
        interpreter = self._interpreter(g, devices)
        plan = g.plan()
        state = RunState()
        trace = self._trace
        spans = [] if trace is not None else None
        start = time.monotonic_ns()
        try:
            if timeout is None:
                return interpreter.run(plan, x, state, spans)
            return _with_timeout(interpreter, plan, x, state, spans, timeout)
        finally:
            if trace is not None:
                _record(trace, spans, devices, index, start)

    def _interpreter(self, g, devices: dict) -> Interpreter:
        """One per graph and placement (its plan compiled once); placing a node again makes a new one."""
        found = self._interpreters.get(g)
        if found is not None and found[0] == g.placement_version:
            return found[1]
        interpreter = Interpreter({node_id: g.node(node_id) for node_id in g.nodes()}, devices)
        self._interpreters[g] = (g.placement_version, interpreter)
        return interpreter

    def _trace_started(self, trace: Trace) -> None:
        trace.process(os.getpid(), f"host (soma.Executor, pid {os.getpid()})")


def _with_timeout(interpreter: Interpreter, plan, x, state: RunState, spans, timeout: float):
    box: dict = {}

    def whole_run() -> None:
        try:
            box["value"] = interpreter.run(plan, x, state, spans)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=whole_run, name="soma-run", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        state.cancelled = True
        raise RunTimeout.after(timeout, dict.fromkeys(state.running_now()), ())
    if "error" in box:
        raise box.pop("error")
    return box["value"]


def _record(trace: Trace, spans: list, devices: dict, index, start: int) -> None:
    pid, tid = os.getpid(), threading.get_native_id()
    trace.thread(pid, tid, threading.current_thread().name)
    trace.span("run" if index is None else f"input {index}", "host", start, time.monotonic_ns(), pid, tid,
               {"input": index})
    trace.node_spans(spans, pid, None, devices, index)


class ExecutorInflight(Inflight):
    """The Executor's in-flight set: inputs wait in a queue, `wait` runs the next one."""

    enforces_timeout = True  # run() itself times out, on a helper thread

    def __init__(self, executor: Executor, g, devices: dict, timeout):
        self.executor, self.g, self.devices, self.timeout = executor, g, devices, timeout
        self.queue: list = []

    def parallelism(self) -> int:
        return 1

    def start(self, items: list) -> None:
        self.queue.extend(items)

    def wait(self, timeout):
        index, x = self.queue.pop(0)
        try:
            return [(index, True, self.executor._run(self.g, self.devices, x, self.timeout, index))]
        except Exception as exc:
            return [(index, False, exc)]

    def close(self) -> None:
        self.queue.clear()
