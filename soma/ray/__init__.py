"""`soma.Ray`: the same graphs, `run` and `map`, on a Ray cluster. Drawn in `soma.ray.runner`; see docs/ray.md.

    devices.py  pure: a node's actor options, the CUDA order, which machines can host it
    actor.py    the only module that runs inside Ray actors: one copy of one node
    copies.py   the driver's book of actors: which copy takes an input
    flows.py    one input (or a map's batch) through a plan: every call submitted at once
    faults.py   Ray's errors as soma's, timeouts, abandoned inputs
    runner.py   the public face: life, run, map, trace

`import soma` never imports Ray: this package imports it only once `soma.Ray` is used.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "Ray":
        from .runner import Ray

        return Ray
    raise AttributeError(f"module 'soma.ray' has no attribute {name!r}")


__all__ = ["Ray"]
