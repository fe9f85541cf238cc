"""Which worker takes a job: what the core knows of each worker (its books: dispatch.py), and how it chooses.

    choose(piece, usable slots, depth) → a slot, or None (no worker can take one more of its jobs)

A worker pinned to the piece's CUDA device, if it has one, and, for a batching
node alone, one with none of its sends (bundles) out, or one out while a full
bundle waits (GATHER_SENDS: one running, the next queued behind it): what comes
meanwhile waits here and goes as one bundle (dispatch fills a bundle at the
worker chosen for its first job, `fits`, before it chooses again); among those, the one with the
fewest jobs outstanding, preferring the worker that already holds copies
of most of the piece's nodes (their state lives there), then the one that holds
the fewest copies; a worker without a copy qualifies only while the nodes'
`copies` allow another. A worker runs its jobs of one piece one after another (a
lane), so at most `depth` of them wait there, and at most `cap(piece)` jobs of all
pieces are out at it when it takes one more.

`depth` comes from measuring: how long a piece's jobs take in a worker, and how
long their way there and back takes. Everything here is the core's books (pure:
no lock, no I/O); nothing here sends or receives.
"""

from __future__ import annotations

from .chunks import CHUNK_SHM
from .chunks import size as chunk_size
from .program import Piece

MAX_DEPTH = 64  # at most this many jobs per worker in flight when inputs are tiny (see depth)
EMA = 0.2
GATHER_SENDS = 2  # a batching node alone: its sends (bundles, or one job) out at a worker before the next waits


def cap(piece: Piece) -> int:
    """How many jobs a worker may have outstanding and still take one of `piece`'s: MAX_DEPTH, or two batches'
    worth for a piece with a batching node (one running, the next queued behind it: with one, the worker
    waited while its outcomes went and the next batch came)."""
    return max(MAX_DEPTH, 2 * piece.batch)


