"""The nodes every layer's tests compose (model, run, local, wire, ray). They live in an importable module so
worker processes and Ray actors load them by name; the nodes one folder alone uses are next to it
(tests/run/nodes.py, tests/local/nodes.py), those of one test module in that module."""

from __future__ import annotations

import os
import threading
import time

from soma import Done, Node

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


class Identity(Node):
    def forward(self, x, ctx):
        return Done(x)


class AddOne(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


class Double(Node):
    def forward(self, x, ctx):
        return Done(x * 2)


class Boom(Node):
    """Raises ValueError("boom") with the input in its message."""

    def forward(self, x, ctx):
        raise ValueError(f"boom on {x!r}")


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


class Sleep(Node):
    """Sleeps `seconds` (releases the GIL), then returns its input."""

    def __init__(self, seconds):
        self.seconds = seconds

    def forward(self, x, ctx):
        time.sleep(self.seconds)
        return Done(x)


class WaitsForFile(Node):
    """Waits until `path` exists (30 s at most), then returns its input plus one: an input that is surely still
    in flight until the test says so."""

    def __init__(self, path):
        self.path = path

    def forward(self, x, ctx):
        deadline = time.monotonic() + 30
        while not os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return Done(x + 1)


class Pid(Node):
    """Returns the pid of the process it ran in."""

    def forward(self, x, ctx):
        return Done(os.getpid())


class Die(Node):
    """Ends its own process the hard way: a signal, or an exit code."""

    def __init__(self, sig=None, code=None, after=0.0):
        self.sig, self.code, self.after = sig, code, after

    def forward(self, x, ctx):
        time.sleep(self.after)
        if self.sig is not None:
            os.kill(os.getpid(), self.sig)
            time.sleep(5)
        os._exit(self.code if self.code is not None else 1)


class Unpicklable:
    def __reduce__(self):
        raise TypeError("Unpicklable refuses to be pickled")


class ReturnsUnpicklable(Node):
    def forward(self, x, ctx):
        return Done({"ok": 1, "bad": Unpicklable()})


class LocatedPerProcess:
    """Says it is on `cpu` in the process that made it and on `meta` anywhere else."""

    def __init__(self):
        self.pid = os.getpid()

    @property
    def device(self):
        return "cpu" if os.getpid() == self.pid else "meta"


class ReturnsMovingDevice(Node):
    def forward(self, x, ctx):
        return Done(LocatedPerProcess())


class MarkThenSleep(Node):
    """Writes a marker file (so a test knows it is running), then sleeps."""

    def __init__(self, path, seconds):
        self.path, self.seconds = path, seconds

    def forward(self, x, ctx):
        tmp = f"{self.path}.{os.getpid()}.{threading.get_ident()}.tmp"  # (copies may write at once)
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, self.path)  # whole or absent, never half-written
        time.sleep(self.seconds)
        return Done(x)


def in_segment(value) -> bool:
    """Whether a tensor's or an array's memory is a mapping of one of soma's segments in this process.

    (`Tensor.is_shared()` answers for torch's own shared-memory allocator only.)
    """
    address = value.data_ptr() if hasattr(value, "data_ptr") else value.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= address < hi:
                return len(fields) > 5 and os.path.basename(fields[5]).startswith("soma-")
    return False


class Shared(Node):
    """Reports how its input tensor arrived: (in a soma segment, the sum, its dtype name)."""

    def forward(self, x, ctx):
        return Done((in_segment(x), float(x.float().sum()), str(x.dtype)))


class RequiresGradOutput(Node):
    def forward(self, x, ctx):
        import torch

        w = torch.ones(3, requires_grad=True)
        return Done(w * 2)


class Fill(Node):
    """A tensor of `numel` float32 elements all equal to its input, born on the heap or through ctx.empty."""

    def __init__(self, numel, through_ctx=False):
        self.numel, self.through_ctx = numel, through_ctx

    def forward(self, x, ctx):
        import torch

        t = ctx.empty(self.numel, dtype=torch.float32) if self.through_ctx else torch.empty(self.numel)
        t.fill_(float(x))
        return Done(t)


class PlusOne(Node):
    """A new tensor: its input plus one (a tuple of tensors is summed first, as a join would)."""

    def forward(self, x, ctx):
        if isinstance(x, tuple):
            x = sum(x)
        return Done(x + 1)


class OneCopyCounter(Node):
    """A counter whose state must live in exactly one place: returns (its count, its pid)."""

    copies = 1

    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        return Done((self.calls, os.getpid()))


class Rendezvous(Node):
    """Marks its arrival in the file `mine`, then waits for the other branch's mark in `other`: proves two
    branches ran at once (it raises when the other never came). Returns what it saw: its pid and worker,
    whether the other's mark was there, and when it started and ended (monotonic ns)."""

    def __init__(self, mine, other, seconds=20.0):
        self.mine, self.other, self.seconds = str(mine), str(other), seconds

    def forward(self, x, ctx):
        start = time.monotonic_ns()
        with open(self.mine, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + self.seconds
        while not os.path.exists(self.other):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.other} never came: the branches did not run at once")
            time.sleep(0.001)
        return Done({"pid": os.getpid(), "saw_other": os.path.exists(self.other), "start": start,
                     "end": time.monotonic_ns(), "worker": ctx.worker})


class FailOdd(Node):
    """Returns its input, except for odd ones, where it raises ValueError("odd <x>")."""

    def forward(self, x, ctx):
        if x % 2:
            raise ValueError(f"odd {x}")
        return Done(x)


class AlwaysDie(Node):
    """Ends its process (os._exit) on every input."""

    def forward(self, x, ctx):
        os._exit(3)


class RaiseCounting(Node):
    """Raises ValueError, counting its calls in the file `raised` of `folder` (a line each)."""

    def __init__(self, folder):
        self.folder = str(folder)

    def forward(self, x, ctx):
        with open(os.path.join(self.folder, "raised"), "a") as f:
            f.write("x\n")
        raise ValueError(f"bad input {x}")
