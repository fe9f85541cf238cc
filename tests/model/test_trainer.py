"""soma.Trainer: every= equals one big batch, when the optimizer steps, fit, misuse, the example."""

import copy
import io
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn.functional import mse_loss  # noqa: E402

import soma  # noqa: E402
from soma import Graph, GraphError, Trainer, fn  # noqa: E402
from soma.torch import Module  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def make_graph(seed=0):
    """hidden >> head: two Module nodes, in float64 so equal math compares equal to the last bits that matter."""
    torch.manual_seed(seed)
    hidden = Module(nn.Sequential(nn.Linear(4, 8), nn.Tanh()).double(), name="hidden")
    head = Module(nn.Linear(8, 1).double(), name="head")
    return Graph.somatize(hidden.on("cpu") >> head.on("cpu"))


def make_data(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    return x, x.sum(dim=1, keepdim=True).sin()


def twins(optimizer, every):
    """Two identical graphs: one trained on big batches (every=1), one on micro-batches (every=`every`)."""
    big, micro = make_graph(), make_graph()
    make = OPTIMIZERS[optimizer]
    return (Trainer(big, mse_loss, make(big.parameters())),
            Trainer(micro, mse_loss, make(micro.parameters()), every=every))


def assert_same(g1, g2, grads=False):
    for p1, p2 in zip(g1.parameters(), g2.parameters(), strict=True):
        assert torch.allclose(p1, p2, rtol=1e-9, atol=1e-12)
        if grads:
            assert torch.allclose(p1.grad, p2.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_every_k_micro_batches_equal_one_big_batch(optimizer):
    k, size = 4, 8
    big, micro = twins(optimizer, every=k)
    x, y = make_data(3 * size)
    before = [p.clone() for p in big.graph.parameters()]
    for xb, yb in zip(x.split(size), y.split(size)):
        big.step(xb, yb)
        for xm, ym in zip(xb.split(size // k), yb.split(size // k)):
            micro.step(xm, ym)
        # .grad still holds the gradient the step used: the mean over the group, equal to the big batch's
        assert_same(big.graph, micro.graph, grads=True)
    assert (big.steps, micro.steps) == (3, 3)
    assert any(not torch.equal(b, p) for b, p in zip(before, big.graph.parameters()))  # it did train


def test_no_optimizer_step_before_the_kth_micro_batch():
    g = make_graph()
    optimizer = torch.optim.SGD(g.parameters(), lr=0.1)
    calls = []
    real_step = optimizer.step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return real_step(*args, **kwargs)

    optimizer.step = counting_step
    trainer = Trainer(g, mse_loss, optimizer, every=3)
    before = [p.clone() for p in g.parameters()]
    x, y = make_data(6)
    for i, (xm, ym) in enumerate(zip(x.split(2), y.split(2)), start=1):
        trainer.step(xm, ym)
        if i < 3:
            assert calls == [] and trainer.pending == i
            assert all(torch.equal(b, p) for b, p in zip(before, g.parameters()))
    assert len(calls) == 1 and trainer.steps == 1 and trainer.pending == 0
    assert all(not torch.equal(b, p) for b, p in zip(before, g.parameters()))


def test_gradients_are_zeroed_at_the_start_of_each_group_not_after_a_step():
    g = make_graph()
    trainer = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.1), every=2)
    x, y = make_data(6)
    trainer.step(x[0:2], y[0:2])
    trainer.step(x[2:4], y[2:4])
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in g.parameters())  # kept after the step
    trainer.step(x[4:6], y[4:6])  # first of the next group: only its own (scaled) gradient is there
    reference = copy.deepcopy(g)
    for p in reference.parameters():
        p.grad = None
    (mse_loss(reference.run(x[4:6]), y[4:6]) / 2).backward()
    assert_same(g, reference, grads=True)


def test_step_returns_the_unscaled_loss_as_a_float():
    g = make_graph()
    x, y = make_data(4)
    expected = mse_loss(g.run(x), y).item()
    loss = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.1), every=4).step(x, y)
    assert type(loss) is float and loss == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fit_steps_a_trailing_partial_group_as_one_batch_of_it(optimizer):
    big, micro = twins(optimizer, every=4)
    x, y = make_data(12)  # 6 micro-batches of 2: a group of 4, then a partial group of 2
    micro.fit(list(zip(x.split(2), y.split(2))), progress=False)
    assert (micro.steps, micro.pending) == (2, 0)
    big.fit([(x[:8], y[:8]), (x[8:], y[8:])], progress=False)
    assert_same(big.graph, micro.graph, grads=True)


