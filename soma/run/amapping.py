"""`async for y in runner.amap(g, xs)`: `map`'s loop (soma.run.mapping) driven by a coroutine, for every runner.

    xs (async) ──Pump, a task: reads while it holds less than the room──▶ items ──take, no wait──▶ loop.start
    caller ◀──yield, as map does── loop.outputs() ◀── inflight.await_wait(timeout, wake=the pump's next item)

An async `xs` is read by a pump, a task of its own, so that a source that is slow to give its next input
(a queue of requests, a socket) holds nothing else up: an input that has come starts at once if the window
has room for it, an output that is ready is handed out meanwhile, and a source that gives its next input only
once the caller has an output (a conversation) goes on. Awaited on the driver itself, the source's next
input held the map: it took a whole window's worth before starting any (a trickling source ran nothing until
it ended; a conversation never went on).

Why one pump per map, not a task per input: a source that never waits (a generator over a list) is read by
the pump in one go, as the driver read it, with no task switch per input. The pump reads only as far as the
map has room (`want`): never more inputs taken than `window` ahead of the caller, as in `map`. What it costs
is one turn of the event loop each time room frees and nothing is read yet (~2 µs: a window of 2, as the
Executor's for one node, pays it once an input; Local's window of thousands, once a window).

Why the runner's wait takes `wake` and is not raced with the pump as a task: what ends the wait early is the
wait itself, at its one safe point; a task left waiting while the driver starts more inputs, or cancelled
after it took outcomes, would meet the runner's books in the middle (Ray concludes a batch on a thread).

asyncio is imported on first use: `import soma` does not pay for it.
"""

from __future__ import annotations

from .mapping import MapLoop, opened
from .resuming import aremaining, remaining


def amap_outputs(inflight, xs, **options) -> "AsyncMapIterator":
    """The async iterator behind every runner's `amap`; `inflight` has an `await_wait(timeout, wake)`;
    `options` are MapLoop's, as `map_outputs`'s. `xs` may be an async iterable."""
    loop, source = opened(inflight, xs, lambda loop: _source(xs, loop), **options)
    cut: list = []  # (_adrive appends to it when a cancel ends it)
    return AsyncMapIterator(_adrive(loop, source, cut), loop, cut)


def _source(xs, loop: MapLoop):
    """amap's inputs, from where `loop` starts: an async iterable's (a TypeError now, not at the first turn),
    or a plain one's."""
    if hasattr(xs, "__aiter__"):
        source = xs.__aiter__()
        if loop.next_index or loop.after_start:
            source = aremaining(source, loop.next_index, loop.after_start)
        return source
    return remaining(xs, loop.next_index, loop.after_start)


class AsyncMapIterator:
    """What `runner.amap` returns: `async for` over the outputs, and `state_dict()` as `map`'s."""

    __slots__ = ("_outputs", "_loop", "_cut")

    def __init__(self, outputs, loop: MapLoop, cut: list):
        self._outputs, self._loop, self._cut = outputs, loop, cut

    def __aiter__(self):
        return self

    def __anext__(self):
        if self._cut:
            return self._cut_off()
        if self._loop.stepping is None:
            return self._outputs.__anext__()
        return self._stepped()

    async def _cut_off(self):
        """The next output of a map a cancel ended while it waited for one (`asyncio.wait_for(it.__anext__(),
        ...)` whose time ran out, a cancel caught and the iteration taken up again): its end, said, where the
        generator would end the `async for` as if every output had come (20 inputs lost without a word)."""
        from ..errors import SomaError

        raise SomaError("this amap was cancelled while it waited for its next output (a timeout around "
                        "`__anext__`, a task's cancel): it was closed then, and what it had in flight dropped; "
                        "wait for outputs without cancelling the wait (asyncio.wait with a timeout, or "
                        "asyncio.shield), or start a new amap (`resume=` its state_dict() goes on from there)")

    async def _stepped(self):
        """The next output of a map with a checkpoint, its `stepping` lock held meanwhile (mapping.save_open).
        Never waited for on the event loop's thread: held by another task stepping it, or by its closing runner
        saving (a moment), it is tried again after a millisecond, the loop going on meanwhile."""
        stepping = self._loop.stepping
        while not stepping.acquire(blocking=False):
            import asyncio

            await asyncio.sleep(0.001)
        try:
            return await self._outputs.__anext__()
        finally:
            stepping.release()

    def state_dict(self) -> dict:
        """As `map(...).state_dict()`: the outputs consumed so far, as plain data, for `resume=`."""
        return self._loop.state(held=True)

    async def aclose(self) -> None:
        """Leave the map early (as `break` out of `async for` and dropping it do)."""
        await self._outputs.aclose()
        self._loop.close()  # (a map never iterated has no frame to close it)


async def _adrive(loop: MapLoop, source, cut: list):
    pump = None
    try:
        await loop.inflight.ready()
        if hasattr(source, "__anext__"):
            pump = Pump(source)
        while True:
            wanted = loop.wanted()
            if wanted:
                await _start(loop, pump.take(wanted, loop) if pump is not None else _take_plain(source, wanted, loop))
            outputs = loop.outputs()
            try:
                for value in outputs:
                    yield value
            finally:
                outputs.close()  # left at a yield: the output held there is marked so (see MapLoop.outputs)
            if loop.over():
                return
            if pump is not None:
                await _await_turn(loop, pump)
            elif loop.must_wait():
                loop.finished(await loop.inflight.await_wait(loop.wait_s()))
    except BaseException as exc:
        if type(exc).__name__ == "CancelledError":  # (asyncio's, imported by now: its next step says so)
            cut.append(True)
        raise
    finally:
        try:
            if pump is not None:
                await pump.close()
        finally:
            loop.close()


