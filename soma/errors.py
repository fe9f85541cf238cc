"""Every failure a user can hit, named by who caused it.

The node's fault: `NodeError`, its `PostconditionError` and `SharedMemoryFull`.
The circumstances' fault: `WorkerDied`, `RunTimeout`.
The declaration's fault: `DeviceError`, `GraphError` (its `NotANodeError`), `PlacementError`.

Each message names the node, worker or device it is about. Errors of one input
of a `map` carry that input's position as `.index` (None elsewhere). Every
exception pickles with its attributes (they cross processes in `Local` and `Ray`).
"""

from __future__ import annotations


class SomaError(Exception):
    """Base of every error soma raises."""

    index = None  # the input's position, when the error belongs to one input of a map

    def __reduce__(self):
        # Rebuilt without calling __init__: every attribute (.node, .index, __notes__, ...) travels as it is.
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class DeviceError(SomaError, ValueError):
    """A device string is not `cpu`, `cuda:N` or `meta`."""


class GraphError(SomaError, ValueError):
    """An expression cannot become a graph, or a graph is asked about a node it lacks."""


class NotANodeError(GraphError, TypeError):
    """Something that is not a soma node, expression or graph where one is expected (`>>`, `|`, `Graph.somatize`,
    a runner's `run`, `map`, `submit`, `arun`, `amap`): a GraphError, and a TypeError as Python's own operators
    raise for an operand of the wrong type. For a plain function it says to wrap it with `soma.fn`."""


class PlacementError(SomaError):
    """A placement cannot be honoured by the runner (no worker serves the device, or this machine lacks it)."""

    def __init__(self, message: str, *, node: str | None = None, devices: tuple = ()):
        super().__init__(message)
        self.node = node
        self.devices = tuple(devices)


class NodeError(SomaError):
    """A node raised, or returned something that is not `Done`.

    `.node` is the node's id. When the node raised, the original exception is
    `__cause__`; in a worker process, `.remote_traceback` holds its traceback text.
    """

    def __init__(self, node: str, message: str, *, remote_traceback: str | None = None):
        super().__init__(message)
        self.node = node
        self.remote_traceback = remote_traceback

    @classmethod
    def failed(cls, node: str, reason: str, **kwargs) -> "NodeError":
        """The error with soma's one wording for it: "node `x` failed: <reason>"."""
        return cls(node, f"node `{node}` failed: {reason}", **kwargs)


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker; chained under the original exception."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\nTraceback in the worker:\n" + self.text.rstrip()


class PostconditionError(NodeError):
    """A placed node returned a value that is not on the device it declared."""

    def __init__(self, node: str, declared: str, actual: str):
        super().__init__(
            node, f"node `{node}` failed: it declared `{declared}` but returned a value on `{actual}`"
        )
        self.declared = declared
        self.actual = actual


