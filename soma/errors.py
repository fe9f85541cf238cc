"""Every failure a user can hit, named by who caused it.

The node's fault: `NodeError` and its `PostconditionError`.
The circumstances' fault: `WorkerDied`, `RunTimeout`.
The declaration's fault: `DeviceError`, `GraphError`, `PlacementError`.

Each message names the node, worker or device it is about. Every exception
pickles with its attributes (they cross processes in `Local` and `Ray`).
"""

from __future__ import annotations


class SomaError(Exception):
    """Base of every error soma raises."""


class DeviceError(SomaError, ValueError):
    """A device string is not `cpu`, `cuda:N` or `meta`."""


class GraphError(SomaError, ValueError):
    """An expression cannot become a graph, or a graph is asked about a node it lacks."""


class PlacementError(SomaError):
    """A placement cannot be honoured by the runner (no worker serves the device)."""

    def __init__(self, message: str, *, node: str | None = None, devices: tuple = ()):
        super().__init__(message)
        self.node = node
        self.devices = tuple(devices)

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(node=self.node, devices=self.devices)))


class NodeError(SomaError):
    """A node raised, or returned something that is not `Done`.

    `.node` is the node's id. When the node raised, the original exception is
    `__cause__`; in a worker process, `.remote_traceback` holds its traceback text.
    """

    def __init__(self, node: str, message: str, *, remote_traceback: str | None = None):
        super().__init__(message)
        self.node = node
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        return (_rebuild, (type(self), (self.node, self.args[0]),
                           dict(remote_traceback=self.remote_traceback)))


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

    def __reduce__(self):
        return (type(self), (self.node, self.declared, self.actual))


class WorkerDied(SomaError):
    """A worker process ended (crash, kill, OOM) while it held work of a run."""

    def __init__(self, message: str, *, worker: str, pid: int | None, node: str | None):
        super().__init__(message)
        self.worker = worker
        self.pid = pid
        self.node = node

    def __reduce__(self):
        return (_rebuild, (type(self), self.args,
                           dict(worker=self.worker, pid=self.pid, node=self.node)))


class RunTimeout(SomaError, TimeoutError):
    """A run's `timeout` expired; `.nodes` are the nodes that were still running."""

    def __init__(self, message: str, *, nodes: tuple = ()):
        super().__init__(message)
        self.nodes = tuple(nodes)

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(nodes=self.nodes)))


def traceback_text(exc: BaseException) -> str:
    """An exception's traceback as text: what travels from a worker when the exception itself may not."""
    import traceback

    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _rebuild(cls, args, kwargs):
    return cls(*args, **kwargs)
