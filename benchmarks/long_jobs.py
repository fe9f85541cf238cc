"""long_jobs: what retries and memory caps cost, and that a long map survives workers killed under it.

    python benchmarks/long_jobs.py [--quick] [--smoke] [--json out.json]   (or: soma bench long_jobs)

On Local (2 workers), every output checked:

* a map of 3,000 inputs of ~1 ms with `retries=5` while a worker is SIGKILLed from
  outside every 0.4 s, four times: every output, in order, none twice; its time against
  the same map with nobody killed (ratio, rounds alternated);
* what a retry costs when nothing dies: the same map of tiny inputs with `retries=5`
  against `retries=0` (ratio), and a lone run's round trip likewise;
* `max_memory="200MiB"` on one worker whose node keeps 300 MiB more per input: every
  input done, a new worker per input, the largest private memory a worker reached.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import _harness as h
import _models as m

import soma
from soma import Graph

NAME = "long_jobs"
WORKERS = 2


def killed_map(suite: h.Suite, local) -> None:
    n = {"full": 3000, "quick": 1500, "smoke": 200}[suite.mode]
    kills = {"full": 4, "quick": 4, "smoke": 1}[suite.mode]
    g = Graph.somatize(m.Ms())
    expected = [10 * i for i in range(n)]
    list(local.map(g, range(64)))  # warm

    def run(with_kills: bool) -> float:
        stop = threading.Event()

        def killer():
            for _ in range(kills):
                if stop.wait(0.4):
                    return
                pids = local.pids()
                if pids:
                    os.kill(pids[0], signal.SIGKILL)

        thread = threading.Thread(target=killer, daemon=True)
        if with_kills:
            thread.start()
        elapsed, out = h.timed(lambda: list(local.map(g, range(n), retries=5)))
        stop.set()
        if with_kills:
            thread.join()
        h.expect("local/killed" if with_kills else "local/quiet", out, expected, "every output, in order, once")
        return elapsed

    samples = h.alternate({"killed": lambda: run(True), "quiet": lambda: run(False)},
                          repeat=suite.repeat(full=3, quick=2, smoke=1), self_timed=True)
    params = {"what": "map_with_kills", "inputs": n, "kills": kills, "every_s": 0.4, "retries": 5}
    for kind, values in samples.items():
        suite.add(kind, params, h.ms(values), "ms")
    suite.add_ratio("killed", params, samples["killed"], samples["quiet"], vs="quiet")


def retry_cost(suite: h.Suite, local) -> None:
    n = {"full": 20000, "quick": 5000, "smoke": 500}[suite.mode]
    trips = {"full": 2000, "quick": 500, "smoke": 50}[suite.mode]
    g = Graph.somatize(m.Tiny())
    expected = [i + 1 for i in range(n)]

    def tiny_map(retries):
        elapsed, out = h.timed(lambda: list(local.map(g, range(n), retries=retries)))
        h.expect(f"local/retries={retries}", out, expected, "tiny map")
        return n / elapsed

    def round_trip(retries):
        elapsed, out = h.timed(lambda: [local.run(g, i, retries=retries) for i in range(trips)])
        h.expect(f"local/retries={retries}", out, [i + 1 for i in range(trips)], "round trips")
        return elapsed / trips

    maps = h.alternate({r: (lambda r=r: tiny_map(r)) for r in (0, 5)}, repeat=suite.repeat(full=7, quick=3),
                       self_timed=True)
    trips_s = h.alternate({r: (lambda r=r: round_trip(r)) for r in (0, 5)}, repeat=suite.repeat(full=7, quick=3),
                          self_timed=True)
    for retries in (0, 5):
        suite.add(f"retries={retries}", {"what": "tiny_map", "inputs": n}, maps[retries], "inputs/s")
        suite.add(f"retries={retries}", {"what": "round_trip"}, h.us(trips_s[retries]), "us")
    suite.add_ratio("retries=5", {"what": "tiny_map", "inputs": n}, maps[5], maps[0], vs="retries=0")
    suite.add_ratio("retries=5", {"what": "round_trip"}, trips_s[5], trips_s[0], vs="retries=0")


def memory_cap(suite: h.Suite) -> None:
    n = {"full": 6, "quick": 4, "smoke": 2}[suite.mode]
    mib = {"full": 300, "quick": 300, "smoke": 120}[suite.mode]
    cap = {"full": "200MiB", "quick": "200MiB", "smoke": "100MiB"}[suite.mode]
    with soma.Local(workers=1, max_memory=cap) as capped:
        start = time.perf_counter()
        out = list(capped.map(Graph.somatize(m.Grow(mib)), range(n)))
        elapsed = time.perf_counter() - start
    pids = [pid for pid, _ in out]
    if len(set(pids)) != n:
        raise h.WrongValue(f"local/max_memory: {n} inputs ran in {len(set(pids))} workers, not one each")
    params = {"what": "max_memory", "inputs": n, "grows_mib": mib, "max_memory": cap}
    suite.add("local", {**params, "what": "max_memory_largest_worker"}, [max(mem for _, mem in out) / (1 << 20)],
              "MiB")
    suite.add("local", {**params, "what": "max_memory_workers"}, [len(set(pids))], "workers")
    suite.add("local", {**params, "what": "max_memory_per_input"}, [1e3 * elapsed / n], "ms")


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    print(f"{NAME}: {h.versions()}; mode {suite.mode}")
    local = soma.Local(workers=WORKERS).start()
    try:
        killed_map(suite, local)
        print("  killed map done", flush=True)
        retry_cost(suite, local)
        print("  retry cost done", flush=True)
    finally:
        local.close()
    memory_cap(suite)
    return suite.finish(lambda: print_summary(suite))


def print_summary(suite: h.Suite) -> None:
    h.print_table(f"{NAME}: a map of ~1 ms inputs with retries=5, a worker SIGKILLed every 0.4 s",
                  ["contender", "ms (x quiet)"],
                  [[k, h.cell(suite.find(k, "ms", what="map_with_kills"), suite.find(k, "x", what="map_with_kills"))]
                   for k in ("killed", "quiet")])
    h.print_table(f"{NAME}: what retries=5 costs when nothing dies", ["contender", "tiny map inputs/s (x)",
                                                                       "round trip µs (x)"],
                  [[k, h.cell(suite.find(k, "inputs/s", what="tiny_map"), suite.find(k, "x", what="tiny_map")),
                    h.cell(suite.find(k, "us", what="round_trip"), suite.find(k, "x", what="round_trip"))]
                   for k in ("retries=0", "retries=5")])
    h.print_table(f"{NAME}: max_memory", ["contender", "workers (one per input)", "largest worker MiB", "ms per input"],
                  [["local", h.cell(suite.find("local", "workers", what="max_memory_workers")),
                    h.cell(suite.find("local", "MiB", what="max_memory_largest_worker")),
                    h.cell(suite.find("local", "ms", what="max_memory_per_input"))]])


if __name__ == "__main__":
    h.cli(main)
