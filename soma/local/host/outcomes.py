"""What the host makes of a job's outcome as it arrives: checked, and recorded when traced (core.py's helpers).

The postcondition is checked again on the host, on what arrived (a transport that moved a tensor is
caught), and an output that could not be decoded is the producing node's named error.
"""

from __future__ import annotations

import os
import threading
import time

from ...errors import NodeError, PostconditionError, SomaError
from ...plan import last_step
from ...run.mapping import Span
from ...run.postcondition import check_postcondition
from ...wire import failures
from .events import Bundled, Undecodable
from .flows import Job


def checked(job: Job, value, worker):
    """The host's look at what arrived: it decoded, and the postcondition holds after the crossing."""
    piece = job.piece
    if type(value) is Undecodable:
        err = value.error
        return NodeError.failed(last_step(piece.plan), f"its output could not be received from worker "
                                                       f"{worker.id}: {type(err).__name__}: {err}"), False
    if piece.devices:
        start = time.monotonic_ns() if job.traced else 0
        try:
            for node_id, declared, item in piece.checked_outputs(value):
                check_postcondition(node_id, declared, item)
        except PostconditionError as err:
            return err, False
        finally:
            if job.traced and job.flow.trace is not None:
                job.flow.trace.span("postcondition", "host", start, time.monotonic_ns(), os.getpid(),
                                    threading.get_native_id(), {"node": last_step(piece.plan), "input": job.flow.index})
    return value, True


def record(job: Job, worker, arrived) -> None:
    """A traced job's spans, as its worker measured them, into its flow's trace."""
    trace, index = job.flow.trace, job.flow.index
    trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")
    trace.node_spans(arrived.spans, worker.pid, worker.id, job.piece.devices, index)
    if arrived.decode is not None:
        pid, tid = os.getpid(), threading.get_native_id()
        start, end, nbytes = arrived.decode
        trace.thread(pid, tid, threading.current_thread().name)
        trace.span("decode output", "host", start, end, pid, tid,
                   {"node": last_step(job.piece.plan), "input": index, "bytes": nbytes})
        trace.interval(f"job {job.piece}", "host", job.sent_ns, start, pid, f"job-{job.id}",
                       {"input": index, "worker": worker.id})


def record_chunk(job: Job, worker, one: Bundled, items: list) -> None:
    """A traced chunk's part: on the host's track the part itself (from its job's send: how many inputs, from
    which) and each input that ended here (`items`: what the part delivers), from when its map started the
    chunk; each of those with its spans, as its worker measured them (an input run twice, handed on from a
    straggler's chunk as it started, is recorded once)."""
    chunk = job.flow
    trace, now, pid = chunk.trace, time.monotonic_ns(), os.getpid()
    if one.jobs:
        trace.interval(f"chunk {job.piece}", "host", job.sent_ns, now, pid, f"chunk-{job.id}-{one.jobs[0]}",
                       {"first": chunk.index - job.base + one.jobs[0], "inputs": len(one.jobs), "worker": worker.id})
    ended = {}
    for first, ok, value in items:
        for i in Span.indices(first, value):
            ended[i] = "ok" if ok else type(value).__name__
            input_ended(trace, i, chunk.started_ns, now, f"input-{id(chunk)}-{i}", ended[i])
    if one.spans is not None:
        trace.process(worker.pid, f"worker {worker.id} (pid {worker.pid})")
        at = chunk.index - job.base  # (a job id less this: its input's index)
        for job_id, spans in zip(one.jobs, one.spans):
            if spans and at + job_id in ended:
                trace.node_spans(spans, worker.pid, worker.id, job.piece.devices, at + job_id)


def input_ended(trace, index: int, started_ns: int, now: int, key: str, outcome: str) -> None:
    """An input's interval on the host's track: from when its map started it until its outcome came."""
    trace.interval(f"input {index}", "host", started_ns, now, os.getpid(), key, {"input": index, "outcome": outcome})


def internal(err: BaseException, doing: str) -> SomaError:
    """soma's own failure while it was `doing` something for an input: said, never a silent hang."""
    failure = SomaError(f"soma failed while {doing}: {type(err).__name__}: {err} (a bug in soma: please report it, "
                        f"with this message)")
    failure.__cause__ = err
    return failure


def bundled(decoder, ids: list, said: list | None, body, seconds: float, spans: list | None = None) -> Bundled:
    """A Bundle's outcomes: `said[i]` is True (its output is the next one of the list `body` decodes to),
    bytes (its output, encoded alone: the worker could not encode the list), or an error body; `said` None:
    every one True (a chunk's part). A list that cannot be decoded leaves every output in it Undecodable.
    `spans`: a traced chunk's part's, per input."""
    # (the others are bytes and error bodies, never equal to True)
    listed = len(ids) if said is None else said.count(True)
    mark = decoder.shm_mark()
    shared: list = []
    decoded = True
    if listed:
        try:
            shared = decoder.unpack(body)
            if type(shared) is not list or len(shared) != listed:
                raise ValueError(f"a bundle's outputs decoded to {type(shared).__name__} of "
                                 f"{len(shared) if type(shared) is list else '?'} values, not {listed}")
        except Exception as err:
            shared, decoded = [Undecodable(err)] * listed, False
    if listed == len(ids):  # (the common case: every input ran ok)
        return Bundled(ids, [True] * listed, shared, seconds, _each(decoder, mark, listed), decoded, spans)
    oks, values, listed_values = [], [], iter(shared)
    for answer in said:
        if answer is True:
            oks.append(True)
            values.append(next(listed_values))
        elif type(answer) is bytes:
            try:
                value = decoder.unpack(answer)
            except Exception as err:
                value = Undecodable(err)
            oks.append(True)
            values.append(value)
        else:
            oks.append(False)
            values.append(failures.error_from(answer))
    return Bundled(ids, oks, values, seconds, _each(decoder, mark, sum(oks)), False, spans)


def _each(decoder, mark: tuple, outputs: int) -> int | None:
    """Bytes of /dev/shm each of `outputs` decoded since `mark` takes, on average (see Decoder.shm_taken)."""
    taken = decoder.shm_taken(mark)
    return taken // outputs if taken is not None and outputs else None
