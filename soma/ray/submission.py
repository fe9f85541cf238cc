"""One input (or a map's batch) submitted to Ray: the driver walks the plan once and submits every call at once.

    plan:        tokenize >> (encoder | other) >> join
    submission:  r1 = tokenize#1.call(x)
                 r2 = encoder#1.call(r1)      r3 = other#2.call(r1)      (two actors: the branches overlap)
                 r4 = join#1.call_with(meta, r2, r3)   shape (0, 1): join receives (encoder's, other's)
                 refs = [r4]                  the driver waits for this ref alone

Every call is submitted before any has run: Ray starts each one when the refs it
takes are ready, and the values go from the object store of the producing actor
to the consuming actor, never through the driver (small values, under Ray's
100 KiB inline limit, ride back in Ray's task replies to the driver, which owns
every ref, and on into the next call, without being deserialized there).

Calls carry the input's *shape* (how the flat args make the node's input: a
wave's output is a tuple, nested waves nest) and the *checks* (for each arg from
a placed node: where that node declared its output would be), so the consuming
actor can check the postcondition on what arrives. The driver does the same for
the run's output (`outcome`).

A map's batch (docs/ray.md, "Batches") walks the plan once for all its inputs:
each node gets one call for the batch, with one return per input.

    batch:  [a1, a2] = add#1.call_many(x1, x2)        (num_returns=2)
            [d1, d2] = double#2.call_many(a1, a2)      the driver waits for d1 and d2 together

The walk is `soma.plan.fold`, done once per `ActorGraph`: it folds the plan into
one function that submits each step's call, a sequence's items in order and a
wave's branches side by side.
"""

from __future__ import annotations

import os
import time

from ..errors import NodeError
from ..plan import Plan, fold
from ..run.postcondition import check_postcondition
from .actor import carries_autograd, first_failure, grad_crossing
from .spreading import HEAVY_S
from .values import exact, tensors_out_of_band, writable


class Out:
    """A value the walk has produced: a ref to a node's output (`producer` its id), or the run's own input."""

    __slots__ = ("ref", "producer")

    def __init__(self, ref, producer: str | None):
        self.ref = ref
        self.producer = producer


class Call:
    """One Ray call an input took part in: the node, the actor it went to, the ref of this input's output,
    and the input's position among those the call carried (0 unless a map's batch)."""

    __slots__ = ("node_id", "actor", "ref", "position")

    def __init__(self, node_id: str, actor, ref, position: int = 0):
        self.node_id = node_id
        self.actor = actor  # the CopyActor (soma.ray.copies)
        self.ref = ref
        self.position = position


class ActorGraph:
    """A graph under one placement, ready to submit: its plan, the actors of each node, and the plan's walk."""

    __slots__ = ("plan", "actors", "devices", "entry_nodes", "shares_input", "walk", "upstream", "cost", "gathering")

    def __init__(self, plan: Plan, actors: dict, devices: dict, gathering=None):
        self.plan = plan
        self.gathering = gathering  # its concurrent runs' meeting place when a node batches (soma.ray.gathering)
        self.actors = actors  # node id → NodeActors
        self.devices = devices
        self.entry_nodes = fold(plan, lambda step: [step.id], _first_item, _every_branch)
        # More than one call receives the input: put it in the object store once, not once per call.
        self.shares_input = len(self.entry_nodes) > 1
        # walk(values, submissions) → each input's value after the plan, every call submitted on the way
        self.walk = fold(plan, self._step, _in_sequence, _side_by_side)
        # node id → the nodes whose outputs its call takes (none for an entry node)
        self.upstream: dict = {}
        fold(plan, self._producers, _in_sequence, _every_output)(frozenset(), self.upstream)
        # Actor-seconds one input takes, as runs and maps measure it (soma.ray.spreading.measured); None: not
        # seen yet
        self.cost: float | None = None

    def spreads(self) -> bool:
        """Whether a map's inputs go one per call, held at the driver until a copy is free, and copies are
        added when they pay for their start-up (soma.ray.spreading): until they are known to be cheap (a
        heavy input gains little from sharing a call, and waits for the others of its call, or behind them
        in one actor)."""
        if any(node_actors.max_batch for node_actors in self.actors.values()):
            return False  # a batching node asked for batches: its calls carry as many inputs as the window gives
        return self.cost is None or self.cost >= HEAVY_S

    def _producers(self, step):
        def producers(takes: frozenset, upstream: dict) -> frozenset:
            upstream[step.id] = takes
            return frozenset((step.id,))
        return producers

    def _step(self, step):
        node_id = step.id
        return lambda values, submissions: _call(self, node_id, values, submissions)


def _first_item(_, entries: list) -> list:
    return entries[0]


def _every_branch(_, entries: list) -> list:
    return [node for branch in entries for node in branch]


def _in_sequence(_, walks: list):
    def walk(values: list, submissions: list) -> list:
        for item in walks:
            values = item(values, submissions)
        return values
    return walk


