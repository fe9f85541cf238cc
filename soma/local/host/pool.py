"""The worker pool: processes, sockets and shared-memory leases. What runs where is the core's (core.py).

    loop ── spawn(slot) / end(worker) / find_dead()     processes: started, ended (their segments settled,
                                                        what their status page said they ran), found dead
         ── send(slot, items) / cancel(slot, ids) ─▶ Task ── ROUTER ──▶ worker   (with the code and piece
                                                                                  specs it lacks)
         ── receiver.wait() / queued() ◀── PULL ◀── Result/Hello ── worker   (transport.Receiver)
         ── handle(frame) → [Ready | Outcomes]          authenticated, outputs decoded (segments mapped,
                                                        leases counted)

Only the holder of the loop's lock calls it (loop.py): nothing here locks, and the
pool calls nothing above it (what happens comes back as return values and events).
"""

from __future__ import annotations

import os
import tempfile
import time

from ..._log import warn
from ...wire import codec, failures, protocol, transport
from ...wire.lifeline import Lifeline, sweep
from ...wire.protocol import ChunkPart, Hello, Result, Stop, Task
from ...wire.shm import pool_prefix, unlink_all
from .events import Arrived, Gone, Outcomes, Ready, Undecodable
from .leases import HostSegments, LeaseBook
from .outcomes import bundled
from .procs import Restarts, refuse_if_loading_code, spawn


