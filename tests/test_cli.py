"""The `soma` command as a newcomer types it (issue 13): it does what it says or says what it expects."""

import subprocess
import sys

from tests.conftest import ROOT  # noqa: E402

# Runs `soma ARGS` in a Python where `import torch` fails exactly as it does where torch is not installed.
WITHOUT_TORCH = """
import sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTorch())
from soma.cli import main
sys.exit(main(sys.argv[1:]))
"""


def soma_command(*args, without_torch: bool = False) -> subprocess.CompletedProcess:
    prefix = ["-c", WITHOUT_TORCH] if without_torch else ["-m", "soma.cli"]
    return subprocess.run([sys.executable, *prefix, *args], capture_output=True, text=True, cwd=ROOT, timeout=60)


BENCHMARKS = ", ".join(sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_")))


def test_soma_bench_with_a_flag_and_no_name_says_what_it_expects():
    done = soma_command("bench", "--quick")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "soma: `soma bench --quick` names no benchmark: write `soma bench NAME --quick` or `soma bench all --quick` "
        f"(each in turn, minutes); benchmarks: {BENCHMARKS}\n")
    done = soma_command("bench", "--smoke", "--json", "out.json")
    assert done.returncode == 2 and "`soma bench all --smoke --json out.json`" in done.stderr
    assert not (ROOT / "out.json").exists()
    done = soma_command("bench")  # no flag either: that still lists them, a line each saying what it measures
    assert done.returncode == 0 and done.stdout.startswith("benchmarks (soma bench NAME; all: each in turn):\n")
    lines = done.stdout.splitlines()[1:-1]
    assert [line.split()[0] for line in lines] == BENCHMARKS.split(", ")
    assert all(len(line.split(None, 1)[1]) > 20 for line in lines), lines  # a sentence each, not just the name
    assert done.stdout.endswith("usage: soma bench NAME [--quick] [--smoke] [--json FILE] [--plot FILE.png]\n")


def test_soma_example_without_torch_says_it_needs_torch():
    done = soma_command("example", without_torch=True)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == ("soma example needs torch (it makes tensors on cpu and meta): "
                           "pip install torch==2.13.0 numpy\n")
