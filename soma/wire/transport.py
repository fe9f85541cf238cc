"""How frames travel between a `Local` host and its workers: ZeroMQ, tuned for this job.

What a frame holds is `soma.wire.protocol`'s business; this module only moves bytes.
"""

from __future__ import annotations

import os
import time

SCHED_BATCH = 3  # os.SCHED_BATCH on Linux
SPIN_S = 250e-6  # a receiver that spins looks this long before it sleeps (see Receiver.wait)
LATE_S = 100e-6  # ... unless a look (a yield) took this long: the core is busy with another program


def context():
    """A ZeroMQ context for one side of the pool, its I/O thread started under SCHED_BATCH.

    Every send wakes libzmq's I/O thread; under the default policy Linux preempts the
    sender right there (wakeup preemption), so each send costs two context switches
    on a busy core. A SCHED_BATCH I/O thread does not preempt: it runs when the sender
    blocks, which it does right after sending anyway (measured here: raw round trips
    ~20% faster, the worker's CPU per round trip down by a third).
    """
    import zmq

    ctx = zmq.Context(1)
    try:
        ctx.set(zmq.THREAD_SCHED_POLICY, SCHED_BATCH)
        ctx.set(zmq.THREAD_PRIORITY, 0)  # SCHED_BATCH takes priority 0 only
    except (AttributeError, zmq.ZMQError):  # an older libzmq: the default policy still works
        pass
    return ctx


def sender(sock):
    """`sock`'s send as one C call a frame (`send(frame, flags=0)`): pyzmq's `Socket.send` is Python that only
    adds routing ids and groups (draft sockets) before its base class's send, in C, which this is."""
    import zmq

    return super(zmq.Socket, sock).send


class Receiver:
    """Receives from one socket with as few calls as possible: both sides' hot path.

    A blocking `recv` with a receive timeout is one call where `poll` + `recv`
    is two (and `socket.poll` builds a new poller each time); `queued()` asks the
    socket whether more is queued instead of ending every batch on a raised
    `zmq.Again` (asking costs ~3 µs, a raised Again ~8). A message of several frames
    is garbage (a sealed message is one frame): each of its frames fails
    authentication on its own. Once `close()`d, it receives nothing (None).
    """

    def __init__(self, sock):
        import zmq

        self._again = zmq.Again
        # Plain ints and the backend's get/set: pyzmq's getsockopt builds enums on every call.
        self._rcvtimeo = int(zmq.RCVTIMEO)
        self._events, self._pollin = int(zmq.EVENTS), int(zmq.POLLIN)
        self._noblock = int(zmq.NOBLOCK)
        self.sock = sock
        self._timeout_ms = None
        self.closed = False
        self.quick = True  # the last spinning wait was answered within SPIN_S: the next one spins (`wait`)
        self.skip = 0  # spinning waits that sleep at once, after a look came back late (`_spin`)
        self.backoff = 0

    def wait(self, timeout_ms: int, spin: bool = False) -> bytes | None:
        """The next frame, or None when none came within `timeout_ms` (or the socket is closed).

        `spin`: while the last such wait was answered within SPIN_S, look for the frame that long (yielding
        the core and the GIL between looks) before sleeping; the caller asks it only while the machine has a
        core to spare (`cores_wanted`). Why: on a VM whose idle vCPUs halt (cloud VMs,
        CI; this one boots with guest halt-polling off) waking a halted vCPU costs tens of µs, and a round
        trip wakes six threads (the caller, each side's I/O thread, the worker's receiver, and back).
        Measured Dec 6, `Local.run` of a node returning its input, 2 workers on 2 vCPUs: ~200 µs a run
        asleep; ~140 µs with every process pinned to one vCPU (ProcessPoolExecutor the same, 210 -> 136 µs:
        its threads wake the same way); the host's caller spinning ~150 µs, the worker's receiver too ~110.
        With other programs keeping the cores busy no vCPU halts, and a run took ~140 µs without it.
        What it costs: the core, up to SPIN_S a wait, and only while frames come that quickly: a wait that
        ran out (a node that takes longer, a caller that comes back later) turns it off until a wait is
        answered within SPIN_S again (`quick`).
        """
        if self.closed:
            return None
        if spin:
            start = time.monotonic()
            if self.skip:
                self.skip -= 1
            elif self.quick:
                frame = self._spin(start)
                if frame is not None:
                    return frame
        sock = self.sock
        if timeout_ms != self._timeout_ms:
            sock.set(self._rcvtimeo, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            frame = sock.recv()
        except self._again:
            frame = None
        if spin:
            self.quick = frame is not None and time.monotonic() - start <= SPIN_S
        return frame

    def _spin(self, start: float) -> bytes | None:
        """Look for a frame until SPIN_S after `start`, yielding the core (and the GIL) between looks. A look
        that came back late (another program had this core for a time slice: no vCPU halts on a busy machine,
        so spinning cannot help, and each yield may cost a slice) stops it, and the next 16, 32, ... 4,096
        spinning waits sleep at once (measured beside two CPU burners: runs took 775 µs spinning with no such
        stop, 163 asleep); a clean spin halves that count again."""
        until, queued, sched_yield, monotonic = start + SPIN_S, self.queued, os.sched_yield, time.monotonic
        before = start
        while True:
            frame = queued()
            if frame is not None:
                self.backoff //= 2  # (a clean spin: the machine is quiet again, or was all along)
                return frame
            now = monotonic()
            if now - before > LATE_S:
                self.backoff = min(2 * self.backoff or 16, 4096)
                self.skip = self.backoff
                return None
            if now >= until:
                return None
            before = now
            sched_yield()  # (lets go of the GIL too: a thread of this process, or its I/O thread, runs first)

    def queued(self) -> bytes | None:
        """The next frame if one is queued now, else None: never waits (nor touches the receive timeout)."""
        if self.closed or not self.sock.get(self._events) & self._pollin:
            return None
        try:
            return self.sock.recv(self._noblock)
        except self._again:
            return None

    def close(self) -> None:
        """Close the socket for good: nothing is received after this."""
        if not self.closed:
            self.closed = True
            self.sock.close(0)


_LOAD = [None, 0.0, False]  # /proc/loadavg (opened once per process; False: there is none), when read, verdict
LOAD_EVERY_S = 0.01  # how long a verdict of `cores_wanted` holds


def cores_wanted() -> bool:
    """Whether more threads are running or waiting for a core, this one included, than the machine has cores
    (/proc/loadavg's count of runnable threads), as read within the last LOAD_EVERY_S: whether a receiver
    should not spin (a busy machine's vCPUs do not halt, so spinning cannot help, and it takes a core from a
    thread that wants one: beside two CPU burners runs took 775 µs spinning, 163 asleep). Asked where this
    side's own threads are calm (the host before it sends, a worker as a Task arrives), and read at most every
    LOAD_EVERY_S: a read between a send and the sleep counted the I/O threads at work, and beside burners
    each such system call (a point where the scheduler may hand the core to a burner) cost a run ~45 µs.
    False where it cannot tell."""
    load = _LOAD
    now = time.monotonic()
    if now - load[1] < LOAD_EVERY_S:
        return load[2]
    load[1] = now
    if load[0] is None:
        try:
            load[0] = os.open("/proc/loadavg", os.O_RDONLY)
        except OSError:
            load[0] = False
    try:
        load[2] = load[0] is not False and int(os.pread(load[0], 64, 0).split()[3].split(b"/")[0]) > (
            os.cpu_count() or 1)
    except (OSError, ValueError, IndexError):
        load[2] = False
    return load[2]
