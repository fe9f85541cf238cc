"""The host's state and its rules, with one owner: events go in, actions come out (h11's shape).

    events (the loop calls them, one at a time)        actions (`out`: the loop pops them as it carries them out)
      start(program, flows) · start_all(starts)          Send(slot, jobs)           jobs to a worker (encoded there)
      cancel(flows)                                      CancelAt(slot, job ids)    drop these unless started (or
                                                                                    give them back: chunks)
      expire(flow, running[, place]) → RunTimeout        Retire(slot, why)          kill and replace a worker
      spawned(slot, worker) · ready(slot)                Deliver(sink, item)        an input's (index, ok, value)
      leaving(slot) · down(slot, why)
      outcomes(slot, worker, arrived, now[, returned])
      lost(slot, worker, ended, running)
      unsent(jobs, error)   (they could not be encoded)
      forget(keys) · close(error)

What lives here: the flows (an input's walk through its program: flows.py), the
lines of jobs waiting for a worker, which worker takes a job and what is out at
each (dispatch.py), what each piece's outcomes taught (measures.py), bundles of a
batching node's inputs, retries, cancels and timeouts. Each is decided here and
nowhere else.

Nothing here locks, sends, receives, sleeps or encodes, and the clock is read only
for a traced input's spans (the loop passes `now` in): the loop that owns the
sockets calls one event at a time (under its one lock) and then
carries out the actions. An outcome is an action too (`Deliver`): the loop puts
it in its sink after letting go of the lock, so a future's done-callback that
starts the next input never runs inside the core. Because it is pure, the core is
tested without processes (tests/local/test_core.py drives random interleavings of
every event with Hypothesis and checks its invariants after each step).
"""

from __future__ import annotations

import time
from collections import deque

from ...errors import (
    Cancelled,
    NodeError,
    RunTimeout,
    SomaError,
    WorkerDied,
)
from . import chunks
from .core_chunks import ChunkEvents
from .core_workers import (
    ASKED,
    DOWN,
    LEAVING,
    READY,
    SlotStates,
    WorkerEvents,
)
from .dispatch import Dispatch
from .events import Bundled, CancelAt, Deliver, Send, Spawn
from .flows import Chunk, Flow, Job, Walker, chunk_base, stale
from .measures import Measures
from .outcomes import checked, input_ended, internal, record
from .program import pieces


