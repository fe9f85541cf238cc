"""How a worker starts and finds node code: the host's interpreter flags, its sys.path (any path, and changes made
after the pool started), nothing from the working directory before that path is set, and what a node whose
unpickling fails for another reason than an import is told. Real worker processes, real files."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import soma
from soma import Done, Node, NodeError
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


def _run_script(tmp_path, script: str, *flags: str, cwd=None, argv=()) -> subprocess.CompletedProcess:
    """`python FLAGS main.py ARGV` (in `tmp_path`) with soma importable from this checkout, from `cwd`."""
    main = tmp_path / "main.py"
    main.write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, *flags, str(main), *argv], cwd=cwd or tmp_path, capture_output=True,
                          text=True, timeout=90, env={**os.environ, "PYTHONPATH": str(ROOT)})


FLAG_NODES = """
import os, sys, warnings
from soma import Done, Node


class Flags(Node):
    def forward(self, x, ctx):
        return Done([sys.flags.optimize, sys.flags.dev_mode, sys.flags.bytes_warning, list(sys.warnoptions),
                     __debug__])


class AssertPositive(Node):
    def forward(self, x, ctx):
        assert x > 0, "x must be positive"
        return Done(x)


class Warns(Node):
    def forward(self, x, ctx):
        warnings.warn("careful", UserWarning)
        return Done(x)


class WarnsWhenLoaded(Node):
    def __init__(self):
        self.host = os.getpid()

    def __setstate__(self, state):
        self.__dict__.update(state)
        if os.getpid() != self.host:
            warnings.warn("loaded in another process", UserWarning)

    def forward(self, x, ctx):
        return Done(x)
"""

FLAGS_MAIN = """
import json, soma
from soma import Done, Node
from flag_nodes import AssertPositive, Flags, Warns, WarnsWhenLoaded


class InMain(Node):  # (from __main__: it travels by value, its code objects rebuilt by soma.wire.nodecode)
    def forward(self, x, ctx):
        return Done(x + 1)


def said(runner, node, x):
    try:
        return runner.run(node, x)
    except soma.NodeError as err:
        return str(err)


with soma.Local(workers=1) as local:
    pids = local.pids()
    answers = {name: [said(runner, node, x) for node, x in ((Flags(), 0), (AssertPositive(), -1), (Warns(), 0),
                                                            (InMain(), 1))]
               for name, runner in (("executor", soma.Executor()), ("local", local))}
    answers["loaded"] = said(local, WarnsWhenLoaded(), 1)
    answers["after"] = said(local, InMain(), 2)
    answers["same_worker"] = local.pids() == pids
