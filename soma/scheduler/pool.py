"""The worker pool: processes, sockets, tasks in flight, shared-memory leases, and faults.

`Local` decides what runs where; this module makes it happen and reports back:

    submit(slot, pieces, code, input)  ─ TASK ─▶ worker          (ROUTER, one lock for senders)
    wait(pendings, deadline)           ◀─ RESULT ─ worker        (PULL, one leading receiver)
        the leader decodes outputs, counts leases, and every PUMP_S looks at the
        processes: a dead one fails what it held (WorkerDied) and is replaced
    timed_out(pendings)                  kill and replace the late workers, RunTimeout
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, deque

from .. import wire
from .._log import warn
from ..errors import NodeError, PostconditionError, RemoteTraceback, RunTimeout, SomaError, WorkerDied
from ..plan import last_step
from ..shm import pool_prefix, unlink_all
from .leases import LeaseBook
from .procs import spawn

PUMP_S = 0.05  # the leader looks at worker processes at least this often while a run waits
START_FAILURES = 3  # a slot whose worker dies this many times before saying hello is broken


class Pending:
    """A task in flight: which worker has it, and what came back."""

    __slots__ = ("id", "worker", "remotes", "outcomes", "error")

    def __init__(self, task_id: int, worker, remotes: list):
        self.id = task_id
        self.worker = worker
        self.remotes = remotes
        self.outcomes = None  # one per piece: a value, or an exception
        self.error = None  # the whole task failed (its worker died, the run timed out)

    @property
    def done(self) -> bool:
        return self.outcomes is not None or self.error is not None

    def node_ids(self) -> list[str]:
        return [n for r in self.remotes for n in r.plan.steps()]


class WorkerPool:
    def __init__(self, devices: list[str], *, arena: int, threads: int, preload_torch: bool):
        self.devices = devices
        self.arena = arena
        self.threads = threads
        self.preload_torch = preload_torch
        self.closed = False
        self.secret = os.urandom(32)
        self.host_pid = os.getpid()
        self.prefix = pool_prefix(self.host_pid, os.urandom(4).hex())
        self.run_dir = tempfile.mkdtemp(prefix="soma-")  # 0700: only this user can reach the sockets
        os.chmod(self.run_dir, 0o700)
        self.endpoints = (f"ipc://{self.run_dir}/tasks", f"ipc://{self.run_dir}/results")
        self.workers: list = [None] * len(devices)
        self._state_lock = threading.RLock()
        self._start_failures = Counter()
        self._pending: dict[int, Pending] = {}
        self._task_ids = itertools.count(1)
        self._book = LeaseBook(self.host_pid)
        self._store = None
        self._host_released: deque = deque()
        self._last_check = 0.0
        self._cv = threading.Condition()
        self._waiting = 0  # threads asleep on _cv (the leader wakes them only if there are any)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()

    # -- life ------------------------------------------------------------------------------------
    def start(self, deadline: float) -> None:
        # Workers first: their start-up (Python, imports) is the long pole, and the host's own
        # (ZeroMQ, binding) overlaps with it. They retry connecting every few ms until we bind.
        for slot in range(len(self.devices)):
            self._spawn(slot)
        self._open_sockets()
        for worker in list(self.workers):
            self.wait_ready(worker, deadline)

    def _open_sockets(self) -> None:
        import zmq

        self._zmq = zmq
        self._zctx = wire.context()
        self._tasks = self._zctx.socket(zmq.ROUTER)
        self._tasks.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown worker is an error, not a silent drop
        self._tasks.setsockopt(zmq.SNDHWM, 0)
        self._tasks.setsockopt(zmq.LINGER, 0)
        self._results = self._zctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        self._results.setsockopt(zmq.LINGER, 0)
        self._tasks.bind(self.endpoints[0])
        self._results.bind(self.endpoints[1])
        self._receiver = wire.Receiver(self._results)

    def _spawn(self, slot: int):
        worker = spawn(slot, self.devices[slot], endpoints=self.endpoints, run_dir=self.run_dir,
                       secret=self.secret, prefix=self.prefix, threads=self.threads,
                       arena=self.arena, preload_torch=self.preload_torch)
        self.workers[slot] = worker
        return worker

    def close(self) -> None:
        self.closed = True
        workers = [w for w in self.workers if w is not None]
        for worker in workers:
            try:
                self.send(worker, [wire.STOP], retry_s=0.0)
            except Exception:
                pass
        deadline = time.monotonic() + 3.0
        for worker in workers:
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
            worker.kill()
            worker.close()
        with self._state_lock:
            for pending in list(self._pending.values()):
                if not pending.done:
                    pending.error = SomaError("the soma.Local pool was closed while this run was in flight")
            self._pending.clear()
        self._wake()
        if hasattr(self, "_tasks"):
            self._tasks.close(0)
            self._results.close(0)
            self._zctx.term()
        if self._store is not None:
            self._store.close()
        unlink_all(self.prefix)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- tasks -------------------------------------------------------------------------------------
    def submit(self, slot: int, pieces: list, code: dict, payload: bytes, shared: list, deadline) -> Pending:
        """Send pieces to the worker of `slot` in one TASK; what comes back lands in the Pending."""
        worker = self.ready_worker(slot, deadline)
        with self._state_lock:
            task_id = next(self._task_ids)
            pending = Pending(task_id, worker, pieces)
            self._pending[task_id] = pending
            forget, worker.forget = worker.forget, []
        for name in shared:
            self._book.lent(name, worker.pid)
            if self._store is not None:
                self._store.note_sent(name)
        frees = self._book.take_frees(worker.pid)
        try:
            self.send(worker, [wire.TASK, task_id, code, [p.spec for p in pieces], payload, frees, forget])
        except Unreachable:
            pass  # it died on the way: the leader reports it as WorkerDied
        worker.loaded.update(code)
        return pending

    def forget(self, keys: list) -> None:
        """Nodes the host let go: each worker that holds one is told with its next task."""
        with self._state_lock:
            for w in self.workers:
                if w is None:
                    continue
                for key in keys:
                    if key in w.loaded:
                        w.loaded.discard(key)
                        w.forget.append(key)

    def ready_worker(self, slot: int, deadline):
        worker = self.workers[slot]
        if not worker.ready.is_set() or not worker.alive(recheck_s=PUMP_S / 10):
            if worker.ready.is_set() and not worker.alive():
                self._lead(lambda: worker.retired, deadline)  # let the leader report and replace it
            worker = self.workers[slot]
            self.wait_ready(worker, deadline)
        return self.workers[slot]

    def wait_ready(self, worker, deadline) -> None:
        while not worker.ready.is_set():
            if not self._lead(lambda: worker.ready.is_set() or worker.retired, deadline):
                raise WorkerDied(f"worker {worker.id} (pid {worker.pid}) did not say hello in time",
                                 worker=worker.id, pid=worker.pid, node=None)
            if worker.retired:
                if self._start_failures[worker.slot] >= START_FAILURES:
                    raise WorkerDied(
                        f"worker {worker.id} (pid {worker.pid}) {worker.how_it_ended()} before it was ready, "
                        f"{START_FAILURES} times in a row; its stderr says why", worker=worker.id,
                        pid=worker.pid, node=None)
                worker = self.workers[worker.slot]

    def wait(self, pendings: list, deadline) -> bool:
        """Until every pending is done (True), or the deadline passes (False)."""
        return self._lead(lambda: all(p.done for p in pendings), deadline)

    # -- sending and receiving ------------------------------------------------------------------------
    def send(self, worker, message: list, retry_s: float = 5.0) -> None:
        frame = wire.seal(self.secret, message)
        deadline = time.monotonic() + retry_s
        while True:
            try:
                with self._send_lock:
                    self._tasks.send(worker.identity, self._zmq.SNDMORE)
                    self._tasks.send(frame)
                return
            except self._zmq.ZMQError as err:
                # Right after HELLO the connection may still be completing; a dead worker never completes it.
                if err.errno != self._zmq.EHOSTUNREACH or time.monotonic() > deadline or not worker.alive():
                    raise Unreachable(worker.id) from err
                time.sleep(0.001)

    def _lead(self, done, deadline) -> bool:
        """Wait until `done()`: one waiting thread at a time receives for everybody (leader/follower).

        Returns False when the deadline passed first.
        """
        while not done():
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return done()
            if self._recv_lock.acquire(blocking=False):
                try:
                    while not done():
                        remaining = None if deadline is None else deadline - time.monotonic()
                        if remaining is not None and remaining <= 0:
                            break
                        self._pump(PUMP_S if remaining is None else min(PUMP_S, remaining))
                finally:
                    self._recv_lock.release()
                    self._wake()  # another waiter may have to lead now
            else:
                with self._cv:
                    self._waiting += 1
                    try:
                        if not done():
                            self._cv.wait(PUMP_S if remaining is None else min(PUMP_S, remaining))
                    finally:
                        self._waiting -= 1
        return True

    def _wake(self) -> None:
        # `done` is set before `_waiting` is read, and a waiter counts itself before it checks `done`
        # (both under the GIL, the waiter under _cv): a sleeping waiter is never missed.
        if self._waiting:
            with self._cv:
                self._cv.notify_all()

    def _pump(self, timeout_s: float) -> None:
        """Receive and handle what has arrived; look at the workers now and then. Leader only."""
        frames = self._receiver.wait(max(0, int(timeout_s * 1000)))
        if frames is not None:
            self._drain(frames)
        now = time.monotonic()
        if now - self._last_check >= PUMP_S:
            self._last_check = now
            self._check_workers()

    def _drain(self, frames=None) -> None:
        """Handle `frames` (a message already received) and everything else queued now."""
        delivered = False
        while True:
            if frames is None:
                if not self._receiver.ready():
                    break
                frames = self._receiver.wait(0)
                if frames is None:
                    break
            message = wire.unseal(self.secret, frames, "a worker")
            frames = None
            if message is not None:
                delivered = self._handle(message) or delivered
        self.settle()
        if delivered:
            self._wake()

    def _handle(self, message: list) -> bool:
        kind = message[0]
        try:
            if kind == wire.RESULT:
                return self._on_result(*message[1:])
            if kind == wire.HELLO:
                worker_id, pid, _device = message[1:4]
                for worker in self.workers:
                    if worker is not None and worker.id == worker_id and worker.pid == pid:
                        worker.ready.set()
                        self._start_failures[worker.slot] = 0
                        return True
            else:
                warn("soma.local", "soma: dropped a %s message a worker should not send", wire.KIND_NAMES[kind])
        except Exception as err:  # authentic but malformed: drop it, never let it take the pool down
            warn("soma.local", "soma: dropped a malformed %s message: %s: %s", wire.KIND_NAMES.get(kind),
                 type(err).__name__, err)
        return False

    def _on_result(self, worker_id: str, task_id: int, outcomes: list, releases: list) -> bool:
        with self._state_lock:
            pending = self._pending.get(task_id)
            if pending is not None and pending.worker.id == worker_id:
                del self._pending[task_id]
            else:
                pending = None  # a task nobody waits for any more (its run timed out), or not this worker's
        worker = pending.worker if pending is not None else self._worker_named(worker_id)
        if worker is None:
            return False
        if pending is None:
            # Open and drop the outputs anyway: the segments they name must still be counted and settled.
            for ok, body in outcomes:
                if ok:
                    try:
                        self._decode(body, worker)
                    except Exception:
                        pass
        else:
            values = [self._outcome(piece, outcome, worker) for piece, outcome in zip(pending.remotes, outcomes)]
        # Releases after the values: a handle echoed back must be counted before the input's receipt drops.
        for name, n in releases:
            self._book.released(worker.pid, name, n)
        if pending is None:
            return False
        pending.outcomes = values
        return True

    def _worker_named(self, worker_id: str):
        return next((w for w in self.workers if w is not None and w.id == worker_id), None)

    def _outcome(self, piece, outcome: list, worker):
        ok, body = outcome
        if not ok:
            if body.get("kind") == "load":
                worker.loaded.difference_update(piece.keys.values())
            return _error_from(body)
        try:
            return self._decode(body, worker)
        except Exception as err:
            producer = last_step(piece.plan)
            return NodeError(producer, f"node `{producer}` failed: its output could not be received from worker "
                                       f"{worker.id}: {type(err).__name__}: {err}")

    def _decode(self, body: bytes, worker):
        decoder = wire.Decoder(self.get_store)
        try:
            return decoder.unpack(body)
        finally:
            for name in decoder.received:
                self._book.received(name, worker.pid)

    # -- shared memory -------------------------------------------------------------------------------------
    def get_store(self, create: bool = True):
        if self._store is None and create:
            with self._state_lock:
                if self._store is None:
                    from ..shm import SegmentStore

                    self._store = SegmentStore(self.prefix, self.arena, on_release=self._host_release)
        return self._store

    def _host_release(self, name: str, n: int) -> None:
        self._host_released.append((name, n))  # any thread, maybe inside GC: only queue it

    def settle(self) -> None:
        """Apply the host's own dead receipts, and hand segments the host owns back to its pool."""
        if not self._host_released and not self._book.has_frees:
            return
        while self._host_released:
            try:
                name, n = self._host_released.popleft()
            except IndexError:
                break
            self._book.released(self.host_pid, name, n)
        if self._store is not None:
            for name, n in self._book.take_frees(self.host_pid):
                self._store.free(name, n)

    def flush_frees(self) -> None:
        """Tell owners about segments nobody holds any more (otherwise they ride on the next TASK)."""
        if not self._book.has_frees:
            return
        for worker in self.workers:
            if worker is None or not worker.ready.is_set():
                continue
            frees = self._book.take_frees(worker.pid)
            if frees:
                try:
                    self.send(worker, [wire.FREE, frees], retry_s=0.0)
                except Unreachable:
                    pass

    # -- faults ----------------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        for worker in list(self.workers):
            if worker is not None and not worker.retired and not worker.alive():
                self._drain()  # a result it sent before dying is still a result
                self._retire(worker, reason=None)

    def _retire(self, worker, reason: str | None, timed_out: set | None = None) -> None:
        """Handle a worker's end: fail what it held, settle its segments, start its replacement."""
        with self._state_lock:
            if worker.retired:
                return
            running = worker.running_nodes()
            worker.kill()
            worker.retired = True
            ended = reason or worker.how_it_ended()
            if not worker.ready.is_set():
                self._start_failures[worker.slot] += 1
            for task_id, pending in list(self._pending.items()):
                if pending.worker is not worker:
                    continue
                del self._pending[task_id]
                if timed_out is not None and task_id in timed_out:
                    continue  # the run that timed out raises RunTimeout itself
                ids = pending.node_ids()
                node = next((n for n in running if n in ids), ids[0] if ids else None)
                pending.error = WorkerDied(
                    f"worker {worker.id} (pid {worker.pid}) {ended} while running node `{node}`; "
                    f"the pool replaced it: run again", worker=worker.id, pid=worker.pid, node=node)
            self._book.holder_gone(worker.pid)
            unlink_all(self.prefix, owner=worker.pid, keep=self._book.held_names())
            worker.close()
            if not self.closed and self._start_failures[worker.slot] < START_FAILURES:
                self._spawn(worker.slot)
        self._wake()

    def timed_out(self, pendings: list, timeout) -> RunTimeout:
        """Kill and replace the workers of the late pendings; the RunTimeout naming what they ran."""
        late = [p for p in pendings if not p.done]
        nodes: list[str] = []
        for p in late:
            running = p.worker.running_nodes()
            ids = p.node_ids()
            nodes.extend([n for n in ids if n in running] or ids)
        for worker in {id(p.worker): p.worker for p in late}.values():
            self._retire(worker, reason="was stopped because a run timed out on it",
                         timed_out={p.id for p in late})
        nodes = list(dict.fromkeys(nodes))
        return RunTimeout(
            f"run timed out after {timeout} s; still running: {', '.join(f'`{n}`' for n in nodes)} "
            f"(their workers were replaced)", nodes=tuple(nodes))


class Unreachable(Exception):
    """A worker's socket is not connected (it died, or never finished connecting)."""


def _error_from(body: dict) -> NodeError:
    """Rebuild a node's failure on the host: same class, same message, the cause chained when it travels."""
    if body.get("kind") == "postcondition":
        return PostconditionError(body["node"], body["declared"], body["actual"])
    err = NodeError(body["node"], body["message"], remote_traceback=body.get("traceback"))
    remote = RemoteTraceback(body["traceback"]) if body.get("traceback") else None
    cause = None
    if body.get("cause"):
        import pickle

        try:
            cause = pickle.loads(body["cause"])
        except Exception:
            cause = None
    if cause is not None:
        cause.__cause__ = remote
        err.__cause__ = cause
    else:
        err.__cause__ = remote
    return err
