"""Which worker takes a job (host/choice.py): pure bookkeeping, so it is tested without a single worker."""

import itertools

from soma import Done, Graph, Node
from soma.local.host.choice import MAX_DEPTH, WorkerChoice
from soma.local.host.program import compile_program
from tests.nodes import AddOne


class Batches64(Node):
    max_batch = 64

    def forward_batch(self, xs, ctx):
        return Done(list(xs))


class Job:
    """What the choice reads of a job: its piece (and what it writes: its slot, the jobs it waits behind)."""

    def __init__(self, piece):
        self.piece, self.slot, self.behind = piece, None, 0


def piece_of(node):
    counter = itertools.count(1)
    return compile_program(Graph.somatize(node), lambda _: next(counter), ["cpu", "cpu"])


def fill(choice, piece, usable=(0, 1)) -> list:
    """Give `piece`'s jobs to workers until none takes another: how many each took."""
    depth = choice.depth(piece)
    while True:
        slot = choice.choose(piece, usable, depth)
        if slot is None:
            return list(choice.load)
        choice.take(Job(piece), slot)


def test_a_worker_holds_two_batches_of_a_batching_node_one_running_and_the_next_behind_it():
    piece = piece_of(Batches64())
    choice = WorkerChoice(["cpu", "cpu"])
    choice.admit([piece])
    assert fill(choice, piece) == [128, 128]  # with one batch's worth, a worker idled while the next one came
    assert not choice.has_room((0, 1))


def test_a_plain_piece_keeps_at_most_max_depth_jobs_at_a_worker():
    piece = piece_of(AddOne())
    choice = WorkerChoice(["cpu", "cpu"])
    choice.admit([piece])
    assert fill(choice, piece) == [MAX_DEPTH, MAX_DEPTH]
    assert not choice.has_room((0, 1))


def test_room_for_a_batching_node_is_room_once_its_piece_is_admitted():
    plain, batching = piece_of(AddOne()), piece_of(Batches64())
    choice = WorkerChoice(["cpu", "cpu"])
    choice.admit([plain])
    fill(choice, plain)
    assert not choice.has_room((0, 1))  # full for plain jobs: a pump looks no further
    choice.admit([batching])
    assert choice.has_room((0, 1))  # ... but a batching node's jobs still fit
    assert fill(choice, batching) == [128, 128]


def test_what_a_pieces_outputs_take_of_dev_shm_counts_a_larger_one_at_once_and_smaller_ones_slowly():
    # (a map's back-pressure by memory reads it: counting too little would fill /dev/shm)
    choice, piece = WorkerChoice(["cpu", "cpu"]), piece_of(AddOne())
    assert choice.shm_per_input([piece]) is None  # not measured: the map takes one input per worker
    choice.weigh(piece, None)  # (spilled: what it would take is not known)
    assert choice.shm_per_input([piece]) is None
    choice.weigh(piece, 1 << 20)
    choice.weigh(piece, 20 << 20)
    assert choice.shm_per_input([piece]) == 20 << 20
    choice.weigh(piece, 0)
    assert 10 << 20 < choice.shm_per_input([piece]) < 20 << 20
    for _ in range(100):
        choice.weigh(piece, 0)
    assert choice.shm_per_input([piece]) < 1 << 10  # (small outputs now: the map is bound by count alone)


def test_an_input_counts_what_the_host_copied_it_into_once_an_output_was_measured():
    choice, piece = WorkerChoice(["cpu", "cpu"]), piece_of(AddOne())
    choice.weigh(piece, 20 << 20, inputs=True)
    assert choice.shm_per_input([piece]) is None  # (no output yet: the map still takes one input per worker)
    choice.weigh(piece, 4 << 20)
    assert choice.shm_per_input([piece]) == 24 << 20
    # An output that came back holds its own room only (its input's copy was freed as it came): what a map's
    # window counts as no longer in flight for it. Of a program of two pieces, the smaller output (its last
    # piece's is one of them: counting more than that would fill /dev/shm).
    assert choice.shm_per_output([piece]) == 4 << 20
    other = piece_of(AddOne())
    assert choice.shm_per_output([piece, other]) == 4 << 20  # (the other not measured yet)
    choice.weigh(other, 1 << 20)
    assert choice.shm_per_output([piece, other]) == 1 << 20
    assert WorkerChoice(["cpu"]).shm_per_output([piece]) == 0  # (nothing measured: nothing counted back)


def test_a_chunk_of_a_piece_whose_values_travel_through_dev_shm_holds_at_most_chunk_shm_of_them():
    """A chunk's job holds its inputs until its last is done: chunks of large arrays would fill /dev/shm."""
    from soma.local.host.chunks import CHUNK_SHM

    choice, piece = WorkerChoice(["cpu", "cpu"]), piece_of(AddOne())
    job = Job(piece)
    job.sent_at = 0.0
    choice.measure(job, 1e-5, 0.0)  # (a piece's first job loads its code: not its pace)
    choice.measure(job, 1e-5, 0.0)
    cheap = choice.chunk(piece)
    assert cheap > 100  # 10 µs inputs with small values: many to a chunk
    choice.weigh(piece, 100 << 10)  # outputs of 100 KiB through /dev/shm
    assert choice.chunk(piece) == CHUNK_SHM // (100 << 10) < cheap
    choice.weigh(piece, 20 << 20, inputs=True)  # and inputs of 20 MiB
    assert choice.chunk(piece) == 1
