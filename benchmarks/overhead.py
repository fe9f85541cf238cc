"""overhead: what a run costs when the work is nothing.

    python benchmarks/overhead.py [--quick] [--smoke] [--json out.json]   (or: soma bench overhead)

Three questions, each on warm pools of 2 workers, contenders alternated round by round:

* round trip: one run of a one-node graph returning its small input, as the
  caller sees it: `Local.run(g, x)` vs `ProcessPoolExecutor(spawn).submit(echo,
  x).result()` vs `multiprocessing.Pool(spawn).apply(echo, (x,))` vs
  `ThreadPoolExecutor.submit().result()`, with `soma.Executor` as the in-process
  floor and `zmq_floor`, a bare ZeroMQ echo over soma's sockets (benchmarks/_zmq_floor.py),
  as the floor of any round trip on soma's transport (SPEC 7: ZeroMQ). One sample = the mean of many back-to-back trips; trip i sends the
  int i and every answer is checked against it (after the clock stops).
* throughput: a 3-node graph `add_one >> double >> add_one` over many inputs, in
  runs per second. The pools get the same three steps as one function.
  Sequential: one input at a time, each waited for. Concurrent: Local from 4
  caller threads (Local.run may be called from several threads at once), the
  pools with all inputs submitted at once (`map`), which is how one uses them.
  Every output is checked against `(x + 1) * 2 + 1`.
* idle: CPU used by a warm pool doing nothing for about a second (the host
  process and its workers, from psutil's cpu_times), in % of one core.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import time

import _harness as h
from _work import AddOne, Double, Echo, chain3, echo
from _zmq_floor import ZmqEcho

import soma
from soma import Graph

NAME = "overhead"
WORKERS = 2


def per_call(name: str, trips: int, call) -> float:
    """Mean seconds per call over `trips` back-to-back calls of `call(i)`, each answer checked to be `i`.

    The inputs are small ints (the figure is the machinery, not the data); the
    answers are kept and compared after the clock stops.
    """
    answers = [None] * trips
    start = time.perf_counter()
    for i in range(trips):
        answers[i] = call(i)
    elapsed = time.perf_counter() - start
    h.expect(name, answers, list(range(trips)), "round trips")
    return elapsed / trips


# -- round trip ---------------------------------------------------------------------------------

def round_trips(suite: h.Suite, pools: h.Pools) -> None:
    g = Graph.somatize(Echo())
    executor = soma.Executor()
    local, procpool, mp_pool, threads = pools.local, pools.procpool, pools.mp_pool, pools.threads
    floor = ZmqEcho()
    calls = {
        "local": lambda x: local.run(g, x),
        "zmq_floor": floor.call,
        "procpool": lambda x: procpool.submit(echo, x).result(),
        "mp_pool": lambda x: mp_pool.apply(echo, (x,)),
        "threads": lambda x: threads.submit(echo, x).result(),
        "executor": lambda x: executor.run(g, x),
    }
    trips = {"full": 500, "quick": 200, "smoke": 20}[suite.mode]
    try:
        samples = h.alternate({name: (lambda n=name, c=call: per_call(n, trips, c)) for name, call in calls.items()},
                              repeat=suite.repeat(full=9, quick=5, smoke=1), self_timed=True)
    finally:
        floor.close()
    params = {"workers": WORKERS, "trips_per_sample": trips}
    for name, values in samples.items():
        suite.add(name, {"what": "round_trip", **params}, h.us(values), "us")
        if name != "procpool":
            suite.add_ratio(name, {"what": "round_trip", **params}, values, samples["procpool"], vs="procpool")


# -- throughput ---------------------------------------------------------------------------------

def throughputs(suite: h.Suite, pools: h.Pools) -> None:
    g = Graph.somatize(AddOne() >> Double() >> AddOne())
    executor = soma.Executor()
    local, procpool, mp_pool, threads = pools.local, pools.procpool, pools.mp_pool, pools.threads
    callers = cf.ThreadPoolExecutor(4)
    runs = {"full": 3000, "quick": 1000, "smoke": 50}[suite.mode]
    inputs = list(range(runs))
    expected = [chain3(i) for i in inputs]
    # sequential: one input at a time, each waited for. concurrent: Local from 4 caller threads,
    # the pools with every input submitted at once (map), as one would use them.
    batches = {
        "local/sequential": lambda: [local.run(g, i) for i in inputs],
        "local/concurrent": lambda: list(callers.map(lambda i: local.run(g, i), inputs)),
        "executor/sequential": lambda: [executor.run(g, i) for i in inputs],
        "procpool/sequential": lambda: [procpool.submit(chain3, i).result() for i in inputs],
        "procpool/concurrent": lambda: list(procpool.map(chain3, inputs)),
        "mp_pool/sequential": lambda: [mp_pool.apply(chain3, (i,)) for i in inputs],
        "mp_pool/concurrent": lambda: mp_pool.map(chain3, inputs, chunksize=1),
        "threads/sequential": lambda: [threads.submit(chain3, i).result() for i in inputs],
        "threads/concurrent": lambda: list(threads.map(chain3, inputs)),
    }

    def rate(name, batch):
        elapsed, out = h.timed(batch)
        h.expect(name, list(out), expected, "3-node throughput")
        return runs / elapsed

    try:
        samples = h.alternate({name: (lambda n=name, b=batch: rate(n, b)) for name, batch in batches.items()},
                              repeat=suite.repeat(full=5, quick=3, smoke=1), self_timed=True)
    finally:
        callers.shutdown()
    for name, values in samples.items():
        contender, _, mode = name.partition("/")
        params = {"what": "throughput_3_nodes", "workers": WORKERS, "runs": runs, "mode": mode}
        suite.add(contender, params, values, "runs/s")
        if contender != "procpool":
            suite.add_ratio(contender, params, values, samples[f"procpool/{mode}"], vs="procpool")


# -- idle ----------------------------------------------------------------------------------------

def pool_pids(name: str, pool) -> list[int]:
    if name == "local":
        return pool.pids()
    if name == "procpool":
        return [p.pid for p in pool._processes.values()]  # no public way to ask
    return [p.pid for p in pool._pool]


def idle_cpu_percent(pids: list[int], seconds: float) -> float:
    """CPU time of `pids` over `seconds` of doing nothing, in % of one core."""
    import psutil

    procs = [psutil.Process(pid) for pid in pids]

    def cpu() -> float:
        return sum(sum(p.cpu_times()[:2]) for p in procs)

    before, start = cpu(), time.perf_counter()
    time.sleep(seconds)
    return 100 * (cpu() - before) / (time.perf_counter() - start)


def idle(suite: h.Suite, pools: h.Pools) -> None:
    seconds = {"full": 1.0, "quick": 1.0, "smoke": 0.2}[suite.mode]
    watched = {name: [os.getpid()] + pool_pids(name, getattr(pools, name)) for name in ("local", "procpool", "mp_pool")}
    samples = h.alternate({name: (lambda p=pids: idle_cpu_percent(p, seconds)) for name, pids in watched.items()},
                          repeat=suite.repeat(full=5, quick=3, smoke=1), warmup=0, self_timed=True)
    for name, values in samples.items():
        suite.add(name, {"what": "idle_cpu", "workers": WORKERS, "seconds": seconds}, values, "% of a core")


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    print(f"{NAME}: {h.versions()}; mode {suite.mode}")
    pools = h.Pools(WORKERS)
    try:
        round_trips(suite, pools)
        print("  round trips done", flush=True)
        throughputs(suite, pools)
        print("  throughput done", flush=True)
        idle(suite, pools)
    finally:
        pools.close()
    return suite.finish(lambda: print_summary(suite))


def print_summary(suite: h.Suite) -> None:
    rows = []
    for name in ("local", "procpool", "mp_pool", "threads", "executor"):
        rt = suite.find(name, "us", what="round_trip")
        rows.append([name, h.cell(rt, suite.find(name, "x", what="round_trip")),
                     h.cell(suite.find(name, "runs/s", what="throughput_3_nodes", mode="sequential"),
                            suite.find(name, "x", what="throughput_3_nodes", mode="sequential")),
                     h.cell(suite.find(name, "runs/s", what="throughput_3_nodes", mode="concurrent"),
                            suite.find(name, "x", what="throughput_3_nodes", mode="concurrent")),
                     h.cell(suite.find(name, "% of a core", what="idle_cpu"))])
    h.print_table(f"{NAME}: medians, {WORKERS} workers (ratio to procpool, per round)",
                  ["contender", "round trip µs", "3-node runs/s, sequential", "3-node runs/s, concurrent",
                   "idle CPU % of a core"], rows)


if __name__ == "__main__":
    h.cli(main)
