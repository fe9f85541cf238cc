"""map's part of issue 31 ("Local's host with one owner, and cheap inputs that travel in chunks"): soma against
the process pools a user tunes in one line, a straggler among cheap inputs, the empty round trip, the host's
hops; each printed as "target: ..., measured: ..., met/missed"; and the sweep `--plot` draws.

    chunked   `ProcessPoolExecutor(2).map(f, xs, chunksize=len(xs) // 64)` (procpool_chunked) and
              `multiprocessing.Pool(2).imap(f, xs, chunksize=len(xs) // 64)` (mp_imap_chunked), beside
              `Local(workers=2).map(g, xs)` (local) and the unchunked pool (procpool, for reference); in the
              tiny case of map.py (20,000 ints, target local >= 1.0x procpool_chunked) and here with `burn`
              work per input (`work`: 100 µs, target >= 0.9x; `--plot` adds 10 and 1,000 µs).
    straggler one input of 300 ms of `burn` among cheap ones of 100 µs, placed mid-chunk in the pools' third
              chunk. The run's total against the slow input alone plus the cheap work over two workers (both
              measured in this process, the same round); and when the slow input's neighbour (the input just
              before it) came back, against when the slow one did: a chunk that hides it behind the
              straggler brings it back with it (about 1.0x); ordered maps, every output checked.
    round trip overhead.py's round trips, on these pools: `Local.run` of a one-node graph against
              `ProcessPoolExecutor.submit(...).result()`; target <= 0.6x.
    hops      `python ../shared/tools/hops.py --show 12` (from the project root; or SOMA_HOPS=path): calls from
              one soma module into another on the host per warm `Local.run` and per map input (targets 15, 5);
              run after the pools are closed. Where the tool is not there, the command is printed instead.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import _harness as h
from _work import BurnPair, BurnTagged, burn_pair, burn_tagged

from soma import Graph

CHUNKS = 64  # the pools' chunksize is len(xs) // CHUNKS
SWEEP_US = (0, 10, 100, 1000)  # µs of work per input that --plot draws (0: map.py's tiny case)
TARGET_US = 100
WORKERS = 2
PARALLEL = ("local", "procpool_chunked", "mp_imap_chunked", "procpool")
HOPS_COMMAND = "python ../shared/tools/hops.py --show 12"


def chunk_size(count: int) -> int:
    return max(1, count // CHUNKS)


# -- work per input ----------------------------------------------------------------------------------------

def inputs_for(work_us: int, mode: str) -> int:
    """As many inputs as make about a second of work on each worker (full; a quarter in --quick), 20,000 at most:
    the tiny target's."""
    seconds = {"full": 2.0, "quick": 0.5, "smoke": 0.05}[mode]
    return max(128, min(20_000, int(seconds / (work_us / 1e6))))


def work(suite: h.Suite, pools, work_us: int) -> None:
    """`work_us` µs of `burn` per input, tagged with the input; local against the chunked and the plain pool."""
    count = inputs_for(work_us, suite.mode)
    n = h.calibrate_burn(work_us / 1e3)
    xs = list(range(count))
    burnt = burn_tagged(n, 0)[1]  # (the same count of iterations gives the same number: computed once)
    expected = [(x, burnt) for x in xs]
    every = pools.maps(Graph.somatize(BurnTagged(n)), functools.partial(burn_tagged, n), xs, chunked=True)
    samples = h.alternate({name: every[name] for name in PARALLEL}, repeat=suite.repeat(full=7, quick=3),
                          check=lambda name, out: h.expect(name, out, expected, f"{work_us} µs of burn each"))
    suite.add_rates(samples, count, "inputs/s", {"case": "work", "work_us": work_us, "workers": WORKERS,
                                                 "inputs": count})


def sweep_cases(plot: bool) -> tuple:
    """The work cases to measure: the target's alone, or every point of the plot's sweep but the tiny case's."""
    return tuple(us for us in SWEEP_US if us) if plot else (TARGET_US,)


# -- a straggler -------------------------------------------------------------------------------------------

