"""Nodes of the tests of soma.Local alone (tests/local/): state, CPU work, processes that die at a given
moment, locks and files that cannot travel, tensors in shared memory. Workers import them by name
(`tests.local.nodes`: they start with the host's sys.path)."""

from __future__ import annotations

import os
import threading

from soma import Done, Node


class Counter(Node):
    """Stateful: counts its calls (state lives wherever the node runs)."""

    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        return Done(self.calls)


def burn(n: int) -> int:
    """A fixed amount of pure-Python work that holds the GIL (unlike a wall-clock loop)."""
    total = 0
    for i in range(n):
        total += i * i % 7
    return total


class Burn(Node):
    """Pure-Python work of a fixed size: threads in one process serialize on it, processes do not."""

    def __init__(self, n):
        self.n = n

    def forward(self, x, ctx):
        return Done(burn(self.n))


class WhereAmI(Node):
    """Returns (worker id, pid, device) as the ctx and the process see them."""

    def forward(self, x, ctx):
        return Done((ctx.worker, os.getpid(), ctx.device))


class ExitAtUnpickle:
    """Kills the process that unpickles it: a worker loading node code, or one decoding its input."""

    def __reduce__(self):
        return (os._exit, (7,))


class NodeExitsAtLoad(Node):
    def __init__(self):
        self.bomb = ExitAtUnpickle()

    def forward(self, x, ctx):
        return Done(x)


class ExitAtPickle:
    """Kills the process that pickles it: a worker sending it back as a result."""

    def __reduce__(self):
        os._exit(9)


class ReturnsExitAtPickle(Node):
    def forward(self, x, ctx):
        return Done(ExitAtPickle())


class HoldsLock(Node):
    def __init__(self):
        self.lock = threading.Lock()

    def forward(self, x, ctx):
        return Done(x)


class TouchFile(Node):
    """Creates a file: proves (or disproves) that the node ran at all."""

    def __init__(self, path):
        self.path = path

    def forward(self, x, ctx):
        with open(self.path, "w") as f:
            f.write("ran")
        return Done(x)


class MakeTensor(Node):
    """Makes a tensor of `numel` float32 ones, on the heap or through ctx.empty."""

    def __init__(self, numel, through_ctx=False, value=1.0):
        self.numel, self.through_ctx, self.value = numel, through_ctx, value

    def forward(self, x, ctx):
        import torch

        t = ctx.empty(self.numel, dtype=torch.float32) if self.through_ctx else torch.empty(self.numel)
        t.fill_(self.value)
        return Done(t)


class Slice(Node):
    def forward(self, x, ctx):
        return Done(x[1:5])


class InPlaceAdd(Node):
    def forward(self, x, ctx):
        x.add_(1)
        return Done(None)


class Holder:
    """A plain object carrying tensors: it travels by pickle, its tensors still as handles."""

    def __init__(self, tensors):
        self.tensors = tensors


class WrapInHolder(Node):
    def forward(self, x, ctx):
        return Done(Holder([x, x[:2]]))


class Tracked(Node):
    """Counts the live instances of its class in the process it runs in (weakly: dropped copies vanish)."""

    live = None

    def __init__(self):
        self.tag = "tracked"  # some state, so unpickling calls __setstate__

    def __setstate__(self, state):
        import weakref

        self.__dict__.update(state)
        if Tracked.live is None:
            Tracked.live = weakref.WeakSet()
        Tracked.live.add(self)

    def forward(self, x, ctx):
        import gc

        gc.collect()
        return Done(len(Tracked.live))


class Raises(Node):
    """Raises the exception it was made with (SystemExit, KeyboardInterrupt, ...)."""

    def __init__(self, exc):
        self.exc = exc

    def forward(self, x, ctx):
        raise self.exc


class FullShm(Node):
    """Makes this process's /dev/shm look full, then makes a big tensor through ctx.empty or on the heap.

    Through ctx.empty the patch is undone at once; a heap tensor is copied into shared memory after
    forward returns, so the patch stays for the rest of the worker's life (use a pool of its own).
    """

    def __init__(self, through_ctx):
        self.through_ctx = through_ctx

    def forward(self, x, ctx):
        import errno

        import torch

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        real, os.posix_fallocate = os.posix_fallocate, full
        try:
            if self.through_ctx:
                return Done(ctx.empty(1 << 22, dtype=torch.float32))
            t = torch.ones(1 << 22)
        finally:
            if self.through_ctx:
                os.posix_fallocate = real
        return Done(t)  # encoded after forward returns, while fallocate still fails


