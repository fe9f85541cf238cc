"""What the host makes of a bundle's outcome (host/outcomes.py `bundled`): each input's own answer, never a
dropped one. Pure: the codec and the error bodies, no worker."""

from soma import NodeError
from soma.local.host.events import Bundled, Undecodable
from soma.local.host.outcomes import bundled
from soma.wire import codec, failures


def packed(value) -> bytes:
    return codec.Encoder(lambda create: None).pack(value)


def decoder():
    return codec.Decoder(lambda create: None)


def test_every_input_ok_gets_its_output_from_the_one_list_in_order():
    got = bundled(decoder(), [7, 8, 9], [True, True, True], packed(["a", ("b", 2), [3]]), 0.01)
    assert got == Bundled([7, 8, 9], [True, True, True], ["a", ("b", 2), [3]], 0.01, 0, True)  # (inline: no /dev/shm)


def test_outputs_encoded_alone_and_failures_keep_their_places():
    err = failures.error_body(NodeError.failed("model", "ValueError: bad input"))
    got = bundled(decoder(), [1, 2, 3, 4], [True, packed({"own": 1}), err, True], packed(["x", "y"]), 0.0)
    assert got.oks == [True, True, False, True]
    assert got.values[0] == "x" and got.values[1] == {"own": 1} and got.values[3] == "y"
    assert isinstance(got.values[2], NodeError) and "bad input" in str(got.values[2])


def test_a_list_of_the_wrong_length_leaves_each_of_its_outputs_undecodable_and_the_rest_as_said():
    err = failures.error_body(NodeError.failed("model", "boom"))
    got = bundled(decoder(), [1, 2, 3], [True, err, True], packed(["only one"]), 0.0)
    assert got.oks == [True, False, True]
    assert isinstance(got.values[0], Undecodable) and isinstance(got.values[2], Undecodable)
    assert "not 2" in str(got.values[0].error)
    assert isinstance(got.values[1], NodeError)


def test_a_list_that_cannot_be_decoded_leaves_every_output_undecodable():
    got = bundled(decoder(), [5, 6], [True, True], b"\xc1 not msgpack", 0.0)
    assert got.oks == [True, True] and all(isinstance(v, Undecodable) for v in got.values)
    assert not got.decoded  # (its chunk looks at each output: each fails by itself)
