"""HostCore's events of workers coming and going: spawned, ready (hello), leaving (over max_memory), down
(cannot start), lost (ended), and what becomes of the jobs they held. Part of the core (a base of HostCore:
the same state, the same purity: no locks, no I/O)."""

from __future__ import annotations

from ...errors import SomaError, WorkerDied
from . import chunks
from .events import Retire
from .flows import Flow, Job, stale

LEFT_OVER_MEMORY = "went over max_memory after an input, and was replaced"


# A slot's state. STARTING: spawned, no hello yet (jobs are parked for it). READY: takes jobs. LEAVING: over
# max_memory, takes nothing, retired once idle. RETIRING: told to go (Retire), its `lost` not yet heard.
# DOWN: no worker there; its end is handled (`why_down` says why when it cannot come back now). ASKED: a
# start was asked for (Spawn), its answer not yet heard.
STARTING, READY, LEAVING, RETIRING, DOWN, ASKED = "starting", "ready", "leaving", "retiring", "down", "asked"


class SlotStates(list):
    """Each slot's state (a list: read as one), which keeps what every pump asks of it current as it is written:
    `usable`, the slots that take jobs (READY, or STARTING: parked until its hello), and `starting`, those of
    them STARTING. A slot's state changes a few times in a worker's life; a pump runs twice a run."""

    def __init__(self, n: int):
        super().__init__([DOWN] * n)
        self.usable: tuple = ()
        self.starting: tuple = ()

    def __setitem__(self, slot: int, state: str) -> None:
        super().__setitem__(slot, state)
        self.usable = tuple([s for s, now in enumerate(self) if now == READY or now == STARTING])
        self.starting = tuple([s for s in self.usable if self[s] == STARTING])


def died(worker, ended: str, node: str, down: str | None, tries: int, retries: int) -> WorkerDied:
    """The error of an input whose every try was lost with the worker running it (`tries` made of it)."""
    then = "run again, or pass retries=N" if not retries else f"{tries} tries, each lost to a dead worker " \
                                                                f"(retries={retries})"
    replaced = "the pool replaced it" if down is None else f"a new worker {down}"
    return WorkerDied(f"worker {worker.id} (pid {worker.pid}) {ended} while running node `{node}`; {replaced}: "
                      f"{then}", worker=worker.id, pid=worker.pid, node=node, tries=tries)


class OutOfOrder(SomaError):
    """An event the core cannot take in its state (a bug in the loop that calls it): never a silent hang."""


class WorkerEvents:
    """The workers' half of HostCore (its `state`, `workers`, `why_down`, `dispatch` and `out` are the core's)."""

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
        dispatch.slot_lost(slot)
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
                job.slot, job.asked_back = None, False  # (a give-back its worker did not answer: all of it goes)
                requeued.append(job)
                continue
            node = running.get(job.id, job.piece.entry) if running is not None else job.piece.entry
            self._lost_running(job, worker, ended, node, down)
        dispatch.waiting.add_first(requeued)
        self._pump()

    def _lost_running(self, job: Job, worker, ended: str, node: str, down: str | None) -> None:
        flow = job.flow
        if flow.tries <= flow.retries:
            self._try_again(flow)
            return
        self._end_job(job, False, died(worker, ended, node, down, flow.tries, flow.retries))

    def _try_again(self, flow: Flow) -> None:
        """Run the input again from the program's start; what is left of its last try is dropped."""
        old = list(flow.jobs)
        flow.jobs.clear()
        flow.tries += 1
        self._cancel_jobs([job for job in old if job.id in self.dispatch.outstanding])
        self._enqueue(self.walker.start(flow, flow.x))

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
            self.out.append(Retire(slot, why, self.workers[slot]))
