"""What a user trips over once the README works: each mistake gets a clear answer, or just works."""

import contextlib
import dataclasses
import traceback

import pytest

import soma
from soma import Done, Graph, GraphError, Node, NodeError
from tests.conftest import module_at

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
                                        rf"and \|; got int 3$"):
        runner.run(3, 1)
    with pytest.raises(TypeError, match=rf"^{name}.map runs .*; got class Echo \(`Echo` is a Node class, not a "
                                        rf"node: did you mean `Echo\(\)`\?\)$"):
        runner.map(Echo, [1])


def upper(x):
    return x.upper()


def test_a_plain_function_where_a_graph_is_expected_is_a_type_error_naming_soma_fn(runner):
    """SPEC 7: every way in (run, map, submit, arun, amap; Graph.somatize, >> and | too) says the same."""
    import asyncio

    name = type(runner).__name__
    wrap = " (wrap a plain function with soma.fn: `soma.fn(upper)`)"
    ways = {
        "run": lambda: runner.run(upper, "x"),
        "map": lambda: runner.map(upper, ["x"]),
        "submit": lambda: runner.submit(upper, "x"),
        "arun": lambda: asyncio.run(runner.arun(upper, "x")),
        "amap": lambda: runner.amap(upper, ["x"]),
    }
    for way, call in ways.items():
        with pytest.raises(TypeError) as info:
            call()
        assert str(info.value) == (f"{name}.{way} runs a soma Graph, a Node or an expression built with >> and |; "
                                   f"got function upper{wrap}"), way
        assert isinstance(info.value, GraphError)  # (what it was before: both still catch it)
    for written, said in [
        (lambda: Graph.somatize(upper),
         "Graph.somatize needs a soma Node or an expression built with >> and |; got function upper"),
        (lambda: Echo() >> upper, "cannot compose echo >> function upper: both sides of `>>` must be soma nodes or "
                                  "expressions"),
        (lambda: upper | Echo(), "cannot compose function upper | echo: both sides of `|` must be soma nodes or "
                                 "expressions"),
    ]:
        with pytest.raises(TypeError) as info:
            written()
        assert str(info.value) == said + wrap
    assert runner.run(soma.fn(upper), "x") == "X"  # what the message says to write works


def fresh_runner_like(runner):
    """A new runner of the same kind (the module's own must stay open for the other tests)."""
    return {"Executor": lambda: soma.Executor(), "Local": lambda: soma.Local(workers=1),
            "Ray": lambda: soma.Ray()}[type(runner).__name__]()


@pytest.mark.parametrize("timeout", ["1", float("nan"), 0, -1, True, [1]])
def test_a_timeout_that_is_not_a_number_of_seconds_is_refused_before_anything_starts(runner, timeout):
    """`timeout=` is seconds (a number > 0) or None, on every runner and every way in; anything else is a
    ValueError before the input starts (on Local a string raised with the loop's lock held, and every later run
    hung; 0 and negative numbers meant something else on each runner), and the runner works on."""
    import asyncio

    said = r"^timeout must be the seconds each input may take \(a number > 0\), or None for no limit, got "
    for call in (lambda: runner.run(AddOne(), 1, timeout=timeout),
                 lambda: runner.submit(AddOne(), 1, timeout=timeout),
                 lambda: list(runner.map(AddOne(), [1], timeout=timeout)),
                 lambda: asyncio.run(runner.arun(AddOne(), 1, timeout=timeout)),
                 lambda: runner.amap(AddOne(), [1], timeout=timeout)):
        with pytest.raises(ValueError, match=said):
            call()
    with pytest.raises(ValueError, match=said):  # (the in-process shorthand too)
        Graph.somatize(AddOne()).run(1, timeout=timeout)
    assert runner.run(AddOne(), 1, timeout=float("inf")) == runner.run(AddOne(), 1, timeout=60) == 2
    assert runner.run(AddOne(), 1, timeout=1e308) == Graph.somatize(AddOne()).run(1, timeout=1e308) == 2  # (no limit)


class Batches(Node):
    def forward_batch(self, xs, ctx):
        return Done([x + 1 for x in xs])


class Forgets(Node):
    """A node that defines no forward at all."""


