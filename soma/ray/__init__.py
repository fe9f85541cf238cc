"""`soma.Ray`: the same graphs, `run` and `map`, on a Ray cluster. How an input flows is drawn in
`soma.ray.runner`; see docs/ray.md.

Each module imports only those below it (calls go down, answers come back up):

    runner.py      the public face: life, run, arun, submit, map, trace (`Ray`)
    inflight.py    map's in-flight set (`RayInflight`): cheap inputs in batches that share one call per
                   node; heavy ones held until a copy is free, one more copy when it pays (spreading.py)
    driver.py      the driver's side once connected (`Driver`): compiles a graph into an `ActorGraph`,
                   submits inputs, fetches their outputs, ends them; the one interface runner, inflight,
                   the settler and tracing call (those two get it handed, never import it)
    settler.py     submit's one thread: every submitted input's Future settled
    gathering.py   concurrent runs of a batching graph submitted together
    tries.py       one input's tries (`Tries`): the retry-or-finish loop of run, arun, submit and
                   map, written once (sent again, finished, or its named error), and how each path waits
    tracing.py     a trace block: the actors' records collected onto the driver's clock
    faults.py      Ray's errors as soma's, timeouts, abandoned inputs
    copies.py      the book of actors (`ActorBook`, `NodeActors`, `CopyActor`): which actor takes an
                   input; the only module that takes the book's lock or changes a copy's load
    submission.py  one input (or a map's batch) through the plan (`Submission`, its `Call`s): every call
                   submitted at once, the plan walked by `soma.plan.fold`
    actor.py       what Ray actors run: one copy of one node (`NodeCopy`)
    values.py      values on Ray's wire, in the driver and the actors alike: soma's tensor serializer,
                   read-only arrays made writable
    records.py     which call a dead actor had started (a start record per actor, on its machine)
    devices.py     pure: a node's actor options, the CUDA order, which machines can host it
    spreading.py   pure: the cost model (an input's cost against a copy's measured start-up)

`import soma` never imports Ray: this package imports it only once `soma.Ray` is used.
"""

from __future__ import annotations


def __getattr__(name: str):
    if name == "Ray":
        from .runner import Ray

        return Ray
    raise AttributeError(f"module 'soma.ray' has no attribute {name!r}")


__all__ = ["Ray"]
