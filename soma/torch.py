"""`soma.torch.Module`: an `nn.Module` as a soma node that obeys its placement.

    import soma, torch
    hidden = soma.torch.Module(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh()), name="hidden")
    g = soma.Graph.somatize(hidden.on("cuda:0") >> soma.torch.Module(torch.nn.Linear(32, 1)).on("cpu"))
    g.nodes()        # ['hidden', 'linear']
    g.parameters()   # every parameter of both modules, each once

Obeying a placement takes three things (docs/design.md, "Obeying is the node's
job"): the parameters are there (moved once, when the placement changes), the
input is there (moved every call), and whatever is created inside is born there
(the wrapped module's own business). This node does the first two, so a plain
`nn.Module` needs no soma code of its own.

This file is `soma/torch.py`: inside it, `import torch` is the real torch
(absolute imports). `import soma` never imports it; `soma.torch` is loaded the
first time it is asked for.
"""

from __future__ import annotations

import contextlib
import copy
import itertools

import torch
from torch import nn

from .node import Node, check_id, is_batch_wait, is_max_batch, snake_case
from .values import Done, Opaque

__all__ = ["Batched", "Module", "move_to"]


class Module(Node):
    """A soma node around an `nn.Module`: `forward(x, ctx)` is `Done(Opaque(module(x)))`.

    When the node is placed, the module's parameters and buffers are moved to
    `ctx.device` whenever they are not already there (so once, in the usual
    case, and again only when the placement changes), and the input is moved
    every call, including tensors nested in tuples, lists and dicts. Unplaced,
    nothing is moved: unplaced means "wherever it already is".

    On a worker process (`soma.Local`, `soma.Ray`: `ctx.worker` is set) the module runs
    under `torch.no_grad()`: gradients cannot cross a process boundary, so none are
    recorded there, and a module with trainable parameters needs no change. In-process
    (`Executor`, `Trainer`) it records gradients as usual.

    The module receives `x` as its one argument, the way `nn.Sequential` calls
    its children: after a wave it receives the wave's tuple. The output is
    carried as an `Opaque`, so its autograd graph reaches the next node and the
    `Trainer` intact.

    The default id is the module's class name in snake_case (`nn.Linear` →
    `linear`, `MyMLP` → `my_mlp`); `name=` gives another default id (suffixes
    `_2`, `_3` still apply), `.named()` an exact one.
    """

    def __init__(self, module, name: str | None = None):
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"soma.torch.Module needs a torch.nn.Module, got {type(module).__name__} {module!r}; "
                f"wrap a plain function with soma.fn instead"
            )
        self.module = module
        self.name = None if name is None else check_id(name, "soma.torch.Module's name")

    def forward(self, x, ctx):
        if ctx.device is not None:
            device = torch.device(ctx.device)
            # Looking at one tensor instead of remembering "already moved" also
            # catches a module moved behind our back: by the user, or by another
            # node that wraps the same nn.Module.
            if _not_on(self.module, device):
                self.module.to(device)
            x = move_to(x, device)
        with _recording(ctx):
            return Done(Opaque(self.module(x)))

    def parameters(self, recurse: bool = True):
        """The module's parameters (what `g.parameters()` collects)."""
        return self.module.parameters(recurse=recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True):
        """The module's named parameters (the Trainer names them in its messages)."""
        return self.module.named_parameters(prefix=prefix, recurse=recurse)

    def _default_id(self) -> str:
        return self.name if self.name is not None else snake_case(type(self.module).__name__)

    def __repr__(self) -> str:
        shown = f"{type(self.module).__name__}()" if len(repr(self.module)) > 80 else repr(self.module)
        name = "" if self.name is None else f", name={self.name!r}"
        return f"soma.torch.Module({shown}{name})"


