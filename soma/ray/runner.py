"""`soma.Ray`: the same graphs, `run` and `map`, on a Ray cluster. See docs/ray.md.

    with soma.Ray() as cluster:            # a local Ray, started here and shut down at close()
        y = cluster.run(g, x)

How one input flows (on the right of each step, the module of soma/ray/ that does it):

    driver process                                                      Ray actors (one per copy)
    ──────────────                                                      ─────────────────────────
    Ray.run(g, x)            runner.py: life, run, map, trace
      │  Driver.actor_graph(g)       driver.py: once per graph and placement
      │    each node's NodeActors    copies.py: which actor takes an input
      │    (actor options, hosting:  devices.py; PlacementError here, before anything is submitted)
      │  Driver.submit → Submission  submission.py: the plan's walk (a fold), every call at once:
      │      r1 = tokenize#1.call(x)                      ─────────▶  actor.py: NodeCopy.call
      │      r2 = encoder#1.call(r1)  r3 = other#2.call(r1) ──────▶  values go actor to actor as
      │      r4 = join#1.call_with(meta, r2, r3)          ─────────▶  ObjectRefs, never via the driver
      │  Driver.output: one ray.get of r4                 ◀─────────  the value, or a `Failed` value
      ▼  the output, or soma's error  faults.py: Ray's errors as soma's (WorkerDied, NodeError), timeouts

    Ray.map(g, xs)           map_outputs (soma.run.mapping) over inflight.RayInflight: batches of
                             cheap inputs share one call per node (call_many: one return per input);
                             heavy ones wait at the driver for a free copy, and a copy starts when the
                             queue it saves is longer than its measured start-up (spreading.py)
    Ray.submit(g, x)         a Future at once; settler.py: one thread settles every submitted input
    await Ray.arun(g, x)     the output refs awaited on the event loop (Ray sets their futures)
    Ray.amap(g, xs)          amap_outputs (soma.run.amapping) over RayInflight.await_wait
    after every try          tries.Tries, one input's tries, the retry-or-finish loop written once
                             (run: outcome(), arun: aoutcome(), submit: watch/ready, map: after): an
                             input lost to a dead actor is sent again (records.py: what the actor had
                             started), or tried again from the graph's start, or its WorkerDied; a
                             finished one is released (and measured: its cost, spreading.py)
    Ray.trace(path)          tracing.py: the actors keep their records; the block's end collects them
"""

from __future__ import annotations

import contextlib
import threading
import time

from ..errors import NodeError, SomaError
from ..run.aio import InputFuture
from ..run.amapping import amap_outputs
from ..run.arguments import checked_retries, checked_timeout
from ..run.base import RunnerBase
from ..run.mapping import default_window, map_outputs, save_open
from ..run.resuming import DEFAULT_EVERY_S
from ..run.trace import Trace
from . import tracing
from .devices import checked_options
from .driver import CLOSED, Driver
from .inflight import RayInflight, batch_size, parallelism


def _import_ray():
    try:
        import ray
    except ImportError as err:
        raise SomaError("soma.Ray needs Ray, which is not installed here: pip install 'soma[ray]'") from err
    return ray


_actor_classes: dict = {}


def _actor_class(ray):
    """`NodeCopy` as a Ray actor class, made once per process (with its control concurrency group)."""
    cls = _actor_classes.get(id(ray))
    if cls is None:
        from .actor import NodeCopy

        # Out of order: a call whose args are not ready must not hold back the calls behind it (another
        # input's, in a pipeline). The default group still runs one call at a time (a copy runs one input at a
        # time), in the order their args became ready. A `copies = 1` node's copy runs its calls in the order
        # they were sent instead: input order, as on Local.
        cls = _actor_classes[id(ray)] = ray.remote(concurrency_groups={"control": 1},
                                                   allow_out_of_order_execution=True)(NodeCopy)
    return cls


