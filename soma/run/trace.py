"""`runner.trace(path)`: a timeline of what ran where, as Chrome trace-event JSON.

    with local.trace("run.json"):
        for y in local.map(g, xs): ...
    # open run.json in https://ui.perfetto.dev or chrome://tracing

One track per process (the host, each worker or actor; an event's `pid` is that
process's OS pid) and per thread. Every node execution is one complete event
(`"ph": "X"`) named by the node id, with `args` {node, device, worker, input,
outcome}; the host's own steps (encoding an input, shared-memory copies, waiting,
decoding, the postcondition) are events of category `host`.

One clock: every process of one machine reads the same CLOCK_MONOTONIC
(`time.monotonic_ns()`), so workers' timestamps need no translation; `Ray` actors
on other machines are brought onto the driver's clock by an offset measured at
the start of the block (see docs/trace.md). Times are microseconds from the start
of the block.

Outside a block nothing is recorded: runners check one attribute per run.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

from ..errors import SomaError


class Trace:
    """The events of one `trace` block."""

    def __init__(self, path):
        self.path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(self.path))
        writable = os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK)
        if not self.path or os.path.isdir(self.path) or not writable:
            why = ("names no file" if not self.path else
                   "is a folder: name a file in it" if os.path.isdir(self.path) else
                   f"its folder {folder} does not exist" if not os.path.isdir(folder) else
                   f"its folder {folder} is not writable")
            raise SomaError(f"trace({self.path!r}): {why} (the trace is written there when the block ends; said now, "
                            f"not then, when what it recorded would be lost)")
        self.start_ns = time.monotonic_ns()
        self.end_ns = None
        self._events: list = []
        self._lock = threading.Lock()
        self._processes: dict[int, str] = {}
        self._threads: dict[tuple[int, int], str] = {}
        self.open = True
        self.process(os.getpid(), "host")

    # -- recording (from any thread) -------------------------------------------------------------
    def process(self, pid: int, name: str) -> None:
        with self._lock:
            self._processes[pid] = name

    def thread(self, pid: int, tid: int, name: str) -> None:
        if (pid, tid) not in self._threads:
            with self._lock:
                self._threads.setdefault((pid, tid), name)

    def span(self, name: str, cat: str, start_ns: int, end_ns: int, pid: int, tid: int, args: dict) -> None:
        """A complete event; ignored once the block has ended (runs still in flight in other threads)."""
        if not self.open:
            return
        event = {"name": name, "cat": cat, "ph": "X", "ts": (start_ns - self.start_ns) / 1000,
                 "dur": max(0, end_ns - start_ns) / 1000, "pid": pid, "tid": tid, "args": args}
        with self._lock:
            self._events.append(event)

    def interval(self, name: str, cat: str, start_ns: int, end_ns: int, pid: int, span_id, args: dict) -> None:
        """An interval that may overlap others of its process (an input in flight, a job at a worker):
        a pair of async events, which Perfetto draws on tracks of their own."""
        if not self.open:
            return
        common = {"name": name, "cat": cat, "pid": pid, "tid": pid, "id": span_id}
        begin = dict(common, ph="b", ts=(start_ns - self.start_ns) / 1000, args=args)
        end = dict(common, ph="e", ts=(max(start_ns, end_ns) - self.start_ns) / 1000)
        with self._lock:
            self._events.extend((begin, end))

    def node_spans(self, spans, pid: int, worker, devices: dict, index, offset_ns: int = 0) -> None:
        """The spans a runner's interpreter recorded (`soma.run.interpreter.span`), as events: category
        `node` for a node's run (named by the node), `setup` and `load` (named "setup x", "load x")."""
        for span in spans:
            node, start, end, tid, outcome = span[:5]
            kind = span[5] if len(span) > 5 else "node"
            name = span[6] if len(span) > 6 else f"thread {tid}"
            self.thread(pid, tid, f"{worker} {name}" if worker is not None else name)
            args = {"node": node, "device": devices.get(node), "worker": worker}
            if kind == "batch":  # a batching node's one call for several inputs: one event, which inputs
                args.update(inputs=span[7], batch=len(span[7]), outcome=outcome)
                self.span(node, "node", start + offset_ns, end + offset_ns, pid, tid, args)
                continue
            args.update(input=index, outcome=outcome)
            self.span(node if kind == "node" else f"{kind} {node}", kind, start + offset_ns, end + offset_ns, pid,
                      tid, args)

    @contextlib.contextmanager
    def host_step(self, name: str, **args):
        """A span of the host's own work on this thread: `with trace.host_step("encode input", bytes=n): ...`."""
        start = time.monotonic_ns()
        try:
            yield args
        finally:
            tid = threading.get_native_id()
            self.thread(os.getpid(), tid, threading.current_thread().name)
            self.span(name, "host", start, time.monotonic_ns(), os.getpid(), tid, args)

    # -- the end ----------------------------------------------------------------------------------
    def close(self) -> None:
        """End the block and write the file (valid JSON even while other threads still record)."""
        with self._lock:
            self.open = False
            self.end_ns = time.monotonic_ns()
            events = list(self._events)
            processes, threads = dict(self._processes), dict(self._threads)  # (others may still name theirs)
        meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
                for pid, name in processes.items()]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
                 for (pid, tid), name in threads.items()]
        doc = {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {"clock": "CLOCK_MONOTONIC", "start_ns": self.start_ns,
                          "duration_us": (self.end_ns - self.start_ns) / 1000},
        }
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.path)


class Traced:
    """Mixin for runners: `trace(path)` and the one attribute the hot path checks (`_trace`)."""

    _trace: Trace | None = None

    @property
    def current_trace(self) -> Trace | None:
        """The trace block open now, or None (read once per input: outside a block nothing is recorded)."""
        return self._trace

    @contextlib.contextmanager
    def trace(self, path):
        """Record every node execution in this block and write it to `path` as Chrome trace-event JSON."""
        if self._trace is not None:
            raise SomaError(f"this {type(self).__name__} is already tracing into {self._trace.path}: "
                            f"one trace block at a time per runner")
        trace = Trace(path)
        self._trace_started(trace)
        self._trace = trace
        try:
            yield trace
        finally:
            self._trace = None
            try:
                self._trace_ending(trace)
            finally:
                trace.close()

    def _trace_started(self, trace: Trace) -> None:
        """Name this runner's processes and threads in the trace (each runner knows its own)."""

    def _trace_ending(self, trace: Trace) -> None:
        """The block ends: add what only the end can collect (Ray: the actors' records), before the file is
        written. Nothing by default."""
