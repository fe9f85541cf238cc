"""numpy arrays, bytes-like values and torch's special tensors across processes: exact, shared, held, after deaths.

Every test holds many results at once and checks every value at the end: a segment
reused while somebody still sees it shows up as a wrong value, never as an error.
"""

import os
import signal
import sys

import pytest

np = pytest.importorskip("numpy")

import soma  # noqa: E402
from soma import Done, Graph, Node, NodeError, WorkerDied  # noqa: E402
from soma.wire.codec import INLINE_LIMIT  # noqa: E402
from tests.conftest import in_threads, segment_file, shm_names  # noqa: E402
from tests.nodes import Die, Identity, in_segment  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HELD = 12
BIG = 4 * INLINE_LIMIT  # bytes: through a segment


class ArrayFill(Node):
    """A float32 array of `n` elements all equal to its input, on the heap or through ctx.empty_array."""

    def __init__(self, n, through_ctx=False, shape=None):
        self.n, self.through_ctx, self.shape = n, through_ctx, shape or (n,)

    def forward(self, x, ctx):
        a = ctx.empty_array(self.shape, np.float32) if self.through_ctx else np.empty(self.shape, np.float32)
        a.fill(x)
        return Done(a)


class PlusOneArray(Node):
    def forward(self, x, ctx):
        return Done(x + 1)


class Describe(Node):
    """What arrived: (type name, dtype, shape, strides, writable, in a segment, whether torch is imported here)."""

    def forward(self, x, ctx):
        return Done((type(x).__name__, str(x.dtype), x.shape, x.strides, bool(x.flags.writeable), in_segment(x),
                     "torch" in sys.modules))


class Twice(Node):
    def forward(self, x, ctx):
        return Done((x, x))


