"""What a run returned belongs to the caller: held results stay intact whatever runs next.

Every test holds many results at once and checks every value at the end: a segment
reused while somebody still sees it shows up as a wrong value, never as an error.
"""

import os
import signal

import pytest

torch = pytest.importorskip("torch")

import soma  # noqa: E402
from soma import Done, Graph, Node, WorkerDied  # noqa: E402
from soma.wire.codec import INLINE_LIMIT  # noqa: E402
from tests.conftest import in_threads, shm_names, wait_for  # noqa: E402
from tests.nodes import Die, Fill, Identity, PlusOne, in_segment  # noqa: E402

pytestmark = pytest.mark.timeout(120)

SIZES = {  # bytes of float32: every class the transport treats differently
    "inline": 4 * 1024,
    "small-segment": 64 * 1024,
    "256KiB": 256 * 1024,
    "4MiB": 4 << 20,
}
HELD = 12


def numel(size: str) -> int:
    return SIZES[size] // 4


def all_equal(t, value) -> bool:
    return bool((t == value).all())


@pytest.mark.parametrize("through_ctx", [False, True], ids=["heap", "ctx.empty"])
@pytest.mark.parametrize("size", list(SIZES))
def test_results_of_one_node_stay_intact(local, size, through_ctx):
    g = Graph.somatize(Fill(numel(size), through_ctx))
    held = [local.run(g, i) for i in range(HELD)]
    assert SIZES[size] < INLINE_LIMIT or in_segment(held[0])
    assert [float(t[0]) for t in held] == [float(i) for i in range(HELD)]
    assert all(all_equal(t, i) for i, t in enumerate(held))
    assert len({t.data_ptr() for t in held}) == HELD


@pytest.mark.parametrize("through_ctx", [False, True], ids=["heap", "ctx.empty"])
@pytest.mark.parametrize("size", ["inline", "256KiB", "4MiB"])
def test_results_of_a_wave_and_a_join_stay_intact(local, size, through_ctx):
    n = numel(size)
    wave = Graph.somatize(Fill(n, through_ctx) | Fill(n, through_ctx))
    join = Graph.somatize((Fill(n, through_ctx) | Fill(n, through_ctx)) >> Identity())
    summed = Graph.somatize((Fill(n, through_ctx) | Fill(n, through_ctx)) >> PlusOne())
    held = [(local.run(wave, i), local.run(join, i), local.run(summed, i)) for i in range(HELD)]
    for i, ((a, b), (c, d), e) in enumerate(held):
        assert all(all_equal(t, i) for t in (a, b, c, d)), i
        assert all_equal(e, 2 * i + 1), i


def test_results_held_by_several_threads_at_once(local):
    graphs = [Graph.somatize(Fill(numel("256KiB"), through_ctx)) for through_ctx in (False, True)]
    graphs.append(Graph.somatize(Fill(numel("4MiB")) | Fill(numel("small-segment"))))

    def go(k):
        return [(value, local.run(graphs[i % len(graphs)], value)) for i in range(20) for value in [k * 1000 + i]]

    held = in_threads(go, 4)
    for mine in held:
        for value, out in mine:
            for t in out if isinstance(out, tuple) else (out,):
                assert all_equal(t, value), value


def test_results_survive_the_death_of_the_worker_that_made_them(local):
    g = Graph.somatize(Fill(numel("4MiB")) | Fill(numel("256KiB"), through_ctx=True))
    held = [local.run(g, i) for i in range(4)]
    victim = local.pids()[0]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDied):  # the killed worker, or the one Die kills: either way WorkerDied
        local.run(Graph.somatize(Die(code=3)), 0)
    held += [local.run(g, i) for i in range(4, 8)]
    for i, (a, b) in enumerate(held):
        assert all_equal(a, i) and all_equal(b, i), i


def test_an_input_the_caller_changes_after_sending_does_not_change_held_results(local):
    g = Graph.somatize(PlusOne())
    x = torch.zeros(numel("4MiB"))
    held = []
    for i in range(6):
        held.append(local.run(g, x))  # a heap input is copied into shared memory: the result is new memory
        x.fill_(i + 1)  # the caller reuses its buffer
    assert [float(t[0]) for t in held] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    first = local.run(Graph.somatize(Fill(numel("4MiB"))), 7)
    echoed = local.run(Graph.somatize(Identity()), first)  # a result sent back travels by name: the same memory
    assert echoed.data_ptr() != 0 and all_equal(echoed, 7)
    again = local.run(Graph.somatize(PlusOne()), first)
    first.fill_(-1)  # the caller writes into what it holds: only its own view of that memory changes
    assert all_equal(again, 8) and all_equal(echoed, -1)


