"""An input lost to a dead actor: sent elsewhere, tried again, or its WorkerDied (`retries=N`).

    a try ends with WorkerDied            (soma.ray.faults.translate: `submission.lost` = (call, started))
      the dead actor had not started it   → sent again, no try counted, no error, whatever `retries` is:
                                            its calls that never met the dead actor are kept (a node
                                            upstream of it does not see the input twice)
      it had (or its record is lost)      → tries left: run again from the graph's start, on live actors
                                            (what is left of the last try is cancelled); none left: the
                                            WorkerDied, saying how many tries were made
    any other outcome                     → the input's outcome (a node's own exception, a
                                            PostconditionError and a RunTimeout are never retried)

The retry-or-finish step is written once, `Tries.after`, and every caller (run, arun, map's
in-flight set, submit's settler) waits for a try its own way and then asks it:

    tries = Tries(driver, graph, submission)       one input, from its first try to its outcome
    wait for tries.submission's refs                (ray.get, await, ray.wait, Ray's futures)
    tries.after(ok, value) / after_values(values)   → None: sent again, wait for tries.submission
                                                    → (ok, value): its outcome; the try released, and
                                                      an input that ran alone on idle copies measured
                                                      (its time is the graph's cost: soma.ray.spreading)

An input the record cannot clear counts a try, so an input that kills every actor
it meets ends after `retries` more tries.
"""

from __future__ import annotations

import time

from ..errors import SomaError
from .spreading import measured
from .submission import ActorGraph, Submission


class Tries:
    """One input's tries: after each, `after` sends it again (`submission` is then the new try) or finishes it."""

    __slots__ = ("driver", "graph", "submission")

    def __init__(self, driver, graph: ActorGraph, submission: Submission):
        self.driver, self.graph, self.submission = driver, graph, submission

    def after(self, ok: bool, value):
        """After a try's outcome: None when the input was sent again (wait for `submission`), else its outcome
        `(ok, value)`, the try released (its actors take other inputs)."""
        submission = self.submission
        after = next_try(self.driver, self.graph, submission, ok, value)
        if isinstance(after, Submission):
            self.submission = after
            return None
        ok, value = after
        if ok and submission.alone:
            measured(self.graph, time.monotonic() - submission.sent_at)
        self.driver.release(submission, "ok" if ok else type(value).__name__)
        return after

    def after_values(self, values: list):
        """`after`, from the values of the try's refs as Ray's futures (or `await`) gave them."""
        return self.after(*self.driver.settled(self.submission, self.graph, values))


def next_try(driver, graph: ActorGraph, submission: Submission, ok: bool, value):
    """After a try: the input's next Submission (already submitted; `submission` is given up), or the
    `(ok, value)` that is the input's outcome."""
    lost = submission.lost
    if ok or lost is None or driver.closed:
        return ok, value
    call, started = lost
    if started and submission.tries > submission.retries:
        return ok, value  # its WorkerDied (it says how many tries were made)
    again = submission.again(counted=started)
    if not started:
        again.keep = kept(graph, submission, call)
    try:
        driver.resubmit(graph, submission, again)
    except SomaError as err:  # closed meanwhile
        return False, err
    return again


def kept(graph: ActorGraph, submission: Submission, lost_call) -> dict:
    """The calls of an input's try that are still good: on live actors, and upstream of (or beside) the
    call that met the dead actor; that call and everything that takes its output are made again."""
    made_again: set = set()
    keep = {}
    for call in submission.calls:  # (in submission order: producers before what takes their output)
        if call is lost_call or call.actor.dead or graph.upstream[call.node_id] & made_again:
            made_again.add(call.node_id)
        else:
            keep[call.node_id] = call
    return keep
