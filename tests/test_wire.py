"""The wire format on its own: sealing, values, tensor handles, the status page."""

import logging

import pytest

from soma import wire


SECRET = b"s" * 32


def test_seal_and_unseal_round_trip():
    frame = wire.seal(SECRET, [wire.TASK, 1, {}, [], b"x", []])
    assert wire.unseal(SECRET, [frame], "test") == [wire.TASK, 1, {}, [], b"x", []]


@pytest.mark.parametrize(
    "frames, why",
    [
        ([wire.seal(b"other" * 8, [wire.STOP])], "failed authentication"),
        ([b"short"], "frames"),
        ([b"a", b"b"], "frames"),
        ([wire.seal(SECRET, [wire.STOP])[:-1] + b"\x00"], "failed authentication"),
    ],
    ids=["wrong-secret", "too-short", "two-frames", "tampered"],
)
def test_frames_that_do_not_authenticate_are_dropped_and_logged(frames, why, caplog):
    with caplog.at_level(logging.WARNING, logger="soma.wire"):
        assert wire.unseal(SECRET, frames, "test") is None
    assert why in caplog.text


def test_authentic_but_undecodable_or_unknown_messages_are_dropped(caplog):
    body = b"\xc1"  # a byte msgpack never uses
    frame = wire.mac(SECRET, body) + body
    with caplog.at_level(logging.WARNING, logger="soma.wire"):
        assert wire.unseal(SECRET, [frame], "test") is None
        assert wire.unseal(SECRET, [wire.seal(SECRET, [99])], "test") is None
        assert wire.unseal(SECRET, [wire.seal(SECRET, {"not": "a list"})], "test") is None
    assert "did not decode" in caplog.text and "unknown shape" in caplog.text


def roundtrip(value):
    data = wire.Encoder(lambda create: None).pack(value)
    return wire.Decoder(lambda create: None).unpack(data)


@pytest.mark.parametrize(
    "value",
    [None, True, 0, -5, 2 ** 63 - 1, 2 ** 64, -(2 ** 80), 1.5, "text", b"\x00bytes", [], (), [1, (2, 3)],
     {"a": (1, [2, {3: (4,)}])}, {(1, 2): "tuple key", 3: "int key"}, {1, 2}, frozenset({"x"}),
     complex(1, 2), range(3)],
)
def test_values_come_back_equal_and_of_the_same_type(value):
    out = roundtrip(value)
    assert out == value and type(out) is type(value)


def test_custom_objects_travel_by_pickle():
    from tests.nodes import Located

    out = roundtrip({"where": Located("meta")})
    assert type(out["where"]).__name__ == "Located" and out["where"].device == "meta"


def test_unsendable_values_say_which_type():
    from tests.nodes import Unpicklable

    with pytest.raises(wire.Unsendable, match="Unpicklable cannot be sent to another process"):
        wire.Encoder(lambda create: None).pack([Unpicklable()])


def test_small_tensors_travel_inline_and_meta_tensors_as_shapes():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3)
    out = roundtrip(t)
    assert torch.equal(out, t) and not out.is_shared()
    m = roundtrip(torch.empty(5, 2, device="meta").t())
    assert m.device.type == "meta" and m.shape == (2, 5) and m.stride() == (1, 2)
    p = roundtrip(torch.ones(3, requires_grad=True))
    assert p.requires_grad and p.is_leaf


def test_a_tensor_with_an_autograd_graph_cannot_be_encoded():
    torch = pytest.importorskip("torch")
    x = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(wire.GradCrossing, match="requires grad and carries an autograd graph"):
        wire.Encoder(lambda create: None).pack((1, [x]))


def test_a_handle_reaching_outside_its_segment_is_refused():
    pytest.importorskip("torch")
    handle = [wire.T_SHM, "float32", [100], [1], 0, False, "soma-1-abcd-2-3", 64]  # 400 bytes in a 64-byte segment
    with pytest.raises(ValueError, match="reaches outside its segment"):
        wire.Decoder(lambda create: None).tensor(handle)


def test_status_page_shows_what_runs(tmp_path):
    path = str(tmp_path / "status")
    writer = wire.StatusPage(path, create=True)
    reader = wire.StatusPage(path, create=False)
    assert reader.read() == []
    writer.write({"encoder": 1, "join": 2})
    assert reader.read() == ["encoder", "join"]
    writer.write({})
    assert reader.read() == []
    writer.close()
    reader.close()
