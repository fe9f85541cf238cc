"""Local's batching: a batching node alone is a piece whose inputs travel in Bundles (one encoding, one message
entry and one outcome for many inputs). Each input still crosses as if it went alone, and fails alone."""

import pytest

import soma
from soma import Graph, NodeError
from tests.conftest import wait_for
from tests.local.nodes import (
    AddsInPlace,
    CountsBatch,
    EchoesBatch,
    GrowsAfterSleep,
    GrowsPerBatch,
    LockFor,
    LogsBatches,
    NamesBatch,
    SameOutputForAll,
)
from tests.nodes import Unpicklable

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(120)


def test_the_same_tensor_many_times_in_a_map_reaches_the_node_as_distinct_inputs(local):
    small, big = torch.zeros(8), torch.zeros(1 << 14)  # inline, and copied into a segment
    xs = [small] * 20 + [big] * 20
    out = list(local.map(Graph.somatize(AddsInPlace()), xs))
    assert out == [8.0] * 20 + [float(1 << 14)] * 20  # each added to its own copy, once
    assert float(small.sum()) == 0.0 and float(big.sum()) == 0.0  # the caller's tensors are untouched


def test_the_same_numpy_array_many_times_reaches_the_node_as_distinct_inputs(local):
    import numpy

    small, big = numpy.zeros(8), numpy.zeros(1 << 14)  # inline, and copied into a segment
    out = list(local.map(Graph.somatize(AddsInPlace()), [small] * 20 + [big] * 20))
    assert out == [8.0] * 20 + [float(1 << 14)] * 20
    assert small.sum() == 0 and big.sum() == 0


def test_numpy_bytes_and_dicts_of_arrays_cross_a_bundle_exactly(local):
    import numpy

    xs = [{"image": numpy.arange(i, i + 12, dtype=numpy.uint8).reshape(3, 4), "label": i} for i in range(10)]
    xs += [bytes([i]) * (1 << 16) for i in range(10)]  # large bytes: the bundle's values go one by one, by pickle
    xs += [numpy.full(1 << 15, i, dtype=numpy.float32)[::2] for i in range(10)]  # strided, in segments
    xs += [(i, b"small", numpy.float64(i) / 3) for i in range(10)]
    out = list(local.map(Graph.somatize(EchoesBatch()), xs))
    for x, y in zip(xs, out):
        if isinstance(x, dict):
            assert y["label"] == x["label"] and y["image"].dtype == numpy.uint8
            assert numpy.array_equal(y["image"], x["image"])
        elif isinstance(x, numpy.ndarray):
            assert y.dtype == x.dtype and numpy.array_equal(y, x)
        else:
            assert type(y) is type(x) and y == x


def test_one_output_object_for_a_whole_batch_arrives_as_each_inputs_own(local):
    held = list(local.map(Graph.somatize(SameOutputForAll()), range(48)))
    firsts = [t[0].item() for t in held]
    held[0].add_(1000)  # the caller changes one result: no other may change with it
    assert [t[0].item() for t in held[1:]] == firsts[1:]
    assert all(t.shape == (1 << 14,) and torch.all(t == t[0]) for t in held[1:])


def test_an_input_that_cannot_be_sent_fails_alone_and_the_rest_still_share_calls(local):
    xs = [*range(10), Unpicklable(), *range(11, 40)]
    out = list(local.map(Graph.somatize(CountsBatch()), xs, errors="yield"))
    bad = out[10]
    assert isinstance(bad, NodeError) and bad.index == 10 and bad.node == "counts_batch"
    assert "its input cannot be sent to a worker" in str(bad) and "Unpicklable" in str(bad)
    good = [y for i, y in enumerate(out) if i != 10]
    assert [y[0] for y in good] == [x * 2 for x in [*range(10), *range(11, 40)]]
    assert max(size for _, size in good) > 1  # still batched


def test_an_output_that_cannot_be_sent_back_fails_alone(local):
    out = list(local.map(Graph.somatize(LockFor(5)), range(32), errors="yield"))
    bad = out[5]
    assert isinstance(bad, NodeError) and bad.index == 5 and "cannot be sent back to the host" in str(bad)
    assert [y[0] for i, y in enumerate(out) if i != 5] == [x * 2 for x in range(32) if x != 5]


def test_a_map_of_a_batching_node_is_sent_in_bundles_of_at_most_max_batch(local):
    out = list(local.map(Graph.somatize(CountsBatch()), range(200)))
    assert [y for y, _ in out] == [x * 2 for x in range(200)]
    sizes = [size for _, size in out]
    assert max(sizes) <= CountsBatch.max_batch
    assert sum(1 for size in sizes if size > 1) >= 150  # most inputs shared a call


def test_a_maps_bundles_carry_consecutive_inputs(local):
    # All 64 are placed in one pump: a bundle fills at one worker before the next worker is chosen, so each
    # call gets a run of 16 consecutive inputs (spread input by input, one worker got the even ones and the
    # other the odd ones: an ordered map then waited for both workers before it could hand out any bundle's).
    out = list(local.map(Graph.somatize(NamesBatch()), range(64), window=64))
    assert [x for x, _ in out] == list(range(64))
    assert sorted({batch for _, batch in out}) == [tuple(range(i, i + 16)) for i in range(0, 64, 16)]


