"""The worker pool: processes, sockets, shared-memory leases, and faults. What runs where is the scheduler's.

    scheduler ── send(slot, jobs) ─▶ Task ── ROUTER ──▶ worker    any thread, under one lock; ships
                                                                  the code and pieces that worker lacks
    receiving ── frame() ◀── PULL ◀── Result/Hello ── worker      whoever receives (receiving.py) asks
              ── handle(frame) → [Ready | Outcomes]                for frames and gets back what they
              ── find_dead() / retire(worker) → Lost               mean: outputs decoded (segments mapped,
              ── restart_due()                                    leases counted), hellos, deaths; and it
                                                                  starts the workers due (procs.Restarts)

The pool calls nothing above it: what happens comes back as events (`Ready`,
`Outcomes` of `Arrived` jobs, `Lost`), which the caller hands to the scheduler.
Sockets belong to the threads that use them: the PULL socket to whoever receives
(receiving.py keeps one such thread at a time), the ROUTER to whoever holds
`_send_lock`. Closing is a flag set under the send lock and a STOP to each worker
(`stop_workers`); the receiver closes its own socket (`close_results`), never a
context terminated under its feet.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time

from ..._log import warn
from ...errors import WorkerDied
from ...wire import codec, failures, protocol, transport
from ...wire.protocol import Hello, Result, Stop, Task
from ...wire.shm import pool_prefix, unlink_all
from .events import Arrived, Bundled, Gone, Lost, Outcomes, Ready, Undecodable
from .leases import HostSegments, LeaseBook
from .procs import Restarts, spawn

PUMP_S = 0.05  # how often the pool's state is looked at (a death nobody reported is found within this)


class WorkerPool:
    """Worker processes and the sockets to them."""

    def __init__(self, devices: list[str], *, arena: int, threads: int, preload_torch: bool, registry,
                 max_memory: int | None = None):
        self.devices = devices
        self.arena = arena
        self.threads = threads
        self.preload_torch = preload_torch
        self.registry = registry
        self.max_memory = max_memory
        self.secret = os.urandom(32)
        self.host_pid = os.getpid()
        self.prefix = pool_prefix(self.host_pid, os.urandom(4).hex())
        self.run_dir = tempfile.mkdtemp(prefix="soma-")  # 0700: only this user can reach the sockets
        os.chmod(self.run_dir, 0o700)
        self.endpoints = (f"ipc://{self.run_dir}/tasks", f"ipc://{self.run_dir}/results")
        self.workers: list = [None] * len(devices)
        self.closing = False
        self._state_lock = threading.RLock()
        self._changed = threading.Condition(self._state_lock)  # a worker said hello or died
        self._restarts = Restarts()  # when each slot starts its next worker (procs.py)
        self._unswept: set = set()  # pids of dead workers whose segments are still to unlink (no descriptor was free)
        self._book = LeaseBook(self.host_pid)
        self.segments = HostSegments(self.prefix, self.arena, self._book)
        self._send_lock = threading.Lock()
        self._results_closed = False
        self._snapshot = None  # see slots(): None when it must be taken again
        self._changes = 0
        self._by_pid: dict = {}  # pid → the worker process, while it is in the pool
        self._zctx = None

    # -- life ------------------------------------------------------------------------------------
    def start_workers(self) -> None:
        """Spawn every worker, then open the sockets.

        Workers first: their start-up (Python, imports) is the long pole, and the host's own
        (ZeroMQ, binding) overlaps with it. They retry connecting every few ms until we bind.
        """
        for slot in range(len(self.devices)):
            self._spawn(slot)
        self._open_sockets()

    def wait_ready(self, deadline: float) -> None:
        """Until every worker has said hello (someone must be receiving meanwhile); WorkerDied if one cannot."""
        with self._changed:
            for slot in range(len(self.devices)):
                while not self.workers[slot].ready.is_set():
                    if self._restarts.gave_up(slot):
                        worker = self.workers[slot]
                        raise WorkerDied(f"worker {worker.id} (pid {worker.pid}) {self._restarts.what_was_seen(slot)}",
                                         worker=worker.id, pid=worker.pid, node=None)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        worker = self.workers[slot]
                        raise WorkerDied(f"worker {worker.id} (pid {worker.pid}) did not say hello in time",
                                         worker=worker.id, pid=worker.pid, node=None)
                    self._changed.wait(min(remaining, PUMP_S))

    def _open_sockets(self) -> None:
        import zmq

        self._zmq = zmq
        self._zctx = transport.context()
        self._tasks = self._zctx.socket(zmq.ROUTER)
        self._tasks.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown worker is an error, not a silent drop
        self._tasks.setsockopt(zmq.SNDHWM, 0)
        self._tasks.setsockopt(zmq.LINGER, 0)
        self._results = self._zctx.socket(zmq.PULL)
        self._results.setsockopt(zmq.RCVHWM, 0)
        self._results.setsockopt(zmq.LINGER, 0)
        self._tasks.bind(self.endpoints[0])
        self._results.bind(self.endpoints[1])
        self._receiver = transport.Receiver(self._results)

    def _spawn(self, slot: int):
        worker = spawn(slot, self.devices[slot], endpoints=self.endpoints, run_dir=self.run_dir,
                       secret=self.secret, prefix=self.prefix, threads=self.threads,
                       arena=self.arena, preload_torch=self.preload_torch, max_memory=self.max_memory)
        self.workers[slot] = worker
        self._by_pid[worker.pid] = worker
        self._changed_slots()
        return worker

    def stop_workers(self) -> None:
        """The first step of closing: nothing is sent after this but a STOP to each worker."""
        with self._send_lock:
            self.closing = True
            if self._zctx is None:
                return
            for worker in self.workers:
                if worker is None:
                    continue
                try:
                    self._tasks.send_multipart([worker.identity, protocol.pack(self.secret, Stop())],
                                               flags=self._zmq.NOBLOCK)
                except Exception:
                    pass

    def close(self) -> None:
        """Stop the workers; leave no processes, segments or socket files. Mappings stay valid.

        Called after `stop_workers`, once whoever receives has let go of the results socket
        (`close_results`): the ZeroMQ context is ended only when every socket is closed.
        """
        self.stop_workers()
        deadline = time.monotonic() + 3.0
        workers = [w for w in self.workers if w is not None]
        for worker in workers:
            try:
                worker.proc.wait(max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
            worker.kill()
            worker.close()
        if self._zctx is not None:
            with self._send_lock:
                self._tasks.close(0)
            if self._results_closed:
                self._zctx.term()
        self.segments.close()
        unlink_all(self.prefix)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- receiving (for receiving.py: one thread at a time) ------------------------------------------
    def frame(self, timeout_ms: int) -> bytes | None:
        """The next frame from a worker, or None when none came within `timeout_ms`."""
        return self._receiver.wait(timeout_ms)

    def frame_now(self) -> bytes | None:
        """The next frame if one is queued now (None when none is, or none may be read any more)."""
        if self._results_closed or not self._receiver.ready():
            return None
        return self._receiver.now()

    def results_fd(self) -> int:
        """A descriptor that becomes readable when frames may have arrived (ZeroMQ's: edge-triggered)."""
        return self._results.get(self._zmq.FD)

    def close_results(self) -> None:
        """The receiving thread lets go of the results socket for good (closing)."""
        self._results_closed = True
        self._results.close(0)

    # -- what the scheduler asks ------------------------------------------------------------------
    def slots(self) -> tuple:
        """`(ready, starting, dead)`: the slots in each state, for the scheduler's every pump.

        A snapshot, taken again after any hello, death or start, and at least every
        PUMP_S / 10 (a death nobody has noticed yet is found within that).
        """
        snapshot = self._snapshot
        if snapshot is None or time.monotonic() - snapshot[3] > PUMP_S / 10:
            changes = self._changes
            by_state: dict = {"ready": [], "starting": [], "dead": []}
            for slot in range(len(self.workers)):
                by_state[self.state(slot)].append(slot)
            # Tuples: the snapshot is shared by every pump until the next change.
            snapshot = (tuple(by_state["ready"]), tuple(by_state["starting"]), tuple(by_state["dead"]),
                        time.monotonic())
            # Kept only when every worker is ready (one starting or dead is asked about every time) and
            # nothing changed while it was taken (a hello or a death on the listener meanwhile).
            if not snapshot[1] and not snapshot[2]:
                with self._state_lock:  # (the lock every change is made under)
                    if changes == self._changes:
                        self._snapshot = snapshot
        return snapshot[0], snapshot[1], snapshot[2]

    def _changed_slots(self) -> None:
        """A worker started, said hello or died: the next `slots()` looks again."""
        self._changes += 1
        self._snapshot = None

    def state(self, slot: int) -> str:
        """"ready", "starting" (spawned, no hello yet), or "dead" (not yet retired, or waiting to start again)."""
        worker = self.workers[slot]
        if worker is None or worker.retired or not worker.alive(recheck_s=PUMP_S / 10):
            return "dead"
        # A leaving worker counts as starting: jobs for its slot are parked for the replacement, not sent to
        # a process that would only answer them Cancelled again until it is idle enough to exit.
        return "ready" if worker.ready.is_set() and not worker.leaving else "starting"

    def leaving(self, slot: int) -> None:
        """The worker of `slot` said it went over max_memory: it takes nothing more (`retire` it once idle)."""
        worker = self.workers[slot]
        if worker is not None and not worker.leaving:
            with self._state_lock:
                worker.leaving = True
                self._changed_slots()

    def why_down(self, slot: int) -> str | None:
        """Why no worker of `slot` can take jobs now, in words that follow "worker w1"; None when one can (or
        one is on its way, and the slot has not been given up on: procs.Restarts)."""
        worker = self.workers[slot]
        return self._restarts.why_down(slot, has_worker=worker is not None and not worker.retired)

    def worker_starting(self, slot: int) -> bool:
        """Whether the slot has a worker on its way (spawned, no hello yet)."""
        worker = self.workers[slot]
        return worker is not None and not worker.retired and not worker.ready.is_set()

    def send(self, slot: int, jobs: list) -> bool:
        """Send jobs to the worker of `slot` in one Task, with the code and piece specs it lacks.

        Each job (a flows.Job, or a flows.BundleSend: several inputs in one entry) has `.piece`
        (a Piece), `.shared` (segment names it lends) and `.wire()` (its JobSpec's or Bundle's
        fields). False when the worker cannot be reached (the listener reports its death).
        """
        self.apply_host_releases()  # so the frees this Task carries are current
        with self._send_lock:
            worker = self.workers[slot]
            # Not ready: the worker the scheduler chose died since, and this is its replacement, still
            # starting (the scheduler parks jobs for those): the death's report fails these jobs.
            if self.closing or worker is None or worker.retired or not worker.ready.is_set():
                return False
            code, pieces = {}, {}
            sent = worker.pieces
            for job in jobs:
                piece = job.piece
                if piece.id in sent or piece.id in pieces:
                    continue  # its spec went there, and its nodes' code with it
                pieces[piece.id] = piece.spec
                for node_id, key in piece.keys.items():
                    if key not in worker.loaded and key not in code:
                        code[key] = self.registry.code(node_id, key)
            forget = worker.forget
            if forget:
                worker.forget = []
            for job in jobs:
                for name in job.shared:
                    self._book.lent(name, worker.pid)
                    self.segments.note_sent(name)
            task = Task(code, pieces, [u.wire() for u in jobs],  # JobSpecs and Bundles, packed
                        self._book.take_frees(worker.pid), forget)
            if not self._send(worker, protocol.pack(self.secret, task)):
                return False
            if pieces:
                sent.update(pieces)
                worker.loaded.update(code)
            return True

    def cancel(self, slot: int, job_ids: list) -> None:
        """Ask the worker of `slot` to drop these jobs if they have not started."""
        with self._send_lock:
            worker = self.workers[slot]
            if not self.closing and worker is not None and not worker.retired:
                self._send(worker, protocol.pack(self.secret, protocol.Cancel(job_ids)))

    def _send(self, worker, frame: bytes, retry_s: float = 5.0) -> bool:
        # send lock held
        deadline = time.monotonic() + retry_s
        while True:
            try:
                self._tasks.send(worker.identity, self._zmq.SNDMORE)
                self._tasks.send(frame)
                return True
            except self._zmq.ZMQError as err:
                # Right after HELLO the connection may still be completing; a dead worker never completes it.
                if err.errno != self._zmq.EHOSTUNREACH or time.monotonic() > deadline or not worker.alive():
                    return False
                time.sleep(0.001)

    def forget(self, keys: list) -> None:
        """Nodes the host let go: each worker that holds one is told with its next task."""
        with self._send_lock:
            for worker in self.workers:
                if worker is None:
                    continue
                for key in keys:
                    if key in worker.loaded:
                        worker.loaded.discard(key)
                        worker.forget.append(key)
                worker.pieces.clear()  # pieces naming those keys are gone there; the others are cheap to resend

    def running(self, slot: int) -> list[tuple[int, str]]:
        """`(job id, node id)` the worker of `slot` runs now, from its status page."""
        worker = self.workers[slot]
        return (worker.running() or []) if worker is not None else []

    def worker(self, slot: int):
        """The worker process of `slot` now (its `.id`, `.pid`), or None before the first start."""
        return self.workers[slot]

    def pids(self) -> list[int]:
        """The pids of the workers running now, in slot order."""
        return [w.pid for w in self.workers if w is not None and not w.retired]

    def handle(self, frame: bytes) -> list:
        """What a frame from a worker means: `[Ready]`, `[Outcomes]`, or nothing (dropped, and logged)."""
        message = protocol.parse(self.secret, frame, "a worker")
        if message is None:
            return []
        try:
            if isinstance(message, Result):
                return self._on_result(message)
            if isinstance(message, Hello):
                return self._on_hello(message)
            warn("soma.local", "soma: dropped a %s message a worker should not send", type(message).__name__)
        except Exception as err:  # authentic but malformed: drop it, never let it take the pool down
            warn("soma.local", "soma: dropped a malformed %s message from worker pid %s: %s: %s",
                 type(message).__name__, getattr(message, "pid", "?"), type(err).__name__, err)
        return []

    def _on_hello(self, hello: Hello) -> list:
        for worker in self.workers:
            if worker is not None and worker.id == hello.worker and worker.pid == hello.pid:
                with self._changed:
                    worker.ready.set()
                    self._restarts.hello(worker.slot)
                    self._changed_slots()
                    self._changed.notify_all()
                return [Ready(worker.slot)]
        return []

    def _on_result(self, result: Result) -> list:
        worker = self._by_pid.get(result.pid)
        if worker is None or worker.retired:
            # A worker already retired: its outputs are dropped, but the segments they name must still
            # be counted and settled.
            worker = Gone(result.pid)
        decoded = []
        decoder = codec.Decoder(self.get_store)
        try:
            for job_id, ok, body, spans, seconds in result.outcomes:
                if type(job_id) is list:  # a Bundle's outcomes
                    decoded.append(_bundled(decoder, job_id, ok, body, seconds))
                    continue
                start = time.monotonic_ns() if spans is not None else 0
                if ok:
                    try:
                        value = decoder.unpack(body)
                    except Exception as err:
                        value = Undecodable(err)
                else:
                    value = failures.error_from(body)
                decode = (start, time.monotonic_ns(), len(body) if ok else 0) if spans is not None else None
                decoded.append(Arrived(job_id, ok, value, spans, seconds, decode))
        finally:
            for name in decoder.received:
                self._book.received(name, worker.pid)
        # Releases after the values: a handle echoed back must be counted before the input's receipt drops.
        for name, n in result.releases:
            self._book.released(worker.pid, name, n)
        if isinstance(worker, Gone):
            return []
        if result.leaving:
            self.leaving(worker.slot)
        return [Outcomes(worker.slot, worker, decoded)]

    # -- shared memory (the host's own segments: leases.HostSegments) -------------------------------------
    def get_store(self, create: bool = True):
        return self.segments.get_store(create)

    def trim_if_idle(self, busy: bool) -> None:
        self.segments.trim_if_idle(busy)

    def apply_host_releases(self) -> None:
        self.segments.apply_releases()

    def flush_frees(self) -> None:
        """Tell owners about segments nobody holds any more (otherwise they ride on the next Task)."""
        if not self._book.has_frees:
            return
        with self._send_lock:
            for worker in self.workers:
                if worker is None or self.closing or worker.retired or not worker.ready.is_set():
                    continue
                frees = self._book.take_frees(worker.pid)
                if frees:
                    self._send(worker, protocol.pack(self.secret, protocol.Free(frees)), retry_s=0.0)

    # -- faults ----------------------------------------------------------------------------------------
    def find_dead(self) -> list:
        """Workers whose process has ended and whose end has not been handled (`retire` them)."""
        return [w for w in list(self.workers) if w is not None and not w.retired and not w.alive()]

    def retire(self, slot: int, reason: str | None = None):
        """Kill and replace the worker of `slot` (it died, or a run timed out on it): the `Lost` it leaves,
        or None when its end was handled already (then a replacement that is due is started: restart_due; one
        that could not be started is tried at once, for a run wants it)."""
        worker = self.workers[slot]
        if worker is None:
            return None
        if worker.retired:
            self.restart_due(slot, wanted=True)
            return None
        return self.retire_worker(worker, reason)

    def retire_worker(self, worker, reason: str | None = None):
        """A worker's end: settle its segments, start its replacement, and say what it held (`Lost`).

        Always returns the `Lost` once the worker is marked retired: a step that needs a file
        descriptor (unlinking its segments, starting the next worker) and finds none is done
        later, for a run waiting on this worker waits for this Lost (before Dec 3 it waited
        forever when the host was out of descriptors).
        """
        slot = worker.slot
        with self._changed:
            if worker.retired:
                return None
            running = worker.running()  # (None when its page cannot be read: then nobody knows)
            worker.kill()
            worker.retired = True
            self._changed_slots()
            self._by_pid.pop(worker.pid, None)
            ended = reason or worker.how_it_ended()
            self._book.holder_gone(worker.pid)
            self._unswept.add(worker.pid)
            self._sweep()
            try:
                worker.close()
            except OSError:
                pass  # (its status page's file stays in the run directory, removed at close)
            if not self.closing:  # (one that died before its hello starts again after a wait: procs.Restarts)
                self._restarts.died(slot, worker.ready.is_set(), worker.how_it_ended(hint=False))
                self.restart_due(slot)
            self._changed.notify_all()
        return Lost(slot, worker, ended, running)

    def restart_due(self, slot: int | None = None, wanted: bool = False) -> None:
        """Start the next worker of each slot (or of `slot`) that has none and whose time has come (`wanted`: a
        run wants it now, so one the machine could not start is tried at once); segments of dead workers that
        could not be unlinked before are unlinked now. Whoever looks at the workers calls it (receiving.py,
        every PUMP_S; the scheduler, for a slot it would use)."""
        if not self._restarts.at and not self._unswept:
            return
        with self._changed:
            self._sweep()
            for due in self._restarts.due(slot, wanted):
                if not self.closing:
                    self._respawn(due)

    def _respawn(self, slot: int) -> None:
        """A new worker for `slot`; when the machine cannot start one now (no file descriptors, no memory)
        the reason is kept (`why_down`) and it is tried again soon (lock held)."""
        try:
            self._spawn(slot)
        except OSError as err:
            if self._restarts.could_not_start(slot, err):  # (said once per streak, not at every try)
                warn("soma.local", "soma: could not start a new worker w%s: %s: %s", slot, type(err).__name__, err)
            return
        self._restarts.started(slot)

    def _sweep(self) -> None:
        """Unlink the segments of dead workers, but those the host still holds (lock held). Without a free
        file descriptor (to list /dev/shm) they wait for the next sweep; close() unlinks every one."""
        keep = self._book.held_names() if self._unswept else None
        for pid in list(self._unswept):
            try:
                unlink_all(self.prefix, owner=pid, keep=keep)
            except OSError:
                return
            self._unswept.discard(pid)


def _bundled(decoder, ids: list, said: list, body, seconds: float) -> Bundled:
    """A Bundle's outcomes: `said[i]` is True (its output is the next one of the list `body` decodes to),
    bytes (its output, encoded alone: the worker could not encode the list), or an error body. A list that
    cannot be decoded leaves every output in it Undecodable."""
    listed = sum(answer is True for answer in said)
    shared: list = []
    if listed:
        try:
            shared = decoder.unpack(body)
            if type(shared) is not list or len(shared) != listed:
                raise ValueError(f"a bundle's outputs decoded to {type(shared).__name__} of "
                                 f"{len(shared) if type(shared) is list else '?'} values, not {listed}")
        except Exception as err:
            shared = [Undecodable(err)] * listed
    if listed == len(ids):  # (the common case: every input ran ok)
        return Bundled(ids, [True] * listed, shared, seconds)
    oks, values, listed_values = [], [], iter(shared)
    for answer in said:
        if answer is True:
            oks.append(True)
            values.append(next(listed_values))
        elif type(answer) is bytes:
            try:
                value = decoder.unpack(answer)
            except Exception as err:
                value = Undecodable(err)
            oks.append(True)
            values.append(value)
        else:
            oks.append(False)
            values.append(failures.error_from(answer))
    return Bundled(ids, oks, values, seconds)
