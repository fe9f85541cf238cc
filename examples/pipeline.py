"""The seed example, runnable on any machine with torch: the cuda placements swapped for cpu and meta.

    python examples/pipeline.py        (or: soma example)

Tokenize splits a sentence; Encoder (on cpu) and Other (on meta) run as one wave,
each on its own thread; Join puts their outputs together. The encoder makes a
real tensor on its device and Other a meta tensor (shapes without memory), and
the device postcondition checks both. It needs torch: without it, it says so and
exits with status 2 (soma itself does not need torch; README.md's first snippet
runs without it).
"""

from __future__ import annotations

import sys

import soma
from soma import Done, Graph, Node, Opaque

NEEDS_TORCH = ("soma example needs torch (it makes tensors on cpu and meta): "
               "pip install torch==2.13.0 numpy")


class Tokenize(Node):
    def forward(self, x, ctx):
        return Done(x.split())


class Encoder(Node):
    """Word lengths, as a tensor born on this node's device."""

    def forward(self, words, ctx):
        import torch

        return Done(Opaque(torch.tensor([float(len(w)) for w in words], device=ctx.device)))


class Other(Node):
    """Shape-only work: on `meta` it computes shapes without touching memory."""

    def forward(self, words, ctx):
        import torch

        return Done(torch.zeros(len(words), 8, device=ctx.device))


class Join(Node):
    def forward(self, pair, ctx):
        lengths, shaped = pair
        return Done({"total_length": float(lengths.sum()), "other_shape": tuple(shaped.shape)})


def build() -> Graph:
    return Graph.somatize(Tokenize() >> (Encoder().on("cpu") | Other().on("meta")) >> Join())


def main() -> dict:
    try:
        import torch  # noqa: F401  (the nodes import it where they run)
    except ImportError:
        print(NEEDS_TORCH, file=sys.stderr)
        raise SystemExit(2) from None
    g = build()
    print(repr(g))
    print("plan:   ", g.plan())
    print("devices:", g.devices())
    out = soma.Executor().run(g, "the quick brown fox")
    print("output: ", out)
    return out


if __name__ == "__main__":
    main()
