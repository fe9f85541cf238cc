"""The protocol on its own: every message both ways, sealing, piece specs and error bodies."""

import logging
import pickle

import pytest

from soma import NodeError, PostconditionError, SharedMemoryFull
from soma.plan import Seq, Step, Wave
from soma.wire import failures, protocol
from soma.wire.protocol import (
    Bundle,
    Cancel,
    Chunk,
    ChunkPart,
    Free,
    GiveBack,
    Hello,
    JobSpec,
    Outcome,
    Result,
    Stop,
    Task,
)

SECRET = b"s" * 32


@pytest.mark.parametrize("message", [
    Hello("w0", 1234, "cuda:1"),
    Task({7: b"code"}, {3: b"spec"}, [JobSpec(1, 3, b"\x01", False), JobSpec(2, 3, b"\x02", True)], [["seg", 2]], [5]),
    Task({}, {}, [Bundle([4, 0, 6], 3, b"\x93\x01\x02\x03"), JobSpec(7, 3, b"\x01", [2])], [], [], 60 << 20, 2.0),
    Result("w1", 99, [Outcome(1, True, b"\x01", None, 0.5),
                      Outcome(2, False, {"node": "a", "message": "m", "kind": "node"}, [["a", 1, 2, 3, "ok"]], 0.1)],
           [["seg", 1]]),
    Result("w1", 99, [Outcome([4, 6, 8], [True, b"\x05", {"node": "a", "message": "m", "kind": "node"}], b"\x91\x01",
                              None, 0.01)], []),
    Task({}, {}, [Chunk([4, 0, 6], 3, b"\x93\x01\x02\x03", [[0], False, [2]]), JobSpec(7, 3, b"\x01", False)], [], []),
    Result("w1", 99, [ChunkPart([4, 6], [True, {"node": "a", "message": "m", "kind": "node"}], b"\x91\x01",
                                [[["a", 1, 2, 3, "ok"]], None], [0.01, 0.02], True),
                      Outcome(7, True, b"\x01", None, 0.5)], [], False, [8, 9]),
    Task({}, {}, [Chunk(range(1 << 48, (1 << 48) + 1024), 3, b"\x90", False)], [], []),
    Result("w1", 99, [ChunkPart(range(5, 9), None, b"\x94\x01\x02\x03\x04", None, 0.01, False)], [], False, []),
    Free([["seg", 3]]),
    Cancel([1, 2, 3]),
    GiveBack([4, 6]),
    Stop(),
], ids=lambda m: type(m).__name__)
def test_every_message_round_trips_as_the_same_record(message):
    back = protocol.parse(SECRET, protocol.pack(SECRET, message), "test")
    assert type(back) is type(message) and back == message


def test_consecutive_ids_travel_as_a_range_of_two_integers_and_nothing_else_packs():
    many = range(1 << 48, (1 << 48) + 1024)  # a chunk's: 9 KiB as a list
    frame = protocol.pack(SECRET, Task({}, {}, [Chunk(many, 3, b"\x90", False)], [], []))
    assert len(frame) < 100
    back = protocol.parse(SECRET, frame, "test").jobs[0]
    assert type(back) is Chunk and type(back.ids) is range and back.ids == many
    for other in (range(0, 10, 2), {1, 2}, object()):  # (a step, or a type the protocol does not know)
        with pytest.raises(TypeError, match="a message cannot hold"):
            protocol.pack(SECRET, Cancel(other))


def test_a_worker_reads_the_task_the_host_packs_field_by_field():
    task = Task({}, {}, [JobSpec(11, 4, b"payload", False)], [], [])
    back = protocol.parse(SECRET, protocol.pack(SECRET, task), "test")
    job = back.jobs[0]
    assert (job.id, job.piece, job.payload, job.traced) == (11, 4, b"payload", False)


@pytest.mark.parametrize("frame, why", [
    (protocol.pack(b"other" * 8, Stop()), "failed authentication"),
    (b"short", "shorter than its 16-byte seal"),
    (protocol.pack(SECRET, Stop())[:-1] + b"\x00", "failed authentication"),
], ids=["wrong-secret", "too-short", "tampered"])
def test_frames_that_do_not_authenticate_are_dropped_and_logged(frame, why, caplog):
    protocol._dropped.last = float("-inf")
    with caplog.at_level(logging.WARNING, logger="soma.wire.protocol"):
        assert protocol.parse(SECRET, frame, "test") is None
    assert why in caplog.text