def test_leaving_a_map_early_drops_the_bundles_still_queued_at_the_workers(local, tmp_path):
    log = tmp_path / "ran"
    outputs = local.map(Graph.somatize(LogsBatches(str(log), 0.05)), range(10_000), window=64)
    assert [next(outputs) for _ in range(3)] == [0, 1, 2]
    outputs.close()
    wait_for(lambda: not any(local.snapshot().jobs), what="the cancelled jobs' outcomes")
    assert local.snapshot().inputs == 0
    ran = [int(x) for x in log.read_text().split()]
    assert len(ran) == len(set(ran))  # none twice
    # 64 were in flight (and more would have come): each worker ran the batches of 8 it had started, two or
    # three of them on a slow machine, never the bundles still queued behind them
    assert len(ran) <= 48, len(ran)
    assert [y for y, _ in local.map(Graph.somatize(CountsBatch()), range(4))] == [0, 2, 4, 6]  # the pool goes on


def test_bundles_a_worker_over_max_memory_never_started_run_on_its_replacement():
    # Two batches put a worker 120 MiB over where it started, above the cap: it hands back the bundles queued
    # behind them (cancelled, not started) and is replaced; they go again, whole, to the next worker.
    with soma.Local(workers=1, max_memory="100MiB") as capped:
        out = list(capped.map(Graph.somatize(GrowsPerBatch(60)), range(24)))
    assert [x for x, _ in out] == list(range(24))  # every output, once, in order
    pids = [pid for _, pid in out]
    assert len(set(pids)) >= 3 and all(pids.count(pid) <= 2 * GrowsPerBatch.max_batch for pid in pids), pids


def test_a_bundle_handed_back_goes_again_naming_only_the_inputs_still_wanted(monkeypatch):
    # Input 0 runs alone and puts its worker over the cap; inputs 1-4 gather into one bundle queued behind it;
    # input 2 is cancelled there. The worker hands the bundle back unstarted: it goes again to the replacement
    # with input 2's place empty, and the other three run.
    from soma.local.host import sending as flows

    sent = []
    made = flows.BundleSend.__init__

    def recording(self, bundle, jobs):
        made(self, bundle, jobs)
        sent.append((id(bundle), list(self.ids)))

    monkeypatch.setattr(flows.BundleSend, "__init__", recording)
    with soma.Local(workers=1, max_memory="100MiB") as capped:
        g = Graph.somatize(GrowsAfterSleep(120, 0.5))
        first = capped.submit(g, 0)
        wait_for(lambda: any(capped.snapshot().jobs), what="input 0 at the worker")
        futures = [capped.submit(g, x) for x in (1, 2, 3, 4)]
        wait_for(lambda: capped.snapshot().jobs == [5], what="inputs 1-4 sent as one bundle")
        assert futures[1].cancel()
        assert first.result(timeout=60) == 0
        assert [f.result(timeout=60) for f in (futures[0], futures[2], futures[3])] == [2, 6, 8]
    again = [ids for bundle, ids in sent if sum(1 for b, _ in sent if b == bundle) > 1]
    assert again and all(ids.count(0) == 1 for ids in again[1:]) and again[0].count(0) == 0, sent


def test_an_idle_pools_snapshot_names_no_node_after_a_map_through_a_batching_node_behind_another(local):
    """A turn's threads stay named on the status page after its outcomes left, until their next job (a death
    before they leave must count them as run): the snapshot named 17 finished jobs per idle worker."""
    from tests.nodes import AddOne

    g = Graph.somatize(AddOne() >> EchoesBatch())
    assert list(local.map(g, range(600))) == list(range(1, 601))
    wait_for(lambda: local.snapshot().inputs == 0 and not any(local.snapshot().jobs), what="the map's end")
    assert local.snapshot().running == [[], []]


class SlowBatches(soma.Node):
    """A batching node whose every call outlasts the map's timeout."""

    max_batch = 4

    def forward_batch(self, xs, ctx):
        import time

        time.sleep(30)
        return soma.Done(list(xs))


def test_inputs_of_one_batch_timed_out_together_each_name_the_node_they_ran_in(local):
    """The first input's timeout replaced its worker, which ended its batch's other inputs before their own
    timeouts were looked at: they said "run timed out after 1.0 s; still running: none", `.nodes` empty (found
    by a tester). Inputs that time out at once are now looked at together, before any worker is replaced."""
    local.start()
    out = list(local.map(Graph.somatize(SlowBatches()), range(8), timeout=1.0, errors="yield"))
    assert all(isinstance(err, soma.RunTimeout) for err in out), out
    assert sorted(err.index for err in out) == list(range(8))
    # Each ran in it, or waited for it: never neither ("still running: none", nothing waiting).
    assert all(err.nodes == ("slow_batches",) or err.waiting == ("slow_batches",) for err in out), \
        [(err.index, str(err)) for err in out]
    assert any("still running: `slow_batches` (on worker w" in str(err) for err in out)
