"""The host's state and its rules, with one owner: events go in, actions come out (h11's shape).

    events (the loop calls them, one at a time)        actions (`take()`: the loop carries them out, in order)
      start(program, flows)                              Send(slot, jobs)           jobs to a worker (encoded there)
      cancel(flows)                                      CancelAt(slot, job ids)    drop these unless started
      expire(flow, running) → RunTimeout                 Retire(slot, why)          kill and replace a worker
      spawned(slot, worker) · ready(slot)                Deliver(sink, item)        an input's (index, ok, value)
      leaving(slot) · down(slot, why)
      outcomes(slot, worker, arrived, now)
      lost(slot, worker, ended, running)
      unsent(jobs, error)   (they could not be encoded)
      forget(keys) · close(error)

What lives here: the flows (an input's walk through its program: flows.py), the
lines of jobs waiting for a worker (waiting.py), which worker takes a job
(choice.py), what is out at each worker, bundles of a batching node's inputs,
retries, cancels and timeouts. Each is decided here and nowhere else.

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

import os
import time

from ...errors import (
    Cancelled,
    NodeError,
    RunTimeout,
    SomaError,
    WorkerDied,
)
from . import chunks
from .dispatch import Dispatch
from .events import Bundled, CancelAt, Deliver, Retire, Send, Spawn
from .flows import Chunk, Flow, Job, Walker, chunk_base, stale
from .outcomes import checked, record
from .program import pieces

LEFT_OVER_MEMORY = "went over max_memory after an input, and was replaced"


# A slot's state. STARTING: spawned, no hello yet (jobs are parked for it). READY: takes jobs. LEAVING: over
# max_memory, takes nothing, retired once idle. RETIRING: told to go (Retire), its `lost` not yet heard.
# DOWN: no worker there; its end is handled (`why_down` says why when it cannot come back now). ASKED: a
# start was asked for (Spawn), its answer not yet heard.
STARTING, READY, LEAVING, RETIRING, DOWN, ASKED = "starting", "ready", "leaving", "retiring", "down", "asked"


class OutOfOrder(SomaError):
    """An event the core cannot take in its state (a bug in the loop that calls it): never a silent hang."""


class HostCore:
    """The host's one owner of what becomes of each input. See the module's docstring."""

    def __init__(self, worker_devices: list[str]):
        n = len(worker_devices)
        self.worker_devices = worker_devices
        self.state = [DOWN] * n  # per slot: STARTING, READY, LEAVING, RETIRING or DOWN (see above)
        self.workers: list = [None] * n  # per slot: its worker process now (`.id`, `.pid`), once spawned
        self.why_down: list = [None] * n  # per slot: why no worker can run there now, in words after "worker w1"
        self.dispatch = Dispatch(worker_devices)  # the lines, what is out at each worker, the choice
        self.flows: dict = {}  # the flows in flight (as keys, in the order they started)
        self.closed_with = None  # the error every flow gets once the pool is closed
        self.walker = Walker()
        self.chunks: dict = {}  # base → a Chunk in flight (its inputs' job ids are base + place: chunks.py)
        self.admitted: set = set()  # programs whose pieces the choice knows (WorkerChoice.admit)
        self.out: list = []  # actions not yet taken by the loop

    def take(self) -> list:
        """The actions decided since the last take, in order."""
        out, self.out = self.out, []
        return out

    def busy(self) -> bool:
        """Whether any job is queued or out at a worker."""
        return self.dispatch.busy()

    def parallelism(self, program_pieces: list) -> int:
        """How many inputs of a program this pool works on at once (see WorkerChoice.parallelism)."""
        return self.dispatch.choice.parallelism(program_pieces)

    def chunk(self, piece) -> int:
        """How many inputs of `piece` a map's chunk holds now (chunks.size)."""
        return self.dispatch.choice.chunk(piece)

    # -- inputs ------------------------------------------------------------------------------------------
    def start(self, program, flows: list) -> None:
        """Start these flows (flows.Flow: an input each) on `program`; each one's `(index, ok, value)` is
        delivered to its sink once."""
        for flow in flows:
            if self.closed_with is not None:
                self._finish(flow, False, self.closed_with)
                continue
            self.flows[flow] = None
            if type(flow) is Chunk:
                self._enqueue([self.walker.start_chunk(flow)])
                self.chunks[flow.base] = flow
                continue
            x = flow.x
            if not flow.retries:
                flow.x = None  # (the job holds it until it is encoded)
            self._enqueue(self.walker.start(flow, x))
        if program not in self.admitted:
            self.admitted.add(program)
            self.dispatch.choice.admit(pieces(program))
        for slot, state in enumerate(self.state):  # a slot that could not be started is tried again for them
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

    def where(self, flow: Flow) -> list:
        """The slots holding jobs of `flow` now (whose status pages `expire` wants)."""
        return sorted({job.slot for job in flow.jobs if job.slot is not None})

    def expire(self, flow: Flow, timeout: float, running: dict) -> RunTimeout:
        """The input's time is up: it ends, the workers running its nodes are retired, and its RunTimeout says
        which nodes those were. `running`: slot → [(job id, node id)] its status page shows (see `where`)."""
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
        self.dispatch.choice.forget(keys)

    def close(self, error: SomaError) -> None:
        """The pool is closing: every input in flight gets `error`, and so does every input started later."""
        self.closed_with = error
        for flow in list(self.flows):
            self._finish(flow, False, error)
        self.dispatch.waiting.clear()

    # -- workers ------------------------------------------------------------------------------------------
    def spawned(self, slot: int, worker) -> None:
        """A new worker process for `slot` is on its way (no hello yet): jobs for it are parked until then."""
        if self.state[slot] not in (DOWN, ASKED):
            raise OutOfOrder(f"worker w{slot} was spawned while the slot was {self.state[slot]} (its last worker's "
                             f"end must be handled first: lost)")
        self.workers[slot], self.state[slot], self.why_down[slot] = worker, STARTING, None
        self._pump()

    def ready(self, slot: int) -> None:
        """The worker of `slot` said hello: what was parked for it goes now."""
        if self.state[slot] != STARTING:
            return  # (a hello from a worker already retired: it takes nothing)
        self.state[slot] = READY
        wanted = []
        for job in self.dispatch.unpark(slot):
            if job.id not in self.dispatch.outstanding:
                continue
            if stale(job):  # cancelled, timed out or tried again while its worker started
                self.dispatch.give_back(job)
                job.flow.jobs.discard(job)
                continue
            wanted.append(job)
        if wanted:
            self._send(slot, wanted)
        self._pump()

    def leaving(self, slot: int) -> None:
        """The worker of `slot` went over max_memory: it takes nothing more, and is retired once idle."""
        if self.state[slot] == READY:
            self.state[slot] = LEAVING
        self._replace_once_idle(slot)

    def down(self, slot: int, why: str) -> None:
        """No worker can run on `slot` now (it could not be started: `why`); jobs that only it could run fail."""
        if self.state[slot] not in (DOWN, ASKED):
            raise OutOfOrder(f"worker w{slot} was said down while the slot was {self.state[slot]}")
        self.state[slot], self.why_down[slot] = DOWN, why
        self._pump()

    def lost(self, slot: int, worker, ended: str, running, down: str | None = None) -> None:
        """The worker process `worker` of `slot` ended (`ended`: how); its copies are gone with it. `down`: why
        no replacement could be started (None: one is, and comes as `spawned` next).

        A job it had not started (parked for it, or sent and not yet begun, as its status page says:
        `running` [(job id, node id)], None when the page could not be read) goes back to the front of
        its line, no try counted. A job it was running is lost: its input runs again from the start if it
        has tries left, else fails (WorkerDied). A replacement is `spawned` (or `down`) next.
        """
        if worker is not self.workers[slot] or self.state[slot] == DOWN:
            return  # an earlier incarnation's end, or this one's told twice
        self.state[slot], self.why_down[slot] = DOWN, down
        dispatch = self.dispatch
        dispatch.choice.slot_lost(slot)
        running = dict(running) if running is not None else None
        parked = set(map(id, dispatch.unpark(slot)))
        requeued = []
        for job in dispatch.at(slot):
            dispatch.give_back(job)
            if stale(job):
                job.flow.jobs.discard(job)
                continue
            if job.places is not None and id(job) not in parked:  # a chunk's: see chunks.py
                place = chunks.lost(job, running)
                if place is not None:
                    requeued += self._chunk_lost(job, place, worker, ended, running, down)
                    continue
            if id(job) in parked or job.places is not None or (running is not None and job.id not in running):
                job.slot = None
                requeued.append(job)
                continue
            node = running.get(job.id, job.piece.entry) if running is not None else job.piece.entry
            self._lost_running(job, worker, ended, node, down)
        dispatch.waiting.add_first(requeued)
        self._pump()

    def _chunk_lost(self, job: Job, place: int, worker, ended: str, running, down: str | None) -> list:
        """A chunk's job whose worker died running the input at `place`: that input fails (WorkerDied), the
        others it still owed (done and not reported, or not started) go again: returns their job."""
        job.flow.jobs.discard(job)
        node = running.get(job.base + place, job.piece.entry) if running else job.piece.entry
        self._lost_running(self.walker.rest_of(job, [place]), worker, ended, node, down)
        others = chunks.still_open(job.flow, sorted(job.pending - {place}))
        if not others:
            return []
        again = self.walker.rest_of(job, others)
        job.flow.jobs.add(again)
        return [again]

    def _lost_running(self, job: Job, worker, ended: str, node: str, down: str | None) -> None:
        flow = job.flow
        if flow.tries <= flow.retries:
            self._try_again(flow)
            return
        then = "run again, or pass retries=N" if not flow.retries else (
            f"{flow.tries} tries, each lost to a dead worker (retries={flow.retries})")
        replaced = "the pool replaced it" if down is None else f"a new worker {down}"
        self._end_job(job, False, WorkerDied(
            f"worker {worker.id} (pid {worker.pid}) {ended} while running node `{node}`; {replaced}: {then}",
            worker=worker.id, pid=worker.pid, node=node, tries=flow.tries))

    def _try_again(self, flow: Flow) -> None:
        """Run the input again from the program's start; what is left of its last try is dropped."""
        old = list(flow.jobs)
        flow.jobs.clear()
        flow.tries += 1
        self._cancel_jobs([job for job in old if job.id in self.dispatch.outstanding])
        self._enqueue(self.walker.start(flow, flow.x))

    # -- outcomes -----------------------------------------------------------------------------------------
    def outcomes(self, slot: int, worker, arrived: list, now: float) -> None:
        """What the worker `worker` of `slot` sent back in one Result: `Arrived` jobs and `Bundled` ones."""
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
                        self.dispatch.choice.measure(job, one.seconds, now)
                        measured = True
                    self._arrived(job, ok, value, worker, None)
                continue
            job = self._returned(one.job, slot, one.value)
            if job is not None:
                self.dispatch.choice.measure(job, one.seconds, now)
                self._arrived(job, one.ok, one.value, worker, one if one.spans is not None else None)
        if self.state[slot] == LEAVING:
            self._replace_once_idle(slot)
        self._pump()

    def _chunk_arrived(self, slot: int, worker, one: Bundled, now: float) -> None:
        """(Part of) a chunk's answer (chunks.py): each input's outcome delivered; what was handed back goes
        again; the job is over once every place it owed is answered."""
        base = chunk_base(one.jobs[0])
        chunk = self.chunks.get(base)
        first = one.jobs[0] - base
        job = next((j for j in chunk.jobs if j.slot == slot and first in j.pending), None) if chunk else None
        if job is None:
            return  # (a place handed on to another worker meanwhile, or a chunk over)
        if stale(job):  # (cancelled: what it owed is dropped as it comes)
            job.pending.difference_update(i - base for i in one.jobs)
            if not job.pending:
                self.dispatch.give_back(job)
                chunk.jobs.discard(job)
                self._deliver_chunk(chunk, [])
            return
        try:
            items, back = chunks.arrived(job, one.oks, one.values, one.jobs, worker)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            items, back = chunks.failed(chunk, job.places, _internal(err, f"handling the outcomes of node "
                                                                           f"`{job.piece.entry}`")), []
            job.pending.clear()
        if not job.pending:
            self.dispatch.give_back(job)
            chunk.jobs.discard(job)
            self.dispatch.choice.measure(job, one.seconds, now, len(job.places))
        back = chunks.still_open(chunk, back)
        if back:
            again = self.walker.rest_of(job, back)
            chunk.jobs.add(again)
            self.dispatch.waiting.add_first([again])
        self._deliver_chunk(chunk, items)

    def stragglers(self, now: float) -> list:
        """`(slot, job)` of chunks' jobs out for long (an input of theirs is slow: it holds the others behind
        it) while a worker has nothing to do: the loop reads what those workers run and calls `hand_on`."""
        for base in [b for b, c in self.chunks.items() if c.finished and not c.jobs]:
            del self.chunks[base]  # (over, its last job dropped on a worker's end or hello)
        if not self.chunks or self.dispatch.waiting:
            return []
        choice = self.dispatch.choice
        if not any(self.state[s] == READY and not choice.load[s] for s in range(len(self.state))):
            return []
        found = []
        for chunk in self.chunks.values():
            for job in chunk.jobs:
                if job.slot is None or len(job.pending) < 2 or job in self.dispatch.parked[job.slot]:
                    continue
                expected = choice.service_s.get(job.piece.id, 0.0) * len(job.places)
                if now - job.sent_at > max(chunks.STRAGGLER_S, 4 * expected):
                    found.append((job.slot, job))
        return found

    def hand_on(self, job: Job, running: list) -> None:
        """A chunk's job out for long (`stragglers`): the inputs it owes, but for the one its worker runs now
        (`running`, its status page), go to another worker; its worker is asked to drop them (it sends what it
        has done so far at once: see soma.local.worker). An input that started meanwhile may run twice; its
        outcome is delivered once (the job it was handed on to is the one that owes it)."""
        if self.dispatch.outstanding.get(job.id) is not job or stale(job):
            return
        now = chunks.running(job, running)
        rest = chunks.still_open(job.flow, sorted(p for p in job.pending if p != now))
        if not rest:
            return
        job.pending.difference_update(rest)
        self.out.append(CancelAt(job.slot, [job.base + p for p in rest]))
        if not job.pending:  # (it had not started: all of it goes; what its worker answers for it is dropped)
            self.dispatch.give_back(job)
            job.flow.jobs.discard(job)
        again = self.walker.rest_of(job, rest)
        job.flow.jobs.add(again)
        self.dispatch.waiting.add_first([again])
        self._pump()

    def _deliver_chunk(self, chunk: Chunk, items: list) -> None:
        for item in items:
            self.out.append(Deliver(chunk.sink, item))
        if not chunk.open and not chunk.finished:
            chunk.finished = True
            self.flows.pop(chunk, None)
        if chunk.finished and not chunk.jobs:
            self.chunks.pop(chunk.base, None)

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
            self._finish(job.flow, False, _internal(err, f"handling the outcome of node `{job.piece.entry}`"))

    def _end_job(self, job: Job, ok: bool, value) -> None:
        """The job is over: its continuation makes the next jobs, or the flow's end."""
        flow = job.flow
        flow.jobs.discard(job)
        if job.places is not None:  # a chunk's, failed (its outcomes come in _chunk_arrived)
            self._deliver_chunk(flow, chunks.failed(flow, job.places, value))
            return
        made = job.then(ok, value)
        if made:
            self._enqueue(made)
        if flow.outcome is not None:
            self._finish(flow, *flow.outcome)

    def _finish(self, flow: Flow, ok, value) -> None:
        """End a flow: its outcome is delivered (unless `ok` is None: nobody waits for it any more)."""
        if flow.finished:
            return
        flow.finished = True  # its queued jobs are dropped by the next pump
        self.flows.pop(flow, None)
        if type(flow) is Chunk and not flow.jobs:
            self.chunks.pop(flow.base, None)
        if flow.trace is not None and flow.index is not None:  # (a run's span is its caller's, see Local.run)
            outcome = "ok" if ok else ("cancelled" if ok is None else type(value).__name__)
            flow.trace.interval(f"input {flow.index}", "host", flow.started_ns, time.monotonic_ns(), os.getpid(),
                                f"input-{id(flow)}", {"input": flow.index, "outcome": outcome})
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
        usable = tuple(s for s, state in enumerate(self.state) if state in (READY, STARTING))
        sends = self.dispatch.pump(usable, tuple(s for s in usable if self.state[s] == STARTING))
        for slot, jobs in (sends or {}).items():
            self._send(slot, jobs)
        if self.dispatch.waiting:
            self._fail_unplaceable()

    def _send(self, slot: int, jobs: list) -> None:
        self.out.append(Send(slot, jobs, self.dispatch.sent(slot, jobs)))

    def _fail_unplaceable(self) -> None:
        """Jobs whose only workers cannot start (now, or any more) would wait forever: they fail, saying why."""
        why = [why if self.state[slot] == DOWN else None for slot, why in enumerate(self.why_down)]
        if not any(why):
            return
        waiting = self.dispatch.waiting
        for piece, _ in waiting.snapshot():
            slots = self.dispatch.choice.serving(piece)
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

    def _replace_once_idle(self, slot: int) -> None:
        """A worker over max_memory is replaced once every job sent to it has come back (its parked jobs go to
        its replacement): nothing it sent is lost on the way, and nothing it held runs twice."""
        parked = set(map(id, self.dispatch.parked[slot]))
        if any(id(job) not in parked for job in self.dispatch.at(slot)):
            return
        self._retire(slot, LEFT_OVER_MEMORY)

    def _retire(self, slot: int, why: str) -> None:
        if self.state[slot] in (STARTING, READY, LEAVING):
            self.state[slot] = RETIRING  # it takes nothing from now on; its `lost` says what it held
            self.out.append(Retire(slot, why))

    def _cancel_jobs(self, jobs: list) -> None:
        """Ask workers to drop these jobs unless they have started (their outcomes come back and are dropped)."""
        by_slot: dict[int, list] = {}
        for job in jobs:
            if job not in self.dispatch.parked[job.slot]:  # (parked ones are dropped at hello)
                by_slot.setdefault(job.slot, []).extend(job.chunk_ids() if job.places is not None else (job.id,))
        for slot, ids in by_slot.items():
            self.out.append(CancelAt(slot, ids))


def _internal(err: BaseException, doing: str) -> SomaError:
    """soma's own failure while it was `doing` something for an input: said, never a silent hang."""
    failure = SomaError(f"soma failed while {doing}: {type(err).__name__}: {err} (a bug in soma: please report it, "
                        f"with this message)")
    failure.__cause__ = err
    return failure
