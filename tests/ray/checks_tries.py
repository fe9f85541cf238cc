"""Ray checks of long jobs (run by tests/ray/checks.py in its session): retries after real actor deaths
(`os._exit`, SIGKILL of the actor's own pid), inputs a dead actor had not started, errors="yield", and a
node or an expression where a graph was expected. Each returns what it observed; tests/ray/test_runner.py asserts.

"Once" is kept in files, so a node knows across processes whether it already died for an input, and each
input's runs are counted (one line per run, naming the process).
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

from soma import Done, Graph, Node, RunTimeout
from tests.nodes import AddOne, AlwaysDie, Double, FailOdd, RaiseCounting


class DieOnceFor(Node):
    """Ends its process the first time it sees each input of `doomed` (a file per input says it did): by
    `os._exit`, or by SIGKILL of its own pid for those of `killed`; returns ten times its input."""

    def __init__(self, folder, doomed, killed=()):
        self.folder, self.doomed, self.killed = str(folder), set(doomed), set(killed)

    def forward(self, x, ctx):
        with open(os.path.join(self.folder, f"ran-{x}"), "a") as f:
            f.write(f"{os.getpid()}\n")
        mark = os.path.join(self.folder, f"died-{x}")
        if x in self.doomed | self.killed and not os.path.exists(mark):
            Path(mark).touch()
            if x in self.killed:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        return Done(x * 10)


class OneCopyDieOnceFor(DieOnceFor):
    """One copy: every input queued at one actor, run in the order sent (a map's window in one call)."""

    copies = 1


class CountRuns(Node):
    """Returns its input; counts its runs of each input in `folder` (one line per run)."""

    def __init__(self, folder):
        self.folder = str(folder)

    def forward(self, x, ctx):
        with open(os.path.join(self.folder, f"up-{x}"), "a") as f:
            f.write(f"{os.getpid()}\n")
        return Done(x)


class SleepCounting(Node):
    """Sleeps `x` seconds, counting its calls in a file."""

    def __init__(self, folder):
        self.folder = str(folder)

    def forward(self, x, ctx):
        with open(os.path.join(self.folder, "slept"), "a") as f:
            f.write("x\n")
        import time

        time.sleep(x)
        return Done(x)


def runs(folder, name: str) -> list:
    """The pids that ran input `name` (a file `ran-<x>` or `up-<x>`), one per run."""
    path = Path(folder, name)
    return path.read_text().split() if path.exists() else []


def _died(err) -> dict:
    return {"type": type(err).__name__, "message": str(err), "tries": getattr(err, "tries", None),
            "node": getattr(err, "node", None), "index": getattr(err, "index", None)}


def retries(cluster):
    """run with retries survives a death; retries exhausted say how many tries; node exceptions and
    timeouts are never retried; a map with retries yields every output once, in order and not."""
    folder = tempfile.mkdtemp(prefix="soma-retries-")
    out: dict = {}
    g = Graph.somatize(DieOnceFor(folder, {7}))
    out["run"] = cluster.run(g, 7, retries=1)
    out["run_pids"] = runs(folder, "ran-7")
    for name, times in (("exhausted", 1), ("without", 0)):
        try:
            cluster.run(Graph.somatize(AlwaysDie()), 0, retries=times)
        except Exception as err:
            out[name] = _died(err)
    try:
        cluster.run(Graph.somatize(RaiseCounting(folder)), 4, retries=3)
    except Exception as err:
        out["raised"] = _died(err) | {"count": Path(folder, "raised").read_text().count("x")}
    sleeper = Graph.somatize(SleepCounting(folder))
    cluster.run(sleeper, 0)  # its actor is up: the timeout stops a running node, not a starting actor
    try:
        cluster.run(sleeper, 30, timeout=1.0, retries=3)
    except RunTimeout as err:
        out["timed_out"] = _died(err) | {"nodes": list(err.nodes),
                                         "count": Path(folder, "slept").read_text().count("x") - 1}
    doomed, killed = {3, 21}, {12}
    for ordered in (True, False):
        mapped = tempfile.mkdtemp(prefix="soma-retries-map-")
        g = Graph.somatize(DieOnceFor(mapped, doomed, killed))
        outputs = list(cluster.map(g, range(30), retries=2, ordered=ordered, window=6))
        out[f"map_{ordered}"] = {"outputs": outputs,
                                 "doomed_runs": {x: runs(mapped, f"ran-{x}") for x in doomed | killed},  # pids
                                 "died": sorted(int(n.split("-")[1]) for n in os.listdir(mapped) if n.startswith("d"))}
    out["after"] = cluster.run(g, 1)
    return out


def innocents(cluster):
    """Inputs a dead actor had been sent and never started: sent elsewhere, no try, no error, whatever
    `retries` is. A copies = 1 node: the whole window queued at its one actor (one call, in order), input 0
    kills it; and a chain, where the inputs' calls upstream of the dead actor are kept (they ran once)."""
    folder = tempfile.mkdtemp(prefix="soma-innocents-")
    out: dict = {}
    g = Graph.somatize(OneCopyDieOnceFor(folder, {0}))
    _measured_cheap(cluster, g, 98)
    got = list(cluster.map(g, range(12), window=12, errors="yield"))
    out["one_copy"] = [_died(y) if isinstance(y, Exception) else y for y in got]
    out["one_copy_runs"] = [len(runs(folder, f"ran-{x}")) for x in range(12)]
    chained = tempfile.mkdtemp(prefix="soma-innocents-chain-")
    g = Graph.somatize(CountRuns(chained) >> OneCopyDieOnceFor(chained, {100}))
    _measured_cheap(cluster, g, 198)
    got = list(cluster.map(g, [100 + x for x in range(8)], window=8, errors="yield"))
    out["chain"] = [_died(y) if isinstance(y, Exception) else y for y in got]
    out["chain_up_runs"] = [len(runs(chained, f"up-{100 + x}")) for x in range(8)]
    out["chain_runs"] = [len(runs(chained, f"ran-{100 + x}")) for x in range(8)]
    return out


class OneCopyBatchDiesOnce(Node):
    """One copy, batching two at a time: writes `batch-<first input>` listing its inputs, and SIGKILLs its own
    process in the first batch it runs (a file says it did); returns ten times each input."""

    copies = 1
    max_batch = 2
    batch_wait = 1.0  # (a call's inputs, announced, meet in one batch)

    def __init__(self, folder):
        self.folder = str(folder)

    def forward_batch(self, xs, ctx):
        Path(self.folder, f"batch-{xs[0]}").write_text(" ".join(map(str, xs)))
        mark = Path(self.folder, "died")
        if not mark.exists():
            mark.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return Done([x * 10 for x in xs])


def batch_innocents(cluster):
    """A batching node's actor killed in its first batch: the inputs of that batch fail (they started), the
    others it had been sent go elsewhere with no error (a call carried 8 inputs, and its actor counted all 8
    started as its first batch of 2 began: the 6 others failed too)."""
    folder = tempfile.mkdtemp(prefix="soma-batch-innocents-")
    g = Graph.somatize(OneCopyBatchDiesOnce(folder))
    Path(folder, "died").touch()
    cluster.run(g, 100)  # the copy is up (not killed: the mark is there)
    os.unlink(Path(folder, "died"))
    got = list(cluster.map(g, range(8), errors="yield"))
    first = [int(x) for x in Path(folder, "batch-0").read_text().split()] if Path(folder, "batch-0").exists() else []
    return {"failed": sorted(y.index for y in got if isinstance(y, Exception)), "first_batch": first,
            "values": [y for y in got if not isinstance(y, Exception)]}


def _measured_cheap(cluster, g, x) -> None:
    """Two runs (of inputs the check does not count): the second one alone on the copies that are up measures
    the graph cheap, so a map's window goes in calls of several inputs, queued at the one actor (a heavy or
    unmeasured map holds its inputs until a copy is free: none would be queued there)."""
    cluster.run(g, x)
    cluster.run(g, x + 1)


def errors_yield(cluster):
    """errors="yield": each failure in its place with its `.index`, the map going on; an unknown value is
    MapLoop's ValueError."""
    g = Graph.somatize(FailOdd())
    out: dict = {}
    for ordered in (True, False):
        got = list(cluster.map(g, range(10), errors="yield", ordered=ordered))
        out[f"yield_{ordered}"] = [[type(y).__name__, y.index, str(y)] if isinstance(y, Exception) else y
                                   for y in got]
    try:
        cluster.map(g, [1], errors="skip")
    except ValueError as err:
        out["unknown"] = str(err)
    return out


def graph_expected(cluster):
    """A node or an expression where a graph was expected, as on the Executor and Local; anything else is
    the TypeError saying what run takes."""
    out = {"node": cluster.run(AddOne(), 1), "expression": cluster.run(AddOne() >> Double(), 1),
           "map": list(cluster.map(AddOne() >> Double(), [1, 2, 3]))}
    try:
        cluster.run(len, 1)
    except TypeError as err:
        out["refused"] = str(err)
    return out


TRIES_CHECKS = [retries, innocents, batch_innocents, errors_yield, graph_expected]
