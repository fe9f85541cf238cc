"""soma.run.weights: what a node's copies were made with, seen changing on the host (unit-tested here; the
warning itself, on every runner: tests/run/test_user_mistakes.py)."""

import pytest

from soma import Done, Node
from soma.run.weights import Weights

torch = pytest.importorskip("torch")


class Holds(Node):
    """A node holding modules the ways nodes do: an attribute, and a list of layers."""

    def __init__(self):
        self.head = torch.nn.Linear(2, 2)
        self.layers = [torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)]

    def forward(self, x, ctx):
        return Done(x)


def test_weights_see_in_place_changes_replacements_and_modules_in_a_list():
    node = Holds()
    weights = Weights.of(node, [])
    assert weights is not None and not weights.changed()  # nothing happened
    node.layers[0].eval()
    assert weights.changed() == "mode"  # the copies run it in train mode (dropout, batch norm)
    node.layers[0].train()
    assert not weights.changed()  # (back as it was sent)
    with torch.no_grad():
        node.layers[0].weight.add_(1.0)  # an optimizer step's way: in place
    assert weights.changed() == "weights"
    weights.noted()  # sent again (another pool): as it is now
    assert not weights.changed()
    node.head.weight = torch.nn.Parameter(torch.zeros(2, 2))  # replaced: the old one is gone
    assert weights.changed()
    node.layers[1].running_mean.add_(1.0)  # a buffer too
    weights.noted()
    node.layers[1].running_mean.add_(1.0)
    assert weights.changed()


def test_a_node_holding_no_module_has_no_weights():
    class Plain(Node):
        def forward(self, x, ctx):
            return Done(x)

    assert Weights.of(Plain(), [1, "a", [2]]) is None
