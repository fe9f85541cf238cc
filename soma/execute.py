"""Running a plan in one process: the interpreter the in-process `Executor` and every
`Local` worker share, so the two cannot disagree about what a node's output is.

    run_plan(plan, x) ─ Step ─ invoke(node) ─ forward(x, ctx) ─ Done? ─ postcondition ─ unwrap
                      ├ Seq  ─ items in order, each on the previous output
                      └ Wave ─ one thread per branch, each branch whole on its thread;
                               wait for every branch, then raise the first failure in branch order
"""

from __future__ import annotations

import contextlib
import sys
import threading

from .ctx import Ctx
from .errors import NodeError, SomaError, traceback_text
from .plan import Plan, Seq, Step, Wave
from .postcondition import check_postcondition
from .values import Done, unwrap


class Cancelled(SomaError):
    """Internal: the run this branch belongs to was abandoned (timeout); stop before the next node."""


def count_in(counts: dict, key, delta: int) -> None:
    """Add `delta` to `counts[key]`, dropping the key at zero (a multiset of what runs now)."""
    n = counts.get(key, 0) + delta
    if n:
        counts[key] = n
    else:
        del counts[key]


class RunState:
    """What one run shares across its threads: the nodes running now, and a cancel flag."""

    __slots__ = ("running", "cancelled", "_lock", "_observer")

    def __init__(self, observer=None):
        self.running: dict[str, int] = {}
        self.cancelled = False
        self._lock = threading.Lock()
        self._observer = observer  # a worker publishes what runs, for the host to read when it dies

    def enter(self, node_id: str) -> None:
        if self.cancelled:
            raise Cancelled(node_id)
        with self._lock:
            count_in(self.running, node_id, +1)
        if self._observer is not None:
            self._observer.enter(node_id)

    def leave(self, node_id: str) -> None:
        with self._lock:
            count_in(self.running, node_id, -1)
        if self._observer is not None:
            self._observer.leave(node_id)

    def running_now(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self.running)


def _thread_modes():
    """What a branch thread must inherit from the thread that started the wave.

    torch keeps grad and inference mode per thread: without this, `with torch.no_grad(): g.run(x)`
    would still build autograd graphs inside every wave.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "is_inference_mode_enabled"):  # absent, or still importing
        return contextlib.nullcontext
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()

    @contextlib.contextmanager
    def inherit():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield

    return inherit


class Runner:
    """Runs plans over a catalog with a placement, making each node's `Ctx`.

    `nodes`: id → Node. `devices`: id → device string for placed nodes.
    `worker`: the worker id for `ctx.worker` (None in-process). `allocate`: the
    worker's shared arena for `ctx.empty`.
    """

    def __init__(self, nodes, devices: dict, worker: str | None = None, allocate=None, remote: bool = False,
                 on_thread=None):
        self.nodes = nodes
        self.devices = devices
        self.worker = worker
        self.allocate = allocate
        self.remote = remote  # in a worker: keep traceback text, the cause may not travel
        self.on_thread = on_thread  # called first on every branch thread (a worker pins its CUDA device)

    def run(self, plan: Plan, x, state: RunState | None = None):
        state = state if state is not None else RunState()
        if type(plan) is Step:
            return self.invoke(plan.id, x, state)
        if type(plan) is Seq:
            for item in plan.items:
                x = self.run(item, x, state)
            return x
        return self.run_wave(plan, x, state)

    def run_wave(self, wave: Wave, x, state: RunState):
        """Every branch whole on its own thread; all of them are waited for before raising."""
        results: list = [None] * len(wave.branches)
        failures: list = [None] * len(wave.branches)
        inherit = _thread_modes()

        def branch(i: int, plan: Plan) -> None:
            try:
                with inherit():
                    if self.on_thread is not None:
                        self.on_thread()
                    results[i] = self.run(plan, x, state)
            except BaseException as exc:  # every failure waits for the siblings
                failures[i] = exc

        threads = [
            threading.Thread(target=branch, args=(i, b), name=f"soma-branch-{i}", daemon=True)
            for i, b in enumerate(wave.branches)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [f for f in failures if f is not None]
        if errors:
            first = next((e for e in errors if not isinstance(e, Cancelled)), errors[0])
            for other in errors:
                if other is not first and not isinstance(other, Cancelled) and hasattr(first, "add_note"):
                    first.add_note(f"another branch of the same wave also failed: {other}")
            raise first
        return tuple(results)

    def invoke(self, node_id: str, x, state: RunState):
        """Run one node: forward, check it returned Done, check the postcondition, unwrap."""
        node = self.nodes[node_id]
        device = self.devices.get(node_id)
        ctx = Ctx(node_id, device, self.worker, self.allocate)
        state.enter(node_id)
        try:
            try:
                out = node.forward(x, ctx)
            except Exception as exc:
                raise self.node_failed(node_id, exc) from exc
        finally:
            state.leave(node_id)
        if type(out) is not Done:
            raise NodeError(node_id, f"node `{node_id}` failed: forward returned {type(out).__name__}, not Done")
        check_postcondition(node_id, device, out.value)
        return unwrap(out.value)

    def node_failed(self, node_id: str, exc: BaseException) -> NodeError:
        text = traceback_text(exc) if self.remote else None
        return NodeError(node_id, f"node `{node_id}` failed: {type(exc).__name__}: {exc}", remote_traceback=text)
