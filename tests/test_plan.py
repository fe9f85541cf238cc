import pytest

from soma import Graph
from soma.plan import Seq, Step, Wave, compile_plan
from tests.nodes import AddOne, Count, Double, Identity, Join, Tokenize, Upper


def test_plan_structure_and_equality():
    g = Graph.somatize(Tokenize() >> (Upper() | Count()) >> Join())
    expected = Seq((Step("tokenize"), Wave((Step("upper"), Step("count"))), Step("join")))
    assert g.plan() == expected
    assert g.plan() != Seq((Step("tokenize"), Step("join")))
    assert hash(g.plan()) == hash(expected)


def test_plan_prints_in_the_dsl_notation():
    g = Graph.somatize(AddOne() >> ((Double() >> Identity()) | Count()) >> Join())
    assert str(g.plan()) == "add_one >> ((double >> identity) | count) >> join"


def test_placing_changes_neither_the_plan_nor_the_graph_nor_the_output():
    g = Graph.somatize(AddOne() >> (Double() | Identity()) >> Join())
    plan, nodes, edges, out = g.plan(), g.nodes(), g.edges(), g.run(1)
    for nid in g.nodes():
        g.place(nid, "cpu")
    assert g.plan() == plan
    assert str(g.plan()) == str(plan)
    assert g.nodes() == nodes and g.edges() == edges
    assert g.run(1) == out == (4, 2)


def test_the_plan_compiler_never_sees_the_placement():
    # A warning for the day someone puts placement into the plan: compiling with
    # a placement that explodes on any use must still work.
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the plan compiler looked at the placement ({name})")

    g = Graph.somatize(AddOne().on("meta") >> (Double() | Identity().on("cpu")))
    g._placement = Untouchable()
    g._plan = None
    assert str(g.plan()) == "add_one >> (double | identity)"
    with pytest.raises(TypeError):
        compile_plan(g._topology, g._placement)  # no placement parameter exists


def test_steps_lists_ids_in_order():
    g = Graph.somatize(AddOne() >> (Double() | Identity()) >> Join())
    assert list(g.plan().steps()) == ["add_one", "double", "identity", "join"]
