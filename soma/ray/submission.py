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
from .actor import (
    carries_autograd,
    first_failure,
    grad_crossing,
    tensors_out_of_band,
    writable,
)


class Out:
    """A value the walk has produced: a ref to a node's output (`producer` its id), or the run's own input."""

    __slots__ = ("ref", "producer")

    def __init__(self, ref, producer: str | None):
        self.ref = ref
        self.producer = producer


class Call:
    """One Ray call an input took part in: the node, the actor it went to, the ref of this input's output."""

    __slots__ = ("node_id", "actor", "ref")

    def __init__(self, node_id: str, actor, ref):
        self.node_id = node_id
        self.actor = actor  # the CopyActor (soma.ray.copies)
        self.ref = ref


class ActorGraph:
    """A graph under one placement, ready to submit: its plan, the actors of each node, and the plan's walk."""

    __slots__ = ("plan", "actors", "devices", "entry_nodes", "shares_input", "walk")

    def __init__(self, plan: Plan, actors: dict, devices: dict):
        self.plan = plan
        self.actors = actors  # node id → NodeActors
        self.devices = devices
        self.entry_nodes = fold(plan, lambda step: [step.id], _first_item, _every_branch)
        # More than one call receives the input: put it in the object store once, not once per call.
        self.shares_input = len(self.entry_nodes) > 1
        # walk(values, submissions) → each input's value after the plan, every call submitted on the way
        self.walk = fold(plan, self._step, _in_sequence, _side_by_side)

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


def _side_by_side(_, walks: list):
    def walk(values: list, submissions: list) -> list:
        branches = [branch(values, submissions) for branch in walks]
        return [tuple(outs) for outs in zip(*branches)]
    return walk


class Submission:
    """One input on its way: its calls (in submission order, which is a topological order) and its output refs."""

    __slots__ = ("index", "token", "timed", "trace", "trace_tag", "started_ns", "calls", "out", "leaves", "refs",
                 "pending", "over", "batch")

    def __init__(self, index, token: int, timed: bool, trace):
        self.index = index  # its position in a map; None for run
        self.token = token  # unique per runner: which input an actor is running now (when timed)
        self.timed = timed  # it has a timeout: its calls carry the token, so a late one can be found
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


def submit(graph: ActorGraph, xs: list, submissions: list, put) -> None:
    """Submit every call of one input, or of a map's batch of inputs: one Ray call per node for all of them
    (under the book's lock: actors are picked here). One input: `call` (exactly the one arg a hand-written
    actor takes). Several: `call_many`, one return per input, so each input still has its own ref at every
    node, and downstream calls, failures, checks and spans stay per input.
    """
    entry = graph.entry_nodes[0]
    tensors_out_of_band()  # this process's tensors reach Ray's store out of band too
    for x in xs:
        if carries_autograd(x):
            raise grad_crossing(entry, "its input is")
    if graph.shares_input:
        try:
            first = [Out(put(x), None) for x in xs]
        except Exception as err:
            raise unsendable(entry, err) from None
    else:
        first = [Out(x, None) for x in xs]  # sent with the entry node's call (see `_call`)
    outs = graph.walk(first, submissions)
    for submission, out in zip(submissions, outs):
        submission.batch = submissions
        submission.out = out
        _collect(out, submission.leaves)
        submission.refs = [leaf.ref for leaf in submission.leaves]
        submission.pending = len(submission.refs)


def _call(graph: ActorGraph, node_id: str, values: list, submissions: list) -> list:
    args: list = []  # every input's args, one after the other
    metas: list = []  # per input: (how many args, shape, checks, trace tag)
    simple = True  # one whole input each, nothing to check, no timeout, not traced: the one-arg call
    for value, submission in zip(values, submissions):
        start, checks = len(args), []
        shape = _flatten(value, args, checks, graph.devices, start)
        metas.append((len(args) - start, shape, tuple(checks), submission.trace_tag))
        simple = simple and shape == 0 and not checks and submission.trace_tag is None and not submission.timed
    actor = graph.actors[node_id].pick(len(submissions))
    try:
        if len(submissions) == 1:
            if simple:
                refs = [actor.handle.call.remote(args[0])]
            else:
                only = submissions[0]
                _, shape, checks, trace_tag = metas[0]
                refs = [actor.handle.call_with.remote((only.token if only.timed else None, shape, checks, trace_tag),
                                                      *args)]
        elif simple:
            refs = actor.batched("call_many", len(submissions)).remote(*args)
        else:
            refs = actor.batched("call_many_with", len(submissions)).remote(tuple(metas), *args)
    except Exception as err:
        actor.load -= len(submissions)  # nothing was sent
        if graph.shares_input or node_id != graph.entry_nodes[0]:
            raise  # only the entry node's call carries the input itself; the others carry refs
        raise unsendable(node_id, err) from None
    outs = []
    for submission, ref in zip(submissions, refs):
        submission.calls.append(Call(node_id, actor, ref))
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


def _rebuild(tree, values):
    if type(tree) is Out:
        return next(values)
    return tuple(_rebuild(item, values) for item in tree)


def release(submission: Submission, outcome: str = "ok") -> None:
    """The input is over (done, failed, expired or abandoned): its actors may take other inputs (under the
    book's lock). A traced input of a map becomes an interval on the driver's track (a run's is its caller's
    span).
    """
    if submission.over:
        return
    submission.over = True
    for call in submission.calls:
        call.actor.load -= 1
    if submission.trace is not None and submission.index is not None:
        submission.trace.interval(f"input {submission.index}", "host", submission.started_ns, time.monotonic_ns(),
                                  os.getpid(), f"input-{submission.token}",
                                  {"input": submission.index, "outcome": outcome})
