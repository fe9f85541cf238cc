"""soma's main job in one screen: GIL-bound Python nodes really run in parallel on worker processes.

    python examples/gil_demo.py [MS] [ROUNDS] [--trace FILE]        (or: soma demo [--trace FILE])

Four branches of pure-Python work in one wave. The in-process Executor runs each
branch on its own thread, and the threads take turns on the GIL. soma.Local runs
the same graph on worker processes (the `soma-worker` program, `python -m
soma.local.worker`), two branches per worker here, so the work is spread across
the cores.
Same graph, same answer, no code change.

Then many inputs: `map` sends 8 inputs of ~50 ms of pure Python each through a
one-node graph. `Executor.map` runs them one after another in this process;
`Local.map` keeps both workers busy with different inputs (the node has a copy
on each), and yields the outputs in input order.

The speed-up is measured the way `soma bench` measures (benchmarks/_harness.py):
the Executor and Local run in alternation, each round starting with the other
one, and the speed-up is taken round by round, so both meet the same machine.
It prints the median over the rounds with the lowest and highest, the most a
round can show on the same machine (branches, workers and cores allow), and how
much CPU other programs (and the hypervisor, on a VM) took meanwhile, as an
average over the run: a busy machine is a low speed-up, not a soma that does not
work. It says only what it measured: a round above the most is one where the
machine changed between the two turns, and an average share of the CPU bounds no
single round. Every answer of every round is
checked against the Executor's. About 10 s on two cores. `--trace FILE` also
writes a timeline of Local's wave and map (docs/trace.md; Local's times then
include the recording).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import statistics
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


class CrunchInput(Node):
    """For map: the input, where it ran, and the work's result."""

    def __init__(self, n: int):
        self.n = n

    def forward(self, x, ctx):
        return Done((x, ctx.worker, work(self.n)))


def calibrate(ms: float) -> int:
    """How many iterations of `work` take about `ms` milliseconds here (the fastest of 3 tries)."""
    n = 100_000
    best = min(timed(work, n) for _ in range(3))
    return max(1, int(n * ms / 1e3 / best))


def timed(fn, *args) -> float:
    return timed_call(fn, *args)[0]


def timed_call(fn, *args):
    """(seconds, what `fn` returned)."""
    gc.collect()  # the previous contender's garbage is not this one's cost
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def alternate(contenders: dict, rounds: int, check) -> dict[str, list[float]]:
    """Seconds per call of each contender, one call each per round, each round starting one later (A B, B A, ...).

    `check(name, out)` looks at every answer, after the clock stops.
    """
    names = list(contenders)
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds, out = timed_call(contenders[name])
            check(name, out)
            samples[name].append(seconds)
    return samples


def report(times: dict, labels: dict, limit: int, bound: str, what: str) -> float:
    """Each contender's median and range, then the speed-up taken round by round; returns the speed-up."""
    for name, label in labels.items():
        t = [s * 1e3 for s in times[name]]
        print(f"{label:34} {statistics.median(t):6.0f} ms  (median; {min(t):.0f}-{max(t):.0f})")
    ratios = [e / loc for e, loc in zip(times["executor"], times["local"])]
    print()
    for line in speedup_lines(what, ratios, limit, bound):
        print(line)
    print()
    return statistics.median(ratios)


def speedup_lines(what: str, ratios: list[float], limit: int, bound: str) -> list[str]:
    """What the rounds measured (each round's Executor time over Local's) and what bounds it: `limit`, the most
    a round can show when both contenders meet the same machine, for the reason `bound`.

    A round can still come out above it: the machine is not the same for both (another program takes a core
    during one turn, a VM's cores change speed). That is said as what it is, and the median, not the best
    round, is the figure given.
    """
    speedup, n = statistics.median(ratios), len(ratios)
    lines = [f"{what}speed-up: {speedup:.2f}x, the median of {n} rounds (each round's Executor time over Local's: "
             f"{min(ratios):.2f}x to {max(ratios):.2f}x)",
             f"  at most {limit}x when both meet the same machine: {bound}"]
    above = sum(ratio > limit for ratio in ratios)
    if above:
        lines.append(f"  {above} of {n} rounds came out above {limit}x: in those the machine ran the Executor's turn "
                     f"slower than Local's (another program took a core, or the cores' speed changed), so they "
                     f"compare two machines; " + ("the median is the figure to quote" if speedup <= limit else
                                                  "run it again for a figure to quote"))
    return lines


def same_answers(what: str, strip_worker):
    """A check for `alternate`: every answer equals the Executor's, the worker that ran it aside."""
    expected = []

    def check(name, out):
        if not expected:
            expected.append([strip_worker(v) for v in out])
        if [strip_worker(v) for v in out] != expected[0]:
            raise SystemExit(f"{name} gave other answers than before ({what}): soma is broken here")

    return check


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


