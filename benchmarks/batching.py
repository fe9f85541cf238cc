"""batching: a batching model node (forward_batch) against the same node per item and against hand-batched inputs.

    python benchmarks/batching.py [--quick] [--smoke] [--json out.json] [--plot batching.png]
    (or: soma bench batching)

Two models with random weights (benchmarks/_models.py: a tiny transformer, whose items
cost more than moving them, and a small MLP, whose items cost about as much as soma's own
work for them) over per-item inputs (4,096 full), on the Executor and on Local (2 workers),
rounds alternated, every output checked against the model run in-process; for each model:

* the model as `soma.torch.Batched` (max_batch 64: a batching node, `forward_batch`) against the same
  model per item (`forward`), items/s;
* against a hand-batched map (the inputs grouped 64 per input by the caller, the same
  model on each group), items/s: what keeping per-item inputs costs;
* 64 threads calling `Local.run` at once, batching node against per-item node, items/s,
  with the mean batch size the batching node saw; beside them, what bounds that section on
  this machine: a batching node with no model (the most batching could gain here) and the
  same 64 threads making blocking calls through one plain dispatcher thread, no soma;
* a lone `Local.run` of the batching node against the per-item node, in ms: what a run
  alone pays for `batch_wait` (nothing: the batch goes at once when nothing else is in flight);
* with `--plot FILE.png`, the transformer's throughput against 1, 4, 16 and 64 concurrent callers of
  `Local.run`: the batching node, the per-item node, and batching by hand (the callers' inputs gathered
  into one input, one run per gathering), drawn into FILE.png.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import statistics
import threading

import _harness as h
import _models as m

import soma
from soma import Graph

NAME = "batching"
WORKERS = 2
MODELS = (m.TRANSFORMER, m.MLP)


def check(name: str, rows, expected) -> None:
    import torch

    got = torch.stack(list(rows))
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-4):
        raise h.WrongValue(f"{name} returned outputs that are not the model's")


def maps(suite: h.Suite, local, model: str) -> None:
    import torch

    n = {"full": 4096, "quick": 1024, "smoke": 128}[suite.mode]
    xs = m.inputs(n, model)
    expected = m.model(model)(torch.stack(xs))
    groups = [xs[i:i + m.BATCH] for i in range(0, n, m.BATCH)]
    executor = soma.Executor()
    graphs = {"per_item": Graph.somatize(m.PerItem(model)), "batched": Graph.somatize(m.batched(model)),
              "hand": Graph.somatize(m.HandBatched(model))}
    sizes: dict = {}

    def rate(name, runner, kind):
        source = groups if kind == "hand" else xs
        elapsed, out = h.timed(lambda: list(runner.map(graphs[kind], source)))
        if kind == "batched":
            rows, batch = m.counted(name, out)
            sizes.setdefault(name, []).append(statistics.mean(batch))
        else:
            rows = [row for group in out for row, _ in group] if kind == "hand" else [row for row, _ in out]
        check(name, rows, expected)
        return n / elapsed

    contenders = {f"{where}/{kind}": (lambda w=where, k=kind, r=runner: rate(f"{w}/{k}", r, k))
                  for where, runner in (("executor", executor), ("local", local)) for kind in graphs}
    for runner in (executor, local):  # warm: setup on every copy
        for kind, g in graphs.items():
            list(runner.map(g, groups[:2] if kind == "hand" else xs[:128]))
    samples = h.alternate(contenders, repeat=suite.repeat(full=5, quick=3, smoke=1), self_timed=True)
    executor.close()
    for name, values in samples.items():
        where, _, kind = name.partition("/")
        params = {"what": "map", "model": model, "inputs": n, "kind": kind,
                  "workers": WORKERS if where == "local" else 0}
        suite.add(where, params, values, "items/s")
        if kind == "batched":
            suite.add_ratio(where, {**params}, values, samples[f"{where}/per_item"], vs="per_item")
            suite.add_ratio(where, {**params, "of": "hand"}, values, samples[f"{where}/hand"], vs="hand_batched")
            suite.add(where, {**params, "what": "mean_batch"}, sizes[name], "inputs")


class Dispatcher:
    """The floor of the 64-thread section, with no soma: each call hands its input to one thread, which answers
    every call queued by then together (as Local's receiving answers a bundle's outcomes) and the caller wakes
    with it. What 64 Python threads making blocking calls at once can do on this machine at all."""

    def __init__(self):
        self.calls = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="floor-dispatcher", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            calls = [self.calls.get()]
            while True:
                try:
                    calls.append(self.calls.get_nowait())
                except queue.Empty:
                    break
            for call in calls:
                if call is None:
                    return
                x, answer = call
                answer.put(x)

    def call(self, x):
        answer = queue.SimpleQueue()
        self.calls.put((x, answer))
        return answer.get()

    def close(self) -> None:
        self.calls.put(None)
        self.thread.join()


def threads(suite: h.Suite, local, model: str) -> None:
    """64 threads calling `Local.run` at once: the per-item node, the batching node, a batching node with no
    model (the most batching could reach here), and the same 64 threads through a plain dispatcher (the floor)."""
    import torch

    n = {"full": 2048, "quick": 1024, "smoke": 128}[suite.mode]
    xs = m.inputs(n, model)
    expected = {"per_item": m.model(model)(torch.stack(xs))}
    expected["batched"] = expected["per_item"]
    expected["no_model"] = torch.stack(xs).reshape(n, -1)[:, :m.OUT[model]]
    nodes = {"per_item": m.PerItem(model), "batched": m.batched(model), "no_model": m.NoModel(model)}
    callers = cf.ThreadPoolExecutor(64)
    dispatcher = Dispatcher()
    sizes = []

    def rate(kind):
        g = Graph.somatize(nodes[kind])
        list(callers.map(lambda x: local.run(g, x), xs[:64]))  # warm
        elapsed, out = h.timed(lambda: list(callers.map(lambda x: local.run(g, x), xs)))
        name = f"local/{kind} from 64 threads"
        if kind == "batched":
            rows, batch = m.counted(name, out)
            sizes.append(statistics.mean(batch))
        else:
            rows = [row for row, _ in out]
        check(name, rows, expected[kind])
        return n / elapsed

    def floor():
        elapsed, out = h.timed(lambda: list(callers.map(dispatcher.call, xs)))
        if any(got is not x for got, x in zip(out, xs)):
            raise h.WrongValue("the dispatcher floor answered a call with another call's input")
        return n / elapsed

    contenders = {kind: (lambda k=kind: rate(k)) for kind in nodes}
    contenders["python_floor"] = floor
    try:
        samples = h.alternate(contenders, repeat=suite.repeat(full=5, quick=3, smoke=1), self_timed=True)
    finally:
        callers.shutdown()
        dispatcher.close()
    params = {"what": "64_threads_run", "model": model, "inputs": n, "workers": WORKERS}
    for kind in nodes:
        suite.add("local", {**params, "kind": kind}, samples[kind], "items/s")
    suite.add("python", {**params, "kind": "dispatcher_floor", "workers": 0}, samples["python_floor"], "calls/s")
    suite.add_ratio("local", {**params, "kind": "batched"}, samples["batched"], samples["per_item"], vs="per_item")
    suite.add_ratio("local", {**params, "kind": "no_model"}, samples["no_model"], samples["per_item"],
                    vs="per_item")
    suite.add_ratio("python", {**params, "kind": "dispatcher_floor", "workers": 0}, samples["python_floor"],
                    samples["per_item"], vs="per_item")
    suite.add("local", {**params, "what": "64_threads_mean_batch"}, sizes, "inputs")


def lone_run(suite: h.Suite, local) -> None:
    x = m.inputs(1)[0]
    trips = {"full": 200, "quick": 100, "smoke": 10}[suite.mode]
    graphs = {"per_item": Graph.somatize(m.PerItem()), "batched": Graph.somatize(m.batched())}
    expected = m.model()(x.unsqueeze(0))
    for g in graphs.values():
        local.run(g, x)

    def per_run(kind):
        elapsed, out = h.timed(lambda: [local.run(graphs[kind], x) for _ in range(trips)])
        rows, sizes = m.counted(f"local/{kind}", out) if kind == "batched" else ([row for row, _ in out],
                                                                              [size for _, size in out])
        if any(size != 1 for size in sizes):
            raise h.WrongValue(f"local/{kind}: a lone run was not a batch of one")
        check(f"local/{kind}, a lone run", rows, expected.expand(trips, -1))
        return elapsed / trips

    samples = h.alternate({kind: (lambda k=kind: per_run(k)) for kind in graphs},
                          repeat=suite.repeat(full=7, quick=3, smoke=1), self_timed=True)
    params = {"what": "lone_run", "workers": WORKERS}
    for kind, values in samples.items():
        suite.add("local", {**params, "kind": kind}, h.ms(values), "ms")
    suite.add_ratio("local", {**params, "kind": "batched"}, samples["batched"], samples["per_item"], vs="per_item")


LEVELS = (1, 4, 16, 64)  # concurrent callers, in --plot's sweep


def callers(suite: h.Suite, local, model: str = m.TRANSFORMER) -> None:
    """Throughput against concurrent callers (--plot): c threads calling `Local.run` at once through the batching
    node and through the per-item node, against batching by hand: the c callers' inputs gathered into one input
    of c items (`HandBatched`), one `Local.run` per gathering, one after another (c callers who each wait for
    their answer keep one such batch in flight)."""
    import torch

    n = {"full": 2048, "quick": 512, "smoke": 64}[suite.mode]
    xs = m.inputs(n, model)
    expected = m.model(model)(torch.stack(xs))
    graphs = {"batched": Graph.somatize(m.batched(model)), "per_item": Graph.somatize(m.PerItem(model)),
              "hand_batched": Graph.somatize(m.HandBatched(model))}
    for level in LEVELS:
        pool = cf.ThreadPoolExecutor(level)
        groups = [xs[i:i + level] for i in range(0, n, level)]
        sizes = []

        def rate(kind):
            name = f"local/{kind} from {level} callers"
            if kind == "hand_batched":
                elapsed, out = h.timed(lambda: [local.run(graphs[kind], group) for group in groups])
                rows = [row for group in out for row, _ in group]
            else:
                elapsed, out = h.timed(lambda: list(pool.map(lambda x: local.run(graphs[kind], x), xs)))
                if kind == "batched":
                    rows, batch = m.counted(name, out)
                    sizes.append(statistics.mean(batch))
                else:
                    rows = [row for row, _ in out]
            check(name, rows, expected)
            return n / elapsed

        try:
            samples = h.alternate({kind: (lambda k=kind: rate(k)) for kind in graphs},
                                  repeat=suite.repeat(full=5, quick=2, smoke=1), self_timed=True)
        finally:
            pool.shutdown()
        params = {"what": "callers", "model": model, "inputs": n, "callers": level, "workers": WORKERS}
        for kind, values in samples.items():
            suite.add("local", {**params, "kind": kind}, values, "items/s")
        for vs in ("per_item", "hand_batched"):
            suite.add_ratio("local", {**params, "kind": "batched"}, samples["batched"], samples[vs], vs=vs)
        suite.add("local", {**params, "kind": "batched", "what": "callers_mean_batch"}, sizes, "inputs")
        suite.done(f"{level} callers ({model})")


def plot(suite: h.Suite, path: str, others: float) -> None:
    import _plot

    def median(unit, **params):
        found = suite.find("local", unit, what="callers", **params)
        return found.median if found else None

    labels = {"batched": "soma.torch.Batched (max_batch 64)", "per_item": "the per-item node",
              "hand_batched": "batched by hand: the callers' inputs as one"}
    _plot.draw(path, f"soma bench batching ({suite.mode}), the tiny transformer on Local(workers=2), {h.versions()}; "
                     f"other programs used {others:.0f}% of a core meanwhile", [
        _plot.Panel("items/s against concurrent callers of Local.run (higher is better)", x=list(LEVELS),
                    xlabel="concurrent callers", ylabel="items/s", logx_base=2, labels=labels,
                    series={kind: [median("items/s", callers=c, kind=kind) for c in LEVELS] for kind in labels}),
        _plot.Panel("the batching node's items/s over the others' (per round)", x=list(LEVELS),
                    xlabel="concurrent callers", ylabel="×", logx_base=2,
                    labels={"per_item": "over the per-item node", "hand_batched": "over batching by hand"},
                    series={vs: [median("x", callers=c, kind="batched", vs=vs) for c in LEVELS]
                            for vs in ("per_item", "hand_batched")},
                    targets={"target at 64 callers: 3.0x the per-item node": 3.0}),
    ])


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__, plot=True)
    suite = h.Suite(NAME, args)
    machine = h.MachineShare()  # (for the plot's title)
    print(f"{NAME}: {h.versions()}; mode {suite.mode}")
    local = soma.Local(workers=WORKERS).start()
    try:
        for model in MODELS:
            maps(suite, local, model)
            suite.done(f"maps ({model})")
            threads(suite, local, model)
            suite.done(f"threads ({model})")
        lone_run(suite, local)
        suite.done("lone run")
        if args.plot:
            callers(suite, local)
    finally:
        local.close()
    records = suite.finish(lambda: print_summary(suite))
    if args.plot:
        plot(suite, args.plot, machine.others()[0])
    return records


def print_summary(suite: h.Suite) -> None:
    rows = []
    for model in MODELS:
        for where in ("executor", "local"):
            at = {"what": "map", "model": model}
            rows.append([f"{where}, {model}", h.cell(suite.find(where, "items/s", **at, kind="per_item")),
                         h.cell(suite.find(where, "items/s", **at, kind="batched"),
                                suite.find(where, "x", **at, vs="per_item")),
                         h.cell(suite.find(where, "items/s", **at, kind="hand")),
                         h.cell(suite.find(where, "x", **at, vs="hand_batched")),
                         h.cell(suite.find(where, "inputs", what="mean_batch", model=model))])
    h.print_table(f"{NAME}: map, items/s (ratio per round)",
                  ["contender", "per item", "batched (x per item)", "hand-batched", "batched / hand",
                   "mean batch"], rows)
    rows = []
    for model in MODELS:
        at = {"what": "64_threads_run", "model": model}
        rows.append([f"local, {model}", h.cell(suite.find("local", "items/s", **at, kind="per_item")),
                     h.cell(suite.find("local", "items/s", **at, kind="batched"),
                            suite.find("local", "x", **at, kind="batched")),
                     h.cell(suite.find("local", "inputs", what="64_threads_mean_batch", model=model)),
                     h.cell(suite.find("local", "items/s", **at, kind="no_model"),
                            suite.find("local", "x", **at, kind="no_model")),
                     h.cell(suite.find("python", "calls/s", **at), suite.find("python", "x", **at))])
    h.print_table(f"{NAME}: 64 threads calling Local.run at once, items/s (x the per-item node)",
                  ["contender", "per item", "batched", "mean batch", "batching, no model",
                   "no soma: a dispatcher thread (calls/s)"], rows)
    h.print_table(f"{NAME}: a lone Local.run of the MLP, ms",
                  ["contender", "per item", "batched (x)"],
                  [["local", h.cell(suite.find("local", "ms", what="lone_run", kind="per_item")),
                    h.cell(suite.find("local", "ms", what="lone_run", kind="batched"),
                           suite.find("local", "x", what="lone_run"))]])


if __name__ == "__main__":
    h.cli(main)
