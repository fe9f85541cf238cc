"""The work that runs in the other processes: soma nodes and the same work as plain functions.

It lives in an importable module (not in the benchmark scripts) so that every
contender loads the very same code by name: `soma.Local` workers (they start with
the host's sys.path), `ProcessPoolExecutor` and `multiprocessing.Pool` children
(spawn passes sys.path too), torch.multiprocessing processes and Ray tasks.
Nothing heavy is imported at the top: torch only where a tensor is made.
"""

from __future__ import annotations

import time

from _harness import burn

from soma import Done, Node

# -- pure Python -----------------------------------------------------------------------------------

class Burn(Node):
    """`burn(n)`: a fixed amount of pure-Python work holding the GIL."""

    def __init__(self, n: int):
        self.n = n

    def forward(self, x, ctx):
        return Done(burn(self.n))


def burn_tagged(n: int, x):
    """`(x, burn(n))`: the burn, and which input it was for (so a mixed-up answer shows)."""
    return x, burn(n)


class BurnTagged(Node):
    """`burn_tagged(n, tag)`: tagged with its input, or with `tag` when given (a wave's branches get one input)."""

    def __init__(self, n: int, tag=None):
        self.n = n
        self.tag = tag

    def forward(self, x, ctx):
        return Done(burn_tagged(self.n, x if self.tag is None else self.tag))


def burn_pair(pair):
    """`(x, burn(n))` for the input `(x, n)`: each input says how much work it is (a straggler among cheap ones)."""
    x, n = pair
    return x, burn(n)


class BurnPair(Node):
    """`burn_pair`: the input `(x, n)` burns `n` and comes back tagged with `x`."""

    def forward(self, pair, ctx):
        return Done(burn_pair(pair))


class Echo(Node):
    """Returns its input."""

    def forward(self, x, ctx):
        return Done(x)


