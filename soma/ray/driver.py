"""The driver's side of one connected soma.Ray: the Ray session, the book of actors, what was compiled.

    Ray.run, RayInflight (map),    Driver                               below it
    the settler (submit), arun
    ───────────────────────────    ──────                               ────────
    actor_graph(g)            ──▶  an ActorGraph for g's placement  ──▶ copies.NodeActors per node;
                                   (PlacementError here)                devices: options, hosting
    submit(graph, items, ...) ──▶  [Submission], every call sent    ──▶ submission.submit (the walk)
    submit_run / run_over     ──▶  one run's input: with concurrent runs of a batching graph, submitted
                                   together                         ──▶ gathering
    outcomes(batch, graph, t) ──▶  [(ok, value)] per input of a batch, one ray.get (None: not yet);
                                   Ray's errors as soma's           ──▶ faults
    settled(s, graph, values) ──▶  (ok, value) from values already fetched (Ray's futures, `await`)
    tries(graph, s)           ──▶  a Tries: after each try, sent again or finished (one place) ──▶ tries
    resubmit(graph, old, new) ◀──  (from Tries: the next try, or the same one sent elsewhere)
    first_ready(refs, t)      ──▶  the first ref to be ready (ray.wait)
    has_room / add_copy / ... ──▶  a map's held inputs (soma.ray.spreading) ──▶ copies.ActorBook
    release / expire / abandon──▶  the try is over: loads given back; RunTimeout; cancelled

Every call goes down and its answer comes back up: the runner, the map's in-flight
set, the settler and tracing use these methods and attributes (`cpus`, `book`,
`ray_node`, `closed`), never a private. The book's lock (soma.ray.copies, its only
user) guards the actors and their loads; the driver's own lock what was compiled,
`closed` and the settler.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref

from ..errors import RunTimeout, SomaError
from ..run.aio import InputFuture
from ..run.batching import batch_wait_of, is_batching, max_batch_of
from ..run.registry import NodeRegistry
from . import records, tracing
from .copies import CLOSED, CLOSED_IN_FLIGHT, ActorBook, NodeActors, cut_frames
from .devices import actor_options, demand_error, hosting_error, requested_resources
from .faults import abandon, expire, translate
from .gathering import Gathering
from .settler import Settler
from .submission import ActorGraph, Submission, outcome
from .tries import Tries


class Driver:
    """What one soma.Ray holds once connected: `ray`, the cluster's CPUs, this driver's Ray node, the actors."""

    def __init__(self, ray, actor_class, options: dict, tracer=None):
        self.ray = ray
        self.tracer = tracer  # whose open trace block (`current_trace`), if any, takes a let-go node's records
        self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.ray_node = ray.get_runtime_context().get_node_id()
        self.book = ActorBook()
        self.closed = False
        self._lock = threading.RLock()  # what was compiled, `closed`, the settler (the book has its own)
        self._actor_class = actor_class
        self._options = options
        self._registry = NodeRegistry()
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph → (placement version, it)
        self._tokens = itertools.count(1)
        self._settler: Settler | None = None  # submit's one thread, made with the first submitted input

    # -- compiling -----------------------------------------------------------------------------
    def actor_graph(self, g) -> ActorGraph:
        """`g` under its placement, ready to submit (compiled again after a `place`)."""
        with self._lock:
            if self.closed:
                raise SomaError(CLOSED)
            if self._registry.dead:
                self._forget(set(self._registry.take_dead()))
            version = g.placement_version
            found = self._graphs.get(g)
            if found is not None and found[0] == version:
                return found[1]
            graph = self._compile(g)
            self._graphs[g] = (version, graph)
            return graph

    def _forget(self, node_keys: set) -> None:
        """Stop the actors of nodes let go (they can never run again); inside a trace block their records
        are taken first: every node execution inside the block is in it (SPEC 7.5)."""
        trace = self.tracer.current_trace if self.tracer is not None else None
        if trace is not None:
            tracing.collect(self, trace, self.book.actors(node_keys))
        self.book.forget(node_keys)

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
                                             limit, here=self.ray_node)
                except (TypeError, ValueError) as err:
                    raise SomaError(f"options for node `{node_id}` are not Ray actor options Ray accepts: "
                                    f"{err}") from None
                if is_batching(node):
                    node_actors.max_batch = max_batch_of(node)
                self.book.add(key, node_actors)
            actors[node_id] = node_actors
        batching = [n for n in g.nodes() if is_batching(g.node(n))]
        gathering = Gathering(min(batch_wait_of(g.node(n)) for n in batching),
                              max(max_batch_of(g.node(n)) for n in batching), node=batching[0]) if batching else None
        return ActorGraph(g.plan(), actors, devices, gathering)

    # -- submitting and fetching ---------------------------------------------------------------
    def submit(self, graph: ActorGraph, items: list, timed: bool, trace=None, retries: int = 0,
               held: bool = False, cancellable: bool = False) -> list[Submission]:
        """Submit the inputs `items` ((index, x) pairs) together: one call per node for all of them, traced
        in the block `trace` when one is open (all of them in that block). `retries`: how many more tries
        each gets when an actor dies while running it (soma.ray.tries). `held`: a map held them until a copy
        was free (they go to copies that are up: soma.ray.spreading). `cancellable`: a caller may give them up
        (a future, an awaiting task): their actors can be told to skip them (faults.abandon)."""
        submissions = [Submission(index, next(self._tokens), timed, trace, x, retries, cancellable=cancellable)
                       for index, x in items]
        for submission in submissions:
            submission.held = held
        self._submit(graph, [x for _, x in items], submissions)
        return submissions

    def submit_run(self, graph: ActorGraph, x, timed: bool, trace=None, retries: int = 0,
                   cancellable: bool = False) -> list[Submission]:
        """`submit` of one run's input; a graph with a batching node submits concurrent runs together
        (soma.ray.gathering). Call `run_over` once the run is over."""
        if graph.gathering is None or timed:
            return self.submit(graph, [(None, x)], timed, trace, retries, cancellable=cancellable)
        return graph.gathering.submit(
            lambda items, trace, retries: self.submit(graph, items, False, trace, retries, cancellable=cancellable),
            x, trace, retries, drop=self._drop)

    def _drop(self, submission: Submission) -> None:
        """A submitted run nobody waits for (its caller was interrupted): cancelled, its loads given back."""
        self.abandon(submission)
        self.release(submission, "cancelled")

    def run_over(self, graph: ActorGraph, timed: bool) -> None:
        """A run `submit_run` submitted is over (done, failed, expired or cancelled)."""
        if graph.gathering is not None and not timed:
            graph.gathering.over()

    def resubmit(self, graph: ActorGraph, old: Submission, again: Submission) -> None:
        """Submit `again`, the next try of `old`'s input (or the same one, sent elsewhere: it takes over
        `again.keep`, the calls of `old` still good); what is left of `old` is cancelled."""
        taken_over = {id(call) for call in again.keep.values()}
        old.calls = [call for call in old.calls if id(call) not in taken_over]  # (their loads go with them)
        self.abandon(old, "again")
        self._submit(graph, [again.x], [again])

    def _submit(self, graph: ActorGraph, xs: list, submissions: list) -> None:
        if self.closed:  # (its caller was accepted before the close: a map's next batch, a try again)
            raise SomaError(CLOSED_IN_FLIGHT)
        self.book.submit(graph, xs, submissions, self.ray.put)  # (closed meanwhile: the book refuses too)

    def tries(self, graph: ActorGraph, submission: Submission, timeout=None, deadline=None) -> Tries:
        """The input's tries (soma.ray.tries): after each try's outcome, sent again or finished; `deadline`
        (time.monotonic): when its time (`timeout`) is up."""
        return Tries(self, graph, submission, timeout, deadline)

    # -- a map's held inputs (soma.ray.spreading) ----------------------------------------------
    def has_room(self, graph: ActorGraph) -> bool:
        """Whether a held input of `graph` may go now: every node has a free copy that is up."""
        return self.book.has_room(graph.actors.values())

    def copies(self, graph: ActorGraph) -> int:
        """The copies of the node of `graph` that has the fewest."""
        return self.book.copies(graph.actors.values())

    def add_copy(self, graph: ActorGraph) -> bool:
        """Start one more copy of the nodes of `graph` that have the fewest (and may have more)."""
        return self.book.add_copy(graph.actors.values())

    def starting(self, graph: ActorGraph) -> list:
        """The hello refs of the copies of `graph`'s nodes that are still starting."""
        return self.book.starting(graph.actors.values())

    def startup(self, graph: ActorGraph) -> tuple[float, str]:
        """How long a copy of `graph`'s nodes takes to start (seconds, where the figure comes from)."""
        return self.book.startup(graph.actors.values())

    def unstarted_on(self, submission: Submission, actor) -> bool:
        """Whether the input's call at the dead `actor` had not finished and never started: then its try is
        lost (marked so), and it can be sent again at once, before Ray reports the call failed."""
        call = next((c for c in submission.calls if c.actor is actor), None)
        if call is None or actor.death is None or records.started(actor.death, call):
            return False
        ready, _ = self.ray.wait([call.ref], timeout=0, fetch_local=False)
        if ready:
            return False  # it finished before the death (or Ray said it failed: its own wait will hear)
        submission.lost = (call, False)
        return True

    def outcomes(self, batch: list, graph: ActorGraph, timeout) -> list | None:
        """`(ok, value)` for each input of a batch (one `ray.get` for all of them); None when `timeout` passed
        before it finished."""
        ray = self.ray
        try:
            with self._open():
                values = ray.get([ref for submission in batch for ref in submission.refs], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            return None
        except ray.exceptions.RayError as err:  # an actor died, or Ray could not carry a value
            cut_frames(err)
            if len(batch) == 1:
                return [(False, self._translate(batch[0], err))]
            return [self._settled(submission, graph, None) for submission in batch]  # each its own error or value
        settled, start = [], 0
        for submission in batch:
            end = start + len(submission.refs)
            settled.append(self._settled(submission, graph, values[start:end]))
            start = end
        return settled

    @contextlib.contextmanager
    def _open(self):
        """Around a wait on Ray for inputs in flight: once closed, their SomaError, never a call to Ray (Ray
        shut down would start a new default session for it, and refs of the old one raise a raw ValueError);
        whatever a close during the call made Ray raise, the same SomaError (another thread's `close()` under a
        map: 3 of 8 gave Ray's "owner is unknown", Dec 7)."""
        if self.closed:
            raise SomaError(CLOSED_IN_FLIGHT)
        try:
            yield
        except Exception as err:
            if self.closed and not isinstance(err, SomaError):
                raise SomaError(CLOSED_IN_FLIGHT) from None
            raise

    def first_ready(self, refs: list, timeout) -> list:
        """The first of `refs` to be ready (a list of one), or [] when `timeout` passed first."""
        with self._open():
            ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        return ready

    def ready_now(self, refs: list) -> set:
        """Those of `refs` that are ready now (never waits, fetches nothing)."""
        if not refs:
            return set()
        with self._open():
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return set(ready)

    def settled(self, submission: Submission, graph: ActorGraph, values: list) -> tuple:
        """(ok, value) for one input from its refs' values as Ray's futures (or `await`) gave them: an
        exception in the place of a ref that holds a Ray error."""
        error = next((v for v in values if isinstance(v, BaseException)), None)
        if error is None:
            return self._settled(submission, graph, values)
        if isinstance(error, self.ray.exceptions.RayError):
            return False, self._translate(submission, error)
        return False, error

    def _settled(self, submission: Submission, graph: ActorGraph, values) -> tuple:
        """(ok, value) for one input from its refs' values (None: fetch them, and meet Ray's error)."""
        try:
            if values is None:
                return True, self._fetch(submission, graph, None)
            return True, outcome(submission, values, graph.devices)
        except SomaError as err:  # (its traceback, these frames, dropped: their callers hold what it is put in)
            return False, err.with_traceback(None)

    def _fetch(self, submission: Submission, graph: ActorGraph, timeout):
        """Fetch the input's output refs (one `ray.get`), or raise soma's error; Ray's GetTimeoutError passes."""
        ray = self.ray
        try:
            with self._open():
                values = ray.get(submission.refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise
        except ray.exceptions.RayError as err:
            cut_frames(err)
            raise self._translate(submission, err) from None
        return outcome(submission, values, graph.devices)

    def _translate(self, submission: Submission, err) -> SomaError:
        if self.closed:
            return SomaError(CLOSED_IN_FLIGHT)
        return translate(self.ray, submission, err, self.book)

    # -- the end of an input -------------------------------------------------------------------
    def release(self, submission: Submission, how: str = "ok") -> None:
        """The input is over: its actors may take other inputs."""
        self.book.release(submission, how)

    def expire(self, submission: Submission, timeout: float) -> RunTimeout:
        """Its time is up: stop what runs it, cancel what waits; the error that says which."""
        return expire(self.ray, submission, timeout, self.book)

    def abandon(self, submission: Submission, how: str = "cancelled") -> None:
        """Nobody waits for it any more (or its input goes on in another try): cancel what has not started.
        Nothing once the driver is closed: its actors are gone (a map held past its runner's close, collected
        later, asked a Ray that was shut down about its refs: an error at exit)."""
        if not self.closed:
            abandon(self.ray, submission, self.book, how)

    def submitted(self, graph: ActorGraph, submission: Submission, timeout, source=None) -> InputFuture:
        """The future of a submitted input, set by the settler thread (soma.ray.settler); `source`: what must
        live while it is in flight (the Graph that holds its nodes)."""
        with self._lock:
            if self._settler is None:
                self._settler = Settler(self)
            settler = self._settler
        return settler.add(graph, submission, timeout, source)

    def close(self) -> None:
        """Stop every actor soma made (the session itself is the runner's to end)."""
        with self._lock:
            self.closed = True
            self._graphs = weakref.WeakKeyDictionary()
            settler = self._settler
        if settler is not None:
            settler.close(SomaError(CLOSED_IN_FLIGHT))
        self.book.close()