class WorkerPool:
    """Worker processes and the sockets to them."""

    def __init__(self, devices: list[str], *, arena: int, threads: int, preload_torch: bool, registry,
                 max_memory: int | None = None):
        refuse_if_loading_code()
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
        self.lifeline = Lifeline(self.prefix, self.run_dir)  # (held before any segment is made)
        sweep(self.prefix)  # what earlier pools killed at once left (soma.wire.lifeline)
        self.endpoints = (f"ipc://{self.run_dir}/tasks", f"ipc://{self.run_dir}/results")
        self.workers: list = [None] * len(devices)
        self.closing = False
        self._restarts = Restarts()  # when each slot starts its next worker (procs.py)
        self._unswept: set = set()  # pids of dead workers whose segments are still to unlink (no descriptor was free)
        self._book = LeaseBook(self.host_pid)
        self.segments = HostSegments(self.prefix, self.arena, self._book)
        self.receiver = None  # frames from the workers (transport.Receiver), once the sockets are open
        self._by_pid: dict = {}  # pid → the worker process, while it is in the pool
        self._zctx = None

    # -- processes -----------------------------------------------------------------------------------
    def spawn(self, slot: int):
        """A new worker process for `slot` (OSError when the machine cannot start one now)."""
        worker = spawn(slot, self.devices[slot], endpoints=self.endpoints, run_dir=self.run_dir,
                       secret=self.secret, prefix=self.prefix, threads=self.threads,
                       arena=self.arena, preload_torch=self.preload_torch, max_memory=self.max_memory)
        self.workers[slot] = worker
        self._by_pid[worker.pid] = worker
        return worker

    def start_due(self, slot: int | None = None, wanted: bool = False) -> list:
        """Start the next worker of each slot (or of `slot`) that has none and whose time has come (`wanted`: a
        run wants it now, so one the machine could not start is tried at once): `[(slot, its worker, or None
        when it could not be started)]`. Segments of dead workers not unlinked before are unlinked now."""
        self._sweep()
        started = []
        for due in self._restarts.due(slot, wanted):
            if self.closing:
                break
            try:
                worker = self.spawn(due)
            except OSError as err:
                if self._restarts.could_not_start(due, err):  # (said once per streak, not at every try)
                    warn("soma.local", "soma: could not start a new worker w%s: %s: %s", due, type(err).__name__,
                         err)
                started.append((due, None))
                continue
            self._restarts.started(due)
            started.append((due, worker))
        return started

    def why_down(self, slot: int) -> str | None:
        """Why no worker of `slot` can take jobs now, in words that follow "worker w1"; None when one can (or
        one is on its way, and the slot has not been given up on: procs.Restarts)."""
        worker = self.workers[slot]
        return self._restarts.why_down(slot, has_worker=worker is not None and not worker.retired)

    def end(self, worker, reason: str | None = None) -> tuple:
        """A worker's end (it died, or the core retired it): killed, its segments settled, its next start set
        (procs.Restarts: at once after a hello, after a doubling wait for one that died before). `(how it
        ended, [(job id, node id)] its status page said it ran, or None when the page could not be read)`.

        A step that needs a file descriptor (unlinking its segments) and finds none is done later: whoever
        waits for this worker's end must hear of it (a run waited forever when the host was out of them)."""
        running = worker.running()
        worker.kill()
        worker.retired = True
        self._by_pid.pop(worker.pid, None)
        ended = reason or worker.how_it_ended()
        self._book.holder_gone(worker.pid)
        self._unswept.add(worker.pid)
        self._sweep()
        try:
            worker.close()
        except OSError:
            pass  # (its status page's file stays in the run directory, removed at close)
        if not self.closing:
            self._restarts.died(worker.slot, worker.ready, worker.how_it_ended(hint=False))
        return ended, running

    def _sweep(self) -> None:
        """Unlink the segments of dead workers, but those the host still holds. Without a free file descriptor
        (to list /dev/shm) they wait for the next sweep; close() unlinks every one."""
        if not self._unswept:
            return
        keep = self._book.held_names()
        for pid in list(self._unswept):
            try:
                unlink_all(self.prefix, owner=pid, keep=keep)
            except OSError:
                return
            self._unswept.discard(pid)

    def find_dead(self) -> list:
        """Workers whose process has ended and whose end has not been handled (`end` them)."""
        return [w for w in self.workers if w is not None and not w.retired and not w.alive()]

    def worker(self, slot: int):
        """The worker process of `slot` now (its `.id`, `.pid`), or None before the first start."""
        return self.workers[slot]

    def running(self, slot: int) -> list[tuple[int, str]]:
        """`(job id, node id)` the worker of `slot` runs now, from its status page."""
        worker = self.workers[slot]
        return (worker.running() or []) if worker is not None and not worker.retired else []

    def pids(self) -> list[int]:
        """The pids of the workers running now, in slot order."""
        return [w.pid for w in self.workers if w is not None and not w.retired]

    # -- sockets ---------------------------------------------------------------------------------------
    def open_sockets(self) -> None:
        """Bind the sockets (after spawning: the workers' start-up overlaps with ours; they retry connecting)."""
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
        self._send_frame = transport.sender(self._tasks)
        self._sndmore = int(zmq.SNDMORE)
        self._results.bind(self.endpoints[1])
        self.receiver = transport.Receiver(self._results)

    def send(self, slot: int, items: list):
        """Send jobs to the worker of `slot` in one Task, with the code and piece specs it lacks: True; False
        when the worker is gone (its end is found and handled); None when its connection is still completing
        (right after its hello: send again soon).

        Each item (a flows.Job, or a sending.BundleSend: several inputs in one entry) has `.piece`, `.shared`
        (segment names it lends) and `.spec` (its JobSpec's, Bundle's or Chunk's fields, as sending.py made them).
        """
        worker = self.workers[slot]
        if self.closing or worker is None or worker.retired:
            return False
        code, pieces = {}, {}
        sent = worker.pieces
        for item in items:
            piece = item.piece
            if piece.id in sent or piece.id in pieces:
                continue  # its spec went there, and its nodes' code with it
            pieces[piece.id] = piece.spec
            for node_id, key in piece.keys.items():
                if key not in worker.loaded and key not in code:
                    code[key] = self.registry.code(node_id, key)
        held, room_s = self.segments.for_task(items)  # (first: its frees are current)
        frees = self._book.take_frees(worker.pid) if self._book.frees else []
        path = worker.path_news(self.registry.files.roots) if code else None  # (the code searches it: procs.py)
        task = Task(code, pieces, [item.spec for item in items], frees, worker.forget, held, room_s, path)
        sent_ok = self._send(worker, protocol.pack(self.secret, task))
        if not sent_ok:
            self._book.give_back_frees(worker.pid, frees)
        else:
            worker.forget = []
            for item in items:
                for name in item.shared:
                    self._book.lent(name, worker.pid)
                    self.segments.note_sent(name)
            sent.update(pieces)
            worker.loaded.update(code)
            if path is not None:
                worker.sys_path = path
        return sent_ok

    def cancel(self, slot: int, job_ids: list, give_back: bool = False) -> None:
        """Ask the worker of `slot` to drop these jobs if they have not started (`give_back`: and name them in
        its answer, at once)."""
        worker = self.workers[slot]
        if not self.closing and worker is not None and not worker.retired:
            message = protocol.GiveBack(job_ids) if give_back else protocol.Cancel(job_ids)
            self._send(worker, protocol.pack(self.secret, message))

    def _send(self, worker, frame: bytes):
        try:
            self._send_frame(worker.identity, self._sndmore)
            self._send_frame(frame)
            return True
        except self._zmq.ZMQError as err:
            # Right after HELLO the connection may still be completing; a dead worker never completes it.
            return None if err.errno == self._zmq.EHOSTUNREACH and worker.alive() else False

    def forget(self, keys: list) -> None:
        """Nodes the host let go: each worker that holds one is told with its next task."""
        for worker in self.workers:
            if worker is None:
                continue
            for key in keys:
                if key in worker.loaded:
                    worker.loaded.discard(key)
                    worker.forget.append(key)
            worker.pieces.clear()  # pieces naming those keys are gone there; the others are cheap to resend

    def results_fd(self) -> int:
        """A descriptor that becomes readable when frames may have arrived (ZeroMQ's: edge-triggered)."""
        return self._results.get(self._zmq.FD)

    def close_results(self) -> None:
        """The listener lets go of the results socket for good (closing)."""
        if self.receiver is not None:
            self.receiver.close()

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
        worker = self._by_pid.get(hello.pid)
        if worker is None or worker.id != hello.worker:
            return []
        worker.ready = True
        self._restarts.hello(worker.slot)
        return [Ready(worker.slot)]

    def _on_result(self, result: Result) -> list:
        worker = self._by_pid.get(result.pid)
        if worker is None or worker.retired:
            # A worker already retired: its outputs are dropped, but the segments they name must still
            # be counted and settled.
            worker = Gone(result.pid)
        decoded = []
        decoder = None  # (made for the first value that needs one: a lone number or string does not)
        try:
            for outcome in result.outcomes:
                if type(outcome) is ChunkPart:  # (part of) a chunk's outcomes: see host/chunks.py
                    decoder = decoder or codec.Decoder(self.get_store)
                    decoded.append(bundled(decoder, outcome.ids, outcome.said, outcome.body, outcome.seconds,
                                           outcome.spans))
                    continue
                job_id, ok, body, spans, seconds = outcome
                if type(job_id) is not int:  # a Bundle's outcomes (its ids)
                    decoder = decoder or codec.Decoder(self.get_store)
                    decoded.append(bundled(decoder, job_id, ok, body, seconds))
                    continue
                start = time.monotonic_ns() if spans is not None else 0
                shm = None  # (what the output takes of /dev/shm: weighed for ok outputs only)
                if ok:
                    try:
                        value, shm = codec.unpack_scalar(body), 0  # (nothing in /dev/shm)
                        if value is codec.NOT_SCALAR:
                            decoder = decoder or codec.Decoder(self.get_store)
                            value, shm = decoder.unpack_weighed(body)
                    except Exception as err:
                        value = Undecodable(err)
                else:
                    value = failures.error_from(body)
                decode = (start, time.monotonic_ns(), len(body) if ok else 0) if spans is not None else None
                decoded.append(Arrived(job_id, ok, value, spans, seconds, decode, shm))
        finally:
            for name in decoder.received if decoder is not None else ():
                self._book.received(name, worker.pid)
        # Releases after the values: a handle echoed back must be counted before the input's receipt drops.
        for name, n in result.releases:
            self._book.released(worker.pid, name, n)
        if self.host_pid in self._book.frees:  # the host's own segments nobody holds now go back to its store at
            self.segments.apply_releases()     # once (not at the next send or look: a worker may wait for that room)
        if isinstance(worker, Gone):
            return []
        return [Outcomes(worker.slot, worker, decoded, bool(result.leaving), result.returned)]

    # -- closing ---------------------------------------------------------------------------------------
    def stop_workers(self) -> None:
        """The first step of closing: nothing is sent after this but a STOP to each worker."""
        self.closing = True
        if self._zctx is None:
            return
        for worker in self.workers:
            if worker is None or worker.retired:
                continue
            try:
                self._tasks.send_multipart([worker.identity, protocol.pack(self.secret, Stop())],
                                           flags=self._zmq.NOBLOCK)
            except Exception:
                pass

    def close(self) -> None:
        """Stop the workers; leave no processes, segments or socket files. Mappings stay valid.

        Called after `stop_workers`, once the listener has let go of the results socket (`close_results`):
        the ZeroMQ context is ended only when every socket is closed.
        """
        self.closing = True
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
            self._tasks.close(0)
            self.close_results()
            self._zctx.term()
        self.segments.close()
        self.lifeline.end()

    # -- shared memory (the host's own segments: leases.HostSegments) -------------------------------------
    def get_store(self, create: bool = True):
        return self.segments.get_store(create)

    def trim_if_idle(self, busy: bool) -> None:
        self.segments.trim_if_idle(busy)

    def apply_host_releases(self) -> None:
        self.segments.apply_releases()

    def tell_room(self) -> None:
        """Tell every worker now what a Task says of the host's memory (`held`, `room_s`: HostSegments.for_task),
        with the frees it is owed: a Task of no jobs."""
        for slot, worker in enumerate(self.workers):
            if worker is not None and worker.ready:
                self.send(slot, [])

    def flush_frees(self) -> None:
        """Tell owners about segments nobody holds any more (otherwise they ride on the next Task)."""
        self.apply_host_releases()
        if not self._book.frees:
            return
        for worker in self.workers:
            if worker is None or self.closing or worker.retired or not worker.ready:
                continue
            frees = self._book.take_frees(worker.pid)
            if frees and not self._send(worker, protocol.pack(self.secret, protocol.Free(frees))):
                self._book.give_back_frees(worker.pid, frees)
