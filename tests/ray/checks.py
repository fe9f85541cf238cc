"""Every Ray check in one process: one local Ray session, then one two-machine cluster, all on loopback.

    python tests/ray/checks.py OUT.json          (tests/ray/test_runner.py runs it under `unshare -n`)

Starting Ray takes seconds, so the checks share one session (and then one
cluster) instead of one each. Each check returns what it *observed* as plain
data; the assertions live in tests/ray/test_runner.py, one test per check, so each can
fail on its own. A check that raises is recorded with its traceback. Nothing
here sleeps to let something happen: waits are on conditions with deadlines.

Nodes defined here live in `__main__`: they travel to the actors by value
(soma.wire.nodecode), the way a user's script's nodes do; the others come from
tests/nodes.py by name.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import ray  # noqa: E402

import soma  # noqa: E402
from soma import Done, Executor, Graph, Node  # noqa: E402
from tests.nodes import (  # noqa: E402
    AddOne,
    Boom,
    Count,
    Double,
    Fill,
    Identity,
    MarkThenSleep,
    Obeys,
    OneCopyCounter,
    Pid,
    PlusOne,
    Rendezvous,
    RequiresGradOutput,
    ReturnsMovingDevice,
    ReturnsOn,
    ReturnsUnpicklable,
    Sleep,
    Tokenize,
    Unpicklable,
    Upper,
)
from tests.ray.checks_async import ASYNC_CHECKS  # noqa: E402
from tests.ray.checks_batching import BATCHING_CHECKS  # noqa: E402
from tests.ray.checks_tries import TRIES_CHECKS  # noqa: E402

DEADLINE_S = 60.0


# -- nodes of these checks (by value, from __main__) ------------------------------------------------

class DieOn(Node):
    """Ends its process (os._exit) on one input; returns (input, its pid) for every other one."""

    def __init__(self, fatal):
        self.fatal = fatal

    def forward(self, x, ctx):
        if x == self.fatal:
            os._exit(3)
        return Done((x, os.getpid()))


class SlowOn(Node):
    """Sleeps a long time on one input (a run's timeout must stop it); returns (input, its pid) at once otherwise."""

    def __init__(self, slow):
        self.slow = slow

    def forward(self, x, ctx):
        if x == self.slow:
            time.sleep(120)
        return Done((x, os.getpid()))


class SleepInput(Node):
    """Sleeps as many seconds as its input says, and returns it."""

    def forward(self, x, ctx):
        time.sleep(x)
        return Done(x)


class HoldUntilFile(Node):
    """Returns its input; an input that is a path makes `<path>.started`, then waits (at most DEADLINE_S) until
    the file `<path>` exists."""

    def forward(self, x, ctx):
        if isinstance(x, str):
            Path(f"{x}.started").touch()
            deadline = time.monotonic() + DEADLINE_S
            while not os.path.exists(x) and time.monotonic() < deadline:
                time.sleep(0.01)  # polling a condition, with a deadline
        return Done(x)


class OneCopyMarkThenSleep(Node):
    """One copy: on input 2 (the first node adds one to 1) it writes `marker`, then sleeps a long time."""

    copies = 1

    def __init__(self, marker):
        self.marker = marker

    def forward(self, x, ctx):
        if x == 2:
            Path(self.marker).write_text("running")
            time.sleep(120)
        return Done((x, os.getpid()))


class TwoCopies(Node):
    """Adds one, except on `bad` (raises ValueError) and on `fatal` (ends its process); at most two copies."""

    copies = 2

    def __init__(self, bad=None, fatal=None):
        self.bad, self.fatal = bad, fatal

    def forward(self, x, ctx):
        if x == self.bad:
            raise ValueError(f"bad input {x!r}")
        if x == self.fatal:
            os._exit(3)
        return Done(x + 1)


class RayNodeId(Node):
    """Appends (its id, the Ray node id it runs on, its pid) to its input list."""

    def forward(self, x, ctx):
        return Done(list(x) + [(ctx.node, ray.get_runtime_context().get_node_id(), os.getpid())])


class OnGpu(Node):
    """What a cuda:N node sees: its ctx.device, the GPU torch gives it, the ids Ray reserved."""

    def forward(self, x, ctx):
        import torch

        t = torch.ones(4, device=ctx.device)
        props = torch.cuda.get_device_properties(torch.device(ctx.device))
        return Done({"device": ctx.device, "tensor_device": str(t.device), "visible": os.environ.get(
            "CUDA_VISIBLE_DEVICES"), "reserved": [str(g) for g in ray.get_gpu_ids()],
            "uuid": str(getattr(props, "uuid", "")), "sum": float(t.sum())})


# -- the checks of the local session ----------------------------------------------------------------

def same_answers(cluster):
    g = Graph.somatize(Tokenize() >> (Upper() | Count()) >> Identity().named("join"))
    xs = ["a b c", "d", "x y", "p q r s"]
    return {"executor": [Executor().run(g, x) for x in xs],
            "run": [cluster.run(g, x) for x in xs],
            "map": list(cluster.map(g, xs)),
            "map_unordered": sorted(cluster.map(g, xs, ordered=False), key=lambda out: out[1])}


def wave_overlap(cluster):
    folder = tempfile.mkdtemp(prefix="soma-rendezvous-")
    try:
        a, b = Path(folder, "a"), Path(folder, "b")
        g = Graph.somatize(Identity() >> (Rendezvous(a, b) | Rendezvous(b, a)))
        first, second = cluster.run(g, None)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"branches": [first, second], "driver_pid": os.getpid()}


