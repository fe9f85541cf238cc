"""Values on the wire: msgpack with tuples, tensors as handles, anything else by pickle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    big = [b"y" * 1000] * (codec.ThreadPacker.KEEP_BYTES // 1000 + 1)  # (one big bytes would go by shared memory)
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
    assert torch.equal(out, t)
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
        "process (its graph would be cut silently). Training runs in-process: use soma.Executor or soma.Trainer; "
        "when only the values are meant to travel, run the model under `with torch.no_grad():`, freeze it with "
        "model.requires_grad_(False), or return t.detach() (soma.torch.Module and Batched do this for you on "
        "workers)")


def test_a_handle_reaching_outside_its_segment_is_refused():
    pytest.importorskip("torch")
    handle = [codec.T_SHM, "float32", [100], [1], 0, False, "soma-1-abcd-2-3", 64]  # 400 bytes in a 64-byte segment
    with pytest.raises(ValueError, match="reaches outside its segment"):
        codec.Decoder(lambda create: None).tensor(handle)


def test_one_decoder_gives_each_body_its_own_objects_and_a_lists_items_theirs():
    """A REF names an object of its own body (the host decodes a Result's outcomes, each one's Encoder's, with
    one Decoder); within a body, one object held twice arrives as one object held twice."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    values = [(np.full(3, i), torch.full((2,), float(i))) for i in range(4)]
    bodies = [codec.Encoder(lambda create: None).pack((a, a, t, [t])) for a, t in values]
    listed = codec.Encoder(lambda create: None).pack_each([(a, a, t) for a, t in values])
    decoder = codec.Decoder(lambda create: None)
    for (a, t), body in zip(values, bodies):
        got_a, again_a, got_t, (again_t,) = decoder.unpack(body)
        assert np.array_equal(got_a, a) and again_a is got_a and torch.equal(got_t, t) and again_t is got_t
    for (a, t), (got_a, again_a, got_t) in zip(values, decoder.unpack(listed)):
        assert np.array_equal(got_a, a) and again_a is got_a and torch.equal(got_t, t)


# -- which way values go, and values that need shared memory (two stores stand for two processes) ----------

@pytest.fixture
def stores():
    import os

    from soma.wire.shm import SegmentStore, pool_prefix, unlink_all

    prefix = pool_prefix(os.getpid(), os.urandom(4).hex())
    yield SegmentStore(prefix, 1 << 30), SegmentStore(prefix, 1 << 30)
    unlink_all(prefix)


def across(stores, value):
    sender, receiver = stores
    encoder = codec.Encoder(lambda create: sender)
    data = encoder.pack(value)
    for name in encoder.shared:
        sender.note_sent(name)
    return codec.Decoder(lambda create: receiver).unpack(data), len(data), encoder.shared


def test_a_received_tensor_is_shared_and_is_sent_on_as_its_segment(stores):
    torch = pytest.importorskip("torch")
    sender, receiver = stores
    x = torch.arange(1 << 18, dtype=torch.float32)
    (t, v), _, (name, _) = across(stores, (x, x[1::2]))  # (the second has gaps: a compact copy, its own segment)
    assert t.is_shared() and v.is_shared() and torch.equal(t, x) and torch.equal(v, x[1::2])
    assert t.untyped_storage().filename.endswith(name) and receiver.segment_of(t.data_ptr()) == name
    encoder = codec.Encoder(lambda create: receiver)  # the receiver sends it on: by name, nothing copied
    out = codec.Decoder(lambda create: sender).unpack(encoder.pack([t, t[5:9]]))
    assert encoder.copied == [] and encoder.shared == [name, name]
    assert torch.equal(out[0], x) and torch.equal(out[1], x[5:9]) and out[1].is_shared()


def test_a_decoder_counts_the_dev_shm_its_values_take_once_per_segment(stores):
    # (what a map's back-pressure by memory measures: soma/local/inflight.py `room`)
    np = pytest.importorskip("numpy")
    sender, receiver = stores
    encoder = codec.Encoder(lambda create: sender)
    a, b = np.arange(1 << 17, dtype=np.float64), np.ones(1 << 16)  # 1 MiB and 512 KiB, a segment each
    data = encoder.pack([a, a, b, "small"])
    decoder = codec.Decoder(lambda create: receiver)
    mark = decoder.shm_mark()
    got = decoder.unpack(data)
    assert (got[0] == a).all() and (got[2] == b).all() and got[3] == "small"
    taken = decoder.shm_taken(mark)
    assert a.nbytes + b.nbytes <= taken < 2 * (a.nbytes + b.nbytes), taken  # (each segment once, granule-rounded)
    mark = decoder.shm_mark()
    assert decoder.unpack(codec.Encoder(lambda create: sender).pack([1, "x"])) == [1, "x"]
    assert decoder.shm_taken(mark) == 0


