"""aio: many concurrent requests from an event loop: `await local.arun(g, x)` against `run_in_executor` with threads.

    python benchmarks/aio.py [--quick] [--smoke] [--json out.json]   (or: soma bench aio)

What a server does with soma behind its requests: 1,000 (full) concurrent requests of a
tiny graph on Local (2 workers), rounds alternated:

* `asyncio.gather` of `local.arun(g, x)`: the outcome reaches the loop from the thread
  that receives the workers' results; no thread per request;
* the same through `loop.run_in_executor(threads, local.run, g, x)`, what one writes
  without arun: a thread of a ThreadPoolExecutor (64) waits in each run;
* requests/s, and the host process's thread count while they are in flight (its peak).
Every answer is checked.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import threading

import _harness as h
import _models as m

import soma
from soma import Graph

NAME = "aio"
WORKERS = 2


async def _watch(peak: list) -> None:
    while True:
        peak[0] = max(peak[0], threading.active_count())
        await asyncio.sleep(0.002)


def requests(suite: h.Suite, local) -> None:
    n = {"full": 1000, "quick": 500, "smoke": 50}[suite.mode]
    g = Graph.somatize(m.Tiny())
    peaks: dict = {"arun": [], "threads": []}

    async def burst(kind):
        peak = [threading.active_count()]
        watcher = asyncio.create_task(_watch(peak))
        loop = asyncio.get_running_loop()
        if kind == "arun":
            out = await asyncio.gather(*(local.arun(g, i) for i in range(n)))
        else:  # (its threads are made for the round and gone after it: the other round counts none of them)
            with cf.ThreadPoolExecutor(64) as threads:
                out = await asyncio.gather(*(loop.run_in_executor(threads, local.run, g, i) for i in range(n)))
        watcher.cancel()
        peaks[kind].append(peak[0])
        return out

    def rate(kind):
        elapsed, out = h.timed(lambda: asyncio.run(burst(kind)))
        h.expect(f"local/{kind}", out, [i + 1 for i in range(n)], "concurrent requests")
        return n / elapsed

    rate("arun"), rate("threads")  # warm
    for kind in peaks:
        peaks[kind].clear()
    samples = h.alternate({kind: (lambda k=kind: rate(k)) for kind in ("arun", "threads")},
                          repeat=suite.repeat(full=7, quick=3, smoke=1), self_timed=True)
    params = {"what": "concurrent_requests", "requests": n, "workers": WORKERS}
    for kind, values in samples.items():
        suite.add(kind, params, values, "requests/s")
        suite.add(kind, {**params, "what": "host_threads_peak"}, peaks[kind], "threads")
    suite.add_ratio("arun", params, samples["arun"], samples["threads"], vs="run_in_executor")


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    print(f"{NAME}: {h.versions()}; mode {suite.mode}")
    local = soma.Local(workers=WORKERS).start()
    try:
        requests(suite, local)
    finally:
        local.close()
    return suite.finish(lambda: print_summary(suite))


def print_summary(suite: h.Suite) -> None:
    rows = [[kind, h.cell(suite.find(kind, "requests/s", what="concurrent_requests"),
                          suite.find(kind, "x", what="concurrent_requests")),
             h.cell(suite.find(kind, "threads", what="host_threads_peak"))] for kind in ("arun", "threads")]
    h.print_table(f"{NAME}: concurrent requests of a tiny graph on Local ({WORKERS} workers), from one event loop",
                  ["contender", "requests/s (x run_in_executor)", "host threads, peak"], rows)


if __name__ == "__main__":
    h.cli(main)