class AddOne(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


class Double(Node):
    def forward(self, x, ctx):
        return Done(x * 2)


class SlowLen(Node):
    """`(i, payload)` → `(i, len(payload))` after sleeping `ms`: a slow node with a big input and a small output."""

    def __init__(self, ms: float):
        self.ms = ms

    def forward(self, x, ctx):
        i, payload = x
        time.sleep(self.ms / 1e3)
        return Done((i, len(payload)))


def echo(x):
    return x


def chain3(x):
    """The three-node graph `AddOne >> Double >> AddOne` as one function (one task for a pool)."""
    return (x + 1) * 2 + 1


# -- tensors ----------------------------------------------------------------------------------------

def make_tensor(numel: int, allocate=None, fill: float = 1.0):
    """`numel` float32 elements equal to `fill`, on this process's heap, or through `allocate` (a ctx's `empty`).

    The benchmarks give every call its own fill (`_harness.next_fill`): a result
    overwritten by a later one, or handed to the wrong caller, then holds the
    wrong number.
    """
    import torch

    t = allocate(numel, dtype=torch.float32) if allocate is not None else torch.empty(numel, dtype=torch.float32)
    return t.fill_(fill)


def make_timed(numel: int, allocate=None, fill: float = 1.0):
    """`(tensor, seconds it took to create and fill)`, measured here, in the producing process."""
    start = time.perf_counter()
    t = make_tensor(numel, allocate, fill)
    return t, time.perf_counter() - start


class MakeTimed(Node):
    """Makes a float32 tensor (heap, or `ctx.empty`) filled with its input (1.0 for None) and returns it with
    its creation time."""

    def __init__(self, numel: int, through_ctx: bool = False):
        self.numel = numel
        self.through_ctx = through_ctx

    def forward(self, x, ctx):
        return Done(make_timed(self.numel, ctx.empty if self.through_ctx else None, 1.0 if x is None else x))


def last(t) -> float:
    """A small value from a received tensor: its last element (one page touched, not a scan)."""
    return float(t.reshape(-1)[-1])


class Last(Node):
    def forward(self, x, ctx):
        return Done(last(x))


def import_torch(then_sleep: float = 0.0) -> bool:
    """Import torch in a pool's child; sleeping after keeps this child busy so the next task goes to another."""
    import torch  # noqa: F401

    time.sleep(then_sleep)
    return True


def queue_server(commands, results) -> None:
    """A torch.multiprocessing process: the shared-memory reference for moving tensors.

    `("make", (numel, fill))` puts `(tensor, creation seconds)`; `("last", tensor)`
    puts `last(tensor)`; `("echo", tensor)` puts the tensor back; None ends it.
    torch's own Queue reductions move every tensor through shared memory.
    """
    import torch  # noqa: F401  (registers torch's reductions before the first get)

    while True:
        command = commands.get()
        if command is None:
            return
        kind, arg = command
        if kind == "make":
            numel, fill = arg
            results.put(make_timed(numel, fill=fill))
        elif kind == "last":
            results.put(last(arg))
        elif kind == "echo":
            results.put(arg)
        del command, arg


# -- numpy arrays, bytes, plain data (benchmarks/buffers.py) ------------------------------------------

IMAGE = (1080, 1920, 3)  # a full-HD RGB frame, uint8: 6 MB


def make_array_timed(shape, dtype: str, fill, allocate=None):
    """`(an ndarray of `shape` filled with `fill`, seconds to make it)`, on the heap or through `allocate`
    (a ctx's `empty_array`)."""
    import numpy

    start = time.perf_counter()
    a = allocate(shape, dtype) if allocate is not None else numpy.empty(shape, dtype)
    a.fill(fill)
    return a, time.perf_counter() - start


def make_image_tensor_timed(shape, fill):
    """The same image as a uint8 torch tensor: `(tensor, seconds to make it)`."""
    import torch

    start = time.perf_counter()
    t = torch.full(shape, fill, dtype=torch.uint8)
    return t, time.perf_counter() - start


def make_bytes_timed(nbytes: int, fill: int):
    """`(bytes of `nbytes` equal to `fill`, seconds to make them)`."""
    start = time.perf_counter()
    b = bytes([fill]) * nbytes
    return b, time.perf_counter() - start


def make_dict_timed(count: int, tag: int):
    """`({"k<i>": i + tag}, seconds to make it)`: a million small items is the benchmark's."""
    start = time.perf_counter()
    d = {f"k{i}": i + tag for i in range(count)}
    return d, time.perf_counter() - start


def size_of(x) -> int:
    """A small answer about a big input: its length (and, for a dict, the sum of its values)."""
    return (len(x), sum(x.values())) if isinstance(x, dict) else len(x)


class MakeTimedBy(Node):
    """Calls `make(*args, input)` (one of the `make_*_timed` above) and returns what it returns; with
    `through_ctx`, an array is born through `ctx.empty_array`."""

    def __init__(self, make, *args, through_ctx: bool = False):
        self.make, self.args, self.through_ctx = make, args, through_ctx

    def forward(self, x, ctx):
        if self.through_ctx:
            return Done(self.make(*self.args, x, ctx.empty_array))
        return Done(self.make(*self.args, x))


class SizeOf(Node):
    def forward(self, x, ctx):
        return Done(size_of(x))


# -- large arrays (benchmarks/shm.py) ------------------------------------------------------------------

def filled(item):
    """`(i, mib)` → a float64 array of `mib` MiB, every element `i` (so a value mixed up with another shows)."""
    import numpy

    i, mib = item
    a = numpy.empty((mib << 20) // 8, numpy.float64)
    a.fill(i)
    return a


class Filled(Node):
    def forward(self, x, ctx):
        return Done(filled(x))


class FilledSet:
    """A map-style dataset for torch's DataLoader: item i is `filled((i, mib))`."""

    def __init__(self, count: int, mib: int):
        self.count, self.mib = count, mib

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        return filled((i, self.mib))
