"""soma's main job in one screen: GIL-bound Python nodes really run in parallel on worker processes.

    python examples/gil_demo.py        (or: soma demo)

Four branches of pure-Python work in one wave. The in-process Executor runs each
branch on its own thread, and the threads take turns on the GIL. soma.Local runs
the same graph on worker processes (`python -m soma.worker`, the `soma-worker`
program), two branches per worker here, so the work is spread across the cores.
Same graph, same answer, no code change.
"""

from __future__ import annotations

import os
import sys
import time

import soma
from soma import Done, Graph, Node


def work(n: int) -> int:
    """Pure-Python arithmetic: it holds the GIL the whole time."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


class Crunch(Node):
    def __init__(self, n: int):
        self.n = n

    def forward(self, x, ctx):
        return Done((ctx.worker, work(self.n)))


def calibrate(ms: float) -> int:
    """How many iterations of `work` take about `ms` milliseconds on this machine."""
    n = 100_000
    t0 = time.perf_counter()
    work(n)
    return max(1, int(n * ms / 1e3 / (time.perf_counter() - t0)))


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        return " ".join(a.decode() for a in args[:4] if a) + " ..."
    except OSError:
        return "?"


def best_of(k, fn) -> float:
    times = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(branches: int = 4, ms: float = 100.0, workers: int | None = None) -> float:
    cores = os.cpu_count() or 1
    workers = workers or min(cores, branches)
    n = calibrate(ms)
    g = Graph.somatize(Crunch(n).named("a") | Crunch(n).named("b") | Crunch(n).named("c") | Crunch(n).named("d"))
    print(f"graph:   {g}")
    print(f"work:    {branches} branches x ~{ms:.0f} ms of pure Python each; {cores} cores, {workers} workers\n")

    executor = soma.Executor()
    expected = executor.run(g, None)
    t_exec = best_of(2, lambda: executor.run(g, None))
    print(f"Executor (threads, one process): {t_exec * 1e3:7.0f} ms")

    with soma.Local(workers=workers) as local:
        out = local.run(g, None)  # warm: each worker loads the node code once
        assert [v for _, v in out] == [v for _, v in expected], "Local and the Executor disagree"
        t_local = best_of(2, lambda: local.run(g, None))
        print(f"Local    ({workers} worker processes):   {t_local * 1e3:7.0f} ms")
        print(f"\nspeed-up: {t_exec / t_local:.2f}x (the limit here is {min(branches, workers, cores)}x)\n")
        print("where each branch ran:", ", ".join(f"{nid}→{w}" for nid, (w, _) in zip("abcd", out)))
        for pid in local.pids():
            print(f"  worker pid {pid}: {command_line(pid)}")
    return t_exec / t_local


if __name__ == "__main__":
    main(ms=float(sys.argv[1]) if len(sys.argv) > 1 else 100.0)
