
from soma import Graph
from soma.plan import Seq, Step, Wave, first_step, fold, last_step
from tests.nodes import AddOne, Count, Double, Identity, Tokenize, Upper


def test_plan_structure_and_equality():
    g = Graph.somatize(Tokenize() >> (Upper() | Count()) >> Identity().named("join"))
    expected = Seq((Step("tokenize"), Wave((Step("upper"), Step("count"))), Step("join")))
    assert g.plan() == expected
    assert g.plan() != Seq((Step("tokenize"), Step("join")))
    assert hash(g.plan()) == hash(expected)


def test_plan_prints_in_the_dsl_notation():
    g = Graph.somatize(AddOne() >> ((Double() >> Identity()) | Count()) >> Identity().named("join"))
    assert str(g.plan()) == "add_one >> ((double >> identity) | count) >> join"


def test_placing_changes_neither_the_plan_nor_the_graph_nor_the_output():
    g = Graph.somatize(AddOne() >> (Double() | Identity()) >> Identity().named("join"))
    plan, nodes, edges, out = g.plan(), g.nodes(), g.edges(), g.run(1)
    for nid in g.nodes():
        g.place(nid, "cpu")
    assert g.plan() == plan
    assert str(g.plan()) == str(plan)
    assert g.nodes() == nodes and g.edges() == edges
    assert g.run(1) == out == (4, 2)


def test_the_plan_never_sees_the_placement():
    # A warning for the day someone puts placement into the plan: with a placement that
    # explodes on any use, the plan must still come, whole.
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the plan looked at the placement ({name})")

    g = Graph.somatize(AddOne().on("meta") >> (Double() | Identity().on("cpu")))
    g._placement = Untouchable()
    assert str(g.plan()) == "add_one >> (double | identity)"


def test_steps_lists_ids_in_order():
    g = Graph.somatize(AddOne() >> (Double() | Identity()) >> Identity().named("join"))
    assert list(g.plan().steps()) == ["add_one", "double", "identity", "join"]


def test_fold_walks_the_tree_bottom_up_once_per_part():
    plan = Seq((Step("a"), Wave((Seq((Step("b"), Step("c"))), Step("d"))), Step("e")))
    seen = []

    def leaf(step):
        seen.append(step.id)
        return 1

    def seq(part, counts):
        seen.append(f"seq{len(counts)}")
        return sum(counts)

    def wave(part, counts):
        seen.append(f"wave{len(counts)}")
        return max(counts)

    assert fold(plan, leaf, seq, wave) == 1 + 2 + 1  # the wave counts its longest branch
    assert seen == ["a", "b", "c", "seq2", "d", "wave2", "e", "seq3"]


def test_first_and_last_steps_of_a_plan():
    plan = Seq((Wave((Step("x"), Step("y"))), Step("z")))
    assert (first_step(plan), last_step(plan)) == ("x", "z")
    assert last_step(Wave((Seq((Step("p"), Step("q"))), Step("r")))) == "q"  # a wave's output is named by its first branch
