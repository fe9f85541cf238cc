"""The device postcondition (soma/run/postcondition.py), where the node ran on every runner, then with and
without torch in-process."""

import pytest

from soma import Done, Graph, Node, NodeError, Opaque, PostconditionError
from tests.nodes import Identity, Located, Obeys, ReturnsOn


def test_postcondition_where_the_node_ran(runner):
    g = Graph.somatize(ReturnsOn("cpu").named("encoder").on("meta"))
    with pytest.raises(PostconditionError) as info:
        runner.run(g, None)
    assert str(info.value) == "node `encoder` failed: it declared `meta` but returned a value on `cpu`"
    assert runner.run(Graph.somatize(Obeys().on("meta")), None).device == "meta"


def test_fires_and_names_the_node_without_torch():
    g = Graph.somatize(Identity() >> ReturnsOn("cpu").named("encoder").on("cuda:0"))
    with pytest.raises(PostconditionError) as info:
        g.run(None)
    assert str(info.value) == "node `encoder` failed: it declared `cuda:0` but returned a value on `cpu`"
    err = info.value
    assert (err.node, err.declared, err.actual) == ("encoder", "cuda:0", "cpu")
    assert isinstance(err, NodeError)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda v: Opaque(v),
        lambda v: (1, v),
        lambda v: [1, [2, v]],
        lambda v: {"a": 1, "b": {"c": v}},
        lambda v: Opaque((v,)),
        lambda v: ("x", [{"deep": Opaque(v)}]),
    ],
    ids=["opaque", "tuple", "nested-list", "nested-dict", "opaque-tuple", "mixed"],
)
def test_looks_inside_opaque_and_containers(wrap):
    g = Graph.somatize(ReturnsOn("cpu", wrap=wrap).named("enc").on("meta"))
    with pytest.raises(PostconditionError, match="declared `meta` but returned a value on `cpu`"):
        g.run(None)


def test_a_node_that_obeys_passes():
    g = Graph.somatize(Obeys().on("meta") >> Identity())
    assert g.run(None).device == "meta"


def test_unplaced_nodes_and_values_without_device_are_not_checked():
    assert Graph.somatize(ReturnsOn("cuda:7")).run(None).device == "cuda:7"

    class Words(Node):
        def forward(self, x, ctx):
            return Done(["not", "placed", "data"])

    assert Graph.somatize(Words().on("cuda:0")).run(None) == ["not", "placed", "data"]


def test_a_container_that_holds_itself_is_walked_once():
    class Loop(Node):
        def forward(self, x, ctx):
            box = [1]
            box.append(box)
            box.append(Located("cpu"))
            return Done(box)

    with pytest.raises(PostconditionError):
        Graph.somatize(Loop().on("meta")).run(None)


def test_with_torch_meta_end_to_end():
    torch = pytest.importorskip("torch")

    class Lin(Node):
        def __init__(self, n_in, n_out):
            self.lin = torch.nn.Linear(n_in, n_out)
            self.placed = None

        def forward(self, x, ctx):
            if ctx.device and self.placed != ctx.device:
                self.lin.to(ctx.device)
                self.placed = ctx.device
            x = x.to(ctx.device) if ctx.device else x
            return Done(Opaque(self.lin(x)))

    g = Graph.somatize(Lin(4, 3).on("meta") >> Lin(3, 2).on("meta"))
    out = g.run(torch.randn(5, 4))  # a cpu input, moved by the node
    assert out.device.type == "meta" and out.shape == (5, 2)
    assert all(p.device.type == "meta" for p in g.node("lin").lin.parameters())


def test_with_torch_a_node_that_ignores_its_device_is_caught():
    torch = pytest.importorskip("torch")

    class Ignores(Node):
        def forward(self, x, ctx):
            return Done(Opaque(torch.ones(3)))  # born on cpu, whatever ctx.device says

    g = Graph.somatize(Ignores().named("encoder").on("meta"))
    with pytest.raises(PostconditionError, match=r"^node `encoder` failed: it declared `meta` but returned a value on `cpu`$"):
        g.run(None)