class WorkerChoice:
    def __init__(self, worker_devices: list[str]):
        self.worker_devices = worker_devices
        self.load = [0] * len(worker_devices)  # jobs outstanding per worker (sent, or parked)
        self.lanes: dict = {}  # (slot, piece id) → that piece's jobs outstanding at that worker
        self.holders: dict[int, set] = {}  # node key → slots holding a copy
        self.copies_at = [0] * len(worker_devices)  # copies held per worker
        self.service_s: dict = {}  # piece id → EMA of one job's time in a worker
        self.latency_s: dict = {}  # piece id → EMA of its jobs' way to a worker and back, less their time there
        self.first_seen: set = set()  # pieces whose first job's outcome has come
        self.output_shm: dict = {}  # piece id → bytes of /dev/shm one output takes (weigh)
        self.input_shm: dict = {}  # piece id → bytes of /dev/shm the host copied one input into (weigh)
        self.sends: dict = {}  # (slot, piece id) → a batching node alone's sends out at that worker (see choose)
        self.widest = MAX_DEPTH  # the largest cap of the pieces admitted (has_room)

    # -- choosing ----------------------------------------------------------------------------------------
    def has_room(self, usable) -> bool:
        """Whether any of these workers can take one more job at all."""
        return any(self.load[slot] < self.widest for slot in usable)

    def admit(self, pieces: list) -> None:
        """These pieces' jobs are coming: a worker has room while its load is under the largest `cap` of any."""
        for piece in pieces:
            self.widest = max(self.widest, cap(piece))

    def choose(self, piece: Piece, usable, depth: int, gather: int = 0):
        """A worker for a job of `piece`, or None; the copies it will hold there are counted. `gather`: the
        job is a batching node alone's (untraced), and a worker takes it only while fewer than `gather` of
        the piece's sends are out there (1: none, the next bundle goes only to a worker with nothing of it
        to run; GATHER_SENDS when a full bundle is waiting). What arrives meanwhile gathers into the next
        bundle; a lone input finds nothing out and goes at once."""
        best, best_rank = None, None
        keys = piece.keys.values()
        holders = self.holders
        lanes = self.lanes
        sends = self.sends if gather else None
        most = cap(piece)
        for slot in usable:
            load = self.load[slot]
            if (load >= most or lanes.get((slot, piece.id), 0) >= depth
                    or (piece.cuda is not None and self.worker_devices[slot] != piece.cuda)
                    or (sends and sends.get((slot, piece.id), 0) >= gather)):
                continue
            holds = 0
            for key in keys:
                if slot in holders.get(key, ()):
                    holds += 1
            if holds < len(keys) and piece.max_copies is not None and not self._may_copy(piece, slot):
                continue
            rank = (load, -holds, self.copies_at[slot], slot)
            if best_rank is None or rank < best_rank:
                best, best_rank = slot, rank
        if best is not None:
            for key in keys:
                slots = holders.setdefault(key, set())
                if best not in slots:
                    slots.add(best)
                    self.copies_at[best] += 1
        return best

    def fits(self, piece: Piece, slot: int, depth: int) -> bool:
        """Whether the worker of `slot`, chosen for one of `piece`'s jobs in this pump, takes one more of them."""
        return self.load[slot] < cap(piece) and self.lanes.get((slot, piece.id), 0) < depth

    def _may_copy(self, piece: Piece, slot: int) -> bool:
        """Whether another copy of the piece's limited nodes may be made on `slot`."""
        return all(len(self.holders.get(key, ())) < piece.max_copies or slot in self.holders.get(key, ())
                   for key in piece.keys.values())

    def serving(self, piece: Piece) -> list[int]:
        """The slots whose workers could ever run `piece` (its CUDA device's, or all)."""
        return [s for s in range(len(self.load)) if piece.cuda is None or self.worker_devices[s] == piece.cuda]

    # -- counting what is out ---------------------------------------------------------------------------
    def take(self, job, slot: int) -> None:
        """`job` goes to the worker of `slot`."""
        lane = (slot, job.piece.id)
        job.slot = slot
        job.behind = self.lanes.get(lane, 0)  # the piece's jobs it will wait behind there
        self.lanes[lane] = job.behind + 1
        self.load[slot] += 1

    def give_back(self, job) -> None:
        """`job` is no longer at its worker (its outcome came, or the worker is gone)."""
        lane = (job.slot, job.piece.id)
        left = self.lanes[lane] - 1
        if left:
            self.lanes[lane] = left
        else:
            del self.lanes[lane]
        self.load[job.slot] -= 1

    def sent(self, slot: int, piece_id: int) -> None:
        """A send of a batching node alone's inputs (a bundle, or one job) went to the worker of `slot`."""
        key = (slot, piece_id)
        self.sends[key] = self.sends.get(key, 0) + 1

    def send_over(self, slot: int, piece_id: int) -> None:
        """Every job of such a send is back (answered, lost, or handed back)."""
        key = (slot, piece_id)
        left = self.sends.get(key, 0) - 1
        if left > 0:
            self.sends[key] = left
        else:
            self.sends.pop(key, None)

    def slot_lost(self, slot: int) -> None:
        """The worker of `slot` is gone: the copies it held are gone with it."""
        for slots in self.holders.values():
            slots.discard(slot)
        self.copies_at[slot] = 0

    def forget(self, keys: list) -> None:
        """Nodes the host let go: nobody holds their copies any more."""
        for key in keys:
            for slot in self.holders.pop(key, ()):
                self.copies_at[slot] -= 1

    # -- measuring ---------------------------------------------------------------------------------------
    def measure(self, job, service_s: float, now: float, count: int = 1) -> None:
        """Learn how long a piece's jobs take in a worker, and how long the way there and back takes.

        The way is measured only on jobs that found their worker idle: the time one spends
        queued behind others is not latency, and counting it would let the depth feed on itself.
        `service_s` is one input's time; a chunk's job ran `count` of them.
        """
        piece = job.piece.id
        known = self.service_s.get(piece)
        if known is None and piece not in self.first_seen:
            self.first_seen.add(piece)  # a piece's first job loads its code and runs setup: not its pace
            return
        self.service_s[piece] = service_s if known is None else known + EMA * (service_s - known)
        if job.behind == 0:
            latency = max(0.0, now - job.sent_at - service_s * count)
            known = self.latency_s.get(piece)
            self.latency_s[piece] = latency if known is None else known + EMA * (latency - known)

    def weigh(self, piece, shm: int | None, inputs: bool = False) -> None:
        """Learn what `piece`'s outputs take of /dev/shm (an output that arrived ok: its bytes there, or None
        when not known), or with `inputs` what the host copied one of its inputs into. A larger one counts at
        once, smaller ones bring it down slowly: the measure bounds a map's window (`shm_per_input`), where
        counting too little fills /dev/shm."""
        if shm is None:
            return
        measures = self.input_shm if inputs else self.output_shm
        known = measures.get(piece.id)
        measures[piece.id] = shm if known is None or shm > known else int(known + EMA * (shm - known))

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

    def depth(self, piece: Piece) -> int:
        """Jobs of `piece` worth having in flight per worker: enough that the worker runs the next ones
        while the last outcomes travel. 2 (one running, one waiting) for jobs that take longer than a
        round trip; up to MAX_DEPTH for jobs of microseconds. MAX_DEPTH until measured. A piece with a
        batching node: at least twice its max_batch."""
        service = self.service_s.get(piece.id)
        latency = self.latency_s.get(piece.id)
        if service is None or latency is None:
            return max(MAX_DEPTH, 2 * piece.batch)
        # A piece with a batching node keeps two batches' worth at each worker: one running, the next one
        # queuing behind it (with one batch's worth, the worker waited while outcomes went and inputs came).
        return max(2, 2 * piece.batch, min(MAX_DEPTH, int(latency / max(service, 1e-6)) + 1))

    def chunk(self, piece: Piece) -> int:
        """How many inputs of `piece` a chunk holds (see chunks.size): 1 until measured; no more than take
        CHUNK_SHM bytes of /dev/shm, their inputs and outputs as measured (a chunk's job holds its inputs until
        its last is done: chunks of 20 MiB arrays filled a 64 MiB /dev/shm the map's window had room for)."""
        size = chunk_size(self.service_s.get(piece.id))
        shm = self.output_shm.get(piece.id, 0) + self.input_shm.get(piece.id, 0)
        return min(size, max(1, CHUNK_SHM // shm)) if shm else size

    def parallelism(self, pieces: list) -> int:
        """How many inputs of a program (its `pieces`) the pool works on at once: map's default window
        is twice this.

        One per worker until its pieces are measured; then as many per worker as the slowest
        piece's depth (2 for jobs longer than the way to a worker and back: one running, one
        waiting; more for jobs of microseconds). A window of exactly one round per worker
        would leave a worker idle whenever the input the caller waits for, to keep order,
        is the slow one.
        """
        if not pieces or any(p.id not in self.service_s or p.id not in self.latency_s for p in pieces):
            return len(self.load)
        return len(self.load) * min(self.depth(p) for p in pieces)