def test_a_received_tensor_whose_bytes_torch_moved_is_copied_again(stores):
    torch = pytest.importorskip("torch")
    import torch.multiprocessing as tmp

    sender, receiver = stores
    x = torch.arange(1 << 16, dtype=torch.float32)
    t, _, (name,) = across(stores, x)
    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # torch moves the bytes into a segment of its own (a copy)
    try:
        t.share_memory_()
    finally:
        tmp.set_sharing_strategy(old)
    assert receiver.segment_of(t.data_ptr()) is None
    receiver._counter = 1000  # (one process standing for two: its segments must not take the sender's names)
    encoder = codec.Encoder(lambda create: receiver)
    out = codec.Decoder(lambda create: sender).unpack(encoder.pack(t))
    assert len(encoder.copied) == 1 and encoder.shared != [name] and torch.equal(out, x)


def test_plain_small_values_go_through_msgpack_and_the_rest_as_one_pickle():
    assert codec.route(5) == codec.route([1, "a", (2.0, None), {"k": b"x" * 100}]) == codec.MSGPACK
    assert codec.route({"a": [1, {"b": bytearray(1)}]}) == codec.PICKLE  # msgpack would make it bytes
    assert codec.route([memoryview(b"x")]) == codec.PICKLE
    assert codec.route((b"x" * codec.INLINE_LIMIT,)) == codec.PICKLE  # a big bytes: shared memory
    assert codec.route({str(i): i for i in range(codec.MSGPACK_ITEMS + 1)}) == codec.PICKLE


def test_a_value_of_many_tuples_goes_as_one_pickle_and_comes_back_exactly():
    few, many = [(i, "x") for i in range(codec.TUPLES_PICKLED)], [(i, "x") for i in range(codec.TUPLES_PICKLED + 1)]
    assert codec.route(few) == codec.route(tuple(few[1:])) == codec.MSGPACK
    assert codec.route(many) == codec.route(tuple(few)) == codec.route({"a": [few, [(1,)]]}) == codec.PICKLE
    for value in (few, many, {"rows": many, "k": (1, [2.5, (3, None)])}):
        out = roundtrip(value)
        assert out == value and [type(x) for x in out] == [type(x) for x in value]


def _route_by_rule(value) -> int:
    """The rule `route` follows, stated directly (one container at a time, recursively)."""
    counts = {"items": 0, "tuples": 0}

    def msgpack_can(x) -> bool:
        if type(x) in (bytearray, memoryview):
            return False
        if type(x) is bytes:
            return len(x) < codec.INLINE_LIMIT
        if type(x) not in (list, tuple, dict):
            return True
        counts["items"] += len(x)
        counts["tuples"] += type(x) is tuple
        children = [*x, *x.values()] if type(x) is dict else x
        return all(msgpack_can(child) for child in children)

    ok = msgpack_can(value)
    small = counts["items"] <= codec.MSGPACK_ITEMS and counts["tuples"] <= codec.TUPLES_PICKLED
    return codec.MSGPACK if ok and small else codec.PICKLE


_leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=3),
                    st.binary(max_size=3), st.sampled_from([bytearray(b"a"), memoryview(b"m"), b"x" * 20_000,
                                                            1j, frozenset({1})]))
_values = st.recursive(_leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=40), st.lists(inner, max_size=6).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=2), st.integers(),
                              st.tuples(st.sampled_from([1, "k", memoryview(b"m")]))), inner, max_size=6)),
    max_leaves=300)


@settings(max_examples=200, deadline=None)
@given(_values)
def test_route_walks_a_level_at_a_time_to_the_answer_of_its_rule(value):
    assert codec.route(value) == _route_by_rule(value)


def _same(a, b) -> bool:
    """Equal, and of the same types all the way down (a tuple stays a tuple, a list a list)."""
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)  # (NaN)


