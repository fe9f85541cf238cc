"""The jobs waiting for a worker: one line per piece, first come first served within it.

    add(jobs) ──▶ {piece: deque of its jobs}  (pieces in the order their first waiting job came)
                   │ the pump takes each piece's jobs from the front while a worker takes them, and stops
                   ▼ at the first one none can: the rest of that line waits, without being looked at

A piece's jobs all ask the same of a worker (its device, its copies, its lane), so
when none can take the first, none can take the ones behind it in the same pump:
a pump costs what it places plus one look per piece, not a look at every job
waiting (64 threads calling `run` while a batching node's inputs gather here
made each run's pump walk all the others).
"""

from __future__ import annotations

from collections import deque


class Waiting:
    """Jobs waiting for a worker, per piece (the core's books: dispatch.py)."""

    __slots__ = ("lines",)

    def __init__(self):
        self.lines: dict = {}  # piece → deque of its waiting jobs (never empty: an emptied line is removed)

    def __bool__(self) -> bool:
        return bool(self.lines)

    def add(self, jobs) -> None:
        """New jobs, each at the back of its piece's line."""
        for job in jobs:
            self._line(job.piece).append(job)

    def add_first(self, jobs: list) -> None:
        """Jobs that were out at a worker and come back unstarted: at the front of their lines, in order."""
        for job in reversed(jobs):
            self._line(job.piece).appendleft(job)

    def _line(self, piece) -> deque:
        line = self.lines.get(piece)
        if line is None:
            line = self.lines[piece] = deque()
        return line

    def waiting(self, piece) -> int:
        """How many of `piece`'s jobs wait (stale ones not yet dropped included)."""
        line = self.lines.get(piece)
        return len(line) if line is not None else 0

    def snapshot(self) -> list:
        """`(piece, line)` of every piece with jobs waiting; a line emptied meanwhile is dropped by `settle`."""
        return list(self.lines.items())

    def settle(self, piece) -> None:
        """Drop `piece`'s line if nothing is left in it."""
        line = self.lines.get(piece)
        if line is not None and not line:
            del self.lines[piece]

    def take(self, piece) -> deque:
        """Remove and return `piece`'s whole line."""
        return self.lines.pop(piece, deque())

    def clear(self) -> None:
        self.lines.clear()
