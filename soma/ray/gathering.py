"""Concurrent `run`/`arun` calls of one graph with a batching node, submitted together (SPEC 2, "Batching").

    run(x1) ── nothing else in flight: submitted at once, alone (a lone run pays no wait)
    run(x2) ── x1 still in flight: opens a group, leads it ─┐ waits ≤ batch_wait for company, or until
    run(x3) ── joins x2's group ────────────────────────────┤ max_batch have joined; then submits the
    run(x4) ── joins ───────────────────────────────────────┘ group as one map batch does: one call per
                                                              node, one return per input (soma.ray.submission)

A map's inputs meet in its batches; concurrent runs of one graph would each be a
Ray call of their own, so a batching node would see batches of one. Each member
still has its own Submission: its own refs, outcome, retries and release. Inputs
with a timeout go alone (their calls carry their own token), as do those traced
in another block or with other retries than the group's. A group Ray refuses as a
whole (an input it cannot serialize) is submitted again member by member, so
each gets its own answer.
"""

from __future__ import annotations

import threading
import time

from ..errors import SomaError


class Gathering:
    """The open group of one graph's concurrent runs, and how many of its runs are in flight."""

    def __init__(self, wait_s: float, most: int, node: str = "?"):
        self.node = node  # the batching node its runs meet for (named in the error of a lost group)
        self.wait_s = wait_s  # the batching nodes' shortest batch_wait
        self.most = max(1, most)  # their largest max_batch
        self.cond = threading.Condition()
        self.active = 0  # runs of this graph between `submit` and `over`
        self.group: _Group | None = None

    def submit(self, submit_many, x, trace, retries: int, drop=None) -> list:
        """`[Submission]` of input `x`, submitted with the runs that came within the wait (`submit_many(items,
        trace, retries)` submits a group). Counts the run as in flight: call `over` once it is over.
        `drop(submission)`: what becomes of this run's submission when the caller is interrupted (Ctrl-C)
        while its group is being submitted: nobody else would ever release it."""
        with self.cond:
            self.active += 1
            group, leads, position = self.group, False, 0
            if group is None and self.active > 1:  # others in flight: company may come within the wait
                group = self.group = _Group(trace, retries, [(None, x)], self.node)
                leads = True
                if self.most == 1:
                    self.group = None  # (a batch of one is full at once)
            elif group is not None and group.trace is trace and group.retries == retries:
                group.items.append((None, x))
                position = len(group.items) - 1
                if len(group.items) >= self.most:
                    self.group = None  # full: its leader submits it now
                    self.cond.notify_all()
            else:
                group = None  # alone: nothing else in flight (or a group of another block or other retries)
        if group is None:
            try:
                return submit_many([(None, x)], trace, retries)
            except BaseException:
                self.over()
                raise
        try:
            if leads:
                deadline = time.monotonic() + self.wait_s
                with self.cond:
                    while self.group is group:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            self.group = None
                            break
                        self.cond.wait(left)
                group.submit(submit_many)
            else:
                group.done.wait()
        except BaseException:  # interrupted: the others go on; this run's submission, if made, is dropped
            self.over()
            if leads:
                with self.cond:
                    if self.group is group:
                        self.group = None
                if not group.done.is_set():
                    group.submit(submit_many)  # (the members wait for it: submitted all the same)
            group.done.wait()
            mine = group.submissions[position]
            if mine is not None and drop is not None:
                drop(mine)
            raise
        failed = group.errors[position]
        if failed is not None:
            self.over()
            raise failed
        return [group.submissions[position]]

    def over(self) -> None:
        """A run counted by `submit` is over."""
        with self.cond:
            self.active -= 1


class _Group:
    __slots__ = ("trace", "retries", "items", "submissions", "errors", "done", "node")

    def __init__(self, trace, retries: int, items: list, node: str = "?"):
        self.node = node
        self.trace = trace
        self.retries = retries
        self.items = items  # (index None, x) per member, in the order they joined
        self.submissions: list = []
        self.errors: list = []
        self.done = threading.Event()

    def submit(self, submit_many) -> None:
        """Submit every member at once; when Ray refuses the group, each member alone (its own answer)."""
        try:
            try:
                self.submissions = submit_many(self.items, self.trace, self.retries)
                self.errors = [None] * len(self.items)
            except Exception:
                self.submissions, self.errors = [], []
                for item in self.items:
                    try:
                        self.submissions += submit_many([item], self.trace, self.retries)
                        self.errors.append(None)
                    except Exception as err:
                        self.submissions.append(None)
                        self.errors.append(err)
        finally:
            if len(self.errors) < len(self.items):  # (interrupted: nobody may wait forever)
                lost = SomaError(f"soma.Ray could not submit this run: the run that was submitting it with "
                                 f"others for batching node `{self.node}` was interrupted; run it again")
                self.submissions += [None] * (len(self.items) - len(self.submissions))
                self.errors += [lost] * (len(self.items) - len(self.errors))
            self.done.set()