def _over_inputs(outputs, where: str, doc: str):
    """Ray's `map` or `amap` (`outputs`: soma.run's map_outputs or amap_outputs), their keywords written once:
    a RayInflight (map's batches, sized from the window) under the loop every runner's map shares."""

    def over_inputs(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None, retries=0,
                    errors="raise", resume=None, checkpoint=None, checkpoint_every=DEFAULT_EVERY_S):
        g = self.accepting(g, where)  # (closed? before anything else, as every runner checks)
        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        driver, g, graph = self._compiled(g, where)
        batch = batch_size(graph, window or default_window(parallelism(graph, driver.cpus)), timeout)
        inflight = RayInflight(driver, graph, timeout, ordered, batch, retries, tracer=self, source=g, by_cost=True)
        return outputs(inflight, xs, graph=g, window=window, ordered=ordered, progress=progress, timeout=timeout,
                       errors=errors, resume=resume, checkpoint=checkpoint, checkpoint_every=checkpoint_every,
                       owner=self)

    over_inputs.__name__, over_inputs.__qualname__ = where.rpartition(".")[2], where
    over_inputs.__doc__ = doc
    return over_inputs


class _Session(threading.Thread):
    """`ray.init` on a thread of soma's own that lives until the runner closes: Ray starts a local session's head
    processes (its GCS, its raylet) with PR_SET_PDEATHSIG, which ends them as soon as the thread that started
    them ends. A first run on a short-lived thread (a thread pool's) left a dead session behind: the next call
    waited 60 s for its GCS, then Ray ended the process (Dec 7)."""

    def __init__(self, ray, address, init: dict):
        super().__init__(name="soma-ray-session", daemon=True)
        self.ray, self.address, self.init = ray, address, init
        self.ready, self.over = threading.Event(), threading.Event()
        self.error: BaseException | None = None
        self.start()
        self.ready.wait()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def run(self) -> None:
        try:
            self.ray.init(address=self.address, **self.init)
        except BaseException as err:  # (raised on the caller's thread)
            self.error = err
            return
        finally:
            self.ready.set()
        self.over.wait()


