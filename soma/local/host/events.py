"""What crosses between the pool, the loop and the core: what happened, and what is to be done.

    pool → loop (events: the pool returns them from `handle(frame)`; the loop hands them to the core)
      Ready      a worker said hello: it takes jobs now
      Outcomes   the Arrived jobs (and Bundled ones) one Result brought (values decoded, or Undecodable), and
                 the chunk inputs it gave back unstarted
    core → loop (actions: `HostCore.out`, popped by the loop as it carries them out, in order)
      Send       jobs to a worker          CancelAt   drop these unless started (or give them back)
      Retire     kill and replace a worker Spawn      try to start a worker again
      Deliver    an input's outcome, for its sink (put there once the loop has let go of its lock)

Plain records: nothing here knows the pool, the loop or the core.
"""

from __future__ import annotations

from typing import NamedTuple

from .procs import WorkerProcess


class Undecodable:
    """An output that arrived but could not be decoded (the core names the node)."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class Ready(NamedTuple):
    """The worker of `slot` said hello: it takes jobs now."""

    slot: int


class Arrived(NamedTuple):
    """What became of one job, as the host received it (`value` decoded, or the error it raised)."""

    job: int
    ok: bool
    value: object  # the output; or the NodeError / Cancelled; or Undecodable
    spans: list | None  # the worker's node spans, when the job was traced
    seconds: float  # how long it ran in the worker
    decode: tuple | None  # (start ns, end ns, bytes) of decoding it here, when traced
    shm: int | None = None  # bytes of /dev/shm its output takes (None: not known, a segment of it was spilled)


class Bundled(NamedTuple):
    """What became of the jobs of one bundle (or of a part of a chunk's), as the host received them."""

    jobs: list  # their ids
    oks: list  # whether each ran ok
    values: list  # each one's output (decoded, or Undecodable), or the NodeError / Cancelled it raised
    seconds: float  # each job's share of the call's time in the worker
    shm: int | None = None  # bytes of /dev/shm each output takes, on average (None: not known, see Arrived)
    decoded: bool = False  # every job ran ok and every output decoded from the one list: none to look at alone
    spans: list | None = None  # a traced chunk's: per job, the spans its worker measured (or None)


class Outcomes(NamedTuple):
    """Outcomes of jobs that the worker of `slot` sent in one Result."""

    slot: int
    worker: WorkerProcess
    arrived: list  # [Arrived | Bundled]
    leaving: bool  # the worker went over max_memory: it takes nothing more (the core retires it once idle)
    returned: list  # ids of chunk inputs it gave back unstarted (a give-back's answer), never to run there


class Gone:
    """A worker process the pool no longer has (its last frames still arrive)."""

    def __init__(self, pid: int):
        self.pid = pid


class Send(NamedTuple):
    """Send these jobs to `worker`, the worker of `slot`, in one Task (the loop encodes the ones not encoded
    yet); not to another that took its slot meanwhile: the core sends them again once it hears of its end."""

    slot: int
    jobs: list
    groups: list  # the jobs as they travel (dispatch.entries): each alone, a batching node alone's in bundles
    worker: object  # the worker process the core chose (`spawned`)


class CancelAt(NamedTuple):
    """Ask the worker of `slot` to drop these jobs unless they have started (their outcomes still come):
    answered Cancelled, or, `give_back`, named in its answer's `returned` at once (a chunk's inputs behind a
    straggler: the core sends them elsewhere only then, so none runs twice)."""

    slot: int
    job_ids: list
    give_back: bool = False


class Retire(NamedTuple):
    """Kill `worker`, the worker of `slot`, and start its replacement; its end comes back as the `lost` event.
    (Not another that took its slot meanwhile: as a Send.)"""

    slot: int
    why: str | None
    worker: object  # the worker process the core meant


class Spawn(NamedTuple):
    """Try to start a worker for `slot` again (it could not be started before, and inputs wait for it): the
    answer is the `spawned` event, or `down` with why not."""

    slot: int


class Deliver(NamedTuple):
    """An input's outcome, `(index, ok, value)`, for its sink (put there once the loop has let go of its lock)."""

    sink: object
    item: tuple
