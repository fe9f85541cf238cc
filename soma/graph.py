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
from .node import Expr, Leaf, Node, composed, not_a_node, operand
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
        catalog, topology, placed = composed(expr)
        self._catalog: dict[str, Node] = catalog
        self._topology = topology
        self._placement = Placement(placed)
        # Bumped by every `place()`: a runner keeps what it compiled for a graph per version (an attribute, not
        # a property: every run reads it).
        self.placement_version = 0

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
        self.placement_version += 1
        return self

    # -- when -----------------------------------------------------------------------------
    def plan(self) -> Plan:
        """The plan: the topology itself, in the plan's vocabulary (the placement is never part of it)."""
        return self._topology

    # -- running and training ---------------------------------------------------------------
    def run(self, x, *, timeout: float | None = None):
        """Shorthand for `soma.Executor().run(g, x)`: the run in this process (soma.run.inprocess)."""
        from .run.inprocess import run_here

        return run_here(self._catalog, self.devices(), self._topology, x, timeout)

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
