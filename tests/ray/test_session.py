"""The suite's own Ray (tests/conftest.py's SessionRay): how it runs soma's actors on a machine that CI shares
with other programs."""

from __future__ import annotations

import os

import pytest

import soma

pytestmark = pytest.mark.timeout(120)


def niceness(_):
    return os.getpriority(os.PRIO_PROCESS, 0)


def test_the_suites_ray_runs_its_actors_at_the_tests_own_priority(ray_runner):
    """Ray's default (nice 15) left every actor a few % of a core beside a busy program at nice 0: the suite sets
    conftest.RAY_WORKER_NICENESS before any Ray starts."""
    g = soma.Graph.somatize(soma.fn(niceness, name="niceness"))
    assert ray_runner.run(g, 0) == niceness(0), "an actor runs at another niceness than the test (see conftest)"
