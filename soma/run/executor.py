"""`Executor`: runs a graph in this process.

`run` runs on the caller's thread: a sequence in order, a wave with each branch whole
on a thread of its own (torch's current device is thread-local, so a branch never
hops threads). See `soma.run.interpreter` for the interpreter itself.

Many inputs (`map`, `submit`, `arun`, `amap`) run on the Executor's own threads, at
most `threads` at once, each input whole on one of them:

    map(g, xs) ── up to `window` inputs ──▶ threads: input i+1 in the first node while input i
                                            is in the second (a pipeline); each node object still
                                            runs one input (or one batch) at a time: its own lock

One process has one GIL: the pipeline overlaps what releases it (I/O, sleeps, torch
and numpy kernels) and lets a batching node see several inputs at once; for Python
that holds the GIL, use `Local`.

A batching node's inputs meet at the node object's one Meeting (soma.run.batching),
whatever thread or Executor runs them. The inputs handed to free threads are announced
there first (`_submit_inputs`), so the first to arrive waits for them (at most
batch_wait) instead of going alone because their threads had not started yet.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import weakref

from ..errors import RunTimeout, SomaError
from .aio import FutureSink, InputFuture, LoopSink
from .arguments import checked_retries, checked_timeout
from .base import RunnerBase, closed_message
from .batching import is_batching, max_batch_of
from .inprocess import run_plan
from .interpreter import Interpreter, RunState
from .mapping import Inflight, map_outputs, save_open
from .resuming import DEFAULT_EVERY_S
from .threads import thread_modes
from .trace import Trace

THREADS = 64  # inputs the Executor runs at once at most (threads kept while it is open)


class Executor(RunnerBase):
    """The in-process runner: `Executor().run(g, x)`, `Executor().map(g, xs)`.

    `threads`: how many inputs it runs at once for `map`, `submit`, `arun` and `amap`
    (default 64, two batches of a batching node's default size); they are kept until `close()`.
    """

    copies_nodes = False  # it runs the node objects themselves

    def __init__(self, threads: int = THREADS):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"Executor's threads= is how many inputs run at once, a positive int; got {threads!r}")
        self.threads = threads
        self._interpreters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph → (version, it)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._busy = 0  # inputs of map, submit, arun and amap handed to the threads and not over yet
        self._busy_lock = threading.Lock()

    def close(self) -> None:
        """Let go of the threads (inputs already running finish; none queued starts) and take no new work."""
        with self._pool_lock:
            self._closed = True
            pool, self._pool = self._pool, None
        save_open(self)  # (its maps with a checkpoint write it: their callers may never step them again)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def run(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """Run graph `g` (or a node, or an expression) on input `x` and return its output.

        With `timeout`, the run happens on a helper thread and `RunTimeout` names
        the nodes still running when it expires. Threads cannot be killed: a
        node already running finishes, and no further node of that run starts.
        `retries` is accepted and changes nothing: there is no worker to lose here.
        """
        checked_retries(retries)
        timeout = checked_timeout(timeout)
        g = self.accepting(g, "Executor.run")
        return self._run(g, g.devices(), x, timeout, index=None)

    def submit(self, g, x, *, timeout: float | None = None, retries: int = 0) -> InputFuture:
        """`run(g, x)` on one of the Executor's threads: a `concurrent.futures.Future` at once.

        `future.cancel()` cancels the input, as on every runner: one that has not started never starts (also
        one on a thread, waiting for its node's copy behind another input), one running stops before its next
        node and its result is dropped. Before Dec 7 it was the thread pool's own future: once a thread held
        the input it said "running", `cancel()` was False and the node ran (5 of 5 waiting behind a slow one;
        cancelling the task awaiting `arun` the same)."""
        checked_retries(retries)
        timeout = checked_timeout(timeout)
        g = self.accepting(g, "Executor.submit")
        devices = g.devices()
        interpreter = self._interpreter(g, devices)
        state, future = RunState(), InputFuture()
        taken = self._submit_inputs(interpreter, [(self._run_into, FutureSink(future), g, devices, x, timeout,
                                                   thread_modes(), state, interpreter)])[0]
        future.cancels_with(lambda: _give_up(taken, state))
        # Cancelled by close() before a thread took it: it never ran, and fails saying so, as on every runner (a
        # cancel nobody asked for read as one in asyncio: a TaskGroup went on without it, Dec 7). Weakly: a
        # failure's traceback reaches the thread pool's work item, and with it `taken` and this callback: holding
        # the future, it was a cycle that kept the input until gc.
        weak = weakref.ref(future)
        taken.add_done_callback(lambda done: done.cancelled() and (f := weak()) is not None and _closed_on(f))
        return future

    def _run_into(self, sink: FutureSink, g, devices: dict, x, timeout, modes, state, interpreter) -> None:
        """A submitted input, on a thread: its outcome goes straight into the caller's future (`sink`)."""
        try:
            value = self._run(g, devices, x, timeout, None, modes, state, interpreter)
        except BaseException as exc:  # (a node's KeyboardInterrupt too: it is the future's, as in a thread pool)
            sink.put((None, False, exc))
        else:
            sink.put((None, True, value))

    def map(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None, retries=0, errors="raise",
            resume=None, checkpoint=None, checkpoint_every=DEFAULT_EVERY_S):
        """The outputs for the inputs of `xs`, lazily, up to `window` inputs at once on the Executor's threads
        (docs/design.md, "Many inputs")."""
        checked_retries(retries)
        timeout = checked_timeout(timeout)
        g = self.accepting(g, "Executor.map")
        return map_outputs(self._inflight(g, timeout), xs, graph=g, window=window, ordered=ordered,
                           progress=progress, timeout=timeout, errors=errors, resume=resume, checkpoint=checkpoint,
                           checkpoint_every=checkpoint_every, owner=self)

    def _inflight(self, g, timeout) -> "ExecutorInflight":
        owner = getattr(_own, "executor", None)
        if owner is not None and owner() is self:
            raise SomaError(f"a map on this soma.Executor was started on one of its own threads "
                            f"({threading.current_thread().name}: inside a node it runs, or in a done-callback of "
                            f"one of its futures): the map's inputs need the Executor's threads, which the inputs "
                            f"calling it hold, so it could wait forever; run the graph with `run` (on this "
                            f"thread), chain inputs with `submit`, or map it on another soma.Executor")
        return ExecutorInflight(self, g, g.devices(), timeout)

    def _async_inflight(self, g, timeout, retries):
        checked_retries(retries)
        timeout = checked_timeout(timeout)
        g = self.accepting(g, "Executor.amap")
        return self._inflight(g, timeout), g

    def _threads(self) -> cf.ThreadPoolExecutor:
        with self._pool_lock:
            if self._closed:  # (closed since its caller was accepted: as a pool refuses a submit after shutdown)
                raise SomaError(closed_message("Executor"))
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="input", initializer=_mark,
                                                   initargs=(weakref.ref(self),))
            return self._pool

    def _submit_inputs(self, interpreter: Interpreter, calls: list) -> list:
        """A future per call `(fn, *args)`, each an input of `interpreter`, submitted to the Executor's threads.
        Those a free thread will take at once are counted as coming at the interpreter's batching nodes before
        the first is submitted (`Interpreter.announce`): the first input to get there waits for them rather
        than going alone because their threads had not started yet. The others count themselves when they
        start: announced, an input queued behind busy threads would keep the inputs at the node (holding those
        threads) waiting their whole batch_wait for it. One cancelled before a thread took it is withdrawn."""
        threads = self._threads()
        with self._busy_lock:
            free = self.threads - self._busy
            self._busy += len(calls)
        announced = max(0, min(len(calls), free)) if interpreter.batching else 0
        interpreter.announce(announced)
        futures: list = []
        try:
            for call in calls:
                try:
                    future = threads.submit(*call)
                except RuntimeError as err:  # (closed on another thread since `_threads` gave the pool)
                    raise SomaError(closed_message("Executor")) from err
                futures.append(future)
                future.add_done_callback(self._input_over)
                if len(futures) <= announced:
                    future.add_done_callback(lambda done: done.cancelled() and interpreter.withdraw(1))
        finally:
            if len(futures) < len(calls):  # (the pool refused one: closed)
                interpreter.withdraw(announced - min(announced, len(futures)))
                with self._busy_lock:
                    self._busy -= len(calls) - len(futures)
        return futures

    def _input_over(self, _future) -> None:
        with self._busy_lock:
            self._busy -= 1

    def _run(self, g, devices: dict, x, timeout, index, modes=None, state: RunState | None = None,
             interpreter: Interpreter | None = None):
        interpreter = interpreter if interpreter is not None else self._interpreter(g, devices)
        plan = g.plan()
        state = state if state is not None else RunState(index=index)
        trace = self._trace
        spans = [] if trace is not None else None
        start = time.monotonic_ns()
        try:
            if modes is not None:
                with modes():  # (torch's grad and inference mode of the thread that asked)
                    return run_plan(interpreter, plan, x, state, spans, timeout)
            return run_plan(interpreter, plan, x, state, spans, timeout)
        finally:
            if trace is not None:
                _record(trace, spans, devices, index, start)

    def _interpreter(self, g, devices: dict) -> Interpreter:
        """One per graph and placement (its plan compiled once); placing a node again makes a new one."""
        found = self._interpreters.get(g)
        if found is not None and found[0] == g.placement_version:
            return found[1]
        interpreter = Interpreter({node_id: g.node(node_id) for node_id in g.nodes()}, devices)
        self._interpreters[g] = (g.placement_version, interpreter)
        return interpreter

    def _trace_started(self, trace: Trace) -> None:
        trace.process(os.getpid(), f"host (soma.Executor, pid {os.getpid()})")


_own = threading.local()  # on an Executor's own threads, `executor`: a weak reference to it


CLOSED_IN_FLIGHT = "this soma.Executor was closed while this run was in flight: it never started"


def _closed_on(future: InputFuture) -> None:
    """An input the Executor's close() cancelled before a thread took it: its SomaError, unless it is over."""
    try:
        future.set_exception(SomaError(CLOSED_IN_FLIGHT))
    except cf.InvalidStateError:  # (cancelled by its caller, which is how its thread-pool future was too)
        pass


def _give_up(taken: cf.Future, state: RunState) -> None:
    """A submitted input is no longer wanted: not taken by a thread, it never is; taken, it never starts its next
    node (the interpreter looks at `state.cancelled` as it enters a node, and again once it holds its copy)."""
    state.cancelled = True
    taken.cancel()


def _mark(executor_ref) -> None:
    """Each of an Executor's threads knows whose it is: a map started on one (inside a node, or in a done-callback
    of a future, which runs on the thread that set its result) is refused."""
    _own.executor = executor_ref


def _record(trace: Trace, spans: list, devices: dict, index, start: int) -> None:
    pid, tid = os.getpid(), threading.get_native_id()
    trace.thread(pid, tid, threading.current_thread().name)
    trace.span("run" if index is None else f"input {index}", "host", start, time.monotonic_ns(), pid, tid,
               {"input": index})
    trace.node_spans(spans, pid, None, devices, index)


class ExecutorInflight(Inflight):
    """The Executor's in-flight set: each input on one of its threads; a timeout stops an input before its
    next node (a thread cannot be killed) and names what was running."""

    def __init__(self, executor: Executor, g, devices: dict, timeout):
        self.executor, self.g, self.devices, self.timeout = executor, g, devices, timeout
        # future → (indices, their RunStates, a batch's given-up Event): one input (its RunState, None), or a
        # batch given to a batching node in one call (no states, its Event), whose result is each input's
        # (ok, value)
        self.running: dict = {}
        self.modes = thread_modes()  # the map's caller's torch modes, for every input
        # A graph that is one batching node, untimed: its inputs go to the node in batches of max_batch, one call each, on
        # one thread (no thread per input, meeting at the node: ~250 µs an input here, against the model's 38)
        self.interpreter = executor._interpreter(g, devices)
        self.batch_node = self.interpreter.batch_node(g.plan()) if timeout is None else None
        self.woken = None  # an amap's: the event loop's sink, woken as an input's future ends (await_wait)

    def parallelism(self) -> int:
        # A pipeline has a stage per node, and a batching node wants a batch's worth of inputs at it.
        batches = [max_batch_of(self.g.node(n)) for n in self.g.nodes() if is_batching(self.g.node(n))]
        return min(self.executor.threads, max([len(self.g.nodes())] + batches))

    def start(self, indices: list, xs: list) -> None:
        items = list(zip(indices, xs))
        threads = self.executor._threads()
        if self.batch_node is not None and self.executor._trace is None:
            size = max(1, max_batch_of(self.g.node(self.batch_node)))
            for first in range(0, len(items), size):
                batch = items[first:first + size]
                # No RunState per input: a batch is one call (nothing to stop between its nodes), untimed (no
                # running node to name); one not started is cancelled whole by its future, and one waiting on
                # its thread for the node's lock (behind the batches before it) by its Event (close).
                given_up = threading.Event()
                future = threads.submit(self._run_batch, [x for _, x in batch], given_up)
                self.running[future] = ([index for index, _ in batch], [], given_up)
                if self.woken is not None:
                    self._wakes(future)
            return
        states = [RunState(index=index) for index, _ in items]
        futures = self.executor._submit_inputs(self.interpreter, [
            (self.executor._run, self.g, self.devices, x, None, index, self.modes, state, self.interpreter)
            for (index, x), state in zip(items, states)])
        for (index, _), state, future in zip(items, states, futures):
            self.running[future] = ([index], [state], None)
            if self.woken is not None:
                self._wakes(future)

    def _run_batch(self, xs: list, given_up: threading.Event) -> list:
        with self.modes():
            return self.interpreter.run_batch(self.batch_node, xs, given_up=given_up)

    def wait(self, timeout):
        done, _ = cf.wait(list(self.running), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        return [outcome for future in done for outcome in self._outcomes(future)]

    async def await_wait(self, timeout, wake=None):
        """`wait`, on the event loop: each input's future wakes it as it ends (one done-callback a future, set
        once this is first awaited, then as each starts). asyncio.wrap_future made a copy of every running
        future at every wait, each copy and its future holding each other through their callbacks: a copy left
        pending when its loop ended (an amap cancelled while its inputs ran) kept its future, its input and its
        output, until the cyclic garbage collector ran."""
        if self.woken is None:
            self.woken = LoopSink()
            for future in self.running:
                self._wakes(future)
        done = [future for future in self.running if future.done()]
        if not done:
            await self.woken.take(timeout, wake)  # (a wake-up whose future a wait took already: none done, [] back)
            done = [future for future in self.running if future.done()]
        return [outcome for future in done for outcome in self._outcomes(future)]

    def _wakes(self, future) -> None:
        woken = self.woken  # (the callback holds the sink, not this in-flight set, whose `running` holds it)
        future.add_done_callback(lambda _: woken.put(True))

    def _outcomes(self, future) -> list:
        indices, _, given_up = self.running.pop(future)
        if future.cancelled():  # (by the Executor's close: the map's own close lets go of its futures first)
            return [(index, False, SomaError(CLOSED_IN_FLIGHT)) for index in indices]
        exc = future.exception()
        if exc is not None and not isinstance(exc, Exception):  # a node's KeyboardInterrupt or SystemExit: it
            raise exc  # passes through in-process, as in `run` (errors="yield" yielded it, and the map went on)
        if given_up is not None:  # a batch's
            if exc is not None:  # (soma's own mistake, not a node's: every input of the batch says so)
                return [(index, False, exc) for index in indices]
            return [(index, ok, value) for index, (ok, value) in zip(indices, future.result())]
        return [(indices[0], False, exc) if exc is not None else (indices[0], True, future.result())]

    def expire(self, index: int) -> BaseException:
        # (only untimed maps send batches: an input that can expire runs alone)
        future, state = next((f, ss[0]) for f, (ii, ss, _) in self.running.items() if ii == [index])
        del self.running[future]
        state.cancelled = True  # it stops before its next node
        return RunTimeout.after(self.timeout, dict.fromkeys(state.running_now()), ())

    def close(self) -> None:
        for future, (_, states, given_up) in self.running.items():
            future.cancel()  # not started: never starts
            for state in states:
                state.cancelled = True  # started: stops before its next node
            if given_up is not None:
                given_up.set()  # a batch waiting for the node's lock: never calls it
        self.running.clear()


