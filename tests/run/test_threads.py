"""A worker's kept branch threads (soma.run.threads.KeptThreads): every call once, calls that need each other
at once, and no thread made per wave."""

from __future__ import annotations

import threading

import pytest

from soma.run.threads import KeptThreads, on_threads

pytestmark = pytest.mark.timeout(60)


def test_every_call_runs_once_in_order_over_many_waves():
    kept = KeptThreads()
    for wave in range(2000):
        ran = [0, 0, 0]

        def call(i, wave=wave, ran=ran):
            ran[i] += 1
            return (wave, i, sum(range(50 * i)))  # a little pure Python: the calls race for the GIL

        results = on_threads([lambda i=i: call(i) for i in range(3)], kept)
        assert results == [(True, (wave, i, sum(range(50 * i)))) for i in range(3)]
        assert ran == [1, 1, 1]
    # A kept thread whose call the caller ran meanwhile goes back to idle: threads are not made per wave.
    assert kept.made <= 4


def test_calls_that_wait_for_each_other_still_run_at_once():
    kept = KeptThreads()
    for _ in range(50):
        marks = [threading.Event(), threading.Event()]
        seen = {}

        def meet(i):
            marks[i].set()
            seen[i] = threading.get_ident()
            if not marks[1 - i].wait(10):  # blocked: the GIL is free, the other call's thread starts it
                raise TimeoutError(f"call {1 - i} never ran while call {i} waited")
            return i

        assert on_threads([lambda: meet(0), lambda: meet(1)], kept) == [(True, 0), (True, 1)]
        assert seen[0] != seen[1]


def test_a_failure_waits_for_its_siblings():
    kept = KeptThreads()
    done = threading.Event()

    def slow():
        done.wait(0.05)
        done.set()
        return "slow"

    def boom():
        raise ValueError("boom")

    results = on_threads([boom, slow], kept)
    assert results[0][0] is False and isinstance(results[0][1], ValueError)
    assert results[1] == (True, "slow") and done.is_set()


def test_nested_waves_never_wait_for_a_thread():
    kept = KeptThreads()
    inner_marks = [threading.Event(), threading.Event()]

    def inner(i):
        inner_marks[i].set()
        assert inner_marks[1 - i].wait(10), "the nested wave's branches did not run at once"
        return i

    def outer(i):
        if i == 0:
            return on_threads([lambda: inner(0), lambda: inner(1)], kept)
        return "other"

    results = on_threads([lambda: outer(0), lambda: outer(1)], kept)
    assert results == [(True, [(True, 0), (True, 1)]), (True, "other")]
