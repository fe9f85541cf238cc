"""Ray checks of batches (run by tests/ray/checks.py in its session): a batching node's actor gets a map's
inputs of one call as one `forward_batch`, and a map sends heavy inputs one per call, starting copies only
when they pay for their start-up (soma.ray.spreading), while cheap ones share calls. Each returns what it
observed; tests/ray/test_runner.py asserts.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from soma import Done, Graph, Node


class DoubleBatch(Node):
    """A batching node: each output is (the size of the batch it came in, twice its input); an input of 13
    fails the whole batch it is in."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        if 13 in xs:
            raise ValueError("13 in the batch")
        return Done([(len(xs), 2 * x) for x in xs])


class SleepPid(Node):
    """Sleeps `seconds`, then returns (its input, the pid that ran it)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return Done((x, os.getpid()))


class FourCopies(SleepPid):
    """SleepPid with up to four copies (as on soma.Ray(num_cpus=4), whatever the session's CPUs)."""

    copies = 4


class Tiny(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


def _calls(path) -> list:
    """The `ray call` events of a trace file: (node, batch) each."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    return [(e["args"]["node"], e["args"]["batch"]) for e in events
            if e.get("ph") == "X" and e.get("cat") == "ray" and e["name"] == "ray call"]


def batching_node(cluster):
    """A map's batch reaches a batching node's actor as one forward_batch; a lone run is a batch of one; a
    failing batch fails each of its inputs (its own index), and nothing else."""
    g = Graph.somatize(DoubleBatch())
    out = {"run": cluster.run(g, 4)}
    mapped = list(cluster.map(g, [x for x in range(40) if x != 13], window=16))
    out["values"] = [v for _, v in mapped]
    out["largest_batch"] = max(size for size, _ in mapped)
    got = list(cluster.map(g, range(40), window=16, errors="yield"))
    out["failed"] = sorted(y.index for y in got if isinstance(y, Exception))
    out["failed_message"] = next(str(y) for y in got if isinstance(y, Exception))
    out["kept"] = sorted(v for y in got if not isinstance(y, Exception) for v in [y[1]])
    return out


def heavy_inputs_spread(cluster):
    """Four 0.5 s inputs after a warm-up run (issue 32): the map, which may start copies, against the same
    four inputs run one after another on the warm actor alone, timed in the same check; six 2 s inputs on a
    fresh node (start-ups measured by then: the queue a second copy saves is far longer); then a map of cheap
    inputs on a fresh node: once measured cheap, they share calls."""
    folder = tempfile.mkdtemp(prefix="soma-heavy-")
    out = {}
    try:
        heavy = Graph.somatize(FourCopies(0.5))
        cluster.run(heavy, -1)  # its first actor up (the runs alone on it then measure what an input costs)
        start = time.monotonic()
        alone = [cluster.run(heavy, x) for x in range(4)]
        out["alone_s"] = time.monotonic() - start
        with cluster.trace(Path(folder, "heavy.json")):
            start = time.monotonic()
            outputs = list(cluster.map(heavy, range(4), window=8))
            out["map_s"] = time.monotonic() - start  # (the trace's collection after it is not the map's)
        out["values"] = [x for x, _ in outputs]
        out["alone_values"] = [x for x, _ in alone]
        out["heavy_calls"] = _calls(Path(folder, "heavy.json"))
        six = list(cluster.map(Graph.somatize(SleepPid(2.0)), range(6)))
        out["six_values"] = [x for x, _ in six]
        out["six_pids"] = len({pid for _, pid in six})
        tiny = Graph.somatize(Tiny())
        with cluster.trace(Path(folder, "tiny.json")):
            out["tiny"] = list(cluster.map(tiny, range(200), window=8)) == list(range(1, 201))
        out["tiny_calls"] = _calls(Path(folder, "tiny.json"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return out


BATCHING_CHECKS = [batching_node, heavy_inputs_spread]