def copies_one_keeps_state(cluster):
    counts = Graph.somatize(OneCopyCounter())  # returns (its count, its pid)
    runs = [cluster.run(counts, None) for _ in range(3)]
    mapped = list(cluster.map(counts, range(6), window=4))
    more = [cluster.run(counts, None) for _ in range(2)]
    fresh = list(cluster.map(Graph.somatize(OneCopyCounter()), range(40)))  # its first inputs meet a starting actor
    return {"runs": runs, "map": mapped, "after_map": more, "fresh_map": fresh}


def map_spreads_over_actors(cluster):
    g = Graph.somatize(Sleep(0.02) >> Pid())
    pids, taken = set(), 0
    deadline = time.monotonic() + DEADLINE_S

    def endless():
        while True:
            yield None

    outputs = cluster.map(g, endless(), window=4)
    for pid in outputs:  # until a second copy has taken inputs (copies start only when the first is busy)
        taken += 1
        pids.add(pid)
        if len(pids) >= 2 or time.monotonic() > deadline:
            break
    outputs.close()
    return {"pids": sorted(pids), "inputs": taken, "driver_pid": os.getpid()}


def map_batches(cluster):
    """A map of 24 inputs, window 4, over nodes of two copies: its inputs share calls (two per call), and
    each input still has its own outcome: a value, its own NodeError, or WorkerDied when its call's actor died.
    The calls are counted in a trace: one `ray call` event per Ray call, listing the inputs it carried."""
    from soma.ray.inflight import RayInflight

    folder = tempfile.mkdtemp(prefix="soma-batches-")
    xs = list(range(24))
    g = Graph.somatize(TwoCopies().named("add") >> Double())
    out: dict = {"executor": [Executor().run(g, x) for x in xs], "inputs": len(xs)}
    out["untraced"] = list(cluster.map(g, xs, window=4))
    with cluster.trace(Path(folder, "ordered.json")):
        out["ordered"] = list(cluster.map(g, xs, window=4))
    ordered = _ray_calls(Path(folder, "ordered.json"))
    out["calls_ordered"] = len(ordered["add"]), len(ordered["double"])
    with cluster.trace(Path(folder, "unordered.json")):
        out["unordered"] = list(cluster.map(g, xs, window=4, ordered=False))
    unordered = _ray_calls(Path(folder, "unordered.json"))
    out["calls_both"] = [len(ordered[node]) + len(unordered[node]) for node in ("add", "double")]
    # each input in exactly one call per node, each call's `batch` the number of inputs it lists
    out["carried"] = [sorted(i for call in calls[node] for i in call["inputs"]) for calls in (ordered, unordered)
                      for node in ("add", "double")]
    out["batches_counted"] = all(call["batch"] == len(call["inputs"]) for calls in (ordered, unordered)
                                 for node in calls for call in calls[node])
    out["copies"] = len(_copies(cluster, "add"))

    failing = Graph.somatize(TwoCopies(bad=11).named("fails") >> Double())
    list(cluster.map(failing, range(11), window=4))  # measured cheap: its maps' inputs share calls from the first
    with cluster.trace(Path(folder, "failing.json")):
        for ordered in (True, False):
            seen = []
            try:
                for y in cluster.map(failing, xs, window=4, ordered=ordered):
                    seen.append(y)
            except Exception as err:
                out[f"failed_{ordered}"] = _error(err) | {"index": err.index, "before": seen}
    out["failed_calls"] = len(_ray_calls(Path(folder, "failing.json"))["fails"])
    shutil.rmtree(folder, ignore_errors=True)
    out["failing_batch"] = _one_batch(RayInflight, cluster, failing, [10, 11])  # 11 fails, 10 beside it

    dying = Graph.somatize(TwoCopies(fatal=9).named("dies"))
    seen = []
    try:
        for y in cluster.map(dying, xs, window=4):
            seen.append(y)
    except Exception as err:
        out["died"] = _error(err) | {"index": err.index, "worker": err.worker, "before": seen}
    out["dying_batch"] = _one_batch(RayInflight, cluster, dying, [8, 9])  # 9 kills the actor running both
    out["after_run"] = cluster.run(dying, 1)
    out["after_map"] = list(cluster.map(dying, [0, 1, 2, 3, 4, 5], window=4))
    return out


