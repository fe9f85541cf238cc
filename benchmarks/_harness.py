"""What every benchmark shares: arguments, alternation, statistics, tables, JSON, the calibrated burn.

    suite = Suite("gil_wave", parse_args(argv, __doc__))
    samples = alternate({"executor": lambda: ex.run(g, None), "local": lambda: local.run(g, None)},
                        repeat=suite.repeat(7))
    suite.add("local", {"B": 4}, ms(samples["local"]), "ms")
    suite.add_ratio("local", {"B": 4}, samples["executor"], samples["local"], vs="executor")
    suite.finish()          # prints the records, writes --json, returns the records

Every contender's answers are checked, not only timed: `expect` and
`expect_filled` raise `WrongValue` naming the contender, `Held` keeps results
across repetitions and checks them again when let go of (a result overwritten
by a later run is caught there), and `cli` turns a `WrongValue` into a loud exit
with status 1.

Why alternate: this machine is a shared VM whose CPU drifts 2-3x between
minutes. Measuring contender A for a minute and then B for a minute measures the
drift; running A, B, C, then B, C, A, ... in one process puts every contender
under the same weather, and a ratio taken within one round (`add_ratio`) cancels
most of what is left.

Everything here is stdlib only: worker processes of the process pools import this
module (for `burn`) and should not pay for more.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from collections import deque
from typing import Callable

CORES = os.cpu_count() or 1
MiB = 1 << 20


# -- arguments -----------------------------------------------------------------------------------

def parse_args(argv, description: str, plot: bool = False) -> argparse.Namespace:
    """`--quick` (under a minute), `--smoke` (seconds: the test suite's mode), `--json FILE`; with `plot`,
    `--plot FILE.png` (for the benchmarks that draw their figures: matplotlib, the `plot` extra)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and inputs (under a minute)")
    parser.add_argument("--smoke", action="store_true", help="the smallest run that exercises every path (tests)")
    parser.add_argument("--json", metavar="FILE", nargs="?", const="-",
                        help="write one record per measurement to FILE (no FILE: to stdout, the tables to stderr)")
    parser.add_argument("--ray", action="store_true",
                        help="add Ray rows (a fresh local Ray instance, never an existing cluster; also "
                             "SOMA_BENCH_RAY=1)")
    if plot:
        parser.add_argument("--plot", metavar="FILE.png", help="draw the figures into FILE.png (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.json == "-":  # for machines: stdout is the JSON alone, everything printed goes to stderr
        global _JSON_OUT
        _JSON_OUT, sys.stdout = sys.stdout, sys.stderr
    return args


_JSON_OUT = None  # the real stdout, when --json writes there


def write_json(path: str, data, what: str) -> None:
    """`data` as JSON into `path`, or onto stdout for `-` (`--json` given no FILE)."""
    if path == "-":
        json.dump(data, _JSON_OUT, indent=1)
        _JSON_OUT.write("\n")
        _JSON_OUT.flush()
        return
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(f"\nwrote {what} to {path}")


# -- running contenders --------------------------------------------------------------------------

def alternate(contenders: dict[str, Callable[[], object]], repeat: int, warmup: int = 1,
              self_timed: bool = False, check: Callable[[str, object], None] | None = None) -> dict[str, list]:
    """Run every contender once per round, `warmup` rounds thrown away, then `repeat` kept.

    Each round starts one contender later than the one before (A B C, B C A, ...),
    so no contender always runs first or right after the same neighbour. A sample
    is the call's wall time in seconds, or, with `self_timed`, what the call
    returns (it measured itself: its own units, or several figures at once).
    Sample i of every contender comes from round i: `add_ratio` pairs them.
    `check(name, returned)` runs after every call, warm-up included, off the
    clock; it raises `WrongValue` for a wrong answer (self-timed contenders check
    their own answers inside the call, off their own clock).
    """
    names = list(contenders)
    samples: dict[str, list] = {name: [] for name in names}
    for round_no in range(warmup + repeat):
        shift = round_no % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()  # garbage of the previous contender is not this one's cost
            start = time.perf_counter()
            value = contenders[name]()
            elapsed = time.perf_counter() - start
            if check is not None:
                check(name, value)
            if round_no >= warmup:
                samples[name].append(value if self_timed else elapsed)
    return samples


def timed(func, *args):
    """`(seconds, result)` of one call."""
    start = time.perf_counter()
    result = func(*args)
    return time.perf_counter() - start, result


def ms(values) -> list[float]:
    return [v * 1e3 for v in values]


def us(values) -> list[float]:
    return [v * 1e6 for v in values]


def paired_ratios(numerators, denominators) -> list[float]:
    """numerator_i / denominator_i, round by round (both measured in the same round)."""
    return [a / b for a, b in zip(numerators, denominators) if b]


# -- checking what contenders return -------------------------------------------------------------

class WrongValue(RuntimeError):
    """A contender returned something other than what it had to: the benchmark fails, loudly."""


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def expect(contender: str, got, expected, what: str = "") -> None:
    """`got == expected`, or a `WrongValue` naming the contender (and, for sequences, the first difference)."""
    if got == expected:
        return
    detail = f"got {_short(got)}, expected {_short(expected)}"
    if isinstance(got, (list, tuple)) and isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            detail = f"{len(got)} values, expected {len(expected)}"
        else:
            i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
            if i is not None:  # (None: equal items in a list where a tuple was expected, or the other way)
                detail = f"value {i} is {_short(got[i])}, expected {_short(expected[i])}"
    raise WrongValue(f"{contender} returned wrong values{' (' + what + ')' if what else ''}: {detail}")


def expect_filled(contender: str, t, fill: float, numel: int, what: str = "") -> None:
    """A tensor of `numel` elements, every one equal to `fill` (one pass: aminmax reads every page)."""
    if t.numel() != numel:
        raise WrongValue(f"{contender} returned a tensor of {t.numel()} elements, expected {numel} ({what})")
    lo, hi = (float(v) for v in t.aminmax())
    if lo != fill or hi != fill:
        raise WrongValue(f"{contender} returned a tensor that should hold {fill:g} everywhere and holds values "
                         f"from {lo:g} to {hi:g}{' (' + what + ')' if what else ''}: overwritten or mixed up")


_fills = itertools.count(1)


def next_fill() -> float:
    """A fill value no earlier call used (exact in float32 up to 2**24): a result overwritten by a later
    one, or one contender's answer handed to another, shows up as the wrong number."""
    return float(next(_fills) % (1 << 24))


class Held:
    """Results the caller keeps across repetitions, as a user keeping them in a list would.

    `add(contender, check)` keeps `check` (a callable that re-reads a held
    result and raises `WrongValue` if it changed) for the last `keep` results of
    each contender; a result is checked again when it is let go of, and every
    one left at `check_all()`. Holding is the point: a pool that reused memory a
    held result still lives in is caught here, not only in the result just made.
    """

    def __init__(self, keep: int = 3):
        self.keep = keep
        self.held: dict[str, deque] = {}

    def add(self, contender: str, check: Callable[[], None]) -> None:
        ring = self.held.setdefault(contender, deque())
        ring.append(check)
        while len(ring) > self.keep:
            ring.popleft()()

    def filled(self, contender: str, t, fill: float, numel: int, what: str) -> None:
        """Check a tensor just received (every element `fill`), and hold it: it is checked again when let go of."""
        expect_filled(contender, t, fill, numel, what)
        self.add(contender, lambda: expect_filled(contender, t, fill, numel, f"{what}, held across later ones "
                                                                             f"(filled with {fill:g})"))

    def check_all(self) -> int:
        """Check (and let go of) everything still held; returns how many were checked."""
        count = 0
        for ring in self.held.values():
            while ring:
                ring.popleft()()
                count += 1
        return count


class Pools:
    """The warm pools most benchmarks compare, `workers` each, started together and closed together:
    `local` (soma.Local), `procpool` (ProcessPoolExecutor, spawn), `mp_pool` (multiprocessing.Pool,
    spawn), `threads` (ThreadPoolExecutor). soma is imported here, not at the top: the pools'
    children import this module and need none of it."""

    def __init__(self, workers: int):
        import concurrent.futures as cf
        import multiprocessing as mp

        import soma

        spawn = mp.get_context("spawn")
        self.local = soma.Local(workers=workers).start()
        self.procpool = cf.ProcessPoolExecutor(workers, mp_context=spawn)
        self.mp_pool = spawn.Pool(workers)
        self.threads = cf.ThreadPoolExecutor(workers)

    def close(self) -> None:
        self.local.close()
        self.procpool.shutdown(wait=True)
        self.mp_pool.close()
        self.mp_pool.join()
        self.threads.shutdown(wait=True)


def cli(main: Callable) -> None:
    """`main(sys.argv[1:])`, and a wrong value is exit status 1 with a last line that says whose it was."""
    try:
        main(sys.argv[1:])
    except WrongValue as wrong:
        import traceback

        traceback.print_exc()
        print(f"\nFAILED: {wrong}", file=sys.stderr)
        sys.exit(1)


# -- the calibrated burn ---------------------------------------------------------------------------

def burn(n: int) -> int:
    """Pure-Python work that holds the GIL for its whole length: `n` loop iterations, not a clock.

    A wall-clock loop (`while time.perf_counter() < end`) ends on time however
    little it ran, so threads sharing the GIL would look parallel.
    """
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


def calibrate_burn(ms_target: float, tries: int = 7) -> int:
    """The iteration count that takes about `ms_target` ms here, calibrated once.

    The fastest of several tries: a shared VM only ever makes a try slower.
    """
    probe = 200_000
    burn(probe)
    best = min(timed(burn, probe)[0] for _ in range(tries))
    return max(1, round(probe * ms_target / 1e3 / best))


# -- records -----------------------------------------------------------------------------------------

class Record:
    """One measurement: a contender under some parameters, its samples, their unit."""

    def __init__(self, benchmark: str, contender: str, params: dict, values: list, unit: str):
        if not values:
            raise ValueError(f"{benchmark}/{contender} {params}: no samples")
        self.benchmark = benchmark
        self.contender = contender
        self.params = dict(params)
        self.values = [float(v) for v in values]
        self.unit = unit

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def to_json(self) -> dict:
        return {"benchmark": self.benchmark, "contender": self.contender, "params": self.params,
                "median": self.median, "min": min(self.values), "max": max(self.values),
                "unit": self.unit, "n": len(self.values)}


class Suite:
    """The records of one benchmark module, and how they are shown and saved."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.args = args
        self.records: list[Record] = []
        self.started = self._last_done = time.perf_counter()
        self._machine_at_start = MachineShare()

    @property
    def mode(self) -> str:
        return "smoke" if self.args.smoke else "quick" if self.args.quick else "full"

    def repeat(self, full: int, quick: int = 3, smoke: int = 1) -> int:
        return {"full": full, "quick": quick, "smoke": smoke}[self.mode]

    def done(self, what: str) -> None:
        """A progress line: `what` is done, in how many seconds since the last one (where a mode's time goes)."""
        now = time.perf_counter()
        print(f"  {what} done ({now - self._last_done:.1f} s)", flush=True)
        self._last_done = now

    def add(self, contender: str, params: dict, values, unit: str) -> Record:
        record = Record(self.name, contender, params, list(values), unit)
        self.records.append(record)
        return record

    def add_ratio(self, contender: str, params: dict, numerators, denominators, vs: str) -> Record:
        """A ratio taken round by round; `vs` names what it is relative to (it joins the params)."""
        return self.add(contender, {**params, "vs": vs}, paired_ratios(numerators, denominators), "x")

    def add_rates(self, samples: dict, count: int, unit: str, params: dict, base: str = "local") -> None:
        """Each contender's rate (`count` over its seconds) and `base`'s speed-up over every other, round by round
        (the other's seconds over base's: above 1, base is faster)."""
        for name, seconds in samples.items():
            self.add(name, params, [count / s for s in seconds], unit)
        for name in samples:
            if name != base:
                self.add_ratio(base, params, samples[name], samples[base], vs=name)

    def find(self, contender: str, unit: str | None = None, **params) -> Record | None:
        for r in self.records:
            if r.contender == contender and (unit is None or r.unit == unit) and all(
                    r.params.get(k) == v for k, v in params.items()):
                return r
        return None

    def finish(self, summary: Callable[[], None] | None = None) -> list[dict]:
        """Print every record, then the `summary` tables; write --json; return the records as dicts.

        Call it after every pool is closed: the CPU of children that have exited and
        been waited for counts as this benchmark's own, not as other programs'.
        """
        others, steal = self._machine_at_start.others()
        self.add("machine", {"what": "other_programs_cpu"}, [others], "% of a core")
        self.add("machine", {"what": "cpu_steal"}, [steal], "% of a core")
        print_records(self.records, f"{self.name}: every measurement")
        if summary is not None:
            summary()
        print(f"\nwhile it ran, other programs used {others:.0f}% of a core and the hypervisor stole {steal:.0f}% "
              f"(of {CORES} cores: {CORES * 100}%)")
        out = [r.to_json() for r in self.records]
        if self.args.json:
            write_json(self.args.json, out, f"{len(out)} records")
        print(f"\n{self.name} ({self.mode}) took {time.perf_counter() - self.started:.1f} s")
        return out


class MachineShare:
    """How much of the machine went to programs other than this benchmark, from now until `others()`.

    /proc/stat counts every busy tick of the machine; this process and its
    children (waited for: the pools' workers once closed) count their own. What is
    left was someone else's: on a shared VM it explains a figure that came out
    low better than any guess. Steal is time the hypervisor gave to other guests.
    """

    def __init__(self):
        self.wall = time.perf_counter()
        self.busy, self.steal = _machine_ticks()
        self.own = _own_cpu()

    def others(self) -> tuple[float, float]:
        """(% of a core used by other programs, % of a core stolen), averaged since construction."""
        wall = time.perf_counter() - self.wall
        busy, steal = _machine_ticks()
        ticks = os.sysconf("SC_CLK_TCK")
        machine = (busy - self.busy) / ticks
        others = max(0.0, machine - (_own_cpu() - self.own))
        return 100 * others / wall, 100 * (steal - self.steal) / ticks / wall


def _machine_ticks() -> tuple[int, int]:
    """(busy ticks of all cores, stolen ticks) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def _own_cpu() -> float:
    """CPU seconds of this process and of its children: the ones waited for and the ones still alive."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass
    except ImportError:
        pass
    return total


# -- tables --------------------------------------------------------------------------------------------

def fmt(value: float) -> str:
    """Three significant figures or so, without scientific notation."""
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    """A Markdown table: readable in a terminal, pasteable into a README."""
    cells = [[c if isinstance(c, str) else fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}\n")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |")
    sys.stdout.flush()


def params_text(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def print_records(records: list[Record], title: str) -> None:
    rows = [[r.contender, params_text(r.params), r.median, min(r.values), max(r.values), r.unit, str(len(r.values))]
            for r in records]
    print_table(title, ["contender", "params", "median", "min", "max", "unit", "n"], rows)


def cell(record: Record | None, ratio: Record | None = None) -> str:
    """`median` or `median (ratio×)` for a pivot table; `—` when not measured."""
    if record is None:
        return "—"
    text = fmt(record.median)
    return f"{text} ({fmt(ratio.median)}×)" if ratio is not None else text


# -- optional contenders ---------------------------------------------------------------------------------

# Ray starts its workers at nice 15 (its `worker_niceness`): beside any busy program at nice 0 they got a few
# % of a core (a 60 s soma_ray smoke ran past 300 s beside two CPU burners; 82 s at nice 0). Every contender here
# runs at nice 0, so a Ray a benchmark starts does too (read by the raylet as it starts; the user's value stays).
RAY_WORKER_NICENESS = ("RAY_worker_niceness", "0")


def optional_ray():
    """The `ray` module when it imports, else None (`pip install 'soma[ray]'` brings it); a Ray started after
    this runs its workers at nice 0, as every other contender (RAY_WORKER_NICENESS)."""
    try:
        import ray
    except ImportError:
        return None
    os.environ.setdefault(*RAY_WORKER_NICENESS)
    return ray


def local_ray(args: argparse.Namespace):
    """For the Ray rows of a benchmark: the `ray` module, initialised on a fresh local instance of our own,
    when asked for (`--ray` or SOMA_BENCH_RAY=1) and importable; else None, with the reason printed.

    Never by default: another program's Ray cluster may be running on this
    machine, and a bare `ray.init` would connect to it (and then refuse
    `num_cpus`). `address="local"` always starts a new instance; the caller
    shuts it down with `ray.shutdown()`. Ray binds this machine's address: run
    with --ray only where that is fine, such as a loopback-only network
    namespace (benchmarks/soma_ray.py re-runs itself in one).
    """
    if not (getattr(args, "ray", False) or os.environ.get("SOMA_BENCH_RAY") == "1"):
        print("ray rows skipped: pass --ray (or set SOMA_BENCH_RAY=1) to start a fresh local Ray instance for them")
        return None
    ray = optional_ray()
    if ray is None:
        print("ray rows skipped: `import ray` failed (pip install 'soma[ray]')")
        return None
    ray.init(address="local", num_cpus=CORES, include_dashboard=False, log_to_driver=False)
    return ray


IN_NAMESPACE = "SOMA_BENCH_LOOPBACK"  # set for a benchmark re-run in a loopback-only network namespace


def rerun_on_loopback(name: str, script: str, argv: list[str]) -> None:
    """Replace this process with `script argv` inside a network namespace that has only `lo`, when allowed,
    so a Ray it starts never binds the machine's address (/work/shared/notes/ray.md); once (IN_NAMESPACE)."""
    import shutil
    import subprocess

    if os.environ.get(IN_NAMESPACE) or shutil.which("unshare") is None or shutil.which("ip") is None:
        return
    if subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode != 0:
        print(f"{name}: no network namespace here (unshare -n refused): Ray binds this machine's address")
        return
    os.environ[IN_NAMESPACE] = "1"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
                          script, *argv])


def versions() -> str:
    """Python, torch (when imported) and pyzmq versions and the cores, for the header."""
    parts = [f"Python {sys.version.split()[0]}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
    try:
        import zmq

        parts.append(f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()})")
    except ImportError:
        pass
    return ", ".join(parts) + f", {CORES} cores"