_plain = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3), st.binary(max_size=3)),
    lambda inner: st.one_of(st.lists(inner, max_size=30), st.lists(inner, max_size=5).map(tuple),
                            st.dictionaries(st.one_of(st.text(max_size=2), st.integers()), inner, max_size=5)),
    max_leaves=200)


@settings(max_examples=150, deadline=None)
@given(st.lists(_plain, max_size=40))
def test_plain_values_cross_exactly_alone_and_packed_each_whichever_way_they_go(values):
    for value in values:
        assert _same(roundtrip(value), value)
    data = codec.Encoder(lambda create: None).pack_each(values)
    assert _same(codec.Decoder(lambda create: None).unpack(data), values)


def test_outputs_packed_each_on_their_own_go_as_one_pickle_when_they_are_many_tuples_of_plain_data(stores):
    sender, receiver = stores
    values = [(i, [i, "x"], {"k": (i,)}) for i in range(1000)]  # (msgpack: 3,000 tuples, a hook call each)
    data = codec.Encoder(lambda create: sender).pack_each(values)
    out = codec.Decoder(lambda create: receiver).unpack(data)
    assert out == values and {type(v) for v in out} == {tuple} and type(out[0][2]["k"]) is tuple
    out[0][1].append("changed")  # (no memo: nothing is shared between them, as each alone)
    assert out[1][1] == [1, "x"]
    assert data[0] == 0xC7 or data[0] in (0xC8, 0xC9)  # one PICKLE extension, not a list of values packed each


def test_what_a_pickle_without_memo_refuses_crosses_with_one(stores):
    """A big value is pickled without a memo first (3-5x faster); what that refuses is pickled with one: rows of a
    class pickled by value (a script's or a function's own: cloudpickle's class refers to itself, and without a
    memo that was "excessively deep recursion", reported as a value nesting too deep) and frozensets (CPython's
    pickler raises KeyError for them without a memo). Both were refused by Local, sent or returned."""
    import collections
    import dataclasses

    @dataclasses.dataclass
    class Point:
        x: int
        y: int

    Row = collections.namedtuple("Row", "a b")
    def plain(v):  # (a class pickled by value arrives as a class of its own: compared by name and fields)
        if dataclasses.is_dataclass(v) or hasattr(v, "_fields"):
            return type(v).__name__, tuple(vars(v).values()) if dataclasses.is_dataclass(v) else tuple(v)
        if type(v) is list:
            return [plain(x) for x in v]
        return {k: plain(x) for k, x in v.items()} if type(v) is dict else v

    sender, receiver = stores
    for value in ([Point(i, -i) for i in range(5000)], [Row(i, str(i)) for i in range(5000)],
                  [(frozenset({i}),) for i in range(60)], {"k": [frozenset({i, i + 1}) for i in range(5000)]}):
        out = codec.Decoder(lambda create: receiver).unpack(codec.Encoder(lambda create: sender).pack(value))
        assert plain(out) == plain(value)
        both = codec.Decoder(lambda create: receiver).unpack(codec.Encoder(lambda create: sender).pack_each([value] * 2))
        assert [plain(v) for v in both] == [plain(value)] * 2


def test_arrays_and_tensors_in_a_value_of_many_tuples_cross_as_handles_and_the_same_one_stays_one(stores):
    """A value of many tuples goes as one pickle: the arrays and tensors in it still travel as handles, exact,
    writable, and one named twice arrives as one object (as through msgpack)."""
    import numpy as np
    import torch

    big, t = np.arange(1 << 14, dtype=np.float32), torch.arange(float(1 << 14))
    value = [(i, big, t, {"small": np.full(3, i, dtype=np.int16), "b": b"x"})
             for i in range(codec.TUPLES_PICKLED + 4)]
    assert codec.route(value) == codec.PICKLE
    out, _, _ = across(stores, value)
    assert len(out) == len(value) and all(type(row) is tuple for row in out)
    assert out[0][1] is out[5][1] and out[0][2] is out[5][2]  # (one object, as sent)
    assert np.array_equal(out[3][1], big) and torch.equal(out[3][2], t)
    assert [row[3]["small"].tolist() for row in out] == [[i] * 3 for i in range(len(value))]
    assert out[3][3]["small"].dtype == np.int16 and out[3][3]["b"] == b"x"
    out[0][1][0] = -1.0  # (writable; the sender's array is its own)
    assert big[0] == 0.0


def test_a_cycle_still_travels():
    cycle = [1]
    cycle.append(cycle)
    out = roundtrip(cycle)
    assert out[0] == 1 and out[1] is out


