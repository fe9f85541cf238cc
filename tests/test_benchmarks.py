"""The benchmarks still run: each module in its smallest mode (`--smoke`), and `soma bench`.

Not a timing test: it checks that every module finishes and writes records of the
documented shape with positive numbers, never what the numbers are.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from soma import cli
from tests.small_shm import why_no_small_shm

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
MODULES = ["gil_wave", "overhead", "tensor", "startup", "memory", "soma_ray", "map", "batching", "aio", "long_jobs",
           "shm"]
WITHOUT_RAY = importlib.util.find_spec("ray") is None
PLOTTED = {"map", "batching"}  # the modules whose --plot the smoke run draws too (serve's: tests/test_serve.py)
WITH_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
KEYS = {"benchmark", "contender", "params", "median", "min", "max", "unit", "n"}
SIGNED_UNITS = {"% growth", "MiB"}  # growth and memory deltas may be zero or negative; the rest must be > 0


def test_soma_bench_lists_the_benchmarks(capsys):
    assert cli.main(["bench"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in MODULES) and "_harness" not in listed
    assert cli.main(["bench", "no_such_benchmark"]) == 2
    assert "no benchmark named 'no_such_benchmark'" in capsys.readouterr().err


@pytest.mark.timeout(630)
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.skipif(
        name == "soma_ray" and WITHOUT_RAY, reason="soma_ray needs ray, which is not installed (pip install "
                                                   "'soma[ray]'); without it the module prints that it skipped"),
        pytest.mark.skipif(name == "shm" and why_no_small_shm() is not None,
                           reason=f"shm needs a 64 MiB /dev/shm of its own: {why_no_small_shm()}")])
    for name in MODULES])
def test_each_benchmark_writes_well_shaped_records(name, tmp_path):
    out = tmp_path / f"{name}.json"
    picture = tmp_path / f"{name}.png"
    drawn = name in PLOTTED and WITH_MATPLOTLIB  # (its sweep and figure too, where it draws one)
    done = subprocess.run([sys.executable, "-m", "soma.cli", "bench", name, "--smoke", "--json", str(out)] +
                          (["--plot", str(picture)] if drawn else []),
                          # a smoke takes 5-30 s quiet (soma_ray ~60 s); soma_ray's took over 300 s once with
                          # both cores busy beside the suite (its Ray start alone over 110 s): a bound on hanging
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| contender" in done.stdout  # the readable table
    records = json.loads(out.read_text())
    assert records and all(set(r) == KEYS for r in records)
    for r in records:
        assert r["benchmark"] == name and isinstance(r["params"], dict) and r["n"] >= 1
        assert r["min"] <= r["median"] <= r["max"], r
        if r["unit"] not in SIGNED_UNITS:
            assert r["min"] > 0 or r["unit"] == "% of a core", r
    assert len({r["contender"] for r in records} - {"machine"}) >= 2  # something was compared with something
    if drawn:
        assert picture.read_bytes().startswith(b"\x89PNG"), done.stdout[-2000:]
    if name == "map":  # issue 31's targets, each a line that says what was aimed at, what came out, and whether met
        lines = [line.strip() for line in done.stdout.splitlines() if ": target: " in line]
        assert len(lines) == 9, done.stdout[-4000:]
        assert all(re.search(r"target: (>=|<=) [\d.]+.*, measured: .*, (met|missed|not measured)$", line)
                   for line in lines), lines


def test_a_wrong_value_fails_the_benchmark_naming_the_contender():
    """What every benchmark's checks rest on: a wrong answer, or a held result changed later, is exit status 1
    with the contender's name; a right one passes."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import torch, _harness as h\n"
        "def main(argv):\n"
        "    h.expect('procpool', [0, 1, 2], [0, 1, 2])\n"
        "    held, t = h.Held(keep=2), torch.full((1000,), 7.0)\n"
        "    held.add('local/heap', lambda: h.expect_filled('local/heap', t, 7.0, 1000, 'held'))\n"
        "    if argv[-1] == 'overwrite':\n"
        "        t[500] = 8.0  # what a pool reusing the memory of a held result does to it\n"
        "    held.check_all()\n"
        "    if argv[-1] == 'wrong':\n"
        "        h.expect('mp_imap', [0, 1, 3], [0, 1, 2])\n"
        "    print('all right')\n"
        "h.cli(main)\n"
    )
    pytest.importorskip("torch")
    outcomes = {}
    for case in ("right", "overwrite", "wrong"):
        done = subprocess.run([sys.executable, "-c", code, str(BENCHMARKS), case], capture_output=True, text=True,
                              timeout=60)
        outcomes[case] = (done.returncode, done.stdout, done.stderr)
    assert outcomes["right"][0] == 0 and "all right" in outcomes["right"][1], outcomes["right"]
    assert outcomes["overwrite"][0] == 1, outcomes["overwrite"]
    assert "FAILED: local/heap returned a tensor that should hold 7 everywhere and holds values from 7 to 8" in \
        outcomes["overwrite"][2]
    assert outcomes["wrong"][0] == 1
    assert "FAILED: mp_imap returned wrong values: value 2 is 3, expected 2" in outcomes["wrong"][2]
