"""The `soma` command: `soma --version`, `soma example`, `soma demo`, `soma bench NAME`."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import __version__


def _beside_package(folder: str) -> Path:
    """examples/ and benchmarks/ sit beside the package in a source checkout (not in a wheel)."""
    return Path(__file__).resolve().parent.parent / folder


def _run_example(name: str, argv: list[str] = ()) -> int:
    path = _beside_package("examples") / f"{name}.py"
    if not path.exists():
        print(f"soma: the example {path} is not there (examples/ ships with the source checkout)", file=sys.stderr)
        return 2
    saved, sys.argv = sys.argv, [str(path), *argv]  # the example sees its own argv, not the `soma` command's
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as stop:  # the example's own exit status is the command's (2: it lacks what it needs)
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def _benchmark_names() -> list[str]:
    """The modules of benchmarks/ (helpers start with `_`)."""
    folder = _beside_package("benchmarks")
    return sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")) if folder.is_dir() else []


def _benchmark_summary(name: str) -> str:
    """What a benchmark measures and against whom: its docstring's first line, less the name (read, not run)."""
    import ast

    try:
        doc = ast.get_docstring(ast.parse((_beside_package("benchmarks") / f"{name}.py").read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first.split(":", 1)[1].strip() if first.startswith(f"{name}:") else first


def _run_bench(name: str | None, quick: bool, smoke: bool, json_path: str | None,
               plot_path: str | None = None) -> int:
    names = _benchmark_names()
    if not names:
        print(f"soma: the benchmarks folder {_beside_package('benchmarks')} is not there (benchmarks/ ships with the source "
              f"checkout)", file=sys.stderr)
        return 2
    flags = (["--quick"] if quick else []) + (["--smoke"] if smoke else [])
    json_flag = [] if not json_path else ["--json"] if json_path == "-" else ["--json", json_path]
    given = " ".join(flags + json_flag + (["--plot", plot_path] if plot_path else []))
    if name is None and given:
        # A flag is an order to run something: never ignore it by listing (docs/design.md says why not run all).
        print(f"soma: `soma bench {given}` names no benchmark: write `soma bench NAME {given}` or "
              f"`soma bench all {given}` (each in turn, minutes); benchmarks: {', '.join(names)}", file=sys.stderr)
        return 2
    if name not in names + ["all"]:
        out = sys.stdout if name is None else sys.stderr
        if name is not None:
            print(f"soma: no benchmark named {name!r}", file=out)
        print("benchmarks (soma bench NAME; all: each in turn):", file=out)
        width = max(map(len, names))
        for each in names:
            print(f"  {each:{width}}  {_benchmark_summary(each)}", file=out)
        print("usage: soma bench NAME [--quick] [--smoke] [--json [FILE]] [--plot FILE.png]", file=out)
        return 0 if name is None else 2
    if name != "all":
        return _run_one_benchmark(name, flags + json_flag + (["--plot", plot_path] if plot_path else []))
    if plot_path:
        print("soma: --plot draws one benchmark's figures: name it (`soma bench serve --plot serve.png`)",
              file=sys.stderr)
        return 2
    return _run_all_benchmarks(names, flags, json_path)


def _run_one_benchmark(name: str, argv: list[str], stdout=None) -> int:
    # Its own process, exactly as `python benchmarks/NAME.py` runs it: a process pool's spawned
    # children re-import the main script by path, and one benchmark's imports (torch) and pools
    # must not colour the next one's figures.
    script = _beside_package("benchmarks") / f"{name}.py"
    sys.stdout.flush()
    return subprocess.call([sys.executable, str(script), *argv], stdout=stdout)


def _run_all_benchmarks(names: list[str], flags: list[str], json_path: str | None) -> int:
    records, took, failed = [], {}, []
    machines = json_path == "-"  # (stdout is the JSON alone: the benchmarks' tables go to stderr)
    say = sys.stderr if machines else sys.stdout
    with tempfile.TemporaryDirectory(prefix="soma-bench-") as tmp:
        for name in names:
            print(f"\n== soma bench {name} {' '.join(flags)}".rstrip(), file=say, flush=True)
            part = os.path.join(tmp, f"{name}.json")
            start = time.perf_counter()
            code = _run_one_benchmark(name, flags + ["--json", part], stdout=sys.stderr if machines else None)
            took[name] = time.perf_counter() - start
            if code != 0 or not os.path.exists(part):
                failed.append(name)
                continue
            with open(part) as f:
                part_records = json.load(f)
            # (a benchmark whose --json is a summary of its own, such as serve's, joins as one entry)
            records.extend(part_records if isinstance(part_records, list) else [{"benchmark": name,
                                                                                 "summary": part_records}])
    print("\n" + ", ".join(f"{n} {s:.0f} s" for n, s in took.items()) + f"; all {sum(took.values()):.0f} s",
          file=say)
    if machines:
        json.dump(records, sys.stdout, indent=1)
        print()
    elif json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {json_path}")
    if failed:
        print(f"soma: these benchmarks failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="soma", description="soma: a dataflow-graph engine for ML pipelines")
    parser.add_argument("--version", action="version", version=f"soma {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("example", help="run the seed example pipeline in-process (examples/pipeline.py)")
    demo = sub.add_parser("demo", help="GIL-bound nodes: soma.Local against the in-process Executor "
                                       "(examples/gil_demo.py)")
    demo.add_argument("--trace", metavar="FILE", help="also write a timeline of Local's runs to FILE (Perfetto)")
    bench = sub.add_parser("bench", help="run a benchmark of benchmarks/ (no NAME: list them; all: every one)")
    bench.add_argument("name", nargs="?", help="the benchmark to run, or all")
    bench.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute each)")
    bench.add_argument("--smoke", action="store_true", help="the smallest run that exercises every path")
    bench.add_argument("--json", metavar="FILE", nargs="?", const="-",
                       help="write one record per measurement to FILE (no FILE: to stdout, for machines)")
    bench.add_argument("--plot", metavar="FILE.png", help="draw the benchmark's figures (serve, map, batching; needs "
                                                             "matplotlib)")
    args = parser.parse_args(argv)
    if args.command == "example":
        return _run_example("pipeline")
    if args.command == "demo":
        return _run_example("gil_demo", ["--trace", args.trace] if args.trace else [])
    if args.command == "bench":
        return _run_bench(args.name, args.quick, args.smoke, args.json, args.plot)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
