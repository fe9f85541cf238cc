"""Which call a Ray actor had started when it died: a record the actor keeps on its machine, read after.

Ray does not say. When an actor dies, every call it had been sent and not finished
fails with the same `ActorDiedError` ("The actor died unexpectedly before finishing
this task"), the one it was running and the ones queued behind it alike (measured,
Ray 2.60). Ray's task states (`ray.util.state.list_tasks`) are served by the
dashboard, which a cluster may not run (`include_dashboard=False`, or no
`ray[default]`), and a call's RUNNING event is reported once a second, so the call
that killed its process within that second has none; `ray.timeline()` needs
profiling switched on before the cluster starts, and returned nothing here.

So each actor notes, before each input it runs, which call and which input of the
call it is (one `pwrite` of a fixed-width line over the last one: ~1.4 µs to read
the task id, ~1.8 µs to write, measured), into a file of its own, named by its
actor id, on its machine's tmpfs. A copy runs one call at a time, so the line
names the one input that may have been running; every earlier input of the copy
had finished.

    actor (soma.ray.actor)   /dev/shm/soma_ray_<uid>/<actor id>:  "<pid> <task id hex> 00000003"
                             made at the end of the actor's __init__ (no input yet: "-" for both),
                             overwritten before input 3 of that call starts
    driver, once the actor   `at_death` (soma.ray.copies drops it): read it, here, or by a small Ray
    is dead or stopped       task pinned to the actor's machine, once, and remove it
                             → (task id, position), NOTHING_STARTED, or UNKNOWN
    driver, tries            `started(death, call)`: had the actor started this input's call?

UNKNOWN (its machine died with the record, the record cannot be found or read, its
id was never known, or the copy runs several calls at once: `max_concurrency`)
counts as started: a try is counted, so a poison input cannot loop for ever. A
record exists only once the actor is made, so a death while it is being made is
UNKNOWN too.

Records of actors soma stops itself (close, nodes let go) are removed by the actors
when asked and by the driver on its own machine (`forget`), and the folder with the
last of them, so a closed soma.Ray leaves nothing in /dev/shm; a record nobody removed
(its driver died) is swept by the next actor that starts on its machine once its
process is gone and it is an hour old.
"""

from __future__ import annotations

import os
import tempfile
import time

NOTHING_STARTED = "nothing started"  # the actor was up and had started no input
UNKNOWN = "unknown"  # the record could not be read: counted as started
READ_S = 10.0  # how long the driver waits for the pinned task that reads a record on another machine
STALE_S = 3600.0  # a record whose process is gone, untouched this long, was never read: removed
NONE = b"-" * 48  # the task id of a record of no input yet (a Ray task id is 24 bytes: 48 hex digits)


def folder() -> str:
    """Where this machine's records live: tmpfs when there is one (a write never reaches a disk)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"soma_ray_{os.getuid()}")


class StartRecord:
    """The actor's side: one file of one fixed-width line, `<pid> <task id> <position>`, overwritten before
    each input the actor runs."""

    __slots__ = ("fd", "path", "prefix")

    def __init__(self, actor_id: str):
        where = folder()
        self.path = os.path.join(where, actor_id)  # (named by the actor id alone: the driver needs no hello)
        self.prefix = b"%10d " % os.getpid()
        for attempt in range(3):
            os.makedirs(where, mode=0o700, exist_ok=True)
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                break
            except FileNotFoundError:  # a driver removed the folder, empty, in between (remove_all): again
                if attempt == 2:
                    raise
        _sweep(where)
        os.pwrite(self.fd, self.prefix + NONE + b" --------\n", 0)

    @classmethod
    def made(cls, actor_id: str):
        """This actor's record; a `NoRecord` where none can be written (the driver then counts UNKNOWN)."""
        try:
            return cls(actor_id)
        except OSError:
            return NoRecord()

    def note(self, task_id: bytes, position: int) -> None:
        """Input `position` of call `task_id` starts now."""
        os.pwrite(self.fd, self.prefix + task_id + b" %08d\n" % position, 0)


class NoRecord:
    """An actor that could not make its record (a read-only or full tmpfs): what it starts is UNKNOWN."""

    path = None

    def note(self, task_id: bytes, position: int) -> None:
        pass