def machine_report(share: tuple[float, float] | None, cores: int, quiet: str = "") -> list[str]:
    """What other programs took while the demo ran (measured: an average over the whole run), and, when it was
    enough to lower the speed-ups, what that means for them. `quiet`: what a quiet machine shows.

    It says only what was measured: an average share cannot bound a speed-up (other programs' work comes and
    goes, so one round may meet all of it and the next none), so no "most it could be" is drawn from it.
    """
    if share is None:
        return []
    others, steal = share
    lines = ["", f"while it ran, other programs used {others:.0f}% of a core and the hypervisor stole {steal:.0f}% "
                 f"(of {cores} cores: {cores * 100}%)"]
    if others + steal >= BUSY:
        free = max(0.0, cores - (others + steal) / 100)
        lines.append(f"That left about {free:.1f} of its {cores} cores free on average, more at some moments and "
                     f"less at others: a round that met the other programs' work ran slower, so the figures above "
                     f"are this busy machine's, not a quiet one's{f' ({quiet})' if quiet else ''}; run it again on a "
                     f"quiet machine for figures to quote.")
    return lines


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if "-c" in args:  # Local's bootstrap (soma/local/host/procs.py): the host's sys.path, then the worker's main
        at = args.index("-c")
        args[at:at + 2] = ["-c", "'<sys.path from the host>; soma.local.worker.main()'"]
    return " ".join(args[:args.index("--tasks") + 2] if "--tasks" in args else args[:4]) + " ..."


def main(ms: float = 100.0, rounds: int = 7, workers: int | None = None, map_inputs: int = 8,
         map_ms: float = 50.0, trace: str | None = None) -> float:
    branches, cores = 4, os.cpu_count() or 1
    workers = workers or min(cores, branches)
    limit = min(branches, workers, cores)
    machine = MachineShare()
    n = calibrate(ms)
    g = Graph.somatize(Crunch(n).named("a") | Crunch(n).named("b") | Crunch(n).named("c") | Crunch(n).named("d"))
    many = Graph.somatize(CrunchInput(max(1, round(n * map_ms / ms))))
    xs = list(range(map_inputs))
    print(f"graph:   {g}")
    print(f"work:    {branches} branches x ~{ms:.0f} ms of pure Python each; {cores} cores, {workers} workers")
    print(f"rounds:  {rounds}, each runs the Executor and Local once, alternating which goes first\n")

    executor = soma.Executor()
    with soma.Local(workers=workers) as local, (local.trace(trace) if trace else contextlib.nullcontext()):
        out = local.run(g, None)  # warm: each worker loads the node code once
        wave_check = same_answers("the wave", lambda branch: branch[1])
        wave_check("executor", executor.run(g, None))
        wave_check("local", out)
        times = alternate({"executor": lambda: executor.run(g, None), "local": lambda: local.run(g, None)}, rounds,
                          wave_check)
        map_check = same_answers("map", lambda output: (output[0], output[2]))
        map_check("executor", list(executor.map(many, xs)))
        mapped = list(local.map(many, xs))  # warm: the node's copy on each worker
        map_check("local", mapped)
        map_times = alternate({"executor": lambda: list(executor.map(many, xs)),
                               "local": lambda: list(local.map(many, xs))}, rounds, map_check)
        workers_seen = [(pid, command_line(pid)) for pid in local.pids()]
    speedup = report(times, {"executor": "Executor (threads, one process)",
                             "local": f"Local    ({workers} worker processes)"}, limit,
                     f"{branches} branches on {workers} worker processes and {cores} cores, so at most {limit} "
                     f"at once", "")
    print("where each branch ran:", ", ".join(f"{nid}→{w}" for nid, (w, _) in zip("abcd", out)))
    for pid, line in workers_seen:
        print(f"  worker pid {pid}: {line}")

    print(f"\nmap:     {len(xs)} inputs x ~{map_ms:.0f} ms of pure Python through one node: {many}")
    print(f"rounds:  {rounds}, each maps all {len(xs)} inputs on the Executor and on Local, alternating\n")
    map_limit = min(len(xs), workers, cores)
    report(map_times, {"executor": "Executor.map (one input at a time)",
                       "local": f"Local.map    ({workers} worker processes)"}, map_limit,
           f"{len(xs)} inputs on {workers} worker processes and {cores} cores, so at most {map_limit} at once, where "
           f"the Executor runs one", "map ")
    ran = {}
    for _, worker, _ in mapped:
        ran[worker] = ran.get(worker, 0) + 1
    print("where the inputs ran:", ", ".join(f"{w}: {count}" for w, count in sorted(ran.items())))
    if trace:
        print(f"\ntrace of Local's wave and map: {trace} (open it in https://ui.perfetto.dev)")

    quiet = f"about {limit}x for the wave and {map_limit}x for the map"
    for line in machine_report(machine.others(), cores, quiet):  # after close: the workers' CPU counts
        print(line)
    return speedup


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ms", nargs="?", type=float, default=100.0, help="ms of work per branch (default 100)")
    parser.add_argument("rounds", nargs="?", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--trace", metavar="FILE", help="also write a timeline of Local's wave and map to FILE")
    args = parser.parse_args()
    main(ms=args.ms, rounds=args.rounds, trace=args.trace)
