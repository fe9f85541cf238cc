"""The weights a node's copies were made with: whether the host's torch modules changed them since.

A copy on a worker process (Local, Ray) is made from the node as it was when it was
sent (SPEC 2, "Copies"). An optimizer step or `load_state_dict` on the host changes
a module's parameters in place afterwards: the copies go on with the old weights,
silently, where the in-process Executor runs the new ones (an evaluation on a warm
pool after each epoch of training measured the first epoch's model every time).
`Weights` notes, when the node is sent, each parameter and buffer of the torch
modules it holds (its attributes, and the globals and closure variables its code
reads) with torch's version counter, which every in-place change bumps; `changed()`
looks again, at most every LOOK_EVERY_S unless told to (a map's start), since a
large model has hundreds of tensors to look at.
"""

from __future__ import annotations

import sys
import time
import weakref

LOOK_EVERY_S = 1.0  # between two looks at a node's weights on a run's way (a few µs a tensor)


class Weights:
    """The parameters and buffers of the torch modules `modules` (weakly held), as they were when noted."""

    __slots__ = ("modules", "then", "looked")

    def __init__(self, modules: list):
        self.modules = [weakref.ref(m) for m in modules]
        self.then = self._now()
        self.looked = time.monotonic()

    @classmethod
    def of(cls, node, read: list) -> "Weights | None":
        """The node's, where it holds torch modules (its attributes, or among `read`, what its code reads)."""
        torch = sys.modules.get("torch")
        module = getattr(getattr(torch, "nn", None), "Module", None)
        if module is None:
            return None
        found = [v for v in (*getattr(node, "__dict__", {}).values(), *read) if isinstance(v, module)]
        if isinstance(node, module):
            found.append(node)
        unique = list({id(m): m for m in found}.values())
        return cls(unique) if unique else None

    def _now(self) -> tuple:
        now = []
        for ref in self.modules:
            m = ref()
            if m is not None:
                now += [(id(t), t._version) for t in (*m.parameters(), *m.buffers())]
        return tuple(now)

    def noted(self) -> None:
        """The node was sent again (another pool): its copies there see the weights as they are now."""
        self.then, self.looked = self._now(), time.monotonic()

    def changed(self, now: bool = False) -> bool:
        """Whether a parameter or buffer was changed in place, or replaced, since noted (looked at only every
        LOOK_EVERY_S, unless `now`)."""
        at = time.monotonic()
        if not now and at - self.looked < LOOK_EVERY_S:
            return False
        self.looked = at
        return self._now() != self.then
