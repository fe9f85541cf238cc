"""From a graph's plan to what workers run: the *program*, compiled once per graph and placement.

A program is the plan tree itself with some subtrees replaced by `Piece`s:

    plan:      tokenize >> (encoder | other) >> join
    program:   [tokenize] >> ([encoder] | [other]) >> [join]

* A `Piece` runs whole on one worker, one input at a time per worker. Nested
  waves inside a piece run on threads in that worker, as in-process.
* The host walks the `Seq`s and `Wave`s around the pieces: a wave's pieces go
  out together (to different workers when there are enough) and the host joins
  their outputs.
* A piece is as large as it can be (for `map`, the whole plan when it may be:
  see compile_program), and is cut
  - at top-level waves, so their branches can use several workers;
  - where the CUDA device changes (a worker is pinned to one device);
  - around a node whose class limits its `copies`: that node is a piece of its
    own, so it can stay on the workers that hold its copies while the rest of the
    graph spreads over the pool (and a stage before it overlaps with it).

Compiling is pure: it reads the plan, the placement, node keys and `copies`,
and never touches a worker. A node on `cuda:N` needs a worker pinned to `cuda:N`:
that is checked here, before anything is dispatched.
"""

from __future__ import annotations

import itertools

from ...errors import PlacementError
from ...node import copy_limit
from ...plan import Plan, Seq, Step, Wave, fold
from ...run.batching import is_batching, max_batch_of
from ...wire.protocol import pack_piece

_piece_ids = itertools.count(1)


class Piece(Plan):
    """A part of the plan that runs whole on one worker.

    `keys`: node id → node key. `devices`: node id → declared device (placed nodes).
    `cuda`: the device its worker must be pinned to, if any. `max_copies`: at most
    this many copies of it may exist (None: as many as there are workers).
    `spec`: the piece as the protocol carries it (packed once). `batch`: its batching nodes' largest
    `max_batch` (0 when it has none): a worker runs that many of its jobs together, so they share calls.
    `bundle`: `batch` when the piece is a batching node alone, else 0: its inputs travel in Bundles of at
    most that many (protocol.Bundle: one encoding, one message entry, one outcome for many inputs).
    """

    __slots__ = ("id", "plan", "keys", "devices", "cuda", "max_copies", "spec", "entry", "checked_outputs", "batch",
                 "bundle")

    def __init__(self, plan: Plan, keys: dict, devices: dict, max_copies: int | None, batch: int = 0):
        ids = list(plan.steps())
        cuda = {devices[n] for n in ids if devices.get(n, "").startswith("cuda")}
        for name, value in (
            ("id", next(_piece_ids)),
            ("plan", plan),
            ("keys", {n: keys[n] for n in ids}),
            ("devices", {n: devices[n] for n in ids if n in devices}),
            ("cuda", next(iter(cuda)) if cuda else None),
            ("max_copies", max_copies),
            ("spec", pack_piece(plan, keys, devices)),
            ("entry", ids[0]),  # the first node: the one its input is for
            ("checked_outputs", outputs_to_check(plan, devices)),  # its output → what the postcondition checks
            ("batch", batch),  # its batching nodes' largest max_batch (0: none): how many of its jobs run together
            ("bundle", batch if type(plan) is Step else 0),
        ):
            object.__setattr__(self, name, value)

    def _key(self):
        return self.id

    def __eq__(self, other):
        return self is other

    __hash__ = object.__hash__  # (a piece is itself only, as __eq__ says: hashed in C, not by a call per job)

    def steps(self):
        return self.plan.steps()

    def __str__(self) -> str:
        return f"[{self.plan}]"


def compile_program(g, key_of, worker_devices: list[str], whole: bool = False) -> Plan:
    """The program for graph `g` under its current placement.

    `key_of(node)` gives a node's key (its identity across graphs and runs);
    `worker_devices` are the devices the pool's workers are pinned to.

    `whole`: one piece for the whole plan when it can run on one worker (no node
    limits its copies, at most one CUDA device). That is `map`'s program: with many
    inputs in flight every worker is busy anyway, so each input runs whole where it
    lands and its values between nodes never cross the host; a single `run` spreads
    a wave's branches over workers instead, for they are all the parallelism it has.
    """
    devices = g.devices()
    check_placement(devices, worker_devices)
    keys = {nid: key_of(g.node(nid)) for nid in g.nodes()}
    limits = {nid: copy_limit(nid, g.node(nid)) for nid in g.nodes()}
    batches = {nid: max_batch_of(g.node(nid)) if is_batching(g.node(nid)) else 0 for nid in g.nodes()}
    compiler = _Compiler(keys, devices, limits, batches)
    plan = g.plan()
    if whole and compiler.whole(plan) and all(limit is None for limit in limits.values()):
        return compiler.piece(plan)
    return compiler.top(plan)


