"""batching: a batching model node (forward_batch) against the same node per item and against hand-batched inputs.

    python benchmarks/batching.py [--quick] [--smoke] [--json out.json]   (or: soma bench batching)

A small MLP with random weights over per-item inputs (4,096 full), on the Executor and
on Local (2 workers), rounds alternated, every output checked against the model run
in-process:

* `forward_batch` (max_batch 64) against the same model's per-item `forward`, items/s;
* against a hand-batched map (the inputs grouped 64 per input by the caller, the same
  model on each group), items/s: what keeping per-item inputs costs;
* 64 threads calling `Local.run` at once, batching node against per-item node, items/s,
  with the mean batch size the batching node saw;
* a lone `Local.run` of the batching node against the per-item node, in ms: what a run
  alone pays for `batch_wait` (nothing: the batch goes at once when nothing else is in flight).
"""

from __future__ import annotations

import concurrent.futures as cf
import statistics

import _harness as h
import _models as m

import soma
from soma import Graph

NAME = "batching"
WORKERS = 2


def check(name: str, rows, expected) -> None:
    import torch

    got = torch.stack(list(rows))
    if got.shape != expected.shape or not torch.allclose(got, expected, atol=1e-4):
        raise h.WrongValue(f"{name} returned outputs that are not the model's")


def maps(suite: h.Suite, local) -> None:
    import torch

    n = {"full": 4096, "quick": 1024, "smoke": 128}[suite.mode]
    xs = m.inputs(n)
    expected = m.model()(torch.stack(xs))
    groups = [xs[i:i + 64] for i in range(0, n, 64)]
    executor = soma.Executor()
    graphs = {"per_item": Graph.somatize(m.PerItem()), "batched": Graph.somatize(m.Batched()),
              "hand": Graph.somatize(m.HandBatched())}
    sizes: dict = {}

    def rate(name, runner, kind):
        source = groups if kind == "hand" else xs
        elapsed, out = h.timed(lambda: list(runner.map(graphs[kind], source)))
        rows = [row for group in out for row, _ in group] if kind == "hand" else [row for row, _ in out]
        check(name, rows, expected)
        if kind == "batched":
            sizes.setdefault(name, []).append(statistics.mean(size for _, size in out))
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
        params = {"what": "map", "inputs": n, "kind": kind, "workers": WORKERS if where == "local" else 0}
        suite.add(where, params, values, "items/s")
        if kind == "batched":
            suite.add_ratio(where, {**params}, values, samples[f"{where}/per_item"], vs="per_item")
            suite.add_ratio(where, {**params, "of": "hand"}, values, samples[f"{where}/hand"], vs="hand_batched")
            suite.add(where, {**params, "what": "mean_batch"}, sizes[name], "inputs")


def threads(suite: h.Suite, local) -> None:
    import torch

    n = {"full": 2048, "quick": 1024, "smoke": 128}[suite.mode]
    xs = m.inputs(n)
    expected = m.model()(torch.stack(xs))
    callers = cf.ThreadPoolExecutor(64)
    sizes = []

    def rate(kind):
        g = Graph.somatize(m.Batched() if kind == "batched" else m.PerItem())
        list(callers.map(lambda x: local.run(g, x), xs[:64]))  # warm
        elapsed, out = h.timed(lambda: list(callers.map(lambda x: local.run(g, x), xs)))
        check(f"local/{kind} from 64 threads", [row for row, _ in out], expected)
        if kind == "batched":
            sizes.append(statistics.mean(size for _, size in out))
        return n / elapsed

    try:
        samples = h.alternate({kind: (lambda k=kind: rate(k)) for kind in ("per_item", "batched")},
                              repeat=suite.repeat(full=5, quick=3, smoke=1), self_timed=True)
    finally:
        callers.shutdown()
    params = {"what": "64_threads_run", "inputs": n, "workers": WORKERS}
    for kind, values in samples.items():
        suite.add("local", {**params, "kind": kind}, values, "items/s")
    suite.add_ratio("local", {**params, "kind": "batched"}, samples["batched"], samples["per_item"], vs="per_item")
    suite.add("local", {**params, "what": "64_threads_mean_batch"}, sizes, "inputs")


def lone_run(suite: h.Suite, local) -> None:
    x = m.inputs(1)[0]
    trips = {"full": 200, "quick": 100, "smoke": 10}[suite.mode]
    graphs = {"per_item": Graph.somatize(m.PerItem()), "batched": Graph.somatize(m.Batched())}
    for g in graphs.values():
        local.run(g, x)

    def per_run(kind):
        elapsed, out = h.timed(lambda: [local.run(graphs[kind], x) for _ in range(trips)])
        if any(size != 1 for _, size in out):
            raise h.WrongValue(f"local/{kind}: a lone run was not a batch of one")
        return elapsed / trips

    samples = h.alternate({kind: (lambda k=kind: per_run(k)) for kind in graphs},
                          repeat=suite.repeat(full=7, quick=3, smoke=1), self_timed=True)
    params = {"what": "lone_run", "workers": WORKERS}
    for kind, values in samples.items():
        suite.add("local", {**params, "kind": kind}, h.ms(values), "ms")
    suite.add_ratio("local", {**params, "kind": "batched"}, samples["batched"], samples["per_item"], vs="per_item")


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    print(f"{NAME}: {h.versions()}; mode {suite.mode}")
    local = soma.Local(workers=WORKERS).start()
    try:
        maps(suite, local)
        print("  maps done", flush=True)
        threads(suite, local)
        print("  threads done", flush=True)
        lone_run(suite, local)
    finally:
        local.close()
    return suite.finish(lambda: print_summary(suite))


def print_summary(suite: h.Suite) -> None:
    rows = []
    for where in ("executor", "local"):
        per = suite.find(where, "items/s", what="map", kind="per_item")
        bat = suite.find(where, "items/s", what="map", kind="batched")
        hand = suite.find(where, "items/s", what="map", kind="hand")
        rows.append([where, h.cell(per), h.cell(bat, suite.find(where, "x", what="map", vs="per_item")),
                     h.cell(hand), h.cell(suite.find(where, "x", what="map", vs="hand_batched")),
                     h.cell(suite.find(where, "inputs", what="mean_batch"))])
    h.print_table(f"{NAME}: map, items/s (ratio per round)",
                  ["contender", "per item", "batched (x per item)", "hand-batched", "batched / hand",
                   "mean batch"], rows)
    h.print_table(f"{NAME}: 64 threads calling Local.run at once, and a lone run",
                  ["contender", "per item items/s", "batched items/s (x)", "mean batch", "lone run ms per item",
                   "lone run ms batched (x)"],
                  [["local", h.cell(suite.find("local", "items/s", what="64_threads_run", kind="per_item")),
                    h.cell(suite.find("local", "items/s", what="64_threads_run", kind="batched"),
                           suite.find("local", "x", what="64_threads_run")),
                    h.cell(suite.find("local", "inputs", what="64_threads_mean_batch")),
                    h.cell(suite.find("local", "ms", what="lone_run", kind="per_item")),
                    h.cell(suite.find("local", "ms", what="lone_run", kind="batched"),
                           suite.find("local", "x", what="lone_run"))]])


if __name__ == "__main__":
    h.cli(main)
