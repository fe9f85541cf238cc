"""The error hierarchy: names, attributes, and that every error pickles with them."""

import pickle

import pytest

import soma
from soma import (
    DeviceError,
    GraphError,
    NodeError,
    PlacementError,
    PostconditionError,
    RunTimeout,
    SomaError,
    WorkerDied,
)


def test_hierarchy():
    assert issubclass(DeviceError, SomaError) and issubclass(DeviceError, ValueError)
    assert issubclass(GraphError, SomaError) and issubclass(GraphError, ValueError)
    assert issubclass(PlacementError, SomaError)
    assert issubclass(NodeError, SomaError)
    assert issubclass(PostconditionError, NodeError)
    assert issubclass(WorkerDied, SomaError)
    assert issubclass(RunTimeout, SomaError) and issubclass(RunTimeout, TimeoutError)


@pytest.mark.parametrize(
    "err, attrs",
    [
        (NodeError("enc", "node `enc` failed: x", remote_traceback="Traceback..."), {"node": "enc", "remote_traceback": "Traceback..."}),
        (PostconditionError("enc", "cuda:0", "cpu"), {"node": "enc", "declared": "cuda:0", "actual": "cpu"}),
        (WorkerDied("worker w1 died", worker="w1", pid=123, node="enc"), {"worker": "w1", "pid": 123, "node": "enc"}),
        (RunTimeout("timed out; still running: `a`", nodes=("a",)), {"nodes": ("a",)}),
        (PlacementError("node `enc` ...", node="enc", devices=("cpu",)), {"node": "enc", "devices": ("cpu",)}),
    ],
)
def test_errors_pickle_with_their_attributes(err, attrs):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err)
    assert str(back) == str(err)
    for name, value in attrs.items():
        assert getattr(back, name) == value


def test_remote_traceback_prints_the_worker_text():
    from soma.errors import RemoteTraceback

    tb = RemoteTraceback("Traceback (most recent call last):\n  File x\nValueError: x\n")
    assert "Traceback in the worker" in str(tb) and "ValueError: x" in str(tb)
    assert pickle.loads(pickle.dumps(tb)).text == tb.text


def test_all_names_are_exported():
    for name in ["SomaError", "DeviceError", "GraphError", "PlacementError", "NodeError",
                 "PostconditionError", "WorkerDied", "RunTimeout"]:
        assert getattr(soma, name).__name__ == name