def arrays():
    """Every kind of array the issue names, small and through a segment."""
    big = np.arange(BIG // 8 * 3, dtype=np.float64).reshape(3, -1)
    image = (np.arange(256 * 256 * 3) % 251).astype(np.uint8).reshape(256, 256, 3)
    return {
        "int8": np.arange(-50, 50, dtype=np.int8), "uint64": np.arange(10, dtype=np.uint64) * 2 ** 60,
        "float16": np.linspace(0, 1, 9, dtype=np.float16), "complex128": np.arange(5) * (1 + 2j),
        "bool": np.arange(7) % 2 == 0, "datetime64": np.arange("2026-01-01", "2026-02-01", dtype="datetime64[D]"),
        "timedelta64": np.arange(6).astype("timedelta64[ms]"), "unicode": np.array(["soma", "ß", ""]),
        "bytes": np.array([b"ab", b"\x00c"]), "big-endian": np.arange(BIG // 4, dtype=">i4"),
        "structured": np.array([(1, 2.5, "x"), (3, -1.0, "yz")], dtype=[("a", "<i4"), ("b", "<f8"), ("c", "U3")]),
        "structured-big": np.zeros(BIG // 16, dtype=[("a", "<i8"), ("b", "<f4", (2,))]),
        "0-d": np.array(3.25), "empty": np.zeros((0, 4), np.float32), "fortran": np.asfortranarray(big),
        "transposed": big.T, "hwc-to-chw": image.transpose(2, 0, 1), "gappy": big[:, ::3], "reversed": big[:, ::-1],
        "broadcast": np.broadcast_to(np.arange(4.0), (BIG // 32, 4)), "read-only": _read_only(big.copy()),
        "image": image, "object": np.array([1, "two", None], dtype=object),
    }


def _read_only(a):
    a.flags.writeable = False
    return a


def same(a, b) -> bool:
    if a.dtype.hasobject:
        return type(b) is np.ndarray and list(a) == list(b)
    return (type(b) is type(a) and a.dtype == b.dtype and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc") and bool(b.flags.writeable) == bool(a.flags.writeable))


@pytest.mark.parametrize("name", list(arrays()))
def test_arrays_come_back_exactly_both_ways(local, name):
    a = arrays()[name]
    held = [local.run(Graph.somatize(Identity()), a) for _ in range(3)]
    echoed = local.run(Graph.somatize(Identity()), held[0])  # a received array, sent again
    for out in held + [echoed]:
        assert same(a, out), name
    if a.nbytes >= INLINE_LIMIT and not a.dtype.hasobject and name != "broadcast":  # (a broadcast one: its span)
        assert in_segment(held[0])
    if name in ("fortran", "transposed", "hwc-to-chw", "reversed", "broadcast"):  # dense or broadcast: strides kept
        assert held[0].strides == a.strides


def test_an_array_arrives_over_shared_memory_writable_with_its_layout(local):
    image = np.zeros((480, 640, 3), np.uint8).transpose(2, 0, 1)  # CHW view of an HWC image: dense, permuted
    kind, dtype, shape, strides, writable, shared, _ = local.run(Graph.somatize(Describe()), image)
    assert (kind, dtype, shape, strides, writable, shared) == ("ndarray", "uint8", image.shape, image.strides, True, True)
    out = local.run(Graph.somatize(Identity()), image)
    assert out.strides == image.strides and in_segment(out) and out.flags.writeable
    out[0, 0, 0] = 7  # the caller's to write


@pytest.mark.parametrize("through_ctx", [False, True], ids=["heap", "ctx.empty_array"])
@pytest.mark.parametrize("n", [100, BIG // 4, 1 << 20])
def test_array_results_held_at_once_stay_intact(local, n, through_ctx):
    g = Graph.somatize(ArrayFill(n, through_ctx))
    held = [local.run(g, i) for i in range(HELD)]
    assert all(np.all(a == i) for i, a in enumerate(held))
    assert len({a.__array_interface__["data"][0] for a in held}) == HELD
    again = list(local.map(Graph.somatize(ArrayFill(n, through_ctx) >> PlusOneArray()), range(HELD)))
    assert all(np.all(a == i) for i, a in enumerate(held)) and all(np.all(a == i + 1) for i, a in enumerate(again))


def test_ctx_empty_array_is_shared_memory_reused_across_runs(local):
    g = Graph.somatize(ArrayFill(1 << 20, through_ctx=True))
    first = local.run(g, 2.0)
    segment = segment_file(first)
    assert segment is not None and float(first[0]) == 2.0
    del first
    local.run(Graph.somatize(Identity()), 0)  # lets the worker hear that the host dropped it
    before = shm_names(local.snapshot().shm_prefix)
    second = local.run(g, 3.0)
    assert segment_file(second) in before  # reused, not new
    assert np.all(second == 3.0)


def test_an_input_the_caller_changes_after_sending_does_not_change_held_results(local):
    x = np.zeros(1 << 20, np.float32)
    held = []
    for i in range(6):
        held.append(local.run(Graph.somatize(Identity()), x))  # a heap input is copied: the result is new memory
        x.fill(i + 1)
    assert [float(a[0]) for a in held] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert all(np.all(a == i) for i, a in enumerate(held))


def test_array_results_held_by_several_threads_at_once(local):
    graphs = [Graph.somatize(ArrayFill(BIG // 4, c)) for c in (False, True)]
    graphs.append(Graph.somatize(ArrayFill(1 << 18) | ArrayFill(100, True)))

    def go(k):
        return [(v, local.run(graphs[i % 3], v)) for i in range(20) for v in [float(k * 1000 + i)]]

    for mine in in_threads(go, 4):
        for value, out in mine:
            for a in out if isinstance(out, tuple) else (out,):
                assert np.all(a == value), value


def test_array_results_survive_the_death_of_the_worker_that_made_them(local):
    g = Graph.somatize(ArrayFill(1 << 20) | ArrayFill(BIG, through_ctx=True))
    held = [local.run(g, i) for i in range(4)]
    os.kill(local.pids()[0], signal.SIGKILL)
    with pytest.raises(WorkerDied):
        local.run(Graph.somatize(Die(code=3)), 0)
    held += [local.run(g, i) for i in range(4, 8)]
    for i, (a, b) in enumerate(held):
        assert np.all(a == i) and np.all(b == i), i


def test_an_array_only_the_map_holds_stays_intact_while_its_job_waits(local):
    results = [local.run(Graph.somatize(ArrayFill(BIG)), i) for i in range(24)]

    def source():
        while results:
            yield results.pop(0)  # from here on only the map holds it

    held = list(local.map(Graph.somatize(PlusOneArray()), source(), window=24))
    assert all(np.all(a == i + 1) for i, a in enumerate(held))


def test_the_same_array_or_tensor_twice_arrives_as_one_object(local):
    a = local.run(Graph.somatize(Twice()), np.arange(BIG, dtype=np.float32))
    assert a[0] is a[1] and np.array_equal(a[0], np.arange(BIG, dtype=np.float32))
    torch = pytest.importorskip("torch")
    t = local.run(Graph.somatize(Twice()), torch.arange(BIG, dtype=torch.float32))
    assert t[0] is t[1] and torch.equal(t[0], torch.arange(BIG, dtype=torch.float32))


# -- bytes-like values -------------------------------------------------------------------------------

def byte_values():
    return {"bytes": b"\x01" * 100, "bytes-big": bytes(range(256)) * (BIG // 256), "bytearray": bytearray(b"ab"),
            "bytearray-big": bytearray(b"\x02" * BIG), "nested": {"jpeg": b"\xff\xd8" * BIG, "raw": [bytearray(3)]},
            "memoryview": memoryview(b"xyz" * BIG), "many-small": [b"q" * 1000] * 2000}


@pytest.mark.parametrize("name", list(byte_values()))
def test_bytes_like_values_keep_their_type_and_bytes(local, name):
    value = byte_values()[name]
    held = [local.run(Graph.somatize(Identity()), value) for _ in range(4)]
    for out in held:
        assert type(out) is type(value) and out == value
    if name == "nested":
        assert type(held[0]["raw"][0]) is bytearray


def test_a_memoryview_keeps_its_format_shape_bytes_and_writability(local):
    """Strided ones (a writable one arrived read-only) and structured ones (format "T{...}": it arrived as bytes,
    format "B", its shape in bytes), small and big, read-only or not, on their way in and back."""
    ro = np.arange(BIG, dtype=np.float64)
    ro.flags.writeable = False
    table = np.zeros((BIG // 16, 2), dtype=[("a", "i4"), ("b", "f8")])
    table["a"] = np.arange(BIG // 16)[:, None]
    views = {"strided": memoryview(np.arange(BIG, dtype=np.float64))[::2],
             "strided-small": memoryview(bytearray(99))[::3], "strided-read-only": memoryview(ro)[::-4],
             "2-d": memoryview(np.ones((64, 64), np.int16)),
             "structured": memoryview(table), "structured-small": memoryview(table[:3]),
             "structured-read-only": memoryview(table).toreadonly(),
             "float16": memoryview(np.arange(3, dtype=np.float16)), "complex": memoryview(np.ones(5, np.complex128)),
             "empty-rows": memoryview(np.zeros((0, 3)))}
    held = {name: local.run(Graph.somatize(Identity()), view) for name, view in views.items()}
    for name, view in views.items():
        out = held[name]
        assert type(out) is memoryview and out.format == view.format and out.shape == view.shape, (name, out)
        assert out.tobytes() == view.tobytes() and out.readonly == view.readonly, name


def test_large_bytes_never_travel_through_the_socket(local, monkeypatch):
    from soma.wire import protocol

    sizes = []
    pack = protocol.pack
    monkeypatch.setattr(protocol, "pack", lambda secret, message: sizes.append(len(pack(secret, message))) or
                        pack(secret, message))
    out = local.run(Graph.somatize(Identity()), {"a": b"\x03" * (4 << 20), "b": bytearray(4 << 20)})
    assert out == {"a": b"\x03" * (4 << 20), "b": bytearray(4 << 20)} and max(sizes) < 64 * 1024


# -- torch's special tensors: the path CUDA tensors take too ------------------------------------------

def special_tensors(torch):
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(300, 200, generator=gen).relu()
    return {
        "coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc(),
        "coo-small": torch.eye(3).to_sparse(),
        "qint8": torch.quantize_per_tensor(torch.randn(BIG, generator=gen), 0.05, 4, torch.qint8),
        "per-channel": torch.quantize_per_channel(torch.randn(64, 300, generator=gen), torch.rand(64, generator=gen)
                                                  + 0.1, torch.arange(64) % 5, 0, torch.quint8),
    }


def same_tensor(torch, a, b) -> bool:
    if a.is_quantized:
        return (b.is_quantized and a.qscheme() == b.qscheme() and torch.equal(a.int_repr(), b.int_repr())
                and torch.equal(a.dequantize(), b.dequantize()))
    return a.layout == b.layout and a.shape == b.shape and torch.equal(a.to_dense(), b.to_dense())


class SpecialFill(Node):
    """A sparse COO tensor and a quantized one, both holding its input (made in the worker)."""

    def forward(self, x, ctx):
        import torch

        dense = torch.full((200, 300), float(x))
        dense[::2] = 0
        return Done((dense.to_sparse(), torch.quantize_per_tensor(torch.full((BIG,), float(x)), 1.0, 0, torch.qint32)))


def test_sparse_and_quantized_tensors_cross_both_ways_held(local):
    torch = pytest.importorskip("torch")
    values = special_tensors(torch)
    held = [(name, local.run(Graph.somatize(Identity()), t)) for _ in range(3) for name, t in values.items()]
    made = [local.run(Graph.somatize(SpecialFill()), i) for i in range(HELD)]
    for name, out in held:
        assert same_tensor(torch, values[name], out), name
    for i, (sparse, quantized) in enumerate(made):
        assert float(sparse.to_dense()[1].min()) == i and float(sparse.to_dense()[0].max()) == 0
        assert torch.all(quantized.dequantize() == i), i


def test_special_tensors_survive_a_worker_death(local):
    torch = pytest.importorskip("torch")
    held = [local.run(Graph.somatize(SpecialFill()), i) for i in range(4)]
    os.kill(local.pids()[1], signal.SIGKILL)
    with pytest.raises(WorkerDied):
        local.run(Graph.somatize(Die(code=3)), 0)
    held += [local.run(Graph.somatize(SpecialFill()), i) for i in range(4, 8)]
    for i, (sparse, quantized) in enumerate(held):
        assert float(sparse.to_dense()[1].min()) == i and torch.all(quantized.dequantize() == i), i


def test_a_special_tensor_that_cannot_be_reduced_is_an_error_naming_the_node(local, monkeypatch):
    torch = pytest.importorskip("torch")
    from soma.wire import tensors

    def broken(torch):
        raise ImportError("cannot import name 'ForkingPickler' from 'torch.multiprocessing.reductions'")

    monkeypatch.setattr(tensors, "_torch_pickler", broken)
    with pytest.raises(NodeError, match=r"^node `identity` failed: its input cannot be sent to a worker: Tensor "
                                        r"cannot be sent to another process: ImportError: cannot import name"):
        local.run(Graph.somatize(Identity()), torch.eye(3).to_sparse())
    monkeypatch.undo()
    assert torch.equal(local.run(Graph.somatize(Identity()), torch.eye(3).to_sparse()).to_dense(), torch.eye(3))


# -- numpy without torch, and leaks -----------------------------------------------------------------

def test_a_worker_running_numpy_nodes_never_imports_torch():
    with soma.Local(workers=1, preload_torch=False) as pool:
        image = np.zeros((300, 400, 3), np.uint8)
        *_, torch_there = pool.run(Graph.somatize(ArrayFill(BIG, through_ctx=True) >> Describe()), 1.0)
        back = pool.run(Graph.somatize(Identity()), {"image": image, "raw": bytearray(BIG), "small": np.arange(3)})
        *_, torch_after = pool.run(Graph.somatize(Describe()), image)
    assert not torch_there and not torch_after
    assert np.array_equal(back["image"], image) and back["raw"] == bytearray(BIG)


def test_thousand_array_runs_leave_shm_and_fds_flat(local):
    g = Graph.somatize(PlusOneArray() >> (Identity() | PlusOneArray()))
    x = np.ones(BIG, np.float32)
    for _ in range(50):
        local.run(g, x)
    fds_before = len(os.listdir("/proc/self/fd"))
    shm_before = len(shm_names(local.snapshot().shm_prefix))
    raw, made = Graph.somatize(Identity()), Graph.somatize(ArrayFill(BIG, through_ctx=True))
    for i in range(1000):
        out = (local.run(g, x), local.run(made, i)) if i % 2 else local.run(raw, {"b": b"\x01" * BIG, "a": bytearray(BIG)})
    del out
    local.run(Graph.somatize(Identity()), 0)
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2
    assert len(shm_names(local.snapshot().shm_prefix)) <= shm_before + 4


def test_an_array_of_objects_sent_read_only_arrives_read_only(local):
    """numpy's pickle (an array holding objects goes so) makes an array writable: a node could write into what its
    caller sent read-only, where an array of numbers arrives read-only (found by a tester's Hypothesis run)."""
    kinds = {"objects": np.array([1, "x", None, (2,)], dtype=object),
             "struct-with-object": np.zeros(3, dtype=[("a", "i4"), ("o", "O")])}
    for name, array in kinds.items():
        frozen = array.copy()
        frozen.flags.writeable = False
        for sent in (array, frozen):
            out = local.run(Graph.somatize(Identity()), sent)
            assert out.dtype == sent.dtype and out.tolist() == sent.tolist(), name
            assert out.flags.writeable == sent.flags.writeable, (name, sent.flags.writeable)
    holds_itself = np.empty(2, dtype=object)
    holds_itself[0], holds_itself[1] = holds_itself, "x"
    holds_itself.flags.writeable = False
    out = local.run(Graph.somatize(Identity()), holds_itself)
    assert out[0] is out and out[1] == "x" and not out.flags.writeable
