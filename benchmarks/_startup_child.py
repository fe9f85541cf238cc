"""One cold pool, from nothing to closed, for `startup.py`: it prints its phases as JSON.

    python benchmarks/_startup_child.py local|procpool|procpool_both [--torch]

A fresh process per measurement, so each contender pays for its own imports and
nothing is warm. The clock starts just before the contender's first import;
with --torch this program has imported torch before that (a user's program
usually has), which is not counted. Only the standard library is imported at the
top: a ProcessPoolExecutor child re-imports this file as its main module.
A wrong answer exits with status 1 and a message naming the contender, which
`startup.py` raises with.
"""

import json
import sys
import time

WORKERS = 2


def echo(x):
    return x


def expect(contender: str, got, expected) -> None:
    if got != expected:
        sys.exit(f"{contender} returned wrong values: got {got!r}, expected {expected!r}")


def local(start: float) -> dict:
    import soma

    imported = time.perf_counter()
    pool = soma.Local(workers=WORKERS)
    pool.start()
    started = time.perf_counter()
    expect("local", pool.run(soma.Graph.somatize(soma.fn(echo)), 41), 41)
    first = time.perf_counter()
    pool.close()
    closed = time.perf_counter()
    return {"import": imported - start, "start": started - imported, "first_result": first - started,
            "close": closed - first, "total": closed - start}


def procpool(start: float, tasks: int = 1) -> dict:
    """With spawn, the pool starts a child per submit that finds none idle: one task starts one
    child; `tasks=WORKERS` submitted at once start them all, as Local.start() does."""
    import concurrent.futures as cf
    import multiprocessing as mp

    imported = time.perf_counter()
    pool = cf.ProcessPoolExecutor(WORKERS, mp_context=mp.get_context("spawn"))
    futures = [pool.submit(echo, 41 + i) for i in range(tasks)]
    expect("procpool" if tasks == 1 else "procpool_both", [f.result() for f in futures],
           [41 + i for i in range(tasks)])
    first = time.perf_counter()
    pool.shutdown(wait=True)
    closed = time.perf_counter()
    return {"import": imported - start, "first_result": first - imported, "close": closed - first,
            "total": closed - start}


if __name__ == "__main__":
    which = sys.argv[1]
    if "--torch" in sys.argv:
        import torch  # noqa: F401

    contenders = {"local": local, "procpool": procpool, "procpool_both": lambda s: procpool(s, tasks=WORKERS)}
    phases = contenders[which](time.perf_counter())
    print(json.dumps(phases))