def test_a_big_message_goes_by_shared_memory(stores):
    value = [b"q" * 1000] * 2000  # 2 MB of small bytes: made again as one pickle, its stream in a segment
    out, size, shared = across(stores, value)
    assert out == value and size < 100 and len(shared) == 1


def test_numpy_values_come_back_exactly(stores):
    np = pytest.importorskip("numpy")
    big = np.arange(100_000, dtype=np.float64).reshape(100, 1000)
    for value in (big, big.T, big[:, ::7], big[::-1], np.float32(2.5), np.array(1 + 2j), np.zeros((3, 0)),
                  np.array([(1, "a")], dtype=[("n", "<i2"), ("s", "U1")]), [big, big], {"m": np.ma.masked_array([1, 2], [0, 1])}):
        out, _, _ = across(stores, value)
        if isinstance(value, list):
            assert out[0] is out[1] and np.array_equal(out[0], big)
        elif isinstance(value, dict):
            assert type(out["m"]) is type(value["m"]) and (out["m"].mask == value["m"].mask).all()
        else:
            assert type(out) is type(value) and out.dtype == value.dtype and np.array_equal(out, value)


def test_nesting_too_deep_for_pickle_is_named_with_its_depth():
    deep: list = []
    for _ in range(5_000):
        deep = [{"k": deep}]
    with pytest.raises(codec.Unsendable, match=r"^list nests 10001 levels deep, deeper than pickle can follow") as err:
        codec.Encoder(lambda create=True: None).pack(deep)
    assert err.value.too_deep
    assert codec.nesting_depth([1, (2, {"a": [3]})]) == 4 and codec.nesting_depth(7) == 0


def _small_tensor_forms():
    import torch

    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
              torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
    for dtype in dtypes:
        base = torch.randn(6, 8, dtype=dtype) if dtype.is_complex else (torch.randn(6, 8) * 10).to(dtype)
        forms = {"matrix": base, "transposed": base.T, "0-d": base[1, 2], "row": base[2], "column": base[:, 3],
                 "expanded": base[0, :1].expand(5, 9), "empty": base[:0], "gaps": base[::2, ::3],
                 "channels_last": base.reshape(1, 6, 8, 1).contiguous(memory_format=torch.channels_last)}
        if dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
            forms["negative view"] = torch._neg_view(base)
        if dtype.is_complex:
            forms["conjugate view"] = base.conj()
        for form, t in forms.items():
            yield pytest.param(t, id=f"{str(dtype).rpartition('.')[2]}-{form}")


@pytest.mark.parametrize("t", list(_small_tensor_forms()))
def test_small_tensors_of_every_dtype_and_form_come_back_exactly(t):
    """Inline tensors (under the inline limit) take the decoder's one-call path: same dtype, shape, values;
    dense forms keep their strides; lazy conj/neg bits resolved; writable, and not sharing the sender's."""
    import torch

    out = roundtrip(t)

    def values(x):  # compared as complex128, through float64 for the dtypes that do not convert directly
        x = x.reshape(-1)
        if x.dtype in (torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2):
            x = x.to(torch.float64)
        return x.to(torch.complex128)

    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(values(out), values(t))
    assert not out.is_neg() and not out.is_conj()
    if t.is_contiguous() or t.stride() in ((1, 8), (1, 0)) or t.is_contiguous(memory_format=torch.channels_last):
        assert out.stride() == t.stride()
    if out.numel() and 0 not in out.stride() and t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert out.data_ptr() != t.data_ptr()
        before = values(t).clone()
        out.fill_(1)  # writable
        assert torch.equal(values(t), before)  # and the sender's tensor is untouched by writes to what arrived


def test_values_packed_each_on_their_own_come_back_as_the_list_for_every_length(stores):
    sender, receiver = stores
    for n in (0, 1, 15, 16, 65_536):  # msgpack's three list headers, before the values packed one by one
        values = [b"x" * codec.INLINE_LIMIT, *((i, "x") for i in range(n - 1))][:n]  # (large bytes: one by one)
        encoder = codec.Encoder(lambda create: sender)
        data = encoder.pack_each(values)
        for name in encoder.shared:
            sender.note_sent(name)
        assert codec.Decoder(lambda create: receiver).unpack(data) == values


