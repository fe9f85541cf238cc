"""What every runner (Executor, Local, Ray) shares: a context manager (async too), `trace(path)`, `arun`
and `amap` over each runner's `submit` (soma.run.aio), and the check of the graph every `run` and `map` is
given (its `timeout=` and `retries=`: soma.run.arguments).

    with soma.Local(workers=2) as local:    __enter__ → start(), __exit__ → close()
        y = local.run(g, x)                 accepting(g, "Local.run"): closed? SomaError; g a Graph, or a Node
                                            or an expression (its graph made once); else the one not-a-node error
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..errors import SomaError
from .aio import AsyncRunner
from .registry import warn_if_changed
from .trace import Traced


class RunnerBase(AsyncRunner, Traced):
    """A runner's life: `start()` makes it ready (nothing to do by default), `close()` releases what it
    holds and sets `_closed`; from then on `accepting` refuses every new input (SPEC 7)."""

    _closed = False  # set by close(): no run, map, submit, arun or amap is taken after it
    copies_nodes = True  # nodes run as copies made from them (Local, Ray; not the Executor): see `accepting`
    sent_files = None  # where nodes share worker processes (Local): the code files they may have imported

    def start(self):
        if self._closed:
            raise SomaError(closed_message(type(self).__name__))
        return self

    def close(self) -> None:
        self._closed = True

    def accepting(self, g, where: str):
        """The graph to run for `g` (`as_graph`), once this runner is known to take new work.

        After `close()` every way in (`run`, `map`, `submit`, `arun`, `amap`) is a `SomaError` saying so,
        as `concurrent.futures` refuses a submit after shutdown; checked before `g`, as it does. On a runner
        that copies nodes, a node whose code reads a global or closure variable rebound since the node was
        sent is warned about (soma.run.registry).
        """
        if self._closed:
            raise SomaError(closed_message(type(self).__name__))
        graph = as_graph(g, where)
        if self.copies_nodes:  # a node's copies keep what its code read when it was sent: say when that changed
            # (a map's start looks at weights too)
            warn_if_changed(graph, thorough=where.endswith("map"), files=self.sent_files)
        return graph

    async def arun(self, g, x, *, timeout: float | None = None, retries: int = 0):
        """`run(g, x)` without blocking the event loop; cancelling the awaiting task cancels the input."""
        # (its graph found here, so that what it was given is checked as `arun`'s, not as the `submit` under it)
        g = self.accepting(g, f"{type(self).__name__}.arun")
        return await super().arun(g, x, timeout=timeout, retries=retries)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def closed_message(runner: str) -> str:
    """What a closed runner says when it is given new work (also when it is started again)."""
    return f"this soma.{runner} is closed; make a new one"


def as_graph(g, where: str):
    """The graph to run: `g` itself, or the graph of a Node or an expression, made once per object (so its
    program is compiled once too) for the last GRAPHS_KEPT objects. Anything else is soma.node's one
    not-a-node error (a GraphError and a TypeError) saying what `where` takes and, for a plain function,
    to wrap it with soma.fn.

    Kept for a bounded number of objects, not for as long as they live: the graph holds the node, so a
    cache keyed by the node would keep every node ever run alive.
    """
    if type(g) is _graph_type[0]:  # (the common case, a Graph, without the imports below: a run's first step)
        return g
    from ..graph import Graph
    from ..node import Expr, Node, not_a_node, operand

    _graph_type[0] = Graph
    if isinstance(g, Graph):
        return g
    if not isinstance(g, (Node, Expr)):
        raise not_a_node(g, f"{where} runs a soma Graph, a Node or an expression built with >> and |; got "
                            f"{operand(g)}")
    with _graphs_lock:
        found = _graphs.get(id(g))
        if found is not None and found[0] is g:
            _graphs.move_to_end(id(g))
            return found[1]
    graph = Graph.somatize(g)
    with _graphs_lock:
        _graphs[id(g)] = (g, graph)
        while len(_graphs) > GRAPHS_KEPT:
            _graphs.popitem(last=False)
    return graph


GRAPHS_KEPT = 64
_graph_type: list = [None]  # soma.graph.Graph, once imported (imported here, not at the top: graph imports node)
_graphs: OrderedDict = OrderedDict()  # id(node or expression) → (it, its graph), most recently run last
_graphs_lock = threading.Lock()


