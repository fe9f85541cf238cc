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


class Pid(Node):
    """Returns the pid of the process it ran in."""

    def forward(self, x, ctx):
        return Done(os.getpid())


class WhereAmI(Node):
    """Returns (worker id, pid, device) as the ctx and the process see them."""

    def forward(self, x, ctx):
        return Done((ctx.worker, os.getpid(), ctx.device))


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


class Unpicklable:
    def __reduce__(self):
        raise TypeError("Unpicklable refuses to be pickled")


class ReturnsUnpicklable(Node):
    def forward(self, x, ctx):
        return Done({"ok": 1, "bad": Unpicklable()})


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


class RequiresGradOutput(Node):
    def forward(self, x, ctx):
        import torch

        w = torch.ones(3, requires_grad=True)
        return Done(w * 2)


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


class OneCopyCounter(Node):
    """A counter whose state must live in exactly one place: returns (its count, its pid)."""

    copies = 1

    def __init__(self):
        self.calls = 0

    def forward(self, x, ctx):
        self.calls += 1
        return Done((self.calls, os.getpid()))


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


class Threads(Node):
    """Returns (OMP_NUM_THREADS as this process sees it, torch's intra-op threads)."""

    def forward(self, x, ctx):
        import torch

        return Done((os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()))


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


class Rendezvous(Node):
    """Marks its arrival in a file, then waits for the other's mark: proves two processes ran at once."""

    def __init__(self, mine, other, seconds=10.0):
        self.mine, self.other, self.seconds = mine, other, seconds

    def forward(self, x, ctx):
        with open(self.mine, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + self.seconds
        while not os.path.exists(self.other):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.other} never came: the branches did not run at once")
            time.sleep(0.001)
        return Done(os.getpid())


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
