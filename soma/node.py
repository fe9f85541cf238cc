"""Nodes and the DSL that composes them: `Node`, `soma.fn`, and the expressions `>>`, `|`, `.on()` build.

A node is the Catalog's half of the graph: the code and its state. Its id and
placement live outside it (in the expression, then in the `Graph`), so a
subclass need not call `Node.__init__`.

An expression is an immutable tree of `Leaf` (a node, with an optional explicit
id and device), `Chain` (`a >> b >> c`) and `Fan` (`a | b | c`). Both operators
flatten, so a chain never holds a chain and a fan never holds a fan.
`Graph.somatize` turns an expression into a graph (what it holds: `composed`). The expression tree and the
plan tree (`soma.plan`: Step, Seq, Wave) have the same shape, and both exist
because an expression holds node objects before they have ids (a default id
depends on the whole graph: `linear`, `linear_2`), while the plan holds ids only.
"""

from __future__ import annotations

import re
import sys

from .device import Device
from .errors import DeviceError, GraphError, NotANodeError
from .plan import Plan, Seq, Step, Wave
from .values import Done

_CAMEL_1 = re.compile(r"(.)([A-Z][a-z]+)")
_CAMEL_2 = re.compile(r"([a-z0-9])([A-Z])")


def snake_case(name: str) -> str:
    """`Tokenize` → `tokenize`, `HTTPFetch` → `http_fetch`, `MyHTTPFetch2` → `my_http_fetch2`."""
    return _CAMEL_2.sub(r"\1_\2", _CAMEL_1.sub(r"\1_\2", name)).lower()


# -- expressions --------------------------------------------------------------------------------

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_id(name, what: str = "a node id") -> str:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise GraphError(
            f"{what} must be a Python-identifier-like name (letters, digits, _; not starting with a digit), got {name!r}"
        )
    return name


def as_expr(value, op: str, other, value_on_left: bool = False) -> "Expr":
    """`value` as an expression, or the not-a-node error, showing both operands in the order they were written.

    `other` is the operand that is already an expression; `value_on_left` says that
    `value` was written on the left of `op` (Python called the right operand's
    reflected operator: `upper >> Tokenize()`).
    """
    if isinstance(value, Expr):
        return value
    if isinstance(value, Node):
        return Leaf(value)
    left, right = (operand(value), other.render()) if value_on_left else (other.render(), operand(value))
    raise not_a_node(value, f"cannot compose {left} {op} {right}: both sides of `{op}` must be soma nodes or "
                            f"expressions")


def not_a_node(value, said: str) -> NotANodeError:
    """The one error for `value` given where a node, an expression or a graph was expected (`>>`, `|`,
    `Graph.somatize`, every runner's run, map, submit, arun and amap): `said`, then what to write instead
    when it can be told: `Tokenize()` for a Node class, `soma.fn(upper)` for a plain function (SPEC 7)."""
    if isinstance(value, type) and issubclass(value, Node):
        return NotANodeError(f"{said} (`{value.__name__}` is a Node class, not a node: did you mean "
                             f"`{value.__name__}()`?)")
    torch = sys.modules.get("torch")
    module = getattr(getattr(torch, "nn", None), "Module", None)
    if module is not None and isinstance(value, module):  # (callable too: not a function to wrap with soma.fn)
        return NotANodeError(f"{said} (a torch module is a node through soma.torch: "
                             f"`soma.torch.Module({type(value).__name__}(...))`, or `soma.torch.Batched(...)` "
                             f"to run the inputs that meet at it as one batch)")
    if callable(value):
        name = getattr(value, "__name__", None)
        example = f"soma.fn({name})" if isinstance(name, str) and name.isidentifier() else 'soma.fn(f, name="...")'
        return NotANodeError(f"{said} (wrap a plain function with soma.fn: `{example}`)")
    return NotANodeError(said)


def operand(value) -> str:
    """What a value that is not a node is, in a few words: `function upper`, `class Tokenize`, `int 3`."""
    if isinstance(value, type):
        return f"class {value.__name__}"
    name = getattr(value, "__name__", None)
    if callable(value) and isinstance(name, str):
        return f"function {name}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


