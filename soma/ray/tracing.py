"""`trace(path)` on Ray: the actors keep their records, the end of the block collects them onto one clock.

    block opens   the driver's track is named; each actor that is up has its clock offset measured
    in the block  every call of a traced input carries its trace tag (index, block): the actor keeps one
                  record per Ray call (soma.ray.actor: when, which thread, the inputs and their node spans)
    node let go   (its graph garbage inside the block) its actors are asked for their records before they stop
    block ends    every actor is asked for its records (`take_spans`, in its control group); of this
                  block's: one `ray call` event per Ray call (args `inputs`, `batch`: what it carried) and
                  one node event per node execution, on the actor's track, on the driver's clock

Records of an input that was still running when its block ended reach its actor
after the take: they name that block, so the next block drops them (an input is
in neither block, never in the wrong one).
"""

from __future__ import annotations

import os
import time

from .copies import CopyActor, control
from .faults import UNANSWERED, ask

SPANS_ANSWER_S = 10.0  # how long the end of a trace block waits for each actor's records


def block_started(driver, trace) -> None:
    """Name the driver's track; measure the clock of every actor that is up (as near the spans as can be).
    `driver` is None before the runner has connected: no actors yet."""
    trace.process(os.getpid(), f"host (soma.Ray driver, pid {os.getpid()})")
    for actor in driver.book.actors() if driver is not None else ():
        if actor.ready:
            offset_of(driver, actor)


def collect(driver, trace, actors: list | None = None) -> None:
    """Take every actor's records (these `actors`' when given: a node let go inside the block, before its
    actors stop) and add this block's to `trace` (an actor that does not answer: lost)."""
    if actors is None:
        actors = driver.book.actors()
    if not actors:
        return
    for actor, taken in zip(actors, ask(driver.ray, [a.handle for a in actors], "take_spans", SPANS_ANSWER_S)):
        if taken == UNANSWERED:
            continue  # dead, or stuck: its records are lost with it
        records = [record for record in taken if record[0] == trace.start_ns]
        if not records:
            continue
        driver.book.learn(actor)
        node_id, device = actor.owner.node_id, actor.owner.device
        devices = {node_id: device} if device is not None else {}
        offset, pid, worker = offset_of(driver, actor), actor.pid, actor.actor_id
        trace.process(pid, f"Ray actor {worker} (node `{node_id}`, pid {pid})")
        for _, start, end, tid, inputs in records:
            trace.thread(pid, tid, f"{worker} thread {tid}")
            trace.span("ray call", "ray", start + offset, end + offset, pid, tid,
                       {"node": node_id, "device": device, "worker": worker,
                        "inputs": [index for index, _ in inputs], "batch": len(inputs)})
            for index, spans in inputs:
                trace.node_spans(spans, pid, worker, devices, index, offset)


def offset_of(driver, actor: CopyActor) -> int:
    """The driver's clock minus this actor's: 0 on the driver's machine (one CLOCK_MONOTONIC), else measured.

    Measured as the best of three round trips asking the actor for its clock,
    against the middle of the round trip: off by at most half of that round trip.
    """
    if actor.offset_ns is not None:
        return actor.offset_ns
    if actor.ray_node == driver.ray_node:
        actor.offset_ns = 0
        return 0
    best = None
    for _ in range(3):
        before = time.monotonic_ns()
        try:
            theirs = driver.ray.get(control(actor.handle, "clock"), timeout=SPANS_ANSWER_S)
        except Exception:  # gone, or stuck: its spans (if any) are placed as if on this machine
            return 0
        after = time.monotonic_ns()
        if best is None or after - before < best[0]:
            best = (after - before, (before + after) // 2 - theirs)
    actor.offset_ns = best[1]
    return actor.offset_ns
