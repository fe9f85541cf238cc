"""The worker pool: processes, sockets and shared-memory leases. What runs where is the core's (core.py).

    loop ── spawn(slot) / end(worker) / find_dead()     processes: started, ended (their segments settled,
                                                        what their status page said they ran), found dead
         ── send(slot, items) / cancel(slot, ids) ─▶ Task ── ROUTER ──▶ worker   (with the code and piece
                                                                                  specs it lacks)
         ── frame() ◀── PULL ◀── Result/Hello ── worker
         ── handle(frame) → [Ready | Outcomes]          authenticated, outputs decoded (segments mapped,
                                                        leases counted)

Only the holder of the loop's lock calls it (loop.py): nothing here locks, and the
pool calls nothing above it (what happens comes back as return values and events).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import time

from ..._log import warn
from ...wire import codec, failures, protocol, transport
from ...wire.protocol import Hello, Result, Stop, Task
from ...wire.shm import pool_prefix, unlink_all
from .events import Arrived, Bundled, Gone, Outcomes, Ready, Undecodable
from .leases import HostSegments, LeaseBook
from .procs import spawn

START_FAILURES = 3  # this many deaths in a row before hello, and a slot's next start waits (BACKOFF_S, doubling)
BACKOFF_S = (0.1, 5.0)  # the first wait before such a slot is started again, and the longest


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
        self._failed_starts = [0] * len(devices)  # per slot: its workers' deaths in a row before hello
        self._how_they_ended = [None] * len(devices)  # per slot: how the last of those ended
        self._start_after = [0.0] * len(devices)  # per slot: no new worker before this (time.monotonic)
        self._book = LeaseBook(self.host_pid)
        self.segments = HostSegments(self.prefix, self.arena, self._book)
        self._results_closed = False
        self._by_pid: dict = {}  # pid → the worker process, while it is in the pool
        self._zctx = None

    # -- processes -----------------------------------------------------------------------------------
    def spawn(self, slot: int):
        """A new worker process for `slot` (OSError when the machine cannot start one now; StartDeferred while
        a slot whose workers keep dying before their hello waits)."""
        if time.monotonic() < self._start_after[slot]:
            raise StartDeferred(self._deferred_why(slot))
        worker = spawn(slot, self.devices[slot], endpoints=self.endpoints, run_dir=self.run_dir,
                       secret=self.secret, prefix=self.prefix, threads=self.threads,
                       arena=self.arena, preload_torch=self.preload_torch, max_memory=self.max_memory)
        self.workers[slot] = worker
        self._by_pid[worker.pid] = worker
        return worker

    def why_not_started(self, slot: int, err: OSError) -> str:
        """Why no worker of `slot` could be started, in words that follow "worker w1"."""
        if isinstance(err, StartDeferred):
            return str(err)
        hint = ""
        if getattr(err, "errno", None) == errno.EMFILE:
            hint = (" (this process has run out of file descriptors: close some, or raise the limit with "
                    "`ulimit -n`; the pool starts it again as soon as it can)")
        return f"could not be started again: {type(err).__name__}: {err}{hint}"

    def slots_to_start_again(self) -> list[int]:
        """Slots with no live worker whose next start may be tried now."""
        now = time.monotonic()
        return [slot for slot, worker in enumerate(self.workers)
                if not self.closing and (worker is None or worker.retired) and now >= self._start_after[slot]]

    def end(self, worker, reason: str | None = None) -> tuple:
        """A worker's end (it died, or the core retired it): killed, its segments settled. `(how it ended,
        [(job id, node id)] its status page said it ran, or None when the page could not be read)`."""
        running = worker.running()
        worker.kill()
        worker.retired = True
        self._by_pid.pop(worker.pid, None)
        ended = reason or worker.how_it_ended()
        slot = worker.slot
        if worker.ready:
            self._failed_starts[slot] = 0
        else:
            self._failed_starts[slot] += 1
            self._how_they_ended[slot] = ended
            if self._failed_starts[slot] >= START_FAILURES:
                first, longest = BACKOFF_S
                wait = min(longest, first * 2 ** (self._failed_starts[slot] - START_FAILURES))
                self._start_after[slot] = time.monotonic() + wait
        self._book.holder_gone(worker.pid)
        try:
            unlink_all(self.prefix, owner=worker.pid, keep=self._book.held_names())
        except OSError as err:  # (out of file descriptors, say: its segments are unlinked at close)
            warn("soma.local", "soma: could not unlink the segments of worker %s: %s: %s", worker.id,
                 type(err).__name__, err)
        worker.close()
        return ended, running

    def _deferred_why(self, slot: int) -> str:
        wait = max(0.0, self._start_after[slot] - time.monotonic())
        return (f"{self._how_they_ended[slot]} before it was ready, {self._failed_starts[slot]} times in a row; "
                f"soma starts it again in {wait:.1f} s")

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
        self._results.bind(self.endpoints[1])
        self._receiver = transport.Receiver(self._results)

    def send(self, slot: int, items: list):
        """Send jobs to the worker of `slot` in one Task, with the code and piece specs it lacks: True; False
        when the worker is gone (its end is found and handled); None when its connection is still completing
        (right after its hello: send again soon).

        Each item (a flows.Job, or a sending.BundleSend: several inputs in one entry) has `.piece`, `.shared`
        (segment names it lends) and `.wire()` (its JobSpec's or Bundle's fields).
        """
        self.apply_host_releases()  # so the frees this Task carries are current
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
        frees = self._book.take_frees(worker.pid) if self._book.has_frees else []
        task = Task(code, pieces, [item.wire() for item in items], frees, worker.forget)
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
        return sent_ok

    def cancel(self, slot: int, job_ids: list) -> None:
        """Ask the worker of `slot` to drop these jobs if they have not started."""
        worker = self.workers[slot]
        if not self.closing and worker is not None and not worker.retired:
            self._send(worker, protocol.pack(self.secret, protocol.Cancel(job_ids)))

    def _send(self, worker, frame: bytes):
        try:
            self._tasks.send(worker.identity, self._zmq.SNDMORE)
            self._tasks.send(frame)
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

    def frame(self, timeout_ms: int) -> bytes | None:
        """The next frame from a worker, or None when none came within `timeout_ms`."""
        return None if self._results_closed else self._receiver.wait(timeout_ms)

    def frame_now(self) -> bytes | None:
        """The next frame if one is queued now (None when none is, or none may be read any more)."""
        if self._results_closed or not self._receiver.ready():
            return None
        return self._receiver.now()

    def results_fd(self) -> int:
        """A descriptor that becomes readable when frames may have arrived (ZeroMQ's: edge-triggered)."""
        return self._results.get(self._zmq.FD)

    def close_results(self) -> None:
        """The listener lets go of the results socket for good (closing)."""
        if self._zctx is not None and not self._results_closed:
            self._results_closed = True
            self._results.close(0)

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
        self._failed_starts[worker.slot] = 0
        return [Ready(worker.slot)]

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
        return [Outcomes(worker.slot, worker, decoded, bool(result.leaving))]

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
        unlink_all(self.prefix)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- shared memory (the host's own segments: leases.HostSegments) -------------------------------------
    def get_store(self, create: bool = True):
        return self.segments.get_store(create)

    def trim_if_idle(self, busy: bool) -> None:
        self.segments.trim_if_idle(busy)

    def apply_host_releases(self) -> None:
        self.segments.apply_releases()

    def flush_frees(self) -> None:
        """Tell owners about segments nobody holds any more (otherwise they ride on the next Task)."""
        self.apply_host_releases()
        if not self._book.has_frees:
            return
        for worker in self.workers:
            if worker is None or self.closing or worker.retired or not worker.ready:
                continue
            frees = self._book.take_frees(worker.pid)
            if frees and not self._send(worker, protocol.pack(self.secret, protocol.Free(frees))):
                self._book.give_back_frees(worker.pid, frees)


class StartDeferred(OSError):
    """A slot whose workers keep ending before their hello is not started again yet (the message says when)."""


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
