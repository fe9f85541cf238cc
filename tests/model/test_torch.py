"""soma.torch.Module: ids, placement obeyed (parameters once, inputs every call), the postcondition, autograd."""

import collections

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from soma import Ctx, Done, Graph, GraphError, Opaque, PostconditionError, fn  # noqa: E402
from soma.torch import Module, move_to  # noqa: E402


class MyMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        return self.lin(x)


class CountsMoves(nn.Linear):
    """A real nn.Linear that counts the times it is asked to move."""

    moves = 0

    def to(self, *args, **kwargs):
        self.moves += 1
        return super().to(*args, **kwargs)


class ReturnsItsInput(nn.Module):
    """Hands back what it was given, so a test can see where every tensor in it went."""

    def forward(self, x):
        return x


class BornOnCpu(nn.Module):
    """Creates its output without device=: it ignores where its node was placed."""

    def forward(self, x):
        return torch.ones(3)


Pair = collections.namedtuple("Pair", "left right")


def test_default_ids_come_from_class_names():
    g = Graph.somatize(Module(nn.Linear(4, 4)) >> Module(nn.Linear(4, 4)) >> Module(MyMLP()) >> Module(nn.ReLU()))
    assert g.nodes() == ["linear", "linear_2", "my_mlp", "re_lu"]


def test_name_gives_a_default_id_and_named_an_exact_one():
    g = Graph.somatize(
        Module(nn.Linear(2, 2), name="enc") >> Module(nn.Linear(2, 2), name="enc")
        >> Module(nn.Linear(2, 2)).named("head")
    )
    assert g.nodes() == ["enc", "enc_2", "head"]


def test_bad_name_and_non_module_are_refused():
    with pytest.raises(GraphError, match=r"^soma.torch.Module's name must be a Python-identifier-like name .*got '2enc'$"):
        Module(nn.Linear(2, 2), name="2enc")
    def double(x):
        return 2 * x

    with pytest.raises(TypeError, match=r"^soma.torch.Module needs a torch.nn.Module, got function <function .*double.*>; wrap a plain function with soma.fn instead$"):
        Module(double)


def test_forward_returns_done_of_opaque_output():
    lin = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    out = Module(lin).forward(x, Ctx("linear"))
    assert type(out) is Done and type(out.value) is Opaque
    assert torch.equal(out.value.obj, lin(x))
    assert out.value.obj.grad_fn is not None  # the autograd graph travels with it


def test_meta_end_to_end():
    g = Graph.somatize(Module(nn.Linear(4, 3)).on("meta") >> Module(nn.Linear(3, 2)).on("meta"))
    out = g.run(torch.randn(5, 4))  # a cpu input, moved by the node
    assert out.device.type == "meta" and out.shape == (5, 2)
    assert all(p.device.type == "meta" for p in g.parameters())


def test_a_module_that_ignores_its_device_is_caught_by_the_postcondition():
    g = Graph.somatize(Module(BornOnCpu()).named("encoder").on("meta"))
    with pytest.raises(PostconditionError, match=r"^node `encoder` failed: it declared `meta` but returned a value on `cpu`$"):
        g.run(torch.randn(2))


def test_nested_inputs_are_moved():
    x = {
        "a": torch.randn(2),
        "b": (torch.randn(3), [torch.randn(4), "text", 7]),
        "pair": Pair(torch.randn(1), torch.randn(1)),
    }
    out = Graph.somatize(Module(ReturnsItsInput()).on("meta")).run(x)  # the postcondition checks every tensor
    assert out["a"].device.type == "meta"
    assert out["b"][0].device.type == "meta" and out["b"][1][0].device.type == "meta"
    assert out["b"][1][1:] == ["text", 7]
    assert type(out["pair"]) is Pair and out["pair"].right.device.type == "meta"
    assert x["a"].device.type == "cpu"  # the caller's structure is not mutated


def test_move_to_keeps_container_types_and_copies_nothing_in_place():
    ordered = collections.OrderedDict(z=torch.ones(1), a=torch.ones(1))
    moved = move_to(ordered, "meta")
    assert type(moved) is collections.OrderedDict and list(moved) == ["z", "a"]
    assert moved["z"].device.type == "meta" and ordered["z"].device.type == "cpu"
    default = collections.defaultdict(list, k=torch.ones(1))
    assert move_to(default, "meta").default_factory is list
    t = torch.ones(2)
    assert move_to(t, "cpu") is t  # already there: the same tensor


def test_parameters_are_moved_once_not_every_call():
    lin = CountsMoves(3, 2)
    g = Graph.somatize(Module(lin))
    for _ in range(2):
        g.run(torch.randn(1, 3))
    assert lin.moves == 0  # unplaced: wherever it already is
    g.place("counts_moves", "cpu")
    for _ in range(2):
        g.run(torch.randn(1, 3))
    assert lin.moves == 0  # placed where the parameters already are: nothing to move
    g.place("counts_moves", "meta")
    g.run(torch.randn(1, 3))
    weight = lin.weight
    for _ in range(3):
        g.run(torch.randn(1, 3))
    assert lin.moves == 1  # the placement changed once: moved once
    assert lin.weight is weight and weight.device.type == "meta"


