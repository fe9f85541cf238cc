"""The plan: when each node runs, and with what concurrency.

`Step(id)` runs one node; `Seq(items)` runs items in order, each receiving the
previous output; `Wave(branches)` runs branches concurrently on the same input
and yields the tuple of their outputs. Plans compare equal by structure and print
in the DSL's own notation.

`compile_plan` sees the topology only. Placement is not an argument, so placing a
node cannot change a plan: that is true by construction, not by a check.
"""

from __future__ import annotations


class Plan:
    """Base of `Step`, `Seq` and `Wave`: immutable, equal and hashable by structure."""

    __slots__ = ()

    def _key(self):
        raise NotImplementedError

    def __eq__(self, other):
        return type(other) is type(self) and other._key() == self._key()

    def __hash__(self):
        return hash((type(self).__name__, self._key()))

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._key()!r})"

    def __reduce__(self):
        return (type(self), (self._key(),))

    def steps(self):
        """The node ids of this plan, in order."""
        raise NotImplementedError


class Step(Plan):
    __slots__ = ("id",)

    def __init__(self, id: str):
        object.__setattr__(self, "id", id)

    def _key(self):
        return self.id

    def steps(self):
        yield self.id

    def __str__(self) -> str:
        return self.id


class Seq(Plan):
    __slots__ = ("items",)

    def __init__(self, items):
        object.__setattr__(self, "items", tuple(items))

    def _key(self):
        return self.items

    def steps(self):
        for item in self.items:
            yield from item.steps()

    def __str__(self) -> str:
        return " >> ".join(f"({i})" if isinstance(i, Wave) else str(i) for i in self.items)


class Wave(Plan):
    __slots__ = ("branches",)

    def __init__(self, branches):
        object.__setattr__(self, "branches", tuple(branches))

    def _key(self):
        return self.branches

    def steps(self):
        for branch in self.branches:
            yield from branch.steps()

    def __str__(self) -> str:
        return " | ".join(f"({b})" if isinstance(b, Seq) else str(b) for b in self.branches)


def last_step(plan: Plan) -> str:
    """The node named as the producer of a plan's output (a wave's: its first branch's)."""
    while not isinstance(plan, Step):
        plan = plan.items[-1] if isinstance(plan, Seq) else plan.branches[0]
    return plan.id


def compile_plan(topology: Plan) -> Plan:
    """Compile a graph's topology into its plan.

    The graph keeps its shape in the plan's own vocabulary (`Step`/`Seq`/`Wave`),
    and a wave's branches run concurrently and a sequence's items in order: the
    plan is that tree itself. The placement is not an argument, and never will be.
    """
    if not isinstance(topology, Plan):
        raise TypeError(f"a topology is a tree of Step, Seq and Wave, not {type(topology).__name__}")
    return topology