def _one_batch(inflight_class, cluster, g, xs, start=None) -> list:
    """What map's in-flight set reports for each input of one batch (the inputs of `xs` share each call;
    their indices count from `start`, by default from the first input)."""
    driver = cluster._driver
    inflight = inflight_class(driver, driver.actor_graph(g), None, True, len(xs))
    first = xs[0] if start is None else start
    inflight.start(list(range(first, first + len(xs))), xs)
    outcomes = []
    deadline = time.monotonic() + DEADLINE_S
    while inflight.submissions and time.monotonic() < deadline:
        outcomes += inflight.wait(1.0)
    inflight.close()
    return [[index, ok, value if ok else _error(value) | {"worker": getattr(value, "worker", None)}]
            for index, ok, value in sorted(outcomes, key=lambda o: o[0])]


def _copies(cluster, node_id: str) -> list:
    """The actors holding copies of a node now."""
    return [actor for actor in cluster._driver.book.actors() if actor.owner.node_id == node_id]


def _ray_calls(path) -> dict:
    """The `ray call` events of a trace file, by node: {node: [{"worker", "inputs", "batch"}, ...]}."""
    calls: dict = {}
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "ray" and e["name"] == "ray call":
            args = e["args"]
            calls.setdefault(args["node"], []).append({"worker": args["worker"], "inputs": args["inputs"],
                                                       "batch": args["batch"]})
    return calls


def node_error(cluster):
    out = {}
    try:
        cluster.run(Graph.somatize(AddOne() >> Boom()), 2)
    except Exception as err:
        out["run"] = _error(err)
        out["run"]["cause"] = repr(err.__cause__)
        out["run"]["cause_chain"] = _chain(err)
    seen = []
    try:
        for y in cluster.map(Graph.somatize(AddOne()), [1, 2, "x", 4]):
            seen.append(y)
    except Exception as err:
        out["map"] = _error(err)
        out["map"]["index"] = err.index
    out["map_before"] = seen
    wave = Graph.somatize(Identity() >> (Boom() | Boom()) >> Identity().named("join"))
    try:
        cluster.run(wave, 1)
    except Exception as err:
        out["wave"] = _error(err)
        out["wave"]["notes"] = list(getattr(err, "__notes__", []))
    # A failure upstream of a wave reaches the join (or the driver) through both branches: one failure,
    # with the Executor's text and no note of "another branch"
    for name, g in (("upstream_of_join", Boom() >> (Identity() | Identity()) >> Identity().named("join")),
                    ("upstream_of_last_wave", Boom() >> (Identity() | Identity()))):
        g = Graph.somatize(g)
        for runner in ("executor", "ray"):
            try:
                (Executor() if runner == "executor" else cluster).run(g, 1)
            except Exception as err:
                out[f"{name}_{runner}"] = _error(err) | {"notes": list(getattr(err, "__notes__", []))}
    try:  # Ray cannot pickle what the node returned: still soma's error, naming that node
        cluster.run(Graph.somatize(ReturnsUnpicklable() >> Identity()), 1)
    except Exception as err:
        out["unpicklable"] = _error(err)
    out["next_run"] = cluster.run(Graph.somatize(AddOne()), 1)
    return out


def unsendable_input(cluster):
    """An input Ray cannot serialize: soma's NodeError naming the entry node, for run (one entry: the input
    goes with its call; a wave first: it is put in the object store once) and, in its place, for map."""
    from soma.ray.inflight import RayInflight

    out = {}
    one_entry = Graph.somatize(AddOne() >> Double())
    wave_first = Graph.somatize((AddOne() | Double()) >> Identity().named("join"))
    for name, g in (("run", one_entry), ("run_wave_first", wave_first)):
        try:
            cluster.run(g, {"bad": Unpicklable()})
        except Exception as err:
            out[name] = _error(err)
    seen = []
    try:
        for y in cluster.map(one_entry, [1, 2, Unpicklable(), 4], window=4):
            seen.append(y)
    except Exception as err:
        out["map"] = _error(err) | {"index": err.index, "before": seen}
    out["batch"] = _one_batch(RayInflight, cluster, one_entry, [1, Unpicklable(), 3], start=0)
    out["load_after"] = sum(actor.load for actor in cluster._driver.book.actors())
    out["next_run"] = cluster.run(one_entry, 1)
    return out


