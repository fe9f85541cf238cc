"""`setup(ctx)`: once per copy, in the copy's process, before its first forward; on every runner."""

import os

import pytest

import soma
from soma import Graph, NodeError
from tests.conftest import cuda_available
from tests.run.nodes import (
    EqualToItsKind,
    MakesOnDevice,
    SetupCounter,
    SetupFailsOnce,
    SetupSees,
)


def test_setup_runs_once_before_the_first_forward(runner):
    g = Graph.somatize(SetupCounter().on("meta"))
    outs = [runner.run(g, i) for i in range(5)]
    assert [setups for _, setups, _ in outs] == [1] * 5
    pids = {pid for pid, _, _ in outs}
    if isinstance(runner, soma.Executor):
        assert pids == {os.getpid()}  # in-process: the one instance, here
    else:
        assert os.getpid() not in pids and len(pids) == 1  # in one worker's (or actor's) process, not here
        if isinstance(runner, soma.Local):
            assert pids <= set(runner.pids())  # one of the pool's workers


def test_setup_sees_its_nodes_ctx(runner):
    node = SetupCounter()
    runner.run(Graph.somatize(node.named("counted").on("meta")), 0)
    if isinstance(runner, soma.Executor):  # in a worker the copy's ctx is not visible from here
        assert node.setup_ctx == ("counted", "meta", None)
    # ... so the copy reports it: the same node id and device everywhere, a worker only in Local
    in_worker = not isinstance(runner, soma.Executor)
    assert runner.run(Graph.somatize(SetupSees().named("seen").on("meta")), 0) == ("seen", "meta", in_worker)


def test_two_equal_nodes_are_two_nodes_each_with_its_own_setup(runner):
    # (a node's setup-done flag and lock were kept by hash: the second of two equal nodes never ran its setup)
    g = Graph.somatize(EqualToItsKind().named("a").on("meta") | EqualToItsKind().named("b").on("meta"))
    in_worker = not isinstance(runner, soma.Executor)
    assert runner.run(g, 0) == (("a", "meta", in_worker), ("b", "meta", in_worker))


def test_a_setup_that_raises_is_the_nodes_error_and_is_tried_again(runner):
    g = Graph.somatize(SetupFailsOnce())
    with pytest.raises(NodeError, match=r"^node `setup_fails_once` failed: setup raised ValueError: the model file "
                                        r"is not there yet$") as info:
        runner.run(g, 0)
    assert isinstance(info.value.__cause__, ValueError)
    assert runner.run(g, 0) == 2  # the same copy: its setup tried again, once, before this forward


@pytest.mark.skipif(cuda_available(), reason="checks the message on a machine without CUDA")
def test_a_node_on_a_missing_gpu_says_which_device_this_machine_lacks():
    pytest.importorskip("torch")
    g = Graph.somatize(MakesOnDevice().named("enc").on("cuda:0"))
    with pytest.raises(NodeError, match=r"^node `enc` failed: it is placed on `cuda:0`, but this machine has no CUDA "
                                        r"device \(torch.cuda.is_available\(\) is False\); [A-Za-z]+Error: "):
        soma.Executor().run(g, 0)
