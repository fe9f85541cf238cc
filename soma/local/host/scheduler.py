"""Which worker runs each piece of each input, and what becomes of each input.

An input in flight is a `Flow`: it walks the program (`Seq`s and `Wave`s around
`Piece`s, see program.py and flows.py). Each piece it reaches becomes a `Job`
(one input for one piece), queued here until a worker can take it:

    start(program, x) ──▶ Flow ──walk──▶ Job(piece, encoded x) ──▶ queue
                                                                    │ pump(): a worker for each job
                                                                    ▼
                        pool.send(slot, jobs)  (one Task per worker and pump)
    listener ──▶ on_outcomes(slot, ...) ──▶ the job's continuation: the next piece (walk on), a
                                            wave's join, or the flow's end: (index, ok, value) → sink

Which worker: a worker pinned to the piece's CUDA device, if it has one; among
those, the one with the fewest jobs outstanding, preferring the worker that
already holds copies of most of the piece's nodes (their state lives there),
then the one that holds the fewest copies; a worker without a copy qualifies
only while the nodes' `copies` allow another.
A worker runs one job per piece at a time, in the order they were sent.

Everything here happens under one lock, from the callers' threads (start,
expire, cancel) and from the pool's listener (outcomes, deaths, hellos).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from ...errors import (
    Cancelled,
    NodeError,
    PostconditionError,
    RunTimeout,
    SomaError,
    WorkerDied,
)
from ...plan import Seq, last_step
from ...run.postcondition import check_postcondition
from .flows import Flow, Job, Walker
from .pool import START_FAILURES, Undecodable
from .program import Piece, output_devices

MAX_DEPTH = 64  # at most this many jobs per worker in flight when inputs are tiny (see parallelism)
EMA = 0.2


class Scheduler:
    def __init__(self, pool, worker_devices: list[str]):
        self.pool = pool
        self.worker_devices = worker_devices
        self.lock = threading.RLock()
        self.queue: deque = deque()  # jobs waiting for a worker
        self.outstanding: dict[int, Job] = {}  # job id → job sent to a worker
        self.load = [0] * len(worker_devices)  # jobs outstanding per worker (sent, or parked)
        self.lanes: dict = {}  # (slot, piece id) → that piece's jobs outstanding at that worker
        self.parked: list = [[] for _ in worker_devices]  # jobs for a worker that has not said hello yet
        self.pumping = False
        self.holders: dict[int, set] = {}  # node key → slots holding a copy
        self.held = [0] * len(worker_devices)  # copies held per worker
        self.flows: set = set()
        self.closed_with = None  # the error every flow gets once the pool is closed
        self.service_s: dict = {}  # piece id → EMA of one job's time in a worker
        self.latency_s: dict = {}  # piece id → EMA of its jobs' way to a worker and back, less their time there
        self.first_seen: set = set()  # pieces whose first job's outcome has come
        self.walker = Walker(pool.get_store, self._enqueue)

    # -- starting inputs ---------------------------------------------------------------------------------
    def start(self, program, items: list, sink, trace) -> dict:
        """Start `(index, x)` inputs on `program`; each one's `(index, ok, value)` goes to `sink` once.

        Returns index → Flow. An input that cannot even be sent (unpicklable, a tensor
        with an autograd graph, /dev/shm full) goes to the sink at once as its error.
        """
        flows = {}
        jobs: list = []
        walk, end = self.walker.walk, self._finish
        for index, x in items:
            flow = Flow(index, sink, trace, end)
            flows[index] = flow
            try:
                walk(program, x, flow, flow, jobs, {})  # the flow is its program's last continuation
            except NodeError as err:
                jobs[:] = [job for job in jobs if job.flow is not flow]  # (a wave's branches before it)
                flow.finished = True
                sink.put((index, False, err))
        with self.lock:
            if self.closed_with is not None:
                for flow in flows.values():
                    self._finish(flow, False, self.closed_with)
                return flows
            for flow in flows.values():
                if not flow.finished:
                    self.flows.add(flow)
            self._enqueue(jobs)
            self._pump()
        return flows

    def _enqueue(self, jobs: list) -> None:
        """Queue new jobs (lock held); the next pump gives them to workers."""
        self.queue.extend(jobs)
        for job in jobs:
            job.flow.jobs.add(job)

    # -- choosing workers ----------------------------------------------------------------------------------
    def _pump(self) -> None:
        """Give queued jobs to workers that can take them, one Task per worker (lock held).

        A worker still starting (a replacement) gets its share too: its jobs are parked
        until it says hello, so a wave still spreads over the pool right after a death.
        """
        if not self.queue or self.pumping:
            return
        self.pumping = True  # retiring a dead worker below reports back here: no pump inside a pump
        try:
            self._pump_queue()
        finally:
            self.pumping = False

    def _pump_queue(self) -> None:
        ready, starting, dead = self.pool.slots()
        usable = ready + starting if starting else ready
        for slot in dead:
            if self.load[slot] == 0:
                self.pool.retire(slot)  # died while idle: replace it now, nothing to drain or fail
                usable += (slot,)
                starting += (slot,)
        load = self.load
        for slot in usable:
            if load[slot] < MAX_DEPTH:
                break
        else:  # no worker (or every one full): nothing to hand out
            self._fail_unplaceable()
            return
        batches: dict[int, list] = {}
        queue, waiting = self.queue, deque()
        self.queue = waiting
        depths: dict = {}
        full: set = set()  # pieces no worker can take more of in this pump (loads only grow during it)
        for job in queue:
            if job.flow.finished:
                continue
            piece = job.piece
            if piece.id in full:
                waiting.append(job)
                continue
            depth = depths.get(piece.id)
            if depth is None:
                depth = depths[piece.id] = self.depth(piece)
            slot = self._choose(piece, usable, depth)
            if slot is None:
                full.add(piece.id)
                waiting.append(job)
                continue
            self._take(job, slot)
            batch = batches.get(slot)
            if batch is None:
                batches[slot] = [job]
            else:
                batch.append(job)
        for slot, jobs in batches.items():
            if slot in starting:
                self.parked[slot].extend(jobs)
            else:
                self._send(slot, jobs)
        if waiting:
            self._fail_unplaceable()

    def _send(self, slot: int, jobs: list) -> None:
        now = time.monotonic()
        for job in jobs:
            job.sent_at = now
            if job.traced:
                job.sent_ns = time.monotonic_ns()
        try:
            # False: it died on the way; the listener reports it, and these jobs, as WorkerDied.
            self.pool.send(slot, jobs)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            for job in jobs:
                if job.id in self.outstanding:
                    self._give_back(job)
                self._finish(job.flow, False, _internal(err, f"sending node `{job.piece.entry}` to a worker"))
        for job in jobs:
            job.keep = None  # counted as sent (or its worker is gone): the copies may go

    def _take(self, job: Job, slot: int) -> None:
        """`job` goes to the worker of `slot` (lock held)."""
        lane = (slot, job.piece.id)
        job.slot = slot
        job.behind = self.lanes.get(lane, 0)  # the piece's jobs it will wait behind there
        self.lanes[lane] = job.behind + 1
        self.load[slot] += 1
        self.outstanding[job.id] = job

    def _give_back(self, job: Job) -> None:
        """`job` is no longer at its worker (its outcome came, or the worker is gone): lock held."""
        del self.outstanding[job.id]
        lane = (job.slot, job.piece.id)
        left = self.lanes[lane] - 1
        if left:
            self.lanes[lane] = left
        else:
            del self.lanes[lane]
        self.load[job.slot] -= 1

    def _choose(self, piece: Piece, usable: list, depth: int):
        """A worker for a job of `piece`, or None: its jobs of this piece run one after another
        (a lane), so at most `depth` of them wait there; other pieces' jobs run beside them."""
        best, best_rank = None, None
        keys = piece.keys.values()
        holders = self.holders
        lanes = self.lanes
        for slot in usable:
            load = self.load[slot]
            if (load >= MAX_DEPTH or lanes.get((slot, piece.id), 0) >= depth
                    or (piece.cuda is not None and self.worker_devices[slot] != piece.cuda)):
                continue
            holds = 0
            for key in keys:
                if slot in holders.get(key, ()):
                    holds += 1
            if holds < len(keys) and piece.copies is not None and not self._may_copy(piece, slot):
                continue
            rank = (load, -holds, self.held[slot], slot)
            if best_rank is None or rank < best_rank:
                best, best_rank = slot, rank
        if best is not None:
            for key in keys:
                slots = holders.setdefault(key, set())
                if best not in slots:
                    slots.add(best)
                    self.held[best] += 1
        return best

    def _may_copy(self, piece: Piece, slot: int) -> bool:
        """Whether another copy of the piece's limited nodes may be made on `slot`."""
        return all(len(self.holders.get(key, ())) < piece.copies or slot in self.holders.get(key, ())
                   for key in piece.keys.values())

    def _fail_unplaceable(self) -> None:
        """Jobs whose only workers cannot start any more would wait forever: fail them."""
        broken = [self.pool.broken(s) for s in range(len(self.load))]
        if not any(broken):
            return
        for job in list(self.queue):
            slots = [s for s in range(len(self.load))
                     if job.piece.cuda is None or self.worker_devices[s] == job.piece.cuda]
            if all(broken[s] for s in slots):
                self.queue.remove(job)
                worker = self.pool.workers[slots[0]]
                self._end_job(job, False, WorkerDied(
                    f"no worker can run node `{job.piece.entry}`: worker {worker.id} died before it was ready "
                    f"{START_FAILURES} times in a row; its stderr says why", worker=worker.id, pid=worker.pid,
                    node=job.piece.entry))


    def depth(self, piece: Piece) -> int:
        """Jobs of `piece` worth having in flight per worker: enough that the worker runs the next ones
        while the last outcomes travel. 2 (one running, one waiting) for jobs that take longer than a
        round trip; up to MAX_DEPTH for jobs of microseconds. MAX_DEPTH until measured."""
        service = self.service_s.get(piece.id)
        latency = self.latency_s.get(piece.id)
        if service is None or latency is None:
            return MAX_DEPTH
        return max(2, min(MAX_DEPTH, int(latency / max(service, 1e-6)) + 1))

    def parallelism(self, pieces: list) -> int:
        """How many inputs of a program (its `pieces`, see pieces_of) this pool works on at once: map's
        default window is twice this.

        One per worker until its pieces are measured; then as many per worker as the slowest
        piece's depth (2 for jobs longer than the way to a worker and back: one running, one
        waiting; more for jobs of microseconds). A window of exactly one round per worker
        would leave a worker idle whenever the input the caller waits for, to keep order,
        is the slow one.
        """
        with self.lock:
            if not pieces or any(p.id not in self.service_s or p.id not in self.latency_s for p in pieces):
                return len(self.load)
            return len(self.load) * min(self.depth(p) for p in pieces)

    # -- what the listener reports ------------------------------------------------------------------------------
    def busy(self) -> bool:
        """Whether any job is queued or out at a worker (read without the lock: a hint)."""
        return bool(self.outstanding or self.queue)

    def on_ready(self, slot: int) -> None:
        with self.lock:
            parked, self.parked[slot] = self.parked[slot], []
            wanted = []
            for job in parked:
                if job.id not in self.outstanding:
                    continue
                if job.flow.finished:  # cancelled or timed out while its worker started: never sent
                    self._give_back(job)
                    job.flow.jobs.discard(job)
                    job.keep = None
                    continue
                wanted.append(job)
            if wanted:
                self._send(slot, wanted)
            self._pump()

    def on_outcomes(self, slot: int, worker, outcomes: list) -> None:
        now = time.monotonic()
        with self.lock:
            for job_id, ok, value, spans, seconds, decode in outcomes:
                job = self.outstanding.get(job_id)
                if job is None or job.slot != slot:
                    continue
                self._give_back(job)
                if type(value) is Cancelled or job.flow.finished:
                    job.flow.jobs.discard(job)
                    continue
                self._measure(job, seconds, now)
                try:
                    if spans is not None and job.flow.trace is not None:
                        self._record(job, worker, spans, decode)
                    if ok:
                        value, ok = self._arrived(job, value, worker)
                    self._end_job(job, ok, value)
                except Exception as err:  # never leave an input waiting forever on soma's own mistake
                    self._finish(job.flow, False, _internal(err, f"handling the outcome of node `{job.piece.entry}`"))
            self._pump()

    def _measure(self, job: Job, service_s: float, now: float) -> None:
        """Learn how long a piece's jobs take in a worker, and how long the way there and back takes.

        The way is measured only on jobs that found their worker idle: the time one spends
        queued behind others is not latency, and counting it would let the depth feed on itself.
        """
        piece = job.piece.id
        known = self.service_s.get(piece)
        if known is None and piece not in self.first_seen:
            self.first_seen.add(piece)  # a piece's first job loads its code and runs setup: not its pace
            return
        self.service_s[piece] = service_s if known is None else known + EMA * (service_s - known)
        if job.behind == 0:
            latency = max(0.0, now - job.sent_at - service_s)
            known = self.latency_s.get(piece)
            self.latency_s[piece] = latency if known is None else known + EMA * (latency - known)

    def _arrived(self, job: Job, value, worker):
        """The host's look at what arrived: it decoded, and the postcondition holds after the crossing."""
        piece = job.piece
        if type(value) is Undecodable:
            producer = last_step(piece.plan)
            err = value.error
            return NodeError.failed(producer, f"its output could not be received from worker {worker.id}: "
                                              f"{type(err).__name__}: {err}"), False
        if piece.devices:
            start = time.monotonic_ns() if job.traced else 0
            try:
                for node_id, declared, item in output_devices(piece.plan, piece.devices, value):
                    check_postcondition(node_id, declared, item)
            except PostconditionError as err:
                return err, False
            finally:
                if job.traced and job.flow.trace is not None:
                    tid = threading.get_native_id()
                    job.flow.trace.span("postcondition", "host", start, time.monotonic_ns(), os.getpid(), tid,
                                        {"node": last_step(piece.plan), "input": job.flow.index})
        return value, True

    def _end_job(self, job: Job, ok: bool, value) -> None:
        job.flow.jobs.discard(job)
        job.then(ok, value)

    def on_lost(self, slot: int, worker, ended: str, running: list) -> None:
        """The worker of `slot` ended: every job it held fails with WorkerDied; its copies are gone."""
        with self.lock:
            for key, slots in self.holders.items():
                if slot in slots:
                    slots.discard(slot)
            self.held[slot] = 0
            running_by_job = dict(running)
            lost = [job for job in self.outstanding.values() if job.slot == slot]
            parked = set(map(id, self.parked[slot]))
            self.parked[slot] = []
            requeued = []
            for job in lost:
                self._give_back(job)
                if job.flow.finished:
                    job.flow.jobs.discard(job)
                    continue
                if id(job) in parked:  # never sent: it goes to another worker (or this one's replacement)
                    job.slot = None
                    requeued.append(job)
                    continue
                node = running_by_job.get(job.id)
                if node is not None:
                    what = f"while running node `{node}`"
                else:
                    node = job.piece.entry
                    others = sorted(set(running_by_job.values()))
                    what = f"before it ran node `{node}`" + (
                        f" (it was running {', '.join(f'`{n}`' for n in others)} for other inputs)" if others else "")
                self._end_job(job, False, WorkerDied(
                    f"worker {worker.id} (pid {worker.pid}) {ended} {what}; the pool replaced it: run again",
                    worker=worker.id, pid=worker.pid, node=node))
            self.queue.extendleft(reversed(requeued))
            self._pump()

    # -- stopping inputs ---------------------------------------------------------------------------------------
    def expire(self, flow: Flow, timeout: float) -> RunTimeout:
        """The input's time is up: stop it, replace the workers running its nodes, and say which those were."""
        with self.lock:
            running: dict = {}  # node → where it runs
            waiting: dict = {}
            retire: set = set()
            if not flow.finished:
                for job in list(flow.jobs):
                    nodes = [] if job.slot is None else [
                        node for job_id, node in self.pool.running(job.slot) if job_id == job.id]
                    for node in nodes:
                        running[node] = f"worker {self.pool.workers[job.slot].id}"
                        retire.add(job.slot)
                    if not nodes:
                        waiting[job.piece.entry] = None
                self._finish(flow, None, None)
            for slot in sorted(retire):
                self.pool.retire(slot, "was stopped because a run timed out on it")
            self._cancel_at_workers([flow])
        return RunTimeout.after(timeout, running, list(waiting),
                                "the workers running them were replaced" if retire else None)

    def cancel(self, flows) -> None:
        """These inputs are no longer wanted: drop their queued jobs, ask workers to drop what has not started."""
        with self.lock:
            flows = [f for f in flows if not f.finished]
            for flow in flows:
                self._finish(flow, None, None)
            self._cancel_at_workers(flows)

    def _cancel_at_workers(self, flows) -> None:
        flows = set(flows)
        by_slot: dict[int, list] = {}
        for job in self.outstanding.values():
            if job.flow in flows and job not in self.parked[job.slot]:  # (parked ones are dropped at hello)
                by_slot.setdefault(job.slot, []).append(job.id)
        for slot, ids in by_slot.items():
            self.pool.cancel(slot, ids)

    def close(self, error: SomaError) -> None:
        """The pool is closing: every input in flight gets `error`."""
        with self.lock:
            self.closed_with = error
            for flow in list(self.flows):
                self._finish(flow, False, error)
            self.queue.clear()

    def _finish(self, flow: Flow, ok, value) -> None:
        """End a flow: its outcome goes to its sink (unless `ok` is None: nobody waits for it any more)."""
        if flow.finished:
            return
        flow.finished = True  # its queued jobs are dropped by the next pump
        self.flows.discard(flow)
        if flow.trace is not None and flow.index is not None:  # (a run's span is its caller's, see Local.run)
            outcome = "ok" if ok else ("cancelled" if ok is None else type(value).__name__)
            flow.trace.interval(f"input {flow.index}", "host", flow.started_ns,
                                time.monotonic_ns(), os.getpid(), f"input-{id(flow)}",
                                {"input": flow.index, "outcome": outcome})
        if ok is not None:
            flow.sink.put((flow.index, ok, value))

    def forget(self, keys: list) -> None:
        with self.lock:
            for key in keys:
                for slot in self.holders.pop(key, ()):
                    self.held[slot] -= 1

    # -- tracing ----------------------------------------------------------------------------------------
    def _record(self, job: Job, worker, spans: list, decode) -> None:
        trace = job.flow.trace
        index = job.flow.index
        trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")
        trace.node_spans(spans, worker.pid, worker.id, job.piece.devices, index)
        pid = os.getpid()
        if decode is not None:
            start, end, nbytes, tid = decode
            trace.thread(pid, tid, "listener" if tid == self.pool.listener_tid else f"thread {tid}")
            trace.span("decode output", "host", start, end, pid, tid,
                       {"node": last_step(job.piece.plan), "input": index, "bytes": nbytes})
            trace.interval(f"job {job.piece}", "host", job.sent_ns, start, pid, f"job-{job.id}",
                           {"input": index, "worker": worker.id})


def _internal(err: BaseException, doing: str) -> SomaError:
    """soma's own failure while it was `doing` something for an input: said, never a silent hang."""
    failure = SomaError(f"soma failed while {doing}: {type(err).__name__}: {err} (a bug in soma: please report it, "
                        f"with this message)")
    failure.__cause__ = err
    return failure


def pieces_of(program) -> list:
    """Every Piece of a program, in order."""
    if isinstance(program, Piece):
        return [program]
    children = program.items if isinstance(program, Seq) else program.branches
    return [piece for child in children for piece in pieces_of(child)]
