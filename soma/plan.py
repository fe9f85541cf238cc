"""The plan: when each node runs, and with what concurrency.

`Step(id)` runs one node; `Seq(items)` runs items in order, each receiving the
previous output; `Wave(branches)` runs branches concurrently on the same input
and yields the tuple of their outputs. Plans compare equal by structure and print
in the DSL's own notation.

A graph's plan is its topology itself (`Graph.plan()`): the tree is built from
the expression's shape and ids alone, so placing a node cannot change a plan.
That is true by construction, not by a check.

`fold` is the one walk over a plan tree. Every pass over a plan (printing it,
listing its steps, compiling it into a program, running it, packing it for the
wire) is a fold, as torch.fx passes are `map_aggregate` and Ray's DAG passes are
`apply_recursive`:

    fold(plan, leaf, seq, wave)
        Step (or any part that is neither a Seq nor a Wave: a program's Piece) → leaf(part)
        Seq  → seq(part, [fold of each item])
        Wave → wave(part, [fold of each branch])
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

    def __str__(self) -> str:
        return render(self, str)

    def steps(self) -> tuple:
        """The node ids of this plan, in order."""
        return fold(self, _own_steps, _joined, _joined)


class Step(Plan):
    __slots__ = ("id",)

    def __init__(self, id: str):
        object.__setattr__(self, "id", id)

    def _key(self):
        return self.id

    def __str__(self) -> str:
        return self.id


class Seq(Plan):
    __slots__ = ("items",)

    def __init__(self, items):
        object.__setattr__(self, "items", tuple(items))

    def _key(self):
        return self.items


class Wave(Plan):
    __slots__ = ("branches",)

    def __init__(self, branches):
        object.__setattr__(self, "branches", tuple(branches))

    def _key(self):
        return self.branches


def fold(plan: Plan, leaf, seq, wave):
    """Fold a plan tree bottom up (see the module's docstring): the one walk every pass uses."""
    kind = type(plan)
    if kind is Seq:
        return seq(plan, [fold(item, leaf, seq, wave) for item in plan.items])
    if kind is Wave:
        return wave(plan, [fold(branch, leaf, seq, wave) for branch in plan.branches])
    return leaf(plan)


def render(plan: Plan, label) -> str:
    """The plan in the DSL's notation, each leaf written as `label(leaf)`: `a >> (b | c) >> d`."""
    def seq(part: Seq, texts: list) -> str:
        return " >> ".join(f"({t})" if type(i) is Wave else t for i, t in zip(part.items, texts))

    def wave(part: Wave, texts: list) -> str:
        return " | ".join(f"({t})" if type(b) is Seq else t for b, t in zip(part.branches, texts))

    return fold(plan, label, seq, wave)


def first_step(plan: Plan) -> str:
    """The node that receives a plan's input (a wave's: its first branch's first node)."""
    return fold(plan, lambda leaf: leaf.id if type(leaf) is Step else first_step(leaf.plan), _first, _first)


def last_step(plan: Plan) -> str:
    """The node named as the producer of a plan's output (a wave's: its first branch's)."""
    return fold(plan, lambda leaf: leaf.id if type(leaf) is Step else last_step(leaf.plan), _last, _first)


def _own_steps(leaf) -> tuple:
    return (leaf.id,) if type(leaf) is Step else tuple(leaf.steps())


def _joined(_, parts: list) -> tuple:
    return tuple(step for part in parts for step in part)


def _first(_, parts: list):
    return parts[0]


def _last(_, parts: list):
    return parts[-1]
