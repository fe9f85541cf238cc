"""Batching nodes: a node with `forward_batch(xs, ctx)` gets the inputs that are at it at once, on every runner."""

import asyncio
import os
import threading
import time

import pytest

from soma import Done, Graph, Node, NodeError, PostconditionError
from tests.conftest import in_threads

pytestmark = pytest.mark.timeout(120)


class Pre(Node):
    """Per-item work before the batched node."""

    def forward(self, x, ctx):
        return Done(x + 1)


class Embed(Node):
    """Doubles each input, and says how big its batch was and which process ran it."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        time.sleep(0.005)  # (a model's forward: long enough that inputs queue behind it)
        return Done([(x * 2, len(xs), os.getpid()) for x in xs])


class OneAtATime(Node):
    """Fails if two batches ever run in it at once."""

    max_batch = 8

    def __init__(self):
        self.inside = 0

    def forward_batch(self, xs, ctx):
        self.inside += 1
        try:
            assert self.inside == 1, "two batches at once"
            time.sleep(0.002)
            return Done(list(xs))
        finally:
            self.inside -= 1


class FailsOn(Node):
    """A batch holding `bad` fails as a whole."""

    max_batch = 4

    def __init__(self, bad):
        self.bad = bad

    def forward_batch(self, xs, ctx):
        if self.bad in xs:
            raise ValueError(f"bad batch {sorted(xs)}")
        return Done(list(xs))


class WrongLength(Node):
    def forward_batch(self, xs, ctx):
        return Done(list(xs)[:-1] if len(xs) > 1 else [1, 2])


class OnMeta(Node):
    """Returns meta tensors, except for input 3 (a CPU tensor: the postcondition catches that one alone)."""

    max_batch = 8

    def forward_batch(self, xs, ctx):
        import torch

        return Done([torch.zeros(2, device="cpu" if x == 3 else ctx.device) for x in xs])


def test_map_with_a_batching_node_gives_what_runs_give_in_batches(runner):
    g = Graph.somatize(Pre() >> Embed())
    for ordered in (True, False):
        out = list(runner.map(g, range(64), ordered=ordered))
        values = [v for v, _, _ in out]
        assert (values if ordered else sorted(values)) == [runner.run(g, i)[0] for i in range(64)]
        sizes = [size for _, size, _ in out]
        assert max(sizes) <= 16
        assert sum(1 for s in sizes if s > 1) > 32, sizes  # most inputs shared a call


def test_a_lone_run_is_a_batch_of_one(runner):
    assert runner.run(Graph.somatize(Pre() >> Embed()), 1)[:2] == (4, 1)


def test_concurrent_runs_share_a_batch(runner):
    g = Graph.somatize(Embed())
    runner.run(g, 0)  # (warm: its code loaded)
    out = in_threads(lambda k: runner.run(g, k), 24)
    assert [v for v, _, _ in out] == [2 * k for k in range(24)]
    assert max(size for _, size, _ in out) > 1, out


def test_concurrent_aruns_share_a_batch(runner):
    g = Graph.somatize(Embed())
    runner.run(g, 0)  # (warm: its code loaded)

    async def together():
        return await asyncio.wait_for(asyncio.gather(*(runner.arun(g, k) for k in range(24))), 60)

    out = asyncio.run(together())
    assert [v for v, _, _ in out] == [2 * k for k in range(24)]
    assert max(size for _, size, _ in out) > 1, out


def test_one_batch_at_a_time_per_node_object(runner):
    assert list(runner.map(OneAtATime(), range(50))) == list(range(50))


def test_a_failing_batch_fails_only_its_own_inputs_each_with_its_index(runner):
    out = list(runner.map(Graph.somatize(FailsOn(bad=5)), range(20), errors="yield"))
    failed = [o for o in out if isinstance(o, NodeError)]
    assert failed and all(o.index not in (None,) for o in failed)
    assert 5 in {o.index for o in failed}
    assert len({id(o) for o in failed}) == len(failed)  # each its own error
    for o in failed:
        assert str(o).startswith("node `fails_on` failed: ValueError: bad batch [") and "5" in str(o)
    ok = [o for o in out if not isinstance(o, NodeError)]
    assert len(ok) + len(failed) == 20 and len(failed) <= 4  # one batch of at most max_batch failed


def test_forward_batch_returning_another_length_is_a_node_error(runner):
    with pytest.raises(NodeError, match=r"^node `wrong_length` failed: forward_batch returned 2 outputs for 1 inputs$"):
        runner.run(WrongLength(), 1)


def test_the_postcondition_applies_to_each_output_of_a_batch(runner):
    pytest.importorskip("torch")
    g = Graph.somatize(OnMeta().on("meta"))
    out = list(runner.map(g, range(8), errors="yield"))
    bad = [o for o in out if isinstance(o, PostconditionError)]
    assert [o.index for o in bad] == [3]
    assert str(bad[0]) == "node `on_meta` failed: it declared `meta` but returned a value on `cpu`"
    assert all(o.device.type == "meta" for i, o in enumerate(out) if i != 3)


def test_a_batching_nodes_call_is_one_trace_event_with_its_inputs(runner, tmp_path):
    import json

    path = tmp_path / "batch.json"
    with runner.trace(path):
        list(runner.map(Graph.somatize(Pre() >> Embed()), range(30)))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "node" and e["name"] == "embed"]
    assert sorted(i for e in events for i in e["args"]["inputs"]) == list(range(30))
    assert all(e["args"]["batch"] == len(e["args"]["inputs"]) <= 16 for e in events)
    assert len(events) < 30  # fewer calls than inputs


def test_a_batching_node_with_setup_runs_setup_once_per_copy(runner):
    class WithSetup(Node):
        def setup(self, ctx):
            self.ready = threading.get_ident()

        def forward_batch(self, xs, ctx):
            return Done([hasattr(self, "ready") for _ in xs])

    assert all(runner.map(WithSetup(), range(10)))


@pytest.mark.timeout(300)  # (on Ray two new actors import torch: over 120 s once with both cores busy)
def test_soma_torch_batched_stacks_the_inputs_and_gives_each_its_row(runner):
    torch = pytest.importorskip("torch")
    from soma.torch import Batched, Module

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 3)  # trainable: on workers soma.torch nodes run it under no_grad (SPEC 8)
    xs = [torch.randn(8) for _ in range(40)]
    module = Module(layer)  # one node for the per-item answers (on Ray a new node is an actor of its own to start)
    per_item = [runner.run(module, x) for x in xs]
    batched = list(runner.map(Batched(layer, max_batch=16), xs))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(per_item, batched))
    assert all(b.shape == (3,) for b in batched)
    with pytest.raises(ValueError, match=r"^soma.torch.Batched's max_batch is a positive int, got 0$"):
        Batched(layer, max_batch=0)


@pytest.mark.timeout(300)
def test_soma_torch_nodes_run_an_ordinary_trainable_module_on_every_runner(runner):
    """SPEC 8: a plain nn.Module with trainable parameters runs through soma.torch.Module and Batched on every
    runner, unchanged (no requires_grad_(False), no no_grad around the map); in-process it records gradients."""
    torch = pytest.importorskip("torch")
    from soma.torch import Batched, Module

    torch.manual_seed(1)
    layer = torch.nn.Linear(8, 4)
    assert all(p.requires_grad for p in layer.parameters())
    xs = [torch.randn(8) for _ in range(24)]
    with torch.no_grad():
        want = [layer(x) for x in xs]
    got = list(runner.map(Graph.somatize(Batched(layer, max_batch=8)), xs))
    one = runner.run(Module(layer), xs[0])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(want, got))
    assert torch.allclose(one, want[0], atol=1e-6)
    in_process = runner is not None and type(runner).__name__ == "Executor"
    # In-process the output carries its autograd graph (training works); on a worker none is recorded.
    assert (one.grad_fn is not None) == in_process and (got[0].grad_fn is not None) == in_process
    assert all(p.requires_grad for p in layer.parameters())  # the caller's module is left as it was


class Fills(Node):
    """A batching node alone in its graph: each input x gives a 256 KiB numpy array of x (shared memory on
    Local), made in one forward_batch."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        import numpy

        return Done([numpy.full(1 << 18, x % 251, dtype=numpy.uint8) for x in xs])