HEAVY_BYTES = 1 << 20  # an input's buffers from which `arun` submits it, and an amap starts it, on a thread


def heavy(x) -> bool:
    """Whether `x` holds HEAVY_BYTES or more of arrays, tensors or bytes, loose or in a list, tuple or dict (one
    level: what a request carries): copying them into shared memory costs more than a thread's hand-off (about
    0.25 ms a MiB here, against ~0.1 ms)."""
    kind = type(x)
    if kind is dict:
        items = list(x.values())[:64]
    elif kind is list or kind is tuple:
        items = x[:64]
    else:
        items = (x,)
    total = 0
    for item in items:
        size = len(item) if type(item) is bytes or type(item) is bytearray else getattr(item, "nbytes", 0)
        total += size if type(size) is int else 0
    return total >= HEAVY_BYTES


async def _start(loop: MapLoop, items: list) -> None:
    """Start `items`; on a thread when they hold large buffers their runner copies as they start (arun's rule,
    `heavy`: eight 64 MiB arrays held the loop up to 0.8 s), the map closed only once they are started."""
    if not (items and loop.inflight.copies_inputs and heavy(items)):
        loop.start(items)
        return
    import asyncio

    started = asyncio.ensure_future(asyncio.to_thread(loop.start, items))
    try:
        await asyncio.shield(started)
    except asyncio.CancelledError:
        await asyncio.wait([started])
        raise


async def _await_turn(loop: MapLoop, pump: "Pump") -> None:
    """Wait until the map of an async source can go on: its next input read (with room for it), or an outcome
    from the runner, whichever comes first; only an outcome when the window is full."""
    wanted = loop.wanted()
    if wanted:
        if pump.items or pump.ended:
            return  # taken on the next turn
        if pump.paused:
            pump.read(wanted)
            import asyncio

            # Its turn first: a source that need not wait (a generator over a list) is read now, and what it
            # read starts here, without a wait on the runner that the pump would end at once.
            await asyncio.sleep(0)
            if not pump.items:
                return
            await _start(loop, pump.take(wanted, loop))
            wanted = loop.wanted()
            if wanted and (pump.items or pump.ended):
                return
        if not loop.pending:
            await pump.arrival()  # (nothing in flight: only the source moves the map)
            return
    elif not loop.pending:
        return
    loop.finished(await loop.inflight.await_wait(loop.wait_s(), pump.arrival() if wanted else None))


def _take_plain(source, wanted: int, loop: MapLoop) -> list:
    """Up to `wanted` inputs from a plain iterator; its end, or its own exception, is told to the loop."""
    items = []
    while len(items) < wanted:
        try:
            x = next(source)
        except StopIteration:
            loop.source_ended()
            break
        except Exception as exc:
            loop.source_ended(exc)
            break
        items.append(x)
    return items


class Pump:
    """An async iterator read in a task of its own into `items`, while they are fewer than `want` (the room the
    map had for them when it last took some): `take` hands them over without waiting, `arrival` wakes the driver
    as the next one comes. Its end, or its own exception, is told to the map once every item before it is taken."""

    def __init__(self, source):
        import asyncio

        self.items: list = []
        self.want = 0  # read on while fewer than this are held
        self.ended = False  # the source ended: `error` is what it raised, if anything
        self.error = None
        self.told = False  # its end was told to the map
        self.closing = False
        self._room = None  # what the pump waits on while it holds `want` (a future)
        self._arrived = None  # what the driver waits on: done as an item is read or the source ends (a future)
        self.task = asyncio.get_running_loop().create_task(self._pump(source), name="soma amap source")

    async def _pump(self, source) -> None:
        import asyncio

        anext, loop = source.__anext__, asyncio.get_running_loop()
        try:
            while True:
                while len(self.items) >= self.want:
                    self._room = loop.create_future()
                    await self._room
                item = await anext()
                self.items.append(item)  # (looked up after the wait: `take` may have swapped the list meanwhile)
                if self._arrived is not None:
                    self._wake()
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError as exc:
            if self.closing:
                raise
            self.error = exc  # the source's own (not the map leaving): it ends the map as its other errors do
        except Exception as exc:
            self.error = exc
        finally:
            self.ended = True
            self._wake()

    @property
    def paused(self) -> bool:
        """Whether the pump waits for room (not for the source)."""
        return self._room is not None and not self._room.done()

    def read(self, want: int) -> None:
        """Read on until `want` are held."""
        self.want = want
        if len(self.items) < want and self.paused:
            self._room.set_result(None)

    def take(self, wanted: int, loop: MapLoop) -> list:
        """Up to `wanted` of the items read, at once; then read on as far as the room left (`wanted` less those
        taken). The source's end is told to `loop` once none is left before it."""
        items = self.items
        if len(items) <= wanted:
            taken, self.items = items, []
        else:
            taken, self.items = items[:wanted], items[wanted:]
        self.read(wanted - len(taken))
        if self.ended and not self.items and not self.told:
            self.told = True
            error, self.error = self.error, None  # (its traceback holds the pump's frame, which holds the pump)
            loop.source_ended(error)
        return taken

    def arrival(self):
        """A future done once the next item is read or the source ends (at once if one is held or it ended)."""
        arrived = self._arrived
        if arrived is None:
            import asyncio

            arrived = self._arrived = asyncio.get_running_loop().create_future()
            if self.items or self.ended:  # (nothing else would wake it)
                self._wake()
        return arrived

    def _wake(self) -> None:
        arrived, self._arrived = self._arrived, None
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    async def close(self) -> None:
        """The map is over: the pump stops (cancelled, within the source if it is waiting there), and is waited
        for, so that nothing of the map runs after it."""
        self.closing = True
        if not self.task.done():
            import asyncio

            self.task.cancel()
            await asyncio.wait((self.task,))
