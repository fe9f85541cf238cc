"""When a map's heavy inputs get another copy: the cost model, pure (no Ray, no clock of its own).

    RayInflight (map, inputs heavy or not measured yet)
      held inputs ── wait at the driver, oldest first; each goes to a copy that is up and has no input
      every event  (an outcome, a copy's hello, a tick while inputs are held) asks `copy_pays`:
                   would one more copy take a held input before the copies there now get to it?
                   yes → the book starts one (soma.ray.copies); it takes inputs once it says hello

    copy_pays(held=3, cost=0.5, busy=[0.5], copies=1, startup=1.1)
        the held inputs would start at 0.5, 1.0, 1.5 s on the one copy: the last waits 1.5 s, longer
        than a copy takes to start (1.1 s, measured): one more copy pays → True
    copy_pays(held=2, cost=0.5, busy=[0.5], copies=1, startup=1.1) → False: the last waits 1.0 s
    copy_pays(..., waited=1.2) → True: inputs have waited here for longer than a start-up (a map sees
        only its window: a long one, or one over a generator, is taken to go on as long again)

Why held at the driver rather than sent to the new copy at once: a copy that is
still starting takes no input while another is up, so a held input goes to
whichever copy is free first, the warm one or the new one. A map is then never
slower than its warm copies alone (the new copy only takes inputs nobody else
had taken yet), whatever the start-up turns out to be; the cost model only
decides whether starting one is worth its start-up (a process, imports, the
node's code: a second or more on a busy machine, and CPU taken from the
copies that work meanwhile).

The start-up is measured as it happens: from an actor's creation to its hello
(soma.ray.copies). Before any has been measured, STARTUP_PRIOR_S, a
conservative guess (a new copy must save more than that before one starts).
An input's cost is the graph's measured cost (`measured`); before any is known,
the longest that an input in flight has been running on a copy that is up (it
costs at least that), so a tick re-asks while inputs are held. The queue a map
shows is its window; how long inputs have been waiting says how long it goes on
(a map that has kept inputs waiting for longer than a start-up gets a copy, up to
the node's `copies`: a long map of heavy inputs spreads after one start-up).
"""

from __future__ import annotations

import heapq

# An input this slow goes alone in its calls: sharing one would save it < 2 % (a call costs Ray ~0.75 ms), and
# would serialize it behind its batch-mates. (Measured with the driver's clock, a tiny input on a busy 2-core
# machine looks like 4-8 ms: the threshold stays well above that.)
HEAVY_S = 0.050

# What a copy's start-up is taken to be before one has been measured: conservative (measured here: 0.6-1.2 s on a
# quiet 2-core machine, 1-3 s with other programs on it; a node that imports torch takes longer).
STARTUP_PRIOR_S = 2.0
STARTUPS_KEPT = 4  # the start-ups averaged (the latest ones: the machine's load changes)

# How often a map with held inputs asks `copy_pays` again while nothing else happens: an input's cost is known
# only as a lower bound (how long it has run) until it ends.
TICK_S = 0.1


def measured(graph, seconds: float) -> None:
    """Learn what one input of `graph` (an ActorGraph) costs, in actor-seconds: falls at once, rises by a tenth
    of the gap, since a slow consumer or a busy machine makes inputs look dearer than they are, and the
    quickest say best what the nodes cost."""
    cost = graph.cost
    graph.cost = seconds if cost is None or seconds < cost else cost + 0.1 * (seconds - cost)


def startup_estimate(own: list, others: list) -> tuple[float, str]:
    """(seconds, where from) a new copy of a node takes to start: the mean of the node's own latest start-ups,
    else of any node's, else STARTUP_PRIOR_S."""
    for measures, source in ((own, "measured"), (others, "measured on other nodes")):
        latest = measures[-STARTUPS_KEPT:]
        if latest:
            return sum(latest) / len(latest), source
    return STARTUP_PRIOR_S, "prior"


def input_cost(known: float | None, running: list, now: float) -> float:
    """What an input costs: `known` (the graph's measure), else the longest that one of the inputs in flight
    has run on copies that are up (`running`: when each started there, or None while its copy is starting)."""
    if known is not None:
        return known
    return max([now - since for since in running if since is not None] + [0.0])


def copy_pays(held: int, cost: float, busy: list, copies: int, startup: float, waited: float = 0.0) -> bool:
    """Whether one more copy would start a held input sooner than the copies there now: the last of the `held`
    inputs, taken oldest first by whichever of `copies` copies is free first (`busy`: how long each busy one
    still needs; the others are free now), waits longer than `startup`; or inputs have been waiting for
    `waited` seconds, longer than `startup` (a map sees only its window: one that has kept inputs waiting
    that long is taken to go on as long again, as a map over a generator may)."""
    if held <= 0 or copies <= 0:
        return False
    if waited > startup:
        return True
    if cost <= 0:
        return False
    free_at = sorted(busy)[:copies] + [0.0] * max(0, copies - len(busy))
    heapq.heapify(free_at)
    last_start = 0.0
    for _ in range(held):
        last_start = heapq.heappop(free_at)
        heapq.heappush(free_at, last_start + cost)
    return last_start > startup
