"""The driver's side of one connected soma.Ray: the Ray session, the book of actors, what was compiled.

    Ray.run / RayInflight (map)    Driver                               below it
    ───────────────────────────    ──────                               ────────
    actor_graph(g)            ──▶  an ActorGraph for g's placement  ──▶ copies.NodeActors per node;
                                   (PlacementError here)                devices: options, hosting
    submit(graph, items, timed)──▶ [Submission], every call sent    ──▶ submission.submit (the walk)
    output(s, graph, timeout) ──▶  one input's output, or soma's error (Ray's → soma's: faults)
    outcomes(batch, graph, t) ──▶  [(ok, value)] per input of a batch, one ray.get (None: not yet)
    first_ready(refs, t)      ──▶  the first ref to be ready (ray.wait)
    release / expire / abandon──▶  the input is over: loads given back; RunTimeout; cancelled

Every call goes down and its answer comes back up: the runner, the map's in-flight
set and tracing use these methods and attributes (`cpus`, `trace`, `book`), never
a private; the book's lock guards the actors, their loads and what was compiled.
"""

from __future__ import annotations

import itertools
import weakref

from ..errors import RunTimeout, SomaError
from ..run.registry import NodeRegistry
from .copies import ActorBook, NodeActors
from .devices import actor_options, demand_error, hosting_error, requested_resources
from .faults import abandon, expire, translate
from .submission import ActorGraph, Submission, outcome, release, submit

CLOSED = "this soma.Ray is closed; make a new one"


