"""The floor under any round trip on soma's transport: a bare ZeroMQ echo over the same sockets.

The host sends on a ROUTER and receives on a PULL; the echo process receives on a
DEALER and answers on a PUSH, both over `ipc://` endpoints in a private directory,
each side's context from `soma.wire.transport.context()` (its I/O thread under
SCHED_BATCH, as soma's). No soma code runs per trip: what `Local.run` costs
beyond this is soma's; this much is ZeroMQ's and the machine's (each frame
crosses two I/O threads each way). Used by overhead.py's round trips, as the
`zmq_floor` contender.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

ECHO = r"""
import sys, zmq
from soma.wire import transport
ctx = transport.context()
inbox = ctx.socket(zmq.DEALER)
inbox.setsockopt(zmq.IDENTITY, b"echo")
inbox.connect(sys.argv[1])
outbox = ctx.socket(zmq.PUSH)
outbox.connect(sys.argv[2])
outbox.send(b"hello")
while True:
    frame = inbox.recv()
    if frame == b"stop":
        break
    outbox.send(frame)
"""


class ZmqEcho:
    """A warm echo process; `call(i)` sends the int `i` and returns what came back (an int)."""

    def __init__(self):
        import zmq

        from soma.wire import transport

        self.dir = tempfile.mkdtemp(prefix="soma-floor-")
        os.chmod(self.dir, 0o700)
        tasks, results = f"ipc://{self.dir}/tasks", f"ipc://{self.dir}/results"
        self.ctx = transport.context()
        self.tasks = self.ctx.socket(zmq.ROUTER)
        self.tasks.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.tasks.bind(tasks)
        self.results = self.ctx.socket(zmq.PULL)
        self.results.bind(results)
        self.results.setsockopt(zmq.RCVTIMEO, 30_000)
        self.proc = subprocess.Popen([sys.executable, "-c", ECHO, tasks, results])
        if self.results.recv() != b"hello":
            raise RuntimeError("the ZeroMQ echo process did not say hello")

    def call(self, i: int) -> int:
        self.tasks.send_multipart([b"echo", i.to_bytes(8, "little")])
        return int.from_bytes(self.results.recv(), "little")

    def close(self) -> None:
        try:
            self.tasks.send_multipart([b"echo", b"stop"])
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        self.tasks.close(linger=0)
        self.results.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
