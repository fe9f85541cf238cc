"""soma.ray.gathering without Ray: a fake `submit_many` records every group it is given."""

from __future__ import annotations

import threading

import pytest

from soma.ray.gathering import Gathering
from tests.conftest import in_threads

pytestmark = pytest.mark.timeout(60)


class Recorder:
    """A `submit_many` that returns one token per item and remembers the groups; `refuse` makes it fail a group
    of more than one that holds that input, and any group holding `bad`."""

    def __init__(self, refuse=None):
        self.groups: list = []
        self.lock = threading.Lock()
        self.refuse = refuse

    def __call__(self, items, trace, retries):
        xs = [x for _, x in items]
        with self.lock:
            self.groups.append(xs)
        if self.refuse is not None and self.refuse in xs:
            raise ValueError(f"cannot send {self.refuse}")
        return [("sub", x, trace, retries) for x in xs]


def test_a_run_alone_is_submitted_at_once_without_waiting():
    gathering, submit = Gathering(wait_s=30.0, most=8), Recorder()
    assert gathering.submit(submit, 1, None, 0) == [("sub", 1, None, 0)]  # (a 30 s wait would time the test out)
    gathering.over()
    assert submit.groups == [[1]] and gathering.active == 0


def test_runs_that_find_others_in_flight_meet_in_one_group():
    gathering, submit = Gathering(wait_s=2.0, most=64), Recorder()  # (room for 12 threads to start, loaded)
    first = gathering.submit(submit, "first", None, 0)  # in flight until `over`
    out = in_threads(lambda k: gathering.submit(submit, k, None, 0), 12)
    assert [o[0][1] for o in out] == list(range(12))  # each its own submission back
    assert submit.groups[0] == ["first"]
    assert sorted(x for group in submit.groups[1:] for x in group) == list(range(12))
    assert len(submit.groups) < 13 and max(len(g) for g in submit.groups) > 1, submit.groups
    for _ in range(13):
        gathering.over()
    assert first == [("sub", "first", None, 0)] and gathering.active == 0


def test_a_full_group_goes_before_its_wait_is_over():
    gathering, submit = Gathering(wait_s=30.0, most=4), Recorder()
    gathering.submit(submit, "first", None, 0)
    out = in_threads(lambda k: gathering.submit(submit, k, None, 0), 4, seconds=20)  # (not 30 s: full at 4)
    assert sorted(o[0][1] for o in out) == [0, 1, 2, 3]
    assert sorted(submit.groups[1]) == [0, 1, 2, 3]


def test_a_group_refused_as_a_whole_is_sent_member_by_member_each_with_its_own_answer():
    gathering, submit = Gathering(wait_s=0.5, most=64), Recorder(refuse=3)
    gathering.submit(submit, "first", None, 0)
    results = {}

    def one(k):
        try:
            results[k] = gathering.submit(submit, k, None, 0)[0][1]
        except ValueError as err:
            results[k] = str(err)

    in_threads(one, 6)
    assert results == {0: 0, 1: 1, 2: 2, 3: "cannot send 3", 4: 4, 5: 5}
    assert gathering.active == 1 + 5  # the refused run is no longer counted; the others are, until `over`


def test_runs_of_other_retries_or_trace_blocks_do_not_share_a_group():
    gathering, submit = Gathering(wait_s=0.3, most=64), Recorder()
    gathering.submit(submit, "first", None, 0)
    in_threads(lambda k: gathering.submit(submit, k, None, k % 2), 8)
    for group in submit.groups[1:]:
        assert len({x % 2 for x in group}) == 1, submit.groups  # one retries count per group


class Interrupted(BaseException):
    """Stands for a Ctrl-C in the thread that submits a group."""


def test_an_interrupted_submission_leaves_no_run_counted_and_no_member_waiting():
    gathering = Gathering(wait_s=0.3, most=64, node="embed")
    first_submit = Recorder()
    gathering.submit(first_submit, "first", None, 0)
    dropped = []

    def interrupted_submit(items, trace, retries):
        raise Interrupted()

    outcomes = {}

    def one(k):
        try:
            outcomes[k] = gathering.submit(interrupted_submit, k, None, 0, drop=dropped.append)
        except Interrupted:
            outcomes[k] = "interrupted"
        except Exception as err:  # the other members: told their group could not be submitted, and why
            assert "batching node `embed`" in str(err) and "run it again" in str(err), err
            outcomes[k] = type(err).__name__

    in_threads(one, 4)
    assert sorted(outcomes) == [0, 1, 2, 3]
    assert sorted(outcomes.values()).count("interrupted") == 1, outcomes  # only the leader was interrupted
    assert all(v in ("interrupted", "SomaError") for v in outcomes.values()), outcomes
    assert dropped == []  # nothing was submitted, so nothing to drop
    gathering.over()  # "first"
    assert gathering.active == 0
