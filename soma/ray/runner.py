"""`soma.Ray`: the same graphs, `run` and `map`, on a Ray cluster. See docs/ray.md.

    with soma.Ray() as cluster:            # a local Ray, started here and shut down at close()
        y = cluster.run(g, x)

    start()     ray.init(address, **init), unless Ray is already initialised in this process:
                then that session is used, and left running at close()
    run(g, x)   program (once per graph and placement: the copies of each node, PlacementError
                here, before anything is submitted)
                → flows.submit_batch: every node's call at once, values actor to actor as ObjectRefs
                → wait for the output's refs → flows.outcome: soma's error, or the output
                  (a Ray error on the way → WorkerDied or NodeError: never Ray's own classes)
    map(g, xs)  soma.run.mapping.map_outputs over `_RayFlows`: `window` inputs in flight, spread over
                the copies of each node (copies: a new copy when every copy is busy), in batches
                that share one call per node (window 4, two copies: two inputs a call; docs/ray.md)
    trace(p)    the actors keep the spans of traced inputs; the block's end collects them, each
                actor's clock brought onto the driver's

Modules: devices (pure: options, CUDA order, hosting), actor (in the
actors), copies (which actor takes an input), flows (one input through a
plan), faults (Ray's errors as soma's, timeouts), this one (life, map, trace).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import weakref

from ..errors import NodeError, RunTimeout, SomaError
from ..run.base import RunnerBase
from ..run.mapping import Inflight, default_window, map_outputs
from ..run.trace import Trace
from .copies import control
from .devices import (
    actor_options,
    checked_options,
    demand_error,
    hosting_error,
    requested_resources,
)
from .faults import UNANSWERED, abandon, ask, expire, translate
from .flows import Flow, Program, outcome, release, submit_batch

SPANS_ANSWER_S = 10.0  # how long the end of a trace block waits for each actor's spans
MAX_BATCH = 8  # the most inputs of a map that share one call per node


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
        self._lock = threading.RLock()
        self._started = False
        self._owns_session = False
        self._closed = False
        self._cpus = 1
        self._driver_node = None
        self._actor_cls = None
        self._copies: dict = {}  # (node key, node id, device) → NodeCopies
        # graph → (its placement's version, the Program compiled for it)
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._tokens = itertools.count(1)
        from ..run.registry import NodeRegistry

        self._registry = NodeRegistry()

    # -- life ----------------------------------------------------------------------------------
    def start(self) -> "Ray":
        """Connect to Ray (starting a local one when `address` is None and Ray is not initialised here)."""
        ray = self._ray
        with self._lock:
            if self._closed:
                raise SomaError("this soma.Ray is closed; make a new one")
            if self._started:
                return self
            if not ray.is_initialized():
                ray.init(address=self.address, **self.init)
                self._owns_session = True
            self._cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
            self._driver_node = ray.get_runtime_context().get_node_id()
            self._actor_cls = _actor_class(ray)
            self._started = True
        return self

    def close(self) -> None:
        """Stop every actor soma made; shut Ray down if soma started it (a session it found stays up)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            copies, self._copies = list(self._copies.values()), {}
            self._programs = weakref.WeakKeyDictionary()
        if not self._started:
            return
        for node_copies in copies:
            node_copies.close()
        if self._owns_session and self._ray.is_initialized():
            self._ray.shutdown()

    # -- running -------------------------------------------------------------------------------
    def run(self, g, x, *, timeout: float | None = None):
        """Run graph `g` on input `x` on the cluster and return its output."""
        program = self._ready(g)
        trace = self._trace
        with trace.host_step("run", input=None) if trace is not None else contextlib.nullcontext():
            [flow] = self._submit(program, [(None, x)], timeout is not None)
            try:
                return self._await(flow, program, timeout)
            finally:
                with self._lock:
                    release(flow)

    def map(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None):
        """The outputs for the inputs of `xs`, lazily, `window` inputs in flight over the copies (SPEC 7.4)."""
        program = self._ready(g)
        batch = _batch_size(program, window or default_window(self._cpus), timeout)
        return map_outputs(_RayFlows(self, program, timeout, ordered, batch), xs, window=window, ordered=ordered,
                           progress=progress, timeout=timeout)

    def _ready(self, g) -> Program:
        if not self._started:
            self.start()
        with self._lock:
            if self._closed:
                raise SomaError("this soma.Ray is closed; make a new one")
            if self._registry.has_dead:
                self._forget_dead_nodes()
            version = g._placement.version  # bumped by every `place`: compiled again after one
            found = self._programs.get(g)
            if found is not None and found[0] == version:
                return found[1]
            program = self._compile(g)
            self._programs[g] = (version, program)
            return program

    def _compile(self, g) -> Program:
        """The copies of each node (made on first use), checked against the cluster's machines."""
        from ..node import copy_limit
        from .copies import NodeCopies

        devices = g.devices()
        machines = [n["Resources"] for n in self._ray.nodes() if n.get("Alive")]
        options = {node_id: actor_options(node_id, devices.get(node_id), self.options.get(node_id))
                   for node_id in g.nodes()}
        for node_id in g.nodes():  # every check before any copy is made: a refused graph leaves nothing
            unhostable = hosting_error(node_id, devices.get(node_id), options[node_id], machines)
            if unhostable is not None:
                raise unhostable
        too_much = demand_error({n: requested_resources(o) for n, o in options.items()}, machines)
        if too_much is not None:
            raise too_much
        stages = {}
        for node_id in g.nodes():
            node = g._catalog[node_id]
            device = devices.get(node_id)
            key = (self._registry.key_of(node), node_id, device)
            copies = self._copies.get(key)
            if copies is None:
                limit = copy_limit(node_id, node) or self._cpus
                if limit == 1:  # its one copy runs every input in the order they were sent: input order
                    options[node_id].setdefault("allow_out_of_order_execution", False)
                code = self._ray.put(self._registry.code(node_id, key[0]))
                try:
                    copies = NodeCopies(self._ray, self._actor_cls, node_id, device, code, options[node_id], limit)
                except (TypeError, ValueError) as err:
                    raise SomaError(f"options for node `{node_id}` are not Ray actor options Ray accepts: "
                                    f"{err}") from None
                self._copies[key] = copies
            stages[node_id] = copies
        return Program(g.plan(), stages, devices)

    def _forget_dead_nodes(self) -> None:
        """Nodes the caller has let go can never run again: stop their actors."""
        dead = set(self._registry.take_dead())
        if dead:
            for key in [k for k in self._copies if k[0] in dead]:
                self._copies.pop(key).close()

    def _submit(self, program: Program, items: list, timed: bool) -> list:
        """Submit the inputs `items` ((index, x) pairs) together: one call per node for all of them."""
        flows = [Flow(index, next(self._tokens), timed, self._trace) for index, _ in items]
        with self._lock:
            if self._closed:
                raise SomaError("this soma.Ray is closed; make a new one")
            try:
                submit_batch(program, [x for _, x in items], flows, self._ray.put)
            except BaseException:
                for flow in flows:
                    release(flow)
                raise
        return flows

    def _await(self, flow: Flow, program: Program, timeout):
        """The input's output, or soma's error for it; `RunTimeout` once `timeout` has passed."""
        try:
            return self._collect(flow, program, timeout)
        except self._ray.exceptions.GetTimeoutError:
            raise self._expire(flow, timeout) from None

    def _collect(self, flow: Flow, program: Program, timeout):
        """Fetch the input's output refs (one `ray.get`), or raise soma's error; Ray's GetTimeoutError passes."""
        ray = self._ray
        try:
            values = ray.get(flow.refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise
        except ray.exceptions.RayError as err:
            raise self._translate(flow, err) from None
        return outcome(flow, values, program.devices)

    # -- Ray's errors, as soma's (soma/ray/faults.py) ---------------------------------------------
    def _translate(self, flow: Flow, err) -> SomaError:
        if self._closed:
            return SomaError("this soma.Ray was closed while this run was in flight")
        return translate(self._ray, flow, err, self._drop)

    def _expire(self, flow: Flow, timeout: float) -> RunTimeout:
        return expire(self._ray, flow, timeout, self._lock, self._drop)

    def _abandon(self, flow: Flow) -> None:
        abandon(self._ray, flow, self._lock)

    def _drop(self, copy) -> None:
        """A copy that died, or that soma stopped: forget it (the next input that needs its node starts another)."""
        with self._lock:
            copy.owner.drop(copy)

    # -- tracing -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def trace(self, path):
        """Record every node execution in this block and write it to `path` as Chrome trace-event JSON.

        The actors keep the spans of traced inputs; they are collected when the block
        ends, each actor's times brought onto the driver's clock (docs/ray.md).
        """
        with super().trace(path) as trace:
            try:
                yield trace
            finally:
                self._collect_spans(trace)

    def _trace_started(self, trace: Trace) -> None:
        trace.process(os.getpid(), f"host (soma.Ray driver, pid {os.getpid()})")
        for copy in self._all_copies():
            if copy.ready:
                self._offset_of(copy)  # at the start of the block, as near as possible to the spans

    def _collect_spans(self, trace: Trace) -> None:
        copies = self._all_copies()
        for copy, taken in zip(copies, ask(self._ray, [c.actor for c in copies], "take_spans", SPANS_ANSWER_S)):
            if taken == UNANSWERED:
                continue  # dead, or stuck: its spans are lost with it
            # Only this block's inputs: one still running when an earlier block ended filed its spans after
            # that block took them (they belong to no open block: dropped, as a span after its block's end).
            taken = [(index, spans) for (index, block), spans in taken if block == trace.start_ns]
            if not taken:
                continue
            if not copy.ready:
                copy.owner.learn(copy)
            owner = copy.owner
            devices = {owner.node_id: owner.device} if owner.device is not None else {}
            offset = self._offset_of(copy)
            trace.process(copy.pid, f"Ray actor {copy.actor_id} (node `{owner.node_id}`, pid {copy.pid})")
            for index, spans in taken:
                trace.node_spans(spans, copy.pid, copy.actor_id, devices, index, offset)

    def _offset_of(self, copy) -> int:
        """The driver's clock minus this actor's: 0 on the driver's machine (one CLOCK_MONOTONIC), else measured.

        Measured as the best of three round trips asking the actor for its clock,
        against the middle of the round trip: off by at most half of that round trip.
        """
        if copy.offset_ns is not None:
            return copy.offset_ns
        if copy.ray_node == self._driver_node:
            copy.offset_ns = 0
            return 0
        best = None
        for _ in range(3):
            before = time.monotonic_ns()
            try:
                theirs = self._ray.get(control(copy.actor, "clock"), timeout=SPANS_ANSWER_S)
            except Exception:  # gone, or stuck: its spans (if any) are placed as if on this machine
                return 0
            after = time.monotonic_ns()
            if best is None or after - before < best[0]:
                best = (after - before, (before + after) // 2 - theirs)
        copy.offset_ns = best[1]
        return copy.offset_ns

    def _all_copies(self) -> list:
        with self._lock:
            return [copy for node_copies in self._copies.values() for copy in node_copies.copies]


def _batch_size(program: Program, window: int, timeout) -> int:
    """How many of a map's inputs share one call per node (docs/ray.md, "Batches").

    The window spread over the copies of the node that has the most (window 4, two copies: two calls of
    two inputs), at most MAX_BATCH. A call costs Ray ~400 µs of the actor's CPU and ~350 µs of the
    driver's whatever it carries, so fewer calls are the cheapest inputs; a batch's outputs come back
    together, so the cap bounds how long its first output waits for the others. Inputs with a timeout
    go one per call: stopping or cancelling one must not touch another's call.
    """
    if timeout is not None:
        return 1
    spread = max(copies.limit for copies in program.stages.values())
    return max(1, min(MAX_BATCH, -(-window // spread)))


class _RayFlows(Inflight):
    """Ray's in-flight set for map: inputs submitted in batches (every node's call shared by a batch, one
    ref per input), a batch's outputs fetched together, each input's outcome its own."""

    def __init__(self, runner: Ray, program: Program, timeout, ordered: bool, batch: int):
        self.runner, self.program, self.timeout, self.ordered = runner, program, timeout, ordered
        self.batch = batch  # inputs per batch (at most)
        self.flows: dict = {}  # index → Flow, oldest first (inputs start in index order)
        self.by_ref: dict = {}  # an output ref of a batch's first input, not ready yet → that input (unordered)
        self.refused: list = []  # (index, False, error) for inputs that could not even be submitted

    def parallelism(self) -> int:
        return self.runner._cpus

    def start(self, items: list) -> None:
        size = self.batch
        for first in range(0, len(items), size):
            self._start(items[first:first + size])

    def _start(self, items: list) -> None:
        try:
            flows = self.runner._submit(self.program, items, self.timeout is not None)
        except NodeError as err:  # an input that cannot travel (autograd): its own error, in its place
            if len(items) > 1:  # nothing of the batch was submitted: each on its own, so only that one fails
                for item in items:
                    self._start([item])
                return
            self.refused.append((items[0][0], False, err))
            return
        for flow in flows:
            self.flows[flow.index] = flow
        if not self.ordered:
            lead = flows[0]  # a batch's inputs share every call: they are ready when its first one is
            for ref in lead.refs:
                self.by_ref[ref] = lead

    def wait(self, timeout):
        if self.refused:
            refused, self.refused = self.refused, []
            return refused
        if not self.flows:
            return []
        if self.ordered:
            # In order, only the oldest input can be handed out next, and map takes no new input before it
            # is (its window counts what is not handed out yet): wait for that one's batch alone, one ray.get.
            return self._conclude(next(iter(self.flows.values())).batch, timeout)
        # One at a time: with a window of a few inputs, asking again for whatever else is ready costs more
        # than it gathers (map_outputs calls back at once while outputs are there).
        ready, _ = self.runner._ray.wait(list(self.by_ref), num_returns=1, timeout=timeout)
        finished = []
        for ref in ready:
            lead = self.by_ref.pop(ref)
            lead.pending -= 1
            if lead.pending == 0:
                finished += self._conclude(lead.batch, None)
        return finished

    def _conclude(self, batch: list, timeout) -> list:
        """[(index, ok, value)] for each input of a finished batch (one `ray.get` for all of them); [] when
        `timeout` passed before it finished."""
        runner, ray = self.runner, self.runner._ray
        try:
            values = ray.get([ref for flow in batch for ref in flow.refs], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return []
        except ray.exceptions.RayError as err:  # an actor died, or Ray could not carry a value
            if len(batch) == 1:
                return [self._over(batch[0], False, runner._translate(batch[0], err))]
            return [self._settled(flow, None) for flow in batch]  # each input's own error (or value)
        finished, start = [], 0
        for flow in batch:
            end = start + len(flow.refs)
            finished.append(self._settled(flow, values[start:end]))
            start = end
        return finished

    def _settled(self, flow: Flow, values) -> tuple:
        """(index, ok, value) for one input, from its refs' values (None: fetch them, and meet Ray's error)."""
        try:
            if values is None:
                value = self.runner._collect(flow, self.program, None)
            else:
                value = outcome(flow, values, self.program.devices)
        except SomaError as err:
            return self._over(flow, False, err)
        return self._over(flow, True, value)

    def _over(self, flow: Flow, ok: bool, value) -> tuple:
        del self.flows[flow.index]
        with self.runner._lock:
            release(flow, "ok" if ok else type(value).__name__)
        return flow.index, ok, value
    def expire(self, index: int) -> BaseException:
        flow = self.flows.pop(index)
        for ref in flow.refs:
            self.by_ref.pop(ref, None)
        return self.runner._expire(flow, self.timeout)

    def close(self) -> None:
        flows, self.flows = list(self.flows.values()), {}
        self.by_ref.clear()
        for flow in flows:
            self.runner._abandon(flow)
