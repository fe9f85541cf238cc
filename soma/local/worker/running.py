"""Running a turn: the worker's core, which knows nothing of sockets or serving threads.

    outcome_of(job, dropped) ─▶ one job: run_job ─────────────────────────────────▶ Outcome
    run_turn(turn, dropped) ──▶ a batching node alone's jobs and Bundles: batches.run_batch (one forward_batch)
                                a piece with a batching node: each job on a thread of its own (they meet there)

    run_job: load the piece's code, set its first node up (once per copy), and look again whether the host
             cancelled the job meanwhile (dropped: answered as a job dropped before its turn)
             decode the input (values.py → soma.wire.codec: map shared segments by name)
             Interpreter.run(plan) (soma.run.interpreter: setup once per copy, forward, Done, postcondition;
                                    a one-node piece's untraced input: Interpreter.each, the same without a RunState)
             encode the output (tensors become segment handles): one Outcome, whatever happens

The status page names the job's node all along (`Observer`: RunState reports each
node it enters), so a worker that dies at any moment is reported with it.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ...errors import Cancelled, NodeError, traceback_text
from ...run.interpreter import Interpreter, RunState, span
from ...run.threads import kept_threads, on_threads
from ...wire import failures
from ...wire.protocol import Bundle, Outcome
from . import batches
from .lanes import ids_of
from .library import Library
from .resources import Arena, private_memory
from .values import decode_input, encode_output, let_go


class Observer:
    """What runs now, for the status page (RunState's observer)."""

    def __init__(self, status):
        self.status = status
        self.local = threading.local()

    def serving(self, on: bool = True) -> bool:
        """This thread is a serving thread (jobs run on it, not a wave's branches), or no longer; the previous."""
        was = getattr(self.local, "serving", False)
        self.local.serving = on
        return was

    def enter(self, job: int, node_id: str) -> None:
        self.status.enter(job, node_id)

    def enter_batch(self, jobs: list, node_id: str) -> None:
        """This thread runs `node_id` for all of `jobs` in one call (a batching node inside a longer piece)."""
        self.status.enter_batch(jobs, node_id)

    def leave(self, job: int, node_id: str, waiting: bool = False) -> None:
        # On a serving thread the next node's name, or the job's end (run_job), overwrites it; a wave's
        # branch thread clears its slot, or a finished branch would be named as running until reused.
        # `waiting`: the job has begun no node and waits for one's copy (RunState.waits): off the page.
        if waiting or not getattr(self.local, "serving", False):
            self.status.leave()


class JobRunner:
    """Runs the jobs of pieces the library knows, in this process, on the calling thread."""

    def __init__(self, worker_id: str, status, devices, get_store, max_memory: int):
        self.id = worker_id
        self.allocator = Arena(get_store)  # ctx.empty / ctx.empty_array
        self.library = Library(worker_id, self.make_interpreter)  # what this worker knows: code, nodes, pieces
        self.status = status
        self.observer = Observer(status)
        self.devices = devices  # torch's threads, CUDA's device (resources.DeviceSetup)
        self.cuda = devices.cuda
        self.get_store = get_store
        self.max_memory = max_memory  # bytes, or 0: no cap
        self.over_memory = False  # above max_memory after a job: it runs nothing more, and the host replaces it

    def run_turn(self, jobs: list, dropped: set) -> list:
        """Outcomes of a lane's turn of a piece with a batching node (a lone job's is `outcome_of`): its queued
        jobs and Bundles, run at once: in one call when the piece is that node alone (`batches.run_batch`), else
        on threads of their own so that they meet at that node (soma.run.batching)."""
        bundled = any(type(job) is Bundle for job in jobs)
        piece = self.library.pieces.get(jobs[0].piece)  # (loaded: its `batch` made this turn)
        if piece is None and bundled:  # a Bundle is the first input of its piece here: load it first
            piece, failure = self.load_for_batch(jobs)
            if piece is None:
                return [batches.failed(job, failure, self.get_store) for job in jobs]
        node_id = piece.interpreter.batch_node(piece.plan) if piece is not None else None
        if node_id is not None and not any(type(job) is not Bundle and job.traced for job in jobs):
            if not piece.interpreter.is_set_up(node_id):  # (before run_batch looks at what the host dropped)
                failure = self.set_up_for_batch(jobs, piece, node_id)
                if failure is not None:
                    return [batches.failed(job, failure, self.get_store) for job in jobs]
            return batches.run_batch(self, piece, node_id, jobs, dropped)
        if bundled:  # (the host bundles only the inputs of a batching node alone: never here)
            failure = NodeError.failed(piece.entry, f"worker {self.id} was sent a bundle of inputs for a piece "
                                                    f"that is not one batching node (a bug in soma: please report it)")
            return [batches.failed(job, failure, self.get_store) if type(job) is Bundle
                    else self.outcome_of(job, dropped) for job in jobs]
        with piece.interpreter.arriving(len(jobs)) if piece is not None else contextlib.nullcontext():
            return [value for _, value in on_threads([lambda job=job: self.serve(job, dropped) for job in jobs],
                                                     kept_threads())]

    def serve(self, job, dropped: set) -> Outcome:
        """`outcome_of(job)` on a thread of a turn's, a serving thread meanwhile: its slot on the status page names
        the job from its first node to its end, between nodes and while it waits at the batching node too (a
        branch thread's slot is cleared after each node: these jobs' were, and a worker killed while they waited
        at the batch left them unnamed, run again elsewhere with no try counted, their first node twice)."""
        was = self.observer.serving()
        try:
            return self.outcome_of(job, dropped, named_after=True)
        finally:
            self.observer.serving(was)

    def outcome_of(self, job, dropped: set, named_after: bool = False) -> Outcome:
        """A job's outcome: Cancelled when the host dropped it (or this worker is over max_memory: what has
        not started runs elsewhere), else what running it gave (`named_after`: see run_job)."""
        if job.id in dropped or self.over_memory:
            let_go(job.payload, self.get_store)
            return cancelled(job.id)
        outcome = self.run_job(job, named_after, dropped)
        if self.max_memory:
            self.check_memory()
        return outcome

    def run_job(self, job, named_after: bool = False, dropped: set = frozenset()) -> Outcome:
        """Load the piece, decode the input, run the piece, encode the output: one Outcome, whatever happens.

        The piece's first node is set up before the input is decoded, and `dropped` (the turn's: a Cancel
        adds to it until the turn ends, lanes.py) looked at again: a job the host cancelled while its node's
        code loaded or its setup ran (a model loading: seconds) is answered as one dropped before its turn,
        and its node never runs (its forward ran ~0.7 s after a cancel sent 0.3 s into a 1 s setup).

        The status page names the job's node all along (its first node while its code
        loads and its input is decoded, its last while the output is encoded), so a
        worker that dies at any moment is reported with the node it was busy with.
        `named_after`: and after it, until this thread's next job (a turn's job, whose outcome leaves with the
        whole turn's: were the worker to die before, the host must count it as run, not run it again).
        """
        start = time.perf_counter()
        spans = [] if job.traced else None
        entry = producer = "?"
        status = self.status
        decoding = False
        try:
            piece = self.library.pieces.get(job.piece)
            if piece is None:
                plan, steps, entry, producer = self.library.describe(job.piece)
                status.enter(job.id, entry)
                self.devices.on_thread()  # (a node's code may touch CUDA as it loads)
                loading = time.monotonic_ns() if spans is not None else 0
                try:  # its imports (torch: a second or more) are a span of their own, not a silent gap
                    piece = self.library.load(job.piece, plan, steps, entry, producer)
                finally:
                    if spans is not None:
                        spans.append(span(entry, loading, "ok" if piece is not None else "failed", "load"))
            else:
                entry, producer = piece.entry, piece.producer
                status.enter(job.id, entry)
            if self.cuda:
                self.devices.on_thread()  # a cuda:N worker's current device is per thread: this one's too
            piece.interpreter.set_up(entry, spans)  # (named on the status page: a death in it counts a try)
            if job.id in dropped:  # (the input is let go undecoded, below)
                return cancelled(job.id)
            decoding = True
            x = decode_input(job.payload, entry, self.id, self.get_store)
            if piece.each is not None and spans is None:
                value = piece.each(x)  # (its one node is named on the status page already: no RunState to tell)
            else:
                value = piece.interpreter.run(piece.plan, x, RunState(self.observer, job.id,
                                                                      job.traced[0] if job.traced else None), spans)
            del x
            if producer != entry:
                status.enter(job.id, producer)
            body = encode_output(value, producer, self.get_store)
            ok = True
        except NodeError as err:
            ok, body = False, failures.error_body(err)
        except BaseException as err:  # never lose a job: the host is waiting for it
            err = self.could_not_run(producer if producer != "?" else entry, err)
            ok, body = False, failures.error_body(err)
        finally:
            if not named_after:
                status.leave()
            if not decoding:  # (its piece could not load: its input never will be decoded here)
                let_go(job.payload, self.get_store)
        return Outcome(job.id, ok, body, spans, time.perf_counter() - start)

    def load_for_batch(self, jobs: list) -> tuple:
        """`(the piece, None)` of the turn's first job, loaded here, or `(None, the NodeError)` that stopped
        it (each input of the turn gets it). The status page names every job of the turn meanwhile."""
        piece_id, entry = jobs[0].piece, "?"
        try:
            plan, steps, entry, producer = self.library.describe(piece_id)
            self.status.enter_batch([i for job in jobs for i in ids_of(job)], entry)
            self.devices.on_thread()  # (a node's code may touch CUDA as it loads)
            return self.library.load(piece_id, plan, steps, entry, producer), None
        except NodeError as err:
            return None, err
        except BaseException as err:  # never lose a job: the host is waiting for it
            return None, self.could_not_run(entry, err)
        finally:
            self.status.leave()

    def set_up_for_batch(self, jobs: list, piece, node_id: str) -> NodeError | None:
        """Set up the batching node of a turn's piece (that node alone) before `batches.run_batch` looks at what
        the host dropped: a Cancel that comes during a setup (seconds: a model loading) drops its jobs before
        their input is decoded. None, or the NodeError that stopped it (each input of the turn gets it, as a
        setup that fails in forward_batch's call gives it to each). The status page names every job meanwhile."""
        try:
            self.status.enter_batch([i for job in jobs for i in ids_of(job)], node_id)
            self.devices.on_thread()  # (a node's setup may touch CUDA)
            piece.interpreter.set_up(node_id)
            return None
        except NodeError as err:
            return err
        except BaseException as err:  # never lose a job: the host is waiting for it
            return self.could_not_run(node_id, err)
        finally:
            self.status.leave()

    def could_not_run(self, node_id: str, err: BaseException) -> NodeError:
        """soma's own failure while running a job (never the node's: that is its NodeError), named."""
        return NodeError.failed(node_id, f"worker {self.id} could not run it: {type(err).__name__}: {err}",
                                remote_traceback=traceback_text(err))

    def check_memory(self) -> None:
        """After a job: over max_memory, this worker runs nothing more (the host replaces it)."""
        if self.max_memory and not self.over_memory:
            self.over_memory = private_memory() > self.max_memory

    def make_interpreter(self, nodes: dict, devices: dict) -> Interpreter:
        """The Interpreter of a piece over its nodes' copies here (the library's `make_interpreter`)."""
        return Interpreter(nodes, devices, worker=self.id, allocate=self.allocator, remote=True,
                           on_thread=self.devices.on_thread, page=self.status)


def cancelled(job_id: int) -> Outcome:
    """The outcome of a job the host dropped before it started."""
    return Outcome(job_id, False, failures.error_body(Cancelled()), None, 0.0)