class Driver:
    """What one soma.Ray holds once connected: `ray`, the cluster's CPUs, this driver's Ray node, the actors."""

    def __init__(self, ray, actor_class, options: dict):
        self.ray = ray
        self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.ray_node = ray.get_runtime_context().get_node_id()
        self.book = ActorBook()
        self.closed = False
        self.trace = None  # the runner's open trace block (its runs and maps record into it), else None
        self._actor_class = actor_class
        self._options = options
        self._registry = NodeRegistry()
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph → (placement version, it)
        self._tokens = itertools.count(1)

    # -- compiling -----------------------------------------------------------------------------
    def actor_graph(self, g) -> ActorGraph:
        """`g` under its placement, ready to submit (compiled again after a `place`)."""
        with self.book.lock:
            if self.closed:
                raise SomaError(CLOSED)
            if self._registry.has_dead:
                self.book.forget(set(self._registry.take_dead()))  # nodes let go can never run again
            version = g.placement_version
            found = self._graphs.get(g)
            if found is not None and found[0] == version:
                return found[1]
            graph = self._compile(g)
            self._graphs[g] = (version, graph)
            return graph

    def _compile(self, g) -> ActorGraph:
        """The actors of each node (made on first use), checked against the cluster's machines."""
        from ..node import copy_limit

        devices = g.devices()
        machines = [n["Resources"] for n in self.ray.nodes() if n.get("Alive")]
        options = {node_id: actor_options(node_id, devices.get(node_id), self._options.get(node_id))
                   for node_id in g.nodes()}
        for node_id in g.nodes():  # every check before any actor is made: a refused graph leaves nothing
            unhostable = hosting_error(node_id, devices.get(node_id), options[node_id], machines)
            if unhostable is not None:
                raise unhostable
        too_much = demand_error({n: requested_resources(o) for n, o in options.items()}, machines)
        if too_much is not None:
            raise too_much
        actors = {}
        for node_id in g.nodes():
            node = g.node(node_id)
            device = devices.get(node_id)
            key = (self._registry.key_of(node), node_id, device)
            node_actors = self.book.get(key)
            if node_actors is None:
                limit = copy_limit(node_id, node) or self.cpus
                if limit == 1:  # its one copy runs every input in the order they were sent: input order
                    options[node_id].setdefault("allow_out_of_order_execution", False)
                code = self.ray.put(self._registry.code(node_id, key[0]))
                try:
                    node_actors = NodeActors(self.ray, self._actor_class, node_id, device, code, options[node_id],
                                             limit)
                except (TypeError, ValueError) as err:
                    raise SomaError(f"options for node `{node_id}` are not Ray actor options Ray accepts: "
                                    f"{err}") from None
                self.book.add(key, node_actors)
            actors[node_id] = node_actors
        return ActorGraph(g.plan(), actors, devices)

    # -- submitting and fetching ---------------------------------------------------------------
    def submit(self, graph: ActorGraph, items: list, timed: bool) -> list[Submission]:
        """Submit the inputs `items` ((index, x) pairs) together: one call per node for all of them, traced
        when a trace block is open (all of them in that block)."""
        trace = self.trace
        submissions = [Submission(index, next(self._tokens), timed, trace) for index, _ in items]
        with self.book.lock:
            if self.closed:
                raise SomaError(CLOSED)
            try:
                submit(graph, [x for _, x in items], submissions, self.ray.put)
            except BaseException:
                for submission in submissions:
                    release(submission)
                raise
        return submissions

    def output(self, submission: Submission, graph: ActorGraph, timeout):
        """One input's output, or soma's error for it; `RunTimeout` once `timeout` has passed."""
        try:
            return self._fetch(submission, graph, timeout)
        except self.ray.exceptions.GetTimeoutError:
            raise self.expire(submission, timeout) from None

    def outcomes(self, batch: list, graph: ActorGraph, timeout) -> list | None:
        """`(ok, value)` for each input of a batch (one `ray.get` for all of them); None when `timeout` passed
        before it finished."""
        ray = self.ray
        try:
            values = ray.get([ref for submission in batch for ref in submission.refs], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError as err:  # an actor died, or Ray could not carry a value
            if len(batch) == 1:
                return [(False, self._translate(batch[0], err))]
            return [self._settled(submission, graph, None) for submission in batch]  # each its own error or value
        settled, start = [], 0
        for submission in batch:
            end = start + len(submission.refs)
            settled.append(self._settled(submission, graph, values[start:end]))
            start = end
        return settled

    def first_ready(self, refs: list, timeout) -> list:
        """The first of `refs` to be ready (a list of one), or [] when `timeout` passed first."""
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        return ready

    def _settled(self, submission: Submission, graph: ActorGraph, values) -> tuple:
        """(ok, value) for one input from its refs' values (None: fetch them, and meet Ray's error)."""
        try:
            if values is None:
                return True, self._fetch(submission, graph, None)
            return True, outcome(submission, values, graph.devices)
        except SomaError as err:
            return False, err

    def _fetch(self, submission: Submission, graph: ActorGraph, timeout):
        """Fetch the input's output refs (one `ray.get`), or raise soma's error; Ray's GetTimeoutError passes."""
        ray = self.ray
        try:
            values = ray.get(submission.refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise
        except ray.exceptions.RayError as err:
            raise self._translate(submission, err) from None
        return outcome(submission, values, graph.devices)

    def _translate(self, submission: Submission, err) -> SomaError:
        if self.closed:
            return SomaError("this soma.Ray was closed while this run was in flight")
        return translate(self.ray, submission, err, self.book)

    # -- the end of an input -------------------------------------------------------------------
    def release(self, submission: Submission, how: str = "ok") -> None:
        """The input is over: its actors may take other inputs."""
        with self.book.lock:
            release(submission, how)

    def expire(self, submission: Submission, timeout: float) -> RunTimeout:
        """Its time is up: stop what runs it, cancel what waits; the error that says which."""
        return expire(self.ray, submission, timeout, self.book)

    def abandon(self, submission: Submission) -> None:
        """Nobody waits for it any more: cancel what has not started."""
        abandon(self.ray, submission, self.book)

    def close(self) -> None:
        """Stop every actor soma made (the session itself is the runner's to end)."""
        with self.book.lock:
            self.closed = True
            self._graphs = weakref.WeakKeyDictionary()
        self.book.close()
