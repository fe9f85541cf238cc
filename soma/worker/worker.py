"""The worker's serving loop: receive, run, send back. See `soma.worker` for the drawing."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import msgpack
import zmq

from .. import wire
from .._log import warn
from ..errors import NodeError, PostconditionError, traceback_text
from ..execute import RunState, Runner, count_in
from ..plan import Seq, Step, Wave, last_step


POLL_MS = 200  # how long the leading thread waits on the socket before looking around
WATCHDOG_S = 0.5
PROMOTE_S = 0.002  # a task running longer than this on the leading thread hands the lead to a follower
TICK_S = 0.002  # how often a follower looks, while tasks keep coming (a wakeup each: not too often)
ACTIVE_S = 0.1  # after this long without a task, followers sleep until the next one
PLAN_CACHE = 1024  # branch specs kept decoded


class Worker:
    def __init__(self, args, secret: bytes):
        self.id = args.id
        self.device = args.device
        self.threads = max(1, args.threads)
        self.host_pid = args.host_pid
        self.prefix = args.prefix
        self.arena = args.arena
        self.secret = secret
        self.zctx = wire.context()
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
        self.receiver = wire.Receiver(self.inbox)
        self.send_lock = threading.Lock()
        self.lead_cv = threading.Condition()
        self.leader = None  # the thread that receives now
        self.busy_since = None  # when the leading thread started running a task itself
        self.active_until = 0.0  # followers tick until then (tasks came recently)
        self.followers_asleep = 0
        self.serving_threads = 1
        self.stopping = threading.Event()
        self.nodes: dict[int, object] = {}  # node key → the node object (its state lives here)
        self.blobs: dict[int, bytes] = {}  # node key → code received and not loaded yet
        self.load_lock = threading.Lock()
        self.plans: dict[bytes, tuple] = {}  # branch spec → (plan, ids → keys, devices)
        self.status = wire.StatusPage(args.status, create=True)
        self.status_lock = threading.Lock()
        self.now_running: dict[str, int] = {}
        self.store = None
        self.store_lock = threading.Lock()
        self.torch_ready = False
        self.torch_lock = threading.Lock()
        self.local = threading.local()
        self.preload_torch = args.preload_torch or self.device.startswith("cuda")

    # -- life --------------------------------------------------------------------------------
    def serve(self) -> int:
        signal.signal(signal.SIGTERM, self.terminated)
        threading.Thread(target=self.watch_host, name="soma-watchdog", daemon=True).start()
        self.send([wire.HELLO, self.id, os.getpid(), self.device])
        if self.preload_torch:
            # After HELLO, not before: importing torch takes a second or more, and the pool is ready
            # without it. A task that needs torch meanwhile waits on the import, as it would anyway.
            threading.Thread(target=self.setup_torch, name="soma-torch", daemon=True).start()
        try:
            self.lead_and_run()
        finally:
            self.finish()
        return 0

    def watch_host(self) -> None:
        """Exit soon after the host is gone (our parent changes when it dies)."""
        while not self.stopping.wait(WATCHDOG_S):
            if os.getppid() != self.host_pid:
                from ..shm import unlink_all

                unlink_all(self.prefix)  # the host cannot clean up any more; whoever notices does
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
        under them would raise in each. The host has asked us to stop (or is gone),
        so nothing still in flight is wanted; the kernel closes the sockets.
        """
        if self.store is not None:
            self.store.close()
        self.status.close()
        os._exit(0)

    # -- receiving: the lead, and who takes it when a task runs long ------------------------------
    def lead_and_run(self) -> None:
        """Every serving thread runs this: lead (receive and run what arrives) or wait to take the lead.

        The thread that receives a task runs it itself and keeps the lead: no hand-off
        between threads on a task's way, which costs as much as the task itself for a
        small one. Only when a task runs longer than PROMOTE_S does a follower take the
        lead, so tasks of concurrent runs are still received while a long one runs.
        Followers tick every TICK_S while tasks keep coming and sleep untimed when the
        worker is idle, so an idle worker uses no CPU.
        """
        me = threading.current_thread()
        while not self.stopping.is_set():
            with self.lead_cv:
                while self.leader is not None and self.leader is not me:
                    if self.stopping.is_set():
                        return
                    if time.monotonic() < self.active_until:
                        self.lead_cv.wait(TICK_S)
                        busy = self.busy_since
                        if busy is not None and time.monotonic() - busy > PROMOTE_S:
                            self.leader, self.busy_since = me, None  # the busy thread follows when done
                    else:
                        self.followers_asleep += 1
                        self.lead_cv.wait()
                        self.followers_asleep -= 1
                self.leader = me
            message = self.receive()
            if message is None:
                continue
            if message[0] == wire.TASK:
                self.start_task(message)
            try:
                self.handle(message)
            except Exception as err:  # an authentic but malformed message must not take the worker down
                warn("soma.worker", "soma worker %s: dropped a %s message it could not handle: %s: %s",
                     self.id, wire.KIND_NAMES.get(message[0]), type(err).__name__, err)
            finally:
                if message[0] == wire.TASK:
                    with self.lead_cv:
                        if self.leader is me:
                            self.busy_since = None

    def start_task(self, message: list) -> None:
        """Before running a task on the leading thread: make sure someone can take the lead."""
        now = time.monotonic()
        with self.lead_cv:
            self.busy_since = now
            waking = now >= self.active_until
            self.active_until = now + ACTIVE_S
            if self.serving_threads < 2:
                self.serving_threads += 1
                threading.Thread(target=self.lead_and_run, name="soma-follower", daemon=True).start()
            elif waking and self.followers_asleep:
                self.lead_cv.notify()  # the first task after a quiet spell: followers start ticking

    def receive(self):
        frames = self.receiver.wait(POLL_MS)
        message = None if frames is None else wire.unseal(self.secret, frames, "the host")
        if message is not None and message[0] == wire.TASK:
            if not well_formed_task(message):
                warn("soma.worker", "soma worker %s: dropped a malformed TASK message", self.id)
                return None
            if message[2]:
                # Registered while this thread still leads: a later task that counts on this code (the
                # host sends it once per worker) may run on another thread before this one gets to it.
                with self.load_lock:
                    self.blobs.update(message[2])
        return message

    def send(self, message: list) -> None:
        frame = wire.seal(self.secret, message)
        with self.send_lock:
            self.outbox.send(frame)

    def handle(self, message: list) -> None:
        kind = message[0]
        if kind == wire.TASK:
            self.run_task(*message[1:])
        elif kind == wire.FREE:
            store = self.get_store()
            for name, n in message[1]:
                store.free(name, n)
        elif kind == wire.STOP:
            self.stopping.set()
            self.finish()

    # -- running a task ---------------------------------------------------------------------------
    def run_task(self, task_id: int, _code: dict, branches: list, payload: bytes, frees: list,
                 forget: list) -> None:
        if forget:
            self.forget(forget)
        # _code was registered when the message was received (see receive()).
        if frees:
            store = self.get_store()
            for name, n in frees:
                store.free(name, n)
        outcomes = self.run_branches(branches, payload)
        # The input and the outputs are dropped by now: what died is reported with the result.
        releases = self.store.releases() if self.store is not None else []
        self.send([wire.RESULT, self.id, task_id, outcomes, releases])

    def run_branches(self, branches: list, payload: bytes) -> list:
        specs = []
        for spec in branches:
            try:
                specs.append(self.branch(spec))
            except NodeError as err:
                return [error_outcome(err)] * len(branches)
        decoder = wire.Decoder(self.get_store)
        try:
            x = decoder.unpack(payload)
        except Exception as err:
            first = specs[0][0]
            entry = next(first.steps())
            return [error_outcome(NodeError(entry, f"node `{entry}` failed: its input could not be received "
                                                   f"in worker {self.id}: {type(err).__name__}: {err}"))] * len(specs)
        self.setup_torch_if_imported()
        state = RunState(observer=self)
        if len(specs) == 1:
            return [self.run_branch(specs[0], x, state)]
        # Several branches of one wave came to this worker together: each on a thread, as in-process.
        outcomes: list = [None] * len(specs)

        def one(i):
            outcomes[i] = self.run_branch(specs[i], x, state)

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(1, len(specs))]
        for t in threads:
            t.start()
        one(0)
        for t in threads:
            t.join()
        return outcomes

    def run_branch(self, spec: tuple, x, state: RunState) -> list:
        plan, nodes, devices = spec
        runner = Runner(nodes, devices, worker=self.id, allocate=self.allocate, remote=True, on_thread=self.on_thread)
        self.on_thread()
        try:
            value = runner.run(plan, x, state)
        except NodeError as err:
            return error_outcome(err)
        encoder = wire.Encoder(self.get_store)
        producer = last_step(plan)
        try:
            data = encoder.pack(value)
        except wire.GradCrossing as err:
            return error_outcome(NodeError(producer, f"node `{producer}` failed: it returned {err}"))
        except Exception as err:
            return error_outcome(NodeError(
                producer, f"node `{producer}` failed: its output cannot be sent back to the host: "
                          f"{type(err).__name__}: {err} (return plain data, tensors, or picklable objects)"))
        if encoder.shared:
            store = self.get_store()
            for name in encoder.shared:
                store.note_sent(name)
        return [True, data]

    def branch(self, spec: bytes) -> tuple:
        """The (plan, id → node, id → device) of a branch spec, loading node code it needs."""
        found = self.plans.get(spec)
        if found is None:
            tree = msgpack.unpackb(spec, raw=False, use_list=False)
            nodes_by_key: dict = {}
            plan = build_plan(tree, nodes_by_key)
            found = (plan, nodes_by_key, {nid: dev for nid, (_, dev) in nodes_by_key.items() if dev})
        plan, keyed, devices = found
        nodes = {}
        for nid, (key, _) in keyed.items():
            node = self.nodes.get(key)
            if node is None:
                node = self.load(nid, key)
            nodes[nid] = node
        if len(self.plans) >= PLAN_CACHE:
            self.plans.pop(next(iter(self.plans)))  # the oldest: graphs come and go
        self.plans[spec] = found
        return plan, nodes, devices

    def forget(self, keys: list) -> None:
        """The host's copies of these nodes are gone: no graph can send them here again."""
        with self.load_lock:
            for key in keys:
                self.nodes.pop(key, None)
                self.blobs.pop(key, None)

    def load(self, node_id: str, key: int):
        with self.load_lock:  # once per node, however many tasks want it at the same moment
            node = self.nodes.get(key)
            if node is not None:
                return node
            blob = self.blobs.pop(key, None)
            if blob is None:
                raise _LoadError(node_id, f"node `{node_id}` failed: worker {self.id} has no code for it "
                                          f"(its loading failed in another task of this run)")
            return self._unpickle(node_id, key, blob)

    def _unpickle(self, node_id: str, key: int, blob: bytes):
        import pickle

        try:
            node = pickle.loads(blob)  # cloudpickle's output; it imports cloudpickle itself if it needs it
        except Exception as err:
            raise _LoadError(
                node_id,
                f"node `{node_id}` failed: its code could not be loaded in worker {self.id}: "
                f"{type(err).__name__}: {err} (workers start with the host's sys.path and working directory; "
                f"define the node in a module they can import)",
                remote_traceback=traceback_text(err),
            ) from err
        self.nodes[key] = node
        self.setup_torch_if_imported()
        return node

    # -- what runs now, published for the host ----------------------------------------------------
    def enter(self, node_id: str) -> None:
        self.count_running(node_id, +1)

    def leave(self, node_id: str) -> None:
        self.count_running(node_id, -1)

    def count_running(self, node_id: str, delta: int) -> None:
        with self.status_lock:
            count_in(self.now_running, node_id, delta)
            self.status.write(self.now_running)

    # -- torch, devices, shared memory -----------------------------------------------------------
    def setup_torch(self) -> None:
        import torch

        with self.torch_lock:
            if self.torch_ready:
                return
            torch.set_num_threads(self.threads)
            if self.device.startswith("cuda"):
                torch.cuda.set_device(int(self.device.split(":")[1]))
            self.torch_ready = True

    def setup_torch_if_imported(self) -> None:
        # While the background preload runs, torch is in sys.modules half-imported: waiting for it
        # here would hold every task behind a second of imports; the preload configures it when done.
        if not self.torch_ready and not self.preload_torch and "torch" in sys.modules:
            self.setup_torch()

    def on_thread(self) -> None:
        """First thing on every thread that runs nodes: CUDA's current device is per thread."""
        if self.device.startswith("cuda") and not getattr(self.local, "pinned", False):
            import torch

            torch.cuda.set_device(int(self.device.split(":")[1]))
            self.local.pinned = True

    def get_store(self, create: bool = True):
        if self.store is None and create:
            with self.store_lock:
                if self.store is None:
                    from ..shm import SegmentStore

                    self.store = SegmentStore(self.prefix, self.arena)
                    self.setup_torch_if_imported()
        return self.store

    def allocate(self, size: tuple, dtype):
        """`ctx.empty` in a worker: a tensor in a shared segment already mapped here."""
        import torch

        numel = 1
        for s in size:
            numel *= s
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes < wire.INLINE_LIMIT:
            return torch.empty(size, dtype=dtype)  # travels inline anyway
        storage = self.get_store().allocate(nbytes)
        return torch.empty(0, dtype=dtype).set_(storage, 0, size)


def well_formed_task(message: list) -> bool:
    return (len(message) == 7 and isinstance(message[1], int) and isinstance(message[2], dict)
            and isinstance(message[3], list) and isinstance(message[4], bytes) and isinstance(message[5], list)
            and isinstance(message[6], list))


class _LoadError(NodeError):
    """A node's code did not load here; the host must send it again next time."""


def build_plan(tree, nodes_by_key: dict):
    kind = tree[0]
    if kind == "s":
        _, node_id, key, device = tree
        nodes_by_key[node_id] = (key, device)
        return Step(node_id)
    children = tuple(build_plan(child, nodes_by_key) for child in tree[1])
    return Seq(children) if kind == "q" else Wave(children)


def error_outcome(err: NodeError) -> list:
    info = {"node": err.node, "message": err.args[0], "traceback": err.remote_traceback}
    if isinstance(err, PostconditionError):
        info.update(kind="postcondition", declared=err.declared, actual=err.actual)
    elif isinstance(err, _LoadError):
        info.update(kind="load", cause=wire.pickle_exception(err.__cause__) if err.__cause__ else None)
    else:
        info.update(kind="node", cause=wire.pickle_exception(err.__cause__) if err.__cause__ else None)
    return [False, info]
