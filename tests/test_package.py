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
    assert "speed-up:" in out.stdout and "-m soma.local.worker" in out.stdout
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
