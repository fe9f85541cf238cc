"""The driver's book of actors: which Ray actors hold copies of which node, and which one takes an input.

    ActorBook (the one owner of its lock: every other module calls its methods)
      (node key, id, device) → NodeActors("encoder", cuda:0, code in the object store, options, limit)
          actors: [CopyActor(handle, load=2, up), CopyActor(handle, load=1, up), CopyActor(starting)]
          pick() → the actor that is up with the fewest inputs in flight; when every actor is up and
                   busy and the node's `copies` (limit) allow, start one more (used once it says hello)
          pick(held=True) → a map's held input (soma.ray.spreading): a copy that is up, never a new one
      submit / release      an input's calls picked and sent (soma.ray.submission) / its loads given back
      has_room / add_copy   a map's held inputs: may one go now? / one more copy (the cost model said so)
      startup               how long a copy takes to start: measured from creation to hello, per node

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
import time

from ..errors import SomaError
from . import records
from .spreading import startup_estimate
from .submission import submit

CLOSED = "this soma.Ray is closed; make a new one"
CLOSED_IN_FLIGHT = "this soma.Ray was closed while this run was in flight"


def cut_frames(err: BaseException) -> None:
    """A Ray error caught from `ray.get` loses its traceback: Ray raises it from a local of its own frame
    (worker.get_objects), which that traceback holds, and through it the catching frames too, with what they
    hold (an input's submission and value, an actor), in a cycle kept until the cyclic collector ran (Dec 7)."""
    err.__traceback__ = None


def _private_id(handle) -> str | None:
    """The actor id a Ray handle holds privately (hex), or None where this Ray has no such attribute."""
    try:
        return handle._actor_id.hex()
    except Exception:
        return None

class CopyActor:
    """One Ray actor holding one copy of a node; `load` counts the inputs routed to it and not yet finished."""

    __slots__ = ("handle", "actor_id", "hello", "pid", "ray_node", "load", "ready", "offset_ns", "owner", "stopped",
                 "methods", "death", "dead", "started_at", "up_at", "abandoned")

    def __init__(self, handle, hello_ref, owner: "NodeActors"):
        self.handle = handle  # the Ray actor handle
        # Its Ray actor id (hex), from its hello, or from Ray's error if it died before saying it: Ray 2.60's
        # handle has no public accessor for it. The private `_actor_id`, where it is there, names it from the
        # start, so the start record of an actor stopped or killed before its hello can still be found and
        # removed (a test found one left behind after a session).
        self.actor_id: str | None = _private_id(handle)
        self.hello = hello_ref  # resolves to (pid, Ray node id, actor id) once the actor is up
        self.pid: int | None = None
        self.ray_node: str | None = None
        self.load = 0
        self.abandoned = 0  # of `load`: calls of inputs nobody waits for, which may run on for any time
        self.ready = False
        self.offset_ns: int | None = None  # the driver's clock minus this actor's (traces); None: not measured
        self.owner = owner
        self.stopped: str | None = None  # why soma stopped it on purpose (the other inputs it held hear this)
        self.methods: dict = {}  # (method, k) → that method with `num_returns=k`: a batch's call
        self.death = None  # once dead: what its record said (soma.ray.records.at_death)
        self.dead = False  # dropped: dead, or stopped by soma
        self.started_at = time.monotonic()  # when it was created (its start-up: until its hello came)
        self.up_at: float | None = None  # when its hello came (set on Ray's thread: one store, no lock)

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

    def __init__(self, ray, actor_class, node_id: str, device: str | None, code_ref, options: dict, limit: int,
                 here: str | None = None):
        self.ray = ray
        self.here = here  # the driver's Ray node (a record on it is read without Ray)
        # Several calls at once in one copy: its start record cannot say which had started (soma.ray.records)
        self.concurrent = (options.get("max_concurrency") or 1) > 1
        self.gone: list[CopyActor] = []  # actors found dead while starting, not dropped (their records: `_stop`)
        self.actor_class = actor_class.options(**options)  # Ray checks the option names here, before any actor
        self.node_id = node_id
        self.device = device
        self.code_ref = code_ref
        self.limit = limit
        self.max_batch = 0  # a batching node's max_batch (its calls may carry that many inputs); 0: not batching
        self.actors: list[CopyActor] = []
        self.startups: list[float] = []  # seconds from an actor's creation to its hello (appended on Ray's thread)

    def pick(self, inputs: int = 1, held: bool = False) -> CopyActor:
        """The actor that takes the next input, or batch of `inputs` (see the module's drawing); its load is
        counted.

        `held`: a map's held input (soma.ray.spreading), sent because `has_room` said a copy is free: the least
        loaded copy that is up (while none is, the least loaded one starting); it never starts a copy but the
        node's first (the cost model starts them: `ActorBook.add_copy`)."""
        live = self.actors
        if not live:
            best = self.start_actor()
        else:
            ready = [a for a in live if a.ready or self.has_said_hello(a)]
            best = min(ready or (live if held else live[:1]), key=_load)
            if not held and best.load > 0 and len(live) < self.limit and len(ready) == len(live):
                fresh = self.start_actor()  # every actor is busy: one more, for the inputs after this one
                if best.abandoned:  # (and not behind a call nobody waits for: it may run on for any time)
                    best = fresh
        best.load += inputs
        return best

    def give_back(self, actor: CopyActor, inputs: int) -> None:
        """The call `pick` chose `actor` for was never sent (Ray refused it): its `inputs` are not counted."""
        actor.load -= inputs

    def has_room(self) -> bool:
        """Whether a held input may go now: a copy that is up has no input (while none is up, a starting one has
        none; or the node has no copy yet, and its first starts with it)."""
        if not self.actors:
            return True
        ready = [a for a in self.actors if a.ready or self.has_said_hello(a)]
        return any(a.load == 0 for a in ready or self.actors)

    def start_actor(self) -> CopyActor:
        handle = self.actor_class.remote(self.node_id, self.device, self.code_ref, list(sys.path))
        actor = CopyActor(handle, control(handle, "hello"), self)
        self.actors.append(actor)
        startups = self.startups

        def said_hello(future) -> None:  # (on Ray's thread: two stores, no lock, no Ray call)
            if future.exception() is None:
                actor.up_at = time.monotonic()
                startups.append(actor.up_at - actor.started_at)

        actor.hello.future().add_done_callback(said_hello)
        return actor

    def has_said_hello(self, actor: CopyActor) -> bool:
        """Whether a starting actor is up now (never blocks)."""
        ready, _ = self.ray.wait([actor.hello], timeout=0)
        if ready:
            self.learn(actor)
        return actor.ready

    def still_starting(self, actor: CopyActor) -> bool:
        """Whether its hello has not come yet (never blocks; a hello that came is read: up, or dead)."""
        if actor.ready:
            return False
        ready, _ = self.ray.wait([actor.hello], timeout=0)
        if ready:
            self.learn(actor)
        return not ready

    def learn(self, actor: CopyActor) -> None:
        """Read an actor's hello once it has come (its pid and machine)."""
        try:
            actor.pid, actor.ray_node, actor.actor_id = self.ray.get(actor.hello, timeout=0)
            actor.ready = True
        except self.ray.exceptions.GetTimeoutError:
            pass  # not up yet
        except Exception as err:  # it died starting: a run that used it reports how; it takes nothing more
            cut_frames(err)
            if actor.actor_id is None:
                actor.actor_id = getattr(err, "actor_id", None)
            if actor in self.actors and len(self.actors) > 1:
                self.actors.remove(actor)
                self.gone.append(actor)

    def remove(self, actor: CopyActor) -> None:
        """Forget this actor: it is dead, or soma stops it (it takes no more inputs)."""
        actor.dead = True
        if actor in self.actors:
            self.actors.remove(actor)

    def kill(self, actor: CopyActor) -> None:
        """Make sure its process ends."""
        try:
            self.ray.kill(actor.handle, no_restart=True)
        except Exception:
            pass  # already gone


FORGET_S = 2.0  # how long stopping actors waits for them to remove their start records


class ActorBook:
    """Every node's actors, keyed by (node key, node id, device). Its lock guards them and their loads, and
    only this class takes it: the other modules call its methods."""

    def __init__(self):
        self._lock = threading.RLock()
        self._nodes: dict = {}  # (node key, node id, device) → NodeActors
        self._closed = False

    def get(self, key) -> NodeActors | None:
        with self._lock:
            return self._nodes.get(key)

    def add(self, key, node_actors: NodeActors) -> None:
        with self._lock:
            self._nodes[key] = node_actors

    # -- inputs --------------------------------------------------------------------------------
    def submit(self, graph, xs: list, submissions: list, put) -> None:
        """Pick the actors of these inputs and send every call (soma.ray.submission.submit); nothing stays
        counted when Ray refuses them. A SomaError once the book is closed."""
        with self._lock:
            if self._closed:  # (an input accepted before the close)
                raise SomaError(CLOSED_IN_FLIGHT)
            try:
                submit(graph, xs, submissions, put)
            except BaseException:
                for submission in submissions:
                    self.release(submission)  # (an RLock: taken again here)
                raise

    def release(self, submission, how: str = "ok", unfinished=()) -> None:
        """The try is over (done, failed, expired, abandoned, or "again": the input goes on in another try): its
        actors may take other inputs; once only (`submission.over`), however many paths end it. `unfinished`:
        its calls that may still run (an abandoned input's: Ray cannot stop an actor's call that has begun),
        whose actors take other inputs only once each call's ref is ready (given back then, a cancelled run's
        copy looked free while its node still ran, and the next run queued behind it until its timeout)."""
        with self._lock:
            if submission.over:
                return
            submission.over = True
            for call in submission.calls:
                if call in unfinished:
                    call.actor.abandoned += 1
                else:
                    call.actor.load -= 1
        for call in unfinished:
            call.ref.future().add_done_callback(lambda _, actor=call.actor: self._unload(actor))
        submission.ended(how)

    def _unload(self, actor) -> None:
        """An abandoned call's ref is ready: it ran to its end, was cancelled in time, or its actor died."""
        with self._lock:
            actor.load -= 1
            actor.abandoned -= 1

    def up_now(self, actors: list) -> list:
        """Those of `actors` that are up (their hello came; never waits)."""
        with self._lock:
            return [actor for actor in actors if actor.ready or actor.owner.has_said_hello(actor)]

    # -- a map's held inputs (soma.ray.spreading) ----------------------------------------------
    def has_room(self, nodes) -> bool:
        """Whether every one of these NodeActors can take a held input now (`NodeActors.has_room`)."""
        with self._lock:
            return all(node_actors.has_room() for node_actors in nodes)

    def copies(self, nodes) -> int:
        """The copies (up or starting) of the node among these that has the fewest."""
        with self._lock:
            return min(len(node_actors.actors) for node_actors in nodes)

    def add_copy(self, nodes) -> bool:
        """One more copy of each of these nodes that has the fewest and may have another; whether any started."""
        with self._lock:
            fewest = min(len(node_actors.actors) for node_actors in nodes)
            more = [n for n in nodes if len(n.actors) == fewest and len(n.actors) < n.limit]
            for node_actors in more:
                node_actors.start_actor()
            return bool(more)

    def starting(self, nodes) -> list:
        """The hello refs of these nodes' copies still starting (a wait wakes when one is up)."""
        with self._lock:
            return [a.hello for node_actors in nodes for a in list(node_actors.actors)
                    if node_actors.still_starting(a)]

    def startup(self, nodes) -> tuple[float, str]:
        """How long a copy of these nodes takes to start, and where that figure comes from
        (soma.ray.spreading.startup_estimate)."""
        with self._lock:
            own = [s for node_actors in nodes for s in node_actors.startups]
            others = [s for node_actors in self._nodes.values() for s in node_actors.startups]
        return startup_estimate(own, others)

    def actors(self, node_keys: set | None = None) -> list[CopyActor]:
        """Every actor of every node now (of the nodes whose key is in `node_keys`, when given)."""
        with self._lock:
            return [actor for key, node_actors in self._nodes.items()
                    if node_keys is None or key[0] in node_keys for actor in node_actors.actors]

    def learn(self, actor: CopyActor) -> None:
        """Read an actor's hello (its pid and machine) if it has not been read yet."""
        with self._lock:
            if not actor.ready:
                actor.owner.learn(actor)

    def drop(self, actor: CopyActor) -> None:
        """An actor that died, or that soma stops (a timeout): forget it (the next input that needs its node
        starts another). Its start record is read first (what it had started, once; soma.ray.records)."""
        with self._lock:
            if not actor.ready:
                actor.owner.learn(actor)  # (its pid, machine and id, if its hello came)
            actor.owner.remove(actor)
        owner = actor.owner
        records.at_death(owner.ray, owner.here, actor, owner.concurrent)
        owner.kill(actor)

    def forget(self, node_keys: set) -> None:
        """Stop the actors of these nodes (the caller let them go: they can never run again)."""
        with self._lock:
            gone = [self._nodes.pop(key) for key in [k for k in self._nodes if k[0] in node_keys]]
        self._stop(gone)

    def close(self) -> None:
        """Stop every actor; the book takes no input any more."""
        with self._lock:
            self._closed = True
            nodes, self._nodes = list(self._nodes.values()), {}
        self._stop(nodes)

    @staticmethod
    def _stop(nodes: list) -> None:
        """Stop these nodes' actors; their start records go first (soma.ray.records: each actor that is up
        removes its own, answering within FORGET_S; those on the driver's machine are removed here too)."""
        for node_actors in nodes:
            actors = list(node_actors.actors)
            ray = node_actors.ray
            starting = [actor.hello for actor in actors if not actor.ready]
            if starting:  # an actor still starting makes its record as it ends: let it say hello, then ask
                ray.wait(starting, num_returns=len(starting), timeout=FORGET_S)
            for actor in actors:
                if not actor.ready:
                    node_actors.learn(actor)
            asked = [control(actor.handle, "forget_record") for actor in actors if actor.ready]
            if asked:
                ray.wait(asked, num_returns=len(asked), timeout=FORGET_S)
            records.forget(actors + node_actors.gone)
            for actor in actors:
                node_actors.remove(actor)
                node_actors.kill(actor)
            late = [actor for actor in actors if not actor.ready]
            if late:
                # Still starting when killed (slower than FORGET_S: a loaded machine): it may have made its
                # record since it was looked for. Once its hello has failed it writes nothing more: remove it then.
                ray.wait([actor.hello for actor in late], num_returns=len(late), timeout=FORGET_S)
                records.forget(late)


def control(handle, method: str, *args):
    """Call one of an actor's control methods in their own concurrency group: it never waits behind an input."""
    return getattr(handle, method).options(concurrency_group="control").remote(*args)


def _load(actor: CopyActor) -> int:
    return actor.load