def test_values_packed_each_on_their_own_share_nothing_on_arrival(stores):
    """A bundle's inputs (and a batch's outputs) are packed with pack_each: the same tensor twice arrives as
    two tensors over two copies (a node that adds to one in place must not change the other), while inside
    one value a tensor named twice still arrives as one object."""
    import torch

    sender, receiver = stores
    small, big = torch.arange(8.0), torch.arange(float(1 << 14))  # inline, and copied into a segment
    encoder = codec.Encoder(lambda create: sender)
    data = encoder.pack_each([small, small, big, big, [big, big]])
    out = codec.Decoder(lambda create: receiver).unpack(data)
    assert [torch.equal(a, b) for a, b in zip(out, [small, small, big, big])] == [True] * 4
    out[0].add_(1)
    out[2].add_(1)
    assert torch.equal(out[1], small) and torch.equal(out[3], big)  # no view of the other's copy
    assert out[4][0] is out[4][1]  # within one value: one object, as pack gives
    assert torch.equal(out[4][0], big)


@pytest.mark.parametrize("value", [None, True, False, 0, 1, -1, 127, 128, -33, 2**63 - 1, 2**64 - 1, -2**63, 0.5,
                                   float("inf"), "", "short", "ü€𝄞" * 100, "x" * (codec.BIG_MESSAGE // 8)])
def test_a_lone_scalar_packs_to_the_encoders_bytes_without_an_encoder(value):
    assert codec.pack_scalar(value) == codec.Encoder(lambda create=True: None).pack(value)


@pytest.mark.parametrize("value", [2**64, -2**63 - 1, "\ud800", "x" * (codec.BIG_MESSAGE // 8 + 1), b"bytes",
                                   [1], (1,), {"a": 1}, 1j, bytearray(b"b")])
def test_any_other_value_is_left_to_the_encoder(value):
    assert codec.pack_scalar(value) is None
    assert codec.pack_scalar(5) == b"\x05"  # (a value msgpack refused leaves nothing in the Packer)
    back = codec.Decoder(lambda create=True: None).unpack(codec.Encoder(lambda create=True: None).pack(value))
    assert back == value and type(back) is type(value)


_PLAIN_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=5), inner,
                                                                                          max_size=3),
    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(_PLAIN_VALUES)
def test_a_scalar_decodes_without_a_decoder_as_the_decoder_would_and_nothing_else_does(value):
    data = codec.Encoder(lambda create=True: None).pack(value)
    back = codec.unpack_scalar(data)
    if type(value) in (type(None), bool, int, float, str) and codec.pack_scalar(value) is not None:
        assert back == value and type(back) is type(value)  # (a number or string the worker packed alone)
    else:
        assert back is codec.NOT_SCALAR  # (containers, bytes, a big int pickled: a Decoder's)
    assert codec.unpack_scalar(b"") is codec.NOT_SCALAR


def test_the_segments_a_body_names_are_what_a_decoder_receives_without_opening_any(stores):
    """`segments_named`: what a worker reports released for an input it will never decode (dropped unstarted,
    given back, its code not loadable): one name per receipt a Decoder would count, for every way a segment is
    named (an array, a tensor, torch's own reductions, a pickle's stream and out-of-band buffers, nested in a
    pickle), and nothing for values that travel inline. The host lends exactly those (Encoder.shared)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    import collections

    class Subclass(torch.Tensor):  # (its data travels as a plain tensor's handle inside a PICKLE)
        pass

    big = np.arange(1 << 16, dtype=np.float64)
    values = [1, "small", b"x" * 10, np.ones(4), big, (big, big, big[::2]), torch.arange(1 << 16, dtype=torch.float32),
              {"t": torch.ones(1 << 16), "a": big}, [bytearray(1 << 16), memoryview(bytes(1 << 16))],
              collections.OrderedDict(a=big), np.array([big, "o"], dtype=object),
              torch.ones(1 << 16).to_sparse(), torch.ones(1 << 16).as_subclass(Subclass)]
    sender, receiver = stores
    counts = []
    for value in values:
        encoder = codec.Encoder(lambda create: sender)
        data = encoder.pack(value)
        named = codec.segments_named(data)
        decoder = codec.Decoder(lambda create: receiver)
        decoder.unpack(data)
        assert sorted(named) == sorted(decoder.received) == sorted(encoder.shared), type(value)
        counts.append(len(named))
    assert counts[:4] == [0, 0, 0, 0] and all(counts[4:]), counts
