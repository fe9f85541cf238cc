"""The worker's serving loop: receive, run, send back. See `soma.local.worker` for the drawing."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from collections import deque

import zmq

from ..._log import warn
from ...errors import Cancelled, NodeError, traceback_text
from ...run.interpreter import Interpreter, RunState, span
from ...run.threads import kept_threads, on_threads
from ...wire import failures, protocol, transport
from ...wire.protocol import Bundle, Cancel, Free, Outcome, Result, Stop, Task
from ...wire.shm import unlink_all
from ...wire.status import StatusPage
from .library import Library
from .resources import Arena, DeviceSetup, private_memory
from .turns import Turns
from .values import decode_input, encode_output, encode_outputs

POLL_MS = 200  # how long the receiving thread waits on the socket before looking around
WATCHDOG_S = 0.5
PROMOTE_S = 0.002  # a receiver that has run jobs this long hands the receiving to a follower
TICK_S = 0.002  # how often a follower looks, while jobs keep coming (a wakeup each: not too often)
ACTIVE_S = 0.1  # after this long without a job, followers sleep until the next one
FLUSH_S = 0.001  # outcomes of short jobs wait at most this long to travel together
MAX_THREADS = 64  # serving threads: one per piece running at once, and one receiving
_STOP = object()  # next_turn's answer when the worker is stopping


class Lane:
    """The jobs of one piece waiting in this worker: run in arrival order, by one thread at a time."""

    __slots__ = ("jobs", "busy")

    def __init__(self):
        self.jobs: deque = deque()
        self.busy = False  # a thread is running its jobs


class Worker:
    def __init__(self, args, secret: bytes):
        self.id = args.id
        self.device = args.device
        self.host_pid = args.host_pid
        self.prefix = args.prefix
        self.arena = args.arena
        self.run_dir = os.path.dirname(args.status)
        self.secret = secret
        self.zctx = transport.context()
        self.inbox = self.zctx.socket(zmq.DEALER)
        # One identity per incarnation: a ROUTER ignores a new peer that reuses an identity it still
        # has registered, so a replacement named like the worker it replaces would never get a task.
        self.inbox.setsockopt(zmq.IDENTITY, f"{self.id}.{os.getpid()}".encode())
        self.inbox.setsockopt(zmq.LINGER, 0)
        # The host binds while we start (it spawns us first): retry the connection soon, not after 100 ms.
        self.inbox.setsockopt(zmq.RECONNECT_IVL, 5)
        self.inbox.connect(args.tasks)
        self.outbox = self.zctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 2000)
        self.outbox.setsockopt(zmq.SNDHWM, 0)
        self.outbox.setsockopt(zmq.RECONNECT_IVL, 5)
        self.outbox.connect(args.results)
        self.receiver = transport.Receiver(self.inbox)
        self.send_lock = threading.Lock()
        # Who does what (all under `cv`): one thread receives; threads take runnable lanes.
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)  # (`with self.lock` where nobody waits: one call, not three)
        self.receiving = None  # the thread that receives now
        self.receiver_busy_since = None  # when that thread went off to run jobs itself
        self.runnable: deque = deque()  # lanes with jobs and nobody running them
        self.lanes: dict[int, Lane] = {}
        self.active_until = 0.0  # followers tick until then (jobs came recently)
        self.idle = 0  # threads asleep on cv
        self.running = 0  # threads running a lane
        self.serving = 1
        self.stopping = threading.Event()
        self.max_memory = args.max_memory  # bytes, or 0: no cap
        self.over_memory = False  # above max_memory after a job: it runs nothing more, and the host replaces it
        self.cancelled: set = set()  # job ids the host no longer wants (dropped unless started)
        self.pace: dict = {}  # piece id → seconds its last job took here (whether outcomes may wait: run_lane)
        self.turns = Turns()  # jobs of pieces that hold the GIL run one at a time
        # What this worker knows: node code, nodes, pieces.
        self.library = Library(self.id, self.make_interpreter)
        self.status = StatusPage(args.status, create=True)
        self.store = None
        self.store_lock = threading.Lock()
        self.caller_held = 0  # bytes of /dev/shm the caller's results hold, as the last Task said (SegmentStore)
        self.allocator = Arena(self.get_store)  # ctx.empty / ctx.empty_array
        self.local = threading.local()
        self.devices = DeviceSetup(self.device, max(1, args.threads))  # torch's threads, CUDA's device
        self.cuda = self.devices.cuda
        self.preload_torch = args.preload_torch or self.cuda

    # -- life --------------------------------------------------------------------------------
    def serve(self) -> int:
        threading.current_thread().name = "lane 0"  # serving threads are named by what they do (the trace shows them)
        signal.signal(signal.SIGTERM, self.terminated)
        self.devices.when_torch_imports()
        threading.Thread(target=self.watch_host, name="soma-watchdog", daemon=True).start()
        self.send(protocol.Hello(self.id, os.getpid(), self.device))
        if self.preload_torch:
            # After HELLO, not before: importing torch takes a second or more, and the pool is ready
            # without it. A job that needs torch meanwhile waits on the import, as it would anyway.
            threading.Thread(target=lambda: __import__("torch"), name="soma-torch", daemon=True).start()
        try:
            self.serve_forever()
        finally:
            self.finish()
        return 0

    def watch_host(self) -> None:
        """Exit soon after the host is gone (our parent changes when it dies), cleaning up after it."""
        while not self.stopping.wait(WATCHDOG_S):
            if os.getppid() != self.host_pid:
                # The host cannot clean up any more: whoever notices does (several workers may; all is idempotent).
                unlink_all(self.prefix)
                shutil.rmtree(self.run_dir, ignore_errors=True)
                os._exit(0)

    def terminated(self, signum, _frame) -> None:
        """SIGTERM: unlink our segments, then die of the signal, so the host can say what ended us."""
        if self.store is not None:
            self.store.close()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def finish(self) -> None:
        """Unlink our segments and exit now.

        Other threads may be polling the socket or running a node: closing sockets
        under them would raise in each, and so would closing the status page (a lane
        thread that names its next node there printed a TypeError traceback while the
        worker stopped). The host has asked us to stop (or is gone), so nothing still
        in flight is wanted; the kernel closes the sockets and unmaps the page.
        """
        if self.store is not None:
            self.store.close()
        os._exit(0)

    # -- serving: one thread receives, the others run lanes ----------------------------------------
    def serve_forever(self) -> None:
        """What every serving thread runs: run a lane that waits, or receive, or wait for either.

        The thread that receives jobs runs them itself and keeps receiving afterwards:
        no hand-off between threads on a job's way, which costs as much as a small job.
        Only when it has been running jobs for longer than PROMOTE_S does a follower
        take over receiving, so jobs of other inputs and pieces are still received.
        Other runnable lanes (another piece, a wave's other branch) go to idle threads
        at once. Followers tick every TICK_S while jobs keep coming, and sleep untimed
        when the worker is idle, so an idle worker uses no CPU.
        """
        me = threading.current_thread()
        self.local.serving = True  # (see leave: jobs run on this thread, not a wave's branches)
        while not self.stopping.is_set():
            lane = self.next_turn(me)
            if lane is _STOP:
                return
            if lane is not None:
                self.run_lane(lane)
                with self.lock:
                    self.running -= 1
                continue
            message = self.receive()
            if message is None:
                self.trim_if_idle()
                continue
            lane = self.handle(message)
            if lane is not None:
                self.run_lane(lane, receiving=True)
                with self.lock:
                    self.running -= 1

    def next_turn(self, me):
        """What this serving thread does next: a runnable lane, None (it receives), or _STOP.

        It waits until one of those is there: a follower ticks every TICK_S while jobs keep
        coming (the receiver may have gone off to run one), and sleeps untimed when the
        worker is idle.
        """
        with self.cv:
            while True:
                if self.stopping.is_set():
                    return _STOP
                if self.runnable:
                    self.running += 1
                    return self.runnable.popleft()
                if self.receiving is None or self.receiving is me:
                    self.receiving, self.receiver_busy_since = me, None
                    return None
                now = time.monotonic()
                busy = self.receiver_busy_since
                if busy is not None and now - busy > PROMOTE_S:
                    self.receiving, self.receiver_busy_since = me, None  # the busy one follows when done
                    return None
                if now < self.active_until:
                    self.cv.wait(TICK_S)
                else:
                    self.idle += 1
                    self.cv.wait()
                    self.idle -= 1

    def trim_if_idle(self) -> None:
        """Between jobs: the store gives back what it keeps for reuse when another process wants room, or when
        nothing ran for a while (`SegmentStore.idle`)."""
        store = self.store
        if store is not None and not self.running:
            store.idle(time.monotonic() - self.active_until)

    def receive(self):
        frame = self.receiver.wait(POLL_MS)
        return None if frame is None else protocol.parse(self.secret, frame, "the host")

    def handle(self, message):
        """Act on a message; for a Task, return a lane for this (receiving) thread to run itself."""
        if isinstance(message, Task):
            return self.accept(message)
        if isinstance(message, Free):
            self.free(message.frees)
        elif isinstance(message, Cancel):
            with self.lock:
                # Only what still waits in a lane can be dropped (a Cancel comes after its Task, on the
                # same socket): the rest has started or is done, and its id need not be kept.
                wanted = set(message.jobs)
                self.cancelled.update(i for lane in self.lanes.values() for u in lane.jobs for i in _ids(u)
                                      if i in wanted)
        elif isinstance(message, Stop):
            self.stopping.set()
            self.finish()
        else:
            warn("soma.worker", "soma worker %s: dropped a %s message a host should not send", self.id,
                 type(message).__name__)
        return None

    def accept(self, task: Task):
        """Register the task's code and pieces, queue its jobs; this thread takes the first runnable lane."""
        try:
            if task.forget:
                self.forget(task.forget)
            if task.frees:
                self.free(task.frees)
            self.caller_held = task.held  # (what the host last said the caller's results hold)
            if task.code or task.pieces:
                # Registered while this thread still receives: a later job that counts on this code
                # (the host sends it once per worker) may run on another thread before it gets here.
                self.library.register(task.code, task.pieces)
        except Exception as err:  # an authentic but malformed message must not take the worker down
            warn("soma.worker", "soma worker %s: dropped a malformed Task: %s: %s", self.id, type(err).__name__, err)
            return None
        now = time.monotonic()
        with self.lock:
            for job in task.jobs:
                lane = self.lanes.get(job.piece)
                if lane is None:
                    lane = self.lanes[job.piece] = Lane()
                lane.jobs.append(job)
                if not lane.busy:
                    lane.busy = True
                    self.runnable.append(lane)
            if not self.runnable:
                return None
            mine = self.runnable.popleft()
            self.receiver_busy_since = now
            waking = now >= self.active_until
            self.active_until = now + ACTIVE_S
            # Someone must receive while this thread runs jobs, and every other runnable lane needs a thread.
            wanted = 1 + len(self.runnable)
            free = self.serving - 1 - self.running  # threads other than this one, not running a lane
            self.running += 1
            for _ in range(min(wanted - free, MAX_THREADS - self.serving)):
                self.serving += 1
                threading.Thread(target=self.serve_forever, name=f"lane {self.serving - 1}", daemon=True).start()
            if self.runnable or (waking and self.idle):
                self.cv.notify(len(self.runnable) + 1)
        return mine

    def send(self, message) -> None:
        frame = protocol.pack(self.secret, message)
        with self.send_lock:
            self.outbox.send(frame)

    # -- running a lane ------------------------------------------------------------------------------
    def run_lane(self, lane: Lane, receiving: bool = False) -> None:
        """Run the lane's jobs in order until it is empty.

        An outcome goes out as soon as its job is done, unless jobs are short: then
        outcomes wait for one another, at most FLUSH_S, and travel together (one
        message and one wake-up for many). An outcome never waits for a long job.
        """
        outcomes: list = []
        first_at = 0.0
        while True:
            with self.lock:
                if not lane.jobs:
                    lane.busy = False
                    if receiving and self.receiving is threading.current_thread():
                        self.receiver_busy_since = None
                    break
                turn = [lane.jobs.popleft()]
                loaded = self.library.pieces.get(turn[0].piece)
                if loaded is not None and loaded.batch:  # a batching node's jobs run together: they share calls
                    self.fill_turn(turn, lane.jobs, loaded.batch)
                dropped = {i for job in turn for i in _ids(job) if i in self.cancelled}
                self.cancelled -= dropped
            piece = turn[0].piece
            if outcomes and (len(turn) > 1 or type(turn[0]) is Bundle or self.pace.get(piece, FLUSH_S) >= FLUSH_S):
                # The next turn may be long (a batch; a piece not known to be quick): what is done goes now,
                # so that it neither waits for that turn nor dies with this worker if that turn ends it (it
                # would run again elsewhere: the status page no longer names it).
                self.flush(outcomes)
                outcomes = []
            # A job of a piece that computes waits while another such job computes here (turns.py).
            single = len(turn) == 1 and type(turn[0]) is not Bundle
            token = self.turns.enter(piece, self.pace.get(piece)) if single else None
            try:
                done = self.run_turn(turn, dropped)
            finally:
                self.turns.leave(piece, token)
            for outcome in done:
                self.pace[piece] = outcome.seconds
                now = time.monotonic()
                if not outcomes:
                    first_at = now
                outcomes.append(outcome)
                if outcome.seconds >= FLUSH_S or now - first_at >= FLUSH_S:
                    self.flush(outcomes)
                    outcomes = []
        if outcomes:
            self.flush(outcomes)

    @staticmethod
    def fill_turn(turn: list, queued: deque, batch: int) -> None:
        """Take the lane's next jobs into `turn` while its inputs stay within `batch` (a Bundle counts its
        inputs); a traced job and a Bundle never share a turn (a Bundle's inputs run in one call, untraced)."""
        bundled = type(turn[0]) is Bundle
        traced = not bundled and bool(turn[0].traced)
        size = _size(turn[0])
        while queued:
            item = queued[0]
            if type(item) is Bundle:
                if traced:
                    break
                bundled = True
            elif item.traced:
                if bundled:
                    break
                traced = True
            size += _size(item)
            if size > batch:
                break
            turn.append(queued.popleft())

    def run_turn(self, jobs: list, dropped: set) -> list:
        """Outcomes of a lane's turn: one job, or the jobs queued for a piece with a batching node, run at once:
        in one call when the piece is that node alone (`run_batch`), else on threads of their own so that
        they meet at that node (soma.run.batching)."""
        def outcome_of(job):
            if job.id in dropped or self.over_memory:  # (over max_memory: what has not started runs elsewhere)
                return Outcome(job.id, False, failures.error_body(Cancelled()), None, 0.0)
            outcome = self.run_job(job)
            if self.max_memory and not self.over_memory:
                self.over_memory = private_memory() > self.max_memory
            return outcome

        bundled = any(type(job) is Bundle for job in jobs)
        if len(jobs) == 1 and not bundled:
            return [outcome_of(jobs[0])]
        piece = self.library.pieces.get(jobs[0].piece)  # (loaded: its `batch` made this turn)
        if piece is None and bundled:  # a Bundle is the first input of its piece here: load it first
            piece, failure = self.load_bundled(jobs)
            if piece is None:
                return [_failed(job, failure) if type(job) is Bundle else
                        Outcome(job.id, False, failures.error_body(failure), None, 0.0) for job in jobs]
        node_id = piece.interpreter.batch_node(piece.plan) if piece is not None else None
        if node_id is not None and not any(type(job) is not Bundle and job.traced for job in jobs):
            return self.run_batch(piece, node_id, jobs, dropped)
        if bundled:  # (the host bundles only the inputs of a batching node alone: never here)
            failure = NodeError.failed(piece.entry, f"worker {self.id} was sent a bundle of inputs for a piece "
                                                    f"that is not one batching node (a bug in soma: please report it)")
            return [_failed(job, failure) if type(job) is Bundle else outcome_of(job) for job in jobs]
        with piece.interpreter.arriving(len(jobs)) if piece is not None else contextlib.nullcontext():
            return [value for _, value in on_threads([lambda job=job: outcome_of(job) for job in jobs],
                                                     kept_threads())]

    def load_bundled(self, jobs: list) -> tuple:
        """`(the piece, None)` of the turn's first job, loaded here, or `(None, the NodeError)` that stopped
        it (each input of the turn gets it). The status page names every job of the turn meanwhile."""
        piece_id, entry = jobs[0].piece, "?"
        try:
            plan, steps, entry, producer = self.library.describe(piece_id)
            self.status.enter_batch([i for job in jobs for i in _ids(job)], entry)
            self.devices.on_thread()  # (a node's code may touch CUDA as it loads)
            return self.library.load(piece_id, plan, steps, entry, producer), None
        except NodeError as err:
            return None, err
        except BaseException as err:  # never lose a job: the host is waiting for it
            return None, self.could_not_run(entry, err)
        finally:
            self.status.leave()

    def run_batch(self, piece, node_id: str, jobs: list, dropped: set) -> list:
        """The jobs of a piece that is one batching node, on this thread: decoded (a Bundle's inputs in one
        pass), one `forward_batch`, encoded (a Bundle's outputs as one list); an outcome per job and one per
        Bundle. The status page names every job of the batch (a death meanwhile counts a try for each: they
        had all started)."""
        start = time.perf_counter()
        outcomes: list = [None] * len(jobs)
        answers: list = [None] * len(jobs)  # a Bundle's: {job id: ok, or its error body} (see protocol.Outcome)
        at, ids, xs = [], [], []  # each input that runs: its job's place in the turn, its job id, its value
        for i, job in enumerate(jobs):
            if type(job) is Bundle:
                answers[i] = self.open_bundle(job, i, node_id, dropped, at, ids, xs)
                continue
            if job.id in dropped or self.over_memory:  # (over max_memory: what has not started runs elsewhere)
                outcomes[i] = Outcome(job.id, False, failures.error_body(Cancelled()), None, 0.0)
                continue
            try:
                xs.append(decode_input(job.payload, node_id, self.id, self.get_store))
                at.append(i)
                ids.append(job.id)
            except NodeError as err:
                outcomes[i] = Outcome(job.id, False, failures.error_body(err), None, 0.0)
        if ids:
            status = self.status
            status.enter_batch(ids, node_id)
            try:
                try:  # (no RunStates: nothing is cancelled mid-turn here, and a traced job never shares a turn)
                    results = piece.interpreter.run_batch(node_id, xs)
                except BaseException as err:  # never lose a job: the host is waiting for it
                    results = [(False, self.could_not_run(node_id, err))] * len(ids)
                del xs
                seconds = (time.perf_counter() - start) / len(ids)  # (each job's share: what the host measures)
                bundled: dict = {}  # a Bundle's place in the turn → ([job id], [output]) of its inputs that ran ok
                for i, job_id, (ok, value) in zip(at, ids, results):
                    if ok and answers[i] is not None:
                        done = bundled.get(i)
                        if done is None:
                            done = bundled[i] = ([], [])
                        done[0].append(job_id)
                        done[1].append(value)
                        continue
                    body = None
                    if ok:
                        try:
                            body = encode_output(value, node_id, self.get_store)
                        except NodeError as err:
                            ok, value = False, err
                    if not ok:
                        if not isinstance(value, NodeError):
                            value = NodeError.failed(node_id, f"{type(value).__name__}: {value}")
                        body = failures.error_body(value)
                    if answers[i] is not None:
                        answers[i][job_id] = body
                    else:
                        outcomes[i] = Outcome(job_id, ok, body, None, seconds)
                for i, (done_ids, values) in bundled.items():
                    outcomes[i] = self.close_bundle(answers[i], done_ids, values, node_id, seconds)
            finally:
                status.leave()
        for i, job in enumerate(jobs):
            if outcomes[i] is None:  # a Bundle none of whose inputs ran ok
                outcomes[i] = self.close_bundle(answers[i], [], [], node_id, 0.0)
        if self.max_memory and not self.over_memory:
            self.over_memory = private_memory() > self.max_memory
        return outcomes

    def open_bundle(self, bundle: Bundle, i: int, node_id: str, dropped: set, at: list, ids: list,
                    xs: list) -> dict:
        """A Bundle's inputs that run (decoded in one pass) go to `at`, `ids` and `xs`; what becomes of the
        others (dropped, or not decodable) is in the answers it returns: {job id: its error body}, in payload
        order (None for one that runs, until its output comes)."""
        named = bundle.ids
        if self.over_memory or 0 in named or (dropped and not dropped.isdisjoint(named)):
            answers: dict = {}
            wanted = []  # (position, job id) of each input that runs
            for position, job_id in enumerate(named):
                if not job_id:
                    continue
                if job_id in dropped or self.over_memory:  # (over max_memory: what has not started runs elsewhere)
                    answers[job_id] = failures.error_body(Cancelled())
                else:
                    answers[job_id] = None
                    wanted.append((position, job_id))
            if not wanted:
                return answers
        else:  # (the common case: every input of the bundle runs)
            answers, wanted = dict.fromkeys(named), None
        try:
            values = decode_input(bundle.payload, node_id, self.id, self.get_store)
            if type(values) is not list or len(values) != len(named):
                raise NodeError.failed(node_id, f"its input could not be received in worker {self.id}: a bundle "
                                                f"of {len(named)} inputs decoded to something else (a bug in "
                                                f"soma: please report it)")
        except NodeError as err:
            body = failures.error_body(err)
            for job_id in answers:
                if answers[job_id] is None:
                    answers[job_id] = body
            return answers
        if wanted is None:
            at += [i] * len(named)
            ids += named
            xs += values
            return answers
        for position, job_id in wanted:
            at.append(i)
            ids.append(job_id)
            xs.append(values[position])
        return answers

    def close_bundle(self, answers: dict, done_ids: list, values: list, node_id: str, seconds: float) -> Outcome:
        """A Bundle's one outcome: the outputs `values` of its inputs `done_ids` (those that ran ok) encoded as
        one list, or each alone when the list cannot be (then one that cannot fails by itself); every other
        input's answer."""
        body = None
        if done_ids:
            try:
                body = encode_outputs(values, node_id, self.get_store)
                for job_id in done_ids:
                    answers[job_id] = True
            except NodeError:
                for job_id, value in zip(done_ids, values):
                    try:
                        answers[job_id] = encode_output(value, node_id, self.get_store)
                    except NodeError as err:
                        answers[job_id] = failures.error_body(err)
                body = None
        said = list(answers.values())
        if None in said:  # (never: each input has its answer by now)
            lost = failures.error_body(NodeError.failed(
                node_id, f"worker {self.id} lost its output (a bug in soma: please report it)"))
            said = [lost if answer is None else answer for answer in said]
        return Outcome(list(answers), said, body, None, seconds)

    def flush(self, outcomes: list) -> None:
        # Inputs and outputs of these jobs are dropped by now: what died is reported with them.
        releases = self.store.releases() if self.store is not None else []
        # Over max_memory, every Result says so (`leaving`): the host sends us nothing more and replaces us
        # once all it sent has come back. We never exit on our own: a message still in ZeroMQ's queue when a
        # process exits is lost, and with it an output (measured: one in three maps of a growing node hung).
        self.send(Result(self.id, os.getpid(), outcomes, releases, self.over_memory))

    def run_job(self, job) -> Outcome:
        """Decode the input, run the piece, encode the output: one Outcome, whatever happens.

        The status page names the job's node all along (its first node while its code
        loads and its input is decoded, its last while the output is encoded), so a
        worker that dies at any moment is reported with the node it was busy with.
        """
        start = time.perf_counter()
        spans = [] if job.traced else None
        entry = producer = "?"
        status = self.status
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
            x = decode_input(job.payload, entry, self.id, self.get_store)
            value = piece.interpreter.run(piece.plan, x, RunState(self, job.id, job.traced[0] if job.traced else None),
                                          spans)
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
            status.leave()
        return Outcome(job.id, ok, body, spans, time.perf_counter() - start)

    def could_not_run(self, node_id: str, err: BaseException) -> NodeError:
        """soma's own failure while running a job (never the node's: that is its NodeError), named."""
        return NodeError.failed(node_id, f"worker {self.id} could not run it: {type(err).__name__}: {err}",
                                remote_traceback=traceback_text(err))

    # -- pieces and nodes (the library's) ------------------------------------------------------------
    def make_interpreter(self, nodes: dict, devices: dict) -> Interpreter:
        return Interpreter(nodes, devices, worker=self.id, allocate=self.allocator, remote=True, on_thread=self.devices.on_thread)

    def forget(self, keys: list) -> None:
        """The host's copies of these nodes are gone: drop them, their pieces, and those pieces' idle lanes."""
        self.library.forget(keys)
        with self.lock:
            for piece_id in [p for p, lane in self.lanes.items() if not lane.busy and not lane.jobs]:
                if piece_id not in self.library.specs:
                    del self.lanes[piece_id]
            # list(): one copy in C, atomic under the GIL (lane threads write `pace` without the lock)
            gone = [p for p in list(self.pace) if p not in self.library.specs]
            for piece_id in gone:
                self.pace.pop(piece_id, None)  # (else a forgotten piece's pace stays for the worker's life)
            self.turns.forget(gone)

    # -- what runs now, for the status page (RunState's observer) ----------------------------------
    def enter(self, job: int, node_id: str) -> None:
        self.status.enter(job, node_id)

    def leave(self, job: int, node_id: str) -> None:
        # On a serving thread the next node's name, or the job's end (run_job), overwrites it; a wave's
        # branch thread clears its slot, or a finished branch would be named as running until reused.
        if not getattr(self.local, "serving", False):
            self.status.leave()

    # -- shared memory -------------------------------------------------------------------------
    def get_store(self, create: bool = True):
        if self.store is None and create:
            with self.store_lock:
                if self.store is None:
                    from ...wire.shm import SegmentStore

                    self.store = SegmentStore(self.prefix, self.arena, caller_held=lambda: self.caller_held)
        return self.store

    def free(self, frees: list) -> None:
        store = self.get_store()
        for name, n in frees:
            store.free(name, n)


def _ids(job) -> list:
    """The job ids a lane's entry stands for: a JobSpec's one, a Bundle's named ones."""
    return [i for i in job.ids if i] if type(job) is Bundle else [job.id]


def _size(job) -> int:
    """How many inputs a lane's entry brings to a turn."""
    return sum(1 for i in job.ids if i) if type(job) is Bundle else 1


def _failed(bundle: Bundle, err: NodeError) -> Outcome:
    """A Bundle's outcome when none of its inputs could run: `err` for each."""
    ids = _ids(bundle)
    body = failures.error_body(err)
    return Outcome(ids, [body] * len(ids), None, None, 0.0)
