"""What every runner (Executor, Local, Ray) shares: a context manager (async too), `trace(path)`, `arun`
and `amap` over each runner's `submit` (soma.run.aio), and the checks of what every `run` and `map` is given.

    with soma.Local(workers=2) as local:    __enter__ → start(), __exit__ → close()
        y = local.run(g, x)                 g: a Graph, or a Node or an expression (compiled once)
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .aio import AsyncRunner
from .trace import Traced


class RunnerBase(AsyncRunner, Traced):
    """A runner's life: `start()` makes it ready (nothing to do by default), `close()` releases what it
    holds (an Executor holds no threads or processes between runs: nothing)."""

    def start(self):
        return self

    def close(self) -> None:
        pass

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def as_graph(g, where: str):
    """The graph to run: `g` itself, or the graph of a Node or an expression, made once per object (so its
    program is compiled once too) for the last GRAPHS_KEPT objects. Anything else is a TypeError that says
    what `where` takes.

    Kept for a bounded number of objects, not for as long as they live: the graph holds the node, so a
    cache keyed by the node would keep every node ever run alive.
    """
    from ..graph import Graph
    from ..node import Expr, Node

    if isinstance(g, Graph):
        return g
    if not isinstance(g, (Node, Expr)):
        hint = (f" (`{g.__name__}` is a Node class: did you mean `{g.__name__}()`?)"
                if isinstance(g, type) and issubclass(g, Node) else "")
        raise TypeError(f"{where} runs a soma Graph, a Node or an expression built with >> and |; got "
                        f"{type(g).__name__}{hint}")
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
_graphs: OrderedDict = OrderedDict()  # id(node or expression) → (it, its graph), most recently run last
_graphs_lock = threading.Lock()


def checked_retries(retries) -> int:
    """`retries=` of run and map: how many more tries an input gets when its worker dies (default 0)."""
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a number of tries beyond the first (an int >= 0), got {retries!r}")
    return retries
