"""HostCore's events for a map's chunks (chunks.py has their rules): what becomes of a chunk's answers, of a
chunk whose worker died, and of a chunk that holds inputs behind a straggler. Part of the core (a base of
HostCore: the same state, the same purity: no locks, no I/O)."""

from __future__ import annotations

from ...errors import RunTimeout
from . import chunks
from .core_workers import died
from .events import Bundled, CancelAt, Deliver
from .flows import Chunk, Job, chunk_base, stale
from .outcomes import internal, record_chunk


class ChunkEvents:
    """The chunk half of HostCore (its `chunk_jobs`, `dispatch`, `walker` and `out` are the core's)."""

    def _chunk_lost(self, job: Job, place: int, worker, ended: str, running, down: str | None) -> list:
        """A chunk's job whose worker died running the input at `place`: that input runs again if it has tries
        left (its own, `Chunk.tried`: a try counted), else fails (WorkerDied); the others it still owed (done
        and not reported, or not started) go again, no try counted: returns the job of those that go."""
        chunk = job.flow
        chunk.jobs.discard(job)
        self.chunk_jobs.pop(job.base, None)
        again = [p for p in job.pending if p != place]
        tries = chunk.tried.get(place, 1)
        if tries <= chunk.retries:
            chunk.tried[place] = tries + 1
            again.append(place)
        else:
            node = running.get(job.base + place, job.piece.entry) if running else job.piece.entry
            error = died(worker, ended, node, down, tries, chunk.retries)
            self._deliver_chunk(chunk, chunks.failed(chunk, [place], error))
        others = chunks.still_open(chunk, sorted(again))
        return [self._rest(job, others)] if others else []

    def _rest(self, job: Job, places: list) -> Job:
        """A new job of `job`'s chunk for these places (its inputs travel under new ids: an answer meant for
        `job` is never taken for it)."""
        again = self.walker.rest_of(job, places)
        self.chunk_jobs[again.base] = again
        job.flow.jobs.add(again)
        return again

    def _chunk_arrived(self, slot: int, worker, one: Bundled, now: float) -> None:
        """(Part of) a chunk's answer (chunks.py): each input's outcome delivered; what was handed back goes
        again; the job is over once every place it owed is answered."""
        base = chunk_base(one.jobs[0])
        job = self.chunk_jobs.get(base)
        if job is None or job.slot != slot:
            return  # (a job over: all it owed answered, handed on, or its chunk cancelled)
        chunk = job.flow
        if stale(job):  # (cancelled: what it owed is dropped as it comes)
            job.pending.difference_update(i - base for i in one.jobs)
            if not job.pending:
                self._chunk_job_over(job)
            return
        self.measures.weigh(job.piece, one.shm)
        try:
            items, back = chunks.arrived(job, one, worker)
        except Exception as err:  # never leave an input waiting forever on soma's own mistake
            items, back = chunks.failed(chunk, job.places, internal(err, f"handling the outcomes of node "
                                                                           f"`{job.piece.entry}`")), []
            job.pending.clear()
        if len(one.jobs) > job.pace[0]:
            job.pace = (len(one.jobs), one.seconds)
        if not job.pending:
            self._chunk_job_over(job)
            self.measures.learn(job, job.pace[1], now, count=len(job.places))
        back = chunks.still_open(chunk, back)
        if back:
            self.dispatch.waiting.add_first([self._rest(job, back)])
        if chunk.trace is not None:
            record_chunk(job, worker, one, items)
        self._deliver_chunk(chunk, items)

    def _chunk_job_over(self, job: Job) -> None:
        """A chunk's job owes nothing any more (what its worker still says of it is dropped)."""
        self.dispatch.give_back(job)
        job.flow.jobs.discard(job)
        self.chunk_jobs.pop(job.base, None)

    def stragglers(self, now: float) -> list:
        """`(slot, job)` of chunks' jobs out for long (an input of theirs is slow: it holds the others behind
        it) while a worker has nothing to do: the loop reads what those workers run and calls `hand_on`."""
        outstanding = self.dispatch.outstanding
        for base in [b for b, j in self.chunk_jobs.items() if stale(j) and outstanding.get(j.id) is not j]:
            del self.chunk_jobs[base]  # (over: dropped on a worker's end or hello, or never sent)
        if not self.chunk_jobs or self.dispatch.waiting:
            return []
        service_s = self.measures.service_s
        if not self.has_idle():
            return []
        found = []
        for job in self.chunk_jobs.values():
            if job.slot is None or len(job.pending) < 2 or job.asked_back or job in self.dispatch.parked[job.slot]:
                continue
            expected = service_s.get(job.piece.id, 0.0) * len(job.places)
            if now - job.sent_at > max(chunks.STRAGGLER_S, 4 * expected):
                found.append((job.slot, job))
        return found

    def hand_on(self, job: Job, running: list) -> None:
        """A chunk's job out for long (`stragglers`): its worker is asked to give back the inputs it owes after
        the one it runs now (`running`, its status page; all it owes when it runs none of them). It answers at
        once, with what it has done so far and the ones it had not started (`_given_back`): those, and only
        those, go to another worker. None runs twice: between the status page's look and the worker's answer,
        the worker may have started more of them (measured: a fresh worker that loaded the piece for 20 ms
        then ran hundreds of inputs before a cancel came; each of those then ran on two workers)."""
        if self.dispatch.outstanding.get(job.id) is not job or stale(job) or job.asked_back:
            return
        now = chunks.running(job, running)  # (a chunk runs in order: those before it are done, not yet reported)
        rest = chunks.still_open(job.flow, sorted(p for p in job.pending if now is None or p > now))
        if not rest:
            return
        job.asked_back = True  # (asked once: what it gives back goes when it answers)
        self.out.append(CancelAt(job.slot, [job.base + p for p in rest], give_back=True))

    def _given_back(self, slot: int, returned: list) -> None:
        """The worker of `slot` gave back these chunk inputs unstarted (`hand_on`'s answer): they go again,
        from the front of their line, as a new job of their chunk; the job they were given back from owes
        them no more."""
        by_job: dict = {}
        for job_id in returned:
            base = chunk_base(job_id)
            job = self.chunk_jobs.get(base) if base is not None else None
            if job is not None and job.slot == slot and job_id - base in job.pending:
                by_job.setdefault(job, []).append(job_id - base)
        for job, places in by_job.items():
            job.asked_back = False
            job.pending.difference_update(places)
            if not job.pending:
                self._chunk_job_over(job)
            rest = chunks.still_open(job.flow, sorted(places))
            if rest:
                self.dispatch.waiting.add_first([self._rest(job, rest)])

    def _expire_place(self, chunk: Chunk, place: int, timeout: float, running: dict) -> RunTimeout:
        """Input `place` of `chunk` ran out of time: it ends (never delivered), and its job never runs it again
        (Job.drop_place: not where it is now, nor where the job goes if its worker ends). Where its worker runs
        it now (its status page: `running`, slot → [(job id, node)]), that worker is retired (the chunk's other
        inputs there go again elsewhere, no try counted: `lost`); where it waits at a worker behind others,
        the worker is asked to drop it; where its job is not at a worker yet, the job goes without it."""
        where, waiting, retire = {}, [], None
        job = next((j for j in chunk.jobs if place in j.pending), None) if place in chunk.open else None
        if place in chunk.open:
            chunk.open.discard(place)
        if job is not None:
            job.drop_place(place)
            job_id = job.base + place
            sent = self.dispatch.outstanding.get(job.id) is job and job not in self.dispatch.parked[job.slot]
            nodes = [node for i, node in running.get(job.slot, ()) if i == job_id] if sent else []
            for node in nodes:
                where[node] = f"worker {self.workers[job.slot].id}"
                retire = job.slot
            if not nodes:
                waiting.append(job.piece.entry)
            if sent:
                if not nodes:
                    self.out.append(CancelAt(job.slot, [job_id]))
                if not job.pending:
                    self._chunk_job_over(job)
            elif not job.places:  # (stale now: dropped from its line, or given back at its worker's hello)
                chunk.jobs.discard(job)
                if self.chunk_jobs.get(job.base) is job:
                    del self.chunk_jobs[job.base]
        self._deliver_chunk(chunk, [])  # (its last input: the chunk is over)
        if retire is not None:
            self._retire(retire, "was stopped because a run timed out on it")
        return RunTimeout.after(timeout, where, waiting, "the workers running them were replaced" if retire is not None
                                else None)

    def _deliver_chunk(self, chunk: Chunk, items: list) -> None:
        for item in items:
            self.out.append(Deliver(chunk.sink, item))
        if not chunk.open and not chunk.finished:
            chunk.finished = True
            chunk.jobs.clear()  # (as HostCore._finish: each holds its chunk, a cycle)
            self.flows.pop(chunk, None)
