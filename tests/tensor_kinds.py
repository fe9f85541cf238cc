"""Tensor subclasses users pass (torchvision's tv_tensors are such: a class, and attributes on the tensor), and
a node that says what it received. Workers import them by name (`tests.tensor_kinds`)."""

from __future__ import annotations

import torch

from soma import Done, Node


class Boxes(torch.Tensor):
    """A tensor subclass with an attribute, shaped like torchvision's BoundingBoxes (`format`)."""


class Weight(torch.nn.Parameter):
    """A Parameter's subclass (as libraries mark their own weights)."""


def boxes(t: torch.Tensor, fmt: str) -> Boxes:
    b = t.as_subclass(Boxes)
    b.fmt = fmt
    return b


class Describe(Node):
    """`(type name, fmt attribute or None, requires_grad, the value itself)` of what it received."""

    def forward(self, x, ctx):
        return Done((type(x).__name__, getattr(x, "fmt", None), x.requires_grad, x))


class MakeBoxes(Node):
    """Boxes of `numel` values, all `x`, with fmt "XYXY": a subclass made in a worker."""

    def __init__(self, numel: int):
        self.numel = numel

    def forward(self, x, ctx):
        return Done(boxes(torch.full((self.numel,), float(x)), "XYXY"))