def test_flush_with_nothing_pending_does_not_step():
    g = make_graph()
    trainer = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.1), every=2)
    assert trainer.flush() is False and trainer.steps == 0


def test_fit_returns_each_epochs_mean_loss():
    x, y = make_data(10)
    batches = list(zip(x.split(2), y.split(2)))
    g1, g2 = make_graph(), make_graph()
    fitted = Trainer(g1, mse_loss, torch.optim.SGD(g1.parameters(), lr=0.1), every=2)
    by_hand = Trainer(g2, mse_loss, torch.optim.SGD(g2.parameters(), lr=0.1), every=2)
    means = fitted.fit(batches, epochs=3, progress=False)
    expected = []
    for _ in range(3):
        losses = [by_hand.step(xb, yb) for xb, yb in batches]
        by_hand.flush()
        expected.append(sum(losses) / len(losses))
    assert means == pytest.approx(expected, rel=1e-12)
    assert len(means) == 3 and all(type(m) is float for m in means)
    assert means[-1] < means[0]
    assert fitted.steps == 9  # 5 micro-batches an epoch: 2 full groups and a flushed one of 1


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_fit_shows_progress_only_on_a_terminal_unless_told(monkeypatch):
    x, y = make_data(8)
    batches = list(zip(x.split(2), y.split(2)))
    g = make_graph()
    trainer = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.1), every=2)

    for stream, progress, shown in [
        (io.StringIO(), None, False),     # not a terminal: quiet
        (FakeTerminal(), None, True),     # a terminal: a bar
        (FakeTerminal(), False, False),   # told not to
        (io.StringIO(), True, True),      # told to
    ]:
        monkeypatch.setattr(sys, "stderr", stream)
        trainer.fit(batches, epochs=2, progress=progress)
        text = stream.getvalue()
        if shown:
            lines = text.split("\n")
            assert lines[0].split("\r")[-1].startswith("epoch 1/2 [########################] 4/4 loss ")
            assert lines[1].split("\r")[-1].startswith("epoch 2/2 [")
        else:
            assert text == ""


def test_every_must_be_a_positive_integer():
    g = make_graph()
    optimizer = torch.optim.SGD(g.parameters(), lr=0.1)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"^Trainer\(every={bad!r}\): every must be an integer >= 1, the number of micro-batches per optimizer step \(every=1 steps on every batch\)$"):
            Trainer(g, mse_loss, optimizer, every=bad)


def test_a_graph_without_parameters_is_refused():
    g = Graph.somatize(fn(torch.tanh) >> fn(torch.relu))
    with pytest.raises(GraphError, match=r"^Trainer: graph Graph\(tanh >> relu\) has no parameters to train: wrap each torch module with soma.torch.Module\(module\), or give your nodes a parameters\(\) method$"):
        Trainer(g, mse_loss, torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))


def test_a_graph_whose_parameters_are_all_frozen_is_refused():
    g = make_graph()
    for p in g.parameters():
        p.requires_grad_(False)
    with pytest.raises(GraphError, match=r"^Trainer: none of the 4 parameters of graph .* requires grad: unfreeze what should train with p.requires_grad_\(True\)$"):
        Trainer(g, mse_loss, torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1))


def test_an_optimizer_that_does_not_hold_the_graphs_parameters_is_refused():
    g = make_graph()
    other = torch.optim.Adam(make_graph().parameters())
    with pytest.raises(ValueError, match=r"^Trainer: the optimizer Adam holds none of the parameters of graph Graph\(hidden.on\('cpu'\) >> head.on\('cpu'\)\); build it from the graph's parameters: torch.optim.Adam\(g.parameters\(\), ...\)$"):
        Trainer(g, mse_loss, other)
    hidden_only = torch.optim.SGD(g.node("hidden").parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"^Trainer: the optimizer SGD does not hold 2 of the 4 trainable parameters of graph .* \(`head`.weight, `head`.bias\); build it .*, or freeze what should not train with p.requires_grad_\(False\)$"):
        Trainer(g, mse_loss, hidden_only)


