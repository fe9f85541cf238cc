"""`soma.Local`: the host side of the worker pool. See `soma.scheduler` for the drawing."""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections import Counter, deque

from .. import wire
from ..device import Device
from ..errors import (
    DeviceError, NodeError, PostconditionError, RemoteTraceback, RunTimeout, SomaError, WorkerDied,
)
from ..postcondition import find_misplaced
from ..shm import pool_prefix, unlink_all
from .dispatch import Chain, Remote, Spread, compile_program, output_devices
from .leases import LeaseBook
from .procs import spawn

log = logging.getLogger("soma.local")

PUMP_S = 0.05  # the leader looks at worker processes at least this often while a run waits
START_FAILURES = 3  # a slot whose worker dies this many times before saying hello is broken


class _Pending:
    """A task in flight: which worker has it, and what came back."""

    __slots__ = ("id", "worker", "remotes", "outcomes", "error")

    def __init__(self, task_id: int, worker, remotes: list):
        self.id = task_id
        self.worker = worker
        self.remotes = remotes
        self.outcomes = None  # one per remote: a value, or an exception
        self.error = None  # the whole task failed (its worker died, the run timed out)

    @property
    def done(self) -> bool:
        return self.outcomes is not None or self.error is not None

    def node_ids(self) -> list[str]:
        return [n for r in self.remotes for n in r.plan.steps()]


