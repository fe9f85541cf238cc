"""Ray checks of futures and asyncio (run by tests/ray/checks.py in its session): submit and
as_completed, cancel, arun and amap with the answers and errors of run and map, an async iterable, a
cancelled task's input, the event loop while a node runs, `async with`. Each returns what it observed.

Whether an input started is a marker file its node writes first. A `copies = 1` node runs its calls in
the order they were sent, so a probe input sent after the cancelled ones returns only once each of them
has either run or been dropped: waiting for it is the condition, not a sleep.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import tempfile
import threading
import time
from pathlib import Path

import soma
from soma import Done, Graph, Node
from tests.nodes import AddOne, Boom, Double
from tests.ray.checks_tries import DieOnceFor

DEADLINE_S = 60.0


class OneCopyMarkAndSleep(Node):
    """One copy: writes `started-<x>`, then sleeps `seconds` (not for the input "probe")."""

    copies = 1

    def __init__(self, folder, seconds):
        self.folder, self.seconds = str(folder), seconds

    def forward(self, x, ctx):
        if x != "probe":
            Path(self.folder, f"started-{x}").touch()
            time.sleep(self.seconds)
        return Done(x)


class SleepFor(Node):
    def forward(self, x, ctx):
        time.sleep(x)
        return Done(x)


def _started(folder) -> list:
    return sorted(int(name.split("-")[1]) for name in os.listdir(folder) if name.startswith("started-"))


def _wait_for(condition) -> bool:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # polling a condition, with a deadline
    return True


def futures(cluster):
    """submit: futures at once, as_completed, a callback, errors, retries and a timeout through them; and
    cancel(): the cancelled inputs not started never start."""
    out: dict = {}
    one = Graph.somatize(AddOne())  # (each node object has actors of its own: one graph, not one per input)
    submitted = {cluster.submit(one, i): i for i in range(10)}
    out["as_completed"] = sorted([submitted[f], f.result()] for f in cf.as_completed(submitted, timeout=DEADLINE_S))
    called = threading.Event()
    f = cluster.submit(AddOne() >> Double(), 1)
    f.add_done_callback(lambda _: called.set())
    out["callback"] = [f.result(timeout=DEADLINE_S), called.wait(DEADLINE_S)]
    try:
        cluster.submit(Boom(), 1).result(timeout=DEADLINE_S)
    except Exception as err:
        out["error"] = [type(err).__name__, str(err)]
    folder = tempfile.mkdtemp(prefix="soma-submit-")
    out["retried"] = cluster.submit(DieOnceFor(folder, {5}), 5, retries=1).result(timeout=DEADLINE_S)
    sleeper = Graph.somatize(SleepFor())
    cluster.run(sleeper, 0)  # its actor is up: the timeout below stops a running node, not a starting actor
    try:
        cluster.submit(sleeper, 30, timeout=1.0).result(timeout=DEADLINE_S)
    except Exception as err:
        out["timeout"] = [type(err).__name__, str(err)]
    g = Graph.somatize(OneCopyMarkAndSleep(folder, 2.0))
    cluster.run(g, "probe")  # its actor is up: what follows measures cancelling, not starting an actor
    pending = [cluster.submit(g, i) for i in range(6)]
    out["first_started"] = _wait_for(lambda: _started(folder))
    out["cancelled"] = [f.cancel() for f in pending]
    out["probe"] = cluster.run(g, "probe")  # after every cancelled one (one copy, calls in order)
    out["started"] = _started(folder)
    out["threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("ray settler"))
    return out


def asyncio_faces(cluster):
    """arun and amap: the answers and errors of run and map; an async iterable taken lazily; many aruns at
    once and no thread each; the loop ticking while a 0.6 s node runs; retries and timeouts."""
    g = Graph.somatize(AddOne() >> Double())
    one, boom, sleeper = Graph.somatize(AddOne()), Graph.somatize(Boom()), Graph.somatize(SleepFor())
    folder = tempfile.mkdtemp(prefix="soma-arun-")
    cluster.run(sleeper, 0)  # its actor is up: the timeout and the 0.6 s below are the node's, not a start's

    async def go():
        out: dict = {"arun": await cluster.arun(g, 1), "run": cluster.run(g, 1)}
        out["amap"] = [y async for y in cluster.amap(g, range(20))]
        out["amap_unordered"] = sorted([y async for y in cluster.amap(g, range(20), ordered=False)])
        out["map"] = list(cluster.map(g, range(20)))
        taken: list = []

        async def source():
            for i in range(10):
                taken.append(i)
                await asyncio.sleep(0)
                yield i

        lazily = []
        async for y in cluster.amap(one, source(), window=3):
            lazily.append([y, len(taken)])
        out["async_source"] = lazily
        try:
            await cluster.arun(boom, 5)
        except Exception as err:
            out["arun_error"] = [type(err).__name__, str(err)]
        try:
            cluster.run(boom, 5)
        except Exception as err:
            out["run_error"] = [type(err).__name__, str(err)]
        yielded = [y async for y in cluster.amap(boom, [1, 2], errors="yield")]
        out["amap_yield"] = [[type(e).__name__, e.index] for e in yielded]
        try:
            async for _ in cluster.amap(g, [1, 2, "x", 4]):
                pass
        except Exception as err:
            out["amap_raised"] = [type(err).__name__, err.index, str(err)]
        out["arun_retried"] = await cluster.arun(DieOnceFor(folder, {6}), 6, retries=1)
        try:
            await cluster.arun(sleeper, 30, timeout=1.0)
        except Exception as err:
            out["arun_timeout"] = [type(err).__name__, str(err)]
        await cluster.arun(sleeper, 0)  # (its actor was stopped by the timeout: a new one, up)
        before = threading.active_count()
        seen: list = []

        async def watch():
            while True:
                seen.append(threading.active_count())
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        out["many"] = await asyncio.gather(*(cluster.arun(one, i) for i in range(200))) == list(range(1, 201))
        watcher.cancel()
        out["threads"] = [before, max(seen)]
        ticks: list = []

        async def ticker():
            while True:
                await asyncio.sleep(0.02)
                ticks.append(time.monotonic())

        ticking = asyncio.create_task(ticker())
        start = time.monotonic()
        await cluster.arun(sleeper, 0.6)
        end = time.monotonic()
        ticking.cancel()
        out["ticks_during"] = len([t for t in ticks if start <= t <= end])
        return out

    return asyncio.run(go())


def cancelled_task(cluster):
    """Cancelling the task that awaits arun cancels its input: what had not started never starts."""
    folder = tempfile.mkdtemp(prefix="soma-acancel-")
    g = Graph.somatize(OneCopyMarkAndSleep(folder, 2.0))
    cluster.run(g, "probe")

    async def go():
        tasks = [asyncio.create_task(cluster.arun(g, i)) for i in range(6)]
        deadline = time.monotonic() + DEADLINE_S
        while not _started(folder) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(go())
    probe = cluster.run(g, "probe")  # after every cancelled one (one copy, calls in order)
    return {"results": [type(r).__name__ for r in results], "probe": probe, "started": _started(folder)}


def cancel_without_ray_cancel(cluster):
    """The actor's own skip (NodeCopy.forget) keeps cancelled inputs from starting even when Ray's cancel of a
    queued actor call does nothing (it is retried seconds later while the call is on its way: CI saw a
    cancelled future's input start): `ray.cancel` is a no-op here, for futures and awaiting tasks alike."""
    import ray

    folder = tempfile.mkdtemp(prefix="soma-forget-")
    g = Graph.somatize(OneCopyMarkAndSleep(folder, 3.0))  # (the cancels below have 3 s to reach the actor)
    cluster.run(g, "probe")
    real_cancel, ray.cancel = ray.cancel, lambda *args, **kwargs: None
    try:
        pending = [cluster.submit(g, i) for i in range(4)]
        first = _wait_for(lambda: _started(folder))
        cancelled = [f.cancel() for f in pending[1:]]

        async def go():
            tasks = [asyncio.create_task(cluster.arun(g, i)) for i in range(10, 13)]
            await asyncio.sleep(0)  # each task runs up to its first wait: its calls are sent by then
            for task in tasks:
                task.cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(go())
        probe = cluster.run(g, "probe")  # after every cancelled one (one copy, calls in order)
    finally:
        ray.cancel = real_cancel
    return {"first_started": first, "cancelled": cancelled, "results": [type(r).__name__ for r in results],
            "probe": probe, "started": _started(folder)}


class OneCopyGathers(Node):
    """One copy, batching: waits for the file `gate` in `folder` when its batch is the input "block"; else
    returns `out-<x>` for each input."""

    copies = 1
    max_batch = 4
    batch_wait = 0.5

    def __init__(self, folder):
        self.folder = str(folder)

    def forward_batch(self, xs, ctx):
        if xs == ["block"]:
            deadline = time.monotonic() + DEADLINE_S
            while not Path(self.folder, "gate").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return Done([f"out-{x}" for x in xs])


def cancel_in_a_group(cluster):
    """Cancelling one of the runs gathered into one call of a batching node: the others still get their
    outputs (Ray's cancel of one return of the group's task cancelled the task: TaskCancelledError in all)."""
    folder = tempfile.mkdtemp(prefix="soma-gcancel-")
    g = Graph.somatize(OneCopyGathers(folder))
    cluster.run(g, "warm")

    async def go():
        blocker = asyncio.create_task(cluster.arun(g, "block"))  # the one copy, busy until the gate opens
        await asyncio.sleep(0.3)
        tasks = [asyncio.create_task(cluster.arun(g, i)) for i in range(4)]  # one group: max_batch 4
        await asyncio.sleep(0.8)  # (its call sent by then, queued behind the blocker's; before, the same holds)
        tasks[0].cancel()
        Path(folder, "gate").touch()
        got = await asyncio.gather(*tasks, return_exceptions=True)
        return [type(got[0]).__name__, *got[1:]], await blocker

    got, blocked = asyncio.run(asyncio.wait_for(go(), DEADLINE_S))
    return {"got": got, "blocked": blocked, "next": cluster.run(g, 9)}


class SlowUntilGate(Node):
    """Writes `started-<x>`; for the input "slow", then waits for the file `gate` in `folder`."""

    def __init__(self, folder):
        self.folder = str(folder)

    def forward(self, x, ctx):
        Path(self.folder, f"started-{x}").touch()
        deadline = time.monotonic() + DEADLINE_S
        while x == "slow" and not Path(self.folder, "gate").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return Done(x)


def cancel_while_running(cluster):
    """An arun cancelled while its node runs: Ray cannot stop the call, so its copy stays busy until it ends;
    the next run goes to another copy, not behind it (it waited for its timeout: the book gave the cancelled
    run's load back at once)."""
    folder = tempfile.mkdtemp(prefix="soma-crun-")
    g = Graph.somatize(SlowUntilGate(folder))
    cluster.run(g, "warm")

    async def go():
        task = asyncio.create_task(cluster.arun(g, "slow"))
        deadline = time.monotonic() + DEADLINE_S
        while not Path(folder, "started-slow").exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        task.cancel()
        return type((await asyncio.gather(task, return_exceptions=True))[0]).__name__

    cancelled = asyncio.run(go())
    try:
        after = cluster.run(g, "next", timeout=DEADLINE_S / 2)
    except soma.RunTimeout as err:
        after = f"RunTimeout: {err}"
    still_running = not Path(folder, "gate").exists()  # (the slow one is still in its node: it was not waited for)
    Path(folder, "gate").touch()
    return {"cancelled": cancelled, "after": after, "while_slow_ran": still_running}


def async_with(_cluster):
    """`async with soma.Ray()` starts and closes off the loop (here in the session already up, which it
    leaves running)."""
    import ray

    async def go():
        async with soma.Ray() as cluster:
            value = await cluster.arun(AddOne(), 1)
        return cluster, value

    cluster, value = asyncio.run(go())
    try:
        cluster.run(AddOne(), 1)
        closed = None
    except soma.SomaError as err:
        closed = str(err)
    return {"value": value, "closed": closed, "session_up": ray.is_initialized()}


ASYNC_CHECKS = [futures, asyncio_faces, cancelled_task, cancel_without_ray_cancel, cancel_in_a_group,
                cancel_while_running, async_with]
