"""`Ctx`: what a node knows about the run it is part of."""

from __future__ import annotations


class Ctx:
    """The context a node's `forward(x, ctx)` receives.

    `node`: the node's id. `device`: its placement as torch writes it
    (`"cuda:0"`, `"cpu"`, `"meta"`) or `None` when unplaced. `worker`: `None`
    in-process, the worker's id in `Local`.
    """

    __slots__ = ("node", "device", "worker", "_allocate")

    def __init__(self, node: str, device: str | None = None, worker: str | None = None, allocate=None):
        self.node = node
        self.device = device
        self.worker = worker
        self._allocate = allocate  # a worker's shared arena (`.tensor`, `.array`); None in-process

    def empty(self, *size, dtype=None):
        """A new tensor born where this node's output should live.

        On `ctx.device` (CPU when unplaced); inside a `Local` worker, a CPU tensor
        comes from shared memory that is already mapped, so returning it to the
        host copies nothing. In-process it is `torch.empty(..., device=...)`.
        """
        import torch

        if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
            size = tuple(size[0])
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        device = self.device or "cpu"
        if self._allocate is not None and device == "cpu":
            return self._allocate.tensor(tuple(int(s) for s in size), dtype)
        return torch.empty(size, dtype=dtype, device=device)

    def empty_array(self, shape, dtype=float, order="C"):
        """A new numpy array born where this node's output should live: `numpy.empty`'s twin of `empty`.

        Inside a `Local` worker it comes from shared memory that is already mapped,
        so returning it to the host copies nothing (a node that decodes or fills an
        image in place pays no copy); in-process it is `numpy.empty(shape, dtype,
        order)`. numpy arrays live on the CPU whatever the node's device.
        """
        if self._allocate is not None:
            return self._allocate.array(shape, dtype, order)
        import numpy

        return numpy.empty(shape, dtype, order)

    def __repr__(self) -> str:
        return f"Ctx(node={self.node!r}, device={self.device!r}, worker={self.worker!r})"
