"""HostLoop's half for workers coming and going: spawned, said hello, ended (died, or retired by the core), found
dead, started again when due; and what a caller asks of the pool (wait_ready; snapshot: Local.snapshot). The
loop's lock is held for all of it (loop.py); what happens is told to the core (core_workers.py has the core's side
of the same events)."""

from __future__ import annotations

import time

from ...errors import WorkerDied
from .listener import PUMP_S


class WorkerLife:
    """HostLoop's methods for workers' lives (its `pool`, `core`, `all_ready`, `closing`, `trace`, `_held`)."""

    def wait_ready(self, deadline: float) -> None:
        """Until every worker has said hello; WorkerDied naming the first that cannot, or did not in time."""
        while not self.all_ready.wait(max(0.0, min(PUMP_S, deadline - time.monotonic()))):
            for slot, why in enumerate(self.core.why_down):  # (read without the lock: what the listener saw)
                if why is not None:
                    worker = self.pool.worker(slot)
                    raise WorkerDied(f"worker w{slot} {why}", worker=f"w{slot}",
                                     pid=getattr(worker, "pid", None), node=None)
            if time.monotonic() >= deadline:
                slot = next((s for s, state in enumerate(self.core.state) if state != "ready"), 0)
                worker = self.pool.worker(slot)
                raise WorkerDied(f"worker w{slot} (pid {getattr(worker, 'pid', '?')}) did not say hello in time",
                                 worker=f"w{slot}", pid=getattr(worker, "pid", None), node=None)

    def snapshot(self) -> tuple:
        """`(inputs, jobs out per slot, jobs waiting, node ids each slot's worker runs)` now (Local.snapshot)."""
        with self._held():
            inputs, jobs, waiting = self.core.in_flight()
            return inputs, jobs, waiting, [[node for _, node in self.core.still_out(s, self.pool.running(s))]
                                           for s in range(len(jobs))]

    def _spawn(self, slot: int) -> None:
        """The first worker of `slot`, or why there is none (the machine refused it: tried again soon)."""
        try:
            worker = self.pool.spawn(slot)
        except OSError as err:
            self.core.down(slot, f"could not be started: {type(err).__name__}: {err}")
            return
        self.all_ready.clear()
        self.core.spawned(slot, worker)

    def _start_due(self, slot: int | None = None, wanted: bool = False) -> None:
        """Slots whose next worker is due start it (`wanted`: the core asked, for inputs wait for it)."""
        started = self.pool.start_due(slot, wanted)
        for due, worker in started:
            if worker is not None:
                self.all_ready.clear()
                self.core.spawned(due, worker)
            elif self.core.state[due] in ("down", "asked"):
                self.core.down(due, self.pool.why_down(due))
        if wanted and not started and self.core.state[slot] == "asked":  # (not due: backing off)
            self.core.down(slot, self.pool.why_down(slot))

    def _end(self, worker, why: str | None) -> None:
        """A worker's end (it died, or the core retired it): the core hears what it held, then a replacement
        is started (unless closing)."""
        if worker is None:
            return
        slot = worker.slot
        ended, running = self.pool.end(worker, why)
        self._unreachable.pop(slot, None)
        started = [] if self.closing else self.pool.start_due(slot)
        replacement = started[0][1] if started else None
        down = None if replacement is not None else (
            "was not replaced: the pool is closing" if self.closing else self.pool.why_down(slot))
        self.core.lost(slot, worker, ended, running, down)
        if replacement is not None:
            self.all_ready.clear()
            self.core.spawned(slot, replacement)

    def _look_at_workers(self) -> None:
        """Dead workers: what they sent before dying is received first (still a result), then their end; a slot
        that could not be started again is tried again (lock held)."""
        dead = self.pool.find_dead()
        if dead:
            self._drain()
            for worker in dead:
                self._end(worker, None)
        self._start_due()

    def _ready(self, slot: int) -> None:
        worker = self.pool.worker(slot)
        trace = self.trace
        if trace is not None:  # a worker started inside a trace block: its start (imports, connecting) is a span
            trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")
            trace.thread(worker.pid, 0, "start")
            trace.span(f"start worker {worker.id}", "start", worker.spawned_ns, time.monotonic_ns(), worker.pid, 0,
                       {"worker": worker.id})
        self.core.ready(slot)
        if all(state == "ready" for state in self.core.state):
            self.all_ready.set()
