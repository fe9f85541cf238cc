"""memory: what a pool costs in memory, whether big results are copied, whether anything leaks.

    python benchmarks/memory.py [--quick] [--smoke] [--json out.json]   (or: soma bench memory)

* idle worker: RSS and USS (psutil's memory_full_info) of an idle Local worker
  that has never needed torch, of one that has (torch loaded, a tensor node run),
  and of a ProcessPoolExecutor (spawn) child in the same two states.
* receiving 256 MiB: this process's memory before and after a worker returns a
  256 MiB float32 tensor, untouched and then read through (`sum()`), for Local
  (born through ctx.empty, and on the worker's heap) and ProcessPoolExecutor.
  `anon` is RssAnon from /proc/self/status: private heap pages, where a copy
  would land. `shmem` (RssShmem) is shared-memory pages this process maps. USS
  counts every page only this process maps, shared-memory pages included: a
  segment its producer has let go of counts there once touched, without being a
  copy.
* many runs: 10,000 runs (1,000 with --quick) of a small graph (`add_one >>
  double`, on ints and on 256 KiB tensors, alternately; then the same on ints and
  256 KiB numpy arrays) on a warm pool of 2; host and
  worker RSS, the host's open fds, the pool's segment files in /dev/shm and all
  files there (machine-wide: other programs' count too) at evenly spaced
  checkpoints. Growth = last checkpoint over the first.

Every answer is checked: each tensor received holds a fill no other call used,
and every element is read (that read is the "touched" state); the last results
of each contender are held across repetitions and checked again when let go of.
A wrong value fails the run, naming the contender.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import multiprocessing as mp
import os
import time

import _harness as h
from _work import AddOne, Double, Echo, MakeTimed, echo, import_torch, make_timed

import soma
from soma import Graph

NAME = "memory"


def status_kib(field: str, pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def process_memory(pid: int) -> dict:
    """MiB: rss, uss, anon (private heap), shmem (shared memory mapped)."""
    import psutil

    full = psutil.Process(pid).memory_full_info()
    return {"rss": full.rss / h.MiB, "uss": full.uss / h.MiB,
            "anon": status_kib("RssAnon", pid) / 1024, "shmem": status_kib("RssShmem", pid) / 1024}


def has_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


# -- the pools ----------------------------------------------------------------------------------------

class Pools:
    """Every pool this benchmark measures, started side by side (torch imports overlap).

    `local`: 2 workers that have needed torch; it serves every question after the
    idle one. `plain`: 1 worker that never needs torch. The process pools: one
    child each, one that has imported torch and one that has not.
    """

    def __init__(self):
        import torch

        spawn = mp.get_context("spawn")
        self.procpool_plain = cf.ProcessPoolExecutor(1, mp_context=spawn)
        self.procpool = cf.ProcessPoolExecutor(1, mp_context=spawn)
        warm = [self.procpool_plain.submit(echo, 1), self.procpool.submit(import_torch)]
        self.plain = soma.Local(workers=1, preload_torch=False).start()
        self.local = soma.Local(workers=2, preload_torch=True).start()
        cf.wait(warm)
        small = torch.ones(64 << 10)  # 256 KiB: above the inline limit, so it travels through a segment
        h.expect("local/no_torch", self.plain.run(Graph.somatize(Echo()), 1), 1)
        both = self.local.run(Graph.somatize(Echo() | Echo()), small)  # a wave: each worker gets a branch
        for t in both:
            h.expect_filled("local/torch", t, 1.0, small.numel(), "warm-up echo")
        h.expect_filled("procpool/torch", self.procpool.submit(echo, small).result(), 1.0, small.numel(),
                        "warm-up echo")

    def close(self) -> None:
        self.plain.close()
        self.local.close()
        self.procpool_plain.shutdown()
        self.procpool.shutdown()


def child_pid(pool) -> int:
    return next(iter(pool._processes))  # no public way to ask


# -- idle workers ------------------------------------------------------------------------------------

def idle_workers(suite: h.Suite, pools: Pools) -> None:
    watched = {
        "local/no_torch": pools.plain.pids()[0], "local/torch": pools.local.pids()[0],
        "procpool/no_torch": child_pid(pools.procpool_plain), "procpool/torch": child_pid(pools.procpool),
    }
    time.sleep(0.2)  # let them settle into idling
    samples = h.alternate({name: (lambda p=pid: process_memory(p)) for name, pid in watched.items()},
                          repeat=suite.repeat(full=5, quick=3, smoke=1), warmup=0, self_timed=True)
    for name, values in samples.items():
        contender, _, state = name.partition("/")
        params = {"what": "idle_worker", "torch": state, "torch_loaded": has_torch(watched[name])}
        for metric in ("rss", "uss"):
            suite.add(contender, {**params, "metric": metric}, [v[metric] for v in values], "MiB")


# -- receiving a big tensor ---------------------------------------------------------------------------

def received_growth(name: str, receive, numel: int, held: h.Held) -> dict:
    """MiB this process grows by: right after `receive(fill)`, and after reading the tensor through.

    Reading it through is the check: every element must be the fill this call
    asked for. The tensor is then held (the last one of each contender) and
    checked again when let go of; the held one is already in `before`.
    """
    gc.collect()
    me = os.getpid()
    fill = h.next_fill()
    before = process_memory(me)
    t, _ = receive(fill)
    after = process_memory(me)
    h.expect_filled(name, t, fill, numel, "just received")  # every page read
    touched = process_memory(me)
    # Held after `touched` is taken: holding lets go of the previous one, whose pages would count.
    held.add(name, lambda: h.expect_filled(name, t, fill, numel, "held across repetitions"))
    return {f"{metric}_{when}": state[metric] - before[metric]
            for when, state in (("received", after), ("touched", touched)) for metric in before}


def receiving(suite: h.Suite, pools: Pools, nbytes: int) -> None:
    numel = nbytes // 4
    arena, heap = Graph.somatize(MakeTimed(numel, through_ctx=True)), Graph.somatize(MakeTimed(numel))
    held = h.Held(keep=1)
    calls = {
        "local/ctx": lambda: received_growth("local/ctx", lambda f: pools.local.run(arena, f), numel, held),
        "local/heap": lambda: received_growth("local/heap", lambda f: pools.local.run(heap, f), numel, held),
        "procpool": lambda: received_growth(
            "procpool", lambda f: pools.procpool.submit(make_timed, numel, None, f).result(), numel, held),
    }
    samples = h.alternate(calls, repeat=suite.repeat(full=5, quick=3, smoke=1), self_timed=True)
    held.check_all()
    size = f"{nbytes // h.MiB}MiB"
    for name, values in samples.items():
        for key in values[0]:
            metric, _, when = key.partition("_")
            suite.add(name, {"what": "host_growth", "size": size, "metric": metric, "when": when},
                      [v[key] for v in values], "MiB")


# -- many runs -------------------------------------------------------------------------------------

def shm_files(prefix: str = "") -> int:
    return sum(1 for name in os.listdir("/dev/shm") if name.startswith(prefix))


def shm_mib(prefix: str) -> float:
    """MiB of memory the /dev/shm files starting with `prefix` hold (pages written, not their nominal size)."""
    total = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            try:
                total += os.stat(os.path.join("/dev/shm", name)).st_blocks * 512
            except FileNotFoundError:  # let go of between the listing and the stat
                pass
    return total / h.MiB


def snapshot(local) -> dict:
    me = os.getpid()
    return {"host_rss": process_memory(me)["rss"], "host_uss": process_memory(me)["uss"],
            "worker_rss": sum(process_memory(pid)["rss"] for pid in local.pids()),
            "host_fds": len(os.listdir("/proc/self/fd")),
            # this host's pools name their segments soma-<host pid>-...; /dev/shm is shared with everyone else
            "pool_segments": shm_files(f"soma-{me}-"), "pool_segment_mib": shm_mib(f"soma-{me}-"),
            "dev_shm_files": shm_files()}


SMALL_TENSOR = 64 << 10  # float32 elements: 256 KiB, above the inline limit, so it travels through a segment


def checked_run(local, g, i: int, held: h.Held, kind: str = "tensor") -> None:
    """Run `add_one >> double` on the int i (even i) or on a fresh 256 KiB tensor (or numpy array) filled with i
    (odd i), and check the answer; tensor and array answers are held (the last few) and checked again when let
    go of."""
    if i % 2 == 0:
        h.expect("local", local.run(g, i), (i + 1) * 2, f"run {i}")
        return
    fill = float(i % (1 << 23))
    if kind == "numpy":
        import numpy

        out = local.run(g, numpy.full(SMALL_TENSOR, fill, numpy.float32))
        expected = (fill + 1) * 2

        def check(out=out, what=f"run {i}"):
            if out.shape != (SMALL_TENSOR,) or out.min() != expected or out.max() != expected:
                raise h.WrongValue(f"local returned an array that should hold {expected:g} everywhere ({what})")
        check()
        held.add("local", lambda: check(what=f"run {i}, held across later ones"))
        return
    import torch

    out = local.run(g, torch.full((SMALL_TENSOR,), fill))
    held.filled("local", out, (fill + 1) * 2, SMALL_TENSOR, f"run {i}")


def many_runs(suite: h.Suite, local, runs: int, checkpoints: int = 5, kind: str = "tensor") -> None:
    g = Graph.somatize(AddOne() >> Double())
    held = h.Held(keep=8)
    for i in range(max(100, runs // 10)):  # warm: segments made, code loaded, caches filled
        checked_run(local, g, i, held, kind)
    gc.collect()
    series = [snapshot(local)]
    for _ in range(checkpoints - 1):
        for i in range(runs // (checkpoints - 1)):
            checked_run(local, g, i, held, kind)
        gc.collect()
        series.append(snapshot(local))
    held.check_all()
    params = {"what": "many_runs" if kind == "tensor" else f"many_runs_{kind}", "runs": runs,
              "checkpoints": checkpoints}
    add_series(suite, params, series)


SERIES_UNITS = {"host_rss": "MiB", "host_uss": "MiB", "worker_rss": "MiB", "host_fds": "count",
                "pool_segments": "count", "pool_segment_mib": "MiB", "dev_shm_files": "count"}


def add_series(suite: h.Suite, params: dict, series: list[dict]) -> None:
    """Each metric of `snapshot()` at every checkpoint, and its growth: last checkpoint over the first, and over
    the middle one (a pool that grows to a high-water mark and stays there is flat in its second half; a leak
    is not)."""
    middle = len(series) // 2
    for metric, unit in SERIES_UNITS.items():
        values = [s[metric] for s in series]
        suite.add("local", {**params, "metric": metric}, values, unit)
        for vs, base in (("first_checkpoint", values[0]), ("middle_checkpoint", values[middle])):
            growth = 100 * (values[-1] - base) / base if base else 0.0
            suite.add("local", {**params, "metric": metric, "vs": vs}, [growth], "% growth")


def print_series(suite: h.Suite, title: str, **params) -> None:
    rows = []
    for r in suite.records:
        if all(r.params.get(k) == v for k, v in params.items()) and "metric" in r.params and "vs" not in r.params:
            growth = [suite.find("local", "% growth", metric=r.params["metric"], vs=vs, **params).median
                      for vs in ("first_checkpoint", "middle_checkpoint")]
            rows.append([r.params["metric"], r.values[0], r.values[len(r.values) // 2], r.values[-1], max(r.values)]
                        + [f"{g:+.1f}%" for g in growth])
    h.print_table(title, ["metric", "first checkpoint", "middle", "last", "max", "growth from first",
                          "growth from middle"], rows)


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    import torch  # noqa: F401  (the host uses tensors)

    print(f"{NAME}: {h.versions()}; mode {suite.mode}")
    pools = Pools()
    try:
        idle_workers(suite, pools)  # first: before the workers have done anything else
        print("  idle workers done", flush=True)
        runs = {"full": 10_000, "quick": 1_000, "smoke": 100}[suite.mode]
        many_runs(suite, pools.local, runs)
        many_runs(suite, pools.local, runs, kind="numpy")
        print("  many runs done", flush=True)
        receiving(suite, pools, (16 if args.smoke else 256) * h.MiB)
    finally:
        pools.close()
    return suite.finish(lambda: print_summary(suite))


def print_summary(suite: h.Suite) -> None:
    rows = []
    for name in ("local", "procpool"):
        for state in ("no_torch", "torch"):
            rss = suite.find(name, "MiB", what="idle_worker", torch=state, metric="rss")
            uss = suite.find(name, "MiB", what="idle_worker", torch=state, metric="uss")
            rows.append([name, state, h.cell(rss), h.cell(uss), str(rss.params["torch_loaded"])])
    h.print_table(f"{NAME}: an idle worker, median MiB", ["contender", "has needed torch", "RSS", "USS",
                                                           "libtorch mapped"], rows)

    rows = []
    for name in ("local/ctx", "local/heap", "procpool"):
        row = [name]
        for when in ("received", "touched"):
            for metric in ("rss", "uss", "anon", "shmem"):
                found = [r for r in suite.records if r.contender == name and r.params.get("what") == "host_growth"
                         and r.params["metric"] == metric and r.params["when"] == when]
                row.append(h.cell(found[0] if found else None))
        rows.append(row)
    size = next((r.params["size"] for r in suite.records if r.params.get("what") == "host_growth"), "?")
    columns = [f"{m} {w}" for w in ("received", "touched") for m in ("rss", "uss", "anon", "shmem")]
    h.print_table(f"{NAME}: how much this process grows receiving {size} from a worker, median MiB",
                  ["contender"] + columns, rows)

    runs = next((r.params["runs"] for r in suite.records if r.params.get("what") == "many_runs"), "?")
    print_series(suite, f"{NAME}: {runs:,} runs of a small graph on a warm Local pool of 2", what="many_runs")
    print_series(suite, f"{NAME}: {runs:,} runs of the same graph on ints and 256 KiB numpy arrays",
                 what="many_runs_numpy")


if __name__ == "__main__":
    h.cli(main)