def _every_output(_, walks: list):
    def producers(takes: frozenset, upstream: dict) -> frozenset:
        return frozenset().union(*(branch(takes, upstream) for branch in walks))
    return producers


def _side_by_side(_, walks: list):
    def walk(values: list, submissions: list) -> list:
        branches = [branch(values, submissions) for branch in walks]
        return [tuple(outs) for outs in zip(*branches)]
    return walk


class Submission:
    """One input on its way: its calls (in submission order, which is a topological order) and its output refs."""

    __slots__ = ("index", "token", "timed", "tokened", "trace", "trace_tag", "started_ns", "calls", "out", "leaves",
                 "refs", "pending", "over", "batch", "x", "tries", "retries", "keep", "lost", "held", "sent_at",
                 "alone")

    def __init__(self, index, token: int, timed: bool, trace, x=None, retries: int = 0, tries: int = 1,
                 cancellable: bool = False):
        self.index = index  # its position in a map; None for run
        self.token = token  # unique per runner: which input an actor is running now (when timed)
        self.timed = timed  # it has a timeout: its calls carry the token, so a late one can be found
        # Its calls carry the token: timed, or a caller may give it up (a future, an awaiting task), so an
        # actor can be told to skip it (NodeCopy.forget) when Ray's own cancel comes too late.
        self.tokened = timed or cancellable
        self.trace = trace  # the runner's Trace when this input is traced, else None
        # What the actors file its spans under: its index, and its trace block (the block's start), so a block
        # collects only its own inputs' spans, not those of an input that was still running when an earlier
        # block ended.
        self.trace_tag = (index, trace.start_ns) if trace is not None else None
        self.started_ns = time.monotonic_ns() if trace is not None else 0
        self.calls: list[Call] = []
        self.out = None  # tree of Out: one, or tuples of them (a plan ending in a wave)
        self.leaves: list[Out] = []
        self.refs: list = []
        self.pending = 0  # map: refs of `refs` not ready yet
        self.over = False  # its actors' loads were given back
        self.batch: list = [self]  # the inputs submitted with it, itself included: they share every call
        self.x = x  # the input itself, while it is in flight: sent again when an actor it was queued at dies
        self.retries = retries  # how many more tries it may have when an actor dies while running it
        self.tries = tries  # this is its try number `tries` (each earlier one lost to a dead actor)
        self.keep: dict = {}  # node id → a Call of its last try to take over (it never reached the dead actor)
        self.lost = None  # (its call there, whether it had started) once this try was lost to a dead actor
        self.held = False  # a map held it until a copy was free: it goes to a copy that is up (soma.ray.spreading)
        self.sent_at = 0.0  # when its calls were sent (time.monotonic)
        self.alone = True  # every call went alone to a copy that was up and idle: its time is its cost

    def ended(self, how: str = "ok") -> None:
        """This try is over (the book gave its actors' loads back: soma.ray.copies.ActorBook.release): a traced
        input of a map becomes an interval on the driver's track, unless it goes on in another try (`how` is
        "again"); a run's is its caller's span."""
        if self.trace is not None and self.index is not None and how != "again":
            self.trace.interval(f"input {self.index}", "host", self.started_ns, time.monotonic_ns(), os.getpid(),
                                f"input-{self.token}", {"input": self.index, "outcome": how})
        batch = self.batch  # (each of a batch holds the list that holds it: with every one of them over, none
        if all(s.over for s in batch):  # is read again, and the cycle kept their inputs until gc ran)
            for s in batch:
                s.batch = ()

    def again(self, counted: bool) -> "Submission":
        """The same input, to be submitted again: another try (`counted`), or the same one sent elsewhere."""
        again = Submission(self.index, self.token, self.timed, self.trace, self.x, self.retries,
                           self.tries + (1 if counted else 0), self.tokened)
        again.trace_tag, again.started_ns = self.trace_tag, self.started_ns  # (one input, one trace interval)
        again.held, again.alone = self.held, False  # (its time would count the try before: not its cost)
        return again


def submit(graph: ActorGraph, xs: list, submissions: list, put) -> None:
    """Submit every call of one input, or of a map's batch of inputs: one Ray call per node for all of them
    (called by the book, under its lock: soma.ray.copies.ActorBook.submit; its NodeActors pick each call's
    actor). One input: `call` (exactly the one arg a hand-written actor takes). Several: `call_many`, one
    return per input, so each input still has its own ref at every node, and downstream calls, failures,
    checks and spans stay per input.
    """
    entry = graph.entry_nodes[0]
    tensors_out_of_band()  # this process's tensors reach Ray's store out of band too
    for x in xs:
        if carries_autograd(x):
            raise grad_crossing(entry, "its input is")
    xs = [exact(x) for x in xs]  # (what Ray's serializer would change: bytearrays, memoryviews, ...)
    if graph.shares_input:
        try:
            first = [Out(put(x), None) for x in xs]
        except Exception as err:
            raise unsendable(entry, err) from None
    else:
        first = [Out(x, None) for x in xs]  # sent with the entry node's call (see `_call`)
    now = time.monotonic()
    for submission in submissions:
        submission.sent_at = now
    outs = graph.walk(first, submissions)
    for submission, out in zip(submissions, outs):
        submission.batch = submissions
        submission.out = out
        _collect(out, submission.leaves)
        submission.refs = [leaf.ref for leaf in submission.leaves]
        submission.pending = len(submission.refs)