def postcondition(cluster):
    out = {}
    try:
        cluster.run(Graph.somatize(Obeys().on("meta") >> ReturnsOn("cpu").on("meta")), None)
    except Exception as err:
        out["declared_meta"] = _error(err) | {"declared": err.declared, "actual": err.actual}
    try:  # a value that reports another device once it has crossed: caught where it arrives
        cluster.run(Graph.somatize(ReturnsMovingDevice().on("cpu") >> Identity()), None)
    except Exception as err:
        out["moved_on_the_way"] = _error(err)
    try:  # ... and at the driver, for the run's output
        cluster.run(Graph.somatize(Identity() >> ReturnsMovingDevice().on("cpu")), None)
    except Exception as err:
        out["moved_to_the_driver"] = _error(err)
    obeys = cluster.run(Graph.somatize(Obeys().on("meta")), None)
    out["obeying"] = repr(obeys)
    return out


def tensors(cluster):
    import torch

    mib = 1 << 20
    x = torch.arange(4 * mib // 4, dtype=torch.float32)  # 4 MiB in
    first, second = PlusOne(), PlusOne()  # one pair of actors for both graphs (each imports torch: seconds)
    y = cluster.run(Graph.somatize(first >> second), x)
    wave = cluster.run(Graph.somatize(first | second), x)
    made = cluster.run(Graph.somatize(Fill(6 * mib // 4)), 3.0)  # 6 MiB made in an actor, out
    made.add_(1)  # the caller's own, writable memory
    try:
        cluster.run(Graph.somatize(RequiresGradOutput() >> Identity()), None)
    except Exception as err:
        autograd = _error(err)
    import numpy

    t = torch.arange(mib, dtype=torch.float32).reshape(1024, 1024).t()  # transposed: out of band, strides kept
    back = cluster.run(Graph.somatize(Identity() >> Identity()), t)
    array = cluster.run(Graph.somatize(Identity()), numpy.full(mib, 2.0))  # Ray's store hands back read-only views
    array += 1  # soma made the result the caller's own
    return {"autograd": autograd, "in_bytes": x.numel() * 4, "out_equal": bool(torch.equal(y, x + 2)),
            "strides_kept": back.stride() == t.stride() and bool(torch.equal(back, t)),
            "array_writable": bool(array.flags.writeable) and float(array.min()) == 3.0,
            "x_untouched": float(x[-1]),
            "made_bytes": made.numel() * 4, "made_all": float(made.min()), "made_max": float(made.max()),
            "wave_equal": all(bool(torch.equal(t, x + 1)) for t in wave)}


def actor_dies(cluster):
    g = Graph.somatize(AddOne() >> DieOn(5))
    out = {}
    try:
        cluster.run(g, 4)
    except Exception as err:
        out["error"] = _error(err) | {"node": err.node, "worker": err.worker, "pid": err.pid}
    out["next_run"] = cluster.run(g, 1)
    try:
        list(cluster.map(g, [1, 2, 4, 6]))
    except Exception as err:
        out["map_error"] = _error(err) | {"index": err.index, "node": err.node}
    out["after_map"] = list(cluster.map(g, [1, 2]))
    return out


def timeout(cluster):
    g = Graph.somatize(AddOne() >> SlowOn(2) >> Identity())
    out = {"before": cluster.run(g, 0)}
    try:
        cluster.run(g, 1, timeout=1.0)
    except Exception as err:
        out["error"] = _error(err) | {"nodes": list(err.nodes), "waiting": list(err.waiting),
                                      "is_timeout_error": isinstance(err, TimeoutError)}
    out["after"] = cluster.run(g, 0)
    try:
        # (5 s each: input 0 may start a fresh copy, which took over 1 s on CI's shared cores; input 1 sleeps 120)
        list(cluster.map(g, [0, 1, 0], timeout=5.0))
    except Exception as err:
        out["map_error"] = _error(err) | {"index": err.index, "nodes": list(err.nodes)}
    out.update(_one_copy_timeout(cluster))
    out["copy_starting"] = _timeout_while_its_copy_starts(cluster)
    out["queued_behind"] = _queued_behind_a_timeout(cluster)
    return out


class OneCopySlowOnZero(Node):
    """One copy; input 0 takes 3 s, the others none."""

    copies = 1

    def forward(self, x, ctx):
        time.sleep(3.0 if x == 0 else 0.0)
        return Done(x)


def _queued_behind_a_timeout(cluster) -> list:
    """A timed map of three inputs on one copy: input 0 runs past its time, 1 and 2 wait behind it and time out
    with it. Each one's RunTimeout: (nodes named running, nodes named waiting)."""
    g = Graph.somatize(OneCopySlowOnZero())
    cluster.run(g, 1)  # (its copy up)
    return [[list(y.nodes), list(y.waiting)] for y in cluster.map(g, range(3), timeout=1.0, errors="yield")]


class SlowToBuild(Node):
    """A node whose copy takes 2 s to be made (as one that loads weights as it is rebuilt in its process); each
    input it starts is written to `log`."""

    def __init__(self, log):
        self.log = log

    def __setstate__(self, state):
        self.__dict__.update(state)
        time.sleep(2.0)

    def forward(self, x, ctx):
        with open(self.log, "a") as f:
            f.write(f"{x} ")
        return Done(x)


def _timeout_while_its_copy_starts(cluster) -> dict:
    """A run whose time is up while its node's first copy still starts: that copy never starts it (it did, once
    up: the caller had its RunTimeout, and the next run waited behind the input it had given up)."""
    fd, log = tempfile.mkstemp(prefix="started-")
    os.close(fd)
    g = Graph.somatize(SlowToBuild(log))
    out = {}
    try:
        cluster.run(g, "given-up", timeout=0.5)
    except Exception as err:
        out["error"] = _error(err) | {"waiting": list(err.waiting)}
    out["next"] = cluster.run(g, "next")
    with open(log) as f:
        out["started"] = f.read().split()
    return out


def _one_copy_timeout(cluster) -> dict:
    """A copies=1 node's copy runs its calls in order. Asked "what do you run?" while another input's call to
    it waits for its upstream, it must still tell the input it runs from the one that waits."""
    import threading

    folder = tempfile.mkdtemp(prefix="soma-one-copy-")
    marker = str(Path(folder, "running"))
    one = OneCopyMarkThenSleep(marker)
    slow = Graph.somatize(AddOne() >> one)  # input 1: the one copy marks, then sleeps
    behind = Graph.somatize(SleepInput().named("sleep") >> one)  # on 5: its call to the one copy waits 5 s
    out: dict = {"one_copy_before": cluster.run(slow, 0)}
    cluster.run(behind, 0)  # `sleep` has its actor before the timed run: starting one may take the 1.5 s
    box: dict = {}

    def timed_out():
        try:
            cluster.run(slow, 1, timeout=6.0)
        except Exception as err:
            box["error"] = err

    thread = threading.Thread(target=timed_out)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.02)  # polling a condition, with a deadline
    try:  # times out first: `sleep` runs, and its call to the one copy (busy with input 1) waits
        cluster.run(behind, 5, timeout=1.5)
    except Exception as err:
        out["behind_error"] = _error(err) | {"nodes": list(err.nodes), "waiting": list(err.waiting)}
    thread.join(DEADLINE_S)
    shutil.rmtree(folder, ignore_errors=True)
    err = box.get("error")
    out["one_copy_error"] = None if err is None else _error(err) | {"nodes": list(err.nodes),
                                                                    "waiting": list(err.waiting)}
    out["one_copy_after"] = cluster.run(slow, 0)
    return out


def traced(cluster, folder):
    path = Path(folder, "trace.json")
    g = Graph.somatize(RayNodeId() >> (RayNodeId() | RayNodeId()))
    single = Graph.somatize(RayNodeId())
    list(cluster.map(single, [[]] * 24))  # measured cheap: its map's inputs now share calls (docs/ray.md, "Batches")
    with cluster.trace(path):
        first, second = cluster.run(g, [])
        mapped = list(cluster.map(single, [[]] * 3))
    doc = json.loads(path.read_text())
    events = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "node"]
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"}
    reported = [[node, pid] for node, _, pid in first + second[1:] + [out[0] for out in mapped]]
    calls = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "ray"]
    return {"events": [{"name": e["name"], "pid": e["pid"], "input": e["args"]["input"], "ts": e["ts"],
                        "worker": e["args"]["worker"]} for e in events],
            "calls": [{"name": e["name"], "node": e["args"]["node"], "worker": e["args"]["worker"],
                       "inputs": e["args"]["inputs"], "batch": e["args"]["batch"], "pid": e["pid"]} for e in calls],
            # each node event inside a call event of its track (same pid and thread) that lists its input
            "enclosed": [any(c["pid"] == e["pid"] and c["tid"] == e["tid"] and c["ts"] <= e["ts"]
                             and e["ts"] + e["dur"] <= c["ts"] + c["dur"] and e["args"]["input"] in c["args"]["inputs"]
                             for c in calls) for e in events],
            "process_names": {str(k): v for k, v in names.items()},
            "reported": reported, "driver_pid": os.getpid()}


def trace_blocks(cluster, folder):
    """A traced map's input still in flight when its block ends: neither that block nor the next has its spans.

    Both inputs hold until released. Which one a copy starts first is Ray's choice (a fresh node's two inputs
    go to its one starting actor, which may run them in either order), so the one that starts first is
    released during the first block, and the other only after that block has ended.
    """
    import threading

    g = Graph.somatize(HoldUntilFile())
    first, second = Path(folder, "first.json"), Path(folder, "second.json")
    holds = [str(Path(folder, "hold-0")), str(Path(folder, "hold-1"))]
    released: list = []

    def release_the_first_to_start():
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            started = [i for i, hold in enumerate(holds) if os.path.exists(f"{hold}.started")]
            if started:
                released.append(started[0])
                Path(holds[started[0]]).touch()
                return
            time.sleep(0.01)  # polling a condition, with a deadline

    with cluster.trace(first):
        releaser = threading.Thread(target=release_the_first_to_start)
        releaser.start()
        outputs = cluster.map(g, holds, window=2, ordered=False)
        early = next(outputs)  # the released input; the other one waits, queued or running, past the block's end
        releaser.join(DEADLINE_S)
    [done] = released
    Path(holds[1 - done]).touch()
    with cluster.trace(second):
        during = cluster.run(g, 0)
        late = list(outputs)  # the other ends in this block: its spans reach its actor after the first one's end
    return {"outputs": [early == holds[done], during, [late == [holds[1 - done]]]], "released": done,
            "first": _node_events(first), "second": _node_events(second),
            "first_us": _duration_us(first), "second_us": _duration_us(second)}


def _node_events(path) -> list:
    doc = json.loads(Path(path).read_text())
    return [{"input": e["args"]["input"], "ts": e["ts"], "end": e["ts"] + e["dur"]} for e in doc["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") == "node"]


def _duration_us(path) -> float:
    """How long a trace block lasted, in µs on the driver's clock (`otherData.duration_us`)."""
    return json.loads(Path(path).read_text())["otherData"]["duration_us"]


def dropped_nodes_stop_their_actors(cluster):
    """A node the caller lets go can never run again: its actors are stopped at the next run."""
    import gc

    g = Graph.somatize(Pid())
    pid = cluster.run(g, None)
    del g
    gc.collect()
    cluster.run(Graph.somatize(AddOne()), 1)  # the next run forgets what was dropped
    return {"pid": pid, "gone_after_s": _gone_within(pid, DEADLINE_S)}


def _gone_within(pid: int, seconds: float):
    """Seconds until process `pid` is gone (killing an actor is asynchronous), or None if it outlived `seconds`."""
    import psutil

    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return time.monotonic() - started
        time.sleep(0.05)  # polling a condition, with a deadline
    return None


def placement(cluster):
    out = {}
    g = Graph.somatize(AddOne() >> Identity().on("cuda:7"))
    try:
        cluster.run(g, 1)
    except Exception as err:
        out["error"] = _error(err) | {"node": err.node}
    out["same_graph_unplaced"] = cluster.run(g.place("identity", None), 1)
    return out


def cuda0(cluster):
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA GPU on this machine"}
    return cluster.run(Graph.somatize(OnGpu().on("cuda:0")), None)


def no_ray_errors_leak(cluster):
    """Every error above is soma's own class: nothing of Ray's in the class or its bases."""
    kinds = []
    for g, x in ((Graph.somatize(Boom()), 1), (Graph.somatize(DieOn(0)), 0)):
        try:
            cluster.run(g, x)
        except Exception as err:
            kinds.append([f"{c.__module__}.{c.__qualname__}" for c in type(err).__mro__])
    return {"mros": kinds}


SESSION_CHECKS = [same_answers, wave_overlap, copies_one_keeps_state, map_spreads_over_actors, map_batches, node_error,
                  unsendable_input, postcondition, tensors, actor_dies, timeout, dropped_nodes_stop_their_actors,
                  placement, cuda0, no_ray_errors_leak, *TRIES_CHECKS, *ASYNC_CHECKS, *BATCHING_CHECKS]


# -- two machines --------------------------------------------------------------------------------------

def two_machines(folder) -> dict:
    """A head with `host_a` and a second machine with `host_b`; `options` pins one node to each."""
    from ray.cluster_utils import Cluster

    out: dict = {}
    system = {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
              "health_check_initial_delay_ms": 0}
    # Cluster writes its address to Ray's default temp folder (/tmp/ray) whatever temp_dir says, and does not
    # make the folder: on a machine where Ray never ran it is not there.
    from ray._common.utils import get_default_ray_temp_dir

    os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
    _say("two machines: starting the head")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"host_a": 1}, "temp_dir": folder, "_system_config": system,
        "include_dashboard": False})
    try:
        machine_b = cluster.add_node(num_cpus=1, resources={"host_b": 1}, temp_dir=folder)
        _say("two machines: both up")
        ray.init(address=cluster.address, log_to_driver=False)
        ids = {}
        for node in ray.nodes():
            for name in ("host_a", "host_b"):
                if node["Alive"] and name in node["Resources"]:
                    ids[name] = node["NodeID"]
        out["machines"] = ids
        options = {"on_a": {"resources": {"host_a": 0.1}}, "on_b": {"resources": {"host_b": 0.1}},
                   "sleeper": {"resources": {"host_b": 0.1}}, "on_c": {"resources": {"host_c": 1}},
                   "dies_on_b": {"resources": {"host_b": 0.1}}}
        with soma.Ray(options=options) as machines:
            g = Graph.somatize(RayNodeId().named("on_a") >> RayNodeId().named("on_b"))
            out["pinned"] = machines.run(g, [])
            _say("two machines: pinned run done")
            out["pinned_map"] = list(machines.map(g, [[]] * 4))
            try:  # no machine offers host_c: refused before anything is submitted, not pending forever
                machines.run(Graph.somatize(RayNodeId().named("on_c")), [])
            except Exception as err:
                out["nowhere"] = _error(err)
            out["remote_innocents"] = _remote_innocents(machines, folder)
            _say("two machines: an actor of machine b died")
            marker = str(Path(folder, "sleeper-is-running"))
            slow = Graph.somatize(RayNodeId().named("on_a") >> MarkThenSleep(marker, 60).named("sleeper"))
            out["machine_death"] = _kill_machine_during(machines, slow, cluster, machine_b, marker)
            _say("two machines: machine b taken away")
        # close() stops the actors soma made even in a session it leaves running (machine a's are on this host)
        out["actor_a_gone_after_close_s"] = _gone_within(out["pinned"][0][2], DEADLINE_S)
        out["session_left_running"] = ray.is_initialized()
    finally:
        ray.shutdown()
        _say("two machines: driver disconnected")
        cluster.shutdown()
        _say("two machines: cluster down")
    return out