class Local:
    """Runs graphs on worker processes on this machine.

        with soma.Local(workers=4) as local:
            y = local.run(g, x)

    `workers`: how many (default: the number of cores). `devices`: `None` (CPU
    workers), a list pinning worker i to `devices[i % len(devices)]`, or `"auto"`
    (every visible CUDA device). `arena`: bytes of shared memory each process keeps
    mapped for reuse (default: a quarter of RAM shared among the processes, at most
    1 GiB each). `preload_torch`: import torch in workers at start (default: when
    the host has imported it).
    """

    def __init__(self, workers: int | None = None, devices=None, *, arena: int | None = None,
                 preload_torch: bool | None = None, start_timeout: float = 60.0):
        self.n_workers = int(workers) if workers is not None else (os.cpu_count() or 1)
        if self.n_workers < 1:
            raise ValueError(f"soma.Local needs at least one worker, got workers={workers}")
        self.worker_devices = _pinning(devices, self.n_workers)
        self.arena = arena if arena is not None else _default_arena(self.n_workers)
        self.preload_torch = preload_torch
        self.start_timeout = start_timeout
        self.threads_per_worker = max(1, (os.cpu_count() or 1) // self.n_workers)
        self._start_lock = threading.Lock()
        self._started = False
        self._closed = False

    # -- life ------------------------------------------------------------------------------------
    def __enter__(self) -> "Local":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Local":
        """Start the workers (in parallel) and wait until each has said hello."""
        with self._start_lock:
            if self._closed:
                raise SomaError("this soma.Local is closed; make a new one")
            if self._started:
                return self
            deadline = time.monotonic() + self.start_timeout
            self._prepare()
            self._started = True
            _live_pools.add(self)
            # Workers first: their start-up (Python, imports) is the long pole, and the host's own
            # (ZeroMQ, binding) overlaps with it. They retry connecting every few ms until we bind.
            for slot in range(self.n_workers):
                self._spawn(slot)
            self._open_sockets()
            for worker in list(self._workers):
                self._wait_ready(worker, deadline)
        return self

    def _prepare(self) -> None:
        """Everything a worker needs to be started: secret, names, the private socket directory."""
        self._secret = os.urandom(32)
        self._host_pid = os.getpid()
        self._prefix = pool_prefix(self._host_pid, os.urandom(4).hex())
        self._run_dir = tempfile.mkdtemp(prefix="soma-")  # 0700: only this user can reach the sockets
        os.chmod(self._run_dir, 0o700)
        self._endpoints = (f"ipc://{self._run_dir}/tasks", f"ipc://{self._run_dir}/results")
        self._workers: list = [None] * self.n_workers

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
        self._tasks.bind(self._endpoints[0])
        self._results.bind(self._endpoints[1])
        self._receiver = wire.Receiver(self._results)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._state_lock = threading.RLock()
        self._cv = threading.Condition()
        self._waiting = 0  # threads asleep on _cv (the leader wakes them only if there are any)
        self._start_failures = Counter()
        self._pending: dict[int, _Pending] = {}
        self._task_ids = itertools.count(1)
        self._book = LeaseBook(self._host_pid)
        self._store = None
        self._host_released: deque = deque()
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._key_by_id: dict[int, int] = {}  # id(node) → node key
        self._node_by_key: dict[int, list] = {}  # node key → [ref to the node, pickled code or None, id(node)]
        self._node_keys = itertools.count(1)
        self._affinity: dict[int, int] = {}  # node key → slot that first ran it
        self._dead_keys: deque = deque()  # keys of nodes gone on the host: their workers may forget them
        self._last_check = 0.0

    def _spawn(self, slot: int):
        preload = self.preload_torch if self.preload_torch is not None else "torch" in __import__("sys").modules
        worker = spawn(slot, self.worker_devices[slot], endpoints=self._endpoints, run_dir=self._run_dir,
                       secret=self._secret, prefix=self._prefix, threads=self.threads_per_worker,
                       arena=self.arena, preload_torch=preload)
        self._workers[slot] = worker
        return worker

    def close(self) -> None:
        """Stop the workers; leave no processes, segments or socket files. Results already returned stay valid."""
        with self._start_lock:
            if self._closed:
                return
            self._closed = True
            if not self._started:
                return
        _live_pools.discard(self)
        workers = [w for w in self._workers if w is not None]
        for worker in workers:
            try:
                self._send(worker, [wire.STOP], retry_s=0.0)
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
        self._tasks.close(0)
        self._results.close(0)
        self._zctx.term()
        if self._store is not None:
            self._store.close()
        unlink_all(self._prefix)
        shutil.rmtree(self._run_dir, ignore_errors=True)

    def pids(self) -> list[int]:
        """The pids of the workers running now, in slot order (none before `start()`)."""
        if not self._started:
            return []
        return [w.pid for w in self._workers if w is not None]

    # -- running ------------------------------------------------------------------------------------
    def run(self, g, x, *, timeout: float | None = None):
        """Run graph `g` on input `x` on the workers and return its output."""
        if not self._started:
            self.start()
        if self._closed:
            raise SomaError("this soma.Local is closed; make a new one")
        program = self._program(g)
        deadline = None if timeout is None else time.monotonic() + timeout
        run = _Run(deadline, timeout)
        try:
            return self._execute(program, x, run)
        finally:
            self._settle()
            self._flush_frees()

    def _program(self, g):
        key = tuple(g.devices().items())
        per_graph = self._programs.get(g)
        if per_graph is None:
            per_graph = self._programs[g] = {}
        program = per_graph.get(key)
        if program is None:
            program = per_graph[key] = compile_program(g, self._key_of, self.worker_devices)
        return program

    def _key_of(self, node) -> int:
        """A node's key: its identity for this pool (its code travels once per worker under it)."""
        key = self._key_by_id.get(id(node))
        if key is not None and self._node_by_key[key][0]() is node:
            return key
        key = next(self._node_keys)
        try:
            # When the host's node dies, no graph can run it again: workers may drop their copies.
            ref = weakref.ref(node, lambda _, key=key: self._dead_keys.append(key))
        except TypeError:  # a node without __weakref__: keep it alive as long as the pool
            ref = (lambda n: (lambda: n))(node)
        self._key_by_id[id(node)] = key
        self._node_by_key[key] = [ref, None, id(node)]
        return key

    def _execute(self, part, x, run: "_Run"):
        if isinstance(part, Chain):
            for item in part.parts:
                x = self._execute(item, x, run)
            return x
        if isinstance(part, Remote):
            return self._run_remotes([part], x, run)[0]
        return self._run_spread(part, x, run)

    def _run_spread(self, spread: Spread, x, run: "_Run"):
        remotes = [p for p in spread.parts if isinstance(p, Remote)]
        others = [p for p in spread.parts if not isinstance(p, Remote)]
        results: dict[int, object] = {}
        threads = []

        def other(part):
            try:
                results[id(part)] = self._execute(part, x, run)
            except BaseException as exc:
                results[id(part)] = _Failure(exc)

        for part in others:  # branches split across devices are orchestrated from here
            t = threading.Thread(target=other, args=(part,), daemon=True)
            t.start()
            threads.append(t)
        failure = None
        try:
            for remote, value in zip(remotes, self._run_remotes(remotes, x, run, raise_first=False)):
                results[id(remote)] = value
        except BaseException as exc:
            failure = exc
        for t in threads:
            t.join()
        if failure is not None:
            raise failure
        values = [results[id(p)] for p in spread.parts]
        for value in values:
            if isinstance(value, _Failure):
                raise value.exc
        return tuple(values)

    def _run_remotes(self, remotes: list, x, run: "_Run", raise_first: bool = True) -> list:
        """Send pieces (one message per worker), wait for all of them, return their outputs in order."""
        self._assign(remotes)
        by_slot: dict[int, list] = {}
        for r in remotes:
            by_slot.setdefault(r.slot, []).append(r)
        encoder = wire.Encoder(self._get_store)
        try:
            payload = encoder.pack(x)
        except wire.GradCrossing as err:
            entry = remotes[0].entry
            raise NodeError(entry, f"node `{entry}` failed: its input is {err}") from None
        except wire.Unsendable as err:
            entry = remotes[0].entry
            raise NodeError(entry, f"node `{entry}` failed: its input cannot be sent to a worker: {err}") from None
        self._settle()
        tasks = [(slot, group, self._code_for(slot, group)) for slot, group in by_slot.items()]
        pendings = [self._submit(slot, group, code, payload, encoder.shared, run) for slot, group, code in tasks]
        del payload, encoder
        self._await(pendings, run)
        outputs = {}
        for pending in pendings:
            for remote, outcome in zip(pending.remotes, pending.outcomes or [pending.error] * len(pending.remotes)):
                outputs[id(remote)] = outcome
        ordered = [outputs[id(r)] for r in remotes]
        for r, value in zip(remotes, ordered):
            if not isinstance(value, BaseException):
                self._check_arrival(r, value)
        first_error = next((v for v in ordered if isinstance(v, BaseException)), None)
        if first_error is not None:
            raise first_error
        return ordered

    def _check_arrival(self, remote: Remote, value) -> None:
        """The postcondition, on what arrived: a transport that moved a tensor is caught too."""
        for node_id, declared, item in output_devices(remote.plan, remote.devices, value):
            actual = find_misplaced(item, declared)
            if actual is not None:
                raise PostconditionError(node_id, declared, actual)

    def _assign(self, remotes: list) -> None:
        """Fix each piece's worker at its first dispatch: where its nodes already live, else the least used."""
        if all(r.slot is not None for r in remotes):
            return
        with self._state_lock:
            load = Counter(r.slot for r in remotes if r.slot is not None)
            weight = Counter(self._affinity.values())
            for r in remotes:
                if r.slot is not None:
                    continue
                eligible = [s for s in range(self.n_workers) if r.cuda is None or self.worker_devices[s] == r.cuda]
                homes = Counter(self._affinity[k] for k in r.keys.values() if k in self._affinity)
                homes = Counter({s: n for s, n in homes.items() if s in eligible})
                if homes:
                    r.slot = homes.most_common(1)[0][0]
                else:
                    r.slot = min(eligible, key=lambda s: (load[s], weight[s], s))
                load[r.slot] += 1
                for key in r.keys.values():
                    if key not in self._affinity:
                        self._affinity[key] = r.slot
                        weight[r.slot] += 1

    def _code_for(self, slot: int, group: list) -> dict:
        """The code of the nodes this worker does not hold yet (pickled once per node)."""
        worker = self._workers[slot]
        code = {}
        for r in group:
            for node_id, key in r.keys.items():
                if key in worker.loaded or key in code:
                    continue
                code[key] = self._pickled(node_id, key)
        return code

    def _pickled(self, node_id: str, key: int) -> bytes:
        entry = self._node_by_key[key]
        if entry[1] is None:
            import cloudpickle

            try:
                entry[1] = cloudpickle.dumps(entry[0]())
            except Exception as err:
                raise NodeError(node_id, f"node `{node_id}` failed: it cannot be sent to a worker: "
                                         f"{type(err).__name__}: {err} (keep unpicklable things such as locks, "
                                         f"sockets and open files out of the node, or create them in forward)") from err
        return entry[1]

    def _submit(self, slot: int, group: list, code: dict, payload: bytes, shared: list, run: "_Run") -> _Pending:
        worker = self._ready_worker(slot, run)
        with self._state_lock:
            task_id = next(self._task_ids)
            pending = _Pending(task_id, worker, group)
            self._pending[task_id] = pending
        for name in shared:
            self._book.lent(name, worker.pid)
            if self._store is not None:
                self._store.note_sent(name)
        frees = self._book.take_frees(worker.pid)
        forget = self._forget_for(worker)
        try:
            self._send(worker, [wire.TASK, task_id, code, [r.spec for r in group], payload, frees, forget])
        except _Unreachable:
            pass  # it died on the way: the leader reports it as WorkerDied
        worker.loaded.update(code)
        run.pendings.append(pending)
        return pending

    def _forget_for(self, worker) -> list:
        """Keys of dead nodes this worker still holds (it drops them; the host drops their code)."""
        while self._dead_keys:
            try:
                key = self._dead_keys.popleft()
            except IndexError:
                break
            with self._state_lock:
                entry = self._node_by_key.pop(key, None)
                self._affinity.pop(key, None)
                if entry is not None and self._key_by_id.get(entry[2]) == key:
                    del self._key_by_id[entry[2]]
                for w in self._workers:
                    if w is not None and key in w.loaded:
                        w.loaded.discard(key)
                        w.forget.append(key)
        if not worker.forget:
            return []
        with self._state_lock:
            forget, worker.forget = worker.forget, []
        return forget

    def _ready_worker(self, slot: int, run: "_Run"):
        worker = self._workers[slot]
        if not worker.ready.is_set() or not worker.alive(recheck_s=PUMP_S / 10):
            if worker.ready.is_set() and not worker.alive():
                self._lead(lambda: worker.retired, run.deadline)  # let the leader report and replace it
            worker = self._workers[slot]
            self._wait_ready(worker, run.deadline)
        return self._workers[slot]

    def _wait_ready(self, worker, deadline) -> None:
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
                worker = self._workers[worker.slot]

    # -- sending and receiving ------------------------------------------------------------------------
    def _send(self, worker, message: list, retry_s: float = 5.0) -> None:
        frame = wire.seal(self._secret, message)
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
                    raise _Unreachable(worker.id) from err
                time.sleep(0.001)

    def _await(self, pendings: list, run: "_Run") -> None:
        if self._lead(lambda: all(p.done for p in pendings), run.deadline):
            return
        self._timed_out(pendings, run)

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
            message = wire.unseal(self._secret, frames, "a worker")
            frames = None
            if message is not None:
                delivered = self._handle(message) or delivered
        self._settle()
        if delivered:
            self._wake()

    def _handle(self, message: list) -> bool:
        kind = message[0]
        try:
            if kind == wire.RESULT:
                return self._on_result(*message[1:])
            if kind == wire.HELLO:
                worker_id, pid, _device = message[1:4]
                for worker in self._workers:
                    if worker is not None and worker.id == worker_id and worker.pid == pid:
                        worker.ready.set()
                        self._start_failures[worker.slot] = 0
                        return True
            else:
                log.warning("soma: dropped a %s message a worker should not send", wire.KIND_NAMES[kind])
        except Exception as err:  # authentic but malformed: drop it, never let it take the pool down
            log.warning("soma: dropped a malformed %s message: %s: %s", wire.KIND_NAMES.get(kind),
                        type(err).__name__, err)
        return False

    def _on_result(self, worker_id: str, task_id: int, outcomes: list, releases: list) -> bool:
        pending = self._pending.pop(task_id, None)
        if pending is None or pending.worker.id != worker_id:
            self._discard(outcomes, worker_id)
            self._on_releases(worker_id, releases)
            return False
        sender = pending.worker.pid
        values = []
        for remote, outcome in zip(pending.remotes, outcomes):
            values.append(self._outcome(remote, outcome, sender, pending.worker))
        # Releases after the values: a handle echoed back must be counted before the input's receipt drops.
        for name, n in releases:
            self._book.released(sender, name, n)
        pending.outcomes = values
        return True

    def _outcome(self, remote: Remote, outcome: list, sender: int, worker):
        ok, body = outcome
        if not ok:
            if body.get("kind") == "load":
                worker.loaded.difference_update(remote.keys.values())
            return _error_from(body)
        decoder = wire.Decoder(self._get_store)
        try:
            value = decoder.unpack(body)
        except Exception as err:
            producer = list(remote.plan.steps())[-1]
            return NodeError(producer, f"node `{producer}` failed: its output could not be received from worker "
                                       f"{worker.id}: {type(err).__name__}: {err}")
        finally:
            for name in decoder.received:
                self._book.received(name, sender)
        return value

    def _discard(self, outcomes: list, worker_id: str) -> None:
        """Open and drop the outputs of a task nobody waits for: their segments must still be settled."""
        worker = next((w for w in self._workers if w is not None and w.id == worker_id), None)
        for ok, body in outcomes:
            if ok and worker is not None:
                decoder = wire.Decoder(self._get_store)
                try:
                    decoder.unpack(body)
                except Exception:
                    pass
                for name in decoder.received:
                    self._book.received(name, worker.pid)

    def _on_releases(self, worker_id: str, releases: list) -> None:
        worker = next((w for w in self._workers if w is not None and w.id == worker_id), None)
        if worker is None:
            return
        for name, n in releases:
            self._book.released(worker.pid, name, n)

    # -- shared memory -------------------------------------------------------------------------------------
    def _get_store(self, create: bool = True):
        if self._store is None and create:
            with self._state_lock:
                if self._store is None:
                    from ..shm import SegmentStore

                    self._store = SegmentStore(self._prefix, self.arena, on_release=self._host_release)
        return self._store

    def _host_release(self, name: str, n: int) -> None:
        self._host_released.append((name, n))  # any thread, maybe inside GC: only queue it

    def _settle(self) -> None:
        """Apply the host's own dead receipts, and hand segments the host owns back to its pool."""
        if not self._host_released and not self._book.has_frees:
            return
        while self._host_released:
            try:
                name, n = self._host_released.popleft()
            except IndexError:
                break
            self._book.released(self._host_pid, name, n)
        if self._store is not None:
            for name, n in self._book.take_frees(self._host_pid):
                self._store.free(name, n)

    def _flush_frees(self) -> None:
        if not self._book.has_frees:
            return
        for worker in self._workers:
            if worker is None or not worker.ready.is_set():
                continue
            frees = self._book.take_frees(worker.pid)
            if frees:
                try:
                    self._send(worker, [wire.FREE, frees], retry_s=0.0)
                except _Unreachable:
                    pass

    # -- faults ----------------------------------------------------------------------------------------
    def _check_workers(self) -> None:
        for worker in list(self._workers):
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
            unlink_all(self._prefix, owner=worker.pid, keep=self._book.held_names())
            worker.close()
            if not self._closed and self._start_failures[worker.slot] < START_FAILURES:
                self._spawn(worker.slot)
        self._wake()

    def _timed_out(self, pendings: list, run: "_Run") -> None:
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
        raise RunTimeout(
            f"run timed out after {run.timeout} s; still running: {', '.join(f'`{n}`' for n in nodes)} "
            f"(their workers were replaced)", nodes=tuple(nodes))


class _Run:
    __slots__ = ("deadline", "timeout", "pendings")

    def __init__(self, deadline, timeout):
        self.deadline = deadline
        self.timeout = timeout
        self.pendings: list = []


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc


class _Unreachable(Exception):
    pass


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


def _default_arena(workers: int) -> int:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    return int(min(1 << 30, total // 4 // (workers + 1)))


_live_pools: "weakref.WeakSet[Local]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for pool in list(_live_pools):
        try:
            pool.close()
        except Exception:
            pass
