"""`soma.Local`, the public face of running graphs on worker processes (`soma.local` draws it): it compiles
programs (host/program.py), starts inputs and waits for their outcomes through the host's loop (host/loop.py,
the one owner of the host's state), and owns the life of the loop and the pool (host/pool.py)."""

from __future__ import annotations

import atexit
import os
import re
import threading
import time
import weakref
from typing import NamedTuple

from ..device import Device
from ..errors import DeviceError, SomaError
from ..run.aio import FutureSink, InputFuture
from ..run.arguments import checked_retries, checked_timeout
from ..run.base import RunnerBase, closed_message
from ..run.mapping import map_outputs, save_open
from ..run.registry import NodeRegistry
from ..run.resuming import DEFAULT_EVERY_S
from ..run.trace import Trace
from .host.loop import HostLoop
from .host.pool import WorkerPool
from .host.program import compile_program
from .inflight import LocalInflight

CLOSE_WAIT_S = 60.0  # a second close() waits this long for the first (which takes a few seconds at most)


class Snapshot(NamedTuple):
    """What a `Local` holds at one moment (`Local.snapshot()`): to watch a pool, or to check it let go of all."""

    pids: list  # its workers' pids, in slot order (as `pids()`)
    inputs: int  # inputs started and not ended yet (run, submit, arun, a map's in flight)
    jobs: list  # per slot: jobs sent to its worker (or held for it while it starts) not back yet, cancelled included
    waiting: int  # jobs on the host waiting for a worker with room
    running: list  # per slot: the ids of the nodes its worker runs now (its status page)
    shm_prefix: str | None  # every /dev/shm segment the pool's processes make starts with it (None: not started)
    run_dir: str | None  # the private directory of its sockets, removed by close() (None: not started)


