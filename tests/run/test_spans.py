"""The map loop with a runner that reports consecutive outputs at once (`Span`s, as Local's chunks do).

An in-memory in-flight set stands for the runner: it finishes inputs in the order and the groups a test asks
for, as Spans, single outcomes or failures, so every way a chunk's outputs can come back is driven here
without processes.
"""

from __future__ import annotations

import pytest

from soma import Done, Graph, Node
from soma.errors import NodeError
from soma.run.mapping import Inflight, Span, map_outputs


class Tag(Node):
    def forward(self, x, ctx):
        return Done(x)


class Spans(Inflight):
    """Finishes started inputs `group` at a time, each group as one Span (in reverse order of groups when
    `backwards`); the inputs of `failing` fail alone."""

    def __init__(self, group: int, backwards: bool = False, failing=()):
        self.group, self.backwards, self.failing = group, backwards, set(failing)
        self.started, self.closed = [], False

    def parallelism(self) -> int:
        return 8

    def start(self, indices: list, xs: list) -> None:
        self.started += zip(indices, xs)

    def wait(self, timeout):
        items, self.started = self.started, []
        out = []
        for first in range(0, len(items), self.group):
            run = items[first:first + self.group]
            ok = [(i, x) for i, x in run if i not in self.failing]
            for i, _ in run:
                if i in self.failing:
                    out.append((i, False, NodeError.failed("f", f"input {i} is bad")))
            # consecutive ok ones as Spans
            start = 0
            for k in range(1, len(ok) + 1):
                if k == len(ok) or ok[k][0] != ok[k - 1][0] + 1:
                    if start < k:
                        out.append((ok[start][0], True, Span(x * 10 for _, x in ok[start:k])))
                    start = k
        return out[::-1] if self.backwards else out

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("group", [1, 3, 7, 64])
@pytest.mark.parametrize("backwards", [False, True])
def test_spans_are_handed_out_one_by_one_in_order(group, backwards):
    out = list(map_outputs(Spans(group, backwards), range(100), graph=None, window=16))
    assert out == [x * 10 for x in range(100)]


@pytest.mark.parametrize("group", [1, 5])
def test_an_unordered_map_of_spans_gives_every_output_once(group):
    out = list(map_outputs(Spans(group, backwards=True), range(50), graph=None, window=16, ordered=False))
    assert sorted(out) == [x * 10 for x in range(50)]


def test_a_failure_between_spans_is_raised_in_its_place_with_its_index():
    got = []
    with pytest.raises(NodeError, match="input 13 is bad") as info:
        for value in map_outputs(Spans(5, failing={13}), range(40), graph=None, window=16):
            got.append(value)
    assert info.value.index == 13
    assert got == [x * 10 for x in range(13)]


def test_yielded_failures_keep_their_own_index_between_spans():
    out = list(map_outputs(Spans(4, backwards=True, failing={2, 3, 9}), range(12), graph=None, window=12,
                           errors="yield"))
    assert [o.index for o in out if isinstance(o, NodeError)] == [2, 3, 9]
    assert [o for o in out if not isinstance(o, NodeError)] == [x * 10 for x in range(12) if x not in (2, 3, 9)]


def test_state_dict_in_the_middle_of_a_span_counts_what_was_handed_out():
    g = Graph.somatize(Tag())
    it = map_outputs(Spans(10), range(30), graph=g, window=30)
    for _ in range(4):
        next(it)
    assert it.state_dict()["next"] == 4  # (the output in hand counts as consumed)
    rest = list(map_outputs(Spans(10), range(30), graph=g, window=30, resume=it.state_dict()))
    it.close()
    assert rest == [x * 10 for x in range(4, 30)]


def test_leaving_in_the_middle_of_a_span_closes_the_runner_once():
    inflight = Spans(10)
    it = map_outputs(inflight, range(30), graph=None, window=30)
    assert [next(it) for _ in range(3)] == [0, 10, 20]
    it.close()
    assert inflight.closed


@pytest.mark.parametrize("kind", [list, tuple, lambda xs: xs, iter, lambda xs: (x for x in xs)])
@pytest.mark.parametrize("count", [0, 1, 16, 32, 33])
def test_every_kind_of_source_ends_the_map_where_it_ends(kind, count):
    # Plain sequences (list, tuple, range) are taken from without a guard: their end is found by a short take,
    # also when it falls on the window's edge (16) or on a multiple of it.
    xs = kind(range(count))
    assert list(map_outputs(Spans(3), xs, graph=None, window=16)) == [x * 10 for x in range(count)]
    assert sorted(map_outputs(Spans(3), kind(range(count)), graph=None, window=16, ordered=False)) == [
        x * 10 for x in range(count)]


@pytest.mark.parametrize("progress", [False, True])  # (True: each value's books kept as it goes; else by the span)
def test_state_dict_after_every_output_counts_each_one_through_spans(progress, capsys):
    g = Graph.somatize(Tag())
    it = map_outputs(Spans(10), range(30), graph=g, window=30, progress=progress)
    states = []
    for value in it:
        states.append(it.state_dict()["next"])
        if value == 240:
            break
    assert states == list(range(1, 26))
    it.close()
    assert it.state_dict()["next"] == 25  # left holding the 25th: it counts (its loop body ran)
    rest = list(map_outputs(Spans(10), range(30), graph=g, window=30, resume=it.state_dict()))
    assert rest == [x * 10 for x in range(25, 30)]
