"""`map` on Ray: the in-flight set `soma.run.mapping.map_outputs` drives (SPEC 7.4), in batches.

    map_outputs ──start([(i, x), ...])──▶ RayInflight: batches of `batch_size` inputs,
                                            driver.submit: one call per node for each batch
                ◀──wait(timeout)─────────  ordered: the oldest input's batch, one ray.get (driver.outcomes)
                                            unordered: the first batch whose refs are all ready
                   [(index, ok, value)]     each input's own outcome: its value, or its error

A batch's inputs share every call, so they finish together: a batch is waited
for through the refs of its first input (`lead`), and concluded as a whole.
"""

from __future__ import annotations

from ..errors import NodeError
from ..run.mapping import Inflight
from .driver import Driver
from .submission import ActorGraph, Submission

MAX_BATCH = 8  # the most inputs of a map that share one call per node


def batch_size(graph: ActorGraph, window: int, timeout) -> int:
    """How many of a map's inputs share one call per node (docs/ray.md, "Batches").

    The window spread over the copies of the node that has the most (window 4, two copies: two calls of
    two inputs), at most MAX_BATCH. A call costs Ray ~400 µs of the actor's CPU and ~350 µs of the
    driver's whatever it carries, so fewer calls are the cheapest inputs; a batch's outputs come back
    together, so the cap bounds how long its first output waits for the others. Inputs with a timeout
    go one per call: stopping or cancelling one must not touch another's call.
    """
    if timeout is not None:
        return 1
    spread = max(node_actors.limit for node_actors in graph.actors.values())
    return max(1, min(MAX_BATCH, -(-window // spread)))


class RayInflight(Inflight):
    """Ray's in-flight set for map: inputs submitted in batches (every node's call shared by a batch, one
    ref per input), a batch's outputs fetched together, each input's outcome its own."""

    def __init__(self, driver: Driver, graph: ActorGraph, timeout, ordered: bool, batch: int):
        self.driver, self.graph, self.timeout, self.ordered = driver, graph, timeout, ordered
        self.batch = batch  # inputs per batch (at most)
        self.submissions: dict = {}  # index → Submission, oldest first (inputs start in index order)
        self.by_ref: dict = {}  # an output ref of a batch's first input, not ready yet → that input (unordered)
        self.refused: list = []  # (index, False, error) for inputs that could not even be submitted

    def parallelism(self) -> int:
        return self.driver.cpus

    def start(self, items: list) -> None:
        size = self.batch
        for first in range(0, len(items), size):
            self._start(items[first:first + size])

    def _start(self, items: list) -> None:
        try:
            submissions = self.driver.submit(self.graph, items, self.timeout is not None)
        except NodeError as err:  # an input that cannot travel (autograd): its own error, in its place
            if len(items) > 1:  # nothing of the batch was submitted: each on its own, so only that one fails
                for item in items:
                    self._start([item])
                return
            self.refused.append((items[0][0], False, err))
            return
        for submission in submissions:
            self.submissions[submission.index] = submission
        if not self.ordered:
            lead = submissions[0]  # a batch's inputs share every call: they are ready when its first one is
            for ref in lead.refs:
                self.by_ref[ref] = lead

    def wait(self, timeout):
        if self.refused:
            refused, self.refused = self.refused, []
            return refused
        if not self.submissions:
            return []
        if self.ordered:
            # In order, only the oldest input can be handed out next, and map takes no new input before it
            # is (its window counts what is not handed out yet): wait for that one's batch alone, one ray.get.
            return self._conclude(next(iter(self.submissions.values())).batch, timeout)
        # One at a time: with a window of a few inputs, asking again for whatever else is ready costs more
        # than it gathers (map_outputs calls back at once while outputs are there).
        finished = []
        for ref in self.driver.first_ready(list(self.by_ref), timeout):
            lead = self.by_ref.pop(ref)
            lead.pending -= 1
            if lead.pending == 0:
                finished += self._conclude(lead.batch, None)
        return finished

    def _conclude(self, batch: list, timeout) -> list:
        """[(index, ok, value)] for each input of a finished batch; [] when `timeout` passed before it finished."""
        settled = self.driver.outcomes(batch, self.graph, timeout)
        if settled is None:
            return []
        return [self._over(submission, ok, value) for submission, (ok, value) in zip(batch, settled)]

    def _over(self, submission: Submission, ok: bool, value) -> tuple:
        del self.submissions[submission.index]
        self.driver.release(submission, "ok" if ok else type(value).__name__)
        return submission.index, ok, value

    def expire(self, index: int) -> BaseException:
        submission = self.submissions.pop(index)
        for ref in submission.refs:
            self.by_ref.pop(ref, None)
        return self.driver.expire(submission, self.timeout)

    def close(self) -> None:
        submissions, self.submissions = list(self.submissions.values()), {}
        self.by_ref.clear()
        for submission in submissions:
            self.driver.abandon(submission)
