"""soma: a dataflow-graph engine for ML pipelines.

    import soma
    g = soma.Graph.somatize(Tokenize() >> (Encoder().on("cpu") | Other()) >> Join())
    soma.Executor().run(g, "some text")           # in this process
    with soma.Local(workers=2) as local:          # on worker processes
        local.run(g, "some text")

Every name is loaded when first used: `import soma` never imports torch or
ZeroMQ, and a worker process, which imports `soma.local.worker`, pays only for the
modules it runs (its start-up is on the critical path of `Local.start()`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_NAMES = {
    "Ctx": "soma.ctx",
    "Device": "soma.device",
    "Done": "soma.values",
    "Opaque": "soma.values",
    "Executor": "soma.run.executor",
    "Graph": "soma.graph",
    "Node": "soma.node",
    "fn": "soma.node",
    "Local": "soma.local.runner",
    "Ray": "soma.ray.runner",
    "Trainer": "soma.trainer",
    "SomaError": "soma.errors",
    "DeviceError": "soma.errors",
    "GraphError": "soma.errors",
    "PlacementError": "soma.errors",
    "NodeError": "soma.errors",
    "PostconditionError": "soma.errors",
    "SharedMemoryFull": "soma.errors",
    "WorkerDied": "soma.errors",
    "RunTimeout": "soma.errors",
}
_MODULES = {"plan", "torch", "errors"}


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"soma.{name}")
    else:
        raise AttributeError(f"module 'soma' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_NAMES) | _MODULES)


__all__ = sorted(_NAMES) + ["plan"]
