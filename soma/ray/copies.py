"""The driver's book of actors: which Ray actors hold copies of which node, and which one takes an input.

    ActorBook (under its lock)
      (node key, id, device) → NodeActors("encoder", cuda:0, code in the object store, options, limit)
          actors: [CopyActor(handle, load=2, up), CopyActor(handle, load=1, up), CopyActor(starting)]
          pick() → the actor that is up with the fewest inputs in flight; when every actor is up and
                   busy and the node's `copies` (limit) allow, start one more (used once it says hello)

"Copies" is the node's number (`limit`, from its `copies` attribute or the
cluster's CPUs); the actors are what holds them: one `CopyActor` per copy.

An actor that is still starting takes no inputs while another is up: a new
actor can take seconds to start (a process, imports, the node's code), and
inputs routed to it would wait while a warm one idles. The first actor of a node
takes inputs at once (there is nothing else). An actor that dies is dropped here
and killed; the next input that needs the node starts a new one.
"""

from __future__ import annotations

import sys
import threading


class CopyActor:
    """One Ray actor holding one copy of a node; `load` counts the inputs routed to it and not yet finished."""

    __slots__ = ("handle", "actor_id", "hello", "pid", "ray_node", "load", "ready", "offset_ns", "owner", "stopped",
                 "methods")

    def __init__(self, handle, hello_ref, owner: "NodeActors"):
        self.handle = handle  # the Ray actor handle
        self.actor_id: str = handle._actor_id.hex()
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
            bound = self.methods[(method, k)] = getattr(self.handle, method).options(num_returns=k)
        return bound

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid is not None else "pid not known yet"
        return f"Ray actor {self.actor_id} ({pid})"


class NodeActors:
    """The actors holding copies of one node object, under one id and one placement (at most `limit`)."""

    def __init__(self, ray, actor_class, node_id: str, device: str | None, code_ref, options: dict, limit: int):
        self.ray = ray
        self.actor_class = actor_class.options(**options)  # Ray checks the option names here, before any actor
        self.node_id = node_id
        self.device = device
        self.code_ref = code_ref
        self.limit = limit
        self.actors: list[CopyActor] = []

    def pick(self, inputs: int = 1) -> CopyActor:
        """The actor that takes the next input, or batch of `inputs` (see the module's drawing); its load is
        counted."""
        live = self.actors
        if not live:
            best = self.start_actor()
        else:
            ready = [a for a in live if a.ready or self.has_said_hello(a)]
            best = min(ready or live[:1], key=_load)
            if best.load > 0 and len(live) < self.limit and len(ready) == len(live):
                self.start_actor()  # every actor is busy: one more, for the inputs after this one
        best.load += inputs
        return best

    def start_actor(self) -> CopyActor:
        handle = self.actor_class.remote(self.node_id, self.device, self.code_ref, list(sys.path))
        actor = CopyActor(handle, control(handle, "hello"), self)
        self.actors.append(actor)
        return actor

    def has_said_hello(self, actor: CopyActor) -> bool:
        """Whether a starting actor is up now (never blocks)."""
        ready, _ = self.ray.wait([actor.hello], timeout=0)
        if ready:
            self.learn(actor)
        return actor.ready

    def learn(self, actor: CopyActor) -> None:
        """Read an actor's hello once it has come (its pid and machine)."""
        try:
            actor.pid, actor.ray_node = self.ray.get(actor.hello, timeout=0)
            actor.ready = True
        except Exception:  # it died starting: a run that used it reports how; it takes nothing more
            if actor in self.actors and len(self.actors) > 1:
                self.actors.remove(actor)

    def drop(self, actor: CopyActor) -> None:
        """This actor is dead, or stopped by soma (a timeout): forget it and make sure its process ends."""
        if actor in self.actors:
            self.actors.remove(actor)
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass  # already gone

    def close(self) -> None:
        for actor in list(self.actors):
            self.drop(actor)


class ActorBook:
    """Every node's actors, keyed by (node key, node id, device); `lock` guards them and their loads."""

    def __init__(self):
        self.lock = threading.RLock()
        self._nodes: dict = {}  # (node key, node id, device) → NodeActors

    def get(self, key) -> NodeActors | None:
        return self._nodes.get(key)

    def add(self, key, node_actors: NodeActors) -> None:
        self._nodes[key] = node_actors

    def actors(self) -> list[CopyActor]:
        """Every actor of every node, now."""
        with self.lock:
            return [actor for node_actors in self._nodes.values() for actor in node_actors.actors]

    def learn(self, actor: CopyActor) -> None:
        """Read an actor's hello (its pid and machine) if it has not been read yet."""
        with self.lock:
            if not actor.ready:
                actor.owner.learn(actor)

    def drop(self, actor: CopyActor) -> None:
        """An actor that died, or that soma stopped: forget it (the next input that needs its node starts another)."""
        with self.lock:
            actor.owner.drop(actor)

    def forget(self, node_keys: set) -> None:
        """Stop the actors of these nodes (the caller let them go: they can never run again)."""
        with self.lock:
            for key in [k for k in self._nodes if k[0] in node_keys]:
                self._nodes.pop(key).close()

    def close(self) -> None:
        with self.lock:
            nodes, self._nodes = list(self._nodes.values()), {}
        for node_actors in nodes:
            node_actors.close()


def control(handle, method: str, *args):
    """Call one of an actor's control methods in their own concurrency group: it never waits behind an input."""
    return getattr(handle, method).options(concurrency_group="control").remote(*args)


def _load(actor: CopyActor) -> int:
    return actor.load
