"""From a graph's plan to what each worker runs: compiled once per graph and placement.

    plan:      tokenize >> (encoder | other) >> join
    program:   Chain[ Remote(tokenize), Spread[Remote(encoder), Remote(other)], Remote(join) ]

* A `Remote` is a piece of the plan that runs whole in one worker: a wave branch,
  or a run of consecutive steps outside any wave. Nested waves inside a branch run
  on threads in that worker, as in-process.
* A `Spread` is a top-level wave: its branches go to different workers when there
  are enough, and what goes to one worker travels in one message.
* A branch whose nodes are placed on two different CUDA devices cannot run whole
  on one worker (a worker is pinned to one device); it is split at its own steps.

Placement is checked here, before anything is dispatched: a node on `cuda:N` needs
a worker pinned to `cuda:N`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ..errors import PlacementError
from ..plan import Plan, Seq, Step, Wave


@dataclass(eq=False)
class Remote:
    """A piece of plan run whole on one worker."""

    plan: Plan
    spec: bytes  # the piece as the wire carries it (packed once)
    keys: dict  # node id → node key
    cuda: str | None  # the CUDA device its worker must be pinned to, if any
    devices: dict  # node id → declared device string (for the host's postcondition check)
    slot: int | None = None  # the worker it runs on, fixed at its first dispatch

    @property
    def entry(self) -> str:
        return next(self.plan.steps())


@dataclass(eq=False)
class Chain:
    parts: list


@dataclass(eq=False)
class Spread:
    parts: list


def compile_program(g, key_of, worker_devices: list[str]):
    """The program for graph `g` under its current placement.

    `key_of(node)` gives a node's key (its identity across graphs and runs);
    `worker_devices` are the devices the pool's workers are pinned to.
    """
    devices = g.devices()
    check_placement(g, devices, worker_devices)
    keys = {nid: key_of(g._catalog[nid]) for nid in g.nodes()}
    return _top(g.plan(), keys, devices)


def check_placement(g, devices: dict, worker_devices: list[str]) -> None:
    served = set(worker_devices)
    for nid, dev in devices.items():
        if dev.startswith("cuda") and dev not in served:
            raise PlacementError(
                f"node `{nid}` is placed on `{dev}`, but no worker of this pool serves it "
                f"(the workers serve: {', '.join(worker_devices)}); start the pool with "
                f"soma.Local(devices=[..., {dev!r}]) or place the node elsewhere",
                node=nid,
                devices=tuple(worker_devices),
            )


def cuda_of(plan: Plan, devices: dict) -> set:
    return {devices[n] for n in plan.steps() if devices.get(n, "").startswith("cuda")}


def _remote(plan: Plan, keys: dict, devices: dict) -> Remote:
    cuda = cuda_of(plan, devices)
    ids = list(plan.steps())
    return Remote(
        plan=plan,
        spec=msgpack.packb(_tree(plan, keys, devices), use_bin_type=True),
        keys={n: keys[n] for n in ids},
        cuda=next(iter(cuda)) if cuda else None,
        devices={n: devices[n] for n in ids if n in devices},
    )


def _tree(plan: Plan, keys: dict, devices: dict):
    if isinstance(plan, Step):
        return ["s", plan.id, keys[plan.id], devices.get(plan.id)]
    if isinstance(plan, Seq):
        return ["q", [_tree(i, keys, devices) for i in plan.items]]
    return ["w", [_tree(b, keys, devices) for b in plan.branches]]


def _top(plan: Plan, keys: dict, devices: dict):
    if isinstance(plan, Step):
        return _remote(plan, keys, devices)
    if isinstance(plan, Wave):
        return Spread([_branch(b, keys, devices) for b in plan.branches])
    parts: list = []
    group: list = []
    group_cuda: set = set()

    def flush():
        if group:
            piece = group[0] if len(group) == 1 else Seq(tuple(group))
            parts.append(_remote(piece, keys, devices))
            group.clear()
            group_cuda.clear()

    for item in plan.items:
        if isinstance(item, Wave):
            flush()
            parts.append(Spread([_branch(b, keys, devices) for b in item.branches]))
            continue
        cuda = cuda_of(item, devices)
        if group and len(group_cuda | cuda) > 1:
            flush()
        group.append(item)
        group_cuda |= cuda
    flush()
    return parts[0] if len(parts) == 1 else Chain(parts)


def _branch(plan: Plan, keys: dict, devices: dict):
    if len(cuda_of(plan, devices)) <= 1:
        return _remote(plan, keys, devices)
    return _top(plan, keys, devices)


def output_devices(plan: Plan, devices: dict, value):
    """Pairs `(node id, declared device, value)` to check on what a piece returned.

    A piece's output is its last step's output; a piece ending in a wave returns a
    tuple, one element per branch.
    """
    if isinstance(plan, Step):
        dev = devices.get(plan.id)
        return [(plan.id, dev, value)] if dev is not None else []
    if isinstance(plan, Seq):
        return output_devices(plan.items[-1], devices, value)
    if not isinstance(value, tuple) or len(value) != len(plan.branches):
        return []
    pairs = []
    for branch, item in zip(plan.branches, value):
        pairs.extend(output_devices(branch, devices, item))
    return pairs
