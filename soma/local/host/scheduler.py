"""What becomes of each input: its flow, its jobs, the queue, and what the workers' answers mean.

An input in flight is a `Flow`: it walks the program (`Seq`s and `Wave`s around
`Piece`s, see program.py and flows.py). Each piece it reaches becomes a `Job`
(one input for one piece), queued here until a worker can take it:

    start(program, x) ──▶ Flow ── walker.start ──▶ Job(piece, encoded x) ──▶ waiting (a line per piece)
                                                                              │ _pump: a worker for each
                                                                              ▼ job (choice.py)
                        pool.send(slot, jobs)  (one Task per worker and pump; a batching node alone's
                                                jobs encoded together there, in Bundles: _wire_items)
    receiving ── handle([Outcomes | Ready | Lost]) ──▶ each job's continuation: the jobs it makes next
                                                      (queued), or its flow's end: (index, ok, value) → sink

Everything here happens under one lock (`locked`), from the callers' threads
(start, expire, cancel) and from whoever receives (handle). A caller starting
inputs does not wait for it: what it started is taken in by whoever holds the
lock before letting go (`_take_in`). Calls go down to the pool and its answers
come back as return values; nothing here is called back by it.
"""

from __future__ import annotations

import contextlib
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
from ...plan import last_step
from ...run.postcondition import check_postcondition
from .choice import GATHER_SENDS, WorkerChoice
from .events import Bundled, Lost, Outcomes, Ready, Undecodable
from .flows import Flow, Job, SendCount, Walker, entries
from .program import pieces
from .sending import BundleSend, encode
from .waiting import Waiting

LEFT_OVER_MEMORY = "went over max_memory after an input, and was replaced"

