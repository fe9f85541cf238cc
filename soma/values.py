"""What a node returns: `Done(value)`, and `Opaque(obj)` for values carried as they are."""

from __future__ import annotations


class Done:
    """The node finished with `value`."""

    __slots__ = ("value",)

    def __init__(self, value=None):
        self.value = value

    def __repr__(self) -> str:
        return f"Done({self.value!r})"

    def __eq__(self, other):
        return type(other) is Done and self.value == other.value

    __hash__ = None


class Opaque:
    """Carry `obj` as it is: never converted or copied; its autograd graph stays intact in-process.

    The next node, and the caller of `run`, receive `obj` itself. Only an
    `Opaque` that is the whole value of a `Done` is unwrapped; one nested inside
    a container is carried as the wrapper it is (unwrapping would mean walking
    and rebuilding every container a node returns).
    """

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __repr__(self) -> str:
        return f"Opaque({self.obj!r})"


def unwrap(value):
    """The value the next node (or the caller) receives for a node's `Done.value`."""
    return value.obj if type(value) is Opaque else value
