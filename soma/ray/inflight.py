"""`map` and `amap` on Ray: the in-flight set `soma.run.mapping` drives (docs/api.md, "map"), in batches.

    map_outputs ──start([(i, x), ...])──▶ RayInflight: cheap inputs in batches of `batch_size`,
    amap_outputs                            driver.submit: one call per node for each batch;
                                            heavy ones (or not measured yet) held, one per call
                                            as copies are free (soma.ray.spreading)
                ◀──wait(timeout)─────────  ordered: the oldest input's batch, one ray.get (driver.outcomes)
                ◀──await_wait(timeout)───   unordered: the first batch whose refs are all ready
                   [(index, ok, value)]     held inputs: any that finished, a copy's hello, or a tick
                                            (await_wait: the same, awaiting the refs on the event loop)
                                            each input's own outcome (Tries.after): its value, or its
                                            error; or, lost to a dead actor, the input sent again:
                                            not reported

A batch's inputs share every call, so they finish together: a batch is waited
for through the refs of its first input (`lead`), and concluded as a whole. An
input sent again goes alone (a batch of one) and keeps its place in the order.
When an actor dies, the inputs it had been sent and never started are sent again
at once (`_send_again`), not when their turn to be waited for comes.
"""

from __future__ import annotations

import time
from collections import deque

from ..errors import NodeError
from ..run.mapping import Inflight
from .driver import Driver
from .spreading import TICK_S, copy_pays, input_cost, measured
from .submission import ActorGraph, Submission, value_of

MAX_BATCH = 8  # the most inputs of a map that share one call per node (a batching node's max_batch if larger)


