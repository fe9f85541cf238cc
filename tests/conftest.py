"""What the tests share: one warm pool per module, and the helpers every multi-process test needs."""

import os
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


def wait_for(condition, seconds: float = 10.0, what: str = "condition") -> None:
    """Poll `condition()` until it holds; fail naming `what` after `seconds` (never sleep-and-hope)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")
