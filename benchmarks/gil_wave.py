"""gil_wave: do GIL-bound branches of one wave really run in parallel?

    python benchmarks/gil_wave.py [--quick] [--smoke] [--json out.json]   (or: soma bench gil_wave)

A wave of B branches, each W ms of pure-Python work (`burn(n)`: a fixed number of
loop iterations calibrated once here, not a clock), for B in 1, 2, 4, 8 and
workers 1..cores. Contenders, alternated round by round in this one process:

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
processes less than two cores holds every contender back alike).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp

import _harness as h
from _work import BurnTagged, burn_tagged

import soma
from soma import Graph

NAME = "gil_wave"


def wave(n: int, branches: int) -> Graph:
    expr = BurnTagged(n, tag=0)
    for b in range(1, branches):
        expr = expr | BurnTagged(n, tag=b)
    return Graph.somatize(expr)


def pool_wave(pool, n: int, branches: int):
    return list(pool.map(burn_tagged, [n] * branches, range(branches)))


def checker(n: int, branches: int):
    """`check(name, out)` for `alternate`: every branch's tag and burn, in order.

    soma's graph of one node returns that node's value, not a 1-tuple.
    """
    expected = [burn_tagged(n, b) for b in range(branches)]

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


def contenders_for(pools: dict, worker_counts: list[int], n: int, branches: int, ray) -> dict:
    g = wave(n, branches)
    executor = soma.Executor()
    contenders = {
        "serial": lambda: [burn_tagged(n, b) for b in range(branches)],
        "executor": lambda: executor.run(g, None),
    }
    for w in worker_counts:
        local, threads, procpool = pools["local", w], pools["threads", w], pools["procpool", w]
        contenders[f"local/{w}"] = lambda local=local: local.run(g, None)
        contenders[f"threads/{w}"] = lambda pool=threads: pool_wave(pool, n, branches)
        contenders[f"procpool/{w}"] = lambda pool=procpool: pool_wave(pool, n, branches)
    if ray is not None:
        task = ray.remote(burn_tagged)
        contenders[f"ray/{h.CORES}"] = lambda: ray.get([task.remote(n, b) for b in range(branches)])
    return contenders


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    smoke = args.smoke
    width_ms = 5 if smoke else 50
    branch_counts = [1, 2] if smoke else [1, 2, 4, 8]
    worker_counts = list(range(1, h.CORES + 1))
    repeat = suite.repeat(full=7, quick=3)

    n = h.calibrate_burn(width_ms)
    print(f"{NAME}: burn({n:,}) ≈ {width_ms} ms here; {h.versions()}; mode {suite.mode}")
    ray = h.local_ray(args)
    pools = start_pools(worker_counts)
    try:
        for branches in branch_counts:
            contenders = contenders_for(pools, worker_counts, n, branches, ray)
            samples = h.alternate(contenders, repeat=repeat, warmup=1, check=checker(n, branches))
            for name, values in samples.items():
                kind, _, w = name.partition("/")
                params = {"B": branches, "W_ms": width_ms, "workers": int(w) if w else 1}
                params["limit"] = min(branches, params["workers"], h.CORES)
                suite.add(kind, params, h.ms(values), "ms")
                if kind not in ("executor", "serial"):
                    suite.add_ratio(kind, params, samples["executor"], values, vs="executor")
                if kind == "local":  # against the best peer in the same rounds: the machine's real capacity
                    suite.add_ratio(kind, params, samples[f"procpool/{w}"], values, vs="procpool")
            print(f"  B={branches} done", flush=True)
    finally:
        for pool in pools.values():
            pool.close() if isinstance(pool, soma.Local) else pool.shutdown(wait=True)
        if ray is not None:
            ray.shutdown()
    return suite.finish(lambda: print_summary(suite, branch_counts, worker_counts, width_ms))


def print_summary(suite: h.Suite, branch_counts, worker_counts, width_ms) -> None:
    kinds = ["local", "threads", "procpool"] + (["ray"] if suite.find("ray") else [])
    rows = []
    for b in branch_counts:
        executor = suite.find("executor", "ms", B=b)
        for w in worker_counts:
            row = [f"B={b} workers={w}", h.cell(suite.find("serial", "ms", B=b)), h.cell(executor)]
            for kind in kinds:
                speedup = suite.find(kind, "x", B=b, workers=w, vs="executor")
                row.append(h.cell(suite.find(kind, "ms", B=b, workers=w), speedup))
            row.append(f"{min(b, w, h.CORES)}×")
            row.append(h.cell(suite.find("local", "x", B=b, workers=w, vs="procpool")) + "×")
            rows.append(row)
    headers = ["wave", "serial", "executor"] + kinds + ["limit", "local over procpool"]
    h.print_table(f"{NAME}: median wall ms per wave of B × {width_ms} ms branches (speed-up over the executor, "
                  f"median of per-round ratios)", headers, rows)


if __name__ == "__main__":
    h.cli(main)
