"""The plan: when each node runs, and with what concurrency.

`Step(id)` runs one node; `Seq(items)` runs items in order, each receiving the
previous output; `Wave(branches)` runs branches concurrently on the same input
and yields the tuple of their outputs. Plans compare equal by structure and print
in the DSL's own notation.

`compile_plan` sees the topology only. Placement is not an argument, so placing a
node cannot change a plan: that is true by construction, not by a check.
"""

from __future__ import annotations

from dataclasses import dataclass


class Plan:
    """Base of `Step`, `Seq` and `Wave`."""

    __slots__ = ()

    def steps(self):
        """The node ids of this plan, in order."""
        raise NotImplementedError

    def last_steps(self):
        """Node ids whose output is (part of) this plan's output."""
        raise NotImplementedError


@dataclass(frozen=True)
class Step(Plan):
    id: str

    def steps(self):
        yield self.id

    def __str__(self) -> str:
        return self.id


@dataclass(frozen=True)
class Seq(Plan):
    items: tuple

    def __post_init__(self):
        object.__setattr__(self, "items", tuple(self.items))

    def steps(self):
        for item in self.items:
            yield from item.steps()

    def __str__(self) -> str:
        return " >> ".join(f"({i})" if isinstance(i, Wave) else str(i) for i in self.items)


@dataclass(frozen=True)
class Wave(Plan):
    branches: tuple

    def __post_init__(self):
        object.__setattr__(self, "branches", tuple(self.branches))

    def steps(self):
        for branch in self.branches:
            yield from branch.steps()

    def __str__(self) -> str:
        return " | ".join(f"({b})" if isinstance(b, Seq) else str(b) for b in self.branches)


def compile_plan(topology) -> Plan:
    """Compile a graph's topology (its id tree) into a plan.

    The topology is the tree `Graph.somatize` builds: a str id, `("seq", items)`
    or `("wave", branches)`.
    """
    if isinstance(topology, str):
        return Step(topology)
    kind, children = topology
    compiled = tuple(compile_plan(child) for child in children)
    return Seq(compiled) if kind == "seq" else Wave(compiled)