print(json.dumps(answers))
"""


def test_the_hosts_interpreter_flags_reach_the_workers(tmp_path):
    """Under `python -O -bb -W error -X dev` a node meets the same asserts, warning filters and checks on Local as
    on the Executor (workers started with no flags: an assert -O removes failed there, a warning -W error turns
    into an error did not); soma's own code runs under -bb (it compared bytes with str loading a node of
    `__main__`); and a warning turned error as a node is loaded fails that node, not the worker."""
    (tmp_path / "flag_nodes.py").write_text(FLAG_NODES)
    done = _run_script(tmp_path, FLAGS_MAIN, "-O", "-bb", "-W", "error", "-X", "dev")
    assert done.returncode == 0, done.stderr
    answers = json.loads(done.stdout)
    assert answers["local"] == answers["executor"], answers
    flags, asserted, warned, in_main = answers["local"]
    assert flags == [1, True, 2, ["default", "error", "error::BytesWarning"], False], flags
    assert asserted == -1  # (the assert is gone, as in the host)
    assert warned == "node `warns` failed: UserWarning: careful"
    assert in_main == 2
    assert answers["loaded"].startswith("node `warns_when_loaded` failed: its code could not be loaded in worker w0: "
                                        "UserWarning: loaded in another process (unpickling it here ran "
                                        "WarnsWhenLoaded.__setstate__ ("), answers["loaded"]
    assert answers["after"] == 3 and answers["same_worker"], answers


def test_a_folder_put_on_sys_path_after_the_pool_started_is_searched_by_every_worker(tmp_path):
    """The notebook's way: the pool runs, then `sys.path.append(folder)` and a node from a module there. Each
    worker is sent the new sys.path with the node's code (it said "No module named 'plug'" while a replacement
    worker, started with the new path, loaded it: two workers, two answers)."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "late_plug.py").write_text(textwrap.dedent("""
        import os
        from soma import Done, Node

        class Plug(Node):
            def forward(self, x, ctx):
                return Done((x + 1, os.getpid()))
        """))
    with soma.Local(workers=2) as local:
        assert local.run(soma.fn(lambda x: x, name="warm"), 0) == 0  # (the pool runs: its workers have a sys.path)
        sys.path.append(str(folder))
        try:
            from late_plug import Plug

            assert soma.Executor().run(Plug(), 1)[0] == 2
            assert local.run(Plug(), 1)[0] == 2
            outs = list(local.map(Plug(), range(400), window=8))  # (one input each at first: both workers)
            assert [y for y, _ in outs] == list(range(1, 401))
            assert {pid for _, pid in outs} == set(local.pids()), "every worker loaded it"
        finally:
            sys.path.remove(str(folder))
            sys.modules.pop("late_plug", None)


def test_the_working_directory_on_sys_path_changed_by_chdir_after_the_pool_started_is_searched_there(tmp_path):
    """'' on sys.path is the working directory, whichever it is now: a workers' copy of it names the folder the
    pool started in, so after an os.chdir the host found a module there and its workers did not."""
    started, moved = tmp_path / "started", tmp_path / "moved"
    started.mkdir()
    moved.mkdir()
    (moved / "here_plug.py").write_text(textwrap.dedent("""
        from soma import Done, Node

        class HerePlug(Node):
            def forward(self, x, ctx):
                return Done(x + 1)
        """))
    done = _run_script(started, """
        import os, sys, soma
        sys.path.insert(0, "")
        with soma.Local(workers=1, start_timeout=20) as local:
            assert local.run(soma.fn(lambda x: x, name="warm"), 0) == 0
            os.chdir(sys.argv[1])
            from here_plug import HerePlug
            print(local.run(HerePlug(), 1))
        """, argv=[str(moved)])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "2\n"


def test_a_module_imported_through_the_working_directory_before_an_os_chdir_is_found_by_the_workers(tmp_path):
    """A notebook's way: `from models import Net` ('' on sys.path: the notebook's folder), `os.chdir("../data")`,
    then a pool: the workers searched '' as the new folder and failed with ModuleNotFoundError, while the host had
    the module. The folder each node's module was imported from goes with its code; a base class's module and
    a package's module (`pkg.sub`: the folder above `pkg`) are found the same way."""
    code, data = tmp_path / "code", tmp_path / "data"
    (code / "pkg").mkdir(parents=True)
    data.mkdir()
    (code / "base_here.py").write_text("from soma import Done, Node\n\n\nclass Base(Node):\n"
                                       "    def forward(self, x, ctx):\n        return Done(self.step(x))\n")
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "sub.py").write_text("from base_here import Base\n\n\nclass Deep(Base):\n"
                                         "    def step(self, x):\n        return x * 10\n")
    (code / "models_here.py").write_text("from base_here import Base\n\n\nclass Net(Base):\n"
                                         "    def step(self, x):\n        return x + 1\n")
    done = _run_script(tmp_path, """
        import os, sys, soma
        sys.path.insert(0, "")
        os.chdir(sys.argv[1])
        from models_here import Net
        from pkg.sub import Deep
        os.chdir(sys.argv[2])
        with soma.Local(workers=1, start_timeout=20) as local:
            print(local.run(Net(), 1), local.run(Deep(), 2), list(local.map(Net(), range(3))))
        """, argv=[str(code), str(data)])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "2 20 [1, 2, 3]\n"


def test_a_sys_path_entry_with_a_colon_in_it_reaches_the_workers(tmp_path):
    """A folder named `colon:dir` (a script's own folder, sys.path[0]) on the sys.path workers start with, and on
    the one sent later: it was joined with ':' and split back into two folders that do not exist."""
    folder = tmp_path / "colon:dir"
    folder.mkdir()
    (folder / "colon_mod.py").write_text("from soma import Done, Node\n\n\nclass Col(Node):\n"
                                         "    def forward(self, x, ctx):\n        return Done(x * 3)\n")
    sys.path.insert(0, str(folder))
    try:
        from colon_mod import Col

        with soma.Local(workers=1) as local:
            assert local.run(Col(), 2) == 6
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("colon_mod", None)


