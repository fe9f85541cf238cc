"""The nodes a pool has seen: their keys, their pickled code, and which of them the host has let go.

A node's key is its identity for the pool: its code travels once per worker under
that key, and a node used by two graphs is one node with one state. Its code is
pickled once, when a graph that holds it is first compiled for this pool: every
copy is made from the node as it was then (and a node that cannot be pickled is
an error before anything is sent). When the host's node object is garbage
collected no graph can run it again, so its key is queued for the workers to
forget.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque

from ..errors import NodeError


class NodeRegistry:
    def __init__(self):
        self._lock = threading.Lock()
        self._key_by_id: dict[int, int] = {}  # id(node) → key
        self._entries: dict[int, list] = {}  # key → [ref to the node, pickled code or None, id(node)]
        self._keys = itertools.count(1)
        self._dead: deque = deque()  # keys of nodes gone on the host

    def key_of(self, node) -> int:
        with self._lock:
            key = self._key_by_id.get(id(node))
            if key is not None and self._entries[key][0]() is node:
                return key
            key = next(self._keys)
            try:
                ref = weakref.ref(node, lambda _, key=key: self._dead.append(key))
            except TypeError:  # a node without __weakref__: keep it alive as long as the pool
                ref = (lambda n: (lambda: n))(node)
            self._key_by_id[id(node)] = key
            self._entries[key] = [ref, None, id(node)]
            return key

    def code(self, node_id: str, key: int) -> bytes:
        """The node's code, pickled once (`soma.wire.nodecode`: classes from `__main__` and notebooks travel too,
        with their file names and lines)."""
        entry = self._entries[key]
        if entry[1] is None:
            from ..wire import nodecode

            try:
                entry[1] = nodecode.dumps(entry[0]())
            except Exception as err:
                raise NodeError.failed(node_id, f"it cannot be sent to a worker: {type(err).__name__}: {err} (keep "
                                                f"unpicklable things such as locks, sockets and open files out of "
                                                f"the node, or create them in setup)") from err
        return entry[1]

    @property
    def has_dead(self) -> bool:
        return bool(self._dead)

    def take_dead(self) -> list[int]:
        """Keys of nodes the host has let go since the last call; their code is dropped here."""
        dead = []
        while self._dead:
            try:
                dead.append(self._dead.popleft())
            except IndexError:
                break
        if dead:
            with self._lock:
                for key in dead:
                    entry = self._entries.pop(key, None)
                    if entry is not None and self._key_by_id.get(entry[2]) == key:
                        del self._key_by_id[entry[2]]
        return dead
