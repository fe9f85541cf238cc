"""The model the batching and asyncio benchmarks run, as soma nodes and as plain functions.

In an importable module, so worker processes load the nodes by name. A small MLP with
random weights (seeded: every process builds the same one), on the CPU.
"""

from __future__ import annotations

from soma import Done, Node

DIM = 256


def model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 16)).eval().requires_grad_(False)


def inputs(n: int) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randn(DIM, generator=g) for _ in range(n)]


class PerItem(Node):
    """The model on one input at a time: `(its output row, 1)`."""

    def setup(self, ctx):
        self.model = model()

    def forward(self, x, ctx):
        return Done((self.model(x.unsqueeze(0))[0], 1))


class Batched(Node):
    """The same model on the inputs at it at once: `(each one's output row, how many shared the call)`."""

    max_batch = 64

    def setup(self, ctx):
        self.model = model()

    def forward_batch(self, xs, ctx):
        import torch

        out = self.model(torch.stack(xs))
        return Done([(row, len(xs)) for row in out])


class HandBatched(Node):
    """The same model on an input that is already a list of 64 items (pre-grouped by the caller): each item's
    `(output row, how many shared the call)`, what `Batched` gives each input (the same values cross)."""

    def setup(self, ctx):
        self.model = model()

    def forward(self, xs, ctx):
        import torch

        out = self.model(torch.stack(xs))
        return Done([(row, len(xs)) for row in out])


class Tiny(Node):
    """Nothing: its input plus one (asyncio's request rate)."""

    def forward(self, x, ctx):
        return Done(x + 1)


class Ms(Node):
    """About a millisecond of pure Python, then its input times ten (a long job's small input)."""

    def forward(self, x, ctx):
        from _harness import burn

        burn(3000)
        return Done(x * 10)


class Grow(Node):
    """Keeps `mib` MiB more of its own memory per input (a leak); returns (its pid, its private memory then)."""

    def __init__(self, mib: int):
        self.mib = mib
        self.kept = []

    def forward(self, x, ctx):
        import os

        self.kept.append(bytearray(os.urandom(1)) * (self.mib << 20))
        with open("/proc/self/statm") as f:
            fields = f.read().split()
        return Done((os.getpid(), (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")))