class HostCore(WorkerEvents, ChunkEvents):
    """The host's one owner of what becomes of each input. See the module's docstring (core_workers.py has the
    events of workers coming and going, core_chunks.py those of a map's chunks)."""

    def __init__(self, worker_devices: list[str]):
        n = len(worker_devices)
        self.worker_devices = worker_devices
        self.state = SlotStates(n)  # per slot: STARTING, READY, LEAVING, RETIRING, DOWN or ASKED (core_workers)
        self.workers: list = [None] * n  # per slot: its worker process now (`.id`, `.pid`), once spawned
        self.why_down: list = [None] * n  # per slot: why no worker can run there now, in words after "worker w1"
        self.measures = Measures()  # what each piece's outcomes taught: its pace, its /dev/shm
        self.dispatch = Dispatch(worker_devices, self.measures)  # the lines, what is out at each worker, the choice
        self.flows: dict = {}  # the flows in flight (as keys, in the order they started)
        self.closed_with = None  # the error every flow gets once the pool is closed
        self.walker = Walker()
        self.chunk_jobs: dict = {}  # base → a Chunk's job out or waiting (its inputs travel as base + place)
        self.admitted: set = set()  # programs whose pieces the dispatch knows (Dispatch.admit)
        self.out: deque = deque()  # actions decided and not yet carried out, oldest first (the loop pops them)

    def take(self) -> list:
        """Every action decided and not yet carried out, in order (at once: the tests' way; the loop pops `out`)."""
        out = list(self.out)
        self.out.clear()
        return out

    def has_idle(self) -> bool:
        """Whether a worker is ready and has nothing out."""
        return any(state == READY and not load for state, load in zip(self.state, self.dispatch.load))

    def busy(self) -> bool:
        """Whether any job is queued or out at a worker (the dispatch's books, read here: a run asks once)."""
        dispatch = self.dispatch
        return bool(dispatch.outstanding or dispatch.waiting.lines)

    def in_flight(self) -> tuple:
        """`(inputs started and not ended, jobs out per slot, jobs waiting for a worker)`: Local.snapshot's.
        A job out is one sent to the slot's worker (or parked for it) whose outcome has not come back, a
        cancelled one's included (its worker may be running it)."""
        inputs = sum(len(flow.open) if type(flow) is Chunk else 1 for flow in self.flows)
        waiting = sum(len(line) for line in self.dispatch.waiting.lines.values())
        return inputs, list(self.dispatch.load), waiting

    def parallelism(self, program_pieces: list) -> int:
        """How many inputs of a program this pool works on at once (see Measures.parallelism)."""
        return self.measures.parallelism(program_pieces, len(self.state))

    def chunk(self, piece) -> int:
        """How many inputs of `piece` a map's chunk holds now (Measures.chunk)."""
        return self.measures.chunk(piece)

    def weigh_inputs(self, piece, shm: int | None, message: int | None) -> None:
        """The host copied an input of `piece` into `shm` bytes of /dev/shm, and one took `message` bytes of its
        chunk's message (None: not known; the loop, as it encodes)."""
        self.measures.weigh(piece, shm, inputs=True)
        if message is not None:
            self.measures.weigh_message(piece, message)

    def shm_measures(self, program_pieces: list) -> tuple:
        """`(bytes of /dev/shm an input of a program takes on its way, or None; what its output takes at least
        once it arrived)`, as measured (Measures.shm_per_input, shm_per_output): a map's room."""
        measures = self.measures
        return measures.shm_per_input(program_pieces), measures.shm_per_output(program_pieces)

    # -- inputs ------------------------------------------------------------------------------------------
    def start(self, program, flows: list) -> None:
        """Start these flows (flows.Flow: an input each) on `program`; each one's `(index, ok, value)` is
        delivered to its sink once."""
        self.start_all([(program, flows)])

    def start_all(self, starts: list) -> None:
        """`start(program, flows)` for each of `starts`, in order, with one pump for them all: the starts posted
        while another thread held the loop, taken at once (64 threads calling `run` post ~16 between two takes,
        and a pump each, with a batching node's inputs gathering in its line, was a tenth of the host's CPU)."""
        for program, flows in starts:
            for flow in flows:
                if self.closed_with is not None:
                    self._finish(flow, False, self.closed_with)
                    continue
                self.flows[flow] = None
                if type(flow) is Chunk:
                    job = self.walker.start_chunk(flow)
                    self.chunk_jobs[job.base] = job
                    self._enqueue([job])
                    continue
                x = flow.x
                if not flow.retries:
                    flow.x = None  # (the job holds it until it is encoded)
                self._enqueue(self.walker.start(flow, x))
            if program not in self.admitted:
                self.admitted.add(program)
                self.dispatch.admit(pieces(program))
        if DOWN in self.state:  # a slot that could not be started is tried again for them
            for slot, state in enumerate(self.state):
                if state == DOWN and self.why_down[slot] is not None:
                    self.state[slot] = ASKED
                    self.out.append(Spawn(slot))
        self._pump()

    def cancel(self, flows) -> None:
        """These inputs are no longer wanted: their queued jobs are dropped, workers drop what has not started."""
        flows = {f for f in flows if not f.finished}
        for flow in flows:
            self._finish(flow, None, None)
        self._cancel_jobs([job for job in self.dispatch.outstanding.values() if job.flow in flows])

    def still_out(self, slot: int, running: list) -> list:
        """The `(job id, node)` pairs of `running` (what the status page of `slot`'s worker names) of jobs still
        out there: a turn's threads stay named after its outcomes left, until their next job (worker/running.py:
        a death before the outcomes leave must count them as run), and an idle pool's snapshot named 17 each."""
        out = self.dispatch.outstanding
        chunk_jobs = [job for job in self.chunk_jobs.values() if job.slot == slot]
        return [(job_id, node) for job_id, node in running
                if getattr(out.get(job_id), "slot", None) == slot or any(job_id - c.base in c.pending
                                                                         for c in chunk_jobs)]

    def where(self, flow: Flow) -> list:
        """The slots holding jobs of `flow` now (whose status pages `expire` wants)."""
        return sorted({job.slot for job in flow.jobs if job.slot is not None})

    def expire(self, flow: Flow, timeout: float, running: dict, place: int | None = None) -> RunTimeout:
        """The input's time is up: it ends, the workers running its nodes are retired, and its RunTimeout says
        which nodes those were. `running`: slot → [(job id, node id)] its status page shows (see `where`).
        A chunk's input is its `place` in the chunk (core_chunks: the chunk's other inputs go on)."""
        if place is not None:
            return self._expire_place(flow, place, timeout, running)
        where: dict = {}  # node → where it ran
        waiting: dict = {}
        retire: set = set()
        if not flow.finished:
            for job in list(flow.jobs):
                nodes = [node for job_id, node in running.get(job.slot, ()) if job_id == job.id]
                for node in nodes:
                    where[node] = f"worker {self.workers[job.slot].id}"
                    retire.add(job.slot)
                if not nodes:
                    waiting[job.piece.entry] = None
            self._finish(flow, None, None)
        for slot in sorted(retire):
            self._retire(slot, "was stopped because a run timed out on it")
        self._cancel_jobs([job for job in self.dispatch.outstanding.values() if job.flow is flow])
        return RunTimeout.after(timeout, where, list(waiting),
                                "the workers running them were replaced" if retire else None)

    def forget(self, keys: list) -> None:
        """Nodes the host let go: nobody holds their copies any more."""
        self.dispatch.forget(keys)

    def close(self, error: SomaError) -> None:
        """The pool is closing: every input in flight gets `error`, and so does every input started later."""
        self.closed_with = error
        for flow in list(self.flows):
            self._finish(flow, False, error)
        self.dispatch.waiting.clear()

    # -- workers ------------------------------------------------------------------------------------------
    # -- outcomes -----------------------------------------------------------------------------------------
    def outcomes(self, slot: int, worker, arrived: list, now: float, returned: list = ()) -> None:
        """What the worker `worker` of `slot` sent back in one Result: `Arrived` jobs and `Bundled` ones, and
        the ids of chunk inputs it gave back unstarted (`returned`: see hand_on)."""
        if worker is not self.workers[slot]:
            return
        for one in arrived:
            if type(one) is Bundled and one.jobs and chunk_base(one.jobs[0]) is not None:
                self._chunk_arrived(slot, worker, one, now)
                continue
            if type(one) is Bundled:  # a bundle's jobs: one call, so one measure of its time for them all
                measured = False
                for job_id, ok, value in zip(one.jobs, one.oks, one.values):
                    job = self._returned(job_id, slot, value)
                    if job is None:
                        continue
                    if not measured:
                        self.measures.learn(job, one.seconds, now, one.shm)
                        measured = True
                    self._arrived(job, ok, value, worker, None)
                continue
            job = self._returned(one.job, slot, one.value)
            if job is not None:
                self.measures.learn(job, one.seconds, now, one.shm if one.ok else None)
                self._arrived(job, one.ok, one.value, worker, one if one.spans is not None else None)
        if returned:
            self._given_back(slot, returned)
        if self.state[slot] == LEAVING:
            self._replace_once_idle(slot)
        self._pump()

    def unsent(self, jobs: list, error: NodeError) -> None:
        """These jobs' inputs could not be encoded for their worker (the loop tried): each fails with `error`."""
        for job in jobs:
            if self.dispatch.outstanding.get(job.id) is job:
                self.dispatch.give_back(job)
            if not stale(job):
                self._end_job(job, False, error)
        self._pump()

    def _returned(self, job_id: int, slot: int, value):
        """The job whose outcome (`value`) came back from `slot`, no longer out there; None when there is no
        more to do with it: unknown (or not this worker's), stale, or handed back unstarted (Cancelled: it
        waits again, to run elsewhere)."""
        job = self.dispatch.outstanding.get(job_id)
        if job is None or job.slot != slot:
            return None
        self.dispatch.give_back(job)
        if stale(job):
            job.flow.jobs.discard(job)
            return None
        if type(value) is Cancelled:
            job.slot = None
            self.dispatch.waiting.add_first([job])
            return None
        return job

    def _arrived(self, job: Job, ok: bool, value, worker, traced) -> None:
        """A job's outcome, checked, carried on (`traced`: its Arrived, when it brought spans)."""
        try:
            if traced is not None and job.flow.trace is not None:
                record(job, worker, traced)
            if ok:
                value, ok = checked(job, value, worker)
            self._end_job(job, ok, value)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            self._finish(job.flow, False, internal(err, f"handling the outcome of node `{job.piece.entry}`"))

    def _end_job(self, job: Job, ok: bool, value) -> None:
        """The job is over: its continuation makes the next jobs, or the flow's end."""
        flow = job.flow
        flow.jobs.discard(job)
        if job.places is not None:  # a chunk's, failed (its outcomes come in _chunk_arrived)
            if self.chunk_jobs.get(job.base) is job:
                del self.chunk_jobs[job.base]
            self._deliver_chunk(flow, chunks.failed(flow, job.places, value))
            return
        then = job.then  # the jobs its outcome makes, or (ok, value): the walk has ended (flows.py); a job of a
        # program's last piece has the flow itself as its continuation: its outcome is the input's, no call
        made = (ok, value) if then is flow else then(ok, value)
        if type(made) is tuple:
            self._finish(flow, *made)
        elif made:
            self._enqueue(made)

    def _finish(self, flow: Flow, ok, value) -> None:
        """End a flow: its outcome is delivered (unless `ok` is None: nobody waits for it any more)."""
        if flow.finished:
            return
        flow.finished = True  # its queued jobs are dropped by the next pump
        flow.jobs.clear()  # (each holds its flow: a cycle that kept their inputs, /dev/shm too, until gc ran)
        self.flows.pop(flow, None)
        if flow.trace is not None and flow.index is not None:  # (a run's span is its caller's, see Local.run)
            outcome = "ok" if ok else ("cancelled" if ok is None else type(value).__name__)
            input_ended(flow.trace, flow.index, flow.started_ns, time.monotonic_ns(), f"input-{id(flow)}", outcome)
        if ok is not None:
            if type(flow) is Chunk:  # (failed: each open input with its own copy of the error)
                for item in chunks.failed(flow, sorted(flow.open), value):
                    self.out.append(Deliver(flow.sink, item))
                return
            self.out.append(Deliver(flow.sink, (flow.index, ok, value)))

    # -- giving jobs to workers ---------------------------------------------------------------------------
    def _enqueue(self, jobs: list) -> None:
        self.dispatch.waiting.add(jobs)
        for job in jobs:
            job.flow.jobs.add(job)

    def _pump(self) -> None:
        """Give queued jobs to workers that can take them (dispatch.py), one Send per worker; what no worker can
        ever take fails, saying why."""
        if not self.dispatch.waiting.lines:
            return
        state = self.state
        for slot, jobs, groups in self.dispatch.pump(state.usable, state.starting):
            self.out.append(Send(slot, jobs, groups, self.workers[slot]))
        if self.dispatch.waiting.lines:
            self._fail_unplaceable()

    def _send(self, slot: int, jobs: list) -> None:
        self.out.append(Send(slot, jobs, self.dispatch.sent(slot, jobs), self.workers[slot]))

    def _fail_unplaceable(self) -> None:
        """Jobs whose only workers cannot start (now, or any more) would wait forever: they fail, saying why."""
        why = [why if self.state[slot] == DOWN else None for slot, why in enumerate(self.why_down)]
        if not any(why):
            return
        waiting = self.dispatch.waiting
        for piece, _ in waiting.snapshot():
            slots = self.dispatch.serving(piece)
            if not all(why[s] for s in slots):
                continue
            worker = self.workers[slots[0]]
            name = worker.id if worker is not None else f"w{slots[0]}"
            for job in waiting.take(piece):
                if stale(job):
                    continue
                self._end_job(job, False, WorkerDied(
                    f"no worker can run node `{piece.entry}`: worker {name} {why[slots[0]]}",
                    worker=name, pid=getattr(worker, "pid", None), node=piece.entry, tries=job.flow.tries))

    def _cancel_jobs(self, jobs: list) -> None:
        """Ask workers to drop these jobs unless they have started (their outcomes come back and are dropped)."""
        by_slot: dict[int, list] = {}
        for job in jobs:
            if job not in self.dispatch.parked[job.slot]:  # (parked ones are dropped at hello)
                by_slot.setdefault(job.slot, []).extend(job.chunk_ids() if job.places is not None else (job.id,))
        for slot, ids in by_slot.items():
            self.out.append(CancelAt(slot, ids))
