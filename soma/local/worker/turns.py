"""Turns: a worker runs the jobs of GIL-bound pieces one at a time, and lets jobs that let go of the GIL overlap.

    run_lane ── job of piece p ──▶ Turns.enter(p)      p holds the GIL (measured), or is not measured yet:
                                     │                 wait while another such job computes here; go at once
                                     │                 when none does, or when the jobs running here all
                                     ▼                 stopped computing (blocked: I/O, a sleep, a sibling)
                                 run the job
                                     │
                                 Turns.leave(p) ──▶ p's job computed for ≥ HOLDS of its wall time (on a
                                                    core, or waiting for one), or slept as a thread waiting
                                                    for the GIL does? then p holds the GIL; it lets go after
                                                    LETS_GO_AFTER jobs in a row that computed under HOLDS
                                                    while no job beside them computed

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

Waiting for the GIL is not computing to the kernel (the thread sleeps), so a job
that ran beside a computing one is never judged by its share alone: two
pure-Python jobs let through together (a holder that looked blocked while it
waited for another thread's GIL) each computed about half their wall time, and
before Dec 3 that half judged both GIL-releasing, so they overlapped in every wave
after. Now a job computing under HOLDS lets go only if the worker's other jobs
together did not compute meanwhile either (one clock, `_computed`, sums them); if
they did, its sleeps tell: CPython wakes a thread waiting for the GIL every
switch interval (5 ms), so sleeps that short on average mean it shared the GIL
(holds), and longer ones leave the verdict as it was. Threads that run no job
(receiving, importing) are not on the clock: LETS_GO_AFTER clean jobs in a row
keep one hiccup from turning a piece. The same clock decides when a waiting job
may go: every job running here counts (a holder waiting for another job's GIL is
not blocked), and they must have slept in stretches of two switch intervals or
more (a holder waiting for the GIL of a thread that runs no job, a receiver
decoding or a piece's first job importing, is not blocked either), or for STUCK_S.
The whole process must have been quiet too (`_ProcessClock`: every thread's time
on a CPU or waiting for one): on a machine whose cores other programs keep busy, a
thread that runs no job and holds the GIL waits for a core (a CFS slice: tens of
ms), and the holder, asleep on that GIL, looked blocked in long stretches: a
wave's two pure-Python branches ran at once in 1 of ~40 waves beside two CPU
burners (Dec 6). A thread that holds the GIL is on a CPU or waiting for one; the
threads that wait for it sleep; so a process that computed under QUIET (a fifth)
of the window holds nobody up, unless a thread other than the one looking is runnable at
the look (`_ProcessClock.others_runnable`): the kernel adds a thread's wait for a core
to its schedstat only once the wait ends, so a GIL holder kept off the cores for a
whole window (seen: 110 of 125 ms, beside two CPU burners) read as quiet, and the
test's waiting job went in while the holder still waited for it (1 in ~15 runs of
test_turns.py there, Dec 7). Not HOLDS: a pure-Python thread that shares the GIL
with the waiting job's looks (each /proc read lets go of the GIL and takes it back
after a switch interval) was seen at 58 % of the window in a test. STUCK_S still
bounds the wait (a thread that is no job's may compute for ever).
"""

from __future__ import annotations

import os
import sys
import threading
import time

HOLDS = 0.5  # a job that computed for at least this share of its wall time holds the GIL
MIN_S = 0.001  # jobs of a piece whose last one took less than this take no turn (and are not measured)
CHECK_S = 0.01  # a waiting job looks this often at whether the jobs running here still compute ...
BLOCKED_S = 0.05  # ... and runs beside them once they computed under HOLDS of a window this long (they wait) ...
STUCK_S = 1.0  # ... in long sleeps, not as threads waiting for the GIL do; or after this long of such windows
QUIET = 0.2  # ... and the whole process computed under this share of that window (see `_ProcessClock`)
LETS_GO_AFTER = 2  # a piece lets go of the GIL once this many of its jobs in a row were seen to (not one hiccup)


