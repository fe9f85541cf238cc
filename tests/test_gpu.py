"""On a real GPU: what only CUDA can show. Every test here is marked `gpu` and skipped, saying so, without one.

benchmarks/gpu.sh runs exactly these (`pytest -m gpu`) on a GPU machine, with the figures of benchmarks/gpu.py.
"""

import pytest

import soma
from soma import Done, Graph, Node, PostconditionError

pytestmark = [pytest.mark.timeout(300)]


class IgnoresItsDevice(Node):
    """Placed on cuda:0, returns a CPU tensor: what the postcondition exists to catch."""

    def forward(self, x, ctx):
        import torch

        return Done(torch.ones(4))


class Fill(Node):
    """A CUDA tensor of `n` floats, all equal to its input, made where it is placed."""

    def __init__(self, n):
        self.n = n

    def forward(self, x, ctx):
        import torch

        return Done(torch.full((self.n,), float(x), device=ctx.device))


class Linear(Node):
    """A small model on its device; per item (forward) and batched (forward_batch, stacked)."""

    max_batch = 64

    def setup(self, ctx):
        import torch

        torch.manual_seed(0)
        self.layer = torch.nn.Linear(32, 8).to(ctx.device)

    def forward_batch(self, xs, ctx):
        import torch

        with torch.no_grad():
            out = self.layer(torch.stack(xs).to(ctx.device))
        return Done(list(out))


@pytest.mark.gpu("the postcondition on real CUDA tensors")
@pytest.mark.parametrize("runner", ["executor", "local"])
def test_a_node_on_cuda_that_returns_a_cpu_tensor_is_caught_with_the_exact_text(runner):
    make = (lambda: soma.Executor()) if runner == "executor" else (lambda: soma.Local(workers=1, devices=["cuda:0"]))
    with make() as r:
        with pytest.raises(PostconditionError) as info:
            r.run(Graph.somatize(IgnoresItsDevice().on("cuda:0")), 1)
    assert str(info.value) == "node `ignores_its_device` failed: it declared `cuda:0` but returned a value on `cpu`"


@pytest.mark.gpu("CUDA tensors returned by CUDA IPC stay intact while held")
def test_cuda_results_held_many_at_once_stay_intact():
    import torch

    with soma.Local(workers=2, devices=["cuda:0"]) as pool:
        g = Graph.somatize(Fill(1 << 20).on("cuda:0"))
        held = [pool.run(g, i) for i in range(16)]
        held += list(pool.map(g, range(16, 48)))
        for i, t in enumerate(held):
            assert t.device.type == "cuda" and bool((t == i).all()), i
        echoed = pool.run(Graph.somatize(Fill(4).on("cuda:0") >> IdentityOnCuda().on("cuda:0")), 7)
        assert torch.equal(echoed.cpu(), torch.full((4,), 7.0))


class IdentityOnCuda(Node):
    def forward(self, x, ctx):
        return Done(x)


@pytest.mark.gpu("a batching model node on a GPU, per-item inputs from the host")
def test_a_batching_model_on_cuda_gives_the_per_item_answers():
    import torch

    xs = [torch.randn(32) for _ in range(256)]
    node = Linear()
    with soma.Local(workers=2, devices=["cuda:0"]) as pool:
        out = list(pool.map(Graph.somatize(node.on("cuda:0")), xs))
    torch.manual_seed(0)
    reference = torch.nn.Linear(32, 8)
    with torch.no_grad():
        expected = reference(torch.stack(xs))
    got = torch.stack([t.cpu() for t in out])
    assert torch.allclose(got, expected, atol=1e-5)