def test_graph_parameters_in_node_order():
    first, last = nn.Linear(2, 3), nn.Linear(3, 1)
    g = Graph.somatize(Module(first) >> fn(torch.tanh) >> Module(last))
    assert [id(p) for p in g.parameters()] == [id(p) for p in [first.weight, first.bias, last.weight, last.bias]]


def test_one_module_shared_by_two_nodes_counts_once():
    shared = nn.Linear(3, 3)
    g = Graph.somatize(Module(shared) >> Module(shared))
    assert g.nodes() == ["linear", "linear_2"]
    assert [id(p) for p in g.parameters()] == [id(shared.weight), id(shared.bias)]


def test_to_across_devices_keeps_the_autograd_graph():
    first = nn.Linear(4, 3)
    g = Graph.somatize(Module(first).on("cpu") >> Module(nn.Linear(3, 2)).on("meta"))
    out = g.run(torch.randn(5, 4))
    assert out.device.type == "meta" and out.shape == (5, 2)
    assert out.grad_fn is not None
    names, leaves = _walk(out.grad_fn)
    assert "ToCopyBackward0" in names  # the cpu → meta hop is a node of the autograd graph ...
    assert id(first.weight) in leaves  # ... and backward through it reaches the cpu layer's weight


def _walk(grad_fn):
    """Names of every autograd node under `grad_fn`, and ids of the leaf tensors it accumulates into."""
    names, leaves, stack, seen = set(), set(), [grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        if hasattr(node, "variable"):
            leaves.add(id(node.variable))
        stack.extend(child for child, _ in node.next_functions)
    return names, leaves


def test_soma_torch_is_loaded_on_demand_as_this_module():
    import importlib

    import soma

    assert soma.torch is importlib.import_module("soma.torch") and soma.torch.Module is Module


class _Sum(nn.Module):
    def forward(self, x):
        return x.sum()


class _TwoOutputs(nn.Module):
    def forward(self, x):
        return x, x


def test_batched_says_what_it_takes_when_an_input_is_no_tensor_or_the_module_returns_no_rows():
    """A non-tensor input failed in torch's words, a tuple output as "'tuple' object has no attribute 'unbind'":
    each is a TypeError naming the node, what it got, and what to do instead."""
    import soma
    from soma import NodeError
    from soma.torch import Batched

    with soma.Executor() as ex:
        embed = Graph.somatize(Batched(nn.Identity(), name="embed", max_batch=8))
        with pytest.raises(TypeError) as info:  # (the call a map's two inputs meeting at the node make)
            embed.node("embed").forward_batch([torch.ones(2), [1.0, 2.0]], Ctx("embed"))
        cause = info.value
        assert "`embed`" in str(cause) and "got list" in str(cause) and "soma.torch.Module" in str(cause), cause
        with pytest.raises(NodeError, match="returned tuple, not a tensor"):
            ex.run(Graph.somatize(Batched(_TwoOutputs(), name="pair")), torch.ones(2))
        with pytest.raises(TypeError, match=r"returned a tensor of shape \[\] for 2 inputs"):
            Batched(_Sum(), name="sum").forward_batch([torch.ones(2), torch.ones(2)], Ctx("sum"))


def test_batched_gives_each_input_what_it_gives_alone_whatever_meets_it():
    """SPEC 2: batching changes no answer. Inputs of another dtype were promoted with their neighbours (an int64
    input came back float32 from a map, int64 from a run); another shape failed the whole batch: each kind is
    now stacked and called apart, in the order they came."""
    from soma.torch import Batched

    node = Batched(nn.Identity(), name="same", max_batch=8)
    xs = [torch.arange(3), torch.ones(3), torch.ones(2, dtype=torch.float16), torch.arange(3) * 2, torch.ones(1, 3)]
    got = node.forward_batch(xs, Ctx("same")).value
    assert all(type(y) is Opaque for y in got)
    for x, y in zip(xs, (y.obj for y in got)):
        assert y.dtype == x.dtype and y.shape == x.shape and torch.equal(y, x)


    for wait in (-1, "0.1", True, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="batch_wait is a number of seconds >= 0"):
            Batched(nn.Identity(), batch_wait=wait)
    import numpy

    assert Batched(nn.Identity(), batch_wait=numpy.float32(0.01)).batch_wait == pytest.approx(0.01)


def test_an_nn_module_given_as_a_node_is_told_to_go_through_soma_torch():
    import soma
    from soma.errors import NotANodeError

    for attempt in (lambda: Graph.somatize(MyMLP()), lambda: fn(lambda x: x, name="first") >> MyMLP(),
                    lambda: soma.Executor().run(MyMLP(), torch.ones(4))):
        with pytest.raises(NotANodeError, match=r"soma\.torch\.Module\(MyMLP\(\.\.\.\)\)"):
            attempt()
