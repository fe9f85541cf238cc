"""startup: a cold pool, from nothing to its first result and closed again.

    python benchmarks/startup.py [--quick] [--smoke] [--json out.json]   (or: soma bench startup)

Each measurement is a fresh process (`_startup_child.py`), so imports count the
same way for both contenders and each pays for its own:

    local          import soma; Local(workers=2).start(); run a one-node graph; close()
    procpool       import concurrent.futures; ProcessPoolExecutor(2, spawn);
                   submit(echo).result(); shutdown(). With spawn the pool starts a
                   child per submit that finds none idle: one task starts one child.
    procpool_both  the same with 2 tasks submitted at once, so both children start
                   (as Local.start() starts both workers and waits for them)

measured inside the child from just before its first import (the interpreter's
own start-up is the same for both and not counted; `process` is the whole
child's wall time, seen from here). Two settings: a host program that has not
imported torch, and one that has (then Local's workers import torch at start,
as Local does by default when its host uses torch; the pool's children do not).
Contenders alternate, one child at a time. Each child checks the answers it gets
and exits with status 1 naming its contender when one is wrong; this run then
fails with that message.

Bytecode: soma's modules are compiled first (`compileall`, what `pip install`
does), as the standard library the pool's children import is. Without it, every
worker compiles soma from source at each start: an editable install under
PYTHONDONTWRITEBYTECODE=1 (this machine's default) never writes the .pyc files,
and that costs Local ~45 ms of its start on 2 cores (benchmarks/README.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import _harness as h

NAME = "startup"
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_startup_child.py")
CONTENDERS = ["local", "procpool", "procpool_both"]


def run_child(contender: str, with_torch: bool) -> dict:
    """The child's phases in seconds, plus `process`: its whole life seen from here."""
    argv = [sys.executable, CHILD, contender] + (["--torch"] if with_torch else [])
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        wrong = "returned wrong values" in done.stderr  # the child's own check (see _startup_child.expect)
        raise (h.WrongValue if wrong else RuntimeError)(
            f"{contender}: {' '.join(argv)} failed ({done.returncode}):\n{done.stderr}")
    phases = json.loads(done.stdout.strip().splitlines()[-1])
    phases["process"] = elapsed
    return phases


def measure(suite: h.Suite, with_torch: bool) -> None:
    samples = h.alternate({name: (lambda n=name: run_child(n, with_torch)) for name in CONTENDERS},
                          repeat=suite.repeat(full=7, quick=3, smoke=1), self_timed=True)
    params = {"workers": 2, "host_has_torch": with_torch}
    for name, runs in samples.items():
        for phase in runs[0]:
            suite.add(name, {**params, "phase": phase}, h.ms(r[phase] for r in runs), "ms")
    totals = {name: [r["total"] for r in runs] for name, runs in samples.items()}
    suite.add_ratio("local", {**params, "phase": "total"}, totals["local"], totals["procpool"], vs="procpool")
    suite.add_ratio("local", {**params, "phase": "total"}, totals["local"], totals["procpool_both"],
                    vs="procpool_both")


def compile_soma() -> str:
    """Compile soma's modules to bytecode where they are (as `pip install` does); say what happened."""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("soma")
    root = list(spec.submodule_search_locations)[0]
    if compileall.compile_dir(root, quiet=2):
        return f"soma's bytecode compiled in {root}"
    return f"soma's bytecode could NOT be written in {root}: its workers compile it at every start"


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    settings = [False] if args.smoke else [False, True]
    print(f"{NAME}: {h.versions()}; mode {suite.mode}; {compile_soma()}")
    for with_torch in settings:
        measure(suite, with_torch)
        print(f"  host_has_torch={with_torch} done", flush=True)
    return suite.finish(lambda: print_summary(suite, settings))


def print_summary(suite: h.Suite, settings) -> None:
    rows = []
    for with_torch in settings:
        for name in CONTENDERS:
            def phase(p):
                return h.cell(suite.find(name, "ms", host_has_torch=with_torch, phase=p))

            ratios = [suite.find(name, "x", host_has_torch=with_torch, phase="total", vs=vs)
                      for vs in ("procpool", "procpool_both")]
            rows.append([name, "yes" if with_torch else "no", phase("import"), phase("start"),
                         phase("first_result"), phase("close"), phase("total"), phase("process")]
                        + [h.fmt(r.median) + "×" if r else "—" for r in ratios])
    h.print_table(f"{NAME}: cold pool of 2 → first result → closed, median ms in a fresh process "
                  f"(ratios of the totals, per round)",
                  ["contender", "host has torch", "import", "start", "first result", "close", "total",
                   "process", "total / procpool", "total / procpool_both"], rows)


if __name__ == "__main__":
    h.cli(main)
