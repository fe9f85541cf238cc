"""What a user trips over once the README works: each mistake gets a clear answer, or just works."""

import traceback

import pytest

from soma import Done, Node, NodeError

pytestmark = pytest.mark.timeout(120)


class Echo(Node):
    def forward(self, x, ctx):
        return Done(x)


class AddOne(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


def test_a_node_or_an_expression_runs_where_a_graph_was_expected(runner):
    assert runner.run(Echo(), 1) == 1
    chain = Echo() >> AddOne()
    assert runner.run(chain, 1) == 2
    assert list(runner.map(chain, range(4))) == [1, 2, 3, 4]
    assert (AddOne() >> AddOne()).run(1) == 3  # an expression runs in-process, as a graph does


def test_the_same_expression_is_one_graph_every_time(runner):
    from soma.run.base import as_graph

    chain = Echo() >> AddOne()
    assert as_graph(chain, "x") is as_graph(chain, "x")  # made once: its program is compiled once
    assert runner.run(chain, 5) == runner.run(chain, 5) == 6


def test_anything_else_says_what_run_takes(runner):
    name = type(runner).__name__
    with pytest.raises(TypeError, match=rf"^{name}.run runs a soma Graph, a Node or an expression built with >> "
                                        rf"and \|; got int$"):
        runner.run(3, 1)
    with pytest.raises(TypeError, match=r"`Echo` is a Node class: did you mean `Echo\(\)`\?"):
        runner.map(Echo, [1])


class ReadsAFile(Node):
    def __init__(self, f):
        self.f = f

    def forward(self, x, ctx):
        return Done(self.f.readline())


def test_a_node_holding_a_file_open_for_reading_is_refused_not_copied(local, tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i}\n" for i in range(10)))
    with open(path) as f:
        with pytest.raises(NodeError) as info:
            local.run(ReadsAFile(f), 0)
    assert str(info.value) == (
        f"node `reads_a_file` failed: it cannot be sent to a worker: TypeError: it holds an open file "
        f"({str(path)!r}, mode 'r'), which cannot be shared with another process (keep unpicklable things such as "
        f"locks, sockets and open files out of the node, or create them in setup)")


class BadSetup(Node):
    def setup(self, ctx):
        raise ValueError("no model file at /models/x.pt")

    def forward(self, x, ctx):
        return Done(x)


def test_a_failing_setup_says_its_message_once_per_exception_shown(runner):
    with pytest.raises(NodeError) as info:
        runner.run(BadSetup(), 0)
    shown = "".join(traceback.format_exception(info.value))
    said = [line for line in shown.splitlines() if not line.startswith(" ") and "no model file" in line]
    # the node's error and its cause (the ValueError itself), as Python shows them in-process (the line of
    # source that raised it may show it too); the worker's traceback adds its frames, not a third message
    assert len(said) == 2, shown
    assert str(info.value) == "node `bad_setup` failed: setup raised ValueError: no model file at /models/x.pt"


class Deep(Node):
    """Returns a list nested 10,000 deep (plain data, only too deep for pickle)."""

    def forward(self, x, ctx):
        value: list = []
        for _ in range(10_000):
            value = [value]
        return Done(value)


def test_plain_data_nested_too_deep_says_so_not_return_plain_data(local):
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    said = ("list nests 10001 levels deep, deeper than pickle can follow (Python's recursion limit is "
            f"{__import__('sys').getrecursionlimit()}): flatten it (rows in one list, not lists inside lists)")
    with pytest.raises(NodeError) as out:
        local.run(Deep(), None)
    assert str(out.value) == f"node `deep` failed: its output cannot be sent back to the host: {said}"
    with pytest.raises(NodeError) as into:
        local.run(Echo(), deep)
    assert str(into.value) == f"node `echo` failed: its input cannot be sent to a worker: {said}"
    assert local.run(Echo(), [[1, [2]]]) == [[1, [2]]]  # the pool is fine, and shallow nesting travels
