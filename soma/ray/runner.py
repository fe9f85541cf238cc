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
                             inputs share one call per node (call_many: one return per input)
    Ray.trace(path)          tracing.py: the actors keep their records; the block's end collects them
"""

from __future__ import annotations

import contextlib
import threading

from ..errors import SomaError
from ..run.base import RunnerBase
from ..run.mapping import default_window, map_outputs
from ..run.trace import Trace
from . import tracing
from .devices import checked_options
from .driver import CLOSED, Driver
from .inflight import RayInflight, batch_size


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
                    ray.init(address=self.address, **self.init)
                    self._owns_session = True
                driver = Driver(ray, _actor_class(ray), self.options)
                driver.trace = self._trace  # a block opened before the first run
                self._driver = driver
        return self

    def close(self) -> None:
        """Stop every actor soma made; shut Ray down if soma started it (a session it found stays up)."""
        with self._life:
            if self._closed:
                return
            self._closed = True
            driver = self._driver
        if driver is None:
            return
        driver.close()
        if self._owns_session and self._ray.is_initialized():
            self._ray.shutdown()

    # -- running -------------------------------------------------------------------------------
    def run(self, g, x, *, timeout: float | None = None):
        """Run graph `g` on input `x` on the cluster and return its output."""
        driver = self._connected()
        graph = driver.actor_graph(g)
        trace = self._trace
        with trace.host_step("run", input=None) if trace is not None else contextlib.nullcontext():
            [submission] = driver.submit(graph, [(None, x)], timeout is not None)
            try:
                return driver.output(submission, graph, timeout)
            finally:
                driver.release(submission)

    def map(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None):
        """The outputs for the inputs of `xs`, lazily, `window` inputs in flight over the copies (SPEC 7.4)."""
        driver = self._connected()
        graph = driver.actor_graph(g)
        batch = batch_size(graph, window or default_window(driver.cpus), timeout)
        return map_outputs(RayInflight(driver, graph, timeout, ordered, batch), xs, window=window, ordered=ordered,
                           progress=progress, timeout=timeout)

    def _connected(self) -> Driver:
        if self._driver is None:
            self.start()
        return self._driver

    # -- tracing -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def trace(self, path):
        """Record every node execution in this block and write it to `path` as Chrome trace-event JSON.

        The actors keep the records of traced inputs; they are collected when the block
        ends, each actor's times brought onto the driver's clock (docs/ray.md).
        """
        with super().trace(path) as trace:
            driver = self._driver
            if driver is not None:
                driver.trace = trace
            try:
                yield trace
            finally:
                driver = self._driver  # (connected during the block, perhaps)
                if driver is not None:
                    driver.trace = None
                    tracing.collect(driver, trace)

    def _trace_started(self, trace: Trace) -> None:
        tracing.block_started(self._driver, trace)