class Turns:
    def __init__(self):
        self.cv = threading.Condition(threading.Lock())
        self.running: dict = {}  # thread ident → [its schedstat descriptor, busy ns, wakes when its job began]
        self.holders: set = set()  # threads whose job holds the turn
        self.retired = [0, 0]  # busy ns and wakes of the jobs that ran here and ended (see `_computed`)
        self.lets_go: dict = {}  # piece id → how many of its last measured jobs in a row let go of the GIL
        self.local = threading.local()
        self.process = _ProcessClock()  # every thread's computing, read while a job waits for its turn

    def enter(self, piece_id: int, pace: float | None):
        """Before a job of `piece_id` (its last job took `pace` seconds): a token for `leave`, after waiting
        for the turn when the piece computes (or is not measured yet). None: nothing to measure."""
        if pace is not None and pace < MIN_S:
            return None
        fd = self._fd()
        if fd is None:
            return None
        takes_turn = self.lets_go.get(piece_id, 0) < LETS_GO_AFTER
        me = threading.get_ident()
        with self.cv:
            look = None
            while takes_turn and self.holders:
                look = self._still_computing(look)
                if look is None:
                    break
                self.cv.wait(CHECK_S)
            busy, wakes, at = _busy(fd)
            others = self._computed()[0]
            self.running[me] = [fd, busy, wakes]
            if takes_turn:
                self.holders.add(me)
        return takes_turn, busy, wakes, at, others

    def leave(self, piece_id: int, token) -> None:
        """After the job: learn whether the piece computes, and hand the turn on."""
        if token is None:
            return
        took_turn, busy0, wakes0, at0, others0 = token
        with self.cv:
            busy, wakes, at = _busy(self._fd())
            mine = busy - busy0
            others = self._computed()[0] - others0 - mine  # what the worker's other jobs computed meanwhile
            del self.running[threading.get_ident()]
            self.retired[0] += mine
            self.retired[1] += wakes - wakes0
            if took_turn:
                self.holders.discard(threading.get_ident())
                self.cv.notify()
        wall = at - at0
        if wall < MIN_S * 1e9:  # (a job dropped unstarted says nothing of its piece)
            return
        if mine >= HOLDS * wall:
            self.lets_go[piece_id] = 0
        elif mine + others < HOLDS * wall:  # neither it nor a job beside it computed: it waited on something
            self.lets_go[piece_id] = min(LETS_GO_AFTER, self.lets_go.get(piece_id, 0) + 1)
        elif wall - mine < 2 * sys.getswitchinterval() * 1e9 * max(1, wakes - wakes0):
            self.lets_go[piece_id] = 0  # jobs beside it computed, and it slept as a thread waiting for the GIL
            # does (CPython wakes it every switch interval until it gets it): it shared the GIL
        # else it slept longer at a time, beside jobs that computed: it says nothing

    def forget_unknown(self, known) -> None:
        """Forget what was learnt of pieces not in `known` (the host let them go)."""
        # list(): one copy in C, atomic under the GIL (lane threads write `lets_go` without the lock)
        for piece_id in [p for p in list(self.lets_go) if p not in known]:
            self.lets_go.pop(piece_id, None)

    def _computed(self) -> tuple:
        """`(ns computed or waited for a core, wakes)` of all the jobs measured here so far, the running ones
        up to now: a clock that runs while any job here computes. Lock held."""
        busy, wakes = self.retired
        for fd, busy0, wakes0 in self.running.values():
            now = _busy(fd)
            busy, wakes = busy + now[0] - busy0, wakes + now[1] - wakes0
        return busy, wakes

    def _still_computing(self, look):
        """`look` for the next call while the jobs running here compute (or it is too soon to tell); None
        once they wait on something (I/O, a sleep, a sibling), so that a waiting job may run beside them:
        they computed under HOLDS of the last BLOCKED_S, in few long sleeps (a thread waiting for the GIL
        of another thread wakes every switch interval: that is not waiting on something), or did so for
        STUCK_S (never wait forever: a job may poll for a sibling in short sleeps). Every job counts, not
        only the holders. A window, not one look: a computing thread also waits for the GIL now and then.
        Lock held."""
        busy, wakes = self._computed()
        now = (busy, wakes, time.monotonic_ns(), None, self.process.busy())
        if look is None or now[2] - look[2] < BLOCKED_S * 1e9:
            return look or now
        window = now[2] - look[2]
        if busy - look[0] >= HOLDS * window:
            return now  # (they compute)
        quiet_since = look[3] or look[2]
        if now[2] - quiet_since >= STUCK_S * 1e9:
            return None
        if (now[4] - look[4] < QUIET * window  # (nobody here computed: nobody held the GIL they may wait for)
                and len(self.running) * window - (busy - look[0])
                >= 2e9 * sys.getswitchinterval() * (wakes - look[1])
                and not self.process.others_runnable()):  # (nor waits for a core now: not counted until it ends)
            return None  # (they slept for 2 switch intervals a wake or more: not for the GIL)
        return busy, wakes, now[2], quiet_since, now[4]

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
    """`(ns the thread has computed or waited for a core, times it was put on a core, now in ns)`."""
    try:
        return (*_schedstat(fd), time.monotonic_ns())
    except (OSError, ValueError):
        return 0, 0, time.monotonic_ns()


