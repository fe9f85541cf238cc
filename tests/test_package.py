"""The package around the core: no torch on import, the command line, the example."""

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT  # noqa: E402


def run_python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_soma_does_not_import_torch():
    code = (
        "import sys, soma\n"
        "g = soma.Graph.somatize(soma.fn(len) >> soma.fn(str).on('meta'))\n"
        "assert g.run([1, 2]) == '2'\n"
        "print('torch' in sys.modules, 'zmq' in sys.modules)\n"
    )
    assert run_python(code).split() == ["False", "False"]


def test_soma_version():
    out = subprocess.run([sys.executable, "-m", "soma.cli", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0
    assert out.stdout.strip().startswith("soma ")


def test_soma_example_runs_the_seed_pipeline():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "soma.cli", "example"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tokenize >> (encoder | other) >> join" in out.stdout
    assert "'total_length': 16.0" in out.stdout and "'other_shape': (4, 8)" in out.stdout


def test_soma_demo_runs_local_against_the_executor(tmp_path):
    trace = tmp_path / "demo.json"
    out = subprocess.run([sys.executable, "-m", "soma.cli", "demo", "--trace", str(trace)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Executor (threads, one process)" in out.stdout and "Local    (" in out.stdout
    assert "speed-up:" in out.stdout and "soma.local.worker.main()' --tasks ipc://" in out.stdout
    ratio = (r"speed-up: \d+\.\d\dx, the median of 7 rounds \(each round's Executor time over Local's: \d+\.\d\dx to "
             r"\d+\.\d\dx\)\n  at most \dx when both meet the same machine: ")
    assert re.search("^" + ratio, out.stdout, re.M), out.stdout  # the wave
    assert "Executor.map (one input at a time)" in out.stdout and "Local.map    (" in out.stdout
    assert re.search("^map " + ratio, out.stdout, re.M), out.stdout
    assert re.search(r"where the inputs ran: w\d: \d", out.stdout), out.stdout
    assert "while it ran, other programs used " in out.stdout
    events = json.loads(trace.read_text())["traceEvents"]  # a timeline of Local's wave and map
    ran = {e["name"] for e in events if e.get("ph") == "X" and e.get("cat") == "node"}
    assert {"a", "b", "c", "d", "crunch_input"} <= ran, ran


def _soma_imports() -> dict:
    """module → the soma modules it imports, read with ast from soma/: every import statement, those inside
    functions included (a lazy import is still a dependency), a package meaning its `__init__`."""
    import ast
    from pathlib import Path

    root = Path(ROOT)
    files = {}
    for path in (root / "soma").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):  # (not its own packages)
                    graph[name].add(target)
    return graph


def _cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on_stack: set = set()
    found: list = []

    def visit(v) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_soma_has_no_import_cycle():
    """Calls go down: no soma module imports (at the top or inside a function) one that imports it back."""
    graph = _soma_imports()
    # (imports at the top and inside functions are both read)
    assert "soma.run.base" in graph["soma.run.executor"] and "soma.wire.nodecode" in graph["soma.run.registry"]
    assert _cycles(graph) == [], "import cycles among soma's modules (break each: a module below both, or " \
                                 "the dependency the other way)"