def test_batched_numpy_outputs_held_many_at_once_keep_their_values(runner):
    import numpy

    g = Graph.somatize(Fills())
    held = list(runner.map(g, range(64)))
    later = list(runner.map(g, range(100, 164)))  # more batches while the first outputs are still held
    for x, value in [*zip(range(64), held), *zip(range(100, 164), later)]:
        assert value.shape == (1 << 18,) and numpy.all(value == x % 251), x


# -- issue 32 item 2: every runner batches a per-item stage's outputs, concurrent calls and traced maps ----------

class Stamp(Node):
    """A per-item stage that costs next to nothing (a decode, an augment)."""

    def forward(self, x, ctx):
        return Done(x)


class Twice(Node):
    """A batching node that costs next to nothing itself: each input doubled, and how many shared its call. Its
    inputs never queue behind a slow call: they batch only when the runner knows more are coming."""

    max_batch = 8
    batch_wait = 0.05

    def forward_batch(self, xs, ctx):
        return Done([(2 * x, len(xs)) for x in xs])


def _shared(out: list) -> int:
    """How many of the outputs came from a call of more than one input."""
    return sum(1 for _, size in out if size > 1)


def test_a_per_item_stage_before_a_batching_node_batches_in_a_map(runner):
    out = list(runner.map(Graph.somatize(Stamp() >> Twice()), range(64), window=64))
    assert [v for v, _ in out] == [2 * x for x in range(64)]
    assert max(size for _, size in out) <= 8
    assert _shared(out) >= 32, out