@pytest.mark.parametrize("attribute, value, said", [
    ("max_batch", -3, r"has max_batch = -3: it must be an int >= 1"), ("max_batch", 0, "has max_batch = 0"),
    ("max_batch", None, "has max_batch = None"), ("max_batch", 2.5, "has max_batch = 2.5"),
    ("max_batch", "4", "has max_batch = '4'"), ("batch_wait", -1, r"has batch_wait = -1: it must be the seconds"),
    ("batch_wait", "0.1", "has batch_wait = '0.1'"), ("copies", 0, r"has copies = 0: it must be None"),
    ("copies", "2", "has copies = '2'"), ("copies", True, "has copies = True")])
def test_a_nodes_settings_that_cannot_work_are_a_graph_error_when_the_graph_is_made_on_every_runner(
        runner, attribute, value, said):
    """`max_batch`, `batch_wait` and `copies` are checked as the graph is made, on every runner: a negative
    max_batch hung Local; None, 2.5 or "4" raised deep in a run, each runner its own way; `copies` was refused by
    Local alone, so code written on the Executor broke on Local."""
    node = Batches()
    setattr(node, attribute, value)
    with pytest.raises(GraphError, match=f"^node `batches` \\(Batches\\) {said}"):
        Graph.somatize(node)
    with pytest.raises(GraphError, match=f"^node `batches` \\(Batches\\) {said}"):
        runner.run(node, 1)
    with pytest.raises(GraphError, match=r"^node `forgets` \(Forgets\) defines no forward: soma calls forward"):
        runner.run(Forgets(), 1)
    assert runner.run(Batches(), 1) == 2


class Awaits(Node):
    async def forward(self, x, ctx):
        return Done(x)


class Yields(Node):
    max_batch = 4

    def forward_batch(self, xs, ctx):
        yield Done(xs)


def test_an_async_or_generator_forward_is_a_graph_error_saying_what_to_write_on_every_runner(runner):
    """It passed every signature check, then failed each input ("forward returned coroutine, not Done", and a
    "never awaited" RuntimeWarning), where soma.fn refuses the same function at once."""
    for node, said in ((Awaits(), r"^node `awaits` \(Awaits\): its forward is an async def, and soma calls "
                                  r"forward\(x, ctx\) and takes what it returns; define it as a plain `def "
                                  r"forward\(self, x, ctx\)` that returns Done\(...\) \(asyncio.run"),
                       (Yields(), r"^node `yields` \(Yields\): its forward_batch is a generator function")):
        with pytest.raises(GraphError, match=said):
            Graph.somatize(node)
        with pytest.raises(GraphError, match=said):
            runner.run(node, 1)


def test_a_module_that_starts_a_pool_as_it_is_imported_is_the_nodes_error_on_every_runner(runner):
    """A worker (or Ray actor) importing a node's module runs its top-level code: one that starts a pool would
    start it there, and its workers would import the module again, process after process. Refused, as the
    node's NodeError naming the module's line on Local and Ray alike (Ray passed a bare SomaError)."""
    import re

    from tests.pools_at_import import InAModuleThatStartsAPool

    node = InAModuleThatStartsAPool()
    if isinstance(runner, soma.Executor):
        assert runner.run(node, 1) == 2  # (nothing is imported elsewhere)
        return
    where = r"worker w\d" if isinstance(runner, soma.Local) else r"Ray actor \w+"
    with pytest.raises(NodeError) as info:
        runner.run(node, 1)
    said = str(info.value)
    assert info.value.node == "in_a_module_that_starts_a_pool"
    assert re.match(rf"node `in_a_module_that_starts_a_pool` failed: its code could not be loaded in {where}: "
                    rf"SomaError: soma.Local cannot start workers here: this process is loading a node's code", said)
    assert re.search(r"importing module `tests.pools_at_import` here ran its top-level code, which raised at "
                     r".*pools_at_import.py, line 21", said), said


def test_a_closed_runner_refuses_new_work_the_same_way_on_every_runner(runner):
    """SPEC 7: after close(), run, map, submit, arun and amap raise SomaError saying the runner is closed (as
    concurrent.futures refuses a submit after shutdown); checked before what it is given, as there."""
    import asyncio

    name = type(runner).__name__
    for used in (False, True):
        closed = fresh_runner_like(runner)
        if used:
            assert closed.run(AddOne(), 1) == 2 and list(closed.map(AddOne(), [1, 2])) == [2, 3]
        closed.close()
        ways = {
            "run": lambda: closed.run(AddOne(), 1),
            "map": lambda: closed.map(AddOne(), [1]),
            "submit": lambda: closed.submit(AddOne(), 1),
            "arun": lambda: asyncio.run(closed.arun(AddOne(), 1)),
            "amap": lambda: closed.amap(AddOne(), [1]),
            "run of what is not a graph": lambda: closed.run(upper, 1),
            "start": closed.start,
            "with": lambda: closed.__enter__(),
        }
        for way, call in ways.items():
            with pytest.raises(soma.SomaError) as info:
                call()
            assert str(info.value) == f"this soma.{name} is closed; make a new one", (used, way)
        closed.close()  # twice is fine


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


