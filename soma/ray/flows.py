"""One input (or a map's batch) through a graph on Ray: the driver walks the plan once, submits every call at once.

    plan:   tokenize >> (encoder | other) >> join
    flow:   r1 = tokenize#1.call(x)
            r2 = encoder#1.call(r1)      r3 = other#2.call(r1)      (two actors: the branches overlap)
            r4 = join#1.call(r2, r3)     shape (0, 1): join receives the tuple (encoder's, other's)
            out = r4                     the driver waits for this ref alone

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
each node's copy gets one call for the batch, with one return per input.

    batch:  [a1, a2] = add#1.call_many(x1, x2)        (num_returns=2)
            [d1, d2] = double#2.call_many(a1, a2)      the driver waits for d1 and d2 together
"""

from __future__ import annotations

import os
import time

from ..errors import NodeError
from ..plan import Plan, Seq, Step
from ..run.postcondition import check_postcondition
from .actor import carries_autograd, first_failure, grad_crossing, tensors_out_of_band, writable


class Out:
    """A value the walk has produced: a ref to a node's output (`producer` its id), or the run's own input."""

    __slots__ = ("ref", "producer")

    def __init__(self, ref, producer: str | None):
        self.ref = ref
        self.producer = producer


class Program:
    """A graph under one placement, ready to submit: its plan and the copies of each of its nodes."""

    __slots__ = ("plan", "stages", "devices", "entry_nodes", "shares_input")

    def __init__(self, plan: Plan, stages: dict, devices: dict):
        self.plan = plan
        self.stages = stages  # node id → NodeCopies
        self.devices = devices
        self.entry_nodes = _entries(plan)
        # More than one call receives the input: put it in the object store once, not once per call.
        self.shares_input = len(self.entry_nodes) > 1


class Flow:
    """One input on its way: its calls (in submission order, which is a topological order) and its output."""

    __slots__ = ("index", "token", "timed", "trace", "trace_tag", "started_ns", "tasks", "out", "leaves", "refs",
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
        self.tasks: list = []  # (node id, Copy, ref)
        self.out = None  # tree of Out: one, or tuples of them (a plan ending in a wave)
        self.leaves: list[Out] = []
        self.refs: list = []
        self.pending = 0  # map: refs of `refs` not ready yet
        self.over = False  # its copies' loads were given back
        self.batch: list = [self]  # the inputs submitted with it, itself included: they share every call


def submit_batch(program: Program, xs: list, flows: list, put) -> None:
    """Submit every call of one input, or of a map's batch of inputs: one Ray call per node for all of them
    (the runner holds its lock: copies are picked here). One input: `call` (exactly the one arg a
    hand-written actor takes). Several: `call_many`, one return per input, so each input still has its own
    ref at every node, and downstream calls, failures, checks and spans stay per input.
    """
    entry = program.entry_nodes[0]
    tensors_out_of_band()  # this process's tensors reach Ray's store out of band too
    for x in xs:
        if carries_autograd(x):
            raise grad_crossing(entry, "its input is")
    if program.shares_input:
        try:
            first = [Out(put(x), None) for x in xs]
        except Exception as err:
            raise unsendable(entry, err) from None
    else:
        first = [Out(x, None) for x in xs]  # sent with the entry node's call (see `_call`)
    outs = _walk(program, program.plan, first, flows)
    for flow, out in zip(flows, outs):
        flow.batch = flows
        flow.out = out
        _collect(out, flow.leaves)
        flow.refs = [leaf.ref for leaf in flow.leaves]
        flow.pending = len(flow.refs)


def _walk(program: Program, plan: Plan, values: list, flows: list) -> list:
    """Each input's value after `plan` (a list, one per flow), every call submitted on the way."""
    kind = type(plan)
    if kind is Step:
        return _call(program, plan.id, values, flows)
    if kind is Seq:
        for item in plan.items:
            values = _walk(program, item, values, flows)
        return values
    branches = [_walk(program, branch, values, flows) for branch in plan.branches]
    return [tuple(outs) for outs in zip(*branches)]


def _call(program: Program, node_id: str, values: list, flows: list) -> list:
    args: list = []  # every input's args, one after the other
    metas: list = []  # per input: (how many args, shape, checks, trace tag)
    simple = True  # one whole input each, nothing to check, no timeout, not traced: the one-arg call
    for value, flow in zip(values, flows):
        start, checks = len(args), []
        shape = _flatten(value, args, checks, program.devices, start)
        metas.append((len(args) - start, shape, tuple(checks), flow.trace_tag))
        simple = simple and shape == 0 and not checks and flow.trace_tag is None and not flow.timed
    copy = program.stages[node_id].pick(len(flows))
    try:
        if len(flows) == 1:
            if simple:
                refs = [copy.actor.call.remote(args[0])]
            else:
                _, shape, checks, trace_tag = metas[0]
                refs = [copy.actor.call_with.remote((flows[0].token if flows[0].timed else None, shape, checks,
                                                    trace_tag), *args)]
        elif simple:
            refs = copy.batched("call_many", len(flows)).remote(*args)
        else:
            refs = copy.batched("call_many_with", len(flows)).remote(tuple(metas), *args)
    except Exception as err:
        copy.load -= len(flows)  # nothing was sent
        if program.shares_input or node_id != program.entry_nodes[0]:
            raise  # only the entry node's call carries the input itself; the others carry refs
        raise unsendable(node_id, err) from None
    outs = []
    for flow, ref in zip(flows, refs):
        flow.tasks.append((node_id, copy, ref))
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


def outcome(flow: Flow, values: list, devices: dict):
    """The run's output from the values of its refs, or the error to raise (the first failure in branch order).

    The driver checks the postcondition on what arrived, like every consuming actor.
    """
    failed = first_failure(values)
    if failed is not None:
        raise failed.rebuild()
    for leaf, value in zip(flow.leaves, values):
        check_postcondition(leaf.producer, devices.get(leaf.producer), value)
    it = iter(values)
    return writable(_rebuild(flow.out, it))  # a result is the caller's to write, not a view of Ray's store


def _rebuild(tree, values):
    if type(tree) is Out:
        return next(values)
    return tuple(_rebuild(item, values) for item in tree)


def _entries(plan: Plan) -> list[str]:
    """The nodes that receive a run's input (several when the plan starts with a wave)."""
    if isinstance(plan, Step):
        return [plan.id]
    if isinstance(plan, Seq):
        return _entries(plan.items[0])
    return [node for branch in plan.branches for node in _entries(branch)]


def release(flow: Flow, outcome: str = "ok") -> None:
    """The input is over (done, failed, expired or abandoned): its copies may take other inputs.

    A traced input of a map becomes an interval on the driver's track (a run's is its caller's span).
    """
    if flow.over:
        return
    flow.over = True
    for _, copy, _ in flow.tasks:
        copy.load -= 1
    if flow.trace is not None and flow.index is not None:
        flow.trace.interval(f"input {flow.index}", "host", flow.started_ns, time.monotonic_ns(), os.getpid(),
                            f"input-{flow.token}", {"input": flow.index, "outcome": outcome})
