"""One copy of one node, living in a Ray actor. This module runs inside the actors.

    driver: copies[i].call.remote(x)                 x: an upstream node's ObjectRef, or the run's input
            copies[i].call_with.remote(meta, *args)  a wave's join, checks, a timeout or a trace;
                                                     meta: (token, shape, checks, trace tag)
            copies[i].call_many / call_many_with      a map's batch: several inputs in one call, one
                                                     return each (`num_returns`), each run as above
            (Ray resolves ObjectRef args in the actor: the values never pass through the driver)
    actor:  a failure among the args?  → pass it on, untouched (the first one, in branch order)
            producers' values where they declared?  (the postcondition on what arrives)
            x = the args in the input's shape (a wave's join receives the tuple of branch outputs)
            Interpreter.run(Step(node), x)   (setup once, one input at a time, Done, postcondition, NodeError)
            → the value (its ObjectRef goes on to the next node), or a `Failed`

Why failures travel as values: a method that raises becomes Ray's `RayTaskError`,
which wraps the exception in a class of Ray's making and its text in Ray's
banner. A `Failed` carries soma's own error (class, text, remote traceback and
cause, as `Local` carries them), every later node passes it on without running,
and the driver raises exactly that error.

Traced calls (their inputs carry a trace tag: (index, block)) are kept here until
the driver takes them at the end of the block: one record per Ray call, its time
and the inputs it carried, each input with its node spans (docs/trace.md):

    (block, start ns, end ns, thread id, [(input index, [[node, start, end, tid, outcome]]), ...])

The control methods (`hello`, `clock`, `running_token`, `forget`, `take_spans`) are
called in a concurrency group of their own (`copies.control`), so a busy copy answers
which input it is running (a timeout), skips an input given up while it waits
(`forget`: a cancelled future), or what time it is (a trace) at once, also
while one of the driver's calls to it still waits for its input (measured with
Ray 2.60, in order and out of order alike).

Ray is imported inside the functions that run in an actor: the driver imports
this module for `Failed` and friends before it knows whether Ray is installed.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ..errors import Cancelled, NodeError, PostconditionError, SomaError, traceback_text
from ..plan import Step
from ..run.batching import is_batching
from ..run.interpreter import Interpreter, RunState
from ..run.postcondition import check_postcondition
from ..run.threads import on_threads
from ..values import Opaque
from ..wire import nodecode
from .devices import cuda_index, cuda_visible_devices, machine_gpus
from .records import StartRecord, remove
from .values import exact, tensors_out_of_band

FORGOTTEN_KEPT = 10_000  # tokens `forget` keeps at most (each ~100 bytes; one per input given up while queued)


class Failed:
    """A node's failure on its way to the driver as an ordinary value.

    A `NodeError` travels as an error body (`soma.wire.failures`) (the same class, text,
    remote traceback and cause on arrival); any other `SomaError` (a
    `PlacementError` from a copy's start) pickles itself.
    """

    __slots__ = ("body", "error", "notes")

    def __init__(self, err: SomaError):
        from ..wire.failures import error_body

        if isinstance(err, NodeError):
            self.body, self.error = error_body(err), None
        else:
            self.body, self.error = None, err
        self.notes = list(getattr(err, "__notes__", ()))

    @property
    def message(self) -> str:
        return self.body["message"] if self.body is not None else str(self.error)

    @property
    def node(self) -> str | None:
        """The node that failed (None for an error that names none)."""
        return self.body["node"] if self.body is not None else getattr(self.error, "node", None)

    def rebuild(self) -> SomaError:
        """The error itself, as the node's process raised it."""
        from ..wire.failures import error_from

        err = error_from(self.body) if self.body is not None else self.error
        for note in self.notes:
            err.add_note(note)
        return err


def first_failure(values) -> Failed | None:
    """The first `Failed` among a wave's outputs, noting the others on it (as a wave in one process does).

    One failure upstream of a wave reaches its join once per branch (each branch passes it on): that is
    one failure, as in one process, where the wave never ran. Only failures of other nodes are noted.
    """
    failures = [v for v in values if type(v) is Failed]
    if not failures:
        return None
    first = failures[0]
    seen = {(first.node, first.message)}
    for other in failures[1:]:
        key = (other.node, other.message)
        if key not in seen:
            seen.add(key)
            first.notes.append(f"another branch of the same wave also failed: {other.message}")
    return first


def shaped(shape, args):
    """The input from the flat args: `shape` is an arg's position, or a tuple of shapes (a wave's output)."""
    if type(shape) is int:
        return args[shape]
    return tuple(shaped(s, args) for s in shape)


def carries_autograd(value) -> bool:
    """Whether a value holds a tensor with an autograd graph (it cannot cross processes intact)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return False  # no torch here: no tensor either
    stack, seen = [value], set()
    while stack:
        item = stack.pop()
        if type(item) is Opaque:
            stack.append(item.obj)
        elif isinstance(item, torch.Tensor):
            if item.requires_grad and not item.is_leaf:
                return True
        elif isinstance(item, (tuple, list, dict)) and id(item) not in seen:
            seen.add(id(item))
            stack.extend(item.values() if isinstance(item, dict) else item)
    return False


def grad_crossing(node_id: str, whose: str) -> NodeError:
    """Local's error for a tensor with an autograd graph at a process boundary, with Local's words."""
    from ..wire.codec import GradCrossing

    return NodeError.failed(node_id, GradCrossing().reason(whose))


# -- tensors through Ray's object store, out of band ---------------------------------------------------
#
# Ray pickles a torch tensor in band by default: torch's pickling copies the storage into the pickle, Ray
# copies the pickle into its object store, and reading it copies it out again (0.8-1.3 s for 256 MiB between
# two actors here). Handed over as a uint8 numpy view of the bytes it covers, the tensor reaches the store
# with one copy (pickle protocol 5, out of band), and is read back as a read-only view of the store.
# torch cannot mark a tensor read-only, and a write into the store's memory would change the object for
# every other reader (a wave's branches share it), so a tensor is copied out of the store once, into memory
# of its own: two copies in all where there were three or four. numpy arrays keep Ray's own handling (out of
# band already): a node receives them as Ray hands them, read-only views of the store (numpy refuses writes);
# the caller's results are made writable copies (`writable`): a result is the caller's to write.

def arrange_cuda(node_id: str, device: str | None) -> None:
    """Make `cuda:N` in this process the GPU Ray reserved for this copy (see soma.ray.devices)."""
    index = cuda_index(device)
    if index is None:
        return
    import ray

    this_machine = ray.get_runtime_context().get_node_id()
    count = next((n["Resources"].get("GPU", 0) for n in ray.nodes() if n["NodeID"] == this_machine), 0)
    machine = machine_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), int(count))
    order = cuda_visible_devices(node_id, index, ray.get_gpu_ids(), machine)
    if order is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = order  # before the node's code loads, so before torch meets CUDA


class NodeCopy:
    """The actor class (wrapped by `ray.remote` in the driver): one copy of one node, its state inside."""

    def __init__(self, node_id: str, device: str | None, blob: bytes, paths: list):
        import ray

        # The driver's sys.path after the actor's own, as Local's workers start with the host's: nodes from
        # the user's modules load on the driver's machine (elsewhere, absent folders are simply not searched).
        sys.path.extend(p for p in paths if p not in sys.path)
        self.node_id = node_id
        self.actor_id = ray.get_runtime_context().get_actor_id()
        self.broken: Failed | None = None  # this copy could not be made: every call answers with why
        self.running = None  # the token of the input running now (timed inputs only); read by `running_token`
        # Tokens of inputs whose caller gave up (`forget`) before their call here started: they never start.
        # Ray's own cancel of a queued actor call can arrive seconds late (it retries while the call is on
        # its way), so the driver also says so here, in the control group, answered at once. `_starting`
        # makes "started" and "forgotten" one decision: an input is one or the other, never both.
        self.forgotten: dict = {}  # token → None (insertion order: the oldest go first past FORGOTTEN_KEPT)
        self._starting = threading.Lock()
        # The tokens of inputs running now while the node's setup runs for them (seconds: a model loading): they
        # have not started the node, so `forget` still drops them (a forward ran after its future was cancelled).
        self.setting_up: set = set()
        self.traced: list = []  # the records of traced calls (see the module's docstring), until taken
        node = None
        try:
            arrange_cuda(node_id, device)
        except SomaError as err:  # (its device: said as it is)
            self.broken = Failed(err)
        else:
            try:
                node = nodecode.loads(blob)
            except BaseException as err:  # the actor stays up, so the driver hears why instead of "actor died"
                # (a SomaError too: one raised as the node's module is imported, a pool its top-level code
                # starts, is the node's, said with the module and line as on Local)
                self.broken = Failed(NodeError.failed(
                    node_id, f"its code could not be loaded in Ray actor {self.actor_id}: {type(err).__name__}: "
                             f"{err} ({nodecode.why_not_loaded(err, 'Ray actor')})",
                    remote_traceback=traceback_text(err)))
        devices = {node_id: device} if device is not None else {}
        tensors_out_of_band()
        self.batching = node is not None and is_batching(node)  # its inputs of one call meet at the node
        self.interpreter = Interpreter({node_id: node}, devices, worker=self.actor_id, remote=True)
        self.plan = Step(node_id)
        self.context = ray.get_runtime_context()
        # Last: a record exists only once the copy is made, so a copy that dies while it is being made has none,
        # and the driver counts that death against the inputs it held (soma.ray.records).
        self.record = StartRecord.made(self.actor_id)

    def _starts(self, position: int = 0) -> None:
        """Note in this copy's start record that input `position` of the running call starts now."""
        self.record.note(self.context.get_task_id().encode(), position)

    def call(self, x):
        """Run the node on one input: the common call (a whole input, nothing to check, no timeout, not
        traced), with exactly the one arg a hand-written actor would take (every arg costs Ray a serialization)."""
        self._starts()
        return self.run((x,), None, 0, (), None)

    def call_with(self, meta, *args):
        """Run the node on one input made of several args (a wave's join), or checked, timed or traced.

        `meta`: (the input's token or None, the input's shape, the checks, the trace tag or None).
        """
        token, shape, checks, trace_tag = meta
        self._starts()
        if trace_tag is None:
            return self.run(args, token, shape, checks, None)
        start, spans = time.monotonic_ns(), []
        try:
            return self.run(args, token, shape, checks, spans, trace_tag[0])
        finally:
            self._keep(trace_tag[1], start, [(trace_tag[0], spans)])

    def call_many(self, *xs):
        """`call` for several inputs in one Ray call (a map's batch): one output per input, each its own
        return (the driver asks for `num_returns=len(xs)`), a failure in its own place, the others' values
        beside it. The calls a batch saves cost Ray ~400 µs of this actor's CPU and ~350 µs of the driver's."""
        return self._each([lambda x=x: self.run((x,), None, 0, (), None) for x in xs])

    def call_many_with(self, metas, *args):
        """`call_with` for several inputs in one Ray call: `metas[i]` is (how many of `args` are input i's,
        its shape, its checks, its trace tag); inputs with a timeout are never batched (no token). The inputs
        of one call were submitted together, so the traced ones share one trace block."""
        start_ns = time.monotonic_ns()
        calls, traced, start = [], [], 0
        for count, shape, checks, trace_tag in metas:
            spans = [] if trace_tag is not None else None
            if spans is not None:
                traced.append((trace_tag, spans))
            index = trace_tag[0] if trace_tag is not None else None
            calls.append(lambda a=args[start:start + count], s=shape, c=checks, p=spans, i=index:
                         self.run(a, None, s, c, p, i))
            start += count
        try:
            return self._each(calls)
        finally:
            if traced:
                self._keep(traced[0][0][1], start_ns, [(tag[0], spans) for tag, spans in traced])

    def _each(self, calls: list) -> tuple:
        """The inputs of one call, one after another; a batching node's all at once, on threads of their own,
        so that they meet at the node and share one `forward_batch` (its start record then names the
        last: every input of the call had started)."""
        if self.batching and len(calls) > 1:
            self._starts(len(calls) - 1)
            with self.interpreter.arriving(len(calls)):
                results = on_threads(calls)
            return tuple(value if ok else Failed(NodeError.failed(self.node_id, f"{type(value).__name__}: {value}"))
                         for ok, value in results)
        outputs = []
        for position, call in enumerate(calls):
            self._starts(position)
            outputs.append(call())
        return tuple(outputs)

    def _keep(self, block: int, start_ns: int, inputs: list) -> None:
        """Keep a traced call's record for the driver: when it ran, on which thread, the inputs it carried."""
        self.traced.append((block, start_ns, time.monotonic_ns(), threading.get_native_id(), inputs))

    def run(self, args: tuple, token, shape, checks, spans, index=None):
        """The value, or a `Failed` (see the module's drawing). With `spans`, the node's spans go there;
        `index`: a traced input's position in its map (a batching node's trace event lists them)."""
        failed = first_failure(args)
        if failed is not None:
            return failed  # upstream first: the error the driver raises is the earliest one
        if self.broken is not None:
            return self.broken
        try:
            for position, producer, declared in checks:  # moved on the way? The producer checked it before it left
                check_postcondition(producer, declared, args[position])
        except PostconditionError as err:
            return Failed(err)
        x = shaped(shape, args)
        setting_up = False
        if token is not None:
            with self._starting:
                if token in self.forgotten:
                    del self.forgotten[token]
                    return Failed(Cancelled(self.node_id))  # (nobody reads it: its caller gave it up)
                self.running = token
                setting_up = not self.interpreter.is_set_up(self.node_id)
                if setting_up:
                    self.setting_up.add(token)
        try:
            if setting_up:  # set up first, then look again (see `setting_up`)
                self.interpreter.set_up(self.node_id, spans)
                with self._starting:
                    self.setting_up.discard(token)
                    if token in self.forgotten:
                        del self.forgotten[token]
                        return Failed(Cancelled(self.node_id))  # (nobody reads it: its caller gave it up)
            value = self.interpreter.run(self.plan, x, RunState(index=index), spans)
        except NodeError as err:
            return Failed(err)
        finally:
            self.running = None
            if setting_up:
                self.setting_up.discard(token)  # (a setup that raised)
        if carries_autograd(value):
            return Failed(grad_crossing(self.node_id, "it returned"))
        tensors_out_of_band()  # (the node may have imported torch itself)
        return exact(value)

    # -- control: called in the "control" group, answered while `call` runs -------------------------
    def hello(self):
        """(pid, Ray node id, Ray actor id): who this copy is, once it is up."""
        return os.getpid(), self.context.get_node_id(), self.actor_id

    def clock(self) -> int:
        return time.monotonic_ns()

    def running_token(self):
        return self.running

    def forget(self, token: int) -> bool:
        """Its caller gave input `token` up: if its call here has not started, it never will (True); False
        when it is running now."""
        with self._starting:
            if self.running == token and token not in self.setting_up:
                return False
            self.forgotten[token] = None
            while len(self.forgotten) > FORGOTTEN_KEPT:  # (a call Ray did cancel never comes to pop its token)
                del self.forgotten[next(iter(self.forgotten))]
            return True

    def forget_record(self) -> bool:
        """soma stops this copy: its start record is nobody's business any more."""
        if self.record.path is not None:
            remove(self.record.path)
        return True

    def take_spans(self) -> list:
        """The records of the traced calls so far (the driver keeps those of its open block)."""
        traced, self.traced = self.traced, []
        return traced
