"""What the worker pool hands up to whoever receives: events, what happened (it never calls back up).

    Ready      a worker said hello: it takes jobs now
    Outcomes   the Arrived jobs (and Bundled ones) one Result brought (values decoded, or Undecodable)

The pool returns these from `handle(frame)`; the loop hands what they mean to the
core (`HostCore.ready`, `.outcomes`, `.leaving`). Nothing here knows either of them.
"""

from __future__ import annotations

from typing import NamedTuple

from .procs import WorkerProcess


class Undecodable:
    """An output that arrived but could not be decoded (the scheduler names the node)."""

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


class Bundled(NamedTuple):
    """What became of the jobs of one bundle, as the host received them: in one call's time, untraced."""

    jobs: list  # their ids
    oks: list  # whether each ran ok
    values: list  # each one's output (decoded, or Undecodable), or the NodeError / Cancelled it raised
    seconds: float  # each job's share of the call's time in the worker


class Outcomes(NamedTuple):
    """Outcomes of jobs that the worker of `slot` sent in one Result."""

    slot: int
    worker: WorkerProcess
    arrived: list  # [Arrived | Bundled]
    leaving: bool  # the worker went over max_memory: it takes nothing more (the core retires it once idle)


class Gone:
    """A worker process the pool no longer has (its last frames still arrive)."""

    def __init__(self, pid: int):
        self.pid = pid
