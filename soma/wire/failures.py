"""A node's failure as data: what travels when a node fails in another process, on every runner.

    worker or actor:  error_body(NodeError)  → a dict (msgpack-able; the cause cloudpickled when it travels)
    host or driver:   error_from(dict)       → the same class, the same text, the remote traceback and
                                               the cause chained under it

`Local`'s workers send the body inside a Result (soma.wire.protocol); Ray's actors
return it inside a `Failed` value (soma.ray.actor). An input the host gave up on
(a timeout, a map left early) comes back as `Cancelled`, the one spelling of that
outcome on every side.
"""

from __future__ import annotations

import re

from ..errors import (
    Cancelled,
    NodeError,
    PostconditionError,
    RemoteTraceback,
    SharedMemoryFull,
)


def error_body(err: NodeError) -> dict:
    """What travels for a node's failure: enough to raise the same error, with the same text, on the host."""
    if isinstance(err, Cancelled):
        return {"kind": "cancelled"}
    body = {"node": err.node, "message": err.args[0], "traceback": err.remote_traceback, "kind": "node"}
    notes = getattr(err, "__notes__", None)
    if notes:  # (a wave's other failed branches: "another branch of the same wave also failed: ...")
        body["notes"] = [str(note) for note in notes]
    if isinstance(err, PostconditionError):
        body.update(kind="postcondition", declared=err.declared, actual=err.actual)
        return body
    if isinstance(err, SharedMemoryFull):
        body["kind"] = "shm"
    body["cause"] = pickled_exception(err.__cause__) if err.__cause__ is not None else None
    return body


def error_from(body: dict) -> NodeError:
    """The NodeError an error body describes: same class, same message, the cause chained when it travels."""
    kind = body.get("kind")
    if kind == "cancelled":
        return Cancelled()
    if kind == "postcondition":
        err = PostconditionError(body["node"], body["declared"], body["actual"])
    else:
        err = (SharedMemoryFull if kind == "shm" else NodeError)(body["node"], body["message"],
                                                                 remote_traceback=body.get("traceback"))
    for note in body.get("notes", ()):
        err.add_note(note)
    if kind == "postcondition":
        return err
    remote = RemoteTraceback(body["traceback"]) if body.get("traceback") else None
    cause = None
    if body.get("cause"):
        try:
            cause = exception_from(body["cause"])
        except Exception:
            cause = None
    if cause is not None:
        if remote is not None:  # the cause is shown below it: its frames alone, not its message a second time
            remote = RemoteTraceback(frames_only(body["traceback"]))
        cause.__cause__ = remote
        err.__cause__ = cause
    else:
        err.__cause__ = remote
    return err


def pickled_exception(exc: BaseException) -> bytes | None:
    """The exception, cloudpickled, or None when it cannot travel (its text always does): as pickle reduces it
    (its class called with its args: what built-in exceptions need), or, when that rebuilds another exception,
    as its class, args and attributes, rebuilt without calling its __init__. Why: an exception whose __init__
    takes other arguments than its args ("custom code 7" from code 7) came back as "custom code custom code 7",
    and one whose __init__ takes two arguments did not come back at all."""
    import cloudpickle

    said = _without_addresses(str(exc))
    for data in _pickled_ways(exc, cloudpickle):
        try:
            rebuilt = exception_from(data)
            if type(rebuilt) is type(exc) and _without_addresses(str(rebuilt)) == said:
                return data
        except Exception:  # (unpicklable args or attributes; a __str__ that needs what did not travel)
            pass
    return None


def _without_addresses(text: str) -> str:
    """`text` with the addresses in default reprs (`<Thing object at 0x7f...>`) left out: a rebuilt object has
    another (KeyError(Thing()) lost its cause over it)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x", text)


def _pickled_ways(exc: BaseException, cloudpickle):
    for way in (lambda: exc, lambda: (type(exc), exc.args, getattr(exc, "__dict__", None) or {})):
        try:
            yield cloudpickle.dumps(way())
        except Exception:
            continue


def exception_from(data: bytes) -> BaseException:
    """The exception `pickled_exception` made `data` of."""
    import pickle

    made = pickle.loads(data)
    if isinstance(made, BaseException):
        return made
    cls, args, attributes = made
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


def frames_only(text: str) -> str:
    """A traceback's text without its last exception's own lines (type and message): what is left once the
    exception itself is displayed next to it."""
    lines = text.rstrip("\n").splitlines()
    last = max((i for i, line in enumerate(lines) if line.startswith("  ")), default=len(lines) - 1)
    return "\n".join(lines[:last + 1]) + "\n"
