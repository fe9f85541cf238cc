"""`map(..., progress=True)` as a person reads it: a rate and a time left that mean something, and one last line.

A fake clock (the progress module's `time` only) and a fake terminal: the lines are exact, whatever the machine.
"""

import io
import types

import pytest

from soma.run import progress


class Terminal(io.StringIO):
    """stderr as a terminal (or, tty=False, as a log file), keeping what was written."""

    def __init__(self, tty: bool = True):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty

    @property
    def text(self) -> str:
        return self.getvalue()


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def drawn(term: Terminal) -> list[str]:
    """Each line drawn, in order (a redraw starts with \\r; the erase-to-end-of-line code left out)."""
    return [part.replace("\x1b[K", "") for part in term.text.split("\r") if part]


def test_no_time_left_from_the_wait_before_the_first_output_then_the_rate_since_it(clock, monkeypatch):
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    report = progress.reporter(True, 300, "soma map")
    clock[0] = 30.0  # the workers spent 30 s importing torch: no output came, and no rate can be told
    report(1)
    for done in (2, 3, 4):
        clock[0] += 0.2
        report(done)
    lines = drawn(term)
    assert lines[0] == "soma map: 1/300 done, 30.0 s"  # (the old line: "..., 0.0/s, 30.0 s, 8970.0 s left")
    assert lines[-1] == "soma map: 4/300 done, 5.0/s, 30.6 s, 59.2 s left"  # 3 outputs in 0.6 s since the first
    assert all("left" not in line for line in lines[:-1]), lines


def test_the_last_line_is_drawn_once_and_ended(clock, monkeypatch):
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    report = progress.reporter(True, 300, "soma map")
    for done in range(1, 301):
        clock[0] += 0.01
        report(done)
    report(None)  # the map is over
    assert term.text.count("300/300") == 1, drawn(term)
    assert drawn(term)[-1] == "soma map: 300/300 done, 100.0/s, 3.0 s\n"


def test_not_a_terminal_gets_nothing(clock, monkeypatch):
    log = Terminal(tty=False)
    monkeypatch.setattr("sys.stderr", log)
    report = progress.reporter(True, 10, "soma map")
    for done in range(1, 11):
        clock[0] += 1.0
        report(done)
    report(None)
    assert log.text == ""
