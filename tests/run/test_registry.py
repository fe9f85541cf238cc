"""soma.run.registry: nodes followed by identity (the warnings themselves, on every runner:
tests/run/test_user_mistakes.py)."""

import dataclasses
import gc
import os

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


EDITED = """
from soma import Done, Node


class Edited(Node):
    def forward(self, x, ctx):
        return Done("{version}")
"""


def test_each_graphs_code_files_are_looked_at_however_often_another_graph_runs(tmp_path, monkeypatch):
    """A run looks at its graph's files at most every LOOK_EVERY_S: with one clock for every graph, a loop running
    graph A then graph B looked at A's alone, and B's edited module was never warned about."""
    import importlib
    import os
    import sys
    import time
    import warnings

    from soma import Graph
    from soma.run import registry

    for name in ("edited_a", "edited_b"):
        (tmp_path / f"{name}.py").write_text(EDITED.format(version="v1"))
    sys.path.insert(0, str(tmp_path))
    try:
        a, b = (importlib.import_module(name).Edited() for name in ("edited_a", "edited_b"))
        graphs = [Graph.somatize(a.named("a")), Graph.somatize(b.named("b"))]
        registry.note_sent(a)  # (as each is pickled for its copies)
        registry.note_sent(b)
        monkeypatch.setattr(registry, "LOOK_EVERY_S", 0.05)
        path = tmp_path / "edited_b.py"
        path.write_text(EDITED.format(version="v2"))
        modified = os.stat(path).st_mtime_ns + 1_000_000_000
        os.utime(path, ns=(modified, modified))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            deadline = time.monotonic() + 2.0
            while not caught and time.monotonic() < deadline:
                for g in graphs:  # one after the other, then a pause: a server's requests, A's first after each
                    registry.warn_if_changed(g)
                time.sleep(0.06)  # (longer than a look's 0.05 s: the scenario, not a wait for a condition)
        assert [str(w.message).split(" runs code")[0] for w in caught] == ["node `b`"]
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("edited_a", "edited_b"):
            sys.modules.pop(name, None)


class Scores(Node):
    """A node holding a torch module (its weights are watched)."""

    def __init__(self, torch):
        self.model = torch.nn.Linear(2, 1)

    def forward(self, x, ctx):
        return Done(x)


def test_a_graphs_weights_are_looked_at_on_its_clock_and_at_a_maps_start(monkeypatch):
    """Weights are looked at on the graph's one clock, as its code files are (each node's own clock before): a
    run within LOOK_EVERY_S of the last look does not look (a large model has hundreds of tensors), a map's
    start (`thorough`) does, and once warned a node is not warned again."""
    import warnings

    torch = pytest.importorskip("torch")
    from soma import Graph
    from soma.run import registry

    node = Scores(torch)
    graph = Graph.somatize(node)
    registry.note_sent(node)  # (as it is pickled for its copies)
    monkeypatch.setattr(registry, "LOOK_EVERY_S", 3600.0)  # (no look on a run's way in this test's time)
    with torch.no_grad():
        node.model.weight.add_(1.0)  # an optimizer's step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.warn_if_changed(graph)
        assert caught == []  # a run's way: not looked at yet
        registry.warn_if_changed(graph, thorough=True)  # a map's start
        registry.warn_if_changed(graph, thorough=True)
    assert [str(w.message).split(" holds")[0] for w in caught] == ["node `scores`"]


def test_a_graphs_first_run_after_its_nodes_were_sent_looks_when_its_clock_says_so(monkeypatch):
    """The clock starts when the nodes were sent, not at the run after (which makes the graph's lists): weights
    changed between the run that sent the node and the next, a look's time later, are said at that next run (a
    second later before Dec 7, by a third run)."""
    import time
    import warnings

    torch = pytest.importorskip("torch")
    from soma import Graph
    from soma.run import registry

    node = Scores(torch)
    graph = Graph.somatize(node)
    monkeypatch.setattr(registry, "LOOK_EVERY_S", 0.2)
    registry.note_sent(node)  # (as it is pickled for its copies, on the run that sent it)
    with torch.no_grad():
        node.model.weight.add_(1.0)
    time.sleep(0.25)  # (a look's time since it was sent: what is asserted is only that this run looks)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry.warn_if_changed(graph)  # the next run: its lists are made now
    assert [str(w.message).split(" holds")[0] for w in caught] == ["node `scores`"]


HELPERS = """
import functools


def g(x, k):
    return x + k


def wraps(func):
    @functools.wraps(func)
    def inner(x):
        return func(x)
    return inner


@wraps
def h(x):
    return x


class Base:
    pass
"""


def test_the_files_watched_are_those_of_the_nodes_function_through_wrappers_and_of_its_classes(tmp_path):
    """A soma.fn of a functools.partial, of a decorated function, a node whose base class lives in another
    module: their files are watched too (before Dec 7 only a plain function's and the node's own methods')."""
    import functools
    import importlib
    import sys

    import soma
    from soma.run import registry

    (tmp_path / "watched_helpers.py").write_text(HELPERS)
    (tmp_path / "watched_node.py").write_text("import watched_helpers\nfrom soma import Done\n\n\n"
                                              "class Sub(watched_helpers.Base, __import__('soma').Node):\n"
                                              "    def forward(self, x, ctx):\n        return Done(x)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        helpers, node_module = (importlib.import_module(n) for n in ("watched_helpers", "watched_node"))
        for node, files in [(soma.fn(functools.partial(helpers.g, k=1)), ["watched_helpers.py"]),
                            (soma.fn(helpers.h), ["watched_helpers.py"]),
                            (node_module.Sub(), ["watched_helpers.py", "watched_node.py"])]:
            reads = registry.note_sent(node)
            assert [os.path.basename(p) for p in reads.files.paths] == files, node
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("watched_helpers", "watched_node"):
            sys.modules.pop(name, None)


def test_the_folder_a_module_is_imported_from_is_found_only_where_its_name_matches_its_place(tmp_path):
    """`_import_root`: what a worker must search to import a node's module by its name (the folder above a
    package); a module loaded from a file under another name is importable nowhere by that name: no folder."""
    import importlib.util
    import types

    from soma.run.codefiles import _import_root

    def module(name, file):
        made = types.ModuleType(name)
        made.__file__ = file
        return made

    assert _import_root(module("net", "/r/code/net.py")) == "/r/code"
    assert _import_root(module("pkg.sub.net", "/r/code/pkg/sub/net.py")) == "/r/code"
    assert _import_root(module("pkg", "/r/code/pkg/__init__.py")) == "/r/code"
    assert _import_root(module("fast", "/r/code/fast.cpython-312-x86_64-linux-gnu.so")) == "/r/code"
    assert _import_root(module("pkg.net", "/r/code/other/net.py")) is None
    assert _import_root(module("net", "/r/code/network.py")) is None
    assert _import_root(module("net", "net.py")) is None  # (relative: nothing to tell a worker)
    assert _import_root(types.ModuleType("built_in")) is None
    (tmp_path / "file_of_mine.py").write_text("X = 1\n")
    spec = importlib.util.spec_from_file_location("renamed", tmp_path / "file_of_mine.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    assert _import_root(loaded) is None
