"""soma's main job in one screen: GIL-bound Python nodes really run in parallel on worker processes.

    python examples/gil_demo.py [MS] [ROUNDS]        (or: soma demo)

Four branches of pure-Python work in one wave. The in-process Executor runs each
branch on its own thread, and the threads take turns on the GIL. soma.Local runs
the same graph on worker processes (`python -m soma.worker`, the `soma-worker`
program), two branches per worker here, so the work is spread across the cores.
Same graph, same answer, no code change.

The speed-up is measured the way `soma bench` measures (benchmarks/_harness.py):
the Executor and Local run in alternation, each round starting with the other
one, and the speed-up is taken round by round, so both meet the same machine.
It prints the median over the rounds with the lowest and highest, and how much
CPU other programs (and the hypervisor, on a VM) took meanwhile: a busy machine
is a low speed-up, not a soma that does not work. About 6 s on two cores.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import sys
import time

import soma
from soma import Done, Graph, Node

BUSY = 25.0  # % of a core taken by others (or stolen) that makes the measurement worth a warning


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
    """How many iterations of `work` take about `ms` milliseconds here (the fastest of 3 tries)."""
    n = 100_000
    best = min(timed(work, n) for _ in range(3))
    return max(1, int(n * ms / 1e3 / best))


def timed(fn, *args) -> float:
    gc.collect()  # the previous contender's garbage is not this one's cost
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def alternate(contenders: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each contender, one call each per round, each round starting one later (A B, B A, ...)."""
    names = list(contenders)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(timed(contenders[name]))
    return samples


class MachineShare:
    """CPU that went to other programs (and to other VMs: steal) between construction and `others()`.

    /proc/stat counts every busy tick of the machine; this process and its
    children (the workers, once closed and waited for) count their own.
    """

    def __init__(self):
        self.wall, (self.busy, self.steal), self.own = time.perf_counter(), _machine_ticks(), _own_cpu()

    def others(self) -> tuple[float, float] | None:
        """(% of a core used by other programs, % of a core stolen), or None where /proc/stat is not there."""
        busy, steal = _machine_ticks()
        if busy is None or self.busy is None:
            return None
        wall, tick = time.perf_counter() - self.wall, os.sysconf("SC_CLK_TCK")
        others = max(0.0, (busy - self.busy) / tick - (_own_cpu() - self.own))
        return 100 * others / wall, 100 * (steal - self.steal) / tick / wall


def _machine_ticks() -> tuple[int | None, int | None]:
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = ([int(v) for v in f.readline().split()[1:]]
                                                                       + [0] * 8)[:8]
    except (OSError, ValueError):
        return None, None
    return user + nice + system + irq + softirq, steal


def _own_cpu() -> float:
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)))


def machine_report(share: tuple[float, float] | None, cores: int) -> list[str]:
    """What other programs took while the demo ran, and a warning when it was enough to lower the speed-up."""
    if share is None:
        return []
    others, steal = share
    lines = ["", f"while it ran, other programs used {others:.0f}% of a core and the hypervisor stole {steal:.0f}% "
                 f"(of {cores} cores: {cores * 100}%)"]
    if others + steal >= BUSY:
        lines.append(f"Other programs took the cores during this run ({others + steal:.0f}% of a core on average): "
                     f"the speed-up above is lower than this machine gives when it is quiet. Run `soma demo` again "
                     f"when it is.")
    return lines


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        return " ".join(a.decode() for a in args[:4] if a) + " ..."
    except OSError:
        return "?"


def main(ms: float = 100.0, rounds: int = 7, workers: int | None = None) -> float:
    branches, cores = 4, os.cpu_count() or 1
    workers = workers or min(cores, branches)
    limit = min(branches, workers, cores)
    machine = MachineShare()
    n = calibrate(ms)
    g = Graph.somatize(Crunch(n).named("a") | Crunch(n).named("b") | Crunch(n).named("c") | Crunch(n).named("d"))
    print(f"graph:   {g}")
    print(f"work:    {branches} branches x ~{ms:.0f} ms of pure Python each; {cores} cores, {workers} workers")
    print(f"rounds:  {rounds}, each runs the Executor and Local once, alternating which goes first\n")

    executor = soma.Executor()
    with soma.Local(workers=workers) as local:
        expected, out = executor.run(g, None), local.run(g, None)  # warm: each worker loads the node code once
        assert [v for _, v in out] == [v for _, v in expected], "Local and the Executor disagree"
        times = alternate({"executor": lambda: executor.run(g, None), "local": lambda: local.run(g, None)}, rounds)
        workers_seen = [(pid, command_line(pid)) for pid in local.pids()]
    labels = {"executor": "Executor (threads, one process)", "local": f"Local    ({workers} worker processes)"}
    for name, label in labels.items():
        t = [s * 1e3 for s in times[name]]
        print(f"{label:34} {statistics.median(t):6.0f} ms  (median; {min(t):.0f}-{max(t):.0f})")
    ratios = [e / loc for e, loc in zip(times["executor"], times["local"])]
    speedup = statistics.median(ratios)
    print(f"\nspeed-up: {speedup:.2f}x (median of {rounds} rounds, range {min(ratios):.2f}x-{max(ratios):.2f}x; "
          f"the limit here is {limit}x)\n")
    print("where each branch ran:", ", ".join(f"{nid}→{w}" for nid, (w, _) in zip("abcd", out)))
    for pid, line in workers_seen:
        print(f"  worker pid {pid}: {line}")

    for line in machine_report(machine.others(), cores):  # after close: the workers' CPU now counts as ours
        print(line)
    return speedup


if __name__ == "__main__":
    main(ms=float(sys.argv[1]) if len(sys.argv) > 1 else 100.0, rounds=int(sys.argv[2]) if len(sys.argv) > 2 else 7)
