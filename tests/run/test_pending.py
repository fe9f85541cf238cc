"""MapLoop's pending indices (soma/run/pending.py) against a plain set, in random sequences of what a map does:
runs of ascending indices added (with gaps, as a resumed map's), single indices and runs finished in any
order, the oldest looked up; and the finished stretch cut off as the map goes on."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from soma.run import pending as pending_module  # noqa: E402
from soma.run.pending import Pending  # noqa: E402

steps = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 40), st.booleans()),  # gap, count, with holes
    st.tuples(st.just("discard"), st.integers(-5, 400), st.just(0), st.just(False)),
    st.tuples(st.just("run"), st.integers(-5, 400), st.integers(0, 60), st.just(False)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(steps=steps)
def test_pending_holds_exactly_what_a_set_would(steps):
    pending, model, top = Pending(keep=8), set(), 0  # (cut off often: the offset is exercised)
    for op, a, b, holes in steps:
        if op == "add":
            first = top + a
            indices = [first + i for i in range(b) if not (holes and i % 3 == 1)]
            pending.add(indices)
            model.update(indices)
            top = indices[-1] + 1
        elif op == "discard":
            pending.discard(a)
            model.discard(a)
        else:
            pending.discard_run(a, b)
            model.difference_update(range(a, a + b))
        assert len(pending) == len(model) and bool(pending) == bool(model)
        assert pending.oldest() == (min(model) if model else None)
        assert all(i in pending for i in model)
        assert not any(i in pending for i in range(-5, top + 5) if i not in model)


def test_pending_refuses_an_index_below_one_added_before():
    pending = Pending()
    pending.add([5, 6, 7])
    with pytest.raises(ValueError, match="index 6 added below"):
        pending.add([6])


def test_pending_keeps_only_the_stretch_from_the_oldest_pending_index():
    pending = Pending()
    for first in range(0, 100_000, 1000):
        pending.add(list(range(first, first + 1000)))
        if first:
            pending.discard_run(first - 1000, 1000)
    assert len(pending) == 1000 and pending.oldest() == 99_000
    assert len(pending.bits) <= 2 * pending_module.KEEP + 1000
