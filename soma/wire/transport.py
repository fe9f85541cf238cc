"""How frames travel between a `Local` host and its workers: ZeroMQ, tuned for this job.

What a frame holds is `soma.wire.protocol`'s business; this module only moves bytes.
"""

from __future__ import annotations

SCHED_BATCH = 3  # os.SCHED_BATCH on Linux


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

    def wait(self, timeout_ms: int) -> bytes | None:
        """The next frame, or None when none came within `timeout_ms` (or the socket is closed)."""
        if self.closed:
            return None
        sock = self.sock
        if timeout_ms != self._timeout_ms:
            sock.set(self._rcvtimeo, timeout_ms)
            self._timeout_ms = timeout_ms
        try:
            return sock.recv()
        except self._again:
            return None

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
