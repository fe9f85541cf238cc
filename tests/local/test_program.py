"""Compiling a graph into the program a pool runs: pure, so it is tested without a single worker."""

import itertools

import pytest

from soma import Graph, GraphError, PlacementError
from soma.local.host.program import Piece, compile_program, output_devices
from soma.plan import Seq, Wave
from soma.wire.protocol import parse_piece
from tests.nodes import AddOne, Count, Double, Identity, OneCopyCounter, Tokenize, Upper

CPU2 = ["cpu", "cpu"]
GPU2 = ["cuda:0", "cuda:1"]


def keys():
    counter = itertools.count(1)
    seen: dict = {}
    return lambda node: seen.setdefault(id(node), next(counter))


def pieces(program):
    if isinstance(program, Piece):
        return [program]
    children = program.items if isinstance(program, Seq) else program.branches
    return [p for child in children for p in pieces(child)]


def test_a_chain_is_one_piece():
    program = compile_program(Graph.somatize(AddOne() >> Double() >> AddOne()), keys(), CPU2)
    assert isinstance(program, Piece) and str(program) == "[add_one >> double >> add_one_2]"
    assert program.cuda is None and program.max_copies is None and program.entry == "add_one"


def test_a_top_level_wave_spreads_its_branches():
    g = Graph.somatize(Tokenize() >> (Upper() | (Count() >> Identity())) >> Identity().named("join"))
    program = compile_program(g, keys(), CPU2)
    assert str(program) == "[tokenize] >> ([upper] | [count >> identity]) >> [join]"
    assert isinstance(program, Seq) and isinstance(program.items[1], Wave)


def test_a_branch_across_two_cuda_devices_is_cut_where_the_device_changes():
    g = Graph.somatize(Tokenize() >> ((Upper().on("cuda:0") >> Count().on("cuda:1")) | Identity().on("cuda:1")))
    program = compile_program(g, keys(), GPU2)  # compiled here, on a machine without a GPU: never run
    assert str(program) == "[tokenize] >> (([upper] >> [count]) | [identity])"
    assert [(p.entry, p.cuda) for p in pieces(program)] == [
        ("tokenize", None), ("upper", "cuda:0"), ("count", "cuda:1"), ("identity", "cuda:1")]


def test_a_chain_across_devices_keeps_unplaced_nodes_with_their_neighbours():
    g = Graph.somatize(AddOne() >> Double().on("cuda:0") >> Identity() >> Count().on("cuda:1")
                       >> Identity().named("join"))
    program = compile_program(g, keys(), GPU2)
    assert str(program) == "[add_one >> double >> identity] >> [count >> join]"
    assert [p.cuda for p in pieces(program)] == ["cuda:0", "cuda:1"]


def test_a_node_with_limited_copies_is_a_piece_of_its_own():
    g = Graph.somatize(AddOne() >> OneCopyCounter() >> Double() >> Identity())
    program = compile_program(g, keys(), CPU2)
    assert str(program) == "[add_one] >> [one_copy_counter] >> [double >> identity]"
    assert [p.max_copies for p in pieces(program)] == [None, 1, None]
    wave = compile_program(Graph.somatize((AddOne() >> OneCopyCounter()) | Double()), keys(), CPU2)
    assert str(wave) == "([add_one] >> [one_copy_counter]) | [double]"


def test_pieces_carry_their_keys_devices_and_spec():
    key_of = keys()
    g = Graph.somatize(AddOne().on("meta") >> Double())
    program = compile_program(g, key_of, CPU2)
    assert program.keys == {"add_one": key_of(g.node("add_one")), "double": key_of(g.node("double"))}
    assert program.devices == {"add_one": "meta"}
    plan, steps = parse_piece(program.spec)
    assert plan == g.plan() and steps == {"add_one": (program.keys["add_one"], "meta"),
                                          "double": (program.keys["double"], None)}


def test_a_cuda_node_without_a_worker_for_it_is_a_placement_error_before_anything_runs():
    g = Graph.somatize(AddOne() >> Double().on("cuda:3"))
    with pytest.raises(PlacementError, match=r"^node `double` is placed on `cuda:3`, but no worker of this pool "
                                             r"serves it \(the workers serve: cuda:0, cuda:1\)"):
        compile_program(g, keys(), GPU2)


@pytest.mark.parametrize("copies", [0, -1, 1.5, "1", True])
def test_copies_must_be_none_or_a_positive_int(copies):
    node = AddOne()
    node.copies = copies
    with pytest.raises(GraphError, match=rf"^node `add_one` \(AddOne\) has copies = {copies!r}: it must be None"):
        compile_program(Graph.somatize(node), keys(), CPU2)


def test_what_a_piece_returned_is_checked_where_it_was_declared():
    g = Graph.somatize(AddOne() >> (Double().on("meta") | Identity() | Count().on("cpu")))
    piece = compile_program(g, keys(), ["cpu"])  # one worker: still one piece per branch, but a piece may end in a wave
    plan = g.plan()
    assert output_devices(plan, g.devices(), ("a", "b", "c")) == [("double", "meta", "a"), ("count", "cpu", "c")]
    assert output_devices(plan, g.devices(), "not a tuple") == []  # (the node's own check already failed)
    assert [p.devices for p in pieces(piece)] == [{}, {"double": "meta"}, {}, {"count": "cpu"}]


def test_a_map_runs_each_input_whole_when_the_graph_allows():
    g = Graph.somatize(Tokenize() >> (Upper() | Count()) >> Identity().named("join"))
    whole = compile_program(g, keys(), CPU2, whole=True)
    assert isinstance(whole, Piece) and str(whole) == "[tokenize >> (upper | count) >> join]"
    limited = Graph.somatize(AddOne() >> OneCopyCounter() >> Double())
    assert str(compile_program(limited, keys(), CPU2, whole=True)) == "[add_one] >> [one_copy_counter] >> [double]"
    two_gpus = Graph.somatize(AddOne().on("cuda:0") >> Double().on("cuda:1"))
    assert str(compile_program(two_gpus, keys(), GPU2, whole=True)) == "[add_one] >> [double]"
