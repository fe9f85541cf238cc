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
import threading
import time
from typing import NamedTuple

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
from .events import Bundled, Undecodable
from .flows import Flow, Job, SendCount, Walker, entries
from .program import pieces
from .waiting import Waiting

LEFT_OVER_MEMORY = "went over max_memory after an input, and was replaced"


class Send(NamedTuple):
    """Send these jobs to the worker of `slot`, in one Task (the loop encodes the ones not encoded yet)."""

    slot: int
    jobs: list


class CancelAt(NamedTuple):
    """Ask the worker of `slot` to drop these jobs unless they have started (their outcomes still come)."""

    slot: int
    job_ids: list


class Retire(NamedTuple):
    """Kill the worker of `slot` and start its replacement; its end comes back as the `lost` event."""

    slot: int
    why: str | None


class Spawn(NamedTuple):
    """Try to start a worker for `slot` again (it could not be started before, and inputs wait for it): the
    answer is the `spawned` event, or `down` with why not."""

    slot: int


class Deliver(NamedTuple):
    """An input's outcome, `(index, ok, value)`, for its sink (put there once the loop has let go of its lock)."""

    sink: object
    item: tuple


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
        self.choice = WorkerChoice(worker_devices)
        self.waiting = Waiting()  # jobs waiting for a worker, a line per piece
        self.outstanding: dict[int, Job] = {}  # job id → job given to a worker (sent, or parked for it)
        self.parked: list = [[] for _ in worker_devices]  # jobs for a worker that has not said hello yet
        self.flows: dict = {}  # the flows in flight (as keys, in the order they started)
        self.closed_with = None  # the error every flow gets once the pool is closed
        self.walker = Walker()
        self.admitted: set = set()  # programs whose pieces the choice knows (WorkerChoice.admit)
        self.out: list = []  # actions not yet taken by the loop

    def take(self) -> list:
        """The actions decided since the last take, in order."""
        out, self.out = self.out, []
        return out

    def busy(self) -> bool:
        """Whether any job is queued or out at a worker."""
        return bool(self.outstanding or self.waiting)

    def parallelism(self, program_pieces: list) -> int:
        """How many inputs of a program this pool works on at once (see WorkerChoice.parallelism)."""
        return self.choice.parallelism(program_pieces)

    # -- inputs ------------------------------------------------------------------------------------------
    def start(self, program, flows: list) -> None:
        """Start these flows (flows.Flow: an input each) on `program`; each one's `(index, ok, value)` is
        delivered to its sink once."""
        for flow in flows:
            if self.closed_with is not None:
                self._finish(flow, False, self.closed_with)
                continue
            self.flows[flow] = None
            x = flow.x
            if not flow.retries:
                flow.x = None  # (the job holds it until it is encoded)
            self._enqueue(self.walker.start(flow, x))
        if program not in self.admitted:
            self.admitted.add(program)
            self.choice.admit(pieces(program))
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
        self._cancel_jobs([job for job in self.outstanding.values() if job.flow in flows])

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
        self._cancel_jobs([job for job in self.outstanding.values() if job.flow is flow])
        return RunTimeout.after(timeout, where, list(waiting),
                                "the workers running them were replaced" if retire else None)

    def forget(self, keys: list) -> None:
        """Nodes the host let go: nobody holds their copies any more."""
        self.choice.forget(keys)

    def close(self, error: SomaError) -> None:
        """The pool is closing: every input in flight gets `error`, and so does every input started later."""
        self.closed_with = error
        for flow in list(self.flows):
            self._finish(flow, False, error)
        self.waiting.clear()

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
        parked, self.parked[slot] = self.parked[slot], []
        wanted = []
        for job in parked:
            if job.id not in self.outstanding:
                continue
            if self.walker.stale(job):  # cancelled, timed out or tried again while its worker started
                self._give_back(job)
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
        self.choice.slot_lost(slot)
        running = dict(running) if running is not None else None
        parked = set(map(id, self.parked[slot]))
        self.parked[slot] = []
        requeued = []
        for job in [job for job in self.outstanding.values() if job.slot == slot]:
            self._give_back(job)
            if self.walker.stale(job):
                job.flow.jobs.discard(job)
                continue
            if id(job) in parked or (running is not None and job.id not in running):
                job.slot = None
                requeued.append(job)
                continue
            node = running.get(job.id, job.piece.entry) if running is not None else job.piece.entry
            self._lost_running(job, worker, ended, node, down)
        self.waiting.add_first(requeued)
        self._pump()

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
        stale = list(flow.jobs)
        flow.jobs.clear()
        flow.tries += 1
        self._cancel_jobs([job for job in stale if job.id in self.outstanding])
        self._enqueue(self.walker.start(flow, flow.x))

    # -- outcomes -----------------------------------------------------------------------------------------
    def outcomes(self, slot: int, worker, arrived: list, now: float) -> None:
        """What the worker `worker` of `slot` sent back in one Result: `Arrived` jobs and `Bundled` ones."""
        if worker is not self.workers[slot]:
            return
        for one in arrived:
            if type(one) is Bundled:  # a bundle's jobs: one call, so one measure of its time for them all
                measured = False
                for job_id, ok, value in zip(one.jobs, one.oks, one.values):
                    job = self._returned(job_id, slot, value)
                    if job is None:
                        continue
                    if not measured:
                        self.choice.measure(job, one.seconds, now)
                        measured = True
                    self._arrived(job, ok, value, worker, None)
                continue
            job = self._returned(one.job, slot, one.value)
            if job is not None:
                self.choice.measure(job, one.seconds, now)
                self._arrived(job, one.ok, one.value, worker, one if one.spans is not None else None)
        if self.state[slot] == LEAVING:
            self._replace_once_idle(slot)
        self._pump()

    def unsent(self, jobs: list, error: NodeError) -> None:
        """These jobs' inputs could not be encoded for their worker (the loop tried): each fails with `error`."""
        for job in jobs:
            if job.id in self.outstanding:
                self._give_back(job)
            if not self.walker.stale(job):
                self._end_job(job, False, error)
        self._pump()

    def _returned(self, job_id: int, slot: int, value):
        """The job whose outcome (`value`) came back from `slot`, no longer out there; None when there is no
        more to do with it: unknown (or not this worker's), stale, or handed back unstarted (Cancelled: it
        waits again, to run elsewhere)."""
        job = self.outstanding.get(job_id)
        if job is None or job.slot != slot:
            return None
        self._give_back(job)
        if self.walker.stale(job):
            job.flow.jobs.discard(job)
            return None
        if type(value) is Cancelled:
            job.slot = None
            self.waiting.add_first([job])
            return None
        return job

    def _arrived(self, job: Job, ok: bool, value, worker, traced) -> None:
        """A job's outcome, checked, carried on (`traced`: its Arrived, when it brought spans)."""
        try:
            if traced is not None and job.flow.trace is not None:
                _record(job, worker, traced)
            if ok:
                value, ok = _checked(job, value, worker)
            self._end_job(job, ok, value)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            self._finish(job.flow, False, _internal(err, f"handling the outcome of node `{job.piece.entry}`"))

    def _end_job(self, job: Job, ok: bool, value) -> None:
        """The job is over: its continuation makes the next jobs, or the flow's end."""
        flow = job.flow
        flow.jobs.discard(job)
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
        if flow.trace is not None and flow.index is not None:  # (a run's span is its caller's, see Local.run)
            outcome = "ok" if ok else ("cancelled" if ok is None else type(value).__name__)
            flow.trace.interval(f"input {flow.index}", "host", flow.started_ns, time.monotonic_ns(), os.getpid(),
                                f"input-{id(flow)}", {"input": flow.index, "outcome": outcome})
        if ok is not None:
            self.out.append(Deliver(flow.sink, (flow.index, ok, value)))

    # -- giving jobs to workers ---------------------------------------------------------------------------
    def _enqueue(self, jobs: list) -> None:
        self.waiting.add(jobs)
        for job in jobs:
            job.flow.jobs.add(job)

    def _usable(self) -> tuple:
        """`(slots that may take jobs, those of them still starting)`."""
        usable = tuple(s for s, state in enumerate(self.state) if state in (READY, STARTING))
        return usable, tuple(s for s in usable if self.state[s] == STARTING)

    def _pump(self) -> None:
        """Give queued jobs to workers that can take them, one Send per worker. A worker still starting gets
        its share too (parked until its hello), so a wave still spreads over the pool right after a death."""
        if not self.waiting:
            return
        usable, starting = self._usable()
        if not self.choice.has_room(usable):
            self._fail_unplaceable()
            return
        sends: dict[int, list] = {}
        for piece, line in self.waiting.snapshot():
            self._place_line(piece, line, usable, sends)
            self.waiting.settle(piece)
        for slot, jobs in sends.items():
            if slot in starting:
                self.parked[slot].extend(jobs)
            else:
                self._send(slot, jobs)
        if self.waiting:
            self._fail_unplaceable()

    def _place_line(self, piece, line, usable, sends: dict) -> None:
        """Give `piece`'s waiting jobs to workers from the front of its line until no worker takes the next
        (then none takes the ones behind it in this pump: loads only grow during it). A batching node alone's
        jobs fill a bundle at one worker before the next worker is chosen (`_gather`)."""
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
            sends.setdefault(slot, []).append(job)

    def _send(self, slot: int, jobs: list) -> None:
        """The jobs go to the worker of `slot`; a batching node alone's sends are counted at it (a bundle, or
        one job, is one send: `WorkerChoice.sent`), grouped as they will travel (flows.entries)."""
        for group in entries(jobs):
            first = group[0]
            if first.piece.bundle and not first.traced:
                count = SendCount(slot, first.piece.id, len(group))
                for job in group:
                    job.send = count
                self.choice.sent(slot, first.piece.id)
        self.out.append(Send(slot, jobs))

    def _give_back(self, job: Job) -> None:
        """`job` is no longer at its worker (its outcome came, or the worker is gone)."""
        del self.outstanding[job.id]
        self.choice.give_back(job)
        count = job.send
        if count is not None:
            job.send = None
            count.left -= 1
            if not count.left:
                self.choice.send_over(count.slot, count.piece_id)

    def _fail_unplaceable(self) -> None:
        """Jobs whose only workers cannot start (now, or any more) would wait forever: they fail, saying why."""
        why = [why if self.state[slot] == DOWN else None for slot, why in enumerate(self.why_down)]
        if not any(why):
            return
        for piece, _ in self.waiting.snapshot():
            slots = self.choice.serving(piece)
            if not all(why[s] for s in slots):
                continue
            worker = self.workers[slots[0]]
            name = worker.id if worker is not None else f"w{slots[0]}"
            for job in self.waiting.take(piece):
                if self.walker.stale(job):
                    continue
                self._end_job(job, False, WorkerDied(
                    f"no worker can run node `{piece.entry}`: worker {name} {why[slots[0]]}",
                    worker=name, pid=getattr(worker, "pid", None), node=piece.entry, tries=job.flow.tries))

    def _replace_once_idle(self, slot: int) -> None:
        """A worker over max_memory is replaced once every job sent to it has come back (its parked jobs go to
        its replacement): nothing it sent is lost on the way, and nothing it held runs twice."""
        parked = set(map(id, self.parked[slot]))
        if any(job.slot == slot and id(job) not in parked for job in self.outstanding.values()):
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
            if job not in self.parked[job.slot]:  # (parked ones are dropped at hello)
                by_slot.setdefault(job.slot, []).append(job.id)
        for slot, ids in by_slot.items():
            self.out.append(CancelAt(slot, ids))