def _remote_innocents(runner, folder) -> dict:
    """An actor of machine b dies with a window of inputs queued at it (one copy): what it had started is read
    from its record there, by a Ray task pinned to machine b; only the input it ran fails."""
    from tests.ray.checks_tries import OneCopyDieOnceFor, runs

    marks = tempfile.mkdtemp(prefix="remote-", dir=folder)
    g = Graph.somatize(OneCopyDieOnceFor(marks, {0}).named("dies_on_b"))
    got = list(runner.map(g, range(6), window=6, errors="yield"))
    return {"outputs": [[type(y).__name__, y.index, y.tries] if isinstance(y, Exception) else y for y in got],
            "runs": [len(runs(marks, f"ran-{x}")) for x in range(6)]}


def _kill_machine_during(runner, g, cluster, machine, marker: str) -> dict:
    """Run `g` on a thread, take `machine` away once its node runs there (`marker` exists), report what it raised."""
    import threading

    box: dict = {}

    def run():
        try:
            box["value"] = runner.run(g, [])
        except Exception as err:
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition, with a deadline
    cluster.remove_node(machine, allow_graceful=False)
    thread.join(DEADLINE_S)
    err = box.get("error")
    return {"error": _error(err) | {"node": err.node, "worker": err.worker} if err is not None else None,
            "value": box.get("value")}