def _schedstat(fd: int) -> tuple:
    """`(ns computed or waited for a core, times put on a core)` of the thread whose schedstat `fd` is."""
    on_cpu, waiting, runs = os.pread(fd, 128, 0).split()
    return int(on_cpu) + int(waiting), int(runs)


class _ProcessClock:
    """ns that all of this process's threads have computed or waited for a core (each thread's schedstat, from
    /proc/self/task; a thread's descriptor opened once): whether anyone here computed, GIL holders included.
    Read only while a job waits for its turn (every CHECK_S), so its few preads a thread cost little.

    A wait for a core is added to a thread's schedstat when it ends (the kernel accounts it as the thread gets a
    core), so a thread kept waiting for one adds nothing while it waits: `others_runnable` reads whether any
    thread but the caller is runnable now (on a CPU, or waiting for one)."""

    def __init__(self):
        self.fds: dict = {}  # thread id (a /proc/self/task entry) → [its schedstat descriptor, ns last read]
        self.gone = 0  # ns of the threads that ended since they were first read (the clock never runs back)
        self.stats: dict = {}  # thread id → its /proc/self/task/<tid>/stat descriptor (others_runnable)

    def busy(self) -> int:
        try:
            tids = os.listdir("/proc/self/task")
        except OSError:
            return 0
        fds, total = self.fds, self.gone
        for tid in tids:
            if tid not in fds:
                try:
                    fds[tid] = [os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY), 0]
                except OSError:
                    continue
        for tid in [tid for tid in fds if tid not in tids]:
            fd, last = fds.pop(tid)
            self.gone += last
            total += last
            os.close(fd)
            stat = self.stats.pop(tid, None)
            if stat is not None:
                os.close(stat)
        for tid, entry in fds.items():
            try:
                entry[1] = _schedstat(entry[0])[0]
            except (OSError, ValueError):
                pass  # (a thread ending: its last reading stands)
            total += entry[1]
        return total

    def others_runnable(self) -> bool:
        """Whether a thread of this process other than the caller is runnable now (state R: on a CPU, or waiting
        for one), among those `busy` has read."""
        me = str(threading.get_native_id())
        for tid in list(self.fds):
            if tid == me:
                continue
            fd = self.stats.get(tid)
            if fd is None:
                try:
                    fd = self.stats[tid] = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
                except OSError:
                    continue
            if _runnable(fd):
                return True
        return False


def _runnable(fd: int) -> bool:
    """Whether the thread whose /proc/.../stat `fd` is is runnable (R), read now; False once it has ended."""
    try:
        stat = os.pread(fd, 1024, 0)
    except OSError:
        return False
    fields = stat.rpartition(b")")[2].split()
    return bool(fields) and fields[0] == b"R"