class Batched(Module):
    """`Module` for a module that takes a batch: a batching node (`forward_batch`).

        embed = soma.torch.Batched(model, max_batch=64)   # Tokenize() >> embed: per-item in, batched model

    The inputs at the node at once (a map's, concurrent runs') are stacked along a new
    first dimension (`torch.stack`), moved to `ctx.device`, run through the module in
    one call, and split again: each input gets its own row of the output
    (`out.unbind(0)`), as an `Opaque`. Inputs that differ in shape, dtype or device
    are stacked and called apart, a call for each kind (in the order they came):
    stacked together, torch would promote them to one dtype, and an input's answer
    would depend on its neighbours. `max_batch` and `batch_wait` are the batching
    node's (at most that many inputs per call, waiting at most that many seconds
    after the first for more).
    """

    def __init__(self, module, name: str | None = None, *, max_batch: int = 32, batch_wait: float = 0.002):
        super().__init__(module, name)
        if not is_max_batch(max_batch):
            raise ValueError(f"soma.torch.Batched's max_batch is a positive int, got {max_batch!r}")
        if not is_batch_wait(batch_wait):
            raise ValueError(f"soma.torch.Batched's batch_wait is a number of seconds >= 0, got {batch_wait!r}")
        self.max_batch, self.batch_wait = max_batch, float(batch_wait)

    def forward_batch(self, xs, ctx):
        if ctx.device is not None:
            device = torch.device(ctx.device)
            if _not_on(self.module, device):
                self.module.to(device)
            xs = [move_to(x, device) for x in xs]
        rows: list = [None] * len(xs)
        with _recording(ctx):
            for positions in _kinds(xs, ctx.node):
                out = self.module(torch.stack([xs[i] for i in positions]))
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"soma.torch.Batched `{ctx.node}`'s module returned {type(out).__name__}, not a "
                                    f"tensor: each input's output is a row of one tensor. Return one tensor from the "
                                    f"module (wrap it), or use soma.torch.Module, which runs the inputs one at a time")
                if out.dim() == 0 or len(out) != len(positions):
                    raise TypeError(f"soma.torch.Batched `{ctx.node}`'s module returned a tensor of shape "
                                    f"{list(out.shape)} for {len(positions)} inputs stacked along a first dimension: "
                                    f"each input's output is a row of it (a module that keeps the batch dimension)")
                for i, row in zip(positions, out.unbind(0)):
                    rows[i] = Opaque(row)
        return Done(rows)


def _kinds(xs, node: str) -> list:
    """The positions of the inputs of each kind (shape, dtype, device: what one `torch.stack` takes without
    changing any), kinds in the order they came; a TypeError that says what Batched takes for an input that is
    not a tensor (`run` of it worked alone, and a map of several failed in torch's own words)."""
    kinds: dict = {}
    for i, x in enumerate(xs):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"soma.torch.Batched `{node}` stacks the inputs that meet at it into tensors: they must "
                            f"be tensors, and it got {type(x).__name__}. Make it a tensor before the node, or use "
                            f"soma.torch.Module, which runs the inputs one at a time (or write a Node with a "
                            f"forward_batch of your own)")
        kinds.setdefault((type(x), x.shape, x.dtype, x.device), []).append(i)
    return list(kinds.values())


def _recording(ctx):
    """Where the module runs: in-process (`ctx.worker is None`: Executor, Trainer) it records gradients as
    usual; on a worker process (Local, Ray) under `torch.no_grad()`, since an autograd graph cannot cross a
    process boundary and an ordinary module with trainable parameters must run there unchanged (SPEC 8)."""
    return contextlib.nullcontext() if ctx.worker is None else torch.no_grad()


def move_to(value, device):
    """`value` with every tensor in it moved to `device`: loose, or nested in tuples, lists and dicts.

    Containers are rebuilt (a namedtuple stays a namedtuple, a dict subclass its
    class); anything else is passed through untouched. A tensor already on
    `device` is returned as it is, so this copies nothing when nothing has to move.
    """
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [move_to(v, device) for v in value]
    if isinstance(value, tuple):
        items = [move_to(v, device) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        if type(value) is dict:
            return {k: move_to(v, device) for k, v in value.items()}
        out = copy.copy(value)  # keeps OrderedDict, defaultdict's factory, ...
        for k, v in value.items():
            out[k] = move_to(v, device)
        return out
    return value


def _not_on(module: nn.Module, device: torch.device) -> bool:
    """True when the module's first parameter (or buffer) is not on `device`.

    One tensor stands for all: `module.to()` moves them together, and a module
    with no tensors has nothing to move.
    """
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first is not None and first.device != device