def parse(text: str):
    """(task id hex, position) from a record's text; NOTHING_STARTED, or UNKNOWN for what is not a record."""
    fields = text.split()
    if len(fields) != 3 or not fields[0].isdigit():
        return UNKNOWN
    if fields[1] == NONE.decode():
        return NOTHING_STARTED
    if not fields[2].isdigit():
        return UNKNOWN
    return fields[1], int(fields[2])


def take(actor_id: str):
    """Read an actor's record and remove it (on the actor's machine): parse()'s answer, or UNKNOWN when
    there is none here."""
    path = os.path.join(folder(), actor_id)
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return UNKNOWN
    remove(path)
    return parse(text)


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_all(actor_ids: list) -> None:
    """Remove these actors' records (on their machine), and the folder once it holds none: soma leaves nothing
    in /dev/shm after close (an actor making its record meanwhile makes the folder again)."""
    where = folder()
    for actor_id in actor_ids:
        remove(os.path.join(where, actor_id))
    try:
        os.rmdir(where)
    except OSError:  # records of live actors (this driver's or another's) are in it, or it is gone
        pass


def _sweep(where: str) -> None:
    """Remove records of processes that are gone, untouched for STALE_S (their driver never read them)."""
    now = time.time()
    try:
        names = os.listdir(where)
    except OSError:
        return
    for name in names:
        path = os.path.join(where, name)
        try:
            if now - os.stat(path).st_mtime < STALE_S:
                continue
            with open(path) as f:
                pid = f.read(10).strip()
        except OSError:
            continue
        if not pid.isdigit() or not process_alive(int(pid)):
            remove(path)


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this machine (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the driver's side ------------------------------------------------------------------------------------

def at_death(ray, here: str, actor, concurrent: bool):
    """What a dead actor's record says, read once (cached on the `CopyActor`) and removed.

    `here`: the driver's Ray node; `concurrent`: its copy may run several calls at once (then one line
    cannot say which had started: UNKNOWN).
    """
    if actor.death is None:
        found = UNKNOWN if actor.actor_id is None else _read(ray, here, actor)
        actor.death = UNKNOWN if concurrent else found
    return actor.death


def started(death, call) -> bool:
    """Whether the dead actor had started this input's `call` (soma.ray.submission.Call) when it died.

    A copy runs one input at a time, so only the input the record names may have been running; an input
    before it in the same call had finished (its value died with the call: it ran); an unfinished call the
    record does not name never started. (A call that had finished but whose answer was still on its way
    when the process died is counted as not started: it runs again, without a try counted.)
    """
    if death == UNKNOWN:
        return True
    if death == NOTHING_STARTED:
        return False
    task, position = death
    return call.ref.task_id().hex() == task and call.position <= position


def forget(actors: list) -> None:
    """Remove the records of actors soma stops itself (nobody will ask what they had started) that are on this
    machine; those elsewhere remove their own when asked (soma.ray.copies), or are swept after STALE_S. (A
    record named by an actor's id is here only if the actor ran here: on this Ray node, or another one of
    this very machine.)"""
    remove_all([actor.actor_id for actor in actors if actor.actor_id is not None and actor.death is None])


def _read(ray, here: str, actor):
    """Its record: read here when it ran here (or its machine is not known: it never said hello, and a record
    named by its id is here only if it ran here), else by a Ray task pinned to its machine."""
    if actor.ray_node in (None, here):
        return take(actor.actor_id)
    if not any(node["NodeID"] == actor.ray_node and node.get("Alive") for node in ray.nodes()):
        # The machine died, and its tmpfs with it, unless it was another Ray node of this very machine
        # (a record named by the actor's id is here only then).
        return take(actor.actor_id)
    ref = _take_on(ray, actor.ray_node).remote(actor.actor_id)
    try:
        return ray.get(ref, timeout=READ_S)
    except Exception:
        try:
            ray.cancel(ref)
        except Exception:
            pass
        return UNKNOWN


_tasks: dict = {}


def _take_on(ray, machine: str):
    """`take` as a Ray task that runs on `machine` and nowhere else, holding no CPU (made once per process)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = _tasks.get(id(ray))
    if task is None:
        task = _tasks[id(ray)] = ray.remote(num_cpus=0, max_retries=0)(take)
    return task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(machine, soft=False))