# -- plumbing ------------------------------------------------------------------------------------------

_STARTED = time.monotonic()


def _say(what: str) -> None:
    """Progress on stderr, with the seconds since the start (the pytest side shows it when a check fails)."""
    print(f"[{time.monotonic() - _STARTED:6.1f} s] {what}", file=sys.stderr, flush=True)


def _error(err) -> dict:
    return {"type": type(err).__name__, "message": str(err), "module": type(err).__module__,
            "node": getattr(err, "node", None), "remote_traceback": getattr(err, "remote_traceback", None)}


def _chain(err) -> list:
    chain = []
    while err is not None and len(chain) < 5:
        chain.append(type(err).__name__)
        err = err.__cause__
    return chain


def _recorded(name: str, call) -> dict:
    started = time.monotonic()
    try:
        result = {"ok": True, "value": call()}
    except Exception:
        result = {"ok": False, "traceback": traceback.format_exc()}
    result["seconds"] = round(time.monotonic() - started, 2)
    _say(f"ray check {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s")
    return result


def lazy_from_a_thread(folder) -> dict:
    """A runner whose first run (which starts its Ray) comes from a thread that then ends, then a new graph from
    this one (compiling it asks Ray's GCS about the machines)."""
    import threading

    out: dict = {}
    with soma.Ray("local", num_cpus=1, include_dashboard=False, log_to_driver=False, _temp_dir=folder) as runner:
        first = threading.Thread(target=lambda: out.update(first=runner.run(Graph.somatize(AddOne()), 1)))
        first.start()
        first.join(120)
        _say("lazy start: the first run's thread ended")
        out["then"] = runner.run(Graph.somatize(AddOne().named("again") >> AddOne()), 1)
    return out


