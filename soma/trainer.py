"""`soma.Trainer`: training a graph from outside it, with gradient accumulation (`every=`).

    trainer = soma.Trainer(g, torch.nn.functional.mse_loss, torch.optim.Adam(g.parameters()), every=4)
    trainer.step(x, target)          # one micro-batch; the optimizer steps on every 4th
    trainer.fit(batches, epochs=10)  # -> [mean loss of epoch 1, ..., of epoch 10]

What one micro-batch does:

    step(x, target) ─ first of its group? ─ optimizer.zero_grad()
                    ─ output = Executor().run(g, x)            in-process: autograd crosses every node
                    ─ loss = loss_fn(output, target)
                    ─ (loss / every).backward()                grads add up in .grad
                    ─ every-th of its group? ─ optimizer.step()
    fit(batches)    ─ step() over each (x, target) pair; at the end of each epoch, flush()
    flush()         ─ a partial group of m < every: .grad *= every / m (the mean of m), optimizer.step()

Why outside the graph, and what `every=` does and does not promise: docs/training.md.
"""

from __future__ import annotations

import operator
import sys
import time

import torch

from .errors import GraphError
from .run.executor import Executor
from .torch import move_to


class Trainer:
    """Trains the parameters of graph `g` with `optimizer`, minimizing `loss_fn(output, target)`.

    `every=k` accumulates the gradients of k micro-batches, each loss scaled by
    1/k, and steps the optimizer once per k: with a mean-reduced loss and
    micro-batches of equal size, k micro-batches of size B/k give the same update
    as one batch of size B. Gradients are zeroed at the start of each group, so
    after a step `.grad` still holds the gradient that step used.

    `trainer.steps` counts the optimizer steps taken; `trainer.pending` the
    micro-batches accumulated towards the next one.
    """

    def __init__(self, g, loss_fn, optimizer, every: int = 1):
        self.every = _check_every(every)
        if not callable(loss_fn):
            raise TypeError(
                f"Trainer: loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__} "
                f"{loss_fn!r}; e.g. torch.nn.functional.mse_loss"
            )
        if not all(hasattr(optimizer, a) for a in ("param_groups", "step", "zero_grad")):
            raise TypeError(
                f"Trainer: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                f"build one from the graph's parameters, e.g. torch.optim.SGD(g.parameters(), lr=0.1)"
            )
        self.graph = g
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.steps = 0
        self._held = 0
        self._executor = Executor()
        # Checked now, for an early error, and once more after the first run: that
        # run moves parameters to their placements, and a move torch cannot do in
        # place (to or from meta) makes new parameter objects the optimizer lacks.
        _check_optimizer_holds(g, optimizer)
        self._checked_after_first_run = False

    @property
    def pending(self) -> int:
        """Micro-batches accumulated since the last optimizer step."""
        return self._held

    def step(self, x, target) -> float:
        """Train on one micro-batch; step the optimizer if it completes a group. Returns the unscaled loss."""
        if self._held == 0:
            self.optimizer.zero_grad()
        output = self._executor.run(self.graph, x)
        if not self._checked_after_first_run:
            _check_optimizer_holds(self.graph, self.optimizer, after_first_run=True)
            self._checked_after_first_run = True
        if isinstance(output, torch.Tensor):
            # The output may live on another device than the data loader's target
            # (a graph ending on cuda:0): follow the output, as a placed node follows its placement.
            target = move_to(target, output.device)
        loss = self.loss_fn(output, target)
        _check_loss(loss, self.loss_fn)
        (loss / self.every).backward()
        self._held += 1
        if self._held == self.every:
            self._step()
        return loss.item()

    def flush(self) -> bool:
        """Step a partial group as the mean of the micro-batches it holds; False when none is held.

        Each of the m held gradients was added with weight 1/every; multiplying by
        every/m turns their sum into their mean, so the update is the one a single
        batch of those m micro-batches would give.
        """
        held = self._held
        if held == 0:
            return False
        if held < self.every:
            scale = self.every / held
            with torch.no_grad():
                for group in self.optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.mul_(scale)
        self._step()
        return True

    def fit(self, batches, epochs: int = 1, progress: bool | None = None) -> list[float]:
        """Train on every `(x, target)` pair of `batches`, `epochs` times; returns each epoch's mean loss.

        The list holds one float per epoch: the mean of the unscaled micro-batch
        losses seen in that epoch (with a model that changes while the epoch runs,
        so it is the running figure a progress bar shows, not a re-evaluation).
        At the end of each epoch a trailing partial group is stepped as the mean
        of what it holds (`flush()`), so every epoch ends with nothing pending;
        a group left open by earlier `step()` calls is continued, not dropped.

        `batches` is iterated once per epoch: with `epochs > 1` it must be
        iterable again (a list, a DataLoader). `progress`: a progress bar with the
        running loss on stderr; `None` shows it only when stderr is a terminal,
        `True` always, `False` never.
        """
        epochs = _check_epochs(epochs)
        if epochs > 1 and iter(batches) is batches:
            raise ValueError(
                f"Trainer.fit(epochs={epochs}) needs batches it can iterate again (a list, a DataLoader), "
                f"got a one-shot {type(batches).__name__} that epoch 2 would find empty; "
                f"pass list(batches), or call fit once per epoch"
            )
        stream = sys.stderr
        show = _isatty(stream) if progress is None else bool(progress)
        total = _length(batches)
        means: list[float] = []
        for epoch in range(1, epochs + 1):
            bar = _Progress(stream, epoch, epochs, total) if show else None
            seen, loss_sum = 0, 0.0
            try:
                for item in batches:
                    x, target = _pair(item, seen + 1, epoch)
                    loss_sum += self.step(x, target)
                    seen += 1
                    if bar is not None:
                        bar.update(seen, loss_sum / seen)
                if seen == 0:
                    raise ValueError(
                        f"Trainer.fit: epoch {epoch} got no batches from {type(batches).__name__}; "
                        f"give fit a non-empty iterable of (x, target) pairs"
                    )
                self.flush()
            finally:
                if bar is not None:
                    bar.close(seen, loss_sum / seen if seen else float("nan"))
            means.append(loss_sum / seen)
        return means

    def _step(self) -> None:
        self.optimizer.step()
        self.steps += 1
        self._held = 0

    def __repr__(self) -> str:
        return (
            f"Trainer({self.graph!r}, optimizer={type(self.optimizer).__name__}, every={self.every}, "
            f"steps={self.steps}, pending={self._held})"
        )


