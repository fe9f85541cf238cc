import os

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on machines without one)")


@pytest.fixture(scope="module")
def local():
    """One warm pool of two workers shared by a test module (it heals after faults)."""
    import soma

    pool = soma.Local(workers=2)
    pool.start()
    yield pool
    pool.close()


def shm_names(prefix: str = "soma-") -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