def test_frozen_parameters_and_extra_ones_in_the_optimizer_are_fine():
    g = make_graph()
    for p in g.node("hidden").parameters():
        p.requires_grad_(False)
    scale = nn.Parameter(torch.ones((), dtype=torch.float64))  # a parameter of the loss, not of the graph
    optimizer = torch.optim.SGD([*g.node("head").parameters(), scale], lr=0.1)
    trainer = Trainer(g, lambda out, t: scale * mse_loss(out, t), optimizer)
    x, y = make_data(4)
    trainer.step(x, y)
    assert scale.grad is not None and trainer.steps == 1


def test_parameters_replaced_by_the_first_run_are_caught():
    # Moving to meta makes new parameter objects: the optimizer built before holds the old ones.
    g = Graph.somatize(Module(nn.Linear(3, 1)).on("meta"))
    trainer = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"^Trainer: the optimizer SGD holds none of the parameters of graph .*; the first run moved the parameters to their placements and torch made new parameter objects \(it does for moves to or from meta\); build it .*, after a first g.run\(x\)$"):
        trainer.step(torch.randn(2, 3), torch.randn(2, 1))


def test_a_loss_that_is_not_a_trainable_scalar_is_refused():
    g = make_graph()
    optimizer = torch.optim.SGD(g.parameters(), lr=0.1)
    x, y = make_data(4)

    def per_sample(out, target):
        return (out - target) ** 2

    with pytest.raises(ValueError, match=r"^Trainer: loss_fn per_sample returned a tensor of shape \(4, 1\), not a scalar: reduce it with .mean\(\)"):
        Trainer(g, per_sample, optimizer).step(x, y)

    def detached(out, target):
        return mse_loss(out, target).detach()

    with pytest.raises(ValueError, match=r"^Trainer: the loss from loss_fn detached does not require grad, so there is nothing to train"):
        Trainer(g, detached, optimizer).step(x, y)


def test_fit_misuse_is_explained():
    g = make_graph()
    trainer = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.1))
    x, y = make_data(4)
    with pytest.raises(ValueError, match=r"^Trainer.fit\(epochs=2\) needs batches it can iterate again \(a list, a DataLoader\), got a one-shot generator"):
        trainer.fit(((x, y) for _ in range(2)), epochs=2, progress=False)
    with pytest.raises(TypeError, match=r"^Trainer.fit: batch 1 of epoch 1 is a Tensor, not an \(x, target\) pair"):
        trainer.fit([x[:2]], progress=False)  # two rows would unpack into two halves: refused
    with pytest.raises(ValueError, match=r"^Trainer.fit: epoch 1 got no batches from list; give fit a non-empty iterable of \(x, target\) pairs$"):
        trainer.fit([], progress=False)
    with pytest.raises(ValueError, match=r"^Trainer.fit\(epochs=0\): epochs must be an integer >= 1$"):
        trainer.fit([(x, y)], epochs=0)


def test_trainer_is_reachable_from_soma():
    assert soma.Trainer is Trainer


@pytest.mark.gpu("cuda:0 → cpu in one graph")
def test_needs_gpu_cuda0_to_cpu_graph_trains_end_to_end():
    torch.manual_seed(0)
    first, last = nn.Linear(4, 16), nn.Linear(16, 1)
    g = Graph.somatize(Module(first).on("cuda:0") >> Module(last).on("cpu"))
    trainer = Trainer(g, mse_loss, torch.optim.SGD(g.parameters(), lr=0.05), every=2)
    x = torch.randn(64, 4)
    y = x.sum(dim=1, keepdim=True)
    losses = trainer.fit([(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)], epochs=20, progress=False)
    assert first.weight.device.type == "cuda" and last.weight.device.type == "cpu"
    assert first.weight.grad.device.type == "cuda"  # backward crossed the cpu → cuda:0 hop
    assert losses[-1] < losses[0] / 2


@pytest.mark.timeout(330)
def test_example_train_converges():
    # ~15 s quiet; over 120 s once with both cores busy beside the suite (a bound on hanging, not a speed)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "converged" in out.stdout.splitlines()[-1]
    assert "train loss by epoch: 1:" in out.stdout
