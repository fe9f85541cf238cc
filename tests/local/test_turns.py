"""Where a wave's branch waits when there are more branches than workers (docs/local.md, "Where a branch waits").

A worker given several branches at once runs those that compute (hold the GIL) one at a time, as a process
pool would, and lets branches that let go of the GIL (a sleep, I/O, a wait) run beside each other. Each node
here returns where and when it ran; the test reads the intervals per process.
"""

import os
import threading
import time

import pytest

from soma import Done, Graph, Node
from soma.local.worker.turns import LETS_GO_AFTER, STUCK_S, Turns
from tests.local.nodes import burn

pytestmark = pytest.mark.timeout(120)


class BurnStamped(Node):
    """Pure-Python work of a fixed size; returns (pid, start, end) of its run, from this machine's clock."""

    def __init__(self, n: int, tag: int):
        self.n, self.tag = n, tag

    def forward(self, x, ctx):
        start = time.monotonic()
        burn(self.n)
        return Done((os.getpid(), start, time.monotonic()))


class SleepStamped(Node):
    """Sleeps (lets go of the GIL); returns (pid, start, end) of its run."""

    def __init__(self, seconds: float, tag: int):
        self.seconds, self.tag = seconds, tag

    def forward(self, x, ctx):
        start = time.monotonic()
        time.sleep(self.seconds)
        return Done((os.getpid(), start, time.monotonic()))


def wave(make, branches: int) -> Graph:
    expr = make(0)
    for tag in range(1, branches):
        expr = expr | make(tag)
    return Graph.somatize(expr)


def overlaps(stamps) -> list:
    """Pairs of runs in one process whose intervals overlap."""
    found = []
    for i, (pid, start, end) in enumerate(stamps):
        for other_pid, other_start, other_end in stamps[i + 1:]:
            if pid == other_pid and start < other_end and other_start < end:
                found.append(((start, end), (other_start, other_end)))
    return found


def burn_size(seconds: float) -> int:
    n, start = 200_000, time.perf_counter()
    burn(n)
    return max(10_000, int(n * seconds / max(1e-6, time.perf_counter() - start)))


def test_gil_bound_branches_take_turns_in_a_worker(local):
    """Four pure-Python branches on two workers: each worker gets two, and never runs them at once (the first
    wave too: a piece not measured yet takes turns). Before Dec 3 each worker ran its two on two threads that
    handed one GIL back and forth."""
    g = wave(lambda tag: BurnStamped(burn_size(0.05), tag), 4)
    for _ in range(3):
        stamps = local.run(g, None)
        assert len({pid for pid, _, _ in stamps}) == 2, stamps  # spread over both workers
        assert not overlaps(stamps), overlaps(stamps)


def test_branches_that_let_go_of_the_gil_still_run_at_once_in_a_worker(local):
    """Four sleeping branches on two workers: once measured (they let go of the GIL), a worker's two run
    beside each other: the wave takes about one sleep, not two."""
    g = wave(lambda tag: SleepStamped(0.3, tag), 4)
    local.run(g, None)  # measured here
    best = None
    for _ in range(3):
        stamps = local.run(g, None)
        assert len(overlaps(stamps)) == 2, stamps  # each worker's two, at once
        took = max(end for _, _, end in stamps) - min(start for _, start, _ in stamps)
        best = took if best is None else min(best, took)
    assert best < 0.55, best


def job(turns: Turns, piece: int, work) -> None:
    """One job of `piece` as a worker's lane runs it: measured between enter and leave."""
    token = turns.enter(piece, None)
    try:
        work()
    finally:
        turns.leave(piece, token)


def at_once(turns: Turns, works: dict) -> None:
    """A job of each piece, each on its own thread, started together (as a wave's branches in one worker)."""
    threads = [threading.Thread(target=job, args=(turns, piece, work)) for piece, work in works.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="turns measure from /proc")
def test_jobs_that_share_the_gil_are_never_judged_to_let_go_of_it():
    """Two pieces seen to let go of the GIL (they slept) now compute on two threads of one process at once:
    each gets about half the GIL, so computes about half its wall time. Before Dec 3 that half judged them
    GIL-releasing again and again (a wave's two pure-Python branches kept overlapping); now they take turns
    from their next job on. A sleeping job beside a computing one keeps its verdict."""
    turns = Turns()
    sleeps_until_let_go(turns, 1, 2)
    n = burn_size(0.1)
    at_once(turns, {1: lambda: burn(n), 2: lambda: burn(n)})
    assert turns.lets_go == {1: 0, 2: 0}, turns.lets_go
    sleeps_until_let_go(turns, 3)
    at_once(turns, {1: lambda: burn(3 * n), 3: lambda: time.sleep(0.2)})
    assert turns.lets_go[1] == 0 and turns.lets_go[3] >= LETS_GO_AFTER, turns.lets_go