class Ray(RunnerBase):
    """Runs graphs on a Ray cluster: each copy of a node is a Ray actor.

        with soma.Ray() as cluster: y = cluster.run(g, x)
        with soma.Ray(address="auto", options={"encoder": {"num_gpus": 1}}) as cluster:
            for y in cluster.map(g, xs): ...

    `address` and `init` go to `ray.init` as Ray takes them. `options[id]`: Ray
    actor options for the copies of one node (`num_cpus`, `num_gpus`, `memory`,
    `resources`, `runtime_env`, `scheduling_strategy`, ...), on top of what its
    placement asks for (`cuda:N`: one GPU). A node's copies: `copies = N` caps
    them, `copies = 1` keeps every input on one actor; by default at most as many
    as the cluster has CPUs, started only when every copy is busy (so `run` alone
    makes one copy per node).
    """

    def __init__(self, address=None, *, options=None, **init):
        self._ray = _import_ray()
        self.address = address
        self.init = init
        self.options = checked_options(options)
        self._driver: Driver | None = None  # made by start(): the session, the actors, what was compiled
        self._owns_session = False
        self._session: _Session | None = None
        self._closed = False
        self._life = threading.Lock()  # start() and close()

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> "Ray":
        """Connect to Ray (starting a local one when `address` is None and Ray is not initialised here)."""
        ray = self._ray
        with self._life:
            if self._closed:
                raise SomaError(CLOSED)
            if self._driver is None:
                if not ray.is_initialized():
                    self._session = _Session(ray, self.address, self.init)
                    self._owns_session = True
                self._driver = Driver(ray, _actor_class(ray), self.options, tracer=self)
        return self

    def close(self) -> None:
        """Stop every actor soma made; shut Ray down if soma started it (a session it found stays up)."""
        with self._life:
            if self._closed:
                return
            self._closed = True
            driver = self._driver
        save_open(self)  # (its maps with a checkpoint write it: their callers may never step them again)
        if driver is None:
            return
        driver.close()
        if self._owns_session and self._ray.is_initialized():
            self._ray.shutdown()
        if self._session is not None:
            self._session.over.set()

    # -- running -------------------------------------------------------------------------------
    def run(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """Run graph `g` (or a node, or an expression) on input `x` on the cluster and return its output.

        `retries`: how many more times the input runs, from the graph's start on live actors, when an
        actor dies while running it (docs/ray.md, "Retries"); `timeout` counts from its start, tries
        included.
        """
        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        driver, _, graph = self._compiled(g, "Ray.run")
        trace = self._trace
        timed = timeout is not None
        deadline = time.monotonic() + timeout if timed else None
        with trace.host_step("run", input=None) if trace is not None else contextlib.nullcontext():
            [submission] = driver.submit_run(graph, x, timed, trace, retries)  # (with concurrent runs: batching)
            tries = driver.tries(graph, submission, timeout, deadline)
            try:
                return tries.outcome()
            finally:
                tries.release()
                driver.run_over(graph, timed)

    map = _over_inputs(map_outputs, "Ray.map", """The outputs for the inputs of `xs`, lazily, `window` inputs in
        flight over the copies (docs/api.md, "map").""")

    def submit(self, g, x, *, timeout: float | None = None, retries: int = 0) -> InputFuture:
        """`run(g, x)` without waiting: a `concurrent.futures.Future` at once, set by the driver's one settler
        thread when Ray says the outputs are ready. `future.cancel()` cancels the input (its calls not
        started never start; its result is dropped)."""
        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        driver, g, graph = self._compiled(g, "Ray.submit")
        try:
            [submission] = driver.submit(graph, [(None, x)], timeout is not None, self._trace, retries,
                                         cancellable=True)
        except NodeError as err:  # its input cannot travel: the future says so, as Local's does
            future = InputFuture()
            future.set_exception(err)
            return future
        return driver.submitted(graph, submission, timeout, source=g)

    async def arun(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """`run(g, x)` without blocking the event loop: the output refs are awaited (Ray sets their futures;
        no thread waits). Cancelling the awaiting task cancels the input."""
        import asyncio

        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        if self._driver is None:
            await asyncio.to_thread(self.start)  # (connecting to Ray takes seconds: not on the loop)
        driver, _, graph = self._compiled(g, "Ray.arun")
        timed = timeout is not None
        deadline = time.monotonic() + timeout if timed else None
        if graph.gathering is not None and not timed:  # it may wait batch_wait for company: not on the loop
            [submission] = await asyncio.to_thread(driver.submit_run, graph, x, timed, self._trace, retries, True)
        else:
            [submission] = driver.submit_run(graph, x, timed, self._trace, retries, cancellable=True)
        tries = driver.tries(graph, submission, timeout, deadline)
        try:
            return await tries.aoutcome()
        finally:
            tries.release()
            driver.run_over(graph, timed)

    amap = _over_inputs(amap_outputs, "Ray.amap", """`map` as an async iterator: `async for y in cluster.amap(g,
        xs)`; `xs` may be an async iterable.""")

    def _compiled(self, g, where: str):
        """The driver, the graph of `g` (a Graph, a Node or an expression) and its ActorGraph."""
        g = self.accepting(g, where)
        if self._driver is None:
            self.start()
        return self._driver, g, self._driver.actor_graph(g)

    # -- tracing -------------------------------------------------------------------------------
    def _trace_started(self, trace: Trace) -> None:
        tracing.block_started(self._driver, trace)

    def _trace_ending(self, trace: Trace) -> None:
        """The actors keep the records of traced inputs: collected now, each actor's times brought onto the
        driver's clock (docs/ray.md)."""
        if self._driver is not None:
            tracing.collect(self._driver, trace)
