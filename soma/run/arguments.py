"""What every run and map is given, checked once the same way on every runner (and by `Graph.run`)."""

from __future__ import annotations

import numbers
import threading


def checked_timeout(timeout) -> float | None:
    """`timeout=` of run, map, submit, arun and amap: the seconds each input may take (a number > 0), or None for
    no limit (so is `math.inf`). Checked before anything starts: a string or NaN raised deep in a run (on Local,
    with the loop's lock held: every later run hung), and 0 or a negative number meant something else on each
    runner."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not timeout > 0:
        raise ValueError(f"timeout must be the seconds each input may take (a number > 0), or None for no limit, "
                         f"got {timeout!r}")
    return None if timeout >= threading.TIMEOUT_MAX else float(timeout)  # (inf, 1e308: no limit a clock can hold)


def checked_retries(retries) -> int:
    """`retries=` of run and map: how many more tries an input gets when its worker dies (default 0)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a number of tries beyond the first (an int >= 0), got {retries!r}")
    return retries
