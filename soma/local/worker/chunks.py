"""A chunk running in this worker: what its lane thread has done so far, which the receiving thread sends at
once when the host asks for the rest back (soma.local.host.chunks: a straggler's neighbours go elsewhere).

    lane thread                                  receiving thread
    run_chunk: for each input of the chunk       Cancel(ids) of inputs not started yet
      begin(id) ─ dropped? → Cancelled             drop(ids) → what was done so far, taken:
      run it, done(id, output | error)               sent now as one part of the chunk's answer
    the rest, taken → the last part              (those inputs are answered Cancelled when their turn comes)

Each input is answered once: `take` hands over what is done and forgets it.
"""

from __future__ import annotations

import threading


class ChunkRun:
    __slots__ = ("lock", "ids", "node", "answers", "done_ids", "outputs", "dropped", "current", "started")

    def __init__(self, ids: list, node: str):
        self.lock = threading.Lock()
        self.node = node  # the node whose outputs these are (named if one cannot be sent)
        self.ids = set(ids)
        self.answers: dict = {}  # job id → None (ok: its output is in `outputs`) or its error body, not yet sent
        self.done_ids: list = []  # the ok ones, in order, and their outputs
        self.outputs: list = []
        self.dropped: set = set()  # asked back while the chunk ran
        self.current = None  # the input running now
        self.started: set = set()

    def begin(self, job_id: int) -> bool:
        """Whether the input `job_id` runs now (False: it was asked back)."""
        with self.lock:
            if job_id in self.dropped:
                return False
            self.current = job_id
            self.started.add(job_id)
            return True

    def done(self, job_id: int, ok: bool, value) -> None:
        """The input's outcome: its output (`ok`), or its error body."""
        with self.lock:
            self.current = None
            if ok:
                self.answers[job_id] = None
                self.done_ids.append(job_id)
                self.outputs.append(value)
            else:
                self.answers[job_id] = value

    def drop(self, ids) -> bool:
        """The host wants these inputs back unless they started: whether any was this chunk's."""
        with self.lock:
            hit = {i for i in ids if i in self.ids and i not in self.started}
            self.dropped |= hit
            return bool(hit)

    def take(self) -> tuple:
        """`(answers, done ids, outputs)` done so far and not yet sent: they are sent now."""
        with self.lock:
            taken = self.answers, self.done_ids, self.outputs
            self.answers, self.done_ids, self.outputs = {}, [], []
            return taken