# -- argument checks --------------------------------------------------------------------------


def _positive_int(value, message: str) -> int:
    """`value` as an int >= 1 (bools refused), else a ValueError with `message`."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < 1:
        raise ValueError(message)
    return n


def _check_every(every) -> int:
    return _positive_int(every, f"Trainer(every={every!r}): every must be an integer >= 1, the number of "
                                f"micro-batches per optimizer step (every=1 steps on every batch)")


def _check_epochs(epochs) -> int:
    return _positive_int(epochs, f"Trainer.fit(epochs={epochs!r}): epochs must be an integer >= 1")


def _where_parameters_live(g) -> dict[int, str]:
    """id(parameter) → "`node`.name", for messages; the first node to hold a parameter names it."""
    where: dict[int, str] = {}
    for node_id in g.nodes():
        node = g.node(node_id)
        if callable(getattr(node, "named_parameters", None)):
            pairs = list(node.named_parameters())
        elif callable(getattr(node, "parameters", None)):  # a node of the user's own, without names
            pairs = [(f"parameters()[{i}]", p) for i, p in enumerate(node.parameters())]
        else:
            pairs = []
        for name, p in pairs:
            where.setdefault(id(p), f"`{node_id}`.{name}")
    return where


def _check_optimizer_holds(g, optimizer, after_first_run: bool = False) -> None:
    """Every trainable parameter of `g` must be in `optimizer` (extra ones, e.g. a loss's, are fine)."""
    params = g.parameters()
    if not params:
        raise GraphError(
            f"Trainer: graph {g!r} has no parameters to train: wrap each torch module with "
            f"soma.torch.Module(module), or give your nodes a parameters() method"
        )
    trainable = [p for p in params if getattr(p, "requires_grad", False)]
    if not trainable:
        raise GraphError(
            f"Trainer: none of the {len(params)} parameters of graph {g!r} requires grad: "
            f"unfreeze what should train with p.requires_grad_(True)"
        )
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [p for p in trainable if id(p) not in held]
    if not missing:
        return
    name = type(optimizer).__name__
    fix = f"build it from the graph's parameters: torch.optim.{name}(g.parameters(), ...)"
    if after_first_run:
        fix = (f"the first run moved the parameters to their placements and torch made new parameter "
               f"objects (it does for moves to or from meta); {fix}, after a first g.run(x)")
    if len(missing) == len(trainable):
        raise ValueError(f"Trainer: the optimizer {name} holds none of the parameters of graph {g!r}; {fix}")
    where = _where_parameters_live(g)
    shown = ", ".join(where.get(id(p), "?") for p in missing[:5]) + (", ..." if len(missing) > 5 else "")
    raise ValueError(
        f"Trainer: the optimizer {name} does not hold {len(missing)} of the {len(trainable)} trainable "
        f"parameters of graph {g!r} ({shown}); {fix}, or freeze what should not train with "
        f"p.requires_grad_(False)"
    )


def _check_loss(loss, loss_fn) -> None:
    who = getattr(loss_fn, "__name__", None) or type(loss_fn).__name__
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"Trainer: loss_fn {who} returned {type(loss).__name__}, not a tensor: return a scalar "
            f"tensor, e.g. torch.nn.functional.mse_loss(output, target)"
        )
    if loss.numel() != 1:
        raise ValueError(
            f"Trainer: loss_fn {who} returned a tensor of shape {tuple(loss.shape)}, not a scalar: "
            f"reduce it with .mean() (a mean is what keeps every= equal to one big batch)"
        )
    if not loss.requires_grad:
        raise ValueError(
            f"Trainer: the loss from loss_fn {who} does not require grad, so there is nothing to "
            f"train: a node or loss_fn cut the autograd graph (.detach(), .item(), torch.no_grad()), "
            f"or no parameter on the way requires grad"
        )


