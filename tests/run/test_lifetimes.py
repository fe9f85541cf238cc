"""What a caller lets go of dies then, on every runner, with Python's cyclic garbage collector off: an idle server's
collector may not run for minutes, and what a reference cycle keeps (an input, a result, its /dev/shm, a model's
weights, GPU memory) is invisible to it. Found by a tester hunting cycles with `gc.disable()` (Dec 7): an error
raised from a local variable, a future and its cancel hook, a map's loop and its failure, an input's flow and its
jobs, each event loop that awaited an `arun`; on Ray, a submission and the batch list that holds it, the
settler waiting with the last input in its locals, a try's watched futures whose callbacks held the try."""

import asyncio
import gc
import weakref

import pytest

from soma import Done, Graph, Node, NodeError, WorkerDied
from tests.conftest import wait_for

np = pytest.importorskip("numpy")
pytestmark = pytest.mark.timeout(120)


class FailsOnOdd(Node):
    """Returns its (numpy) input, except where its first value is odd: ValueError."""

    def forward(self, x, ctx):
        if int(x[0]) % 2:
            raise ValueError(f"odd {int(x[0])}")
        return Done(x)


class Slowly(Node):
    """Returns its input after a while: a moment to give up on it while it runs."""

    def forward(self, x, ctx):
        import time

        time.sleep(0.3)
        return Done(x)


class DiesFirst(Node):
    """Ends its own process (a worker's, an actor's) the first time it runs, marked by the file `flag`."""

    def __init__(self, flag: str):
        self.flag = flag

    def forward(self, x, ctx):
        import os

        if not os.path.exists(self.flag):
            open(self.flag, "w").close()
            os._exit(3)
        return Done(x)


class BatchFailsOnOdd(Node):
    max_batch = 4

    def forward_batch(self, xs, ctx):
        if any(int(x[0]) % 2 for x in xs):
            raise ValueError("an odd one in the batch")
        return Done(list(xs))


def _big(value: int):
    return np.full(1 << 17, float(value))  # 1 MiB: through /dev/shm on Local


@pytest.fixture
def no_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _all_die(refs: list, what: str) -> None:
    wait_for(lambda: all(ref() is None for ref in refs), 20, f"{what} to die without the garbage collector")


def test_an_input_whose_run_raised_dies_with_its_error(runner, no_gc):
    """`raise value` from a local: the error's traceback held the frame that held the error."""
    refs = []
    for graph in (Graph.somatize(FailsOnOdd()), Graph.somatize(FailsOnOdd() | FailsOnOdd()),
                  Graph.somatize(BatchFailsOnOdd())):
        x = _big(1)
        refs.append(weakref.ref(x))
        with pytest.raises(NodeError, match="odd"):
            runner.run(graph, x)
        del x
    _all_die(refs, "inputs of failed runs")


def test_a_failed_submit_or_arun_lets_go_of_its_future_and_input(runner, no_gc):
    async def handler(x):  # (a server's: the error caught where it is awaited; one raised out of asyncio.run is
        try:  # held by asyncio's own cycle, its runner's frame and task)
            return await runner.arun(FailsOnOdd(), x)
        except NodeError as err:
            return str(err)

    refs = []
    x = _big(3)
    refs.append(weakref.ref(x))
    with pytest.raises(NodeError, match="odd"):
        runner.submit(FailsOnOdd(), x).result(timeout=60)
    x = _big(5)
    refs.append(weakref.ref(x))
    assert "odd 5" in asyncio.run(handler(x))
    del x
    _all_die(refs, "inputs of a failed submit and arun")


def test_a_map_that_raised_lets_go_of_its_inputs_and_outputs(runner, no_gc):
    """The map's loop kept its failure, whose traceback held the generator's frame, which held the loop: every
    output in its window and the whole `xs` stayed (on Local, 105 MiB of /dev/shm for a window of 8 MiB ones)."""
    refs = []
    for ordered in (True, False):
        xs = [_big(2 * i) for i in range(6)] + [_big(7)] + [_big(2 * i) for i in range(6)]
        refs += [weakref.ref(x) for x in xs]
        with pytest.raises(NodeError, match="odd 7"):
            for y in runner.map(FailsOnOdd(), xs, ordered=ordered):
                refs.append(weakref.ref(y))
        del xs, y
    _all_die(refs, "a failed map's inputs and outputs")


def test_event_loops_that_awaited_arun_die(runner):
    """Each loop stayed for the life of the process (a WeakKeyDictionary whose value held its key)."""
    loops = []

    async def one():
        loops.append(weakref.ref(asyncio.get_running_loop()))
        return await runner.arun(FailsOnOdd(), _big(2))

    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            assert asyncio.run(one())[0] == 2.0
        _all_die(loops, "event loops")
    finally:
        gc.enable()


def test_an_amap_cancelled_while_its_inputs_run_lets_go_of_them(runner, no_gc):
    """The Executor's amap wrapped each running input's future at each wait (asyncio.wrap_future): a copy left
    pending as its loop ended held its future, which held it and the input's output (its input, here)."""
    refs = []

    async def cancelled_amid():
        xs = [_big(2 * i) for i in range(8)]
        refs.extend(weakref.ref(x) for x in xs)

        async def consume(xs):
            async for y in runner.amap(Slowly(), xs):
                refs.append(weakref.ref(y))
                del y

        task = asyncio.ensure_future(consume(xs))
        del xs
        await asyncio.sleep(0.05)  # (its first inputs are out: they run, or wait for a worker or a thread)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_amid())
    _all_die(refs, "the inputs of an amap cancelled while they ran")


def test_an_input_whose_worker_died_dies_with_its_error_or_its_retry(runner, no_gc, tmp_path):
    """On Ray, its error was raised from a local of Ray's own frame, whose traceback held the driver's frames
    and with them the input's submission and value."""
    if not runner.copies_nodes:
        pytest.skip("the Executor runs nodes in the caller's process: no worker to lose")
    refs = []
    x = _big(4)
    refs.append(weakref.ref(x))
    with pytest.raises(WorkerDied):
        runner.run(DiesFirst(str(tmp_path / "once")), x)
    x = _big(6)
    refs.append(weakref.ref(x))
    y = runner.run(DiesFirst(str(tmp_path / "again")), x, retries=1)
    assert y[0] == 6.0
    refs.append(weakref.ref(y))
    del x, y
    _all_die(refs, "inputs whose worker died")