def test_concurrent_runs_from_eight_threads_share_calls(runner):
    g = Graph.somatize(Stamp() >> Embed())  # (a model's forward takes time: calls that come meanwhile meet)
    runner.run(g, 0)  # (warm: its code loaded)
    start = threading.Barrier(8)

    def call(k):
        start.wait(30)
        return runner.run(g, k)

    out = in_threads(call, 8)
    assert [v for v, _, _ in out] == [2 * k for k in range(8)]
    assert max(size for _, size, _ in out) > 1, out


def test_concurrent_aruns_of_a_cheap_batching_node_share_calls(runner):
    g = Graph.somatize(Twice())  # (its calls cost next to nothing: they batch only because the runner waits)
    runner.run(g, 0)  # (warm: its code loaded)

    async def together():
        return await asyncio.wait_for(asyncio.gather(*(runner.arun(g, k) for k in range(32))), 60)

    out = asyncio.run(together())
    assert [v for v, _ in out] == [2 * k for k in range(32)]
    assert _shared(out) >= 16, out


def test_a_traced_map_of_a_batching_node_batches_and_each_call_is_one_event(runner, tmp_path):
    import json

    path = tmp_path / "twice.json"
    with runner.trace(path):
        out = list(runner.map(Graph.somatize(Twice()), range(32), window=32))
    assert [v for v, _ in out] == [2 * x for x in range(32)]
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "node" and e["name"] == "twice"]
    assert sorted(i for e in events for i in e["args"]["inputs"]) == list(range(32))
    assert all(e["args"]["batch"] == len(e["args"]["inputs"]) <= 8 for e in events)
    assert max(e["args"]["batch"] for e in events) > 1, events
    assert len(events) <= 16, [e["args"]["batch"] for e in events]


def test_a_failing_batch_after_a_per_item_stage_fails_each_of_its_inputs_with_its_own_error(runner):
    out = list(runner.map(Graph.somatize(Stamp() >> FailsOn(bad=5)), range(24), window=24, errors="yield"))
    failed = [o for o in out if isinstance(o, NodeError)]
    assert 5 in {o.index for o in failed} and len(failed) <= 4
    assert len({id(o) for o in failed}) == len(failed)  # each its own error
    assert all(str(o).startswith("node `fails_on` failed: ValueError: bad batch [") for o in failed)
    assert [o for i, o in enumerate(out) if not isinstance(o, NodeError)] == \
        [i for i in range(24) if i not in {o.index for o in failed}]


class DefaultSizes(Node):
    """A batching node that leaves max_batch and batch_wait to their defaults: each input, and its call's size."""

    def forward_batch(self, xs, ctx):
        time.sleep(0.005)  # (inputs queue behind it)
        return Done([(x, len(xs)) for x in xs])


def test_a_batching_node_with_the_default_max_batch_takes_up_to_32(runner):
    """SPEC 2: `max_batch` and `batch_wait` are class attributes, 32 and 0.002 unless a node sets them. The
    Executor's map sized its window for a max_batch of 1 when the node did not set one: batches of 2 at most,
    100 calls for 200 inputs, where a node saying `max_batch = 32` got 7."""
    assert (Node.max_batch, Node.batch_wait) == (32, 0.002)
    assert (DefaultSizes.max_batch, DefaultSizes.batch_wait) == (32, 0.002)
    out = list(runner.map(DefaultSizes(), range(200)))
    assert [x for x, _ in out] == list(range(200))
    sizes = [size for _, size in out]
    assert max(sizes) <= 32 and max(sizes) > 2, sorted(set(sizes))


class EmptiesItsList(Node):
    """Answers each input, then empties the list it was given (to let the inputs go early) or grows it (as
    scratch space): the list is the node's."""

    max_batch = 4

    def __init__(self, how: str):
        self.how = how

    def forward_batch(self, xs, ctx):
        out = [(x, "seen") for x in xs]
        if self.how == "clear":
            xs.clear()
        else:
            xs.append("scratch")
        return Done(out)


def test_a_batching_node_may_change_the_list_it_was_given(runner):
    """The outputs were counted against the list as the node left it: emptied, the Executor's run raised a raw
    TypeError and its map spun for ever, Local said "lost its output (a bug in soma)"; grown, a correct node was
    told it "returned 1 outputs for 2 inputs" (found by a tester)."""
    for how in ("clear", "append"):
        g = Graph.somatize(Pre() >> EmptiesItsList(how))
        assert runner.run(g, 2) == (3, "seen")
        assert list(runner.map(g, range(10), timeout=60)) == [(x + 1, "seen") for x in range(10)]
        assert runner.submit(g, 5).result(timeout=60) == (6, "seen")
