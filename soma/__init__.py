"""soma: a dataflow-graph engine for ML pipelines.

    import soma
    g = soma.Graph.somatize(Tokenize() >> (Encoder().on("cpu") | Other()) >> Join())
    soma.Executor().run(g, "some text")           # in this process
    with soma.Local(workers=2) as local:          # on worker processes
        local.run(g, "some text")

`import soma` never imports torch; torch is imported when a value needs it.
"""

from __future__ import annotations

from . import plan
from .ctx import Ctx
from .device import Device
from .errors import (
    DeviceError,
    GraphError,
    NodeError,
    PlacementError,
    PostconditionError,
    RunTimeout,
    SomaError,
    WorkerDied,
)
from .executor import Executor
from .graph import Graph
from .node import Node, fn
from .values import Done, Opaque

__version__ = "0.1.0"

_LAZY = {
    "Local": ("soma.scheduler", "Local"),
    "Trainer": ("soma.trainer", "Trainer"),
    "torch": ("soma.torch", None),
}


def __getattr__(name: str):
    # Local pulls in zmq/msgpack, Trainer and soma.torch pull in torch: only when asked for.
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'soma' has no attribute {name!r}")


__all__ = [
    "Ctx", "Device", "DeviceError", "Done", "Executor", "Graph", "GraphError", "Local", "Node",
    "NodeError", "Opaque", "PlacementError", "PostconditionError", "RunTimeout", "SomaError",
    "Trainer", "WorkerDied", "fn", "plan",
]
