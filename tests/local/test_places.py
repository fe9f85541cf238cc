"""A chunk's places (soma/local/host/places.py: a Chunk's `open`, its Job's `pending`) against a plain set."""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from soma.local.host.places import Places  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(size=st.integers(0, 50), data=st.data())
def test_places_hold_exactly_what_a_set_would(size, data):
    start = data.draw(st.one_of(st.none(), st.sets(st.integers(0, max(0, size - 1)), max_size=size)))
    if size == 0 and start:
        start = set()
    places = Places(size, sorted(start) if start is not None else None)
    model = set(range(size)) if start is None else set(start)
    for _ in range(data.draw(st.integers(0, 20))):
        op = data.draw(st.sampled_from(["discard", "drop_run", "covers", "difference_update", "clear"]))
        a = data.draw(st.integers(-2, size + 2))
        b = data.draw(st.integers(a, size + 2))
        if op == "discard":
            places.discard(a)
            model.discard(a)
        elif op == "drop_run" and 0 <= a <= b <= size:
            places.drop_run(a, b)
            model.difference_update(range(a, b))
        elif op == "covers":
            assert places.covers(a, b) == (0 <= a and b <= size and model.issuperset(range(a, b)))
        elif op == "difference_update":
            places.difference_update([a, b])
            model.difference_update([a, b])
        elif op == "clear":
            places.clear()
            model.clear()
        assert list(places) == sorted(model) and len(places) == len(model) and bool(places) == bool(model)
        assert all((i in places) == (i in model) for i in range(-2, size + 3))