def straggler(suite: h.Suite, pools) -> None:
    slow_ms = 30 if suite.mode == "smoke" else 300
    count = {"full": 4000, "quick": 2000, "smoke": 200}[suite.mode]
    n_slow, n_cheap = h.calibrate_burn(slow_ms), h.calibrate_burn(TARGET_US / 1e3)
    chunk = chunk_size(count)
    slow_at = 2 * chunk + chunk // 2  # mid-chunk: a chunk holding it holds its neighbours too
    xs = [(i, n_slow if i == slow_at else n_cheap) for i in range(count)]
    burnt = {n: burn_pair((0, n))[1] for n in (n_slow, n_cheap)}
    expected = [(i, burnt[n]) for i, n in xs]
    g = Graph.somatize(BurnPair())

    def timed_map(name, start_map):
        """(total s, s until the neighbour came back, s until the slow input did); every output checked."""
        got, back = [], {}
        start = time.perf_counter()
        for y in start_map():
            if len(got) in (slow_at - 1, slow_at):
                back[len(got)] = time.perf_counter() - start
            got.append(y)
        total = time.perf_counter() - start
        h.expect(name, got, expected, "a straggler among cheap inputs")
        return total, back[slow_at - 1], back[slow_at]

    def serial():
        """The reference's parts, measured here in the same round: the slow input alone; the cheap ones."""
        slow_s = h.timed(burn_pair, xs[slow_at])[0]
        cheap_s = h.timed(lambda: [burn_pair(x) for x in xs if x[1] == n_cheap])[0]
        return slow_s, cheap_s

    contenders = {
        "local": lambda: timed_map("local", lambda: pools.local.map(g, xs)),
        "procpool_chunked": lambda: timed_map("procpool_chunked",
                                              lambda: pools.procpool.map(burn_pair, xs, chunksize=chunk)),
        "mp_imap_chunked": lambda: timed_map("mp_imap_chunked",
                                             lambda: pools.mp_pool.imap(burn_pair, xs, chunksize=chunk)),
        "serial": serial,
    }
    samples = h.alternate(contenders, repeat=suite.repeat(full=5, quick=3), self_timed=True)
    reference = [slow + cheap / WORKERS for slow, cheap in samples.pop("serial")]
    params = {"case": "straggler", "inputs": count, "slow_ms": slow_ms, "cheap_us": TARGET_US, "at": slow_at,
              "workers": WORKERS}
    suite.add("reference", {**params, "what": "slow_alone_plus_cheap_over_workers"}, h.ms(reference), "ms")
    for name, runs in samples.items():
        total, neighbour, slow = zip(*runs)
        suite.add(name, {**params, "what": "total"}, h.ms(total), "ms")
        suite.add(name, {**params, "what": "neighbour_back"}, h.ms(neighbour), "ms")
        suite.add(name, {**params, "what": "slow_back"}, h.ms(slow), "ms")
        suite.add(name, {**params, "what": "total", "vs": "reference"}, h.paired_ratios(total, reference), "x")
        suite.add(name, {**params, "what": "neighbour_back", "vs": "slow_back"}, h.paired_ratios(neighbour, slow),
                  "x")


# -- hops ----------------------------------------------------------------------------------------------------

def hops_tool() -> Path | None:
    root = Path(__file__).resolve().parent.parent
    for candidate in (os.environ.get("SOMA_HOPS"), root.parent / "shared/tools/hops.py",
                      root / "shared/tools/hops.py"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def hops(suite: h.Suite) -> str | None:
    """The hops tool's two figures as records, its busiest pairs printed; or why not, and the command. Returns
    what went wrong when the tool failed (the caller fails the run with it once every table is printed)."""
    tool = hops_tool()
    if tool is None:
        print(f"\nhops not measured: the tool is not beside this checkout; from the project root of one that has "
              f"it: {HOPS_COMMAND} (or set SOMA_HOPS to its path)")
        return None
    import soma

    runs = 20 if suite.mode == "smoke" else 200
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(soma.__file__).resolve().parent.parent)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    done = subprocess.run([sys.executable, str(tool), "--runs", str(runs), "--show", "12"], capture_output=True,
                          text=True, env=env, timeout=600)
    found = re.search(r"host cross-module calls: ([\d.]+) per Local\.run, ([\d.]+) per map input", done.stdout)
    if done.returncode != 0 or found is None:
        failed = (f"{tool} --runs {runs} --show 12 failed (exit {done.returncode}; its own checks of Local.run's "
                  f"answers are asserts):\n{(done.stdout + done.stderr)[-3000:]}")
        print(f"\nhops FAILED: {failed}")
        return failed
    print(f"\nhops ({tool} --runs {runs} --show 12): the busiest pairs, then its figures\n{done.stdout.rstrip()}")
    for per, value in (("run", found.group(1)), ("map_input", found.group(2))):
        suite.add("local", {"what": "hops", "per": per, "runs": runs}, [float(value)], "calls")
    return None


# -- the targets ------------------------------------------------------------------------------------------------

def target_line(what: str, record, goal: float, at_most: bool = False) -> str:
    """`what: target: >= 1.0x, measured: 0.041x (0.036-0.05), met` (or `missed`, or `not measured`)."""
    bound = f"{'<=' if at_most else '>='} {h.fmt(goal)}"
    if record is None:
        return f"{what}: target: {bound}, measured: —, not measured"
    unit = "x" if record.unit == "x" else f" {record.unit}"
    spread = f" ({h.fmt(min(record.values))}-{h.fmt(max(record.values))})" if len(record.values) > 1 else ""
    met = record.median <= goal if at_most else record.median >= goal
    return (f"{what}: target: {bound}{unit}, measured: {h.fmt(record.median)}{unit}{spread}, "
            f"{'met' if met else 'missed'}")


