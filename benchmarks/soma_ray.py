"""soma_ray: what soma.Ray costs over hand-written Ray, and what Ray costs for a big tensor.

    python benchmarks/soma_ray.py [--quick] [--smoke] [--json out.json]   (or: soma bench soma_ray)

(Not `ray.py`: a script's folder comes first on sys.path, and `benchmarks/ray.py`
would be what `import ray` finds, for this benchmark and every other one.)

It re-runs itself in a loopback-only network namespace (`unshare -n`) when the
machine allows it, so the Ray it starts never binds the machine's address; one
local Ray (`num_cpus` = cores) serves every question. Every contender's values
are checked (`h.expect`: a wrong one ends the run with `FAILED: <contender> ...`);
the tensors carry a fill of their own per call, so a stale one fails too.
Contenders alternate round by round (benchmarks/README.md).

* chain: one input through `AddOne >> Double >> AddOne`, per run.
    soma     soma.Ray().run(g, x)
    actors   three hand-written actors, each call given the ref of the one before
             (soma's own pattern: every call submitted at once, values actor to actor)
  Target: soma / actors <= 1.2.
* map: N inputs through a one-node graph (tiny: returns its input + 1; 2ms: burns
  2 ms first), window 4, in input order and as they finish.
    soma     list(cluster.map(g, xs, window=4, ordered=...)) (the node's copies: 2 here; soma sends
             the inputs in batches, one call for two inputs: docs/ray.md "Batches")
    pool     hand-written: as many actors, round-robin, ray.wait for the next, under
             map's own rule (at most 4 inputs taken and not yet handed out)
  Target: soma's inputs/s / pool's >= 1.0.
* retries: N inputs of ~1 ms work through a one-node graph, `map(g, xs, retries=5)` (the default window),
  in order; in every round of "death" one copy's actor `os._exit`s at input N/2 (its first sight of it):
  every output must come, in input order, none twice. The ratio: how much longer the map took with the
  death than without it, round by round (off the clock after a death: the node's second copy is up again).
    no death  the same map, nobody dies        death  the actor dies mid-map
* heavy: a fresh node that sleeps 0.5 s (copies = 4), warmed by one run (off the clock), then four inputs
  (docs/ray.md, "Copies": a copy starts only when the queue it saves is longer than the measured start-up).
    alone    four `cluster.run`s one after another: the warm actor alone
    map      list(cluster.map(g, range(4))): may start copies, must never be slower than `alone`
  Target: map / alone <= 1.0 (each round on a node of its own, so its one warm actor is the only one).
  Full mode also maps six 2 s inputs on a fresh node and reports how many actors ran them (must be > 1).
* gil_wave: a wave of 4 branches of 50 ms pure-Python work (`burn`), per run.
    executor soma.Executor() (threads: one GIL)     ray  soma.Ray (an actor per branch)
* concurrent_runs: 64 threads calling `cluster.run` at once, the batching MLP of benchmarks/_models.py
  (max_batch 64) against the same model per item; items/s, and the mean batch the node saw (concurrent
  runs meet at the driver: docs/ray.md "Batches"). Needs torch; skipped without it.
* tensor: 256 MiB of float32 made in one actor and read (its last element) in another,
  time beyond the tensor's creation; and the parts that explain it, in this process:
  pickling it (what Ray does to a torch tensor), ray.put, ray.get of that ref.
    actors   hand-written (make.remote() → read.remote(ref))     soma  make_timed >> last_of_timed
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time

import _harness as h
from _work import AddOne, Double, chain3

from soma import Done, Node

NAME = "soma_ray"
WINDOW = 4


# -- what the actors run (plain functions and nodes; by value from __main__ is fine for both) -------------

def make_timed(spec):
    """(a float32 tensor of `numel` elements equal to `fill`, seconds to make it), measured where it is made;
    `spec` is `(numel, fill)`, one input (a soma node's)."""
    from _work import make_timed as made

    numel, fill = spec
    return made(numel, None, fill)


def last_of_timed(pair):
    tensor, seconds = pair
    return float(tensor.reshape(-1)[-1]), seconds


def actor_classes(ray):
    @ray.remote
    class Stage:
        """One hand-written stage: applies its function to whatever arrives."""

        def __init__(self, func):
            self.func = func

        def call(self, x):
            return self.func(x)

    return Stage


def hand_chain(stages, ray, x):
    ref = x
    for stage in stages:
        ref = stage.call.remote(ref)
    return ray.get(ref)


def hand_pool_map(actors, ray, xs, window: int, ordered: bool) -> list:
    """What one writes by hand, under map's own rule: at most `window` inputs taken and not yet handed out.

    Round-robin over `actors`; ordered: outputs handed out in input order (a finished output waits
    for the ones before it, and holds its place in the window meanwhile); unordered: as they finish.
    """
    out, taken, handed, next_actor = [], 0, 0, 0
    inflight: dict = {}  # ref → input index
    finished: dict = {}  # input index → output, not handed out yet (ordered)
    while handed < len(xs):
        while taken < len(xs) and taken - handed < window:
            inflight[actors[next_actor].call.remote(xs[taken])] = taken
            next_actor = (next_actor + 1) % len(actors)
            taken += 1
        ready, _ = ray.wait(list(inflight), num_returns=1)
        index = inflight.pop(ready[0])
        if not ordered:
            out.append(ray.get(ready[0]))
            handed += 1
            continue
        finished[index] = ray.get(ready[0])
        while handed in finished:
            out.append(finished.pop(handed))
            handed += 1
    return out


def dies_once(n):
    """~`n` of burn, then (input, this pid); a `marker` that is not there yet: made, and the process ends."""
    def work(x):
        i, marker = x
        h.burn(n)
        if marker is not None and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        return i, os.getpid()
    return work


def burn_plus_one(n):
    def work(x):
        h.burn(n)
        return x + 1
    return work


# -- the questions -----------------------------------------------------------------------------------------

def chain(suite, ray, cluster, Stage, soma):
    g = soma.Graph.somatize(AddOne() >> Double() >> AddOne())
    stages = [Stage.remote(lambda x: x + 1), Stage.remote(lambda x: x * 2), Stage.remote(lambda x: x + 1)]
    runs = 10 if suite.mode == "smoke" else 200

    def many(name, call):
        def go():
            for i in range(runs):
                h.expect(name, call(i), chain3(i), f"input {i}")
        return go

    samples = h.alternate({"soma": many("soma", lambda i: cluster.run(g, i)),
                           "actors": many("actors", lambda i: hand_chain(stages, ray, i))},
                          repeat=suite.repeat(full=7, quick=3), warmup=1)
    params = {"question": "chain", "nodes": 3}
    for name in ("soma", "actors"):
        suite.add(name, params, [s / runs * 1e6 for s in samples[name]], "µs/run")
    suite.add_ratio("soma", params, samples["soma"], samples["actors"], vs="actors")


def map_throughput(suite, ray, cluster, Stage, soma):
    n = 12 if suite.mode == "smoke" else 400
    work_n = h.calibrate_burn(2.0)
    for kind, func in (("tiny", lambda x: x + 1), ("2ms", burn_plus_one(work_n))):
        g = soma.Graph.somatize(soma.fn(func, name="work"))
        xs = list(range(n))
        expected = [x + 1 for x in xs]
        # as many actors as soma's copies: a node's default `copies` is the cluster's CPUs (docs/ray.md)
        pool = [Stage.remote(func) for _ in range(max(1, int(ray.cluster_resources().get("CPU", 1))))]
        for ordered in (True, False):
            what = f"map, {kind}, {'ordered' if ordered else 'unordered (sorted)'}"

            def with_soma(g=g, ordered=ordered, what=what):
                out = list(cluster.map(g, xs, window=WINDOW, ordered=ordered))
                h.expect("soma", out if ordered else sorted(out), expected, what)

            def with_pool(pool=pool, ordered=ordered, what=what):
                out = hand_pool_map(pool, ray, xs, WINDOW, ordered)
                h.expect("pool", out if ordered else sorted(out), expected, what)

            with_soma()  # soma starts its second copy once the first is busy: warm both before timing
            samples = h.alternate({"soma": with_soma, "pool": with_pool}, repeat=suite.repeat(full=9, quick=3),
                                  warmup=1)
            params = {"question": "map", "work": kind, "ordered": ordered, "inputs": n, "window": WINDOW,
                      "actors": len(pool)}
            for name in ("soma", "pool"):
                suite.add(name, params, [n / s for s in samples[name]], "inputs/s")
            suite.add_ratio("soma", params, samples["pool"], samples["soma"], vs="pool")  # pool's time / soma's


def retries_death(suite, cluster, soma):
    n = 24 if suite.mode == "smoke" else 300
    g = soma.Graph.somatize(soma.fn(dies_once(h.calibrate_burn(1.0)), name="dies_once"))
    folder = tempfile.mkdtemp(prefix="soma-bench-retries-")
    deaths = iter(range(1 << 30))
    expected = list(range(n))

    def mapped(name, xs, what):
        start = time.perf_counter()
        out = list(cluster.map(g, xs, retries=5))
        elapsed = time.perf_counter() - start
        h.expect(name, [i for i, _ in out], expected, what)
        return elapsed

    def both_copies_up(deadline_s=120.0):
        """Off the clock: map until two processes answer (a node's second copy starts once its first is busy)."""
        pids, deadline = set(), time.monotonic() + deadline_s
        while len(pids) < 2 and time.monotonic() < deadline:
            pids |= {pid for _, pid in cluster.map(g, [(i, None) for i in range(40)])}

    def without():
        return mapped("no death", [(i, None) for i in range(n)], "every output, in order")

    def with_death():
        marker = os.path.join(folder, f"died-{next(deaths)}")
        elapsed = mapped("death", [(i, marker if i == n // 2 else None) for i in range(n)],
                         "every output, in order, none twice, though an actor died")
        h.expect("death", os.path.exists(marker), True, "an actor died mid-map")
        both_copies_up()
        return elapsed

    both_copies_up()
    samples = h.alternate({"no death": without, "death": with_death}, repeat=suite.repeat(full=7, quick=3),
                          warmup=1, self_timed=True)
    params = {"question": "retries", "inputs": n, "work_ms": 1, "retries": 5}
    for name in ("no death", "death"):
        suite.add(name, params, h.ms(samples[name]), "ms")
    suite.add_ratio("death", params, samples["death"], samples["no death"], vs="no death")
    shutil.rmtree(folder, ignore_errors=True)


class Sleeper(Node):
    """Sleeps `seconds`, then returns (its input, the pid that ran it); up to four copies, as on
    soma.Ray(num_cpus=4)."""

    copies = 4

    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return Done((x, os.getpid()))


def heavy(suite, cluster, soma):
    seconds = 0.05 if suite.mode == "smoke" else 0.5
    xs = list(range(4))

    rounds_done = []

    def one_round():
        g = soma.Graph.somatize(Sleeper(seconds))  # a node of its own: one warm actor, no other copy yet
        h.expect("warm-up", cluster.run(g, -1)[0], -1, "the warm-up run")  # its first actor up, off the clock
        out = {}
        for name in (["alone", "map"] if len(rounds_done) % 2 == 0 else ["map", "alone"]):
            start = time.perf_counter()
            got = [cluster.run(g, x) for x in xs] if name == "alone" else list(cluster.map(g, xs))
            out[name] = time.perf_counter() - start
            h.expect(name, [x for x, _ in got], xs, "every output, in order")
            if name == "map":
                out["actors"] = len({pid for _, pid in got})
        rounds_done.append(out)
        return out

    rounds = h.alternate({"round": one_round}, repeat=suite.repeat(full=5, quick=3), warmup=0, self_timed=True)
    params = {"question": "heavy", "inputs": len(xs), "seconds": seconds}
    alone, mapped = [r["alone"] for r in rounds["round"]], [r["map"] for r in rounds["round"]]
    suite.add("alone", params, h.ms(alone), "ms")
    suite.add("map", params, h.ms(mapped), "ms")
    suite.add_ratio("map", params, mapped, alone, vs="alone")
    suite.add("map", {**params, "what": "actors"}, [r["actors"] for r in rounds["round"]], "actors")
    if suite.mode == "full":
        g = soma.Graph.somatize(Sleeper(2.0))
        got = list(cluster.map(g, range(6)))
        h.expect("six", [x for x, _ in got], list(range(6)), "every output, in order")
        suite.add("map", {"question": "heavy", "inputs": 6, "seconds": 2.0, "what": "actors"},
                  [len({pid for _, pid in got})], "actors")


def gil_wave(suite, cluster, soma):
    from _work import Burn

    width_ms = 5 if suite.mode == "smoke" else 50
    n = h.calibrate_burn(width_ms)
    g = soma.Graph.somatize(Burn(n) | Burn(n) | Burn(n) | Burn(n))
    expected = (h.burn(n),) * 4
    executor = soma.Executor()
    contenders = {"executor": lambda: executor.run(g, None), "ray": lambda: cluster.run(g, None)}
    samples = h.alternate(contenders, repeat=suite.repeat(full=7, quick=3), warmup=1,
                          check=lambda name, got: h.expect(name, got, expected, "the wave's outputs"))
    params = {"question": "gil_wave", "B": 4, "W_ms": width_ms}
    for name in ("executor", "ray"):
        suite.add(name, params, h.ms(samples[name]), "ms")
    suite.add_ratio("ray", params, samples["executor"], samples["ray"], vs="executor")


def tensor(suite, ray, cluster, soma):
    import pickle

    import torch

    mib = 8 if suite.mode == "smoke" else 256
    numel = mib * h.MiB // 4
    maker, reader = ray.remote(make_timed), ray.remote(last_of_timed)

    @ray.remote
    class Maker:
        def make(self, spec):
            return make_timed(spec)

    @ray.remote
    class Reader:
        def read(self, pair):
            return last_of_timed(pair)

    make_actor, read_actor = Maker.remote(), Reader.remote()
    g = soma.Graph.somatize(soma.fn(make_timed, name="make") >> soma.fn(last_of_timed, name="read"))

    def beyond_creation(name, call):
        def go():
            fill = h.next_fill()  # this call's own: a tensor of an earlier call holds another number
            start = time.perf_counter()
            value, made_s = call((numel, fill))
            elapsed = time.perf_counter() - start
            h.expect(name, value, fill, "the last element of the tensor made")
            return elapsed - made_s
        return go

    def got_back():
        seconds, value = h.timed(lambda: float(ray.get(put_ref)[-1]))
        h.expect("ray.get", value, local_fill, "the last element of the tensor put")
        return seconds

    local_fill = h.next_fill()
    local = torch.full((numel,), local_fill)
    put_ref = ray.put(local)
    contenders = {
        "actors": beyond_creation("actors", lambda spec: ray.get(read_actor.read.remote(make_actor.make.remote(spec)))),
        "soma": beyond_creation("soma", lambda spec: cluster.run(g, spec)),
        "tasks": beyond_creation("tasks", lambda spec: ray.get(reader.remote(maker.remote(spec)))),
        "pickle.dumps": lambda: h.timed(pickle.dumps, local)[0],
        "ray.put": lambda: h.timed(ray.put, local)[0],
        "ray.get": got_back,
        "clone": lambda: h.timed(local.clone)[0],
    }
    samples = h.alternate(contenders, repeat=suite.repeat(full=5, quick=3), warmup=1, self_timed=True)
    for name, values in samples.items():
        suite.add(name, {"question": "tensor", "MiB": mib}, h.ms(values), "ms")


def concurrent_runs(suite, cluster, soma):
    """64 threads calling `cluster.run` at once on the batching MLP node, against the same model per item: they
    meet at the driver (docs/ray.md, "Batches"), so the batching node's calls carry several runs each."""
    import concurrent.futures as cf
    import statistics

    import _models as m
    import torch

    n = {"full": 1024, "quick": 512, "smoke": 64}[suite.mode]
    xs = m.inputs(n)
    expected = m.model()(torch.stack(xs))
    graphs = {"per_item": soma.Graph.somatize(m.PerItem()), "batched": soma.Graph.somatize(m.batched())}
    callers = cf.ThreadPoolExecutor(64)
    sizes: list = []

    def rate(kind):
        g = graphs[kind]
        elapsed, out = h.timed(lambda: list(callers.map(lambda x: cluster.run(g, x), xs)))
        if kind == "batched":  # (soma.torch.Batched: each row ends in its call's size)
            rows, batch = m.counted(f"ray/{kind} from 64 threads", out)
            sizes.append(statistics.mean(batch))
        else:
            rows = [row for row, _ in out]
        if not torch.allclose(torch.stack(rows), expected, atol=1e-4):
            raise h.WrongValue(f"ray/{kind} from 64 threads returned outputs that are not the model's")
        return n / elapsed

    try:
        for g in graphs.values():  # warm: the actors up, torch imported in them
            list(callers.map(lambda x, g=g: cluster.run(g, x), xs[:64]))
        samples = h.alternate({kind: (lambda k=kind: rate(k)) for kind in graphs},
                              repeat=suite.repeat(full=5, quick=3, smoke=1), self_timed=True)
    finally:
        callers.shutdown()
    params = {"question": "concurrent_runs", "inputs": n, "threads": 64}
    for kind, values in samples.items():
        suite.add("ray", {**params, "kind": kind}, values, "items/s")
    suite.add_ratio("ray", {**params, "kind": "batched"}, samples["batched"], samples["per_item"], vs="per_item")
    suite.add("ray", {**params, "what": "mean_batch"}, sizes, "inputs")


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    h.rerun_on_loopback(NAME, os.path.abspath(__file__), argv)
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    ray = h.optional_ray()
    if ray is None:
        print(f"{NAME}: skipped: ray is not installed (pip install 'soma[ray]')")
        return []
    import soma

    print(f"{NAME}: {h.versions()}, ray {ray.__version__}; mode {suite.mode}; "
          f"{'loopback only' if os.environ.get(h.IN_NAMESPACE) else 'on the machine address'}")
    folder = tempfile.mkdtemp(prefix="soma-ray-", dir="/tmp")  # Ray's temp dir: nothing left for the next init
    try:
        # address="local": always a new instance of our own, never another program's cluster on this machine
        with soma.Ray("local", num_cpus=h.CORES, include_dashboard=False, log_to_driver=False,
                      _temp_dir=folder) as cluster:
            Stage = actor_classes(ray)
            chain(suite, ray, cluster, Stage, soma)
            print("  chain done", flush=True)
            map_throughput(suite, ray, cluster, Stage, soma)
            print("  map done", flush=True)
            retries_death(suite, cluster, soma)
            print("  retries done", flush=True)
            heavy(suite, cluster, soma)
            print("  heavy done", flush=True)
            gil_wave(suite, cluster, soma)
            print("  gil_wave done", flush=True)
            tensor(suite, ray, cluster, soma)
            print("  tensor done", flush=True)
            if importlib.util.find_spec("torch") is not None:
                concurrent_runs(suite, cluster, soma)
                print("  concurrent runs done", flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return suite.finish(lambda: print_summary(suite))


def print_summary(suite: h.Suite) -> None:
    ratio = suite.find("soma", "x", question="chain")
    rows = [["chain: µs per run", h.cell(suite.find("soma", "µs/run")), h.cell(suite.find("actors", "µs/run")),
             h.cell(ratio) + "×", "≤ 1.2×"]]
    for kind in ("tiny", "2ms"):
        for ordered in (True, False):
            rows.append([f"map ({kind}, {'ordered' if ordered else 'unordered'}): inputs/s",
                         h.cell(suite.find("soma", "inputs/s", work=kind, ordered=ordered)),
                         h.cell(suite.find("pool", "inputs/s", work=kind, ordered=ordered)),
                         h.cell(suite.find("soma", "x", question="map", work=kind, ordered=ordered)) + "×", "≥ 1.0×"])
    h.print_table(f"{NAME}: soma.Ray against the same work written by hand on Ray (median; ratio: median of "
                  f"per-round ratios)", ["question", "soma.Ray", "hand-written", "ratio", "target"], rows)
    death = [["map of N ~1 ms inputs, retries=5", h.cell(suite.find("no death", "ms", question="retries")),
              h.cell(suite.find("death", "ms", question="retries")),
              h.cell(suite.find("death", "x", question="retries")) + "×"]]
    h.print_table(f"{NAME}: an actor os._exit's mid-map (every output once, in order), ms per map",
                  ["map", "no death", "death", "ratio"], death)
    heavy_rows = [["4 × 0.5 s after a warm-up run", h.cell(suite.find("alone", "ms", question="heavy")),
                   h.cell(suite.find("map", "ms", question="heavy")),
                   h.cell(suite.find("map", "x", question="heavy")) + "×",
                   h.cell(suite.find("map", "actors", question="heavy", inputs=4)), "≤ 1.0×"]]
    six = suite.find("map", "actors", question="heavy", inputs=6)
    if six is not None:
        heavy_rows.append(["6 × 2 s, fresh node: actors", "", "", "", h.cell(six), "> 1"])
    h.print_table(f"{NAME}: a few heavy inputs, ms (one warm actor alone, one after another; a map that may start "
                  f"copies)", ["inputs", "warm actor alone", "map", "ratio", "actors", "target"], heavy_rows)
    wave = [["4 × W ms GIL-bound branches", h.cell(suite.find("executor", "ms")), h.cell(suite.find("ray", "ms")),
             h.cell(suite.find("ray", "x", question="gil_wave")) + "×"]]
    h.print_table(f"{NAME}: the GIL-bound wave, ms per run", ["wave", "Executor", "soma.Ray", "speed-up"], wave)
    tensors = [[name, h.cell(suite.find(name, "ms", question="tensor"))]
               for name in ("actors", "soma", "tasks", "pickle.dumps", "ray.put", "ray.get", "clone")]
    h.print_table(f"{NAME}: a float32 tensor between two actors on one machine, ms beyond its creation (and its "
                  f"parts, in this process)", ["what", "ms"], tensors)
    per = suite.find("ray", "items/s", question="concurrent_runs", kind="per_item")
    if per is not None:
        h.print_table(f"{NAME}: 64 threads calling soma.Ray.run at once, the MLP (benchmarks/_models.py), items/s",
                      ["per item", "batched (x)", "mean batch"],
                      [[h.cell(per), h.cell(suite.find("ray", "items/s", question="concurrent_runs", kind="batched"),
                                            suite.find("ray", "x", question="concurrent_runs")),
                        h.cell(suite.find("ray", "inputs", question="concurrent_runs", what="mean_batch"))]])


if __name__ == "__main__":
    h.cli(main)
