"""Nodes of the tests where /dev/shm is small (tests/local/test_small_shm.py): arrays of a given size, each
element telling which input made it, so a value that went wrong shows."""

from __future__ import annotations

import numpy as np

from soma import Done, Node

MIB = 1 << 20


class Make(Node):
    """`(i, mib)` → a float64 array of `mib` MiB, every element `i` (on the heap, or through ctx.empty_array)."""

    def __init__(self, through_ctx: bool = False):
        self.through_ctx = through_ctx

    def forward(self, x, ctx):
        i, mib = x
        n = mib * MIB // 8
        a = ctx.empty_array(n, np.float64) if self.through_ctx else np.empty(n, np.float64)
        a.fill(i)
        return Done(a)


class MakeTensor(Node):
    """`(i, mib)` → a float64 tensor of `mib` MiB through ctx.empty, every element `i`."""

    def forward(self, x, ctx):
        import torch

        i, mib = x
        t = ctx.empty((mib * MIB // 8,), dtype=torch.float64)
        t.fill_(i)
        return Done(t)


class PlusOne(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


class Size(Node):
    """What arrived, in brief: its bytes and its first and last elements."""

    def forward(self, x, ctx):
        return Done((int(x.nbytes), float(x[0]), float(x[-1])))


def check(a, i, mib) -> None:
    """`a` is what Make made for `(i, mib)`: its size, and every element."""
    assert a.nbytes == mib * MIB, (a.nbytes, mib)
    assert (a == i).all(), f"array {i}: elements other than {i}"


class ArrayPlusOne(Node):
    """An array `x` → `x + 1`; at the inputs whose first element is in `die_at` it kills its own worker the first
    time (a file in `folder` says it happened), and at `hang_at` it waits up to 60 s for a file that never comes."""

    def __init__(self, folder: str, die_at=(), hang_at=()):
        self.folder, self.die_at, self.hang_at = folder, set(die_at), set(hang_at)

    def forward(self, x, ctx):
        import os
        import signal
        import time

        i = int(x[0])
        flag = os.path.join(self.folder, f"{i}.died")
        if i in self.die_at and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        if i in self.hang_at:
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(self.folder, "never")) and time.monotonic() < deadline:
                time.sleep(0.005)
        return Done(x + 1)



class NoFilesLeft(Node):
    """Uses up this process's file descriptors (its soft limit lowered first: a node, or its library, leaking
    them), then returns a 1 MiB array, which goes through /dev/shm."""

    def forward(self, x, ctx):
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
        held = NoFilesLeft.held = []
        try:
            while True:
                held.append(open("/dev/null"))
        except OSError:
            pass
        return Done(np.ones(MIB // 8))
