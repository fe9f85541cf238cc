"""The driver's book of actors: which Ray actors hold copies of which node, and which copy takes an input.

    NodeCopies(node "encoder", cuda:0, code in the object store, options, limit)
        copies: [Copy(actor, load=2, ready), Copy(actor, load=1, ready), Copy(actor, starting)]
        pick() → the ready copy with the fewest inputs in flight; when every copy is
                 busy and the limit allows, start one more (used once it has said hello)

A copy that is still starting takes no inputs while another copy is ready: a new
actor can take seconds to start (a process, imports, the node's code), and
inputs routed to it would wait while a warm copy idles. The first copy of a node
takes inputs at once (there is nothing else). A copy that dies is dropped here
and killed; the next input that needs the node starts a new one.

Everything here runs under the runner's lock.
"""

from __future__ import annotations

import sys


class Copy:
    """One actor holding one copy of a node; `load` counts the inputs routed to it and not yet finished."""

    __slots__ = ("actor", "actor_id", "hello", "pid", "ray_node", "load", "ready", "offset_ns", "owner", "stopped",
                 "methods")

    def __init__(self, actor, hello_ref, owner: "NodeCopies"):
        self.actor = actor
        self.actor_id: str = actor._actor_id.hex()
        self.hello = hello_ref  # resolves to (pid, Ray node id) once the actor is up
        self.pid: int | None = None
        self.ray_node: str | None = None
        self.load = 0
        self.ready = False
        self.offset_ns: int | None = None  # the driver's clock minus this actor's (traces); None: not measured
        self.owner = owner
        self.stopped: str | None = None  # why soma stopped it on purpose (the other inputs it held hear this)
        self.methods: dict = {}  # (method, k) → that method with `num_returns=k`: a batch's call

    def batched(self, method: str, k: int):
        """`method` of this actor returning `k` values, one ref each (made once per size: Ray's `options`)."""
        bound = self.methods.get((method, k))
        if bound is None:
            bound = self.methods[(method, k)] = getattr(self.actor, method).options(num_returns=k)
        return bound

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid is not None else "pid not known yet"
        return f"Ray actor {self.actor_id} ({pid})"


class NodeCopies:
    """The actors holding copies of one node object, under one id and one placement."""

    def __init__(self, ray, actor_class, node_id: str, device: str | None, code_ref, options: dict, limit: int):
        self.ray = ray
        self.actor_class = actor_class.options(**options)  # Ray checks the option names here, before any actor
        self.node_id = node_id
        self.device = device
        self.code_ref = code_ref
        self.limit = limit
        self.copies: list[Copy] = []

    def pick(self, inputs: int = 1) -> Copy:
        """The copy that takes the next input, or batch of `inputs` (see the module's drawing); its load is
        counted."""
        live = self.copies
        if not live:
            best = self.start_copy()
        else:
            ready = [c for c in live if c.ready or self.has_said_hello(c)]
            best = min(ready or live[:1], key=_load)
            if best.load > 0 and len(self.copies) < self.limit and len(ready) == len(self.copies):
                self.start_copy()  # every copy is busy: one more, for the inputs after this one
        best.load += inputs
        return best

    def start_copy(self) -> Copy:
        actor = self.actor_class.remote(self.node_id, self.device, self.code_ref, list(sys.path))
        copy = Copy(actor, control(actor, "hello"), self)
        self.copies.append(copy)
        return copy

    def has_said_hello(self, copy: Copy) -> bool:
        """Whether a starting copy is up now (never blocks)."""
        ready, _ = self.ray.wait([copy.hello], timeout=0)
        if ready:
            self.learn(copy)
        return copy.ready

    def learn(self, copy: Copy) -> None:
        """Read a copy's hello once it has come (its pid and machine)."""
        try:
            copy.pid, copy.ray_node = self.ray.get(copy.hello, timeout=0)
            copy.ready = True
        except Exception:  # it died starting: a run that used it reports how; it takes nothing more
            if copy in self.copies and len(self.copies) > 1:
                self.copies.remove(copy)

    def drop(self, copy: Copy) -> None:
        """This copy is dead, or stopped by soma (a timeout): forget it and make sure its process ends."""
        if copy in self.copies:
            self.copies.remove(copy)
        try:
            self.ray.kill(copy.actor, no_restart=True)
        except Exception:
            pass  # already gone

    def close(self) -> None:
        for copy in list(self.copies):
            self.drop(copy)


def control(actor, method: str, *args):
    """Call one of a copy's control methods in their own concurrency group: it never waits behind an input."""
    return getattr(actor, method).options(concurrency_group="control").remote(*args)


def _load(copy: Copy) -> int:
    return copy.load