def check_placement(devices: dict, worker_devices: list[str]) -> None:
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


class _Compiler:
    """Cuts a plan into pieces: a fold whose value for each part is a call making that part's program
    when it stands at the top or in a wave (made only where it is used: a part that joins a larger
    piece is never cut itself)."""

    def __init__(self, keys: dict, devices: dict, limits: dict, batches: dict):
        self.keys, self.devices, self.limits, self.batches = keys, devices, limits, batches

    def top(self, plan: Plan) -> Plan:
        """The plan at the top: cut into pieces."""
        return fold(plan, self._leaf, self._seq, self._wave)()

    def _leaf(self, step: Step):
        return lambda: self.piece(step)

    def _wave(self, wave: Wave, cuts: list):
        """A wave's branches: each one piece when it can run whole on one worker, else cut further."""
        return lambda: Wave(tuple(self.piece(b) if self._one_piece(b) else cut() for b, cut in zip(wave.branches, cuts)))

    def _seq(self, seq: Seq, cuts: list):
        """A sequence: runs of items that one worker can run together become one piece each."""
        def cut_seq():
            parts: list = []
            group: list = []

            def flush():
                if group:
                    parts.append(self.piece(group[0] if len(group) == 1 else Seq(tuple(group))))
                    group.clear()

            for item, cut in zip(seq.items, cuts):
                if isinstance(item, Wave) or not self.whole(item) or self.limited(item):
                    flush()
                    parts.append(cut())
                    continue
                if group and len(self.cuda_of(Seq(tuple(group + [item])))) > 1:
                    flush()
                group.append(item)
            flush()
            return parts[0] if len(parts) == 1 else Seq(tuple(parts))
        return cut_seq

    def _one_piece(self, plan: Plan) -> bool:
        return self.whole(plan) and (isinstance(plan, Step) or not any(self.limited(Step(n)) for n in plan.steps()))

    def whole(self, plan: Plan) -> bool:
        """Whether a worker pinned to one device can run all of it."""
        return len(self.cuda_of(plan)) <= 1

    def limited(self, plan: Plan) -> bool:
        return isinstance(plan, Step) and self.limits[plan.id] is not None

    def cuda_of(self, plan: Plan) -> set:
        return {self.devices[n] for n in plan.steps() if self.devices.get(n, "").startswith("cuda")}

    def piece(self, plan: Plan) -> "Piece":
        limits = [self.limits[n] for n in plan.steps() if self.limits[n] is not None]
        return Piece(plan, self.keys, self.devices, min(limits) if limits else None,
                     max(self.batches[n] for n in plan.steps()))


def output_devices(plan: Plan, devices: dict, value) -> list:
    """Pairs `(node id, declared device, value)` to check on what a piece returned.

    A piece's output is its last step's output; a piece ending in a wave returns a
    tuple, one element per branch.
    """
    return outputs_to_check(plan, devices)(value)


def outputs_to_check(plan: Plan, devices: dict):
    """`output_devices` for one plan, compiled once (a fold): a call from a piece's output to its pairs."""
    def leaf(step: Step):
        device = devices.get(step.id)
        return (lambda value: [(step.id, device, value)]) if device is not None else (lambda value: [])

    def wave(_, branches: list):
        def pairs(value):
            if type(value) is not tuple or len(value) != len(branches):
                return []
            return [pair for branch, item in zip(branches, value) for pair in branch(item)]
        return pairs

    return fold(plan, leaf, lambda _, items: items[-1], wave)


def pieces(program) -> list:
    """Every Piece of a program, in order."""
    return fold(program, lambda piece: [piece], _joined, _joined)


def _joined(_, parts: list) -> list:
    return [piece for part in parts for piece in part]
