"""Batching nodes: the inputs at one node at the same time, handed to one `forward_batch(xs, ctx)` call.

    thread of input 1 ──▶ Batcher.call(x1) ── nobody leads: leads ──┐ waits ≤ batch_wait after the
    thread of input 2 ──▶ Batcher.call(x2) ── waits for its output   │ first, while more inputs may
    thread of input 3 ──▶ Batcher.call(x3) ── waits                  │ come, for at most max_batch
                                                                     ▼
                          forward_batch([x1, x2, x3], ctx)  (the node's lock: one batch at a time)
                          Done([y1, y2, y3]) → each input its own output (or its own error), the
                          postcondition on each; then the next waiter leads the next batch

Wherever inputs meet a node on several threads they can share a call: the Executor's
threads (map, concurrent `run` calls, `arun`), a Local worker running the jobs queued
for one piece together, a Ray actor's concurrent calls. A lone input does not wait:
the leader waits only while other inputs are in flight in the same interpreter and not
yet at this node (they may come); when nothing else is, the batch of one goes at once.
"""

from __future__ import annotations

import threading
import time

from ..errors import NodeError
from ..values import Done, unwrap
from .postcondition import check_postcondition

MAX_BATCH = 32  # a batching node's default `max_batch`
BATCH_WAIT = 0.002  # ... and `batch_wait`, in seconds


def is_batching(node) -> bool:
    """Whether a node takes batches: it defines `forward_batch(self, xs, ctx)`."""
    return callable(getattr(node, "forward_batch", None))


def max_batch_of(node) -> int:
    return int(getattr(node, "max_batch", MAX_BATCH))


def batch_wait_of(node) -> float:
    return float(getattr(node, "batch_wait", BATCH_WAIT))


class Entry:
    """One input at a batching node: its value, its run's state, where its spans go, and its outcome."""

    __slots__ = ("x", "state", "spans", "done", "ok", "value")

    def __init__(self, x, state, spans):
        self.x, self.state, self.spans = x, state, spans
        self.done = False
        self.ok = False
        self.value = None


class Batcher:
    """One batching node of one interpreter: inputs meet here, and leave with their own outputs.

    `run_batch(xs, entries) -> [(ok, value)]` is the interpreter's: the node's call itself (setup once,
    its lock, the checks); `expecting()` says how many inputs in flight may still come to this node.
    """

    def __init__(self, node_id: str, node, run_batch, expecting):
        self.node_id = node_id
        self.max_batch = max(1, max_batch_of(node))
        self.wait_s = batch_wait_of(node)
        self.run_batch = run_batch
        self.expecting = expecting
        self.cond = threading.Condition()
        self.waiting: list[Entry] = []
        self.leading = False

    def call(self, x, state, spans):
        """The node's output for `x`, after a batch that held it (its own error raised, if it failed)."""
        entry = Entry(x, state, spans)
        with self.cond:
            self.waiting.append(entry)
            self.cond.notify_all()  # a leader gathering a batch looks again
            while not entry.done and self.leading:
                self.cond.wait()
            lead = not entry.done
            if lead:
                self.leading = True
        if lead:
            self._lead(entry)
        if not entry.ok:
            raise entry.value
        return entry.value

    def _lead(self, mine: Entry) -> None:
        """Run batches until the one holding `mine` is done; then let a waiter lead the next."""
        try:
            while not mine.done:
                batch = self._gather()
                self._settle(batch, self.run_batch([e.x for e in batch], batch))
        finally:
            with self.cond:
                self.leading = False
                self.cond.notify_all()

    def _gather(self) -> list:
        """The next batch: the inputs waiting now, and those that come within `batch_wait` of the first
        while more may come; at most `max_batch`."""
        with self.cond:
            deadline = time.monotonic() + self.wait_s
            while len(self.waiting) < self.max_batch and self.expecting() > len(self.waiting):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            batch, self.waiting = self.waiting[:self.max_batch], self.waiting[self.max_batch:]
            return batch

    def _settle(self, batch: list, outcomes: list) -> None:
        with self.cond:
            for entry, (ok, value) in zip(batch, outcomes):
                entry.ok, entry.value, entry.done = ok, value, True
            self.cond.notify_all()


def batch_outputs(node_id: str, out, n: int, device) -> list:
    """Each input's `(ok, value)` from what forward_batch returned for `n` inputs: one output per input, in
    order, each checked against the node's placement; a wrong return fails them all."""
    if type(out) is not Done:
        return failing(n, lambda: NodeError.failed(node_id, f"forward_batch returned {type(out).__name__}, not Done"))
    values = out.value
    if not isinstance(values, (list, tuple)):
        return failing(n, lambda: NodeError.failed(
            node_id, f"forward_batch returned Done({type(values).__name__}), not Done(list): one output per input, "
                     f"in order"))
    if len(values) != n:
        return failing(n, lambda: NodeError.failed(node_id, f"forward_batch returned {len(values)} outputs for {n} "
                                                            f"inputs"))
    if device is None:  # (unplaced: nothing to check)
        return [(True, unwrap(value)) for value in values]
    outcomes = []
    for value in values:
        try:
            check_postcondition(node_id, device, value)
            outcomes.append((True, unwrap(value)))
        except NodeError as err:
            outcomes.append((False, err))
    return outcomes


def failing(n: int, make) -> list:
    """`(False, error)` for each of `n` inputs, each its own error object (a map sets each one's `.index`)."""
    return [(False, make()) for _ in range(n)]