def sleeps_until_let_go(turns: Turns, *pieces) -> None:
    """Sleeping jobs of `pieces` at once until each is seen to let go of the GIL (a wake-up that waits long
    for a core on a busy machine counts as computing: a job may need another try)."""
    deadline = time.monotonic() + 30
    while any(turns.lets_go.get(piece, 0) < LETS_GO_AFTER for piece in pieces):
        assert time.monotonic() < deadline, turns.lets_go
        at_once(turns, {piece: lambda: time.sleep(0.2) for piece in pieces})


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="turns measure from /proc")
@pytest.mark.parametrize("waits", ["at once", "polling"])
def test_a_job_waiting_for_a_sibling_in_its_worker_lets_the_sibling_run(waits):
    """A job holding the turn waits for another job of the same worker (branches that need each other): the
    other goes once the first is seen blocked, whether it waits in one sleep or polls in 1 ms sleeps (those
    look like waiting for the GIL at first: it goes after STUCK_S then). Never a deadlock."""
    turns, ready, done = Turns(), threading.Event(), threading.Event()

    def first():
        ready.set()
        if waits == "at once":
            done.wait(30)
        else:
            deadline = time.monotonic() + 30
            while not done.is_set() and time.monotonic() < deadline:
                time.sleep(0.001)
    holder = threading.Thread(target=job, args=(turns, 1, first))
    holder.start()
    assert ready.wait(30)
    start = time.monotonic()
    job(turns, 2, done.set)  # (takes the turn: not measured yet)
    took = time.monotonic() - start
    holder.join(30)
    assert done.is_set() and not holder.is_alive()
    assert took < 20, took  # (30 s: the holder gave up waiting; the sibling never ran beside it)


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="turns measure from /proc")
@pytest.mark.parametrize("computes_s", [0.4, 3.0])
def test_a_holder_asleep_while_a_thread_that_runs_no_job_computes_keeps_its_turn(computes_s):
    """The holder of the turn sleeps on a lock that a thread running no job holds while it computes (a piece's
    first job waiting on an import another thread runs; under load, a GIL holder waiting for a core looks the
    same): it is not blocked, so the waiting job waits for it, not just BLOCKED_S (a wave's two pure-Python
    branches ran at once beside two CPU burners, 1 wave in ~40). A thread that computes for ever holds the
    waiting job up for STUCK_S of quiet windows, not as long as it computes (3 STUCK_S here)."""
    turns, lock, holding, done = Turns(), threading.Lock(), threading.Event(), threading.Event()

    def computes():  # runs no job: not on the turns' clock
        with lock:
            holding.set()
            end = time.monotonic() + computes_s
            while time.monotonic() < end:
                pass
            done.set()  # (before the holder can have the lock: it is set by the time the waiting job may go)

    def holder():
        with lock:  # asleep until the computing thread lets go
            pass
    threading.Thread(target=computes).start()
    assert holding.wait(30)
    first = threading.Thread(target=job, args=(turns, 1, holder))
    first.start()
    deadline = time.monotonic() + 30
    while not turns.holders and time.monotonic() < deadline:
        time.sleep(0.001)
    start = time.monotonic()
    entered = []
    job(turns, 2, lambda: entered.append((time.monotonic(), done.is_set(), first.is_alive())))
    first.join(30)
    assert done.wait(30)
    at, computing_over, _ = entered[0]
    if computes_s < STUCK_S:
        assert computing_over, f"went {at - start:.3f} s in, while the holder still waited for the computing thread"
    else:
        assert not computing_over, f"went {at - start:.3f} s in, after the computing thread's {computes_s} s"


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="turns measure from /proc")
def test_a_thread_waiting_for_a_core_keeps_the_process_from_looking_quiet(monkeypatch):
    """The kernel adds a thread's wait for a core to its schedstat only once the wait ends: a GIL holder kept off
    the cores for a whole window added nothing, the process looked quiet, and a waiting job went in beside the
    job that waited for that holder (the test above, [0.4]: 1 in ~15 runs of this file beside two CPU burners,
    Dec 7; 110 ms of a 125 ms window unaccounted). Here no schedstat moves (what the kernel shows while that
    thread waits) and another thread is runnable: the waiting job waits until none is."""
    from soma.local.worker import turns as turns_module

    monkeypatch.setattr(turns_module, "_schedstat", lambda fd: (0, 0))  # (nothing moves: as during that wait)
    monkeypatch.setattr(turns_module, "STUCK_S", 60.0)  # (only the runnable thread may hold the job up here)
    runnable, looks = threading.Event(), []
    runnable.set()

    def reads(fd):
        looks.append(runnable.is_set())
        return runnable.is_set()
    monkeypatch.setattr(turns_module, "_runnable", reads, raising=False)  # (without the fix: fails below)
    turns, release, entered = Turns(), threading.Event(), []
    holder = threading.Thread(target=job, args=(turns, 1, lambda: release.wait(30)))
    holder.start()
    deadline = time.monotonic() + 30
    while not turns.holders and time.monotonic() < deadline:
        time.sleep(0.001)
    waiting = threading.Thread(target=job, args=(turns, 2, lambda: entered.append(runnable.is_set())))
    waiting.start()
    while len(looks) < 3 and not entered and time.monotonic() < deadline:  # (three windows refused: it waits)
        time.sleep(0.001)
    runnable.clear()
    waiting.join(30)
    release.set()
    holder.join(30)
    assert entered == [False], (entered, looks)  # it went in only once no other thread was runnable
    assert looks[:3] == [True, True, True], looks