class Scheduler:
    def __init__(self, pool, worker_devices: list[str], tracer=None):
        self.pool = pool
        self.tracer = tracer  # whose open trace block (`current_trace`), if any, a worker's start is shown in
        self.worker_devices = worker_devices
        self.lock = threading.RLock()
        self.choice = WorkerChoice(worker_devices)
        self.waiting = Waiting()  # jobs waiting for a worker, a line per piece
        self.outstanding: dict[int, Job] = {}  # job id → job sent to a worker (or parked for one)
        self.parked: list = [[] for _ in worker_devices]  # jobs for a worker that has not said hello yet
        self.flows: set = set()
        self.closed_with = None  # the error every flow gets once the pool is closed
        self.walker = Walker()
        self.get_store = pool.get_store
        self.admitted: set = set()  # programs whose pieces the choice knows (WorkerChoice.admit)
        self.arrivals: deque = deque()  # (program, flows, jobs) started and not yet taken in (_take_in)
        self.forgotten: deque = deque()  # node keys let go and not yet taken in (forget)

    # -- starting inputs ---------------------------------------------------------------------------------
    def start(self, program, items: list, sink, trace, retries: int = 0, graph=None) -> dict:
        """Start `(index, x)` inputs on `program` (of `graph`, held while they are in flight); each one's
        `(index, ok, value)` goes to `sink` once.

        Returns index → Flow. An input that cannot even be sent (unpicklable, a tensor
        with an autograd graph, /dev/shm full) goes to the sink at once as its error.
        `retries`: tries each input gets beyond the first when a worker dies while running it.
        """
        flows = {}
        jobs: list = []
        for index, x in items:
            flow = Flow(index, sink, trace, program, x, retries, graph)
            flows[index] = flow
            jobs += self.walker.start(flow, x)
        self.arrivals.append((program, flows, jobs))
        self._take_in()
        return flows

    def _take_in(self) -> None:
        """Take in the inputs started meanwhile, unless another thread holds the lock: it takes them in itself
        before it lets go (`locked`). A caller never sleeps on the lock to start an input (64 threads calling
        `run` queued on it behind the thread receiving a bundle's outcomes and sending the next)."""
        while self.arrivals or self.forgotten:
            if not self.lock.acquire(blocking=False):
                return
            try:
                self._take_started()
            finally:
                self.lock.release()

    def _take_started(self, pump: bool = True) -> bool:
        """The nodes let go meanwhile forgotten; the started inputs, in the order they came: their flows known,
        their jobs queued, and (`pump`) a pump. Whether any input was taken in (lock held)."""
        while self.forgotten:
            self.choice.forget(self.forgotten.popleft())
        if not self.arrivals:
            return False
        while self.arrivals:
            program, flows, jobs = self.arrivals.popleft()
            if self.closed_with is not None:
                for flow in flows.values():
                    self._finish(flow, False, self.closed_with)
                continue
            for flow in flows.values():
                if not flow.finished:
                    self.flows.add(flow)
            if program not in self.admitted:
                self.admitted.add(program)
                self.choice.admit(pieces(program))
            self._enqueue(jobs)
        if pump:
            self._pump()
        return True

    @contextlib.contextmanager
    def locked(self):
        """The lock, held by this thread, with every input started before it taken in (a cancel or a timeout
        sees their jobs); before it lets go, the inputs started meanwhile are taken in too (their callers did
        not wait for the lock: `_take_in`), and after, any that came between that and the release."""
        with self.lock:
            took = self._take_started(pump=False)  # (queued now, pumped once on the way out)
            try:
                yield
            finally:
                if not self._take_started() and took:
                    self._pump()
        if self.arrivals or self.forgotten:
            self._take_in()

    def _enqueue(self, jobs: list) -> None:
        """Queue new jobs (lock held); the next pump gives them to workers."""
        self.waiting.add(jobs)
        for job in jobs:
            job.flow.jobs.add(job)

    # -- giving jobs to workers ---------------------------------------------------------------------------
    def _pump(self) -> None:
        """Give queued jobs to workers that can take them, one Task per worker (lock held).

        A worker still starting (a replacement) gets its share too: its jobs are parked
        until it says hello, so a wave still spreads over the pool right after a death.
        """
        if not self.waiting:
            return
        usable, starting = self._usable_slots()
        if not self.choice.has_room(usable):  # no worker (or every one full): nothing to hand out
            self._fail_unplaceable()
            return
        batches: dict[int, list] = {}
        for piece, line in self.waiting.snapshot():
            self._place_line(piece, line, usable, batches)
            self.waiting.settle(piece)
        for slot, jobs in batches.items():
            if slot in starting:
                self.parked[slot].extend(jobs)
            else:
                self._send(slot, jobs)
        if self.waiting:
            self._fail_unplaceable()

    def _usable_slots(self) -> tuple:
        """`(slots that may take jobs, those of them still starting)`. A worker found dead while idle is
        replaced here and now (nothing to drain or fail): its replacement is one of the starting."""
        ready, starting, dead = self.pool.slots()
        usable = ready + starting if starting else ready
        for slot in dead:
            if self.choice.load[slot] == 0:
                lost = self.pool.retire(slot)
                if lost is not None:
                    self._lost(lost)
                if self.pool.worker_starting(slot):
                    usable += (slot,)
                    starting += (slot,)
        return usable, starting

    def _place_line(self, piece, line, usable, batches: dict) -> None:
        """Give `piece`'s waiting jobs to workers from the front of its line, each counted as taken, into
        `batches` (slot → jobs), until no worker takes the next: then none takes the ones behind it in this
        pump (loads only grow during it), and they wait unlooked at (a stale one among them is dropped once its
        piece has room again).

        A batching node alone's jobs fill a bundle at one worker before the next worker is chosen (a bundle of
        the waiting jobs' share of the workers that can take them, up to max_batch: _gather): consecutive
        inputs travel and come back together (an ordered map hands out a bundle's outputs as soon as the
        bundles before it are back; spread input by input over the workers, each bundle's outputs waited for
        the slowest worker's), and a bundle costs one choice, not one per input."""
        choice, stale = self.choice, self.walker.stale
        depth = choice.depth(piece)
        workers = len(usable) if piece.cuda is None else len(set(usable).intersection(choice.serving(piece)))
        gather, size = _gather(piece, self.waiting.waiting(piece), workers)
        filling, filled = None, 0  # the slot a bundle fills now, and how many it has
        while line:
            job = line[0]
            if stale(job):
                line.popleft()
                continue
            bundled = piece.bundle and not job.traced
            if bundled and filling is not None and filled < size and choice.fits(piece, filling, depth):
                slot = filling
                filled += 1
            else:
                slot = choice.choose(piece, usable, depth, gather if bundled else 0)
                if slot is None:
                    return
                if bundled:
                    filling, filled = slot, 1
            line.popleft()
            choice.take(job, slot)
            self.outstanding[job.id] = job
            batches.setdefault(slot, []).append(job)

    def _send(self, slot: int, jobs: list) -> None:
        now = time.monotonic()
        for job in jobs:
            job.sent_at = now
            if job.traced:
                job.sent_ns = time.monotonic_ns()
        try:
            items = self._wire_items(slot, jobs)
            # False: it died on the way; whoever receives finds it dead, and these jobs fail as WorkerDied.
            if items:
                self.pool.send(slot, items)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            for job in jobs:
                if job.id in self.outstanding:
                    self._give_back(job)
                self._finish(job.flow, False, _internal(err, f"sending node `{job.piece.entry}` to a worker"))

    def _wire_items(self, slot: int, jobs: list) -> list:
        """What the jobs going to one worker travel as (flows.entries, encoded by sending.encode); an input
        that cannot be encoded fails alone, here (lock held)."""
        items, failed = encode(self.get_store, entries(jobs))
        for job, err in failed:
            self._give_back(job)
            self._end_job(job, False, err)
        for item in items:  # a batching node alone's sends are counted at their worker (WorkerChoice.choose)
            members = item.jobs if type(item) is BundleSend else [item]
            if item.piece.bundle and not members[0].traced:
                count = SendCount(slot, item.piece.id, len(members))
                for job in members:
                    job.send = count
                self.choice.sent(slot, item.piece.id)
        return items

    def _give_back(self, job: Job) -> None:
        """`job` is no longer at its worker (its outcome came, or the worker is gone): lock held."""
        del self.outstanding[job.id]
        self.choice.give_back(job)
        send = job.send
        if send is not None:
            job.send = None
            send.left -= 1
            if not send.left:
                self.choice.send_over(send.slot, send.piece_id)

    def _fail_unplaceable(self) -> None:
        """Jobs whose only workers cannot start (now, or any more) would wait forever: fail them, saying why."""
        why = [self.pool.why_down(s) for s in range(len(self.worker_devices))]
        if not any(why):
            return
        for piece, _ in self.waiting.snapshot():
            slots = self.choice.serving(piece)
            if not all(why[s] for s in slots):
                continue
            worker = self.pool.worker(slots[0])
            for job in self.waiting.take(piece):
                if self.walker.stale(job):
                    continue
                self._end_job(job, False, WorkerDied(
                    f"no worker can run node `{piece.entry}`: worker {worker.id} {why[slots[0]]}",
                    worker=worker.id, pid=worker.pid, node=piece.entry, tries=job.flow.tries))

    def parallelism(self, pieces: list) -> int:
        """How many inputs of a program this pool works on at once (see WorkerChoice.parallelism)."""
        with self.locked():
            return self.choice.parallelism(pieces)

    # -- what whoever receives hands over ----------------------------------------------------------------
    def busy(self) -> bool:
        """Whether any job is queued or out at a worker (read without the lock: a hint)."""
        return bool(self.outstanding or self.waiting)

    def handle(self, events: list) -> None:
        """What the pool reported: a worker's hello (`Ready`), outcomes of jobs, or a worker's end (`Lost`)."""
        if not events:
            return
        with self.locked():
            for event in events:
                if type(event) is Outcomes:
                    self._on_outcomes(event)
                elif type(event) is Ready:
                    self._on_ready(event.slot)
                else:
                    self._lost(event)
            self._pump()

    def _on_ready(self, slot: int) -> None:
        trace = self.tracer.current_trace if self.tracer is not None else None
        if trace is not None:  # a worker started inside a trace block: its start (imports, connecting) is a span
            worker = self.pool.worker(slot)
            trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")
            trace.thread(worker.pid, 0, "start")
            trace.span(f"start worker {worker.id}", "start", worker.spawned_ns, time.monotonic_ns(), worker.pid, 0,
                       {"worker": worker.id})
        parked, self.parked[slot] = self.parked[slot], []
        wanted = []
        for job in parked:
            if job.id not in self.outstanding:
                continue
            if self.walker.stale(job):  # cancelled, timed out or tried again while its worker started: never sent
                self._give_back(job)
                job.flow.jobs.discard(job)
                job.keep = None
                continue
            wanted.append(job)
        if wanted:
            self._send(slot, wanted)

    def _on_outcomes(self, outcomes: Outcomes) -> None:
        now = time.monotonic()
        slot, worker = outcomes.slot, outcomes.worker
        for arrived in outcomes.arrived:
            if type(arrived) is Bundled:  # a bundle's jobs: one call, so one measure of its time for them all
                measured = False
                for job_id, ok, value in zip(arrived.jobs, arrived.oks, arrived.values):
                    job = self._returned(job_id, slot, value)
                    if job is None:
                        continue
                    if not measured:
                        self.choice.measure(job, arrived.seconds, now)
                        measured = True
                    self._arrived(job, ok, value, worker, None)
                continue
            job = self._returned(arrived.job, slot, arrived.value)
            if job is not None:
                self.choice.measure(job, arrived.seconds, now)
                self._arrived(job, arrived.ok, arrived.value, worker, arrived if arrived.spans is not None else None)
        if worker.leaving:
            self._replace_once_idle(slot)

    def _returned(self, job_id: int, slot: int, value):
        """The job whose outcome (`value`) came back from `slot`, no longer out there; None when there is no
        more to do with it: unknown (or not this worker's), stale, or handed back unstarted (Cancelled, by a
        worker leaving over max_memory: it waits again, to run elsewhere)."""
        job = self.outstanding.get(job_id)
        if job is None or job.slot != slot:
            return None
        self._give_back(job)
        if self.walker.stale(job):
            job.flow.jobs.discard(job)
            return None
        if type(value) is Cancelled:
            job.slot = None
            self.waiting.add([job])
            return None
        return job

    def _arrived(self, job: Job, ok: bool, value, worker, traced) -> None:
        """A job's outcome, checked, carried on (`traced`: its Arrived, when it brought spans)."""
        try:
            if traced is not None and job.flow.trace is not None:
                self._record(job, worker, traced)
            if ok:
                value, ok = self._checked(job, value, worker)
            self._end_job(job, ok, value)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            self._finish(job.flow, False, _internal(err, f"handling the outcome of node `{job.piece.entry}`"))

    def _replace_once_idle(self, slot: int) -> None:
        """A worker over max_memory is replaced once every job sent to it has come back (its jobs parked for
        it meanwhile go to its replacement): nothing it sent is lost on the way, and nothing it held runs twice."""
        parked = set(map(id, self.parked[slot]))
        if any(job.slot == slot and id(job) not in parked for job in self.outstanding.values()):
            return
        lost = self.pool.retire(slot, LEFT_OVER_MEMORY)
        if lost is not None:
            self._lost(lost)

    def _checked(self, job: Job, value, worker):
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
                for node_id, declared, item in piece.checked_outputs(value):
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
        """The job is over: its continuation makes the next jobs, or the flow's outcome (lock held)."""
        flow = job.flow
        flow.jobs.discard(job)
        made = job.then(ok, value)
        if made:
            self._enqueue(made)
        if flow.outcome is not None:
            self._finish(flow, *flow.outcome)

    def _lost(self, lost: Lost) -> None:
        """The worker of `lost.slot` ended; its copies are gone (lock held; the caller pumps).

        A job it had not started (parked for it, or sent and not yet begun, as its status page
        says) is innocent: it goes back to the queue, no try counted. A job it was running is
        lost: its input runs again from the start if it has tries left, else fails (WorkerDied).
        """
        slot = lost.slot
        self.choice.slot_lost(slot)
        running = dict(lost.running) if lost.running is not None else None  # None: its page could not be read
        jobs = [job for job in self.outstanding.values() if job.slot == slot]
        parked = set(map(id, self.parked[slot]))
        self.parked[slot] = []
        requeued = []
        for job in jobs:
            self._give_back(job)
            if self.walker.stale(job):
                job.flow.jobs.discard(job)
                continue
            started = id(job) not in parked and (running is None or job.id in running)
            if not started:
                job.slot = None
                requeued.append(job)
                continue
            node = running.get(job.id, job.piece.entry) if running is not None else job.piece.entry
            self._lost_running(job, lost, node)
        self.waiting.add_first(requeued)

    def _lost_running(self, job: Job, lost: Lost, node: str) -> None:
        """A worker died while running `job`: another try of its input, or its WorkerDied."""
        flow, worker = job.flow, lost.worker
        if flow.tries <= flow.retries:
            self._try_again(flow)
            return
        then = "run again, or pass retries=N" if not flow.retries else (
            f"{flow.tries} tries, each lost to a dead worker (retries={flow.retries})")
        down = self.pool.why_down(lost.slot)
        replaced = "the pool replaced it" if down is None else f"a new worker {down}"
        self._end_job(job, False, WorkerDied(
            f"worker {worker.id} (pid {worker.pid}) {lost.ended} while running node `{node}`; {replaced}: {then}",
            worker=worker.id, pid=worker.pid, node=node, tries=flow.tries))

    def _try_again(self, flow: Flow) -> None:
        """Run the input again from the program's start; what is left of its last try is dropped."""
        stale = list(flow.jobs)
        flow.jobs.clear()
        flow.tries += 1
        self._cancel_jobs([job for job in stale if job.id in self.outstanding])
        self._enqueue(self.walker.start(flow, flow.x))

    # -- stopping inputs ---------------------------------------------------------------------------------------
    def expire(self, flow: Flow, timeout: float) -> RunTimeout:
        """The input's time is up: stop it, replace the workers running its nodes, and say which those were."""
        with self.locked():
            running: dict = {}  # node → where it runs
            waiting: dict = {}
            retire: set = set()
            if not flow.finished:
                for job in list(flow.jobs):
                    nodes = [] if job.slot is None else [
                        node for job_id, node in self.pool.running(job.slot) if job_id == job.id]
                    for node in nodes:
                        running[node] = f"worker {self.pool.worker(job.slot).id}"
                        retire.add(job.slot)
                    if not nodes:
                        waiting[job.piece.entry] = None
                self._finish(flow, None, None)
            for slot in sorted(retire):
                lost = self.pool.retire(slot, "was stopped because a run timed out on it")
                if lost is not None:
                    self._lost(lost)
            self._cancel_at_workers([flow])
            self._pump()
        return RunTimeout.after(timeout, running, list(waiting),
                                "the workers running them were replaced" if retire else None)

    def cancel(self, flows) -> None:
        """These inputs are no longer wanted: drop their queued jobs, ask workers to drop what has not started."""
        with self.locked():
            flows = [f for f in flows if not f.finished]
            for flow in flows:
                self._finish(flow, None, None)
            self._cancel_at_workers(flows)

    def _cancel_at_workers(self, flows) -> None:
        flows = set(flows)
        self._cancel_jobs([job for job in self.outstanding.values() if job.flow in flows])

    def _cancel_jobs(self, jobs: list) -> None:
        """Ask workers to drop these jobs unless they have started (their outcomes come back and are dropped)."""
        by_slot: dict[int, list] = {}
        for job in jobs:
            if job not in self.parked[job.slot]:  # (parked ones are dropped at hello)
                by_slot.setdefault(job.slot, []).append(job.id)
        for slot, ids in by_slot.items():
            self.pool.cancel(slot, ids)

    def close(self, error: SomaError) -> None:
        """The pool is closing: every input in flight gets `error`."""
        with self.locked():
            self.closed_with = error
            for flow in list(self.flows):
                self._finish(flow, False, error)
            self.waiting.clear()

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
        """Nodes the host let go: nobody holds their copies any more (taken in as a start is: `_take_in`)."""
        self.forgotten.append(keys)
        self._take_in()

    # -- tracing ----------------------------------------------------------------------------------------
    def _record(self, job: Job, worker, arrived) -> None:
        trace = job.flow.trace
        index = job.flow.index
        trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")
        trace.node_spans(arrived.spans, worker.pid, worker.id, job.piece.devices, index)
        if arrived.decode is not None:
            pid, tid = os.getpid(), threading.get_native_id()
            start, end, nbytes = arrived.decode
            trace.thread(pid, tid, threading.current_thread().name)
            trace.span("decode output", "host", start, end, pid, tid,
                       {"node": last_step(job.piece.plan), "input": index, "bytes": nbytes})
            trace.interval(f"job {job.piece}", "host", job.sent_ns, start, pid, f"job-{job.id}",
                           {"input": index, "worker": worker.id})


def _gather(piece, waiting: int, workers: int) -> tuple:
    """`(how many of a batching node alone's sends a worker may have out and still take its jobs now, how many
    of them a bundle holds in this pump)`; (0, 0) for any other piece. Sends: one running and the next behind
    it when a full bundle waits, else none (what the other inputs wait for gathers here into one bundle; a lone
    input finds nothing out and goes at once). A bundle: the `waiting` jobs' share of the `workers` that may take
    them, up to max_batch (ten waiting for two idle workers go five and five, not ten to one while the other
    idles)."""
    if not piece.bundle:
        return 0, 0
    size = min(piece.bundle, max(1, -(-waiting // max(1, workers))))
    return (GATHER_SENDS if waiting >= piece.bundle else 1), size


def _internal(err: BaseException, doing: str) -> SomaError:
    """soma's own failure while it was `doing` something for an input: said, never a silent hang."""
    failure = SomaError(f"soma failed while {doing}: {type(err).__name__}: {err} (a bug in soma: please report it, "
                        f"with this message)")
    failure.__cause__ = err
    return failure
