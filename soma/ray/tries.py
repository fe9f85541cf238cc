"""One input's tries, from its first to its outcome: the retry-or-finish loop of Ray, written once.

    a try ends with WorkerDied            (soma.ray.faults.translate: `submission.lost` = (call, started))
      the dead actor had not started it   → sent again, no try counted, no error, whatever `retries` is:
                                            its calls that never met the dead actor are kept (a node
                                            upstream of it does not see the input twice)
      it had (or its record is lost)      → tries left: run again from the graph's start, on live actors
                                            (what is left of the last try is cancelled); none left: the
                                            WorkerDied, saying how many tries were made
    its time is up                        → RunTimeout (what runs it is stopped: soma.ray.faults.expire)
    any other outcome                     → the input's outcome (a node's own exception, a
                                            PostconditionError and a RunTimeout are never retried)

`Tries.after` decides, once for every path; `Tries` also waits, in the one way each path needs:

    tries = driver.tries(graph, submission, timeout, deadline)
    run      tries.outcome()            each try's refs: one ray.get          ┐ after each try, `after`:
    arun     await tries.aoutcome()     each try's refs: awaited on the loop  │ None: sent again, wait for
    submit   tries.watch(ready) …       Ray's callbacks; the settler thread   │ `tries.submission`; else
             tries.ready()              asks once all of a try's are done     │ (ok, value): its outcome,
    map      tries.after(ok, value)     a batch's refs (soma.ray.inflight)    ┘ the try released

An input that ran alone on idle copies is measured when it finishes (its time is the
graph's cost: soma.ray.spreading). An input the record cannot clear counts a try, so
an input that kills every actor it meets ends after `retries` more tries.
"""

from __future__ import annotations

import threading
import time

from ..errors import RunTimeout, SomaError
from .spreading import measured
from .submission import ActorGraph, Submission, value_of


class Tries:
    """One input's tries: after each, `after` sends it again (`submission` is then the new try) or finishes it.
    `deadline` (time.monotonic) and `timeout`: when its time is up, and what its RunTimeout says (run, arun,
    submit; a map keeps its inputs' deadlines itself)."""

    __slots__ = ("driver", "graph", "submission", "timeout", "deadline", "watched")

    def __init__(self, driver, graph: ActorGraph, submission: Submission, timeout=None, deadline=None):
        self.driver, self.graph, self.submission = driver, graph, submission
        self.timeout, self.deadline = timeout, deadline
        self.watched: list = []  # submit: Ray's futures of the output refs of the try watched now

    # -- the decision --------------------------------------------------------------------------
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

    # -- waiting, each path its own way --------------------------------------------------------
    def outcome(self):
        """run: each try waited for with one `ray.get`, until the input's outcome: its output, or its error
        raised (a RunTimeout once the deadline passed)."""
        while True:
            settled = self.driver.outcomes([self.submission], self.graph, self.left())
            if settled is None:
                raise self.expire() from None
            done = self.after(*settled[0])
            if done is not None:
                try:
                    return returned(done)
                finally:  # (an error raised holds this frame: it must not hold the error)
                    done = settled = None

    async def aoutcome(self):
        """`outcome` on the event loop: each try's refs awaited (Ray sets their futures; no thread waits).
        Cancelling the awaiting task abandons the input (what has not started never starts)."""
        import asyncio

        futures: list = []
        try:
            while True:
                futures = [asyncio.wrap_future(ref.future()) for ref in self.submission.refs]
                _, pending = await asyncio.wait(futures, timeout=self.left())
                if pending:
                    raise await asyncio.to_thread(self.expire) from None
                values = [value_of(future) for future in futures]
                if any(isinstance(v, BaseException) for v in values):  # (a dead actor's record may take a Ray task)
                    done = await asyncio.to_thread(self.after_values, values)
                else:
                    done = self.after_values(values)
                if done is not None:
                    return returned(done)
        except asyncio.CancelledError:
            self.abandon()
            raise
        finally:
            for future in futures:
                future.cancel()  # (done ones stay as they are)
            done = values = futures = None  # (an error raised holds this frame: it must not hold the error)

    def watch(self, ready) -> None:
        """submit: `ready(self, submission)` once every output ref of the try now is ready, called on Ray's
        thread (it must only hand over: a Ray call made there waits for that very thread)."""
        submission = self.submission
        self.watched = [ref.future() for ref in submission.refs]
        left = [len(self.watched)]
        lock = threading.Lock()

        def done(_):
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                ready(self, submission)

        for ray_future in self.watched:
            ray_future.add_done_callback(done)

    def ready(self, ready):
        """submit, once `watch` said so (not on Ray's thread): the input's outcome `(ok, value)`, or None when
        it was sent again (watched again, with the same `ready`)."""
        done = self.after_values([value_of(f) for f in self.watched])
        self.watched = []  # (their callbacks hold this object: a cycle that kept the input until gc ran)
        if done is None:
            self.watch(ready)
        return done

    # -- the end -------------------------------------------------------------------------------
    def left(self) -> float | None:
        """Seconds until the deadline (None: no timeout)."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def expire(self) -> RunTimeout:
        """Its time is up: what runs it stopped, what waits cancelled; the error that says which."""
        return self.driver.expire(self.submission, self.timeout)

    def abandon(self) -> None:
        """Nobody waits for it any more: what has not started never starts; its result is dropped."""
        self.driver.abandon(self.submission)

    def release(self, how: str = "ok") -> None:
        """The try now is over (nothing more when it was released already: finished, expired, abandoned)."""
        self.driver.release(self.submission, how)


def returned(settled: tuple):
    """An outcome `(ok, value)` as a call gives it: the value returned, or the error raised."""
    ok, value = settled
    if ok:
        return value
    try:
        raise value
    finally:  # (the error's traceback holds this frame: the frame must not hold the error, a cycle)
        value = settled = None


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