def test_results_held_across_a_map_stay_intact(local):
    g = Graph.somatize(Fill(numel("256KiB")) >> PlusOne())
    held = list(local.map(g, range(40)))
    assert all(all_equal(t, i + 1) for i, t in enumerate(held))


class EchoAndMake(Node):
    """`(its input, a new 256 KiB tensor of -1)` after a short wait: the new tensor is made in the worker
    that runs it, which may own the segment its input lives in."""

    def forward(self, x, ctx):
        import time

        import torch

        time.sleep(0.005)  # long enough that jobs queue on the host once the map has measured the node
        return Done((x, torch.full((numel("256KiB"),), -1.0)))


def test_an_input_only_the_map_holds_stays_intact_while_its_job_waits_for_a_worker(local):
    # Results fed back into a map that is their only holder: once a job waits on the host for a worker,
    # its input must stay held until it is sent (its segment must not be freed and reused meanwhile).
    g = Graph.somatize(EchoAndMake())
    list(local.map(g, [torch.zeros(4)] * 8))  # measured: the node is slower than a round trip, so jobs queue
    results = [local.run(Graph.somatize(Fill(numel("256KiB"))), i) for i in range(24)]

    def source():
        while results:
            yield results.pop(0)  # from here on only the map holds it

    held = list(local.map(g, source(), window=24))
    for i, (echoed, made) in enumerate(held):
        assert all_equal(echoed, i), i
        assert all_equal(made, -1), i


class SlowFirst(Node):
    """Its input's first value, a little slowly (inputs queue at the workers behind it)."""

    def forward(self, x, ctx):
        import time

        time.sleep(0.01)
        return Done(float(x[0]))


class MakeArray(Node):
    def forward(self, x, ctx):
        import numpy as np

        return Done(np.full(1 << 17, float(x)))  # 1 MiB, made in the worker: its segment


def test_inputs_dropped_unstarted_at_a_worker_give_back_their_segments():
    """A map left with `break` (or inputs cancelled, given back, whose code cannot load): a worker drops what it
    had not started without decoding it, and never reported the segments the host lent with it: counted as held
    by that worker until it ended, they were never freed (the host's own never reused): the pool's /dev/shm grew
    7, 10, 19 MiB over three such maps of 1 MiB inputs (found by a tester hunting leaks)."""
    import numpy as np

    with soma.Local(workers=2, arena=1 << 20) as local:  # (a small arena: a freed segment is unlinked, not kept)
        prefix = local.start().snapshot().shm_prefix

        def pool_mib() -> float:
            return sum(os.stat(os.path.join("/dev/shm", n)).st_size for n in shm_names(prefix)) / 2 ** 20

        for round_ in range(4):
            made = list(local.map(MakeArray(), range(20)))  # (worker-owned inputs: the host lends them on)
            xs = made + [np.full(1 << 17, float(i)) for i in range(20)]  # (and the host's own)
            for y in local.map(SlowFirst(), xs):
                break
            del made, xs, y
            assert list(local.map(SlowFirst(), [np.zeros(4)] * 8)) == [0.0] * 8  # (the workers talk: releases)
        wait_for(lambda: pool_mib() <= 3, 30, "the dropped inputs' segments to be freed")


class LoadsNowhere(Node):
    """A node whose copies cannot be made in a worker (its unpickling raises there)."""

    def __getstate__(self):
        return {"made_in": os.getpid()}

    def __setstate__(self, state):
        if os.getpid() != state["made_in"]:
            raise RuntimeError("this node cannot be loaded in another process")
        self.__dict__.update(state)

    def forward(self, x, ctx):
        return Done(x)


def test_inputs_of_a_node_that_cannot_load_give_back_their_segments():
    """Its piece does not load, so its input is never decoded: what the host lent with it was never let go."""
    import numpy as np

    with soma.Local(workers=2, arena=1 << 20) as local:
        prefix = local.start().snapshot().shm_prefix
        for i in range(6):
            with pytest.raises(soma.NodeError, match="its code could not be loaded"):
                local.run(LoadsNowhere(), np.full(1 << 17, float(i)))
        assert list(local.map(Identity(), [1, 2, 3, 4])) == [1, 2, 3, 4]  # (the workers talk: releases)

        def pool_mib() -> float:
            return sum(os.stat(os.path.join("/dev/shm", n)).st_size for n in shm_names(prefix)) / 2 ** 20

        wait_for(lambda: pool_mib() <= 3, 30, "the undecoded inputs' segments to be freed")
