"""soma.run.registry: nodes followed by identity (the warnings themselves, on every runner:
tests/run/test_user_mistakes.py)."""

import dataclasses
import gc

import pytest

from soma import Done, Node
from soma.run.registry import ByNode


@dataclasses.dataclass
class Equal(Node):
    """Two of these are equal, and neither can be hashed."""

    k: int = 1

    def forward(self, x, ctx):
        return Done(x)


def test_nodes_are_kept_by_identity_not_by_equality_and_go_with_their_node():
    kept = ByNode()
    a, b = Equal(), Equal()
    assert a == b
    kept.put(a, "a")
    assert kept.get(a) == "a" and kept.get(b) is None  # an equal node is another node
    kept.put(b, "b")
    assert (kept.get(a), kept.get(b)) == ("a", "b")
    del a
    gc.collect()
    assert len(kept._entries) == 1 and kept.get(b) == "b"  # the entry went with its node, not held by it


def test_a_node_without_weakref_is_not_kept():
    class Slotted:  # (not a Node: every Node has __weakref__)
        __slots__ = ()

    with pytest.raises(TypeError):
        ByNode().put(Slotted(), 1)
