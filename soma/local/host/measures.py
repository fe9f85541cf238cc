"""What the host learns of each piece as its outcomes come: its pace and what its inputs and outputs take of
/dev/shm (the core's, pure like it: no lock, no I/O).

    learn(job, seconds, now[, shm]) ─▶ service_s, latency_s (EMAs) ─▶ depths: jobs worth out at a worker
                                    ─▶ output_shm                    (dispatch.py reads them as it places jobs)
    weigh(piece, shm[, inputs])     ─▶ output_shm, input_shm        ─▶ a map's room and chunk size, a program's
    weigh_message(piece, size)      ─▶ message_bytes                   parallelism (core.py answers with them)

A piece's depth is computed here when a measure changes it, not at every pump:
dispatch reads `depths` as it places jobs (a placement is the host's hottest
step; a run places one job).
"""

from __future__ import annotations

from .chunks import CHUNK_BYTES, CHUNK_SHM, UNWEIGHED_FILL
from .chunks import size as chunk_size

MAX_DEPTH = 64  # at most this many jobs per worker in flight when inputs are tiny (see depths)
# and, beyond two, no more than take this much /dev/shm between them (their inputs' copies and outputs, as measured).
# A large value's way there and back is mostly the host copying it, so it measured as a deep piece: a map of 20 MiB
# arrays through a node of microseconds had a depth of 64, and a map's window (twice the parallelism) took 137
# inputs, 2.7 GB of /dev/shm, ahead of a slow caller, at half the pace of `window=4`. A cap of 4 MiB (a chunk's,
# CHUNK_SHM) cost a map of 1-4 MiB arrays a third of its pace; 64 MiB kept it (alternated, on a loaded machine).
DEPTH_SHM = 64 << 20
EMA = 0.2


