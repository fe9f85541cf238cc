"""gil_wave: do GIL-bound branches of one wave really run in parallel?

    python benchmarks/gil_wave.py [--quick] [--smoke] [--burners N] [--json out.json]   (or: soma bench gil_wave)

A wave of B branches, each W ms of work, for B in 1, 2, 4, 8 and workers 1..cores,
with two kinds of node:

    burn       pure Python (`burn(n)`: a fixed number of loop iterations calibrated once
               here, not a clock): it holds the GIL all along
    sleep      `time.sleep(W ms)`: it lets go of the GIL (as I/O, torch and numpy kernels do)

and in two conditions, one after the other in this one run:

    quiet      nothing else started here
    busy       N processes burning a core each beside it (`python -c 'while True: pass'`,
               --burners, default 2; killed at the end): a user's machine is busy, and a
               wave with more branches than workers must not pay for it more than a pool

Contenders, alternated round by round in this one process:

    serial     the B burns one after another on the calling thread (the reference
               the executor's threads fight over the GIL to match)
    executor   soma.Executor(): one thread per branch, one GIL
    local      soma.Local(workers=w): branches spread over worker processes
    threads    ThreadPoolExecutor(w)
    procpool   ProcessPoolExecutor(w, spawn)
    ray        Ray tasks (only with --ray, on a fresh local instance; at workers = cores)

Every answer is checked (each branch returns its own tag and the burn's value);
a wrong one fails the run, naming the contender.

Reported: wall time per wave, speed-up over the Executor (taken round by round),
the limit min(B, workers, cores): the best any contender can do, and Local's
speed-up over the process pool in the same rounds (a VM that gives two busy
processes less than two cores holds every contender back alike). In quick mode
only the case of issue 32 (B=4 on workers=2, and B=2) runs, for both kinds and
both conditions.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import multiprocessing as mp
import subprocess
import sys
import time

import _harness as h
from _work import BurnTagged, burn_tagged

import soma
from soma import Done, Graph, Node

NAME = "gil_wave"


def sleep_tagged(seconds: float, x):
    """`(x, seconds)` after sleeping that long: a node that lets go of the GIL."""
    time.sleep(seconds)
    return x, seconds


class SleepTagged(Node):
    """`sleep_tagged(seconds, tag)`: a wave's branch that waits, holding no GIL."""

    def __init__(self, seconds: float, tag):
        self.seconds, self.tag = seconds, tag

    def forward(self, x, ctx):
        return Done(sleep_tagged(self.seconds, self.tag))


KINDS = {  # kind → (its node for branch b, its function for a pool, given the work size)
    "burn": (lambda n, b: BurnTagged(n, tag=b), burn_tagged),
    "sleep": (lambda n, b: SleepTagged(n, b), sleep_tagged),
}


def wave(kind: str, n, branches: int) -> Graph:
    make = KINDS[kind][0]
    expr = make(n, 0)
    for b in range(1, branches):
        expr = expr | make(n, b)
    return Graph.somatize(expr)


def pool_wave(pool, kind: str, n, branches: int):
    return list(pool.map(KINDS[kind][1], [n] * branches, range(branches)))


@contextlib.contextmanager
def burners(count: int):
    """`count` processes burning a core each while the block runs; killed after, whatever happens.

    Each in a session of its own, as another program a user runs is: where the kernel groups
    CPU time by session (autogroup, on by default on desktop Linux), burners in this one's
    session would take their share from this process and its process pool only, while
    Local's workers (sessions of their own) would hardly meet them.
    """
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
             for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def checker(kind: str, n, branches: int):
    """`check(name, out)` for `alternate`: every branch's tag and result, in order.

    soma's graph of one node returns that node's value, not a 1-tuple.
    """
    expected = [KINDS[kind][1](n, b) if kind == "burn" else (b, n) for b in range(branches)]

    def check(name: str, out) -> None:
        soma_graph = name == "executor" or name.startswith("local/")
        h.expect(name, [out] if soma_graph and branches == 1 else list(out), expected)

    return check


def start_pools(worker_counts: list[int]) -> dict:
    """Every pool, started and warmed before anything is timed."""
    pools = {}
    spawn = mp.get_context("spawn")
    for w in worker_counts:
        pools["local", w] = soma.Local(workers=w).start()
        pools["threads", w] = cf.ThreadPoolExecutor(w)
        pools["procpool", w] = cf.ProcessPoolExecutor(w, mp_context=spawn)
    return pools


