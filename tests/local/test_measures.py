"""What the host learns of each piece from its outcomes (host/measures.py): pure, tested without a worker."""

import itertools

from soma import Done, Graph, Node
from soma.local.host.flows import Flow, Job
from soma.local.host.measures import DEPTH_SHM, MAX_DEPTH, Measures
from soma.local.host.program import compile_program
from tests.nodes import AddOne


class Batches(Node):
    max_batch = 4

    def forward_batch(self, xs, ctx):
        return Done(xs)


def piece_of(node):
    counter = itertools.count(1)
    return compile_program(Graph.somatize(node), lambda _: next(counter), ["cpu", "cpu"])


def test_what_a_pieces_outputs_take_of_dev_shm_counts_a_larger_one_at_once_and_smaller_ones_slowly():
    # (a map's back-pressure by memory reads it: counting too little would fill /dev/shm)
    measures, piece = Measures(), piece_of(AddOne())
    assert measures.shm_per_input([piece]) is None  # not measured: the map takes one input per worker
    measures.weigh(piece, None)  # (spilled: what it would take is not known)
    assert measures.shm_per_input([piece]) is None
    measures.weigh(piece, 1 << 20)
    measures.weigh(piece, 20 << 20)
    assert measures.shm_per_input([piece]) == 20 << 20
    measures.weigh(piece, 0)
    assert 10 << 20 < measures.shm_per_input([piece]) < 20 << 20
    for _ in range(100):
        measures.weigh(piece, 0)
    assert measures.shm_per_input([piece]) < 1 << 10  # (small outputs now: the map is bound by count alone)


def test_an_input_counts_what_the_host_copied_it_into_once_an_output_was_measured():
    measures, piece = Measures(), piece_of(AddOne())
    measures.weigh(piece, 20 << 20, inputs=True)
    assert measures.shm_per_input([piece]) is None  # (no output yet: the map still takes one input per worker)
    measures.weigh(piece, 4 << 20)
    assert measures.shm_per_input([piece]) == 24 << 20
    # An output that came back holds its own room only (its input's copy was freed as it came): what a map's
    # window counts as no longer in flight for it. Of a program of two pieces, the smaller output (its last
    # piece's is one of them: counting more than that would fill /dev/shm).
    assert measures.shm_per_output([piece]) == 4 << 20
    other = piece_of(AddOne())
    assert measures.shm_per_output([piece, other]) == 4 << 20  # (the other not measured yet)
    measures.weigh(other, 1 << 20)
    assert measures.shm_per_output([piece, other]) == 1 << 20
    assert Measures().shm_per_output([piece]) == 0  # (nothing measured: nothing counted back)


def test_a_chunk_of_a_piece_whose_values_travel_through_dev_shm_holds_at_most_chunk_shm_of_them():
    """A chunk's job holds its inputs until its last is done: chunks of large arrays would fill /dev/shm."""
    from soma.local.host.chunks import CHUNK_SHM

    measures, piece = Measures(), piece_of(AddOne())
    job = Job(1, Flow(None, None, None, piece, None), piece, None, None, {})
    measures.learn(job, 1e-5, 0.0)  # (a piece's first job loads its code: not its pace)
    measures.learn(job, 1e-5, 0.0)
    cheap = measures.chunk(piece)
    assert cheap > 100  # 10 µs inputs with small values: many to a chunk
    measures.weigh(piece, 100 << 10)  # outputs of 100 KiB through /dev/shm
    assert measures.chunk(piece) == CHUNK_SHM // (100 << 10) < cheap
    measures.weigh(piece, 20 << 20, inputs=True)  # and inputs of 20 MiB
    assert measures.chunk(piece) == 1


def test_a_chunk_of_tiny_inputs_holds_unweighed_fill_until_one_was_weighed_then_what_fits_chunk_bytes():
    """A chunk's inputs travel in one message: until one of the piece's chunks was encoded, no more than
    UNWEIGHED_FILL of them; then as many as take CHUNK_BYTES of it (a larger input counts at once), never more
    than a chunk's block of job ids (flows.MAX_CHUNK: a larger chunk's ids would be the next chunk's)."""
    from soma.local.host.chunks import CHUNK_BYTES, UNWEIGHED_FILL
    from soma.local.host.flows import MAX_CHUNK

    measures, piece = Measures(), piece_of(AddOne())
    job = Job(1, Flow(None, None, None, piece, None), piece, None, None, {})
    for _ in range(2):  # (a piece's first job loads its code: not its pace)
        measures.learn(job, 1e-7, 0.0)  # tiny inputs: the pace alone would make chunks of MAX_CHUNK
    assert measures.chunk(piece) == UNWEIGHED_FILL < MAX_CHUNK
    measures.weigh_message(piece, 3)  # small ints: 3 bytes each
    assert measures.chunk(piece) == MAX_CHUNK
    measures.weigh_message(piece, 32 << 10)  # strings of 32 KiB, inline
    assert measures.chunk(piece) == CHUNK_BYTES // (32 << 10) < UNWEIGHED_FILL
    measures.weigh_message(piece, 3)  # (a smaller one brings it down slowly)
    assert measures.chunk(piece) < UNWEIGHED_FILL


