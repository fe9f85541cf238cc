"""The weights a node's copies were made with: whether the host's torch modules changed them since.

A copy on a worker process (Local, Ray) is made from the node as it was when it was
sent (SPEC 2, "Copies"). An optimizer step or `load_state_dict` on the host changes
a module's parameters in place afterwards: the copies go on with the old weights,
silently, where the in-process Executor runs the new ones (an evaluation on a warm
pool after each epoch of training measured the first epoch's model every time).
`Weights` notes, when the node is sent, each parameter and buffer of the torch
modules it holds (its attributes, and the globals and closure variables its code
reads) with torch's version counter, which every in-place change bumps, and each
submodule's train/eval mode (`model.eval()` after a first run in train mode: the
copies went on with dropout, the Executor without, Dec 7); `changed()`
looks again (the registry asks at most every LOOK_EVERY_S a graph, and at a map's
start, since a large model has hundreds of tensors to look at: soma.run.registry,
one clock a graph for weights and code files). The tensors are found once, when
noted, and held weakly: a look reads each one's counter (~0.15 µs; walking the
modules again took 1 ms a look for 700 tensors), and one replaced (`module.weight =
nn.Parameter(...)`) is seen as the old one goes. Not seen: writes through `.data`
(`p.data.mul_(...)`), which torch does not count.
"""

from __future__ import annotations

import sys
import weakref


class Weights:
    """The parameters and buffers of the torch modules `modules` (weakly held), as they were when noted."""

    __slots__ = ("modules", "tensors", "submodules", "then", "modes")

    def __init__(self, modules: list):
        self.modules = [weakref.ref(m) for m in modules]
        self.noted()

    @classmethod
    def of(cls, node, read: list) -> "Weights | None":
        """The node's, where it holds torch modules (its attributes, or among `read`, what its code reads)."""
        torch = sys.modules.get("torch")
        module = getattr(getattr(torch, "nn", None), "Module", None)
        if module is None:
            return None
        found = [v for v in _one_level((*getattr(node, "__dict__", {}).values(), *read)) if isinstance(v, module)]
        if isinstance(node, module):
            found.append(node)
        unique = list({id(m): m for m in found}.values())
        return cls(unique) if unique else None

    def _now(self) -> tuple:
        return tuple(-1 if (t := ref()) is None else t._version for ref in self.tensors)

    def _modes(self) -> tuple:
        return tuple(None if (m := ref()) is None else m.training for ref in self.submodules)

    def noted(self) -> None:
        """The node is sent (again: another pool): its copies there see the weights and modes as they are now."""
        modules = [m for m in (ref() for ref in self.modules) if m is not None]
        self.tensors = [weakref.ref(t) for m in modules for t in (*m.parameters(), *m.buffers())]
        self.submodules = [weakref.ref(s) for m in modules for s in m.modules()]
        self.then, self.modes = self._now(), self._modes()

    def changed(self) -> str | None:
        """What changed since noted: "weights" (a parameter or buffer changed in place, or replaced: ~0.15 µs a
        tensor), "mode" (a submodule switched between train and eval), or None."""
        if self._now() != self.then:
            return "weights"
        return "mode" if self._modes() != self.modes else None


def _one_level(values) -> list:
    """`values`, and what lists, tuples and dicts among them hold (a node's `self.layers = [a, b]`)."""
    found = []
    for value in values:
        found.append(value)
        if isinstance(value, (list, tuple)):
            found.extend(value)
        elif isinstance(value, dict):
            found.extend(value.values())
    return found
