"""`soma.Ray`: the same graphs, `run` and `map`, on a Ray cluster. How an input flows is drawn in
`soma.ray.runner`; see docs/ray.md.

    runner.py      the public face: life, run, map, trace (`Ray`)
    driver.py      the driver's side once connected (`Driver`): compiles a graph into an `ActorGraph`,
                   submits inputs, fetches their outputs, ends them; the one interface runner and
                   inflight call
    submission.py  one input (or a map's batch) through the plan (`Submission`, its `Call`s): every
                   call submitted at once, the plan walked by `soma.plan.fold`
    inflight.py    map's in-flight set (`RayInflight`): inputs in batches that share one call per node
    copies.py      the book of actors (`ActorBook`, `NodeActors`, `CopyActor`): which actor takes an input
    faults.py      Ray's errors as soma's, timeouts, abandoned inputs
    tracing.py     a trace block: the actors' records collected onto the driver's clock
    devices.py     pure: a node's actor options, the CUDA order, which machines can host it
    actor.py       the only module that runs inside Ray actors: one copy of one node (`NodeCopy`)

`import soma` never imports Ray: this package imports it only once `soma.Ray` is used.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "Ray":
        from .runner import Ray

        return Ray
    raise AttributeError(f"module 'soma.ray' has no attribute {name!r}")


__all__ = ["Ray"]
