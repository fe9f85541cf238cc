"""Turns: a worker runs the jobs of GIL-bound pieces one at a time, and lets jobs that let go of the GIL overlap.

    run_lane ── job of piece p ──▶ Turns.enter(p)      p holds the GIL (measured), or is not measured yet:
                                     │                 wait while another such job computes here; go at once
                                     │                 when none does, or when the one(s) holding the turn
                                     ▼                 stopped computing (blocked: I/O, a sleep, a sibling)
                                 run the job
                                     │
                                 Turns.leave(p) ──▶ p's last job: computing for ≥ HOLDS of its wall time
                                                    (on a core, or waiting for one)? then p holds the GIL

Why: a wave with more branches than workers gives a worker several branches at
once, each on its own lane thread. Two pure-Python branches on two threads of one
process share one GIL: they take as long as one after the other on a quiet
machine, and far longer on a busy one, where the two threads hand the GIL back
and forth on a contended core (Local 0.76-0.97x threads where a process pool
reached 1.06-1.73x, issue 32). A branch that computes waits its turn here, as a
task waits for a free process in a pool; a branch that lets the GIL go (a sleep,
I/O, a wait) still runs beside the others.

"Computing" is read from the kernel: a thread's time on a CPU plus its time
waiting for one (/proc/thread-self/schedstat), against the wall time. On a busy
machine a pure-Python thread gets half a core or less, so its CPU time alone would
look like a thread that lets go; with the run-queue wait added it is its whole
wall time. A native op that computes without the GIL (a torch or numpy kernel on
this thread) counts as computing too: the worker's share of the cores (`threads=`)
is for one such op at a time. Pieces whose jobs take under MIN_S are left alone
(their threads rarely meet, and measuring costs microseconds).
"""

from __future__ import annotations

import os
import threading
import time

HOLDS = 0.5  # a job that computed for at least this share of its wall time holds the GIL
MIN_S = 0.001  # jobs of a piece whose last one took less than this take no turn (and are not measured)
CHECK_S = 0.01  # a waiting job looks this often at whether the turn's holder still computes ...
BLOCKED_S = 0.05  # ... and runs beside it once it computed under HOLDS of a window this long (it waits on something)


class Turns:
    def __init__(self):
        self.cv = threading.Condition(threading.Lock())
        self.holders: dict = {}  # thread ident → [its schedstat descriptor, busy ns, at ns] (the last look)
        self.lets_go: dict = {}  # piece id → True when its last measured job let go of the GIL
        self.local = threading.local()

    def enter(self, piece_id: int, pace: float | None):
        """Before a job of `piece_id` (its last job took `pace` seconds): a token for `leave`, after waiting
        for the turn when the piece computes (or is not measured yet). None: nothing to measure."""
        if pace is not None and pace < MIN_S:
            return None
        fd = self._fd()
        if fd is None:
            return None
        takes_turn = not self.lets_go.get(piece_id, False)
        if takes_turn:
            me = threading.get_ident()
            with self.cv:
                while self.holders and not self._all_blocked():
                    self.cv.wait(CHECK_S)
                self.holders[me] = [fd, *_busy(fd)]
        return (takes_turn, *_busy(fd))

    def leave(self, piece_id: int, token) -> None:
        """After the job: learn whether the piece computes, and hand the turn on."""
        if token is None:
            return
        took_turn, busy0, at0 = token
        busy, at = _busy(self._fd())
        if at - at0 >= MIN_S * 1e9:  # (a job dropped unstarted says nothing of its piece)
            self.lets_go[piece_id] = (busy - busy0) < HOLDS * (at - at0)
        if took_turn:
            with self.cv:
                self.holders.pop(threading.get_ident(), None)
                self.cv.notify()

    def forget_unknown(self, known) -> None:
        """Forget what was learnt of pieces not in `known` (the host let them go)."""
        # list(): one copy in C, atomic under the GIL (lane threads write `lets_go` without the lock)
        for piece_id in [p for p in list(self.lets_go) if p not in known]:
            self.lets_go.pop(piece_id, None)

    def _all_blocked(self) -> bool:
        """Whether every holder of the turn computed for less than HOLDS of the last BLOCKED_S (it waits on
        something: its job lets go of the GIL, or waits for a sibling, so another may run beside it). A window,
        not one look: a computing thread also waits a few ms for the GIL now and then. Lock held."""
        blocked = True
        for look in self.holders.values():
            busy, at = _busy(look[0])
            if at - look[2] < BLOCKED_S * 1e9:
                blocked = False  # (not long enough to tell)
                continue
            if busy - look[1] >= HOLDS * (at - look[2]):
                blocked = False
            look[1], look[2] = busy, at
        return blocked

    def _fd(self):
        """This thread's /proc/thread-self/schedstat, opened once (None where there is none: no turns)."""
        fd = getattr(self.local, "fd", False)
        if fd is False:
            try:
                fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            except OSError:
                fd = None
            self.local.fd = fd
        return fd


def _busy(fd: int) -> tuple:
    """`(ns the thread has computed or waited for a core, now in ns)`."""
    try:
        on_cpu, waiting, _ = os.pread(fd, 128, 0).split()
        return int(on_cpu) + int(waiting), time.monotonic_ns()
    except (OSError, ValueError):
        return 0, time.monotonic_ns()