def test_authentic_but_undecodable_or_unknown_messages_are_dropped(caplog):
    def sealed(body):
        return protocol.mac(SECRET, body) + body

    with caplog.at_level(logging.WARNING, logger="soma.wire.protocol"):
        for frame, why in [(sealed(b"\xc1"), "did not decode"),
                           (sealed(b"\x91\x63"), "unknown shape"),  # [99]
                           (sealed(b"\x92\x03\xa2w0"), "did not decode"),  # a Result without its fields
                           (sealed(b"\x92\x05\xd4\x07\x00"), "did not decode")]:  # an ext it does not know
            protocol._dropped.last = float("-inf")
            assert protocol.parse(SECRET, frame, "test") is None
            assert why in caplog.text


def test_a_flood_of_bad_frames_is_logged_once_with_a_count(caplog):
    protocol._dropped.last = float("-inf")
    protocol._dropped.since = 0
    with caplog.at_level(logging.WARNING, logger="soma.wire.protocol"):
        for _ in range(1000):
            protocol.parse(SECRET, b"x" * 40, "a flood")
    assert caplog.text.count("dropped") == 1
    protocol._dropped.last -= protocol._DropLog.INTERVAL_S  # the interval has passed: the next says how many
    with caplog.at_level(logging.WARNING, logger="soma.wire.protocol"):
        protocol.parse(SECRET, b"x" * 40, "a flood")
    assert "(and 999 more dropped since the last report)" in caplog.text


def test_piece_specs_carry_the_plan_keys_and_devices():
    plan = Seq((Step("a"), Wave((Step("b"), Seq((Step("c"), Step("d")))))))
    keys = {"a": 1, "b": 2, "c": 3, "d": 4}
    spec = protocol.pack_piece(plan, keys, {"b": "meta"})
    back, steps = protocol.parse_piece(spec)
    assert back == plan
    assert steps == {"a": (1, None), "b": (2, "meta"), "c": (3, None), "d": (4, None)}


def test_error_bodies_rebuild_the_same_error():
    try:
        raise ValueError("boom")
    except ValueError as exc:
        err = NodeError.failed("enc", "ValueError: boom", remote_traceback="Traceback ...")
        err.__cause__ = exc
    back = failures.error_from(failures.error_body(err))
    assert type(back) is NodeError and str(back) == "node `enc` failed: ValueError: boom" and back.node == "enc"
    assert isinstance(back.__cause__, ValueError) and back.remote_traceback == "Traceback ..."
    post = failures.error_from(failures.error_body(PostconditionError("enc", "meta", "cpu")))
    assert type(post) is PostconditionError and (post.declared, post.actual) == ("meta", "cpu")
    full = failures.error_from(failures.error_body(SharedMemoryFull.reserving("enc", 1 << 20, "its output")))
    assert type(full) is SharedMemoryFull and "1.0 MiB in /dev/shm for its output" in str(full)
    assert pickle.loads(pickle.dumps(back)).node == "enc"


def test_many_pools_secrets_are_not_all_kept_and_each_still_seals():
    """The MAC starts from a cached keyed hash per secret; a process that makes many pools keeps few."""
    import os

    secrets = [os.urandom(32) for _ in range(100)]
    frames = [protocol.pack(secret, protocol.Free([["seg", i]])) for i, secret in enumerate(secrets)]
    for i, (secret, frame) in enumerate(zip(secrets, frames)):
        assert protocol.parse(secret, frame, "test") == protocol.Free([["seg", i]])
        assert protocol.parse(secrets[i - 1], frame, "test") is None  # another pool's secret never opens it
    assert len(protocol._keyed) <= protocol._KEYED_MAX
    big = [protocol.pack(secret, protocol.Free([["s" * protocol.SHA_FROM, i]])) for i, secret in enumerate(secrets)]
    assert all(protocol.parse(secret, frame, "test") is not None for secret, frame in zip(secrets, big))
    assert len(protocol._keyed_big) <= protocol._KEYED_MAX


@pytest.mark.parametrize("size", [0, 100, protocol.SHA_FROM - 1, protocol.SHA_FROM, 64 * 1024])
def test_a_seal_is_keyed_blake2b_for_small_bodies_and_hmac_sha256_from_sha_from_on(size):
    """Either side picks the MAC by the body's length: both standard constructions, cut to MAC_SIZE bytes; a
    body changed in any byte, or sealed with another secret, does not open."""
    import hashlib
    import hmac
    import os

    body = os.urandom(size)
    tag = protocol.mac(SECRET, body)
    if size < protocol.SHA_FROM:
        assert tag == hashlib.blake2b(body, key=SECRET, digest_size=protocol.MAC_SIZE).digest()
    else:
        assert tag == hmac.new(SECRET, body, hashlib.sha256).digest()[:protocol.MAC_SIZE]
    assert protocol.mac(SECRET, body) == tag and len(tag) == protocol.MAC_SIZE  # (the cached key is never updated)
    assert protocol.mac(b"another secret" * 3, body) != tag
    if size:
        changed = bytearray(body)
        changed[size // 2] ^= 1
        assert protocol.mac(SECRET, bytes(changed)) != tag