class Expr:
    """Base of the expression tree. Compose with `>>` and `|`."""

    __slots__ = ("_runs",)  # what `run` runs: composed once (an expression never changes), kept with it

    def run(self, x, *, timeout: float | None = None):
        """Shorthand for `soma.Executor().run(expr, x)`: the run in this process (soma.run.inprocess), on
        what `Graph.somatize(expr)` would hold (`composed`, made once and kept with the expression), without
        a Graph: soma.graph imports this module."""
        from .run.inprocess import run_here

        runs = getattr(self, "_runs", None)
        if runs is None:
            catalog, plan, placed = composed(self)
            runs = self._runs = (catalog, {node_id: str(device) for node_id, device in placed.items()}, plan)
        return run_here(*runs, x, timeout)

    def __rshift__(self, other) -> "Chain":
        other = as_expr(other, ">>", self)
        return Chain(_flat(self, Chain) + _flat(other, Chain))

    def __rrshift__(self, other) -> "Chain":
        return as_expr(other, ">>", self, value_on_left=True) >> self

    def __or__(self, other) -> "Fan":
        other = as_expr(other, "|", self)
        return Fan(_flat(self, Fan) + _flat(other, Fan))

    def __ror__(self, other) -> "Fan":
        return as_expr(other, "|", self, value_on_left=True) | self

    def on(self, device) -> "Expr":
        """Give `device` to every leaf that has none yet (the innermost `.on` wins)."""
        try:
            parsed = Device.parse(device)
        except DeviceError as err:
            raise DeviceError(f"{err} (in .on() of {self.render()})") from None
        return self._on(parsed)

    def named(self, name: str) -> "Expr":
        raise GraphError(
            f".named({name!r}) names one node, but {self.render()} is a composite expression: "
            f"name its nodes one by one"
        )

    def leaves(self):
        raise NotImplementedError

    def to_plan(self, ids: dict):
        """The same shape as a plan tree, each leaf a `Step` with its id (`ids`: id(leaf) → node id)."""
        raise NotImplementedError

    def render(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<soma expression {self.render()}>"


class Leaf(Expr):
    """One node in an expression, with the explicit id and device given to it so far."""

    __slots__ = ("node", "name", "device")

    def __init__(self, node, name: str | None = None, device: Device | None = None):
        self.node = node
        self.name = name
        self.device = device

    def _on(self, device: Device) -> "Leaf":
        return self if self.device is not None else Leaf(self.node, self.name, device)

    def named(self, name: str) -> "Leaf":
        return Leaf(self.node, check_id(name), self.device)

    def leaves(self):
        yield self

    def to_plan(self, ids: dict):
        return Step(ids[id(self)])

    def render(self) -> str:
        text = self.name or self.node._default_id()
        return text if self.device is None else f"{text}.on({str(self.device)!r})"


class Chain(Expr):
    """`a >> b >> c`: each item receives the previous item's output."""

    __slots__ = ("items",)

    def __init__(self, items: tuple):
        self.items = tuple(items)

    def _on(self, device: Device) -> "Chain":
        return Chain(tuple(item._on(device) for item in self.items))

    def leaves(self):
        for item in self.items:
            yield from item.leaves()

    def to_plan(self, ids: dict):
        return Seq(tuple(item.to_plan(ids) for item in self.items))

    def render(self) -> str:
        return " >> ".join(f"({i.render()})" if isinstance(i, Fan) else i.render() for i in self.items)


class Fan(Expr):
    """`a | b | c`: a wave; every branch receives the same input, the output is the tuple."""

    __slots__ = ("branches",)

    def __init__(self, branches: tuple):
        self.branches = tuple(branches)

    def _on(self, device: Device) -> "Fan":
        return Fan(tuple(b._on(device) for b in self.branches))

    def leaves(self):
        for branch in self.branches:
            yield from branch.leaves()

    def to_plan(self, ids: dict):
        return Wave(tuple(branch.to_plan(ids) for branch in self.branches))

    def render(self) -> str:
        return " | ".join(f"({b.render()})" if isinstance(b, Chain) else b.render() for b in self.branches)


def _flat(expr: Expr, kind: type) -> tuple:
    if isinstance(expr, kind):
        return expr.items if kind is Chain else expr.branches
    return (expr,)


# -- nodes --------------------------------------------------------------------------------------

class Node:
    """Subclass and implement `forward(self, x, ctx)`, returning `Done(value)`."""

    # A batching node's (one that defines `forward_batch`): at most `max_batch` inputs a call, waiting at most
    # `batch_wait` seconds after the first for more (SPEC 2); a subclass sets its own. Other nodes never read them.
    max_batch = 32
    batch_wait = 0.002

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
        self.takes_ctx = _takes_ctx(func)  # False, True (second positional), or "keyword" (keyword-only ctx)

    def forward(self, x, ctx):
        takes = self.takes_ctx
        out = self.func(x) if not takes else self.func(x, ctx) if takes is True else self.func(x, ctx=ctx)
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
    _check_plain(func)
    if name is None:
        name = getattr(func, "__name__", None)
        if name is None:
            name = snake_case(type(func).__name__)
        if name == "<lambda>":
            raise GraphError("soma.fn(<lambda>) needs name=: a lambda has no name to make an id from")
    return FnNode(func, check_id(name, "soma.fn's name"))


def _check_plain(func) -> None:
    """A TypeError for a function soma cannot call as a node: an `async def` (soma calls nodes and uses what they
    return: a coroutine object was the Executor's output, and Local's "cannot pickle 'coroutine'") or a
    generator function (a generator object, the same), or a callable object whose `__call__` is one."""
    import functools
    import inspect

    plain = inspect.isroutine(func) or isinstance(func, functools.partial)
    called = func if plain else getattr(func, "__call__", func)
    kind = ("an async def function" if inspect.iscoroutinefunction(called) or inspect.isasyncgenfunction(called)
            else "a generator function" if inspect.isgeneratorfunction(called) else None)
    if kind is not None:
        name = getattr(func, "__qualname__", repr(func))
        raise TypeError(f"soma.fn({name}): it is {kind}, and soma calls a node's function and takes what it returns "
                        f"as its output; make it a plain def that returns the output (a list for what it would yield; "
                        f"asyncio.run(...) inside it for what it would await)")


def _takes_ctx(func) -> bool | str:
    import inspect  # here, not at the top: a worker starting up does not need it

    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return False  # builtins without a signature take just x
    named = next((p for p in params if p.name == "ctx"), None)
    if named is not None:
        return "keyword" if named.kind is named.KEYWORD_ONLY else True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    return len(required) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


def is_max_batch(value) -> bool:
    """A batching node's `max_batch`: an int >= 1 (the one rule: node checks and soma.torch.Batched use it)."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def is_batch_wait(value) -> bool:
    """A batching node's `batch_wait`: a finite real number of seconds >= 0."""
    import math
    import numbers

    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 <= value < math.inf


def _check_batching(node_id: str, node, cls: str) -> None:
    """A batching node's `max_batch` (an int >= 1) and `batch_wait` (seconds >= 0), refused now when they are not
    (a negative max_batch hung Local; None, 2.5 or "4" raised deep in a run, differently on each runner)."""
    most = node.max_batch
    if not is_max_batch(most):
        raise GraphError(f"node `{node_id}` ({cls}) has max_batch = {most!r}: it must be an int >= 1, the most inputs "
                         f"one forward_batch call gets")
    wait = node.batch_wait
    if not is_batch_wait(wait):
        raise GraphError(f"node `{node_id}` ({cls}) has batch_wait = {wait!r}: it must be the seconds (a number >= 0) "
                         f"a batch may wait for more inputs to join it")


def copy_limit(node_id: str, node) -> int | None:
    """A node's `copies` (class attribute): None (the runner decides) or a positive int."""
    copies = getattr(node, "copies", None)
    if copies is None:
        return None
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise GraphError(f"node `{node_id}` ({type(node).__name__}) has copies = {copies!r}: it must be None "
                         f"(let the runner decide) or a positive int (1: every input goes through one instance)")
    return copies


# -- an expression composed: what a Graph holds -------------------------------------------------

def composed(expr: Expr) -> tuple[dict, Plan, dict]:
    """What a graph of `expr` holds: its catalog (id → Node, in the order the expression wrote them), its
    topology (the plan) and the devices its leaves were put on (id → Device); a GraphError for a node used
    twice, two nodes of one id, or a forward soma cannot call."""
    leaves = list(expr.leaves())
    ids = _assign_ids(leaves)
    for leaf in leaves:
        _check_forward(ids[id(leaf)], leaf.node)
        copy_limit(ids[id(leaf)], leaf.node)  # (its `copies` refused now, on every runner, not by one runner later)
    catalog = {ids[id(leaf)]: leaf.node for leaf in leaves}
    placed = {ids[id(leaf)]: leaf.device for leaf in leaves if leaf.device is not None}
    return catalog, expr.to_plan(ids), placed


def _assign_ids(leaves: list[Leaf]) -> dict[int, str]:
    """Explicit ids first, then default ids with `_2`, `_3` suffixes in order of appearance."""
    seen_nodes: dict[int, Leaf] = {}
    for leaf in leaves:
        if id(leaf.node) in seen_nodes:
            first = seen_nodes[id(leaf.node)]
            raise GraphError(
                f"the same Node instance ({first.render()}, {type(leaf.node).__name__}) is used twice in one "
                f"expression: a node holds its own state, so create a second instance"
            )
        seen_nodes[id(leaf.node)] = leaf
    taken: set[str] = set()
    for leaf in leaves:
        if leaf.name is not None:
            if leaf.name in taken:
                raise GraphError(f"two nodes are named `{leaf.name}`: ids must be unique in a graph")
            taken.add(leaf.name)
    ids: dict[int, str] = {}
    counters: dict[str, int] = {}
    for leaf in leaves:
        if leaf.name is not None:
            ids[id(leaf)] = leaf.name
            continue
        base = check_id(leaf.node._default_id(), f"the default id of {type(leaf.node).__name__}")
        n = counters.get(base, 0)
        while True:
            n += 1
            candidate = base if n == 1 else f"{base}_{n}"
            if candidate not in taken:
                break
        counters[base] = n
        taken.add(candidate)
        ids[id(leaf)] = candidate
    return ids


def _check_forward(node_id: str, node: Node) -> None:
    """A GraphError now, naming the node, when the method soma calls cannot be called as soma calls it:
    `forward(x, ctx)`, or `forward_batch(xs, ctx)` for a node that takes batches.

    Only a signature that surely refuses two positional arguments is refused:
    defaults, `*args` and callables without a signature (builtins) pass.
    """
    method = "forward_batch" if callable(getattr(node, "forward_batch", None)) else "forward"
    arg = "xs" if method == "forward_batch" else "x"
    forward = getattr(node, method, None)
    cls = type(node).__name__
    if not callable(forward):
        raise GraphError(f"node `{node_id}` ({cls}) has no callable forward: soma calls forward(x, ctx)")
    if method == "forward" and getattr(type(node), "forward", None) is Node.forward:
        raise GraphError(f"node `{node_id}` ({cls}) defines no forward: soma calls forward(x, ctx); define it as "
                         f"`def forward(self, x, ctx)` (or `forward_batch(self, xs, ctx)` for one that takes batches)")
    if method == "forward_batch":
        _check_batching(node_id, node, cls)
    import inspect  # here, not at the top: `import soma` and the workers do not need it

    kind = ("an async def" if inspect.iscoroutinefunction(forward) or inspect.isasyncgenfunction(forward)
            else "a generator function" if inspect.isgeneratorfunction(forward) else None)
    if kind is not None:  # (it passed every signature check, then failed each input: "returned coroutine")
        raise GraphError(f"node `{node_id}` ({cls}): its {method} is {kind}, and soma calls {method}({arg}, ctx) and "
                         f"takes what it returns; define it as a plain `def {method}(self, {arg}, ctx)` that returns "
                         f"Done(...) (asyncio.run(...) inside it for what it would await, a list for what it would "
                         f"yield)")
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return  # no signature to read (a builtin, an odd callable): it may well accept (x, ctx)
    try:
        signature.bind(None, None)
    except TypeError as err:
        written = getattr(type(node), method, None)  # as the class wrote it: `(self, x)`, not the bound `(x)`
        shown = inspect.signature(written) if inspect.isfunction(written) else signature
        raise GraphError(
            f"node `{node_id}` ({cls}): soma calls {method}({arg}, ctx), but {cls}.{method}{shown} cannot be called "
            f"that way ({err}); define it as `def {method}(self, {arg}, ctx)`"
        ) from None
