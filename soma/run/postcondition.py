"""The device postcondition: a placed node's output must be where the node was placed.

Anything with a `.device` attribute is looked at (a tensor, or any object that
says where it is), loose, in an `Opaque`, or inside tuples, lists and dicts.
Values without `.device` are not checked, and neither are unplaced nodes.
A plain scalar (`UNCHECKED`: an int, a str...) is answered by its type alone,
one set lookup: a map of tiny inputs checks every output of a placed node.
"""

from __future__ import annotations

from ..errors import PostconditionError
from ..values import Opaque

# Values of exactly these types have no device and hold nothing that has one (exact types, for a set lookup: a
# subclass takes find_misplaced's walk, which gives the same answer).
UNCHECKED = frozenset({int, float, bool, complex, str, bytes, bytearray, type(None)})


def find_misplaced(value, declared: str):
    """The first device (as a string) in `value` that is not `declared`, or None."""
    stack = [value]
    seen: set[int] = set()
    while stack:
        item = stack.pop()
        if type(item) is Opaque:
            stack.append(item.obj)
            continue
        device = getattr(item, "device", None) if not isinstance(item, (str, bytes, int, float)) else None
        if device is not None and not callable(device):
            actual = str(device)
            if actual != declared:
                return actual
            continue
        if isinstance(item, (tuple, list, dict)):
            if id(item) in seen:
                continue  # a container that holds itself
            seen.add(id(item))
            children = item.values() if isinstance(item, dict) else item
            stack.extend(reversed(list(children)))
    return None


def check_postcondition(node_id: str, declared: str | None, value) -> None:
    """Raise `PostconditionError` when a placed node returned a value elsewhere."""
    if declared is None or type(value) in UNCHECKED:
        return
    actual = find_misplaced(value, declared)
    if actual is not None:
        raise PostconditionError(node_id, declared, actual)