class SharedMemoryFull(NodeError):
    """A tensor of a node's input or output could not be given shared memory (`/dev/shm` is full).

    Raised first by the shared-memory store, which knows the bytes but not the node (`.node` None,
    `.nbytes` set); whoever knows whose value it was raises it again with `reserving`.
    """

    nbytes = 0
    held = 0  # bytes of /dev/shm the caller's own results hold, when that is why (`caller_holds`)
    elsewhere = ""  # where else the store looked and why it failed there (its spill directory: `reserving`)

    @classmethod
    def reserving(cls, node: str | None, nbytes: int, what: str, elsewhere: str = "") -> "SharedMemoryFull":
        """`elsewhere`: ", nor on disk in <the spill directory> (why)", when the store tried there too."""
        advice = ("Free space in /dev/shm (`df -h /dev/shm` shows it), or give it more (in docker: `--shm-size=8g`)"
                  if not elsewhere else "Free space in /dev/shm or on that disk (SOMA_SPILL_DIR names another "
                                        "directory), or give /dev/shm more (in docker: `--shm-size=8g`)")
        reason = f"shared memory is full: could not reserve {size_text(nbytes)} in /dev/shm for {what}{elsewhere}. " \
                 f"{advice}"
        err = cls.failed(node, reason) if node is not None else cls(None, reason)
        err.nbytes, err.elsewhere = nbytes, elsewhere
        return err

    @classmethod
    def again(cls, node: str, err: "SharedMemoryFull", what: str) -> "SharedMemoryFull":
        """The store's `err` raised again for `node`, whose `what` it was, with all the store said: whose the room
        is (`caller_holds`), where else it looked (`elsewhere`)."""
        if not err.held:
            return cls.reserving(node, err.nbytes, what, err.elsewhere)
        said = err.args[0]  # ("... could not reserve 20.0 MiB in /dev/shm, which has ...": whose value, said there)
        again = cls.failed(node, said.replace(" in /dev/shm, ", f" in /dev/shm for {what}, ", 1) if " in /dev/shm, "
                           in said else f"{said} (for {what})")
        again.nbytes, again.held = err.nbytes, err.held
        return again

    @classmethod
    def caller_holds(cls, nbytes: int, held: int, free: int, total: int) -> "SharedMemoryFull":
        """The room is the caller's own: results it keeps hold `held` bytes of /dev/shm (raised by the store;
        whoever knows the node raises it again with `again`, which keeps this reason)."""
        err = cls(None, f"shared memory is full: could not reserve {size_text(nbytes)} in /dev/shm, which has "
                        f"{size_text(free)} free of {size_text(total)}, and the results this program keeps hold "
                        f"{size_text(held)} of it. Let go of results you no longer need (del them, or copy what "
                        f"you keep: `t.clone()`, `a.copy()`), or give /dev/shm more room (in docker: "
                        f"`--shm-size=8g`)")
        err.nbytes, err.held = nbytes, held
        return err


class WorkerDied(SomaError):
    """A worker process ended (crash, kill, OOM) while it held work of a run.

    `.tries`: how many times the input was run, each try lost to a dead worker (1 + the retries made).
    """

    def __init__(self, message: str, *, worker: str, pid: int | None, node: str | None, tries: int = 1):
        super().__init__(message)
        self.worker = worker
        self.pid = pid
        self.node = node
        self.tries = tries


class Cancelled(SomaError):
    """Internal, never raised to a user: the input this work belongs to was given up (a timeout, a map left
    early), so it stops before its next node, and a worker drops it unless it has started."""

    def __init__(self, node: str | None = None):
        super().__init__(f"the input was given up before node `{node}` ran" if node else "the input was given up")
        self.node = node


class RunTimeout(SomaError, TimeoutError):
    """A run's `timeout` expired; `.nodes` are the nodes that were still running."""

    def __init__(self, message: str, *, nodes: tuple = (), waiting: tuple = ()):
        super().__init__(message)
        self.nodes = tuple(nodes)
        self.waiting = tuple(waiting)

    @classmethod
    def after(cls, timeout: float, running: dict, waiting, then: str | None = None) -> "RunTimeout":
        """soma's one wording: `running` maps each node still running to where ("worker w1", "Ray actor 3f2a";
        None in-process), `waiting` the nodes that had not started, `then` what was done about the running ones."""
        text = f"run timed out after {timeout} s; still running: " + (
            ", ".join(f"`{node}`" + (f" (on {where})" if where else "") for node, where in running.items())
            or "none")
        if waiting:
            text += f"; waiting to run: {', '.join(f'`{n}`' for n in waiting)}"
        if then:
            text += f" ({then})"
        return cls(text, nodes=tuple(running), waiting=tuple(waiting))


def traceback_text(exc: BaseException) -> str:
    """An exception's traceback as text: what travels from a worker when the exception itself may not."""
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def size_text(nbytes: int) -> str:
    """`nbytes` as a person reads it: `20.0 MiB`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _restore(cls, args, state):
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err