def test_a_file_in_the_working_directory_does_not_shadow_the_workers_standard_library(tmp_path):
    """A user's argparse.py (and json.py) in the working directory, the script elsewhere: the host never sees them
    (its sys.path[0] is the script's folder), and the workers imported them before the host's sys.path was set
    (`python -m` puts the working directory first): every worker died before its hello."""
    cwd = tmp_path / "here"
    cwd.mkdir()
    for name in ("argparse", "json"):
        (cwd / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    app = tmp_path / "app"
    app.mkdir()
    done = _run_script(app, """
        import soma
        with soma.Local(workers=1, start_timeout=20) as local:
            print(local.run(soma.fn(lambda x: x + 1, name="inc"), 1))
        """, cwd=cwd)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "2\n"


UNGUARDED = """
import os, sys, soma
from soma import Done, Node


class Double(Node):
    def forward(self, x, ctx):
        return Done(x * 2)


depth = int(os.environ.get("SOMA_TEST_DEPTH", "0"))
if depth < 2:  # (only so that, were soma not to refuse, this test would fail rather than fill the machine)
    os.environ["SOMA_TEST_DEPTH"] = str(depth + 1)
    with soma.Local(workers=1, start_timeout=20) as local:
        print("nested", depth, local.run(Double(), 21), flush=True)
"""


def test_a_module_that_starts_a_pool_as_it_is_imported_is_refused_in_the_worker_that_imports_it(tmp_path):
    """A script without `if __name__ == "__main__":`, imported for its node class: each worker importing it ran
    its pool, whose workers imported it again, process after process. A pool is refused while a node's code
    loads (as multiprocessing refuses a start while its child imports __main__): the node's error says so."""
    (tmp_path / "unguarded.py").write_text(UNGUARDED)
    done = _run_script(tmp_path, """
        import os, soma
        os.environ["SOMA_TEST_DEPTH"] = "2"  # (this import of it starts nothing)
        from unguarded import Double
        os.environ["SOMA_TEST_DEPTH"] = "0"  # (a worker's import of it would)
        with soma.Local(workers=1, start_timeout=20) as local:
            try:
                print("result", local.run(Double(), 1))
            except soma.NodeError as err:
                print("refused", err)
        """)
    assert done.returncode == 0, done.stderr
    assert "nested" not in done.stdout, done.stdout  # no pool started in a worker
    said = done.stdout
    assert said.startswith("refused node `double` failed: its code could not be loaded in worker w0: SomaError: "
                           "soma.Local cannot start workers here: this process is loading a node's code"), said
    assert "importing module `unguarded` here ran its top-level code" in said and "__main__" in said, said


class OpensWeightsWhenLoaded(Node):
    """Opens a file as it is unpickled: where it is not there, loading the node raises FileNotFoundError."""

    def __init__(self, path: str):
        self.path = path

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.path = state["path"]
        with open(self.path, "rb") as f:
            self.weights = f.read()

    def forward(self, x, ctx):
        return Done(x)


def test_a_node_whose_unpickling_fails_for_no_import_reason_is_told_where_and_what_to_do(tmp_path):
    """A `__setstate__` that raises FileNotFoundError: the error names the node, the real error and the code that
    raised, and says what to do (it said "define the node in a module they can import", about sys.path)."""
    missing = str(tmp_path / "weights.bin")
    with soma.Local(workers=1) as local:
        with pytest.raises(NodeError) as info:
            local.run(OpensWeightsWhenLoaded(missing), 1)
    said = str(info.value)
    assert said.startswith(
        f"node `opens_weights_when_loaded` failed: its code could not be loaded in worker w0: FileNotFoundError: "
        f"[Errno 2] No such file or directory: {missing!r} (unpickling it here ran "
        f"OpensWeightsWhenLoaded.__setstate__ ({__file__}, line "), said
    assert said.endswith("which raised: a worker rebuilds each node from its pickled state, so what runs as it is "
                         "unpickled (`__setstate__`, a `__reduce__`'s function) runs there, in that process; make it "
                         "work there, or do that work in the node's `setup(self, ctx)`, which runs once per copy "
                         "where it runs)"), said
    assert "sys.path" not in said and "module they can import" not in said


def test_a_worker_adopting_the_hosts_new_sys_path_keeps_what_a_node_added_there_itself(monkeypatch):
    """The host's entries follow the host (added, removed, reordered); one a node's setup put on the worker's own
    sys.path stays, after them: that node counts on it."""
    from soma.local.worker.library import Library

    monkeypatch.setattr(sys, "path", ["/host/a", "/host/b"])
    library = Library("w0", make_interpreter=None)
    sys.path.append("/added/by/a/node")
    library.register({}, {}, ["/host/new", "/host/a"])
    assert sys.path == ["/host/new", "/host/a", "/added/by/a/node"]
    library.register({}, {}, None)  # (no news: nothing changes)
    assert sys.path == ["/host/new", "/host/a", "/added/by/a/node"]