def _pair(item, index: int, epoch: int):
    # A tensor of 2 rows would unpack into two "halves": only real pairs are accepted.
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    what = f"a {type(item).__name__} of length {len(item)}" if isinstance(item, (tuple, list)) \
        else f"a {type(item).__name__}"
    raise TypeError(
        f"Trainer.fit: batch {index} of epoch {epoch} is {what}, not an (x, target) pair: "
        f"give fit an iterable of (x, target) tuples, e.g. list(zip(xs, targets))"
    )


def _length(batches) -> int | None:
    try:
        return len(batches)
    except TypeError:
        return None


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


# -- the progress bar ------------------------------------------------------------------------


class _Progress:
    """One line on a terminal, redrawn in place: `epoch 2/5 [#####.....] 40/80 loss 0.1234`.

    Redrawn at most ten times a second: a line per micro-batch would cost more
    than a small model's step.
    """

    WIDTH = 24
    INTERVAL = 0.1

    def __init__(self, stream, epoch: int, epochs: int, total: int | None):
        self.stream = stream
        self.head = f"epoch {epoch}/{epochs}"
        self.total = total
        self.last_draw = 0.0
        self.last_len = 0

    def update(self, seen: int, loss: float) -> None:
        now = time.monotonic()
        if now - self.last_draw >= self.INTERVAL:
            self.last_draw = now
            self._draw(seen, loss)

    def close(self, seen: int, loss: float) -> None:
        self._draw(seen, loss)
        self.stream.write("\n")
        self.stream.flush()

    def _draw(self, seen: int, loss: float) -> None:
        if self.total:
            filled = min(self.WIDTH, self.WIDTH * seen // self.total)
            line = f"{self.head} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {seen}/{self.total} loss {loss:.4g}"
        else:
            line = f"{self.head} {seen} batches loss {loss:.4g}"
        pad = " " * max(0, self.last_len - len(line))  # wipe what a longer previous line left
        self.last_len = len(line)
        self.stream.write("\r" + line + pad)
        self.stream.flush()
