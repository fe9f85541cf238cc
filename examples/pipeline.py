"""The seed example, runnable anywhere: the cuda placements swapped for cpu and meta.

    python examples/pipeline.py        (or: soma example)

Tokenize splits a sentence; Encoder (on cpu) and Other (on meta) run as one wave,
each on its own thread; Join puts their outputs together. With torch installed the
encoder makes a real tensor on its device and Other a meta tensor, and the device
postcondition checks both; without torch both work on plain lists.
"""

from __future__ import annotations

import soma
from soma import Done, Graph, Node, Opaque


class Tokenize(Node):
    def forward(self, x, ctx):
        return Done(x.split())


class Encoder(Node):
    """Word lengths, as a tensor born on this node's device when torch is there."""

    def forward(self, words, ctx):
        lengths = [float(len(w)) for w in words]
        try:
            import torch
        except ImportError:
            return Done(lengths)
        return Done(Opaque(torch.tensor(lengths, device=ctx.device)))


class Other(Node):
    """Shape-only work: on `meta` it computes shapes without touching memory."""

    def forward(self, words, ctx):
        try:
            import torch
        except ImportError:
            return Done(len(words))
        return Done(torch.zeros(len(words), 8, device=ctx.device))


class Join(Node):
    def forward(self, pair, ctx):
        lengths, shaped = pair
        total = float(sum(lengths)) if not hasattr(lengths, "sum") else float(lengths.sum())
        shape = tuple(shaped.shape) if hasattr(shaped, "shape") else (shaped,)
        return Done({"total_length": total, "other_shape": shape})


def build() -> Graph:
    return Graph.somatize(Tokenize() >> (Encoder().on("cpu") | Other().on("meta")) >> Join())


def main() -> dict:
    g = build()
    print(repr(g))
    print("plan:   ", g.plan())
    print("devices:", g.devices())
    out = soma.Executor().run(g, "the quick brown fox")
    print("output: ", out)
    return out


if __name__ == "__main__":
    main()
