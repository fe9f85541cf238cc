"""`retries` and `errors=` on every runner (SPEC 7.4): a node's own exception and a timeout are never
retried; `retries` must be a count; `errors="yield"` puts each failure in its place. (Retries after a lost
worker or actor are the runners' own: tests/local/test_retries.py, tests/ray/checks_tries.py.)"""

import time

import pytest

from soma import Done, Graph, Node, NodeError, RunTimeout
from tests.nodes import FailOdd, RaiseCounting

pytestmark = pytest.mark.timeout(120)


class Slow(Node):
    def forward(self, x, ctx):
        time.sleep(x)
        return Done(x)


def test_a_node_exception_is_never_retried(runner, tmp_path):
    with pytest.raises(NodeError, match=r"^node `raise_counting` failed: ValueError: bad input 4"):
        runner.run(Graph.somatize(RaiseCounting(tmp_path)), 4, retries=3)
    assert open(tmp_path / "raised").read().count("x") == 1


def test_a_timeout_is_never_retried(runner):
    with pytest.raises(RunTimeout):
        runner.run(Graph.somatize(Slow()), 5, timeout=0.5, retries=3)
    assert runner.run(Graph.somatize(Slow()), 0) == 0  # the runner goes on


def test_retries_must_be_a_count(runner):
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match=r"^retries must be a number of tries beyond the first"):
            runner.run(Graph.somatize(Slow()), 0, retries=bad)


def test_errors_yield_puts_each_failure_in_its_place_and_goes_on(runner):
    g = Graph.somatize(FailOdd())
    for ordered in (True, False):
        out = list(runner.map(g, range(10), errors="yield", ordered=ordered))
        errs = sorted((e.index, str(e)) for e in out if isinstance(e, NodeError))
        assert errs == [(i, f"node `fail_odd` failed: ValueError: odd {i}") for i in (1, 3, 5, 7, 9)]
        values = [v for v in out if not isinstance(v, NodeError)]
        assert (values if ordered else sorted(values)) == [0, 2, 4, 6, 8]
        if ordered:
            assert [isinstance(v, NodeError) for v in out] == [i % 2 == 1 for i in range(10)]


def test_errors_must_be_raise_or_yield(runner):
    with pytest.raises(ValueError, match=r"^map's errors must be 'raise' or 'yield', got 'skip'$"):
        runner.map(Graph.somatize(FailOdd()), [1], errors="skip")


def test_checkpoint_every_must_be_seconds_with_or_without_a_checkpoint(runner):
    """It was checked only with `checkpoint=` (and NaN passed even then), where every other option of map is
    refused whatever else is given."""
    for bad in (-1, "x", float("nan"), True, None):
        with pytest.raises(ValueError, match=r"^map's checkpoint_every must be a number of seconds >= 0, got "):
            runner.map(Graph.somatize(FailOdd()), [2], checkpoint_every=bad)
    assert list(runner.map(Graph.somatize(FailOdd()), [2], checkpoint_every=0)) == [2]
