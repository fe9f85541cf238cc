"""Nodes kept by identity: a node object is itself, not any node equal to it.

A node need not be hashable (a @dataclass node's `__hash__` is None, as is any class's that defines `__eq__`
alone), and a node equal to another one is not the same node: it is another copy, with its own state, its own
lock and its own `setup`. So what soma keeps per node object (what its code read when it was sent:
soma.run.registry; its lock and whether its setup ran: soma.run.interpreter) is keyed by `id(node)` and a weak
reference that says whose id it is, never by hash (a WeakKeyDictionary would be both wrong and, for an
unhashable node, a TypeError).
"""

from __future__ import annotations

import weakref


class ByNode:
    """A dict keyed by the node object itself (its identity), held weakly: an entry goes with its node. A node
    without `__weakref__` (`__slots__`) is not kept (`put` raises TypeError: its id would name another object
    once it is freed, and nothing would say so)."""

    __slots__ = ("_entries",)

    def __init__(self):
        self._entries: dict[int, tuple] = {}  # id(node) → (a weak reference to it, its value)

    def get(self, node, default=None):
        entry = self._entries.get(id(node))
        # (an id may be a dead node's until its weak reference's callback has run: the reference says whose)
        return entry[1] if entry is not None and entry[0]() is node else default

    def put(self, node, value) -> None:
        key, entries = id(node), self._entries

        def gone(ref) -> None:  # (run as the node is freed, before its id can be another object's)
            if entries.get(key, (None,))[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(node, gone), value)