class Threads(Node):
    """Returns (OMP_NUM_THREADS as this process sees it, torch's intra-op threads)."""

    def forward(self, x, ctx):
        import torch

        return Done((os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()))



class AddsInPlace(Node):
    """A batching node that adds 1 to each input (a tensor or an ndarray) in place and returns its sum: two
    inputs that arrived as one object (or over one copy) would see each other's addition."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        out = []
        for x in xs:
            x += 1
            out.append(float(x.sum()))
        return Done(out)


class EchoesBatch(Node):
    """A batching node that returns its inputs as they came."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        return Done(list(xs))


class SameOutputForAll(Node):
    """A batching node that returns one tensor object as the output of every input of its batch."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        import torch

        out = torch.full((1 << 14,), float(len(xs)))  # a heap tensor over the inline limit: copied to go back
        return Done([out] * len(xs))


class LockFor(Node):
    """A batching node whose output for input `bad` is a lock (it cannot travel back); the others' doubled."""

    max_batch = 16

    def __init__(self, bad):
        self.bad = bad

    def forward_batch(self, xs, ctx):
        return Done([threading.Lock() if x == self.bad else (x * 2, len(xs)) for x in xs])


class CountsBatch(Node):
    """A batching node: each input doubled, with how many shared its call."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        return Done([(x * 2, len(xs)) for x in xs])


class NamesBatch(Node):
    """A batching node: each input with the inputs that shared its call (a tuple)."""

    max_batch = 16

    def forward_batch(self, xs, ctx):
        return Done([(x, tuple(xs)) for x in xs])


class LogsBatches(Node):
    """A batching node that appends each input it runs to a file (a count of what really ran), then sleeps."""

    max_batch = 8

    def __init__(self, path, seconds):
        self.path, self.seconds = path, seconds

    def forward_batch(self, xs, ctx):
        import time

        with open(self.path, "a") as f:
            f.write("".join(f"{x}\n" for x in xs))
        time.sleep(self.seconds)
        return Done(list(xs))


class GrowsPerBatch(Node):
    """A batching node that keeps `mib` more MiB of its own memory per batch; each input's `(x, pid)`."""

    max_batch = 4

    def __init__(self, mib):
        self.mib = mib
        self.kept = []

    def forward_batch(self, xs, ctx):
        self.kept.append(bytearray(os.urandom(1)) * (self.mib << 20))  # written: resident, not just reserved
        return Done([(x, os.getpid()) for x in xs])


class GrowsAfterSleep(Node):
    """A batching node that sleeps, then keeps `mib` more MiB of its own memory per batch; each input doubled."""

    max_batch = 4

    def __init__(self, mib, seconds):
        self.mib, self.seconds = mib, seconds
        self.kept = []

    def forward_batch(self, xs, ctx):
        import time

        time.sleep(self.seconds)
        self.kept.append(bytearray(os.urandom(1)) * (self.mib << 20))  # written: resident, not just reserved
        return Done([x * 2 for x in xs])


class MarksThenWaits(Node):
    """Input `(name, gate)`: writes the file `name` in `folder` (so a test knows the input is running), then
    waits until the file `gate` there exists (30 s at most); returns `name`."""

    def __init__(self, folder: str):
        self.folder = folder

    def forward(self, x, ctx):
        import time

        name, gate = x
        with open(os.path.join(self.folder, name), "w"):
            pass
        deadline = time.monotonic() + 30
        while gate is not None and not os.path.exists(os.path.join(self.folder, gate)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return Done(name)


class LogsInput(Node):
    """Appends its input, a line, to the file `path` (a side effect a test counts); returns the input. Input 0
    first sleeps `first_s` (the inputs sent after it gather at the worker meanwhile)."""

    def __init__(self, path: str, first_s: float = 0.0):
        self.path, self.first_s = path, first_s

    def forward(self, x, ctx):
        if x == 0 and self.first_s:
            import time

            time.sleep(self.first_s)
        with open(self.path, "a") as f:
            f.write(f"{x}\n")
        return Done(x)


class BatchWhileFile(Node):
    """A batching node that, called with more than one input, waits while the file `path` exists (30 s at most);
    returns its inputs."""

    max_batch = 16
    batch_wait = 0.05

    def __init__(self, path: str):
        self.path = path

    def forward_batch(self, xs, ctx):
        import time

        deadline = time.monotonic() + 30
        while len(xs) > 1 and os.path.exists(self.path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return Done(list(xs))
