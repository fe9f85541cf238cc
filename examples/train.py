"""Training a soma graph end to end: a 2-layer MLP on synthetic regression data, on a CPU.

    python examples/train.py

The graph is two `soma.torch.Module` nodes placed on `cpu` (`hidden >> head`).
The batch of 64 is fed as 4 micro-batches of 16 with `every=4`, so each optimizer
step sees the same gradient one batch of 64 would give (docs/training.md). It
prints the loss trajectory and exits non-zero if the model did not converge.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

import soma
from soma.torch import Module

SAMPLES, FEATURES, HIDDEN = 1024, 8, 64
MICRO_BATCH, EVERY = 16, 4  # one optimizer step per 4 x 16 = 64 samples
EPOCHS = 30
THRESHOLD = 0.02  # mean squared error on held-out data; predicting the mean scores about 1.0


def make_data(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """y = sin(x @ a) @ b, plus a little noise: smooth, nonlinear, learnable by a small MLP."""
    a = torch.randn(FEATURES, 4, generator=torch.Generator().manual_seed(1)) / FEATURES ** 0.5
    b = torch.randn(4, 1, generator=torch.Generator().manual_seed(2))
    x = torch.randn(n, FEATURES, generator=generator)
    y = torch.sin(x @ a) @ b + 0.01 * torch.randn(n, 1, generator=generator)
    return x, y


def build() -> soma.Graph:
    hidden = Module(nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh()), name="hidden")
    head = Module(nn.Linear(HIDDEN, 1), name="head")
    return soma.Graph.somatize(hidden.on("cpu") >> head.on("cpu"))


def main() -> int:
    torch.manual_seed(0)
    data = torch.Generator().manual_seed(0)
    x, y = make_data(data, SAMPLES)
    x_test, y_test = make_data(data, 256)
    batches = list(zip(x.split(MICRO_BATCH), y.split(MICRO_BATCH)))

    g = build()
    optimizer = torch.optim.Adam(g.parameters(), lr=1e-2)
    trainer = soma.Trainer(g, nn.functional.mse_loss, optimizer, every=EVERY)
    print(f"{g!r}: {sum(p.numel() for p in g.parameters())} parameters, "
          f"{len(batches)} micro-batches of {MICRO_BATCH}, every={EVERY}, target variance {y.var():.3f}")

    start = time.perf_counter()
    losses = trainer.fit(batches, epochs=EPOCHS, progress=False)
    seconds = time.perf_counter() - start
    with torch.no_grad():
        test_loss = nn.functional.mse_loss(g.run(x_test), y_test).item()

    shown = [f"{i + 1}:{loss:.4f}" for i, loss in enumerate(losses) if i in (0, 1, 2, 4) or (i + 1) % 10 == 0]
    print("train loss by epoch:", "  ".join(shown))
    print(f"{trainer.steps} optimizer steps in {seconds:.2f} s; held-out loss {test_loss:.4f} "
          f"(threshold {THRESHOLD})")
    if not test_loss < THRESHOLD:
        print(f"did NOT converge: held-out loss {test_loss:.4f} >= {THRESHOLD}", file=sys.stderr)
        return 1
    print("converged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
