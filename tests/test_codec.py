"""Values on the wire: msgpack with tuples, tensors as handles, anything else by pickle."""

import pytest

from soma.wire import codec
from tests.conftest import in_threads


def roundtrip(value):
    data = codec.Encoder(lambda create: None).pack(value)
    return codec.Decoder(lambda create: None).unpack(data)


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

    with pytest.raises(codec.Unsendable, match="Unpicklable cannot be sent to another process"):
        codec.Encoder(lambda create: None).pack([Unpicklable()])


def test_a_failed_encoding_leaves_nothing_in_the_next_one():
    """Each thread reuses one Packer: a value that fails half-way must not leak its bytes into the next."""
    from tests.nodes import Unpicklable

    with pytest.raises(codec.Unsendable):
        codec.Encoder(lambda create: None).pack([1, "two", (3, [Unpicklable()])])
    assert roundtrip([4, ("five", (6,))]) == [4, ("five", (6,))]


def test_a_big_value_does_not_leave_its_buffer_in_the_threads_packer():
    small = codec._local.packer
    assert roundtrip(b"x" * 1000) == b"x" * 1000 and codec._local.packer is small  # reused
    big = b"y" * (codec.ThreadPacker.KEEP_BYTES + 1)
    assert roundtrip(big) == big and codec._local.packer is not small  # replaced: its buffer goes
    assert roundtrip([1, (2,)]) == [1, (2,)]


def test_threads_encode_at_once_without_mixing_values():
    def encode_many(tag):
        values = [[tag, i, (tag, str(i), (i,))] for i in range(2000)]
        return [roundtrip(value) == value for value in values]

    assert all(all(same) for same in in_threads(encode_many, 4, seconds=30))


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
    with pytest.raises(codec.GradCrossing) as info:
        codec.Encoder(lambda create: None).pack((1, [x]))
    assert info.value.reason("it returned") == (
        "it returned a tensor that requires grad and carries an autograd graph, which cannot cross into another "
        "process (its graph would be cut silently). Training runs in-process: use soma.Executor or soma.Trainer, "
        "or return t.detach() when only the values are meant to travel")


def test_a_handle_reaching_outside_its_segment_is_refused():
    pytest.importorskip("torch")
    handle = [codec.T_SHM, "float32", [100], [1], 0, False, "soma-1-abcd-2-3", 64]  # 400 bytes in a 64-byte segment
    with pytest.raises(ValueError, match="reaches outside its segment"):
        codec.Decoder(lambda create: None).tensor(handle)
