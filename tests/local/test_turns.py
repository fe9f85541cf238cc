"""Where a wave's branch waits when there are more branches than workers (docs/local.md, "Where a branch waits").

A worker given several branches at once runs those that compute (hold the GIL) one at a time, as a process
pool would, and lets branches that let go of the GIL (a sleep, I/O, a wait) run beside each other. Each node
here returns where and when it ran; the test reads the intervals per process.
"""

import os
import time

import pytest

from soma import Done, Graph, Node
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
