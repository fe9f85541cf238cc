"""HostLoop's half for a map: what its in-flight set asks between turns (how many inputs a chunk holds, how many
the pool works on at once, what an input takes of /dev/shm; read without the lock, as hints) and what it tells
(opened, closed, held back by memory, frees wanted now). soma.local.inflight is its one caller."""

from __future__ import annotations

from .flows import Chunk


class MapHints:
    """HostLoop's methods for a map's in-flight set (its `core`, `pool`, `_started` and `_post`)."""

    def start_chunks(self, program, indices: list, xs: list, sink, graph, size: int, retries: int = 0,
                     trace=None) -> dict:
        """Start inputs `xs` (numbered `indices`, ascending) of a map in chunks (flows.Chunk) of up to `size`
        consecutive ones, each input with `retries` of its own (and traced in `trace`, if any); an ok run's
        outcome comes as `(index, True, Span)` (core.py, chunks.py). Returns first index → Chunk."""
        flows, count = {}, len(indices)
        if indices[-1] - indices[0] == count - 1:  # (consecutive: the common case, sliced at C speed)
            cuts = range(0, count, size)
        else:  # (a resumed map's inputs: a chunk never spans a gap)
            cuts = [at for at in range(count) if at == 0 or indices[at] != indices[at - 1] + 1]
            cuts = [cut for start, stop in zip(cuts, cuts[1:] + [count]) for cut in range(start, stop, size)]
        for start, stop in zip(cuts, list(cuts[1:]) + [count]):
            flows[indices[start]] = Chunk(indices[start], sink, program, xs[start:stop], graph, retries, trace)
        self._started(program, list(flows.values()))
        return flows

    def chunk(self, piece) -> int:
        """How many inputs of `piece` a chunk holds now (1: its inputs go one by one: not measured, or slow)."""
        return self.core.chunk(piece)  # (read without the lock: a hint, as parallelism is)

    def map_open(self, inflight, is_open: bool) -> None:
        """A map's in-flight set opens or closes (what the caller's results hold is told apart by it: see
        HostSegments.caller_held)."""
        segments = self.pool.segments
        if is_open:
            segments.maps_open.add(inflight)
        else:
            segments.maps_open.discard(inflight)
            self.map_held_back(inflight, False)

    def map_held_back(self, inflight, held: bool) -> None:
        """A map open now is held back by memory (its outputs' room counted: HostSegments.for_task), or no
        longer (what its caller keeps left no room to count, or it closed). When the last such map lets go, the
        workers are told now (WorkerPool.tell_room): one waiting for room, told to wait long for frees on their
        way, would hear it from no Task while it waits (its jobs are all it may have out), and waited its
        ROOM_WAIT_S, 2 s, for frees that were not coming."""
        held_back = self.pool.segments.held_back
        if held:
            held_back.add(inflight)
        elif inflight in held_back:
            held_back.discard(inflight)
            if not held_back:
                self._post(self.pool.tell_room)

    def parallelism(self, program_pieces: list) -> int:
        return self.core.parallelism(program_pieces)  # (read without the lock: a hint, as map uses it)

    def shm_measures(self, program_pieces: list) -> tuple:
        return self.core.shm_measures(program_pieces)  # (read without the lock: a hint, as parallelism is)

    def shm_received(self) -> int:
        return self.pool.segments.received()  # (see HostSegments.received)

    def flush_frees(self) -> None:
        """Tell the workers now, not at the next look (PUMP_S), of their segments nobody holds any more: a map
        held back by memory is about to start inputs whose outputs need that room."""
        self._post(self.pool.flush_frees)