class Local(RunnerBase):
    """Runs graphs on worker processes on this machine.

        with soma.Local(workers=4) as local:
            y = local.run(g, x)
            for y in local.map(g, xs): ...

    `workers`: how many (default: the number of cores). `devices`: `None` (CPU
    workers), a list pinning worker i to `devices[i % len(devices)]`, or `"auto"`
    (every visible CUDA device). `threads`: the intra-op threads each worker gives
    torch and BLAS (default: cores // workers, at least 1, so a full pool does not
    oversubscribe the machine; raise it for one big model per worker, keep it low for
    many small nodes). `arena`: bytes of shared memory each process keeps mapped
    for reuse (default: a quarter of RAM shared among the processes, at most 1 GiB
    each). `preload_torch`: import torch in each worker in the background right
    after it starts (default False: a worker imports torch when a tensor or a torch
    node first needs it; True spares the first torch run the ~1 s import).
    `start_timeout`: how long `start()` waits for the workers to say hello.
    `max_memory`: bytes (an int) or a size such as "4GiB" or "512MiB"; a worker whose own
    memory (resident, less libraries and the shared memory values cross in) is above it
    after an input is replaced before it takes another (default None: never).

    A Local belongs to the process that made it: in a child process (a fork) it is a
    SomaError to use it, and closing it there touches nothing of the parent's.
    """

    def __init__(self, workers: int | None = None, devices=None, *, threads: int | None = None,
                 arena: int | None = None, preload_torch: bool = False, start_timeout: float = 60.0,
                 max_memory=None):
        self.n_workers = workers if workers is not None else (os.cpu_count() or 1)
        if isinstance(workers, bool) or not isinstance(self.n_workers, int) or self.n_workers < 1:
            raise ValueError(f"soma.Local needs at least one worker (workers= an int >= 1), got workers={workers!r}")
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, (int, float)) or not start_timeout > 0:
            raise ValueError(f"soma.Local's start_timeout= is the seconds start() waits for the workers (> 0); got "
                             f"{start_timeout!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"soma.Local's threads= is the torch threads per worker, a positive int; got {threads!r}")
        self.worker_devices = _pinning(devices, self.n_workers)
        self.threads_per_worker = threads if threads is not None else max(1, (os.cpu_count() or 1) // self.n_workers)
        self.arena = arena if arena is not None else _default_arena(self.n_workers)
        self.preload_torch = bool(preload_torch)
        self.start_timeout = start_timeout
        self.max_memory = parse_bytes(max_memory, "max_memory") if max_memory is not None else None
        self._owner_pid = os.getpid()
        self._start_lock = threading.Lock()
        self._pool: WorkerPool | None = None
        self._loop: HostLoop | None = None
        self._closer = None  # the thread whose close() closes it; the others wait for it (_close_done)
        self._close_done = threading.Event()
        # graph → (placement version, its program for run, its program for map)
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._programs_lock = threading.Lock()
        self._last_program = (_nothing, None, None, None)  # (weak ref to a graph, placement version, whole, program)
        self._registry = NodeRegistry(shared_workers=True)
        self.sent_files = self._registry.files  # (the code files its workers may have imported: RunnerBase)

    # -- life ------------------------------------------------------------------------------------
    def start(self) -> "Local":
        """Start the workers (in parallel) and wait until each has said hello."""
        self._check_process()
        with self._start_lock:
            if self._closed:
                raise SomaError(closed_message("Local"))
            if self._pool is None:
                _check_cuda(self.worker_devices)
                pool = WorkerPool(self.worker_devices, arena=self.arena, threads=self.threads_per_worker,
                                  preload_torch=self.preload_torch, registry=self._registry, max_memory=self.max_memory)
                loop = HostLoop(pool, self.worker_devices)
                loop.trace = self._trace
                try:
                    loop.start()  # (hellos are received like everything else)
                    loop.wait_ready(time.monotonic() + self.start_timeout)
                except BaseException:
                    _shut_down(loop, SomaError("this soma.Local could not start"))  # nothing half-started is left
                    raise
                self._loop, self._pool = loop, pool
                _live_pools.add(self)
        return self

    def close(self) -> None:
        """Stop the workers; leave no processes, segments or socket files. Results already returned stay valid.

        Any thread may call it at any time: runs and maps in flight in other threads
        raise `SomaError` ("... was closed while this run was in flight"). Every call returns
        only once the pool is closed: threads calling it at once wait for the one that closes
        it (a call made while closing, on the closing thread, returns at once). In a process
        other than the one that made it (a fork), it does nothing.
        """
        if os.getpid() != self._owner_pid:
            return  # the parent's workers, sockets and segments are the parent's
        with self._start_lock:
            closer = self._closer
            if closer is None:
                self._closer, self._closed = threading.get_ident(), True
        if closer is not None:  # another call closes it: this one returns once it has (one Event: never polled)
            if closer != threading.get_ident() and not self._close_done.wait(CLOSE_WAIT_S):
                raise SomaError(f"this soma.Local's close() in another thread has not finished after "
                                f"{CLOSE_WAIT_S:.0f} s: its workers, segments or socket files may be left")
            return
        try:
            _live_pools.discard(self)
            save_open(self)  # (its maps with a checkpoint write it: their callers may never step them again)
            if self._loop is not None:
                _shut_down(self._loop, SomaError("this soma.Local was closed while this run was in flight"))
        finally:
            self._close_done.set()

    def pids(self) -> list[int]:
        """The pids of the workers running now, in slot order (none before `start()`, nor once `close()` ended)."""
        return [] if self._pool is None or self._close_done.is_set() else self._pool.pids()

    def snapshot(self) -> "Snapshot":
        """What this pool holds now: its workers, the inputs and jobs in flight, where its files are."""
        pool, loop = self._pool, self._loop
        if pool is None:
            return Snapshot([], 0, [0] * len(self.worker_devices), 0, [[] for _ in self.worker_devices], None, None)
        inputs, jobs, waiting, running = loop.snapshot()
        return Snapshot(self.pids(), inputs, jobs, waiting, running, pool.prefix, pool.run_dir)

    # -- running ------------------------------------------------------------------------------------
    def run(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """Run graph `g` (or a node, or an expression) on input `x` on the workers and return its output.

        `retries`: how many more times the input runs, from the graph's start on a live worker,
        when the worker running it dies (a node's own exception, a PostconditionError and a
        RunTimeout are never retried). `timeout`: seconds for the whole input, tries included.
        """
        if type(retries) is not int or retries < 0:  # (0 and the like pass without a call: a run's hot path)
            retries = checked_retries(retries)
        if timeout is not None:
            timeout = checked_timeout(timeout)
        loop, g, program = self._ready(g, "Local.run")
        trace = self._trace
        start = time.monotonic_ns() if trace is not None else 0
        try:
            try:
                _, ok, value = loop.run_one(program, x, trace, retries, g, timeout)
            except KeyboardInterrupt:  # (cancelled by the loop: the traceback stops here, not deep in its receiving)
                raise KeyboardInterrupt from None
            if not ok:
                raise value
            return value
        finally:
            value = None  # (an error raised holds this frame: the frame must not hold the error, a cycle)
            if trace is not None:
                pid, tid = os.getpid(), threading.get_native_id()
                trace.thread(pid, tid, threading.current_thread().name)
                trace.span("run", "host", start, time.monotonic_ns(), pid, tid, {"input": None})

    def submit(self, g, x, *, timeout: float | None = None, retries: int = 0) -> InputFuture:
        """`run(g, x)` without waiting: a `concurrent.futures.Future` at once, set when the outcome comes.

        No thread waits for it: the thread that receives the workers' results sets it (with no lock held:
        a done-callback may start the next input, or wait for one).
        `future.cancel()` cancels the input (dropped if not started; its result dropped if it was).
        """
        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        loop, g, program = self._ready(g, "Local.submit")
        future = InputFuture()
        flow = loop.start_one(program, x, FutureSink(future), self._trace, retries, g)
        future.cancels_with(lambda: loop.cancel([flow]))
        if timeout is not None:
            deadline = _Deadline(loop, flow, future, timeout)
            future.add_done_callback(deadline.disarm)
            loop.at(time.monotonic() + timeout, deadline)
        return future

    def _async_inflight(self, g, timeout, retries):
        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        loop, g, program = self._ready(g, "Local.amap", start=False)
        # A pool not started yet starts as the amap begins, on a thread (LocalInflight.ready), not on the loop.
        return LocalInflight(loop, g, program, self, timeout, retries, asynchronous=True,
                             attach=lambda: self._ready(g, "Local.amap")[0]), g

    def _starts_off_the_loop(self) -> bool:
        return self._pool is None

    def map(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None, retries=0, errors="raise",
            resume=None, checkpoint=None, checkpoint_every=DEFAULT_EVERY_S):
        """The outputs for the inputs of `xs`, lazily, several inputs at once over the pool.

        docs/design.md ("Many inputs") says what each option does. With at least as many inputs
        in flight as workers, each input runs whole on one worker when the graph allows (see
        host/program.compile_program); with fewer, a wave's branches spread over workers as in `run`.
        """
        retries, timeout = checked_retries(retries), checked_timeout(timeout)
        loop, g, program = self._ready(g, "Local.map", whole=window is None or window >= self.n_workers)
        inflight = LocalInflight(loop, g, program, self, timeout, retries)
        return map_outputs(inflight, xs, graph=g, window=window, ordered=ordered, progress=progress,
                           timeout=timeout, errors=errors, resume=resume, checkpoint=checkpoint,
                           checkpoint_every=checkpoint_every, owner=self)

    def _ready(self, g, where: str, whole: bool = False, start: bool = True):
        """`(the loop, the graph of g, its program)`, the pool started first (`start=False`: a pool not started
        yet is not, and the loop is None)."""
        self._check_process()
        g = self.accepting(g, where)
        if self._pool is None:
            if not start:
                return None, g, self._program(g, whole)
            self.start()
        if self._closed:  # (closed since it was accepted)
            raise SomaError(closed_message("Local"))
        program = self._program(g, whole)
        if self._registry.dead:
            self._loop.forget(self._registry.take_dead())
        return self._loop, g, program

    def _program(self, g, whole: bool = False):
        """Compiled once per graph, placement and kind (placing after a run compiles again)."""
        version = g.placement_version
        last = self._last_program  # (the one run last, found without a new weak reference: a run's hot path)
        if last[0]() is g and last[1] == version and last[2] == whole:
            return last[3]
        found = self._programs.get(g)
        if found is not None and found[0] == version and found[1 + whole] is not None:
            self._last_program = (weakref.ref(g), version, whole, found[1 + whole])
            return found[1 + whole]
        with self._programs_lock:
            program = compile_program(g, self._registry.key_of, self.worker_devices, whole)
            for node_id in g.nodes():  # pickled now: a copy is made from the node as it was when first sent
                self._registry.code(node_id, self._registry.key_of(g.node(node_id)))
            found = self._programs.get(g)
            programs = list(found) if found is not None and found[0] == version else [version, None, None]
            programs[1 + whole] = program
            self._programs[g] = tuple(programs)
        return program

    def _check_process(self) -> None:
        if _pid[0] != self._owner_pid:
            raise SomaError(f"this soma.Local belongs to process {self._owner_pid}; this is process {os.getpid()} "
                            f"(a fork of it, say): make a new soma.Local in this process")

    def _trace_ending(self, trace: Trace) -> None:
        if self._loop is not None:
            self._loop.trace = None

    def _trace_started(self, trace: Trace) -> None:
        if self._loop is not None:
            self._loop.trace = trace  # (a worker started inside the block shows its start)
        trace.process(os.getpid(), f"host (soma.Local, pid {os.getpid()})")
        if self._pool is not None:
            for slot in range(self.n_workers):
                worker = self._pool.worker(slot)
                if worker is not None:
                    trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")


class _Deadline:
    """A submitted input's `timeout=`, called on the listener thread when its time is up: its RunTimeout, unless
    its outcome came first. Disarmed as its future is done: the listener's timers keep it until its time (with
    the flow and future, it kept the input and the result alive that long: a server's every response's /dev/shm)."""

    __slots__ = ("loop", "flow", "future", "timeout")

    def __init__(self, loop: HostLoop, flow, future, timeout: float):
        self.loop, self.flow, self.future, self.timeout = loop, flow, future, timeout

    def disarm(self, _future=None) -> None:
        self.flow = self.future = None

    def __call__(self) -> None:
        flow, future = self.flow, self.future
        if flow is None or future is None:  # (done: disarmed, maybe between these two reads)
            return
        err = self.loop.expire([(flow, None)], self.timeout)[0]
        if not future.done():
            FutureSink(future).put((None, False, err))


def _shut_down(loop: HostLoop, error: SomaError) -> None:
    """Closing, in order: every input in flight gets `error`, nothing more is sent but STOP, the listener lets
    go of its socket, then the rest (processes, segments, the socket directory)."""
    loop.close(error)
    loop.pool.close()


def _check_cuda(worker_devices: list[str]) -> None:
    """A DeviceError before any worker starts when one is pinned to a CUDA device torch cannot see here (each
    such worker failed its first input with torch's AttributeError `_cuda_setDevice`, its traceback on stderr)."""
    wanted = [(slot, Device.parse(d)) for slot, d in enumerate(worker_devices) if d.startswith("cuda")]
    if not wanted:
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for slot, device in wanted:
        if (device.index or 0) >= count:
            raise DeviceError(f"worker w{slot} is pinned to {device}, but torch sees {count} CUDA device(s) on this "
                              f"machine: pin it to one of those, to cpu, or pass devices=\"auto\" (every GPU, or cpu)")


def _pinning(devices, n: int) -> list[str]:
    if devices is None:
        return ["cpu"] * n
    if devices == "auto":
        import torch

        count = torch.cuda.device_count()
        devices = [f"cuda:{i}" for i in range(count)] or ["cpu"]
    if isinstance(devices, str):
        devices = [devices]
    parsed = []
    for d in devices:
        dev = Device.parse(d)
        if dev.kind == "meta":
            raise DeviceError("a worker cannot be pinned to `meta` (meta nodes run on any worker); pin cpu or cuda:N")
        parsed.append(str(dev))
    if not parsed:
        raise DeviceError("devices= is an empty list; give at least one device, or None for CPU workers")
    return [parsed[i % len(parsed)] for i in range(n)]


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "t": 1000 ** 4, "tb": 1000 ** 4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_bytes(value, name: str) -> int:
    """Bytes from an int or a size such as "4GiB", "512MiB", "1.5GB"; anything else is a ValueError naming `name`."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value > 0:
            return value
    elif isinstance(value, str):
        match = _SIZE.match(value.lower())
        if match is not None and match.group(2) in _UNITS:
            nbytes = int(float(match.group(1)) * _UNITS[match.group(2)])
            if nbytes > 0:
                return nbytes
    raise ValueError(f"soma.Local's {name}= is a number of bytes (an int > 0) or a size such as \"4GiB\" or "
                     f"\"512MiB\", got {value!r}")


def _default_arena(workers: int) -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(min(1 << 30, total // 4 // (workers + 1)))


_live_pools: "weakref.WeakSet[Local]" = weakref.WeakSet()
_pid = [os.getpid()]  # this process's pid, kept current in a fork's child (os.getpid is a system call a run)
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))


def _nothing():
    return None


@atexit.register
def _close_all() -> None:
    for pool in list(_live_pools):  # (in a forked child, close does nothing: they are the parent's)
        try:
            pool.close()
        except Exception:
            pass
