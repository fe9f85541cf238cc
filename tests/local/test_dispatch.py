"""Which worker takes a job (host/dispatch.py): pure bookkeeping, so it is tested without a single worker."""

import itertools

from soma import Done, Graph, Node
from soma.local.host.dispatch import Dispatch
from soma.local.host.flows import Flow, Job
from soma.local.host.measures import MAX_DEPTH, Measures
from soma.local.host.program import compile_program
from tests.nodes import AddOne


class Batches64(Node):
    max_batch = 64

    def forward_batch(self, xs, ctx):
        return Done(list(xs))


def piece_of(node):
    counter = itertools.count(1)
    return compile_program(Graph.somatize(node), lambda _: next(counter), ["cpu", "cpu"])


def dispatch_of(measures=None) -> Dispatch:
    return Dispatch(["cpu", "cpu"], measures or Measures())


def fill(dispatch, piece, n: int = 1000) -> list:
    """Queue `n` of `piece`'s jobs and pump: how many each worker took (the rest wait)."""
    flow = Flow(None, None, None, piece, None)
    dispatch.waiting.add([Job(i, flow, piece, None, i, {}) for i in range(1, n + 1)])
    dispatch.pump((0, 1), ())
    return list(dispatch.load)


def test_a_worker_holds_two_batches_of_a_batching_node_one_running_and_the_next_behind_it():
    piece = piece_of(Batches64())
    dispatch = dispatch_of()
    dispatch.admit([piece])
    assert fill(dispatch, piece) == [128, 128]  # with one batch's worth, a worker idled while the next one came
    assert not dispatch.has_room((0, 1))


def test_a_plain_piece_keeps_at_most_max_depth_jobs_at_a_worker():
    piece = piece_of(AddOne())
    dispatch = dispatch_of()
    dispatch.admit([piece])
    assert fill(dispatch, piece) == [MAX_DEPTH, MAX_DEPTH]
    assert not dispatch.has_room((0, 1))
    assert dispatch.pump((0, 1), ()) == []  # (nothing more goes: the rest wait in their line)
    assert len(dispatch.waiting.lines[piece]) == 1000 - 2 * MAX_DEPTH


def test_room_for_a_batching_node_is_room_once_its_piece_is_admitted():
    plain, batching = piece_of(AddOne()), piece_of(Batches64())
    dispatch = dispatch_of()
    dispatch.admit([plain])
    fill(dispatch, plain)
    assert not dispatch.has_room((0, 1))  # full for plain jobs: a pump looks no further
    dispatch.admit([batching])
    assert dispatch.has_room((0, 1))  # ... but a batching node's jobs still fit
    assert fill(dispatch, batching) == [128, 128]




def test_a_measured_piece_keeps_only_its_depth_of_jobs_at_each_worker():
    measures, piece = Measures(), piece_of(AddOne())
    job = Job(1, Flow(None, None, None, piece, None), piece, None, None, {})
    for seconds in (0.1, 0.1):  # (the first: its code loading, not its pace)
        measures.learn(job, seconds, 0.1 + 1e-4)  # jobs far longer than their way: one running, one waiting
    dispatch = dispatch_of(measures)
    dispatch.admit([piece])
    assert fill(dispatch, piece) == [2, 2]


def test_chunks_placed_in_one_pump_go_one_a_send_each_workers_first_before_any_second():
    """A worker starts on its first chunk while the host encodes the next ones: sent all in one Task, the
    second worker began ~1.8 ms into a 12 ms map of 20,000 tiny inputs."""
    from soma.local.host.flows import Chunk, Walker

    piece = piece_of(AddOne())
    dispatch, walker = dispatch_of(), Walker()
    dispatch.admit([piece])
    jobs = [walker.start_chunk(Chunk(k * 10, None, piece, list(range(10)))) for k in range(6)]
    dispatch.waiting.add(jobs)
    sends = dispatch.pump((0, 1), ())
    assert [len(sent) for _, sent, _ in sends] == [1] * 6  # (one chunk a Task)
    slots = [slot for slot, _, _ in sends]
    assert sorted(slots[:2]) == [0, 1] and sorted(slots) == [0, 0, 0, 1, 1, 1]  # each worker's first, first
    assert sorted(job.base for _, sent, _ in sends for job in sent) == sorted(job.base for job in jobs)


def test_a_batching_nodes_job_encoded_alone_and_sent_again_goes_alone_as_it_was_encoded():
    """A batching node's lone input goes encoded alone (sending.encode_alone: its value then lives in its spec,
    `value` is None). Its worker killed before starting it, it waits again, and the next pump sent it in a bundle
    with the inputs queued meanwhile: the bundle was encoded from `value`, and the node got None for it (a
    server's caller got None back, no error: 9 in 1,000 requests after a kill)."""
    from soma.local.host.dispatch import entries
    from soma.local.host.sending import encode
    from soma.wire import codec

    piece = piece_of(Batches64())
    flow = Flow(None, None, None, piece, None)
    lone = Job(1, flow, piece, None, "lone input", {})
    assert entries([lone]) == [[lone]]
    items, failed, _ = encode(lambda create=True: None, [[lone]])
    assert items == [lone] and not failed and lone.value is None  # (encoded alone: in its spec now)
    others = [Job(i, flow, piece, None, f"input {i}", {}) for i in (2, 3, 4)]
    groups = entries([lone, *others])  # (sent again, after its worker's death, with three that came meanwhile)
    assert [lone] in groups and sorted(j.id for g in groups for j in g) == [1, 2, 3, 4]
    items, failed, _ = encode(lambda create=True: None, groups)
    decoder = codec.Decoder(lambda create=True: None)
    seen = {}
    for item in items:
        if item is lone:
            seen[1] = decoder.unpack(item.spec[2])
        else:
            for job_id, value in zip(item.ids, decoder.unpack(item.packed.payload)):
                seen[job_id] = value
    assert seen == {1: "lone input", 2: "input 2", 3: "input 3", 4: "input 4"}
