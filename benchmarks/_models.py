"""The models the batching benchmarks run, as soma nodes and as plain functions; the asyncio and long-job
benchmarks' small nodes.

In an importable module, so worker processes load the nodes by name. Two models with random weights
(seeded: every process builds the same one), on the CPU, per item (`PerItem`), batched as a user would batch
them (`batched`: `soma.torch.Batched`) and on inputs grouped by the caller (`HandBatched`):

* "mlp": a small MLP over a 256-value input; an item costs about as much as soma's own work for it (43 µs
  alone, 9 µs in a batch of 64, measured on this machine on Dec 2);
* "transformer": two transformer-encoder layers over 16 tokens of width 64, mean-pooled (326 µs an item
  alone, 50 µs in a batch of 64): a model that costs more than moving its input does, where batching is for.
"""

from __future__ import annotations

from soma import Done, Node

MLP, TRANSFORMER = "mlp", "transformer"
DIM = 256  # the MLP's input width
TOKENS, WIDTH = 16, 64  # the transformer's input: tokens, and each token's width
OUT = {MLP: 16, TRANSFORMER: WIDTH}  # each model's output row


def model(name: str = MLP):
    import torch

    torch.manual_seed(0)
    if name == MLP:
        net = torch.nn.Sequential(torch.nn.Linear(DIM, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                  torch.nn.ReLU(), torch.nn.Linear(512, OUT[MLP]))
    elif name == TRANSFORMER:
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        net = _then(torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), _mean_of_tokens)
    else:
        raise ValueError(f"no model named {name!r}: {MLP!r} or {TRANSFORMER!r}")
    return net.eval().requires_grad_(False)


def _then(net, after):
    """`net`, then `after` on its output, as one module (its class made here, not at import: this module imports
    without torch, for benchmarks with no model)."""
    import torch

    class Then(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return after(self.net(x))

    return Then()


def _mean_of_tokens(out):
    """(batch, tokens, width) → (batch, width): the encoder's tokens averaged."""
    return out.mean(1)


def _with_batch_size(out):
    """(batch, out) → (batch, out + 1): each row ending in how many rows the batch had."""
    import torch

    return torch.cat([out, out.new_full((len(out), 1), float(len(out)))], 1)


def inputs(n: int, name: str = MLP) -> list:
    import torch

    g = torch.Generator().manual_seed(1)
    shape = (DIM,) if name == MLP else (TOKENS, WIDTH)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


class _ModelNode(Node):
    def __init__(self, name: str = MLP):
        self.name = name

    def setup(self, ctx):
        self.model = model(self.name)


class PerItem(_ModelNode):
    """The model on one input at a time: `(its output row, 1)`."""

    def forward(self, x, ctx):
        return Done((self.model(x.unsqueeze(0))[0], 1))


BATCH = 64  # the batching nodes' max_batch, and the hand-batched inputs' size


def batched(name: str = MLP):
    """The same model as what users write: `soma.torch.Batched` (max_batch 64) over it, with a last column
    that says how many shared the call (`counted`): each input's `[output row..., batch size]`."""
    from soma.torch import Batched

    return Batched(_then(model(name), _with_batch_size), name=f"batched_{name}", max_batch=BATCH)


def counted(name: str, out) -> tuple:
    """`(the model's output rows, each one's batch size)` from `batched`'s outputs, the sizes checked: 1 to
    max_batch, and a call of k inputs gives k outputs that say k (so k of them, or a multiple of k)."""
    from collections import Counter

    from _harness import WrongValue

    rows, sizes = [row[:-1] for row in out], [int(row[-1]) for row in out]
    if any(not 1 <= size <= BATCH for size in sizes):
        raise WrongValue(f"{name} says a call held {sorted(set(sizes))} inputs: 1 to {BATCH} can share one")
    odd = {size: count for size, count in Counter(sizes).items() if count % size}
    if odd:
        raise WrongValue(f"{name}: calls of these sizes gave these many outputs, not a multiple of the size: {odd}")
    return rows, sizes


class NoModel(Node):
    """A batching node with no model: each input's first values, as many as the model's output row (the same
    bytes cross), and how many shared the call. What batching from 64 threads reaches when the model costs
    nothing: the most any batching node could gain over the per-item one on this machine."""

    max_batch = BATCH

    def __init__(self, name: str = MLP):
        self.out = OUT[name]

    def forward_batch(self, xs, ctx):
        return Done([(x.reshape(-1)[:self.out].clone(), len(xs)) for x in xs])


class HandBatched(_ModelNode):
    """The same model on an input that is already a list of 64 items (pre-grouped by the caller): each item's
    `(output row, how many shared the call)`: what `batched` gives each input, in one row."""

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