def contenders_for(pools: dict, worker_counts: list[int], kind: str, n, branches: int, ray) -> dict:
    g = wave(kind, n, branches)
    executor = soma.Executor()
    call = KINDS[kind][1]
    contenders = {
        "serial": lambda: [call(n, b) for b in range(branches)],
        "executor": lambda: executor.run(g, None),
    }
    for w in worker_counts:
        local, threads, procpool = pools["local", w], pools["threads", w], pools["procpool", w]
        contenders[f"local/{w}"] = lambda local=local: local.run(g, None)
        contenders[f"threads/{w}"] = lambda pool=threads: pool_wave(pool, kind, n, branches)
        contenders[f"procpool/{w}"] = lambda pool=procpool: pool_wave(pool, kind, n, branches)
    if ray is not None:
        task = ray.remote(call)
        contenders[f"ray/{h.CORES}"] = lambda: ray.get([task.remote(n, b) for b in range(branches)])
    return contenders


def own_args(argv) -> tuple:
    """`--burners N` (this benchmark's own), and the rest for the harness."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--burners", type=int, default=2)
    mine, rest = parser.parse_known_args(argv)
    return mine.burners, rest


def main(argv=None) -> list[dict]:
    count, argv = own_args(sys.argv[1:] if argv is None else argv)
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    smoke = args.smoke
    width_ms = 5 if smoke else 50
    branch_counts = [1, 2] if smoke else [2, 4] if args.quick else [1, 2, 4, 8]
    worker_counts = [h.CORES] if smoke or args.quick else list(range(1, h.CORES + 1))
    repeat = suite.repeat(full=7, quick=3)
    conditions = [("quiet", 0)] + ([("busy", count)] if count > 0 else [])

    n = h.calibrate_burn(width_ms)
    sizes = {"burn": n, "sleep": width_ms / 1e3}
    print(f"{NAME}: burn({n:,}) ≈ {width_ms} ms here; sleep {width_ms} ms; {h.versions()}; mode {suite.mode}; "
          f"conditions: {', '.join(f'{c} ({b} burners)' for c, b in conditions)}")
    ray = h.local_ray(args)
    pools = start_pools(worker_counts)
    try:
        for condition, burning in conditions:
            with burners(burning):
                for kind in KINDS:
                    for branches in branch_counts:
                        measure(suite, pools, worker_counts, kind, sizes[kind], branches, ray, repeat,
                                {"node": kind, "burners": burning, "B": branches, "W_ms": width_ms})
                        print(f"  {condition}: {kind} B={branches} done", flush=True)
    finally:
        for pool in pools.values():
            pool.close() if isinstance(pool, soma.Local) else pool.shutdown(wait=True)
        if ray is not None:
            ray.shutdown()
    return suite.finish(lambda: print_summary(suite, conditions, branch_counts, worker_counts, width_ms))


def measure(suite: h.Suite, pools: dict, worker_counts, kind: str, n, branches: int, ray, repeat: int,
            base: dict) -> None:
    contenders = contenders_for(pools, worker_counts, kind, n, branches, ray)
    samples = h.alternate(contenders, repeat=repeat, warmup=1, check=checker(kind, n, branches))
    for name, values in samples.items():
        contender, _, w = name.partition("/")
        params = {**base, "workers": int(w) if w else 1}
        params["limit"] = min(branches, params["workers"]) if kind == "sleep" else min(branches, params["workers"],
                                                                                         h.CORES)
        suite.add(contender, params, h.ms(values), "ms")
        if contender not in ("executor", "serial"):
            suite.add_ratio(contender, params, samples["executor"], values, vs="executor")
        if contender == "local":  # against the best peer in the same rounds: the machine's real capacity
            suite.add_ratio(contender, params, samples[f"procpool/{w}"], values, vs="procpool")


def print_summary(suite: h.Suite, conditions, branch_counts, worker_counts, width_ms) -> None:
    kinds = ["local", "threads", "procpool"] + (["ray"] if suite.find("ray") else [])
    rows = []
    for condition, burning in conditions:
        for node in KINDS:
            for b in branch_counts:
                where = {"node": node, "burners": burning, "B": b}
                executor = suite.find("executor", "ms", **where)
                for w in worker_counts:
                    row = [f"{condition} {node} B={b} workers={w}", h.cell(suite.find("serial", "ms", **where)),
                           h.cell(executor)]
                    for kind in kinds:
                        speedup = suite.find(kind, "x", workers=w, vs="executor", **where)
                        row.append(h.cell(suite.find(kind, "ms", workers=w, **where), speedup))
                    row.append(h.cell(suite.find("local", "x", workers=w, vs="procpool", **where)) + "×")
                    rows.append(row)
    headers = ["wave", "serial", "executor"] + kinds + ["local over procpool"]
    h.print_table(f"{NAME}: median wall ms per wave of B × {width_ms} ms branches (speed-up over the executor, "
                  f"median of per-round ratios); busy: burners beside it", headers, rows)


if __name__ == "__main__":
    h.cli(main)
