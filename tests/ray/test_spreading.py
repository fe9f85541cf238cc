"""The cost model that decides when a map's heavy inputs get another copy on Ray (soma.ray.spreading): pure,
tested without Ray. The map itself, in the real Ray, is checked by tests/ray/checks_batching.py."""

from __future__ import annotations

from types import SimpleNamespace

from soma.ray.spreading import (
    STARTUP_PRIOR_S,
    STARTUPS_KEPT,
    copy_pays,
    input_cost,
    measured,
    startup_estimate,
)


def test_a_copy_pays_only_when_the_last_held_input_would_wait_longer_than_a_start_up():
    # issue 32: four 0.5 s inputs, one warm copy running the first; the last held one starts at 1.5 s
    assert copy_pays(held=3, cost=0.5, busy=[0.5], copies=1, startup=1.1)
    assert not copy_pays(held=3, cost=0.5, busy=[0.5], copies=1, startup=1.6)  # a slow start-up: the warm copy
    assert not copy_pays(held=2, cost=0.5, busy=[0.5], copies=1, startup=1.1)  # starts the last at 1.0 s
    # six 2 s inputs: five held behind the first; a second copy pays whatever a start-up costs here
    assert copy_pays(held=5, cost=2.0, busy=[2.0], copies=1, startup=STARTUP_PRIOR_S)


def test_copies_that_are_free_or_finishing_soon_take_the_held_inputs_first():
    assert not copy_pays(held=2, cost=0.5, busy=[0.5], copies=3, startup=0.1)  # two idle copies take them now
    assert copy_pays(held=2, cost=1.0, busy=[1.0, 1.0], copies=2, startup=0.5)  # both busy for a second
    assert not copy_pays(held=2, cost=1.0, busy=[0.1, 0.2], copies=2, startup=0.5)  # both nearly done


def test_inputs_held_for_longer_than_a_start_up_get_a_copy_whatever_the_window_shows():
    # a long map (or one over a generator) shows only its window: one that kept inputs waiting that long goes on
    assert copy_pays(held=1, cost=0.06, busy=[0.06], copies=1, startup=1.0, waited=1.2)
    assert not copy_pays(held=1, cost=0.06, busy=[0.06], copies=1, startup=1.0, waited=0.8)
    assert not copy_pays(held=0, cost=0.06, busy=[0.06], copies=1, startup=1.0, waited=9.0)


def test_nothing_held_or_no_cost_known_starts_nothing():
    assert not copy_pays(held=0, cost=9.0, busy=[9.0], copies=1, startup=0.1)
    assert not copy_pays(held=4, cost=0.0, busy=[], copies=1, startup=0.1)


def test_an_unknown_cost_is_at_least_how_long_an_input_has_run_on_a_copy_that_is_up():
    assert input_cost(0.3, [10.0], now=20.0) == 0.3  # known: the graph's measure
    assert input_cost(None, [18.5, 19.0, None], now=20.0) == 1.5  # the longest-running one that is up
    assert input_cost(None, [None], now=20.0) == 0.0  # nothing runs yet: nothing is known


def test_start_up_is_the_nodes_own_latest_measures_else_other_nodes_else_the_prior():
    assert startup_estimate([], []) == (STARTUP_PRIOR_S, "prior")
    assert startup_estimate([], [1.0, 3.0]) == (2.0, "measured on other nodes")
    own = [9.0] + [1.0] * STARTUPS_KEPT  # only the latest count: the machine's load changes
    assert startup_estimate(own, [5.0]) == (1.0, "measured")


def test_the_cost_falls_at_once_and_rises_by_a_tenth_of_the_gap():
    graph = SimpleNamespace(cost=None)
    measured(graph, 1.0)
    assert graph.cost == 1.0
    measured(graph, 2.0)
    assert graph.cost == 1.1
    measured(graph, 0.5)
    assert graph.cost == 0.5