class Measures:
    """Per piece (by id): how long its jobs take in a worker and on their way, what its outputs and inputs
    take of /dev/shm, and the depth that follows."""

    def __init__(self):
        self.service_s: dict = {}  # piece id → EMA of one job's time in a worker
        self.latency_s: dict = {}  # piece id → EMA of its jobs' way to a worker and back, less their time there
        self.first_seen: set = set()  # pieces whose first job's outcome has come
        self.output_shm: dict = {}  # piece id → bytes of /dev/shm one output takes
        self.input_shm: dict = {}  # piece id → bytes of /dev/shm the host copied one input into
        self.message_bytes: dict = {}  # piece id → bytes one input takes of its chunk's message, as encoded
        # piece id → jobs of it worth having in flight per worker, once measured (dispatch.cap until then): enough
        # that the worker runs the next ones while the last outcomes travel. 2 (one running, one waiting) for jobs
        # that take longer than a round trip; up to MAX_DEPTH for jobs of microseconds; a piece with a batching
        # node: at least twice its max_batch.
        self.depths: dict = {}

    def learn(self, job, service_s: float, now: float, shm: int | None = None, count: int = 1) -> None:
        """A job's outcome came: learn its piece's pace from it (`service_s`: one input's time in its worker; a
        chunk's job ran `count` of them) and, for an output that arrived ok, what it takes of /dev/shm (`shm`:
        its bytes there; None when not known or not ok).

        The way there and back is measured only on jobs that found their worker idle: the time one spends
        queued behind others is not latency, and counting it would let the depth feed on itself. A piece's
        first job loads its code and runs setup: not its pace.
        """
        piece = job.piece
        if shm is not None:
            self.weigh(piece, shm)
        known = self.service_s.get(piece.id)
        if known is None and piece.id not in self.first_seen:
            self.first_seen.add(piece.id)
            return
        self.service_s[piece.id] = service = service_s if known is None else known + EMA * (service_s - known)
        if job.behind == 0:
            latency = max(0.0, now - job.sent_at - service_s * count)
            known = self.latency_s.get(piece.id)
            self.latency_s[piece.id] = latency if known is None else known + EMA * (latency - known)
        latency = self.latency_s.get(piece.id)
        if latency is not None:
            depth = min(MAX_DEPTH, int(latency / max(service, 1e-6)) + 1)
            # Beyond two, the jobs out at a worker hold no more than DEPTH_SHM of /dev/shm between them.
            shm = self.output_shm.get(piece.id, 0) + self.input_shm.get(piece.id, 0)
            if shm:
                depth = min(depth, DEPTH_SHM // shm)
            # A piece with a batching node keeps two batches' worth at each worker: one running, the next one
            # queuing behind it (with one batch's worth, the worker waited while outcomes went and inputs came);
            # one batch's worth when two would take more than DEPTH_SHM (8 MiB arrays and max_batch 32: a map's
            # window took 180 of them, 2.4 GB, ahead of a slow caller): its batches are still full ones.
            batches = 2 if not shm or 2 * piece.batch * shm <= DEPTH_SHM else 1
            if piece.batch > 1:  # (whole batches: a depth of 21 at max_batch 16 ran half its batches of one input)
                depth = depth // piece.batch * piece.batch
            self.depths[piece.id] = max(2, batches * piece.batch, depth)

    def weigh(self, piece, shm: int | None, inputs: bool = False) -> None:
        """Learn what `piece`'s outputs take of /dev/shm (an output that arrived ok: its bytes there, or None
        when not known), or with `inputs` what the host copied one of its inputs into. A larger one counts at
        once, smaller ones bring it down slowly: the measure bounds a map's window (`shm_per_input`), where
        counting too little fills /dev/shm."""
        if shm is not None:
            _weighed(self.input_shm if inputs else self.output_shm, piece, shm)

    def weigh_message(self, piece, size: int) -> None:
        """Learn what one input of `piece` takes of its chunk's message, as encoded (`size` bytes; as `weigh`
        counts: a larger one at once): no chunk's message holds much more than CHUNK_BYTES of them."""
        _weighed(self.message_bytes, piece, size)

    def shm_per_input(self, pieces: list) -> int | None:
        """Bytes of /dev/shm an input of a program of `pieces` takes on its way (each piece's output and what
        its inputs were copied into, as measured); None until an output of one of them was measured."""
        measured = [self.output_shm[p.id] for p in pieces if p.id in self.output_shm]
        if not measured:
            return None
        return sum(measured) + sum(self.input_shm.get(p.id, 0) for p in pieces)

    def shm_per_output(self, pieces: list) -> int:
        """Bytes of /dev/shm an arrived output of a program of `pieces` takes at least (the smallest of its
        pieces' outputs, as measured: its last piece's is one of them); what a map's window counts as no
        longer in flight for an output that came back (`LocalInflight.room`), where counting too much fills
        /dev/shm. 0 until one was measured."""
        return min([self.output_shm[p.id] for p in pieces if p.id in self.output_shm], default=0)

    def chunk(self, piece) -> int:
        """How many inputs of `piece` a chunk holds (see chunks.size): 1 until measured; no more than take
        CHUNK_SHM bytes of /dev/shm, their inputs and outputs as measured (a chunk's job holds its inputs until
        its last is done: chunks of 20 MiB arrays filled a 64 MiB /dev/shm the map's window had room for), nor
        CHUNK_BYTES of its message (UNWEIGHED_FILL until a chunk of the piece was weighed)."""
        size = chunk_size(self.service_s.get(piece.id))
        message = self.message_bytes.get(piece.id)
        size = min(size, UNWEIGHED_FILL if message is None else max(1, CHUNK_BYTES // max(1, message)))
        shm = self.output_shm.get(piece.id, 0) + self.input_shm.get(piece.id, 0)
        return min(size, max(1, CHUNK_SHM // shm)) if shm else size

    def parallelism(self, pieces: list, workers: int) -> int:
        """How many inputs of a program (its `pieces`) a pool of `workers` works on at once: map's default
        window is twice this.

        One per worker until its pieces are measured; then as many per worker as the slowest
        piece's depth (2 for jobs longer than the way to a worker and back: one running, one
        waiting; more for jobs of microseconds). A window of exactly one round per worker
        would leave a worker idle whenever the input the caller waits for, to keep order,
        is the slow one.
        """
        if not pieces or any(p.id not in self.depths for p in pieces):
            return workers
        return workers * min(self.depths[p.id] for p in pieces)


def _weighed(measures: dict, piece, size: int) -> None:
    """`measures[piece.id]` learns `size`: a larger one counts at once, smaller ones bring it down slowly (a
    measure that bounds memory must not count too little)."""
    known = measures.get(piece.id)
    measures[piece.id] = size if known is None or size > known else int(known + EMA * (size - known))
