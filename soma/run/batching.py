"""Batching nodes: the inputs at one node at the same time, handed to one `forward_batch(xs, ctx)` call.

One `Meeting` per batching node object in this process, whoever runs it (every Executor, every
interpreter of a graph holding it: a map's threads, concurrent `run`s, `arun`s and `submit`s, traced or not):

    run starts (or is announced) ──▶ expect()            coming += 1: an input on its way to the node
    thread of input 1 ──▶ call(entry) ── nobody leads: leads ──┐ waits while inputs are coming, at most
    thread of input 2 ──▶ call(entry) ── waits for its output   │ batch_wait after the first waiting,
    thread of input 3 ──▶ call(entry) ── waits                  │ for at most max_batch
                                                                ▼
                         entries[0].call([x1, x2, x3], entries)  (the interpreter's: the node's lock,
                         setup once, one forward_batch, each input its own output or its own error)
                         → each waiter wakes with its own; the leader leads again until its own is
                         done, then a waiter leads the next batch
    run ends before the node (failed, cancelled) ──▶ not_coming()

The callers' own threads wait (no thread per waiting input). A lone input does not wait: the
leader waits only while inputs counted as coming have not arrived; when none is, the batch goes at
once. Inputs of several interpreters batch together when their calls are the same (`Entry.key`: the
node's id, device, worker; a traced input only with its own interpreter's, whose trace gets the event).
"""

from __future__ import annotations

import threading
import time

from ..errors import NodeError
from ..values import Done, unwrap
from .postcondition import check_postcondition


def is_batching(node) -> bool:
    """Whether a node takes batches: it defines `forward_batch(self, xs, ctx)`."""
    return callable(getattr(node, "forward_batch", None))


def max_batch_of(node) -> int:
    return int(node.max_batch)  # (soma.Node's class attribute, unless the node sets its own)


def batch_wait_of(node) -> float:
    return float(node.batch_wait)


class Entry:
    """One input at a batching node: its value, its run's state, where its spans go, which calls it may share
    (`key`), the call that runs a batch of them (`call(xs, entries) -> [(ok, value)]`), and its outcome."""

    __slots__ = ("x", "state", "spans", "key", "call", "at", "done", "ok", "value")

    def __init__(self, x, state, spans, key=None, call=None):
        self.x, self.state, self.spans, self.key, self.call = x, state, spans, key, call
        self.at = 0.0  # when it came to the node (its batch waits at most batch_wait after the oldest's)
        self.done = False
        self.ok = False
        self.value = None


class Meeting:
    """One batching node object's meeting point: inputs wait here, and leave with their own outputs."""

    def __init__(self, node):
        self.max_batch = max(1, max_batch_of(node))
        self.wait_s = batch_wait_of(node)
        lock = threading.Lock()
        self.changed = threading.Condition(lock)  # the leader waits on it: an input came, or will not come
        self.settled = threading.Condition(lock)  # the others wait on it: a batch is done, or nobody leads
        self.waiting: list[Entry] = []
        self.coming = 0  # inputs counted on their way here, not yet here
        self.leading = False

    def expect(self, n: int = 1) -> None:
        """`n` inputs are on their way here (a run started, or announced)."""
        with self.changed:
            self.coming += n

    def not_coming(self, n: int = 1) -> None:
        """`n` inputs counted by `expect` will not come (their run ended before this node, or never began)."""
        with self.changed:
            self.coming = max(0, self.coming - n)
            self.changed.notify()  # a leader waiting for them looks again

    def call(self, entry: Entry, expected: bool):
        """The node's output for `entry.x`, after a batch that held it (its own error raised, if it failed).
        `expected`: this input was counted by `expect`."""
        with self.changed:
            if expected:
                self.coming = max(0, self.coming - 1)
            entry.at = time.monotonic()
            self.waiting.append(entry)
            if self.leading:
                self.changed.notify()  # a leader meeting a batch looks again
                while not entry.done and self.leading:
                    self.settled.wait()
            lead = not entry.done
            if lead:
                self.leading = True
        if lead:
            self._lead(entry)
        value, entry.value = entry.value, None  # (an error raised holds this frame: nothing here may hold it)
        if not entry.ok:
            try:
                raise value
            finally:
                value = None
        return value

    def _lead(self, mine: Entry) -> None:
        """Run batches until the one holding `mine` is done; then let a waiter lead the next."""
        batch: list = []
        try:
            while True:
                batch = self._next_batch()
                outcomes = batch[0].call([e.x for e in batch], batch)
                with self.settled:
                    for entry, (ok, value) in zip(batch, outcomes):
                        entry.ok, entry.value, entry.done = ok, value, True
                    # (a failure's traceback reaches this frame: it must not hold what holds the failure)
                    batch, outcomes, entry, value = [], None, None, None
                    self.leading = not mine.done
                    self.settled.notify_all()  # each of the batch wakes with its own; a waiter may lead next
                    if mine.done:
                        return
        except BaseException as exc:  # (in-process a node's KeyboardInterrupt passes through: nobody waits on)
            self._abandon(batch, mine, exc)
            raise

    def _next_batch(self) -> list:
        """The next batch: the oldest waiting input and those of the same key waiting with it, more coming
        while any is counted on its way, within `batch_wait` of the oldest; at most `max_batch`."""
        with self.changed:
            oldest = self.waiting[0]
            deadline = oldest.at + self.wait_s
            while self.coming > 0:
                if sum(1 for e in self.waiting if e.key == oldest.key) >= self.max_batch:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.changed.wait(left)
            batch, rest = [], []
            for entry in self.waiting:
                (batch if entry.key == oldest.key and len(batch) < self.max_batch else rest).append(entry)
            self.waiting = rest
            return batch

    def _abandon(self, batch: list, mine: Entry, exc: BaseException) -> None:
        """The leader's call raised (not a node's failure: those are outcomes): the batch it ran fails with it,
        and so does the leader's own input if it is still waiting; the others wait for the next leader."""
        with self.settled:
            for entry in [*batch, mine]:
                if not entry.done:
                    entry.ok, entry.value, entry.done = False, exc, True
            if mine in self.waiting:
                self.waiting.remove(mine)
            self.leading = False
            self.settled.notify_all()


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
