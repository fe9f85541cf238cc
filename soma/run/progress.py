"""`map(..., progress=...)`: how far a map has come, on a terminal or to a callable.

    progress=True, stderr a terminal   one line redrawn in place (at most 10 times a second):
                                       soma map: 1200/5000 done, 310.2/s, 3.9 s, 12.3 s left
                                       (the rate since the first output, shown once a few have come)
    progress=True, stderr not one      nothing (SPEC 7.4: "only when stderr is a terminal"; a log file, nohup
                                       or CI that wants lines passes a callable that writes them)
    progress=callable                  progress(done, total) after each output, once the loop's body ran on it
                                       (total None if unknown)
"""

from __future__ import annotations

import sys
import time


def reporter(progress, total, label: str, start: int = 0):
    """A callable taking the number of outputs so far (None once the map is over); `start` of them were
    there before this run (a resumed map): they count in `done`, not in the rate."""
    if progress is False or progress is None:
        return silent
    if progress is True:
        return _Line(total, label, start=start) if _isatty(sys.stderr) else silent
    if callable(progress):
        return lambda done: None if done is None else progress(done, total)
    raise TypeError(f"map's progress must be True, False or a callable progress(done, total), got {progress!r}")


def silent(done) -> None:
    """The reporter of a map without progress: it says nothing."""
    return None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


class _Line:
    """Done (of total), rate, elapsed, and time left when the total is known: redrawn on a terminal.

    The rate counts from the first output: the wait before it (workers starting, a model loading, torch
    importing) is no rate, and dividing by it said "321.5 s left" for a map nearly done. Until RATE_AFTER
    outputs have come after the first, the line shows no rate and no time left. The line of the last output
    is drawn once: the end of the map only finishes it.
    """

    DRAW_EVERY_S = 0.1
    RATE_AFTER = 3  # outputs after the first before a rate is shown (one interval alone says little)

    def __init__(self, total, label: str, start: int = 0):
        self.total = total
        self.start_done = start
        self.label = label
        self.start = time.monotonic()
        self.last = 0.0
        self.done = start
        self.first = None  # (time, done) at the first output: the rate counts from there
        self.drawn = None  # `done` on the last line drawn

    def __call__(self, done) -> None:
        now = time.monotonic()
        stream = sys.stderr
        if done is not None:
            if self.first is None and done > 0:
                self.first = (now, done)
            self.done = done
            if now - self.last < self.DRAW_EVERY_S and done != self.total:
                return
        elif self.drawn is not None and self.drawn == self.done:  # the map is over, its last line is drawn
            stream.write("\n")
            stream.flush()
            return
        self.last = now
        self.drawn = self.done
        text = self._text(now)
        stream.write("\r" + text + "\x1b[K" + ("\n" if done is None else ""))
        stream.flush()

    def _text(self, now: float) -> str:
        text = f"{self.label}: {self.done}"
        if self.total is not None:
            text += f"/{self.total}"
        text += " done"
        rate = self._rate(now)
        if rate is not None:
            text += f", {rate:,.1f}/s"
        text += f", {now - self.start:.1f} s"
        if self.total is not None and rate is not None and self.done < self.total:
            text += f", {(self.total - self.done) / rate:.1f} s left"
        return text

    def _rate(self, now: float) -> float | None:
        """Outputs a second since the first output, once RATE_AFTER have come after it; None before."""
        if self.first is None:
            return None
        since, first = self.first
        after = self.done - first
        if after < self.RATE_AFTER or now <= since:
            return None
        return after / (now - since)