def _call(graph: ActorGraph, node_id: str, values: list, submissions: list) -> list:
    kept = submissions[0].keep.get(node_id)
    if kept is not None:  # (only for an input sent again alone: its call here never met the dead actor)
        submissions[0].calls.append(kept)
        return [Out(kept.ref, node_id)]
    args: list = []  # every input's args, one after the other
    metas: list = []  # per input: (how many args, shape, checks, trace tag)
    simple = True  # one whole input each, nothing to check, no timeout, not traced: the one-arg call
    for value, submission in zip(values, submissions):
        start, checks = len(args), []
        shape = _flatten(value, args, checks, graph.devices, start)
        metas.append((len(args) - start, shape, tuple(checks), submission.trace_tag))
        simple = simple and shape == 0 and not checks and submission.trace_tag is None and not submission.tokened
    actor = graph.actors[node_id].pick(len(submissions), held=submissions[0].held)
    if len(submissions) > 1 or not actor.ready or actor.load > 1:
        for submission in submissions:
            submission.alone = False  # it shares the call, or waits for the copy or behind other inputs
    try:
        if len(submissions) == 1:
            if simple:
                refs = [actor.handle.call.remote(args[0])]
            else:
                only = submissions[0]
                _, shape, checks, trace_tag = metas[0]
                token = only.token if only.tokened else None
                refs = [actor.handle.call_with.remote((token, shape, checks, trace_tag), *args)]
        elif simple:
            refs = actor.batched("call_many", len(submissions)).remote(*args)
        else:
            refs = actor.batched("call_many_with", len(submissions)).remote(tuple(metas), *args)
    except Exception as err:
        graph.actors[node_id].give_back(actor, len(submissions))  # nothing was sent
        if graph.shares_input or node_id != graph.entry_nodes[0]:
            raise  # only the entry node's call carries the input itself; the others carry refs
        raise unsendable(node_id, err) from None
    outs = []
    for position, (submission, ref) in enumerate(zip(submissions, refs)):
        submission.calls.append(Call(node_id, actor, ref, position))
        outs.append(Out(ref, node_id))
    return outs


def unsendable(entry: str, err: Exception) -> NodeError:
    """The error for an input Ray cannot serialize (in `ray.put` or a call's args), naming the entry node,
    in Local's words. Ray wraps a pickling TypeError in its own ("Could not serialize ...", with a report of
    several lines): the pickling error itself is what the caller needs."""
    cause = err.__cause__ if isinstance(err, TypeError) and err.__cause__ is not None else err
    return NodeError.failed(entry, f"its input cannot be sent to a Ray actor: {type(cause).__name__}: "
                                   f"{first_line(cause)}")


def first_line(err) -> str:
    """The first line of an error's text (Ray's run on for lines), or its class when it has none."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


def _flatten(value, args: list, checks: list, devices: dict, start: int = 0):
    """Refs as top-level args (Ray resolves only those), and the shape that puts them back together.

    Positions count from `start`: an input's own args, wherever they sit among a batch's.
    """
    if type(value) is Out:
        position = len(args) - start
        args.append(value.ref)
        declared = devices.get(value.producer)  # None for the run's input (no producer) and unplaced nodes
        if declared is not None:
            checks.append((position, value.producer, declared))
        return position
    return tuple(_flatten(item, args, checks, devices, start) for item in value)


def _collect(tree, leaves: list) -> None:
    if type(tree) is Out:
        leaves.append(tree)
    else:
        for item in tree:
            _collect(item, leaves)


def outcome(submission: Submission, values: list, devices: dict):
    """The run's output from the values of its refs, or the error to raise (the first failure in branch order).

    The driver checks the postcondition on what arrived, like every consuming actor.
    """
    failed = first_failure(values)
    if failed is not None:
        raise failed.rebuild()
    for leaf, value in zip(submission.leaves, values):
        check_postcondition(leaf.producer, devices.get(leaf.producer), value)
    return writable(_rebuild(submission.out, iter(values)))  # the caller's to write, not a view of Ray's store


def value_of(future):
    """What a done future of a ref holds (Ray's or asyncio's): its value, or the exception in its place."""
    error = future.exception()
    return error if error is not None else future.result()


def _rebuild(tree, values):
    if type(tree) is Out:
        return next(values)
    return tuple(_rebuild(item, values) for item in tree)