def _gather(piece, waiting: int, workers: int) -> tuple:
    """`(how many of a batching node alone's sends a worker may have out and still take its jobs now, how many
    of them a bundle holds in this pump)`; (0, 0) for any other piece. One send running and the next behind it
    when a full bundle waits, else none; a bundle is the waiting jobs' share of the workers, up to max_batch."""
    if not piece.bundle:
        return 0, 0
    size = min(piece.bundle, max(1, -(-waiting // max(1, workers))))
    return (GATHER_SENDS if waiting >= piece.bundle else 1), size


def _checked(job: Job, value, worker):
    """The host's look at what arrived: it decoded, and the postcondition holds after the crossing."""
    piece = job.piece
    if type(value) is Undecodable:
        err = value.error
        return NodeError.failed(last_step(piece.plan), f"its output could not be received from worker "
                                                       f"{worker.id}: {type(err).__name__}: {err}"), False
    if piece.devices:
        start = time.monotonic_ns() if job.traced else 0
        try:
            for node_id, declared, item in piece.checked_outputs(value):
                check_postcondition(node_id, declared, item)
        except PostconditionError as err:
            return err, False
        finally:
            if job.traced and job.flow.trace is not None:
                job.flow.trace.span("postcondition", "host", start, time.monotonic_ns(), os.getpid(),
                                    threading.get_native_id(), {"node": last_step(piece.plan), "input": job.flow.index})
    return value, True


def _record(job: Job, worker, arrived) -> None:
    """A traced job's spans, as its worker measured them, into its flow's trace."""
    trace, index = job.flow.trace, job.flow.index
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


def _internal(err: BaseException, doing: str) -> SomaError:
    """soma's own failure while it was `doing` something for an input: said, never a silent hang."""
    failure = SomaError(f"soma failed while {doing}: {type(err).__name__}: {err} (a bug in soma: please report it, "
                        f"with this message)")
    failure.__cause__ = err
    return failure