def test_a_pieces_depth_follows_its_pace_once_measured():
    """Jobs of microseconds keep many out at a worker while outcomes travel; long ones one running and one
    waiting; a program runs one input per worker until its pieces are measured."""
    measures, piece = Measures(), piece_of(AddOne())
    job = Job(1, Flow(None, None, None, piece, None), piece, None, None, {})
    assert measures.parallelism([piece], 2) == 2
    measures.learn(job, 1e-3, 1.0)  # (a piece's first job loads its code: not its pace)
    assert piece.id not in measures.depths
    measures.learn(job, 1e-5, 1e-3)  # 10 µs in the worker, ~1 ms there and back
    assert measures.depths[piece.id] == MAX_DEPTH
    assert measures.parallelism([piece], 2) == 2 * MAX_DEPTH
    for _ in range(50):
        measures.learn(job, 0.1, 0.1 + 1e-4)  # 100 ms in the worker, 0.1 ms there and back
    assert measures.depths[piece.id] == 2
    assert measures.parallelism([piece], 2) == 4


def test_jobs_out_at_a_worker_hold_at_most_depth_shm_of_dev_shm_beyond_two():
    """A large value's way is mostly the host copying it: measured as latency, it made a deep piece of a node of
    microseconds, and a map's window took 137 arrays of 20 MiB (2.7 GB of /dev/shm) ahead of a slow caller."""
    measures, piece = Measures(), piece_of(AddOne())
    job = Job(1, Flow(None, None, None, piece, None), piece, None, None, {})
    measures.weigh(piece, 20 << 20, inputs=True)  # the host copied its input into 20 MiB, its output took 20
    measures.learn(job, 1e-5, 1e-2, shm=20 << 20)  # (a first job: not its pace)
    measures.learn(job, 1e-5, 1e-2, shm=20 << 20)  # 10 µs in the worker, ~10 ms there and back (the copies)
    assert measures.depths[piece.id] == 2  # (64 MiB holds one such job: two out, one running, one waiting)
    assert measures.parallelism([piece], 2) == 4
    small = piece_of(AddOne())
    small_job = Job(2, Flow(None, None, None, small, None), small, None, None, {})
    measures.weigh(small, 1 << 20, inputs=True)
    for _ in range(2):
        measures.learn(small_job, 1e-5, 1e-2, shm=1 << 20)
    assert measures.depths[small.id] == DEPTH_SHM // (2 << 20) == 32
    batching = piece_of(Batches())  # max_batch 4: two batches of 1 MiB inputs and outputs take 16 MiB
    batch_job = Job(3, Flow(None, None, None, batching, None), batching, None, None, {})
    measures.weigh(batching, 1 << 20, inputs=True)
    for _ in range(2):
        measures.learn(batch_job, 1e-5, 1e-2, shm=1 << 20)
    assert measures.depths[batching.id] == 32  # (the cap, above two batches)
    measures.weigh(batching, 20 << 20, inputs=True)  # two batches of 20 MiB inputs: 160 MiB, more than DEPTH_SHM
    measures.learn(batch_job, 1e-5, 1e-2, shm=20 << 20)
    assert measures.depths[batching.id] == 4  # one full batch (they stay full), not two
    measures.weigh(batching, 3 << 20, inputs=True)  # (as a larger one counts at once, a smaller one slowly)
    measures.input_shm[batching.id] = measures.output_shm[batching.id] = 3 << 19  # 3 MiB a job: DEPTH_SHM holds 21
    measures.learn(batch_job, 1e-5, 1e-2)
    assert measures.depths[batching.id] == 20  # whole batches (21 ran a batch of one input after each of 4)
    measures.weigh(small, 0, inputs=True)  # (values in the message from now on: the cap eases as they shrink)
    for _ in range(200):
        measures.learn(small_job, 1e-5, 1e-2, shm=0)
    assert measures.depths[small.id] == MAX_DEPTH
