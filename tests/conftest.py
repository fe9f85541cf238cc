"""What the tests share: one warm pool per module, and the helpers every multi-process test needs."""

import os
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository: scripts run from here see `tests.nodes`


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(why): needs a CUDA GPU; skipped, saying why, on machines without one")


def pytest_collection_modifyitems(config, items):
    if cuda_available():
        return
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None:
            why = marker.args[0] if marker.args else "it runs on a GPU"
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {why}"))


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def local():
    """One warm pool of two workers shared by a test module (it heals after faults)."""
    import soma

    pool = soma.Local(workers=2)
    pool.start()
    yield pool
    pool.close()


def shm_names(prefix: str = "soma-") -> set:
    """The shared-memory files whose names start with `prefix`."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def in_threads(func, count: int, seconds: float = 60.0) -> list:
    """`[func(0), ..., func(count - 1)]`, each called on a thread of its own, all at once.

    Fails if a thread is still running after `seconds` (naming how many), and raises
    the first exception a thread raised: never a silent pass over a hung or failed thread.
    """
    results: list = [None] * count
    errors: list = []

    def call(k):
        try:
            results[k] = func(k)
        except BaseException as exc:  # re-raised below, in the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(k,), daemon=True) for k in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = sum(thread.is_alive() for thread in threads)
    assert not hung, f"{hung} of {count} threads still running after {seconds} s"
    if errors:
        raise errors[0]
    return results


def wait_for(condition, seconds: float = 10.0, what: str = "condition") -> None:
    """Poll `condition()` until it holds; fail naming `what` after `seconds` (never sleep-and-hope)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")
