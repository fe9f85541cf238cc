"""The `soma` command: `soma --version`, `soma example`, `soma demo`, `soma bench NAME`."""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

from . import __version__


def _examples_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "examples"


def _run_example(name: str) -> int:
    path = _examples_dir() / f"{name}.py"
    if not path.exists():
        print(f"soma: the example {path} is not there (examples/ ships with the source checkout)", file=sys.stderr)
        return 2
    saved, sys.argv = sys.argv, [str(path)]  # the example sees its own argv, not the `soma` command's
    try:
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = saved
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soma", description="soma: a dataflow-graph engine for ML pipelines")
    parser.add_argument("--version", action="version", version=f"soma {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("example", help="run the seed example pipeline in-process (examples/pipeline.py)")
    sub.add_parser("demo", help="GIL-bound nodes: soma.Local against the in-process Executor (examples/gil_demo.py)")
    args = parser.parse_args(argv)
    if args.command == "example":
        return _run_example("pipeline")
    if args.command == "demo":
        return _run_example("gil_demo")
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
