"""Nodes the tests share. They live in an importable module so worker processes load them by name."""

from __future__ import annotations

import os
import threading
import time

from soma import Done, Node, Opaque

_thread_tokens = threading.local()
_token_counter = iter(range(1, 1 << 62))


def thread_token() -> int:
    """A number unique to the calling thread for this process's life (idents are reused, these are not)."""
    token = getattr(_thread_tokens, "token", None)
    if token is None:
        token = _thread_tokens.token = next(_token_counter)
    return token


class Tokenize(Node):
    def forward(self, x, ctx):
        return Done(x.split())


class Upper(Node):
    def forward(self, x, ctx):
        return Done([w.upper() for w in x])


class Count(Node):
    def forward(self, x, ctx):
        return Done(len(x))


class Join(Node):
    def forward(self, x, ctx):
        return Done(x)


class Identity(Node):
    def forward(self, x, ctx):
        return Done(x)


class AddOne(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


class Double(Node):
    def forward(self, x, ctx):
        return Done(x * 2)


class Linear(Node):
    def forward(self, x, ctx):
        return Done(x)


class Boom(Node):
    """Raises ValueError("boom") with the input in its message."""

    def forward(self, x, ctx):
        raise ValueError(f"boom on {x!r}")


class ReturnsList(Node):
    def forward(self, x, ctx):
        return [x]


class SeeCtx(Node):
    """Returns what it saw: its ctx's node, device and worker, its thread and process."""

    def forward(self, x, ctx):
        return Done({
            "node": ctx.node, "device": ctx.device, "worker": ctx.worker,
            "thread": thread_token(), "pid": os.getpid(), "repr": repr(ctx),
        })


class Located:
    """Any object that says where it is: the postcondition needs nothing more than `.device`."""

    def __init__(self, device):
        self.device = device

    def __repr__(self):
        return f"Located({self.device!r})"


class ReturnsOn(Node):
    """Returns an object located on a fixed device, whatever it was placed on."""

    def __init__(self, where, wrap=lambda v: v):
        self.where = where
        self.wrap = wrap

    def forward(self, x, ctx):
        return Done(self.wrap(Located(self.where)))


class Obeys(Node):
    """Returns an object located where the ctx says (or on cpu when unplaced)."""

    def forward(self, x, ctx):
        return Done(Located(ctx.device or "cpu"))


class WaitBarrier(Node):
    """Waits at a shared barrier: proves branches run at the same time (it breaks otherwise)."""

    def __init__(self, barrier, timeout=10.0):
        self.barrier = barrier
        self.timeout = timeout

    def forward(self, x, ctx):
        self.barrier.wait(self.timeout)
        return Done((ctx.node, threading.get_ident()))


class ThreadId(Node):
    """Appends a token of the thread it ran on to its input list."""

    def forward(self, x, ctx):
        return Done((list(x) if isinstance(x, list) else []) + [thread_token()])


class Sleep(Node):
    """Sleeps `seconds` (releases the GIL), then returns its input."""

    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return Done(x)


class Spin(Node):
    """Pure-Python work holding the GIL for about `seconds`."""

    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        end = time.perf_counter() + self.seconds
        n = 0
        while time.perf_counter() < end:
            n += 1
        return Done(n)


class SetEvent(Node):
    def __init__(self, event, delay=0.0):
        self.event = event
        self.delay = delay

    def forward(self, x, ctx):
        time.sleep(self.delay)
        self.event.set()
        return Done(x)


class WrapOpaque(Node):
    def forward(self, x, ctx):
        return Done(Opaque(x))


class Counter(Node):
    """Stateful: counts its calls (state lives wherever the node runs)."""

    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        return Done(self.calls)
