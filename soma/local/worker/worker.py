"""The worker's serving loop: receive, hand to lanes, run, send outcomes. See `soma.local.worker` for the drawing.

    while not stopping:                                   (every serving thread)
        lane = next_turn()         a runnable lane, or None: this thread receives (or _STOP)
        if lane: run_lane(lane)    its turns in order (lanes.py), run by the core (running.py), outcomes
                                   grouped on their way back (outbox.py)
        else: message = receive(); accept(Task) → a lane the receiving thread runs itself; or handle(message)

Everything that decides lives in its own module: which entries make a lane's next
turn (lanes.py), how a turn runs (running.py; a batching node's in batches.py),
when GIL-bound jobs take turns (turns.py), when outcomes travel (outbox.py), the
shared-memory store (segments.py). This module owns the threads and the lock.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections import deque

import zmq

from ..._log import warn
from ...wire import protocol, transport
from ...wire.lifeline import remove_pool
from ...wire.protocol import Cancel, Free, GiveBack, JobSpec, Stop, Task
from ...wire.status import StatusPage
from . import chunks as chunking
from .chunks import ChunkRun
from .lanes import Lane, Lanes
from .outbox import FLUSH_S, Grouped, Outbox
from .resources import DeviceSetup
from .running import JobRunner
from .segments import Segments
from .turns import MIN_S, Turns
from .values import let_go

POLL_MS = 200  # how long the receiving thread waits on the socket before looking around
PART_MS = int(chunking.PART_S * 1000)  # ... while chunks are here (see send_due_parts)
WATCHDOG_S = 0.5
PROMOTE_S = 0.002  # a receiver that has run jobs this long hands the receiving to a follower
TICK_S = 0.002  # how often a follower looks, while jobs keep coming (a wakeup each: not too often)
ACTIVE_S = 0.1  # after this long without a job, followers sleep until the next one
MAX_THREADS = 64  # serving threads: one per piece running at once, and one receiving
BEHIND = 256  # messages read_behind keeps read ahead at most
_STOP = object()  # next_turn's answer when the worker is stopping


class Worker:
    def __init__(self, args, secret: bytes):
        self.id = args.id
        self.device = args.device
        self.host_pid = args.host_pid
        self.prefix = args.prefix
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
        self.receiver = transport.Receiver(self.inbox)
        self.spins = False  # the receiving thread looks for the next Task before it sleeps (see `receive`)
        self.behind: deque = deque()  # messages read_behind read, handled in order by `receive` (its thread's)
        # Who does what (all under `cv`): one thread receives; threads take runnable lanes.
        self.lock = threading.RLock()
        self.cv = threading.Condition(self.lock)  # (taken as `with self.lock`: one call, not three)
        self.receiving = None  # the thread that receives now
        self.receiver_busy_since = None  # when that thread went off to run jobs itself
        self.lanes = Lanes()  # each piece's jobs waiting here (and which the host cancelled)
        self.active_until = 0.0  # followers tick until then (jobs came recently)
        self.parts_looked_at = 0.0  # when the receiving thread last looked for chunk parts due (send_due_parts)
        self.idle = 0  # threads asleep on cv
        self.running = 0  # threads running a lane
        self.serving = 1
        self.stopping = threading.Event()
        self.turns = Turns()  # jobs of pieces that hold the GIL run one at a time
        self.segments = Segments(args.prefix, args.arena)
        self.status = StatusPage(args.status, create=True)
        self.devices = DeviceSetup(self.device, max(1, args.threads))  # torch's threads, CUDA's device
        self.runner = JobRunner(self.id, self.status, self.devices, self.segments.get_store, args.max_memory)
        self.library = self.runner.library  # what this worker knows: node code, nodes, pieces
        self.outbox = Outbox(self.zctx, args.results, secret, self.id, self.segments, self.runner)
        self.preload_torch = args.preload_torch or self.devices.cuda

    # -- life --------------------------------------------------------------------------------
    def serve(self) -> int:
        threading.current_thread().name = "lane 0"  # serving threads are named by what they do (the trace shows them)
        signal.signal(signal.SIGTERM, self.terminated)
        self.devices.when_torch_imports()
        threading.Thread(target=self.watch_host, name="soma-watchdog", daemon=True).start()
        self.outbox.send(protocol.Hello(self.id, os.getpid(), self.device))
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
                remove_pool(self.prefix, self.run_dir, spill=None)
                os._exit(0)

    def terminated(self, signum, _frame) -> None:
        """SIGTERM: unlink our segments, then die of the signal, so the host can say what ended us."""
        self.segments.close()
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
        self.segments.close()
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
        self.runner.observer.serving()  # (jobs run on this thread, not a wave's branches)
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
            if self.lanes.chunks:
                self.send_due_parts()
            if message is None:
                self.trim_if_idle()
            elif type(message) is Task:
                lane = self.accept(message)
                self.read_behind()
                if lane is not None:
                    # From now on a follower may take the receiving over (after PROMOTE_S): not before, while
                    # this thread still reads the socket in read_behind (one socket, one thread at a time).
                    with self.lock:
                        self.going_off()
                    self.run_lane(lane, receiver=me)
                    with self.lock:
                        self.running -= 1
            else:
                self.handle(message)

    def next_turn(self, me):
        """What this serving thread does next: a runnable lane, None (it receives), or _STOP.

        It waits until one of those is there: a follower ticks every TICK_S while jobs keep
        coming (the receiver may have gone off to run one), and sleeps untimed when the
        worker is idle.
        """
        with self.lock:  # (the lock of `cv`, which it waits on: one call to take it, not three)
            while True:
                if self.stopping.is_set():
                    return _STOP
                if self.lanes.runnable:
                    self.running += 1
                    if self.receiving is me:  # (the receiver goes off to run a lane itself)
                        self.going_off()
                    return self.lanes.runnable.popleft()
                if self.receiving is None or self.receiving is me:
                    self.receiving, self.receiver_busy_since = me, None
                    return None
                now = time.monotonic()
                busy = self.receiver_busy_since
                if busy is not None and now - busy > PROMOTE_S:
                    self.receiving, self.receiver_busy_since = me, None  # the busy one follows when done
                    return None
                if now < self.active_until or busy is not None:  # (jobs came lately, or the receiver is off)
                    self.cv.wait(TICK_S)
                else:
                    self.idle += 1
                    self.cv.wait()
                    self.idle -= 1

    def going_off(self) -> None:
        """The receiving thread goes off to run a lane (under the lock): a follower takes the receiving over after
        PROMOTE_S, one asleep untimed woken to look (held up past ACTIVE_S, in read_behind on a loaded machine,
        the receiver went off to a long job with every follower asleep and nobody to read the socket)."""
        self.receiver_busy_since = time.monotonic()
        if self.idle:
            self.cv.notify()

    def trim_if_idle(self) -> None:
        # (running: idle for 0 s, so only a want of room is heard: a worker running a long input gives back
        # what it keeps for reuse to the other worker that lacks room for its outputs)
        self.segments.trim_if_idle(0.0 if self.running else time.monotonic() - self.active_until)

    def receive(self):
        # While chunks are here, look at least every PART_S whether one holds outputs behind a long input.
        # (spinning while Tasks come quickly and the machine has a core to spare: a run after run keeps this
        # vCPU awake, see transport.Receiver.wait; asked as a Task arrives, when this side's threads are calm)
        if self.behind:
            return self.behind.popleft()
        frame = self.receiver.wait(PART_MS if self.lanes.chunks else POLL_MS, self.spins)
        if frame is None:
            return None
        message = protocol.parse(self.secret, frame, "the host")
        if type(message) is Task:
            self.spins = not transport.cores_wanted()
        return message

    def read_behind(self) -> None:
        """Read what is queued behind a Task before its jobs start (kept in order for `receive`, at most BEHIND),
        and cancel now the jobs its Cancels name: of that Task, and of the Tasks read (`Lanes.cancel`).
        Why: a Task that waited (its worker busy, or stopped a moment by a loaded machine) has its Cancel right
        behind it, and run at once it started first: `future.cancel()` of an input not started returned True,
        and the node ran. After every Task, not only while another lane runs (a worker that finished its other
        input just before it read the Task ran it: 1 in 3 of the test's tries, Dec 7), and past the Tasks behind
        it (Task a, Task b, Cancel a, Cancel b: a ran). The Tasks read wait their turn at this thread, as they
        would in the socket: queued at once, each lane got a thread (a burst of 900 made 64 for good). A look
        costs ~1.5 µs."""
        behind = self.behind
        read = len(behind)
        while len(behind) < BEHIND and (frame := self.receiver.queued()) is not None:
            behind.append(protocol.parse(self.secret, frame, "the host"))
        cancels = {i for m in itertools.islice(behind, read, None) if type(m) is Cancel for i in m.jobs}
        if cancels:  # (each Cancel is also handled in its turn: a chunk's inputs are answered then)
            with self.lock:
                self.lanes.cancel(cancels, coming=[m for m in behind if type(m) is Task])

    def handle(self, message) -> None:
        """Act on a message other than a Task (`accept`'s)."""
        if isinstance(message, Free):
            self.segments.free(message.frees)
        elif isinstance(message, Cancel):
            wanted = set(message.jobs)
            with self.lock:
                chunks = self.lanes.cancel(wanted)
            if chunks:
                self.answer_chunks(chunks, wanted, [])
        elif isinstance(message, GiveBack):
            wanted = set(message.jobs)
            with self.lock:
                returned, chunks = self.lanes.give_back(wanted)
            for job in returned:  # (never decoded here: what the host lent with them is let go)
                let_go(job.payload, self.segments.get_store)
            self.answer_chunks(chunks, wanted, [job.id for job in returned], give_back=True)
        elif isinstance(message, Stop):
            self.stopping.set()
            self.finish()
        else:
            warn("soma.worker", "soma worker %s: dropped a %s message a host should not send", self.id,
                 type(message).__name__)

    def accept(self, task: Task):
        """Register the task's code and pieces, queue its jobs; this thread takes the first runnable lane."""
        try:
            if task.forget:
                self.forget(task.forget)
            if task.frees:
                self.segments.free(task.frees)
            self.segments.told(task.held, task.room_s)  # (what the caller's results hold, how long room is awaited)
            if task.code or task.pieces:
                # Registered while this thread still receives: a later job that counts on this code
                # (the host sends it once per worker) may run on another thread before it gets here.
                self.library.register(task.code, task.pieces, task.sys_path)
        except Exception as err:  # an authentic but malformed message must not take the worker down
            warn("soma.worker", "soma worker %s: dropped a malformed Task: %s: %s", self.id, type(err).__name__, err)
            return None
        now = time.monotonic()
        with self.lock:
            for entry in task.jobs:
                self.lanes.add(entry)
            runnable = self.lanes.runnable
            if not runnable:
                return None
            mine = runnable.popleft()
            waking = now >= self.active_until
            self.active_until = now + ACTIVE_S
            # Someone must receive while this thread runs jobs, and every other runnable lane needs a thread.
            wanted = 1 + len(runnable)
            free = self.serving - 1 - self.running  # threads other than this one, not running a lane
            self.running += 1
            for _ in range(min(wanted - free, MAX_THREADS - self.serving)):
                self.serving += 1
                threading.Thread(target=self.serve_forever, name=f"lane {self.serving - 1}", daemon=True).start()
            if runnable or (waking and self.idle):
                self.cv.notify(len(runnable) + 1)
        return mine

    # -- running a lane ------------------------------------------------------------------------------
    def run_lane(self, lane: Lane, receiver=None) -> None:
        """Run the lane's turns in order until it is empty; outcomes travel grouped (outbox.Grouped).
        `receiver`: this thread, when it received the lane's job itself (it goes back to receiving after)."""
        outcomes = Grouped(self.outbox)
        lock, lanes, pieces, runner = self.lock, self.lanes, self.library.pieces, self.runner
        while True:
            with lock:
                taken = lanes.take_turn(lane, pieces)
                if taken is None:
                    if receiver is not None and self.receiving is receiver:
                        self.receiver_busy_since = None
                    break
            turn, dropped = taken
            first = turn[0]
            if type(first) is ChunkRun:
                self.run_chunk(first, lane, outcomes)
                continue
            pace = lane.pace
            lone = len(turn) == 1 and type(first) is JobSpec  # (else a batching piece's turn, or a Bundle)
            if not lone or (pace if pace is not None else FLUSH_S) >= FLUSH_S:
                # The next turn may be long (a batch; a piece not known to be quick): what is done goes now,
                # so that it neither waits for that turn nor dies with this worker if that turn ends it (it
                # would run again elsewhere: the status page no longer names it).
                outcomes.flush()
            if not lone:
                for outcome in runner.run_turn(turn, dropped):
                    lane.pace = outcome.seconds
                    outcomes.add(outcome, outcome.seconds)
                continue
            # A job of a piece that computes waits while another such job computes here (turns.py). A piece
            # whose last job took under MIN_S takes no turn: turns.enter would say so, here it costs no call.
            token = self.turns.enter(first.piece, pace) if pace is None or pace >= MIN_S else None
            try:
                outcome = runner.outcome_of(first, dropped)
            finally:
                if token is not None:
                    self.turns.leave(first.piece, token)
            lane.pace = outcome.seconds
            outcomes.add(outcome, outcome.seconds)
            if not lane.jobs:  # nothing behind it (a peek without the lock: one queued just now goes next time)
                outcomes.flush()  # its outcome goes now, not after the lock is taken again to find that out
        outcomes.flush()

    def run_chunk(self, run: ChunkRun, lane: Lane, outcomes: Grouped) -> None:
        """A chunk's inputs, one by one on this thread (chunks.py): its parts go out as they are due, the
        last with the lane's other outcomes."""
        outcomes.flush()  # (a chunk may take a while: what is done goes first)
        try:
            part = chunking.run_chunk(self.runner, run, lane, self.turns, lambda part: self.outbox.result([part]))
        finally:
            with self.lock:
                self.lanes.finished(run)
        if part is not None:
            outcomes.add(part, part.seconds * len(part.ids))

    def send_due_parts(self) -> None:
        """Send what the running chunks have done, where it has waited PART_S behind a long input."""
        now = time.monotonic()
        if now - self.parts_looked_at < chunking.PART_S:
            return
        self.parts_looked_at = now
        with self.lock:
            running = list(self.lanes.chunks)
        for run in running:
            chunking.send_due(self.runner, run, lambda part: self.outbox.result([part]))

    def answer_chunks(self, chunks: list, wanted: set, returned: list, give_back: bool = False) -> None:
        """A Cancel's or a GiveBack's answer for the chunks it names, now (the receiving thread: their lanes'
        threads may be busy with an input for a while). A GiveBack is always answered, `returned` or not."""
        parts: list = []
        for run in chunks:
            returned += chunking.answer_now(self.runner, run, wanted, give_back, parts)
        if parts or give_back:
            self.outbox.result(parts, returned)

    def forget(self, keys: list) -> None:
        """The host's copies of these nodes are gone: drop them, their pieces, and those pieces' idle lanes."""
        self.library.forget(keys)
        known = self.library.specs
        with self.lock:
            self.lanes.forget(known)
        self.turns.forget_unknown(known)
