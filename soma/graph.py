"""`Graph`: what exists and how it connects, with its Catalog and its Placement beside it.

    g = Graph.somatize(Tokenize() >> (Encoder().on("cuda:0") | Other().on("cuda:1")) >> Join())
    g.nodes()      # ['tokenize', 'encoder', 'other', 'join']
    g.edges()      # [('tokenize', 'encoder'), ('tokenize', 'other'), ('encoder', 'join'), ('other', 'join')]
    g.devices()    # {'encoder': 'cuda:0', 'other': 'cuda:1'}
    str(g.plan())  # 'tokenize >> (encoder | other) >> join'
    g              # Graph(tokenize >> (encoder.on('cuda:0') | other.on('cuda:1')) >> join)

Three facts live here and stay apart: the topology (a tree of `Step(id)`,
`Seq` and `Wave`, immutable once built: the plan's own vocabulary, so there is
one tree and not two), the catalog (`id → Node`), and the placement
(`id → Device`, the only mutable one, through `place()`). The plan is compiled
from the topology alone.
"""

from __future__ import annotations

from .device import Device
from .errors import DeviceError, GraphError
from .node import Expr, Leaf, Node, check_id, not_a_node, operand
from .placement import Placement
from .plan import Plan, Step, fold, render


class Graph:
    """A somatized expression: nodes with ids, edges, a placement, and a plan."""

    def __init__(self, expr):
        if isinstance(expr, Node):
            expr = Leaf(expr)
        if not isinstance(expr, Expr):
            raise not_a_node(expr, f"Graph.somatize needs a soma Node or an expression built with >> and |; got "
                                   f"{operand(expr)}")
        leaves = list(expr.leaves())
        ids = _assign_ids(leaves)
        for leaf in leaves:
            _check_forward(ids[id(leaf)], leaf.node)
        self._catalog: dict[str, Node] = {ids[id(leaf)]: leaf.node for leaf in leaves}
        self._topology = expr.to_plan(ids)
        self._placement = Placement(
            {ids[id(leaf)]: leaf.device for leaf in leaves if leaf.device is not None}
        )

    @classmethod
    def somatize(cls, expr) -> "Graph":
        """Build a graph from a Node or an expression."""
        return cls(expr)

    # -- what exists and how it connects -------------------------------------------------
    def nodes(self) -> list[str]:
        """Node ids, in the order the expression wrote them."""
        return list(self._catalog)

    def edges(self) -> list[tuple[str, str]]:
        """`(src, dst)` pairs: dst receives src's output."""
        return fold(self._topology, _step_ends, _seq_ends, _wave_ends)[2]

    def node(self, node_id: str) -> Node:
        """The Node object with this id."""
        self._check_known(node_id)
        return self._catalog[node_id]

    # -- where ----------------------------------------------------------------------------
    def devices(self) -> dict[str, str]:
        """`{id: device}` for placed nodes only, in node order."""
        return {nid: str(dev) for nid in self._catalog if (dev := self._placement.of(nid)) is not None}

    def device(self, node_id: str) -> str | None:
        """This node's placement, or None when unplaced."""
        self._check_known(node_id)
        dev = self._placement.of(node_id)
        return None if dev is None else str(dev)

    def place(self, node_id: str, device) -> "Graph":
        """Place (or re-place) one node; `None` unplaces it. A failure changes nothing."""
        self._check_known(node_id)
        if device is not None:
            try:
                device = Device.parse(device)
            except DeviceError as err:
                raise DeviceError(f"{err} (placing node `{node_id}`)") from None
        self._placement.set(node_id, device)
        return self

    @property
    def placement_version(self) -> int:
        """Bumped by every `place()`: a runner keeps what it compiled for a graph per version."""
        return self._placement.version

    # -- when -----------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The plan: the topology itself, in the plan's vocabulary (the placement is never part of it)."""
        return self._topology

    # -- running and training ---------------------------------------------------------------
    def run(self, x, *, timeout: float | None = None):
        """Shorthand for `soma.Executor().run(g, x)`."""
        from .run.executor import Executor

        return Executor().run(self, x, timeout=timeout)

    def parameters(self) -> list:
        """The torch parameters of every node that has them, each once, in node order."""
        seen: set[int] = set()
        params = []
        for node in self._catalog.values():
            get = getattr(node, "parameters", None)
            if not callable(get):
                continue
            for p in get():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def __repr__(self) -> str:
        def label(step: Step) -> str:
            dev = self._placement.of(step.id)
            return step.id if dev is None else f"{step.id}.on({str(dev)!r})"

        return f"Graph({render(self._topology, label)})"

    def _check_known(self, node_id) -> None:
        if node_id not in self._catalog:
            known = ", ".join(self._catalog)
            raise GraphError(f"no node `{node_id}` in this graph; its nodes are: {known}")


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
    import inspect  # here, not at the top: `import soma` and the workers do not need it

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


def _step_ends(step: Step) -> tuple:
    """(entry ids, exit ids, edges inside) of a part of the topology, for `edges()`."""
    return [step.id], [step.id], []


def _seq_ends(_, parts: list) -> tuple:
    edges = [edge for _, _, inside in parts for edge in inside]
    for (_, exits, _), (entries, _, _) in zip(parts, parts[1:]):
        edges.extend((src, dst) for src in exits for dst in entries)
    return parts[0][0], parts[-1][1], edges


def _wave_ends(_, parts: list) -> tuple:
    return ([i for entries, _, _ in parts for i in entries], [o for _, exits, _ in parts for o in exits],
            [edge for _, _, inside in parts for edge in inside])
