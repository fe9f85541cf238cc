"""What goes back to the host: one PUSH socket any serving thread sends on, and outcomes of short jobs grouped.

    a lane's outcomes ─▶ Grouped.add ─▶ (a job that took FLUSH_S or more, or the first waiting FLUSH_S) ─┐
                         Grouped.flush (before a turn that may be long, and when the lane is empty) ──────┴▶
    Outbox.result(outcomes): Result[outcomes, releases, leaving] ──▶ host PULL
"""

from __future__ import annotations

import os
import threading
import time

import zmq

from ...wire import protocol, transport
from ...wire.protocol import Result

FLUSH_S = 0.001  # outcomes of short jobs wait at most this long to travel together


class Outbox:
    def __init__(self, zctx, endpoint: str, secret: bytes, worker_id: str, segments, runner):
        self.socket = zctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 2000)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 5)
        self.socket.connect(endpoint)
        self._send = transport.sender(self.socket)
        self.lock = threading.Lock()  # any thread may send
        self.secret, self.id, self.pid = secret, worker_id, os.getpid()
        self.segments, self.runner = segments, runner

    def send(self, message) -> None:
        frame = protocol.pack(self.secret, message)
        with self.lock:
            self._send(frame)

    def result(self, outcomes: list, returned: list = ()) -> None:
        """Send `outcomes` (and the job ids given back) to the host, with the receipts that died meanwhile."""
        # Inputs and outputs of these jobs are dropped by now: what died is reported with them.
        releases = self.segments.releases()
        # Over max_memory, every Result says so (`leaving`): the host sends us nothing more and replaces us
        # once all it sent has come back. We never exit on our own: a message still in ZeroMQ's queue when a
        # process exits is lost, and with it an output (measured: one in three maps of a growing node hung).
        frame = protocol.pack(self.secret, Result(self.id, self.pid, outcomes, releases, self.runner.over_memory,
                                                  returned))
        with self.lock:  # (`send`'s two lines: a Result goes after every turn, without the call)
            self._send(frame)


class Grouped:
    """A lane's outcomes on their way: each goes as soon as its job is done, unless jobs are short: then
    outcomes wait for one another, at most FLUSH_S, and travel together (one message and one wake-up for
    many). An outcome never waits for a long job."""

    __slots__ = ("outbox", "outcomes", "first_at")

    def __init__(self, outbox: Outbox):
        self.outbox = outbox
        self.outcomes: list = []
        self.first_at = 0.0

    def add(self, outcome, seconds: float) -> None:
        """`outcome` is done; its job took `seconds`."""
        now = time.monotonic()
        if not self.outcomes:
            self.first_at = now
        self.outcomes.append(outcome)
        if seconds >= FLUSH_S or now - self.first_at >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if self.outcomes:
            outcomes, self.outcomes = self.outcomes, []
            self.outbox.result(outcomes)
