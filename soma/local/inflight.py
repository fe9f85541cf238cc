"""Local's in-flight set for `map` and `amap` (soma.run.mapping drives it): flows on the host's loop, their
outcomes in one sink; a map's cheap inputs start in chunks (host/chunks.py)."""

from __future__ import annotations

import queue
from bisect import bisect_right

from ..errors import RunTimeout
from ..run.aio import LoopSink
from ..run.mapping import Inflight
from ..wire.room import shm_room
from .host.chunks import AHEAD, even_chunks
from .host.flows import Chunk
from .host.loop import HostLoop
from .host.program import pieces

SWEEP_AT = 1024  # a map's books of its flows are swept of ended chunks once they hold this many (see _popped)


class LocalInflight(Inflight):
    """Local's in-flight set for map: flows on the host's loop, their outcomes in one queue."""

    def __init__(self, loop: HostLoop | None, g, program, tracer, timeout, retries: int, asynchronous: bool = False,
                 attach=None):
        # loop None: an amap's, on a pool not started yet; `attach()` starts it and gives its loop (`ready`)
        self.loop, self.program, self.timeout, self.attach = loop, program, timeout, attach
        self.graph = g  # its nodes must live while the map does (their code is shipped by their key)
        self.retries = retries
        self.tracer = tracer  # whose trace block, if any, each input is recorded in when it starts
        self.pieces = pieces(program)  # (asked for at every turn of the map: found once)
        # amap: outcomes go to the event loop (made at the first start, in the loop); map: to a queue the
        # iterating thread receives on
        self.sink = None if asynchronous else queue.SimpleQueue()
        self.flows: dict = {}  # index → Flow (a chunk's first index → its Chunk) not yet seen to end
        self.sweep_at = SWEEP_AT
        # Cheap inputs travel in chunks (host/chunks.py): a program of one piece with no batching node (a
        # chunk's inputs run one after another at one worker; each keeps its own retries, timeout and spans).
        one = self.pieces[0] if len(self.pieces) == 1 and self.pieces[0] is program else None
        self.chunked = one if one is not None and not one.batch else None
        # With a timeout, `expire` finds an input's chunk by bisection: the chunks started, in the order of
        # their first index (those that ended are swept once as many again were started).
        self.chunk_firsts: list = []
        self.chunk_list: list = []
        self.sweep_chunks_at = SWEEP_AT
        self.workers = len(tracer.worker_devices)
        # Until an output is measured: a worker's worth each (a batching node's: a full batch, so its first calls
        # are full ones; a map's first inputs were all placed in one go, and bundles cut small then stay small).
        self.first = self.workers * max([1] + [piece.batch for piece in self.pieces])
        self.held_back = None  # the window is bound by memory (room): True, False once measured
        self.shm_total = shm_room()[1]  # (room: what the window's values may take of /dev/shm at most)
        if loop is not None:
            loop.map_open(self, True)

    copies_inputs = True

    async def ready(self) -> None:
        if self.sink is None:  # (made on the event loop: `start` may run on a thread, amapping._start)
            self.sink = LoopSink()
        if self.loop is None:
            import asyncio

            self.loop = await asyncio.to_thread(self.attach)  # (the pool starts: its workers' hellos are awaited)
            self.loop.map_open(self, True)

    def parallelism(self) -> int:
        most = self.loop.parallelism(self.pieces)
        if self.chunked is not None:
            most = max(most, self.workers * AHEAD * self.loop.chunk(self.chunked))
        return most

    def room(self, arrived: int) -> int | None:
        """The map's back-pressure by memory (SPEC 7.2): its window holds no more inputs than /dev/shm has room
        for, by what one was measured to take there on its way (each piece's output, and its input's copy).
        The room is /dev/shm's size less what the caller's results outside the window hold (what the host
        maps, less the outputs that arrived and wait in the window: `arrived`; at least the one output the
        caller works on); not /dev/shm's free room now, which lags behind the frees the workers have not heard
        of yet (measured: taking by it ran the 20 MiB map of `soma bench shm` at a third of its speed). Until
        the first output is measured, one input per worker (a full batch per worker for a batching node);
        None when they take no room there (small values travel in the message), or when what the caller keeps
        leaves less than an eighth of /dev/shm (the window is then as wide as without memory: see below)."""
        per_input, per_output = self.loop.shm_measures(self.pieces)
        if per_input is None:
            return arrived + self.first
        if not per_input:
            return None
        # (an output that arrived holds its own room only: its input's copy was freed as it came; at least one
        # output is the caller's: the one it holds now, or the next one it takes from the window)
        received = self.loop.shm_received()
        outside = max(per_input, received - arrived * per_output)
        # Held back while the caller's results leave room to count. Once what they hold outside the window leaves
        # less than an eighth of /dev/shm, the frees a worker would wait for are not coming: what finds no room
        # goes to disk after a short wait (room_wait_s), in a window as wide as without memory, not one input at
        # a time after a 2 s wait each (measured: 1,100 outputs of 40 KiB kept at 64 MiB, see docs/local.md's
        # failure table). (The eighth: what processes keep for reuse, and the input copies in flight, are not
        # counted; the last inputs' room waited 2 s each for them without it.) Held back again once what the
        # host maps, window and all, leaves that room: not by what the caller keeps, for outputs that went to disk
        # are not in what the host maps, yet they are among the `arrived`. (What the caller keeps is counted low
        # here, each arrived output taking a whole input's room: a program whose pieces' outputs differ in size
        # has `per_output` of its smallest, and must not stop being held back by a window of large ones.)
        kept = received - arrived * per_input
        held = (received if self.held_back is False else kept) + (self.shm_total >> 3) <= self.shm_total
        if held != self.held_back:  # (start tells the workers of what was freed first: see HostLoop.flush_frees;
            self.held_back = held  # a worker short of the room counted waits for those frees: map_held_back)
            self.loop.map_held_back(self, held)
        return max(0, self.shm_total - outside) // per_input if held else None

    def start(self, indices: list, xs: list) -> None:
        if self.sink is None:
            self.sink = LoopSink()
        if self.held_back:
            self.loop.flush_frees()
        trace = self.tracer.current_trace
        if self.chunked is not None and len(xs) > 1:
            size = even_chunks(len(xs), self.loop.chunk(self.chunked), self.workers)
            if size > 1:
                started = self.loop.start_chunks(self.program, indices, xs, self.sink, self.graph, size, self.retries,
                                                 trace)
                self.flows.update(started)
                if self.timeout is not None:
                    self._keep_chunks(started)
                return
        self.flows.update(self.loop.start_inputs(self.program, zip(indices, xs), self.sink, trace, self.retries,
                                                 self.graph))

    def _popped(self, got: list) -> None:
        flows = self.flows
        for index, _, _ in got:
            flow = flows.pop(index, None)
            if type(flow) is Chunk and not flow.finished:  # (a part of it: the rest is open, and `close` cancels it)
                flows[index] = flow
        if len(flows) > self.sweep_at:  # chunks whose inputs ended in parts (failures) are not popped above
            self.flows = {index: flow for index, flow in flows.items() if not flow.finished}
            self.sweep_at = max(SWEEP_AT, 2 * len(self.flows))

    def wait(self, timeout):
        try:
            got = [self.loop.await_item(self.sink, timeout)]
        except queue.Empty:
            return []
        take = self.loop.take_nowait
        item = take(self.sink)
        while item is not None:
            got.append(item)
            item = take(self.sink)
        self._popped(got)
        return got

    async def await_wait(self, timeout, wake=None):
        got = await self.sink.take(timeout, wake)
        self._popped(got)
        return got

    def expire(self, index: int) -> BaseException:
        return self.expire_all([index])[0]

    def expire_all(self, indices: list) -> list:
        """Each input's flow (or its chunk and place there), stopped together (HostLoop.expire)."""
        stopping, errors = [], {}
        for index in indices:
            flow = self.flows.get(index)
            if flow is not None and type(flow) is not Chunk:
                del self.flows[index]
                stopping.append((index, flow, None))
                continue
            at = bisect_right(self.chunk_firsts, index) - 1
            chunk = self.chunk_list[at] if at >= 0 else None
            if chunk is None or index >= chunk.index + chunk.count:  # (its chunk ended and was swept: nothing runs)
                errors[index] = RunTimeout.after(self.timeout, {}, [], None)
            else:
                stopping.append((index, chunk, index - chunk.index))
        stopped = self.loop.expire([(flow, place) for _, flow, place in stopping], self.timeout)
        errors.update((index, err) for (index, _, _), err in zip(stopping, stopped))
        return [errors[index] for index in indices]

    def _keep_chunks(self, started: dict) -> None:
        """Remember chunks just started (first index → Chunk, ascending) for `expire`; sweep those that ended."""
        self.chunk_firsts += started
        self.chunk_list += started.values()
        if len(self.chunk_list) > self.sweep_chunks_at:
            kept = [chunk for chunk in self.chunk_list if not chunk.finished]
            self.chunk_firsts, self.chunk_list = [chunk.index for chunk in kept], kept
            self.sweep_chunks_at = max(SWEEP_AT, 2 * len(kept))

    def close(self) -> None:
        if self.loop is None:
            return  # (an amap left before it began: nothing was started)
        self.loop.map_open(self, False)
        if self.flows:
            self.loop.cancel(list(self.flows.values()))
            self.flows.clear()
