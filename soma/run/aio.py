"""asyncio and futures, for every runner: `submit`, `arun`, `amap`, `async with`.

    runner.submit(g, x)  → a concurrent.futures.Future at once: the input in flight; its outcome is set
                           by whoever receives it (Local: the thread that receives the workers' results)
    await runner.arun(g, x)   the same input, awaited: asyncio.wrap_future, so the outcome reaches the
                              event loop through call_soon_threadsafe (one wake-up of the loop, no thread
                              waiting per input); cancelling the awaiting task cancels the future, which
                              cancels the input (dropped if not started, its result dropped if it was)
    async for y in runner.amap(g, xs)   the same MapLoop as `map` (soma.run.mapping), driven by a
                              coroutine (soma.run.amapping): `xs` may be an async iterable; the
                              in-flight set's `await_wait` waits on the loop

asyncio is imported on first use: `import soma` and a pool's start do not pay for it.

Why call_soon_threadsafe and not an fd the loop watches: the receiving thread already wakes
whoever waits for an outcome; handing it to the loop is one more wake-up either way, and
wrap_future's is the one asyncio (and every future-based library) already knows, cancellation
included.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import weakref

from .amapping import amap_outputs, heavy
from .resuming import DEFAULT_EVERY_S

_TELLING = threading.Lock()  # (one for every InputFuture: a cancel is rare, a lock per future is not free)


class InputFuture(cf.Future):
    """A Future for one input of a runner: `cancel()` also tells the runner it is no longer wanted.

    `on_cancel` is let go as the future ends: what it names (Local's flow, whose sink is this future; the
    Executor's thread-pool future, whose done-callback is) holds the future, and with it its result, in a
    reference cycle: a result the caller dropped lived on, with its /dev/shm, until the cyclic garbage
    collector ran (an idle server kept 380 MiB of dropped responses; in a 64 MiB /dev/shm, requests failed
    SharedMemoryFull blaming results nobody held)."""

    def __init__(self):
        super().__init__()
        self.on_cancel = None  # what cancels the input itself (set by the runner once it is in flight)
        self.told = False  # its cancel was told (to waiters and the runner): by one cancel() of many at once

    def cancels_with(self, on_cancel) -> None:
        """The runner's way to cancel the input, now in flight (it made the future: nobody has cancelled it yet);
        let go at once if the outcome came first (set on the thread that received it)."""
        self.on_cancel = on_cancel
        if self.done():
            self.on_cancel = None

    def set_result(self, result) -> None:
        super().set_result(result)
        self.on_cancel = None

    def set_exception(self, exception) -> None:
        super().set_exception(exception)
        self.on_cancel = None

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        with _TELLING:
            if self.told:
                return True
            self.told = True
        # Nobody else calls set_running_or_notify_cancel on it (no thread pool takes it), and `cf.wait` and
        # `cf.as_completed` count a cancelled future done only once notified: they waited out their timeout.
        # Once only: a second call logs CRITICAL "Future ... in unexpected state" (two threads cancelling).
        self.set_running_or_notify_cancel()
        on_cancel, self.on_cancel = self.on_cancel, None
        if on_cancel is not None:
            on_cancel()
        return True


class FutureSink:
    """Where a runner puts an input's `(index, ok, value)`: into its future (nothing if it was cancelled)."""

    __slots__ = ("future",)

    def __init__(self, future: cf.Future):
        self.future = future

    def put(self, item) -> None:
        _, ok, value = item
        future, self.future = self.future, None  # (set once: a sink left in a traceback's frames keeps nothing)
        if future is None or future.done():
            return
        try:
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        except cf.InvalidStateError:  # cancelled between the look and the set
            pass


class LoopSink:
    """Where a runner puts the outcomes of an `amap`'s inputs: an asyncio queue of the loop that iterates it."""

    def __init__(self):
        import asyncio

        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass

    async def take(self, timeout, wake=None) -> list:
        """What came, at least one item unless `timeout` (seconds) passed first, or `wake` (an asyncio future,
        amap's next input read) was done first."""
        import asyncio

        if wake is not None and self.queue.empty():
            getting = asyncio.ensure_future(self.queue.get())
            try:
                await asyncio.wait((getting, wake), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                getting.cancel()  # (done: nothing; an item it had not taken yet stays queued, as Queue.get says)
            if not getting.done():
                return []
            first = getting.result()
        else:
            try:
                first = await asyncio.wait_for(self.queue.get(), timeout)
            except (asyncio.TimeoutError, TimeoutError):
                return []
        got = [first]
        while not self.queue.empty():
            got.append(self.queue.get_nowait())
        return got


async def arun(runner, g, x, timeout, retries, off_the_loop: bool = False):
    """`await runner.arun(g, x)`: the runner's `submit`, awaited. Cancelling the awaiting task cancels the
    submitted future, which cancels the input. `off_the_loop`: submit on a thread (a large input's copy into
    shared memory would hold the loop: 13-83 ms for 64 MiB here, Dec 7)."""
    import asyncio

    submitting = None
    try:
        if off_the_loop:
            submitting = asyncio.ensure_future(asyncio.to_thread(runner.submit, g, x, timeout=timeout,
                                                                 retries=retries))
            try:
                submitted = await asyncio.shield(submitting)
            except asyncio.CancelledError:  # (submitted meanwhile, or soon: not wanted)
                submitting.add_done_callback(_cancel_submitted)
                raise
        else:
            submitted = runner.submit(g, x, timeout=timeout, retries=retries)
        waiting = asyncio.get_running_loop().create_future()
        submitted.add_done_callback(lambda done: _waker_of(waiting.get_loop()).put(waiting, done))
        try:
            return await waiting
        except asyncio.CancelledError:
            submitted.cancel()
            raise
    finally:  # (an error raised from here holds this frame, which held the error, the future and its input)
        submitting = submitted = waiting = None


def _cancel_submitted(submitting) -> None:
    if not submitting.cancelled() and submitting.exception() is None:
        submitting.result().cancel()


class _LoopWaker:
    """Hands finished futures to one event loop, many per wake-up: the first outcome that finds none pending
    schedules the loop's turn (call_soon_threadsafe: one write to its self-pipe), and the ones that come
    before that turn runs ride along. (asyncio.wrap_future wakes the loop once per future: with a thousand
    requests in flight, outcomes arrive a Result at a time, and the wake-ups were a third of the cost.)"""

    def __init__(self, loop):
        # Weakly: `_wakers` is keyed by the loop, and a value holding its key keeps it for ever (every event loop
        # that awaited an `arun` lived on, 3.5 KiB and, left unclosed, its 3 file descriptors).
        self.loop = weakref.ref(loop)
        self.lock = threading.Lock()
        self.pending: list = []
        self.scheduled = False

    def put(self, waiting, done) -> None:
        with self.lock:
            self.pending.append((waiting, done))
            if self.scheduled:
                return
            self.scheduled = True
        loop = self.loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._settle)
        except RuntimeError:  # the loop is closed: nobody awaits any more (nor will: what waits is let go)
            with self.lock:
                self.pending, self.scheduled = [], False

    def _settle(self) -> None:
        with self.lock:
            pending, self.pending, self.scheduled = self.pending, [], False
        for waiting, done in pending:
            if waiting.done():
                continue  # (its task was cancelled)
            if done.cancelled():
                waiting.cancel()
            elif done.exception() is not None:
                waiting.set_exception(done.exception())
            else:
                waiting.set_result(done.result())


_wakers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def _waker_of(loop) -> _LoopWaker:
    with _wakers_lock:
        waker = _wakers.get(loop)
        if waker is None:
            waker = _wakers[loop] = _LoopWaker(loop)
        return waker


class AsyncRunner:
    """Mixin of every runner: `arun`, `amap` over the runner's `submit` and `_async_inflight`, and
    `async with` (start and close on a thread, so the loop is not blocked while workers start or stop)."""

    async def arun(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """`run(g, x)` without blocking the event loop; cancelling the awaiting task cancels the input."""
        if self._starts_off_the_loop():  # (a pool's start waits for its workers: never on the loop)
            import asyncio

            await asyncio.to_thread(self.start)
        return await arun(self, g, x, timeout, retries, self._submits_off_the_loop(x))

    def _starts_off_the_loop(self) -> bool:
        """Whether `start()` has work to do that `arun` must not do on the event loop (a pool not started yet)."""
        return False

    def _submits_off_the_loop(self, x) -> bool:
        """Whether `submit(g, x)` has work to do that `arun` must not do on the event loop: a large input's copy
        into shared memory, on a runner that copies values to its workers (`heavy`; Ray submits off it always)."""
        return self.copies_nodes and heavy(x)

    def amap(self, g, xs, *, window=None, ordered=True, progress=False, timeout=None, retries=0, errors="raise",
             resume=None, checkpoint=None, checkpoint_every=DEFAULT_EVERY_S):
        """`map` as an async iterator: `async for y in runner.amap(g, xs)`; `xs` may be an async iterable."""
        inflight, graph = self._async_inflight(g, timeout, retries)
        return amap_outputs(inflight, xs, graph=graph, window=window, ordered=ordered, progress=progress,
                            timeout=timeout, errors=errors, resume=resume, checkpoint=checkpoint,
                            checkpoint_every=checkpoint_every, owner=self)

    def _async_inflight(self, g, timeout, retries):
        """`(the in-flight set for an amap of g, the Graph of g)`."""
        raise NotImplementedError

    async def __aenter__(self):
        import asyncio

        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        import asyncio

        await asyncio.to_thread(self.close)