READS_ARGV = """
import sys
from soma import Done, Node

TASKS = int(sys.argv[1]) if len(sys.argv) > 1 else 4  # the script's `python main.py 3`: read as it is imported


class Times(Node):
    def forward(self, x, ctx):
        return Done(x * TASKS)
"""

PARSES_ARGS = """
import argparse
from soma import Done, Node

parser = argparse.ArgumentParser()
parser.add_argument("n", type=int)
ARGS = parser.parse_args()  # (exits with status 2 where the arguments are not its own)


class Echoes(Node):
    def forward(self, x, ctx):
        return Done(x)
"""

MAIN = """
import soma, parses_args, reads_argv

with soma.Local(workers=1) as local:
    for node in (reads_argv.Times(), parses_args.Echoes()):
        try:
            local.run(node, 2)
        except soma.NodeError as err:
            print(err)
"""


def test_a_node_module_that_reads_the_command_line_as_it_is_imported_says_so_from_the_worker(tmp_path):
    """The worker imports the node's module, whose top-level code then sees the worker's own sys.argv: the
    error says that (it said to look at sys.path, which was fine)."""
    import re
    import subprocess
    import sys

    from tests.conftest import ROOT

    (tmp_path / "reads_argv.py").write_text(READS_ARGV)
    (tmp_path / "parses_args.py").write_text(PARSES_ARGS)
    (tmp_path / "main.py").write_text(MAIN)
    done = subprocess.run([sys.executable, "main.py", "3"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=90, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    times, echoes = done.stdout.splitlines()
    advice = (r"it reads the command line as it is imported, and a worker's sys.argv holds its own program's "
              r"arguments \(`--tasks ipc://\S+ \.\.\.`\), not your script's; read arguments under "
              r"`if __name__ == \"__main__\":` and give nodes what they need as their attributes\)")
    assert re.fullmatch(
        r"node `times` failed: its code could not be loaded in worker w0: ValueError: invalid literal for int\(\) "
        r"with base 10: '--tasks' \(importing module `reads_argv` here ran its top-level code, which raised at "
        + re.escape(str(tmp_path / "reads_argv.py")) + r", line 5: " + advice, times), times
    assert re.fullmatch(
        r"node `echoes` failed: its code could not be loaded in worker w0: SystemExit: 2 \(importing module "
        r"`parses_args` here ran its top-level code, which raised at " + re.escape(str(tmp_path / "parses_args.py"))
        + r", line 7: " + advice, echoes), echoes


OFFSET = 10  # read by add_offset; the test below rebinds it


def add_offset(x):
    return x + OFFSET


def test_a_value_a_node_reads_rebound_after_it_was_sent_is_warned_about_once(runner, monkeypatch):
    """A node's copies keep what its code read when it was sent (docs/api.md, "Copies"): the Executor runs the
    node itself and sees a rebound global at once, Local and Ray do not, and say so once, naming the node and
    the name, instead of giving other answers without a word."""
    import warnings

    def closing_over(k):
        def add_k(x):
            return x + k
        return add_k

    by_global, by_closure = soma.fn(add_offset), soma.fn(closing_over(10), name="add_k")
    assert runner.run(by_global, 1) == 11 and runner.run(by_closure, 1) == 11
    monkeypatch.setattr(__import__(__name__, fromlist=["OFFSET"]), "OFFSET", 100)
    by_closure.func.__closure__[0].cell_contents = 100
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [runner.run(by_global, 1), list(runner.map(by_closure, [1, 2])), runner.run(by_global, 1),
               runner.run(by_closure, 1)]
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if isinstance(runner, soma.Executor):
        assert got == [101, [101, 102], 101, 101] and said == []
        return
    assert got == [11, [11, 12], 11, 11]  # the copies' values, as sent
    tail = (", which now names another value than when the node was sent to its copies on worker processes: they "
            "still see the old one, where the in-process Executor sees the new (docs/api.md, \"Copies\"); to use "
            "the new value, give it to a new node as its attribute, or pass it in the input")
    assert said == [f"node `add_offset` reads `OFFSET`{tail}", f"node `add_k` reads `k`{tail}"]  # once each
    assert {w.filename for w in caught} == {__file__}  # pointing at the run or map that was given the node


SCALE = 10  # read by Scaled; the test below rebinds it


@dataclasses.dataclass
class Scaled(Node):
    """A @dataclass node: eq=True sets its __hash__ to None, so it cannot be a dict's key."""

    offset: int = 1

    def forward(self, x, ctx):
        return Done(x * SCALE + self.offset)


@dataclasses.dataclass
class Scores(Node):
    """A @dataclass node holding a torch module (unhashable, as above)."""

    model: object = None

    def forward(self, x, ctx):
        return Done(self.model(x).sum().item())


def test_an_unhashable_node_is_watched_as_any_other(runner, monkeypatch):
    """A node that cannot be hashed (a @dataclass, any class defining __eq__ without __hash__) is still one
    node: its rebound global and its module's weights changed in place are warned about once, as a plain
    node's are (both were silent: Local gave 11 where the Executor gave 101, and not a word)."""
    import warnings

    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    scaled, scores = Scaled(), Scores(model)
    with pytest.raises(TypeError):
        hash(scaled)
    x = torch.ones(2)
    assert runner.run(scaled, 1) == 11 and runner.run(scores, x) == 2.0
    monkeypatch.setattr(__import__(__name__, fromlist=["SCALE"]), "SCALE", 100)
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer's step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [runner.run(scaled, 1), list(runner.map(scaled, [1, 2])), list(runner.map(scores, [x])),
               runner.run(scaled, 1), list(runner.map(scores, [x]))]
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if isinstance(runner, soma.Executor):
        assert got == [101, [101, 201], [4.0], 101, [4.0]] and said == []
        return
    assert got == [11, [11, 21], [2.0], 11, [2.0]]  # the copies', as sent
    assert said == [  # once each
        "node `scaled` reads `SCALE`, which now names another value than when the node was sent to its copies on "
        "worker processes: they still see the old one, where the in-process Executor sees the new (docs/api.md, "
        "\"Copies\"); to use the new value, give it to a new node as its attribute, or pass it in the input",
        "node `scores` holds a torch module whose weights changed in place (an optimizer step, load_state_dict) "
        "since the node was sent to its copies on worker processes: they still run the old weights, where the "
        "in-process Executor sees the new (docs/api.md, \"Copies\"); to use the new weights, make a new node of "
        "the module (soma.torch.Module(model)), or start a new pool"]
    assert {w.filename for w in caught} == {__file__}


ONLY_HERE = """\
import os
import sys

from soma import Done, Node

TEST_PROCESS = {pid}  # the test's process imports this module; any other process reads the command line
if os.getpid() != TEST_PROCESS:
    COUNT = int(sys.argv[1])


class {cls}(Node):
    def forward(self, x, ctx):
        return Done(x)
"""


def _node_only_here(tmp_path, module: str, cls: str):
    """A node of module `module` (in `tmp_path`, which the caller puts on sys.path): importable in this
    process only, since anywhere else it reads the command line as it is imported."""
    import importlib
    import os

    (tmp_path / f"{module}.py").write_text(ONLY_HERE.format(pid=os.getpid(), cls=cls))
    return getattr(importlib.import_module(module), cls)()


@pytest.mark.parametrize("case", ["reads_argv", "not_there"])
def test_node_code_a_copy_cannot_load_says_why_and_what_to_do_on_every_runner(runner, tmp_path, case):
    """A node's copy (Local's worker, Ray's actor) imports the node's module: when that fails, the error names
    the node and the process and says what to do, in words for that runner: the module reads the command line
    as it is imported (the copy's sys.argv is its own program's), or it cannot be found where the copy runs
    (on Ray: importable on every machine of the cluster, or shipped with the runtime_env)."""
    import re
    import sys

    if isinstance(runner, soma.Executor):
        pytest.skip("the Executor runs the node object itself: nothing is loaded")
    module = f"only_here_{case}_{type(runner).__name__.lower()}"
    # (a Ray actor searches the driver's sys.path as it was when it started; Local's workers, as it is when the
    # node is sent)
    sys.path.insert(0, str(tmp_path))
    try:
        node = _node_only_here(tmp_path, module, "OnlyHere")
        if case == "not_there":
            (tmp_path / f"{module}.py").unlink()  # (imported here already: it travels by reference)
        where = r"worker w\d" if isinstance(runner, soma.Local) else r"Ray actor \w+"
        who = "worker" if isinstance(runner, soma.Local) else "Ray actor"
        for _ in range(2):  # and again: the copy did not keep the failure as "loaded"
            with pytest.raises(NodeError) as info:
                runner.run(node, 1)
            said = str(info.value)
            assert re.match(rf"node `only_here` failed: its code could not be loaded in {where}: ", said), said
            if case == "reads_argv":
                assert re.search(rf"ValueError: .*\(importing module `{module}` here ran its top-level code, which "
                                 rf"raised at .*{module}\.py, line 8: it reads the command line as it is imported, "
                                 rf"and a {who}'s sys.argv holds its own program's arguments", said), said
            elif who == "worker":
                assert "ModuleNotFoundError" in said and "define the node in a module they can import" in said
            else:
                assert "ModuleNotFoundError" in said and all(words in said for words in (
                    "importable there, the same code on every machine", "runtime_env", "working_dir",
                    "py_modules")), said
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


def test_a_modules_weights_changed_in_place_after_its_node_was_sent_are_warned_about_once(runner):
    """An optimizer step on the host after the node was sent: Local's and Ray's copies go on with the old
    weights (SPEC 2, "Copies"), silently; an evaluation on a warm pool after each epoch measured the first
    epoch's model. A map's start looks at the weights; a run looks every second or so."""
    import warnings

    torch = pytest.importorskip("torch")
    import soma.torch as st

    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    node = st.Module(model, name="model")
    x = torch.ones(2)
    assert runner.run(node, x).item() == 2.0
    with torch.no_grad():
        model.weight.add_(1.0)  # what an optimizer's step does: in place
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [y.item() for y in runner.map(node, [x, x])] + [y.item() for y in runner.map(node, [x])]
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if isinstance(runner, soma.Executor):
        assert got == [4.0, 4.0, 4.0] and said == []
        return
    assert got == [2.0, 2.0, 2.0]  # the copies' weights, as sent
    assert said == ["node `model` holds a torch module whose weights changed in place (an optimizer step, "
                    "load_state_dict) since the node was sent to its copies on worker processes: they still run the "
                    "old weights, where the in-process Executor sees the new (docs/api.md, \"Copies\"); to use the "
                    "new weights, make a new node of the module (soma.torch.Module(model)), or start a new pool"]
    assert runner.run(st.Module(model, name="model"), x).item() == 4.0  # a new node: sent with the new weights


def test_a_module_switched_to_eval_after_its_node_was_sent_is_warned_about(runner):
    """`model.eval()` after a first run in train mode (the default): the copies went on with dropout, the
    Executor without, and nothing said so (Dec 7)."""
    import warnings

    torch = pytest.importorskip("torch")
    import soma.torch as st

    model = torch.nn.Sequential(torch.nn.Dropout(0.5))
    node = st.Module(model, name="dropped")
    x = torch.ones(256)
    runner.run(node, x)  # sent in train mode
    model.eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = runner.map(node, [x])
        [y] = list(got)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if isinstance(runner, soma.Executor):
        assert torch.equal(y, x) and said == []
        return
    assert not torch.equal(y, x)  # the copies' mode, as sent: dropout
    assert said == ["node `dropped` holds a torch module switched between train and eval mode (`model.eval()`, "
                    "`model.train()`) since the node was sent to its copies on worker processes: they still run it "
                    "in the mode it had then (dropout, batch norm), where the in-process Executor sees the new "
                    "(docs/api.md, \"Copies\"); to use the new mode, make a new node of the module "
                    "(soma.torch.Module(model)), or set the mode before its first run"]
    assert torch.equal(runner.run(st.Module(model, name="dropped"), x), x)  # a new node: sent in eval mode


VERSIONED = """
from soma import Done, Node


class Versioned(Node):
    def forward(self, x, ctx):
        return Done("{version}")
"""


def test_a_nodes_module_edited_on_disk_after_it_was_sent_is_warned_about_once(runner, tmp_path):
    """A worker imports a node's module once: edited on disk since (or reloaded: `%autoreload` in a notebook),
    the workers that have it run the old code and a worker started since (a replacement) the new, so one pool
    could answer both ways; Local and Ray say so once, naming the file."""
    import os
    import warnings

    with _versioned_module(runner, tmp_path, "versioned") as (path, module):
        node = module.Versioned()
        assert runner.run(node, 0) == "v1"
        modified = os.stat(path).st_mtime_ns + 1_000_000_000
        os.utime(path, ns=(modified, modified))  # touched, not changed (a save without an edit): no warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert list(runner.map(node, [0])) == ["v1"]
        assert [str(w.message) for w in caught if issubclass(w.category, UserWarning)] == []
        path.write_text(VERSIONED.format(version="v2"))
        modified += 1_000_000_000
        os.utime(path, ns=(modified, modified))  # (a second later, whatever the file system's clock grain)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(runner.map(node, [0, 1])) + list(runner.map(node, [2]))  # (a map's start looks at once)
        said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        if isinstance(runner, soma.Executor):
            assert got == ["v1"] * 3  # the class object the host holds
            assert said == []  # (it runs the node object itself: nothing was imported elsewhere)
            return
        # w0 imported v1 for the run; w1, first given the node by the map, may import v2: the pool runs both
        assert got[0] == "v1" or got[1] == "v1", got
        assert set(got) <= {"v1", "v2"}, got
        assert said == [f"node `versioned` runs code of {path}, which changed on disk since the node was sent to "
                        f"its copies on worker processes: those run the code as their worker imported it, and a "
                        f"worker that imports it from now on (one that had not run the node yet, or a replacement) "
                        f"imports the new, so the pool may run both (docs/api.md, \"Copies\"); to run the new code, start a new pool"]
        assert {w.filename for w in caught} == {__file__}


def test_a_new_node_of_a_module_reloaded_since_the_pools_workers_imported_it_is_warned_about_at_its_first_run(
        runner, tmp_path, monkeypatch):
    """A notebook's loop: run a node, edit its module, `importlib.reload` it (or `%autoreload`), make a new node,
    run it. In-process the new node runs the new code; Local's workers imported the module once, for the first
    node, and the new node's copies there run it as it was (before Dec 7 silently: the new node answered with the
    old code and nothing said so). Its first run says so; so does the old node's next run."""
    import importlib
    import os
    import warnings

    monkeypatch.setattr("soma.run.registry.LOOK_EVERY_S", 0.0)  # (every run looks: the test takes no second)
    with _versioned_module(runner, tmp_path, "reloaded") as (path, module):
        old = module.Versioned()
        assert runner.run(old, 0) == "v1"
        path.write_text(VERSIONED.format(version="v2"))
        modified = os.stat(path).st_mtime_ns + 1_000_000_000
        os.utime(path, ns=(modified, modified))  # (a second later, whatever the file system's clock grain)
        new = importlib.reload(module).Versioned()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got_new = runner.run(new, 0)
            said_at_first_run = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
            got_old = runner.run(old, 0)  # (its graph's files are looked at on this run: LOOK_EVERY_S is 0)
        said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
        if isinstance(runner, soma.Executor):
            assert (got_new, got_old) == ("v2", "v1") and said == []  # each object's own class, as Python has it
            return
        assert got_old == "v1" and got_new in ("v1", "v2")  # (a worker that had not imported it imports v2)
        tail = (": those run the code as their worker imported it, and a worker that imports it from now on (one "
                "that had not run the node yet, or a replacement) imports the new, so the pool may run both "
                "(docs/api.md, \"Copies\"); to run the new code, start a new pool")
        assert said_at_first_run == [f"node `versioned` runs code of {path}, which changed on disk since this "
                                     f"pool's workers, where the node's copies run, imported it for a node sent "
                                     f"before (a reload in this process does not reach them)" + tail]
        assert said[1:] == [f"node `versioned` runs code of {path}, which changed on disk since the node was sent "
                            f"to its copies on worker processes" + tail]
        assert {w.filename for w in caught} == {__file__}


@contextlib.contextmanager
def _versioned_module(runner, tmp_path, name: str):
    """`(path, module)`: a module of `VERSIONED` at "v1", importable from `tmp_path` while the block runs."""
    if isinstance(runner, soma.Ray):
        pytest.skip("Ray's actors search the driver's sys.path as it was when Ray started: not the test's folder")
    name = f"{name}_{type(runner).__name__.lower()}"
    with module_at(tmp_path, name, VERSIONED, version="v1") as (_, module):
        yield tmp_path / f"{name}.py", module
