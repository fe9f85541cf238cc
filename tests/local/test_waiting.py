"""The jobs waiting for a worker (host/dispatch.py, `Waiting`): a line per piece, first come first served within it."""

from soma.local.host.dispatch import Waiting


class Job:
    def __init__(self, piece, name):
        self.piece, self.name = piece, name

    def __repr__(self):
        return self.name


def names(waiting):
    return {piece: [job.name for job in line] for piece, line in waiting.snapshot()}


def test_each_piece_has_its_own_line_in_arrival_order_and_pieces_keep_the_order_they_came():
    waiting = Waiting()
    waiting.add([Job("b", "b1"), Job("a", "a1"), Job("b", "b2")])
    waiting.add([Job("a", "a2")])
    assert list(names(waiting).items()) == [("b", ["b1", "b2"]), ("a", ["a1", "a2"])]
    assert waiting.waiting("a") == 2 and waiting.waiting("b") == 2 and waiting.waiting("c") == 0


def test_jobs_handed_back_go_to_the_front_of_their_line_in_their_order():
    waiting = Waiting()
    waiting.add([Job("a", "a3")])
    waiting.add_first([Job("a", "a1"), Job("b", "b1"), Job("a", "a2")])
    assert names(waiting) == {"a": ["a1", "a2", "a3"], "b": ["b1"]}


def test_an_emptied_line_is_dropped_and_taking_a_line_removes_it():
    waiting = Waiting()
    waiting.add([Job("a", "a1"), Job("b", "b1")])
    (_, line), _ = waiting.snapshot()
    line.popleft()
    waiting.settle("a")
    waiting.settle("b")  # (not empty: kept)
    assert names(waiting) == {"b": ["b1"]}
    assert [job.name for job in waiting.take("b")] == ["b1"]
    assert not waiting and waiting.waiting("b") == 0
    assert list(waiting.take("b")) == []
