"""`Node`, the unit of work, and `soma.fn` for plain functions.

A node is the Catalog's half of the graph: the code and its state. Its id and
placement live outside it (in the expression, then in the `Graph`), so a
subclass need not call `Node.__init__`.
"""

from __future__ import annotations

import re

from .errors import GraphError
from .expr import Leaf, check_id
from .values import Done

_CAMEL_1 = re.compile(r"(.)([A-Z][a-z]+)")
_CAMEL_2 = re.compile(r"([a-z0-9])([A-Z])")


def snake_case(name: str) -> str:
    """`Tokenize` → `tokenize`, `HTTPFetch` → `http_fetch`, `MyHTTPFetch2` → `my_http_fetch2`."""
    return _CAMEL_2.sub(r"\1_\2", _CAMEL_1.sub(r"\1_\2", name)).lower()


class Node:
    """Subclass and implement `forward(self, x, ctx)`, returning `Done(value)`."""

    def forward(self, x, ctx):
        raise NotImplementedError(f"{type(self).__name__} must implement forward(self, x, ctx)")

    def _default_id(self) -> str:
        """The id this node gets when none is given; suffixes `_2`, `_3` are added by the graph."""
        return snake_case(type(self).__name__)

    # The DSL: a Node is a one-leaf expression.
    def __rshift__(self, other):
        return Leaf(self) >> other

    def __rrshift__(self, other):
        return Leaf(self).__rrshift__(other)

    def __or__(self, other):
        return Leaf(self) | other

    def __ror__(self, other):
        return Leaf(self).__ror__(other)

    def on(self, device) -> Leaf:
        """This node placed on `device` (validated here)."""
        return Leaf(self).on(device)

    def named(self, name: str) -> Leaf:
        """This node with the explicit id `name`."""
        return Leaf(self).named(name)


class FnNode(Node):
    """A node made from a plain function `f(x)` or `f(x, ctx)` by `soma.fn`."""

    def __init__(self, func, name: str):
        self.func = func
        self.name = name
        self.takes_ctx = _takes_ctx(func)

    def forward(self, x, ctx):
        out = self.func(x, ctx) if self.takes_ctx else self.func(x)
        return out if type(out) is Done else Done(out)

    def _default_id(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"soma.fn({self.name})"


def fn(func, name: str | None = None) -> FnNode:
    """A node from a plain function; its return value is wrapped in `Done` for you.

    The function is called `f(x, ctx)` when it has a parameter named `ctx` or a
    second required positional parameter, and `f(x)` otherwise. The node's
    default id is `name`, else the function's name (a lambda needs `name=`).
    """
    if not callable(func):
        raise TypeError(f"soma.fn needs a callable, got {type(func).__name__} {func!r}")
    if name is None:
        name = getattr(func, "__name__", None)
        if name is None:
            name = snake_case(type(func).__name__)
        if name == "<lambda>":
            raise GraphError("soma.fn(<lambda>) needs name=: a lambda has no name to make an id from")
    return FnNode(func, check_id(name, "soma.fn's name"))


def _takes_ctx(func) -> bool:
    import inspect  # here, not at the top: a worker starting up does not need it

    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False  # builtins without a signature take just x
    if any(p.name == "ctx" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)
