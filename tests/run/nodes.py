"""Nodes of the contract tests every runner runs (tests/run/): setup, map's order and errors, copies.
Workers and actors import them by name (`tests.run.nodes`: they start with the driver's sys.path)."""

from __future__ import annotations

import os
import time

from soma import Done, Node
from tests.nodes import Sleep


class ReturnsList(Node):
    def forward(self, x, ctx):
        return [x]


class SetupCounter(Node):
    """Counts setup() and forward() calls in the copy it runs in; returns (pid, setups, calls)."""

    def __init__(self):
        self.setups = 0
        self.calls = 0

    def setup(self, ctx):
        self.setups += 1
        self.setup_ctx = (ctx.node, ctx.device, ctx.worker)

    def forward(self, x, ctx):
        self.calls += 1
        return Done((os.getpid(), self.setups, self.calls))


class SetupSees(Node):
    """Returns what its setup's ctx said: (node, device, worker is given), seen from the copy itself."""

    def setup(self, ctx):
        self.seen = (ctx.node, ctx.device, ctx.worker is not None)

    def forward(self, x, ctx):
        return Done(self.seen)


class EqualToItsKind(SetupSees):
    """Equal to (and hashed as) every other of its class: value semantics, as a frozen dataclass's. Two of them
    are still two nodes, each with its own setup (and lock)."""

    def __eq__(self, other):
        return type(other) is type(self)

    def __hash__(self):
        return 0


class OneCopySleep(Sleep):
    copies = 1


class PidAfter(Node):
    """Sleeps `seconds`, then returns its pid (a stateless node that takes a while)."""

    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return Done(os.getpid())


class FailOn(Node):
    """Returns its input, except for `bad`, where it raises ValueError."""

    def __init__(self, bad):
        self.bad = bad

    def forward(self, x, ctx):
        if x == self.bad:
            raise ValueError(f"bad input {x!r}")
        return Done(x)


class AppendLine(Node):
    """Appends its input to a file (one line per execution: a count of what really ran), returns it."""

    def __init__(self, path, seconds=0.0):
        self.path, self.seconds = path, seconds

    def forward(self, x, ctx):
        with open(self.path, "a") as f:
            f.write(f"{x}\n")
        time.sleep(self.seconds)
        return Done(x)


class NotReentrant(Node):
    """Fails if two threads are ever inside its forward at once (the copy rule)."""

    def __init__(self, seconds=0.01):
        self.seconds = seconds
        self.inside = 0

    def forward(self, x, ctx):
        self.inside += 1
        try:
            if self.inside > 1:
                raise AssertionError("two threads inside one node's forward at once")
            time.sleep(self.seconds)
            return Done(x)
        finally:
            self.inside -= 1


class SetupFailsOnce(Node):
    """Its first setup raises; the next one succeeds. Returns how many setups it saw."""

    def __init__(self):
        self.tries = 0

    def setup(self, ctx):
        self.tries += 1
        if self.tries == 1:
            raise ValueError("the model file is not there yet")

    def forward(self, x, ctx):
        return Done(self.tries)


class MakesOnDevice(Node):
    """Makes a tensor on ctx.device: fails where that device does not exist."""

    def forward(self, x, ctx):
        import torch

        return Done(torch.ones(2, device=ctx.device))



class Twice(Node):
    """Its input twice in one output, `(x, x)`: one object the output holds in two places (`tag`: `(tag, x)`)."""

    def __init__(self, tag: str | None = None):
        self.tag = tag

    def forward(self, x, ctx):
        return Done((x, x) if self.tag is None else (self.tag, x))


class CodeError(Exception):
    """An exception whose __init__ takes another argument than its args (a code, its message made of it)."""

    def __init__(self, code):
        super().__init__(f"custom code {code}")
        self.code = code


class PlaceError(Exception):
    """An exception whose __init__ takes two arguments, and whose text is made of its attributes."""

    def __init__(self, code, where):
        super().__init__(code)
        self.code, self.where = code, where

    def __str__(self):
        return f"code {self.code} at {self.where}"


class Thing:
    """An object with the default repr (its address in it)."""


class RaisesOwn(Node):
    """Raises CodeError(x), PlaceError(x, "here") or KeyError(Thing()) (`kind`: "code", "place", "address")."""

    def __init__(self, kind):
        self.kind = kind

    def forward(self, x, ctx):
        if self.kind == "address":
            raise KeyError(Thing())
        raise CodeError(x) if self.kind == "code" else PlaceError(x, "here")
