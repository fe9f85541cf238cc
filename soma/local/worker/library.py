"""What a worker knows: node code as the host sent it, the nodes loaded from it, and the pieces it can run.

    Task.code   {key: blob}  ─ register ─▶ blobs ─ node(): unpickled once, on first use ─▶ nodes
    Task.pieces {id: spec}   ─ register ─▶ specs ─ load(): plan + Interpreter over the nodes ─▶ pieces (Loaded)
    Task.forget [key]        ─ forget ───▶ those nodes, and every piece naming one, are dropped
    Task.sys_path [str]      ─ register ─▶ sys.path: the host's, changed since we had it, searched by its code

A node's copy lives in `nodes` from its first input on (its state is here); a
piece whose code fails to load is not kept, so the next input tries again.
"""

from __future__ import annotations

import sys
import threading

from ...errors import NodeError, traceback_text
from ...plan import first_step, last_step
from ...run.batching import is_batching, max_batch_of
from ...wire import protocol


class Loaded:
    """A piece this worker can run: its plan, an Interpreter over its nodes' copies here, its first and last node,
    and `batch`: how many of its jobs run together (a batching node's max_batch; 0 when it has none)."""

    __slots__ = ("batch", "each", "each_held", "entry", "interpreter", "plan", "producer")

    def __init__(self, plan, interpreter, entry: str, producer: str):
        self.plan = plan
        self.interpreter = interpreter
        # A one-node piece that takes no batches: `each(x)` runs its node on an untraced input in a few calls,
        # not through Interpreter.run's RunState (the caller names the node on the status page itself); else None.
        self.each = interpreter.each(plan)
        self.each_held = interpreter.each_held(plan)  # (lock, call): a chunk's run of quick inputs (chunks.py)
        self.batch = max((max_batch_of(n) for n in interpreter.nodes.values() if is_batching(n)), default=0)
        self.entry = entry  # named on the status page while its input is decoded
        self.producer = producer  # ... and while its output is encoded


class Library:
    """`make_interpreter(nodes, devices)` builds the Interpreter of a piece from its nodes' copies and their devices."""

    def __init__(self, worker_id: str, make_interpreter):
        self.worker_id = worker_id
        self.make_interpreter = make_interpreter
        self.blobs: dict[int, bytes] = {}  # node key → code received and not loaded yet
        self.nodes: dict[int, object] = {}  # node key → the node object (its copy lives here)
        self.specs: dict[int, bytes] = {}  # piece id → spec
        self.pieces: dict[int, Loaded] = {}  # piece id → the piece, once its nodes are loaded
        self.lock = threading.Lock()
        self.host_path = list(sys.path)  # the host's sys.path as last given (main.py set it at our start)

    def register(self, code: dict, pieces: dict, sys_path: list | None = None) -> None:
        """Code and piece specs a Task carries (registered before its jobs run anywhere), and the host's sys.path
        when it changed since we were given it (before the code that may need it is loaded)."""
        with self.lock:
            if sys_path is not None:
                self.adopt_path(sys_path)
            self.blobs.update(code)
            self.specs.update(pieces)

    def adopt_path(self, host_path: list) -> None:
        """Search `host_path`, the host's sys.path now: what it added or removed since we had it, here too. An
        entry a node added here itself (not the host's) is kept, after the host's: its node counts on it."""
        before = set(self.host_path)
        ours = [p for p in sys.path if p not in before and p not in host_path]
        sys.path[:] = list(host_path) + ours
        self.host_path = list(host_path)

    def describe(self, piece_id: int) -> tuple:
        """`(plan, {node id: (key, device)}, first node, last node)` of a piece the host has described."""
        spec = self.specs.get(piece_id)
        if spec is None:
            raise NodeError.failed("?", f"worker {self.worker_id} was sent an input for piece {piece_id} it was "
                                        f"never told about (a bug in soma: please report it)")
        plan, steps = protocol.parse_piece(spec)
        return plan, steps, first_step(plan), last_step(plan)

    def load(self, piece_id: int, plan, steps: dict, entry: str, producer: str) -> Loaded:
        """The piece with an Interpreter over this worker's copies of its nodes, loading their code the first time."""
        nodes = {node_id: self.node(node_id, key) for node_id, (key, _) in steps.items()}
        devices = {node_id: device for node_id, (_, device) in steps.items() if device}
        piece = Loaded(plan, self.make_interpreter(nodes, devices), entry, producer)
        with self.lock:
            if piece_id in self.specs:  # (not forgotten meanwhile: then it is not kept)
                self.pieces[piece_id] = piece
        return piece

    def node(self, node_id: str, key: int):
        node = self.nodes.get(key)
        if node is not None:
            return node
        with self.lock:  # once per node, however many lanes want it at the same moment
            node = self.nodes.get(key)
            if node is not None:
                return node
            blob = self.blobs.get(key)
            if blob is None:
                raise NodeError.failed(node_id, f"worker {self.worker_id} was not sent its code (a bug in soma: "
                                                f"please report it)")
            node = self._unpickle(node_id, blob)  # a failure keeps the code: the next input tries again
            self.nodes[key] = node
            del self.blobs[key]
        return node

    def _unpickle(self, node_id: str, blob: bytes):
        from ...wire import nodecode

        try:
            return nodecode.loads(blob)
        except (Exception, SystemExit) as err:  # (SystemExit: a module that calls argparse as it is imported)
            raise NodeError.failed(
                node_id,
                f"its code could not be loaded in worker {self.worker_id}: {type(err).__name__}: {err} "
                f"({nodecode.why_not_loaded(err)})",
                remote_traceback=traceback_text(err),
            ) from err

    def forget(self, keys: list) -> None:
        """The host's copies of these nodes are gone: no graph can send them here again."""
        gone = set(keys)
        with self.lock:
            for key in keys:
                self.nodes.pop(key, None)
                self.blobs.pop(key, None)
            for piece_id, spec in list(self.specs.items()):
                _, steps = protocol.parse_piece(spec)
                if any(key in gone for key, _ in steps.values()):
                    del self.specs[piece_id]
                    self.pieces.pop(piece_id, None)