def print_targets(suite: h.Suite) -> None:
    rows = []
    for case, params in [("tiny", {"case": "tiny"})] + [(f"{us} µs", {"case": "work", "work_us": us})
                                                        for us in SWEEP_US if us]:
        if suite.find("local", "inputs/s", **params) is None:
            continue
        rows.append([case] + [h.cell(suite.find(name, "inputs/s", **params),
                                     suite.find("local", "x", vs=name, **params) if name != "local" else None)
                              for name in PARALLEL])
    h.print_table("issue 31: map on 2 workers against the process pools chunked by len(xs) // 64, median inputs/s "
                  "(in brackets: local's speed-up over it, per round)", ["work per input"] + list(PARALLEL), rows)
    straggling = {"case": "straggler"}
    rows = [[name] + [h.cell(suite.find(name, "ms", what=what, **straggling))
                      for what in ("total", "slow_back", "neighbour_back")]
            + [h.cell(suite.find(name, "x", what="total", vs="reference", **straggling)),
               h.cell(suite.find(name, "x", what="neighbour_back", **straggling))]
            for name in ("local", "procpool_chunked", "mp_imap_chunked")]
    ref = suite.find("reference", "ms", **straggling)
    if ref is not None:
        h.print_table(f"issue 31: one {ref.params['slow_ms']} ms input (at {ref.params['at']}) among "
                      f"{ref.params['inputs'] - 1:,} of {ref.params['cheap_us']} µs, ms from the start; reference: "
                      f"the slow input alone plus the cheap work over {WORKERS} workers, {h.fmt(ref.median)} ms",
                      ["contender", "total", "slow input back", "its neighbour back", "total / reference",
                       "neighbour / slow"], rows)
    lines = [
        target_line("tiny map (20,000 ints), local / ProcessPoolExecutor.map chunked",
                    suite.find("local", "x", case="tiny", vs="procpool_chunked"), 1.0),
        target_line("tiny map, local / Pool.imap chunked", suite.find("local", "x", case="tiny",
                                                                      vs="mp_imap_chunked"), 1.0),
        target_line(f"{TARGET_US} µs of Python per input, local / ProcessPoolExecutor.map chunked",
                    suite.find("local", "x", case="work", work_us=TARGET_US, vs="procpool_chunked"), 0.9),
        target_line(f"{TARGET_US} µs of Python per input, local / Pool.imap chunked",
                    suite.find("local", "x", case="work", work_us=TARGET_US, vs="mp_imap_chunked"), 0.9),
        target_line("a straggler: local's total / (the slow input alone + the cheap work over 2 workers)",
                    suite.find("local", "x", what="total", vs="reference", **straggling), 1.0, at_most=True),
        target_line("a straggler: when its neighbour came back / when it did (~1.0x: hidden in its chunk)",
                    suite.find("local", "x", what="neighbour_back", **straggling), 0.5, at_most=True),
        target_line("the empty round trip, Local.run / ProcessPoolExecutor.submit().result()",
                    suite.find("local", "x", what="round_trip", vs="procpool"), 0.6, at_most=True),
        target_line("hops per warm Local.run (host, all threads)", suite.find("local", "calls", what="hops",
                                                                             per="run"), 15, at_most=True),
        target_line("hops per map input", suite.find("local", "calls", what="hops", per="map_input"), 5,
                    at_most=True),
    ]
    print("\nissue 31's targets (each measured in this run, side by side):")
    for line in lines:
        print("  " + line)


# -- the plot --------------------------------------------------------------------------------------------------

def plot(suite: h.Suite, path: str, others: float) -> None:
    import _plot

    def rate(name, us):
        params = {"case": "tiny"} if us == 0 else {"case": "work", "work_us": us}
        found = suite.find(name, "inputs/s", **params)
        return found.median if found else None

    def ratio(vs, us):
        params = {"case": "tiny"} if us == 0 else {"case": "work", "work_us": us}
        found = suite.find("local", "x", vs=vs, **params)
        return found.median if found else None

    x = [f"{us:,}" for us in SWEEP_US]
    shown = ("local", "procpool_chunked", "mp_imap_chunked", "procpool")
    labels = {"local": "soma Local(workers=2).map", "procpool_chunked": "ProcessPoolExecutor.map, chunked",
              "mp_imap_chunked": "Pool.imap, chunked", "procpool": "ProcessPoolExecutor.map (chunksize 1)"}
    _plot.draw(path, f"soma bench map ({suite.mode}), {h.versions()}; chunked: chunksize=len(xs)//{CHUNKS}; "
                     f"other programs used {others:.0f}% of a core meanwhile", [
        _plot.Panel("inputs/s against work per input (higher is better)", x=x, xlabel="µs of Python per input",
                    ylabel="inputs/s", logy=True, labels=labels,
                    series={name: [rate(name, us) for us in SWEEP_US] for name in shown}),
        _plot.Panel("soma's inputs/s over the chunked pools' (per round)", x=x, xlabel="µs of Python per input",
                    ylabel="×", labels={"procpool_chunked": "over ProcessPoolExecutor, chunked",
                                        "mp_imap_chunked": "over Pool.imap, chunked"},
                    series={vs: [ratio(vs, us) for us in SWEEP_US] for vs in ("procpool_chunked", "mp_imap_chunked")},
                    targets={"target, tiny: 1.0x": 1.0, "target, 100 µs: 0.9x": 0.9}),
    ])