def batch_size(graph: ActorGraph, window: int, timeout) -> int:
    """How many of a map's inputs share one call per node (docs/ray.md, "Batches").

    The window spread over the copies of the node that has the most (window 4, two copies: two calls of
    two inputs), at most MAX_BATCH. A call costs Ray ~400 µs of the actor's CPU and ~350 µs of the
    driver's whatever it carries, so fewer calls are the cheapest inputs; a batch's outputs come back
    together, so the cap bounds how long its first output waits for the others. Inputs with a timeout
    go one per call: stopping or cancelling one must not touch another's call. Where a node batches, a call
    carries at most its `max_batch` (the smallest of them): the actor counts every input of a call as started
    once its one `forward_batch` begins, and a call of 8 at a node of max_batch 2 had its 6 later inputs fail
    with WorkerDied, never started, when the actor died in its first batch.
    """
    if timeout is not None:
        return 1
    spread = max(node_actors.limit for node_actors in graph.actors.values())
    batching = [a.max_batch for a in graph.actors.values() if a.max_batch]
    cap = min(batching) if batching else MAX_BATCH
    return max(1, min(cap, -(-window // spread)))


def parallelism(graph: ActorGraph, cpus: int) -> int:
    """How many inputs a map works on at once (the default window is twice this): one per CPU; a batching
    node's graph a batch's worth per CPU, so that its calls carry batches (as Local keeps batches at each
    worker), not the one or two inputs a window of a few frees at a time."""
    batch = max([1] + [node_actors.max_batch for node_actors in graph.actors.values() if node_actors.max_batch])
    return cpus * batch


class RayInflight(Inflight):
    """Ray's in-flight set for map: inputs submitted in batches (every node's call shared by a batch, one
    ref per input), a batch's outputs fetched together, each input's outcome its own; an input lost to a
    dead actor is sent again (`retries`: how many more tries each may have). `tracer`: whose open trace
    block, if any, an input is recorded in when it starts."""

    def __init__(self, driver: Driver, graph: ActorGraph, timeout, ordered: bool, batch: int, retries: int = 0,
                 tracer=None, source=None, by_cost: bool = False):
        self.driver, self.graph, self.timeout, self.ordered = driver, graph, timeout, ordered
        self.source = source  # the Graph: its nodes must live while the map does (a node let go stops its actors)
        self.batch = batch  # inputs per batch (at most)
        # by_cost: batches only once inputs are known to be cheap (graph.spreads()): until then, and for
        # heavy inputs, one input per call, held here until a copy is free (soma.ray.spreading)
        self.by_cost = by_cost
        self.held: deque = deque()  # (index, x) taken, waiting for a free copy (oldest first)
        self.waiting_since: float | None = None  # since when inputs have been held without a break
        self.last_outcome: float | None = None  # when the last batch concluded (by_cost)
        self.retries = retries
        self.tracer = tracer
        self.submissions: dict = {}  # index → its Submission now, oldest first (inputs start in index order)
        self.by_ref: dict = {}  # an output ref of a batch's first input, not ready yet → that input (unordered)
        self.refused: list = []  # (index, False, error) for inputs that could not even be submitted
        self.futures: dict = {}  # amap: ref → its asyncio future (set by Ray's own callback), until concluded

    def parallelism(self) -> int:
        return parallelism(self.graph, self.driver.cpus)

    # -- starting ------------------------------------------------------------------------------
    def start(self, indices: list, xs: list) -> None:
        self.held.extend(zip(indices, xs))
        self._send_held()

    def _holds(self) -> bool:
        """Whether inputs wait here for a free copy: a map's untimed inputs while they are heavy or not measured
        yet (a timed input goes at once: its time runs from its start)."""
        return self.by_cost and self.timeout is None and self.graph.spreads()

    def _send_held(self) -> None:
        """Send the held inputs: cheap ones in batches; heavy ones oldest first, one per copy that is free,
        then one more copy if it pays for its start-up (soma.ray.spreading)."""
        if not self._holds():
            items, size = list(self.held), self.batch
            self.held.clear()
            for first in range(0, len(items), size):
                self._start(items[first:first + size])
            return
        while self.held and self.driver.has_room(self.graph):
            self._start([self.held.popleft()], held=True)
        if not self.held:
            self.waiting_since = None
            return
        if self.waiting_since is None:
            self.waiting_since = time.monotonic()
        self._spread()

    def _spread(self) -> None:
        """Start one more copy when the last held input would wait longer for one of the copies there than a
        new copy takes to start."""
        now = time.monotonic()
        startup, _ = self.driver.startup(self.graph)
        inputs = list(self.submissions.values())
        cost = input_cost(self.graph.cost, [self._running_since(s) for s in inputs], now)
        busy = [self._busy(s, cost, startup, now) for s in inputs]
        if copy_pays(len(self.held), cost, busy, self.driver.copies(self.graph), startup, now - self.waiting_since):
            self.driver.add_copy(self.graph)

    @staticmethod
    def _running_since(submission: Submission) -> float | None:
        """When the input started running: sent, and every copy it went to up; None while one is starting."""
        ups = [call.actor.up_at for call in submission.calls]
        return None if None in ups else max([submission.sent_at] + ups)

    @classmethod
    def _busy(cls, submission: Submission, cost: float, startup: float, now: float) -> float:
        """How long the copy of an input in flight still needs for it: what is left of its cost, after what
        is left of its copy's start-up if that copy is still starting."""
        since = cls._running_since(submission)
        if since is not None:
            return max(0.0, cost - (now - since))
        started = min(call.actor.started_at for call in submission.calls if call.actor.up_at is None)
        return max(0.0, startup - (now - started)) + cost

    def _start(self, items: list, held: bool = False) -> None:
        trace = self.tracer.current_trace if self.tracer is not None else None
        try:
            submissions = self.driver.submit(self.graph, items, self.timeout is not None, trace, self.retries,
                                             held=held)
        except NodeError as err:  # an input that cannot travel (autograd): its own error, in its place
            if len(items) > 1:  # nothing of the batch was submitted: each on its own, so only that one fails
                for item in items:
                    self._start([item])
                return
            self.refused.append((items[0][0], False, err))
            return
        self._track(submissions)

    def _track(self, submissions: list) -> None:
        for submission in submissions:
            self.submissions[submission.index] = submission  # (an input sent again keeps its place)
        if not self.ordered:
            lead = submissions[0]  # a batch's inputs share every call: they are ready when its first one is
            for ref in lead.refs:
                self.by_ref[ref] = lead

    # -- waiting -------------------------------------------------------------------------------
    def _nothing_to_wait_for(self):
        """What `wait` hands out without waiting: the inputs refused at submission, or [] when none is in
        flight or held; None when there is something to wait for."""
        if self.refused:
            refused, self.refused = self.refused, []
            return refused
        return None if self.submissions or self.held else []

    def wait(self, timeout):
        at_once = self._nothing_to_wait_for()
        if at_once is not None:
            return at_once
        if self.held:
            return self._wait_held(timeout)
        if self.ordered:
            # In order, only the oldest input can be handed out next, and map takes no new input before it
            # is (its window counts what is not handed out yet): wait for that one's batch alone, one ray.get.
            batch = self._current(next(iter(self.submissions.values())).batch)
            return self._over(batch, self.driver.outcomes(batch, self.graph, timeout))
        # One at a time: with a window of a few inputs, asking again for whatever else is ready costs more
        # than it gathers (map_outputs calls back at once while outputs are there).
        finished = []
        for ref in self.driver.first_ready(list(self.by_ref), timeout):
            batch = self._ready(ref)
            if batch:
                finished += self._over(batch, self.driver.outcomes(batch, self.graph, None))
        return finished

    def _wait_held(self, timeout) -> list:
        """While inputs are held: until any input in flight finishes, a copy says hello, or a tick passes (the
        cost model asks again); then every batch that finished is concluded, and held inputs sent."""
        refs = self._refs()
        wake = refs + self.driver.starting(self.graph)
        limit = TICK_S if timeout is None else min(timeout, TICK_S)
        if wake:
            self.driver.first_ready(wake, limit)
        else:
            time.sleep(limit)  # (the copies are busy with other maps' or runs' inputs: they free them)
        done = self.driver.ready_now(refs)
        finished = []
        for batch in self._batches():
            if all(ref in done for submission in batch for ref in submission.refs):
                finished += self._over(batch, self.driver.outcomes(batch, self.graph, None))
        self._send_held()
        return finished

    async def await_wait(self, timeout, wake=None):
        """`wait` for amap: the refs awaited on the event loop (Ray sets their futures; no thread waits); `wake`
        (an asyncio future) ends it early, before anything is concluded."""
        import asyncio

        at_once = self._nothing_to_wait_for()
        if at_once is not None:
            return at_once
        if self.held:
            return await self._await_held(timeout, wake)
        if self.ordered:
            batch = self._current(next(iter(self.submissions.values())).batch)
            futures = [self._future(ref) for submission in batch for ref in submission.refs]
            if wake is None:
                _, pending = await asyncio.wait(futures, timeout=timeout)
            else:
                pending = await _all_or_woken(futures, timeout, wake)
            return [] if pending else await self._aconclude(batch)
        wanted = {self._future(ref): ref for ref in self.by_ref}
        woken = [] if wake is None else [wake]
        done, _ = await asyncio.wait([*wanted, *woken], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finished = []
        for future in done:
            if future is wake:
                continue
            batch = self._ready(wanted[future])
            if batch:
                await asyncio.wait([self._future(ref) for submission in batch for ref in submission.refs])
                finished += await self._aconclude(batch)
        return finished

    async def _await_held(self, timeout, wake=None) -> list:
        """`_wait_held` on the event loop (`wake`: as `await_wait`'s)."""
        import asyncio

        futures = [self._future(ref) for ref in self._refs()]
        hellos = [asyncio.wrap_future(ref.future()) for ref in self.driver.starting(self.graph)]
        woken = [] if wake is None else [wake]
        limit = TICK_S if timeout is None else min(timeout, TICK_S)
        if futures or hellos or woken:
            await asyncio.wait(futures + hellos + woken, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(limit)
        for hello in hellos:
            hello.cancel()
        finished = []
        for batch in self._batches():
            if all(self._future(ref).done() for submission in batch for ref in submission.refs):
                finished += await self._aconclude(batch)
        self._send_held()
        return finished

    def _refs(self) -> list:
        return [ref for submission in self.submissions.values() for ref in submission.refs]

    def _batches(self) -> list:
        """The batches in flight, oldest first (each as its inputs not concluded and not sent again since)."""
        batches, seen = [], set()
        for submission in list(self.submissions.values()):
            if id(submission.batch) not in seen:
                seen.add(id(submission.batch))
                batches.append(self._current(submission.batch))
        return batches

    async def _aconclude(self, batch: list) -> list:
        """Conclude a batch whose futures are done, from their values (nothing fetched again). A Ray error
        among them is translated on a thread: reading a dead actor's record may take a Ray task."""
        import asyncio

        values = [[value_of(self.futures.pop(ref)) for ref in submission.refs] for submission in batch]
        settle = self._settle_values
        if any(isinstance(v, BaseException) for vs in values for v in vs):
            return await asyncio.to_thread(settle, batch, values)
        return settle(batch, values)

    def _settle_values(self, batch: list, values: list) -> list:
        return self._over(batch, [self.driver.settled(s, self.graph, vs) for s, vs in zip(batch, values)])

    def _future(self, ref):
        import asyncio

        future = self.futures.get(ref)
        if future is None:
            future = self.futures[ref] = asyncio.wrap_future(ref.future())
        return future

    def _ready(self, ref) -> list:
        """One ref of a batch's lead is ready: the batch's inputs still in flight once all of its are."""
        lead = self.by_ref.pop(ref, None)
        if lead is None:
            return []
        lead.pending -= 1
        return self._current(lead.batch) if lead.pending == 0 else []

    def _current(self, batch: list) -> list:
        """The inputs of a batch not concluded and not sent again since."""
        return [s for s in batch if self.submissions.get(s.index) is s]

    # -- concluding ----------------------------------------------------------------------------
    def _over(self, batch: list, settled) -> list:
        """[(index, ok, value)] for the inputs of a finished batch that are over ([] when `settled` is None:
        the wait's time passed first); those lost to a dead actor are sent again and stay in flight."""
        if settled is None:
            return []
        for submission in batch:
            for ref in submission.refs:
                self.by_ref.pop(ref, None)
        measured_alone = len(batch) == 1 and batch[0].alone  # (Tries.after measures it: its time is its cost)
        if self.by_cost and all(ok for ok, _ in settled) and not measured_alone:
            self._measure(len(batch))
        finished, deaths = [], []
        for submission, (ok, value) in zip(batch, settled):
            finished += self._next(submission, ok, value)
            if submission.lost is not None and submission.lost[0].actor not in deaths:
                deaths.append(submission.lost[0].actor)
        for actor in deaths:
            finished += self._send_again(actor)
        return finished

    def _measure(self, inputs: int) -> None:
        """An input's cost from the map's pace: the time since the last batch concluded, per input, times
        the copies working side by side (the first outcome only starts the clock: it includes actors
        starting). With the window full, outcomes come as fast as the copies make them."""
        now = time.monotonic()
        last, self.last_outcome = self.last_outcome, now
        if last is None:
            return
        side_by_side = min(len(self.submissions) + inputs, max(len(a.actors) for a in self.graph.actors.values()))
        measured(self.graph, (now - last) / inputs * max(1, side_by_side))

    def _next(self, submission: Submission, ok: bool, value) -> list:
        tries = self.driver.tries(self.graph, submission)
        done = tries.after(ok, value)
        if done is None:
            self._track([tries.submission])  # sent again
            return []
        del self.submissions[submission.index]
        return [(submission.index, *done)]

    def _send_again(self, actor) -> list:
        """The inputs the dead `actor` had been sent and never started: sent again now (no try counted)."""
        finished = []
        for submission in list(self.submissions.values()):
            if self.driver.unstarted_on(submission, actor):
                for ref in submission.refs:
                    self._drop_future(ref)
                finished += self._next(submission, False, None)
        return finished

    # -- ending --------------------------------------------------------------------------------
    def expire(self, index: int) -> BaseException:
        submission = self.submissions.pop(index)
        for ref in submission.refs:
            self.by_ref.pop(ref, None)
            self._drop_future(ref)
        return self.driver.expire(submission, self.timeout)

    def close(self) -> None:
        self.held.clear()  # (never sent)
        submissions, self.submissions = list(self.submissions.values()), {}
        self.by_ref.clear()
        for ref in list(self.futures):
            self._drop_future(ref)
        for submission in submissions:
            self.driver.abandon(submission)

    def _drop_future(self, ref) -> None:
        future = self.futures.pop(ref, None)
        if future is not None:
            future.cancel()  # (Ray's callback sees it done and leaves it)


async def _all_or_woken(futures: list, timeout, wake) -> list:
    """`asyncio.wait(futures, timeout=timeout)` (all of them), ended early once `wake` is done: those still
    pending. (One task stands for them all: asyncio.wait over them and `wake` returns at the first one done.)"""
    import asyncio

    if all(future.done() for future in futures):
        return []
    whole = asyncio.ensure_future(asyncio.wait(futures))  # (cancelled, it leaves the futures as they are)
    try:
        await asyncio.wait((whole, wake), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        whole.cancel()
    return [future for future in futures if not future.done()]