def _map_on_a_thread(cluster) -> dict:
    """A map of slow inputs iterated by another thread, its first output handed out: `outcome` once it ends."""
    import threading

    seen = {"outcome": None, "started": threading.Event()}

    def iterate():
        try:
            for _ in cluster.map(Graph.somatize(SleepInput()), [0.0] + [2.0] * 8, window=4):
                seen["started"].set()
            seen["outcome"] = "ended"
        except Exception as err:
            seen["outcome"] = _error(err)
        finally:
            seen["started"].set()

    seen["thread"] = threading.Thread(target=iterate, daemon=True)
    seen["thread"].start()
    seen["started"].wait(60)
    return seen


def main(out_path: str, only: list) -> None:
    """Run the checks (`only`: just these, by name, to debug one) and write what each observed to `out_path`."""
    results: dict = {}
    checks = [c for c in SESSION_CHECKS if not only or c.__name__ in only]
    folder = tempfile.mkdtemp(prefix="soma-ray-", dir="/tmp")  # Ray's own temp dir: a crashed run leaves no trace
    from soma.ray import records

    def start_records() -> set:
        """The start records on this machine (soma.ray.records) whose actor's process is gone: this session's
        are all gone once it is shut down, and a live process's record is another Ray run's on this machine."""
        where = records.folder()
        left = set()
        for name in os.listdir(where) if os.path.isdir(where) else ():
            try:
                with open(os.path.join(where, name), "rb") as f:
                    pid = int(f.read(10))
            except FileNotFoundError:
                continue  # removed meanwhile
            except (OSError, ValueError):
                pid = None  # unreadable: counted
            if pid is None or not records.process_alive(pid):
                left.add(name)
        return left

    before = start_records()
    try:
        # address="local": always a new instance of our own, never another program's cluster on this machine
        with soma.Ray("local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                      _temp_dir=folder) as cluster:
            # The checks' own folders (markers their actors leave, tempfile.mkdtemp without a dir) go inside
            # Ray's, removed with it below: a run leaves nothing in /tmp (they were left there, empty, before)
            tempfile.tempdir = tempfile.mkdtemp(prefix="checks-", dir=folder)
            try:
                for check in checks:
                    results[check.__name__] = _recorded(check.__name__, lambda: check(cluster))
            finally:
                tempfile.tempdir = None  # (Ray's own look-ups of the temp dir, at shutdown, see /tmp again)
            for check in (traced, trace_blocks):
                if not only or check.__name__ in only:
                    results[check.__name__] = _recorded(check.__name__, lambda: check(cluster, folder))
            held = cluster.map(Graph.somatize(AddOne()), range(20), window=4)  # its caller holds it past the close
            first = next(held)
            under_close = _map_on_a_thread(cluster)  # in flight on another thread as the block's end closes it
        under_close["thread"].join(60)
        unraisable = []  # (held, collected after Ray was shut down, asked Ray about its refs: an error at exit)
        sys.unraisablehook, hook = (lambda u: unraisable.append(repr(u.exc_value))), sys.unraisablehook
        try:
            del held
            gc.collect()
        finally:
            sys.unraisablehook = hook
        results["session_shut_down"] = {"ok": True, "value": {"initialized_after_close": ray.is_initialized(),
                                                             "held_map": [first, unraisable],
                                                             "map_on_a_thread": under_close["outcome"]}}
        results["records_left"] = {"ok": True, "value": {"session": sorted(start_records() - before)}}
        if not only or "lazy_from_a_thread" in only:
            results["lazy_from_a_thread"] = _recorded("lazy_from_a_thread", lambda: lazy_from_a_thread(folder))
        if not only or "two_machines" in only:
            results["two_machines"] = _recorded("two_machines", lambda: two_machines(folder))
            results["records_left"]["value"]["two_machines"] = sorted(start_records() - before)
    finally:
        Path(out_path).write_text(json.dumps(results, default=repr))
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
