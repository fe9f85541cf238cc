"""`map`: the same contract on every runner (SPEC 7.4), then what only a pool of workers adds."""

import itertools
import json
import os
import signal
import time

import pytest

from soma import Graph, NodeError, RunTimeout, WorkerDied
from tests.conftest import in_threads, wait_for
from tests.nodes import AddOne, Double, Identity, OneCopyCounter, Sleep
from tests.run.nodes import (
    AppendLine,
    FailOn,
    NotReentrant,
    OneCopySleep,
    PidAfter,
    SetupCounter,
)

pytestmark = pytest.mark.timeout(120)


def chain_with_a_wave():
    return Graph.somatize(AddOne() >> (Double() | Identity()) >> Identity().named("join"))


class Counted:
    """An iterable that counts how many items were taken from it."""

    def __init__(self, items):
        self.items, self.taken = items, 0

    def __iter__(self):
        for x in self.items:
            self.taken += 1
            yield x


# -- what every runner's map promises ------------------------------------------------------------

def test_map_gives_what_run_gives_in_order(runner):
    g = chain_with_a_wave()
    xs = list(range(30))
    assert list(runner.map(g, xs)) == [runner.run(g, x) for x in xs]


def test_unordered_map_gives_every_output_once(runner):
    g = chain_with_a_wave()
    assert sorted(runner.map(g, range(30), ordered=False)) == sorted(runner.run(g, x) for x in range(30))


def test_map_is_lazy_and_bounded_by_its_window(runner):
    source = Counted(range(1000))
    it = runner.map(Graph.somatize(AddOne()), source, window=5)
    yielded = 0
    for _ in range(20):
        next(it)
        yielded += 1
        assert source.taken - yielded <= 5
    it.close()
    assert source.taken <= 25


def test_map_takes_from_an_endless_source(runner):
    outputs = runner.map(Graph.somatize(AddOne()), itertools.count())
    assert list(itertools.islice(outputs, 50)) == list(range(1, 51))
    outputs.close()


def test_a_failing_input_raises_in_its_place_with_its_index(runner):
    g = Graph.somatize(FailOn(7) >> AddOne())
    got = []
    with pytest.raises(NodeError, match=r"^node `fail_on` failed: ValueError: bad input 7$") as info:
        for y in runner.map(g, range(20)):
            got.append(y)
    assert got == list(range(1, 8))  # every earlier output first, in order
    assert info.value.index == 7 and info.value.node == "fail_on"
    assert runner.run(g, 1) == 2  # the runner goes on


def test_a_failing_input_in_an_unordered_map_comes_after_every_earlier_output(runner):
    got = []
    with pytest.raises(NodeError) as info:
        for y in runner.map(Graph.somatize(FailOn(5)), range(20), ordered=False):
            got.append(y)
    assert info.value.index == 5 and set(range(5)) <= set(got) and 5 not in got


def test_an_iterable_that_raises_raises_after_the_outputs_before_it(runner):
    def source():
        yield from range(4)
        raise LookupError("the dataset ran dry")

    got = []
    with pytest.raises(LookupError, match="ran dry"):
        for y in runner.map(Graph.somatize(AddOne()), source()):
            got.append(y)
    assert got == [1, 2, 3, 4]


def test_progress_callable_hears_done_and_total(runner):
    calls = []
    list(runner.map(Graph.somatize(AddOne()), range(6), progress=lambda done, total: calls.append((done, total))))
    assert calls == [(i, 6) for i in range(1, 7)]
    calls.clear()
    list(runner.map(Graph.somatize(AddOne()), iter(range(3)), progress=lambda d, t: calls.append((d, t))))
    assert calls == [(1, None), (2, None), (3, None)]


class _Stderr:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_progress_true_draws_one_line_on_a_terminal(runner, monkeypatch):
    term = _Stderr(tty=True)
    monkeypatch.setattr("sys.stderr", term)
    list(runner.map(Graph.somatize(AddOne()), range(5), progress=True))
    monkeypatch.undo()
    last = term.text.split("\r")[-1]
    assert last.startswith("soma map: 5/5 done, ") and "/s, " in last and last.endswith("\n")


def test_progress_true_says_nothing_where_stderr_is_not_a_terminal(runner, monkeypatch):
    """SPEC 7.4: "only when stderr is a terminal" (a log, nohup, CI, pytest's capture: not a word)."""
    log = _Stderr(tty=False)
    monkeypatch.setattr("sys.stderr", log)
    assert list(runner.map(Graph.somatize(AddOne()), range(5), progress=True)) == [1, 2, 3, 4, 5]
    monkeypatch.undo()
    assert log.text == ""


def test_map_arguments_are_checked(runner):
    with pytest.raises(ValueError, match="window must be a positive number of inputs, got 0"):
        runner.map(Graph.somatize(AddOne()), [1], window=0)
    with pytest.raises(TypeError):
        runner.map(Graph.somatize(AddOne()), 5)
    for ordered in (None, "no", 0):
        with pytest.raises(TypeError, match=f"map's ordered must be True or False, got {ordered!r}"):
            runner.map(Graph.somatize(AddOne()), [1], ordered=ordered)


def test_a_slow_input_times_out_with_its_index(runner):
    g = Graph.somatize(Sleep(0.0) >> FailOn(None))
    slow = Graph.somatize(Sleep(5).named("slow"))
    with pytest.raises(RunTimeout) as info:
        list(runner.map(slow, [0], timeout=0.3))
    assert info.value.index == 0 and "slow" in str(info.value)
    assert runner.run(g, 1) == 1


def test_no_node_object_runs_two_inputs_at_once(runner):
    g = Graph.somatize(NotReentrant(0.005))

    def go(_):
        for _ in runner.map(g, range(20)):
            pass
        for i in range(10):
            runner.run(g, i)

    in_threads(go, 3)  # (NotReentrant raises if a second input enters while one runs)


# -- what a pool of workers adds ------------------------------------------------------------------------

def test_a_node_with_one_copy_sees_every_input_in_order_in_one_process(local):
    out = list(local.map(Graph.somatize(OneCopyCounter()), range(60)))
    assert [calls for calls, _ in out] == list(range(1, 61))
    assert len({pid for _, pid in out}) == 1
    more = local.run(Graph.somatize(Identity()), 0), list(local.map(Graph.somatize(Identity()), range(3)))
    assert more == (0, [0, 1, 2])


@pytest.mark.parametrize("window", [2, 5])
def test_a_caller_slower_than_the_timeout_gets_every_output_that_came_in_time(local, window):
    """The timeout is each input's, not the caller's: an output that came while the caller was busy is an
    output, even once its deadline has passed (it waited in the map's queue, not in a worker)."""
    g = Graph.somatize(AddOne())
    local.run(g, 0)  # (warm: its inputs then finish at once, long before the caller asks for them)
    got = []
    for y in local.map(g, range(5), window=window, timeout=0.5):
        got.append(y)
        time.sleep(0.6)  # the caller's own work, longer than any input's timeout
    assert got == [1, 2, 3, 4, 5]


def test_a_timeout_names_the_node_still_running_not_a_finished_branch(local):
    """A wave's branches run on threads of the worker; one that has finished is not running any more."""
    g = Graph.somatize((Identity() | Identity().named("other")) >> Identity().named("join") >> Sleep(5).named("slow"))
    with pytest.raises(RunTimeout) as info:
        list(local.map(g, [0, 1], window=2, timeout=1.0))  # window >= workers: each input whole on a worker
    assert info.value.nodes == ("slow",), str(info.value)


def test_a_stateless_node_is_copied_to_every_worker(local):
    pids = set(local.map(Graph.somatize(PidAfter(0.02)), range(40)))
    assert pids == set(local.pids())


def test_setup_runs_once_per_copy_in_its_process(local):
    out = list(local.map(Graph.somatize(SetupCounter()), range(40), window=8))
    by_pid: dict = {}
    for pid, setups, calls in out:
        assert setups == 1
        by_pid.setdefault(pid, []).append(calls)
    assert set(by_pid) <= set(local.pids())
    for calls in by_pid.values():
        assert calls == sorted(calls) and calls[0] == 1


def test_concurrent_runs_of_one_graph_use_the_whole_pool(local):
    g = Graph.somatize(PidAfter(0.3))
    local.run(g, 0)
    got = in_threads(lambda _: local.run(g, 0), 2, seconds=30)
    assert sorted(got) == sorted(local.pids())


@pytest.mark.parametrize("stage", [Sleep, OneCopySleep], ids=["copies=None", "copies=1"])
def test_two_stages_overlap(local, stage, tmp_path):
    g = Graph.somatize(stage(0.1).named("first") >> stage(0.1).named("second"))
    list(local.map(g, range(2)))  # copies made
    with local.trace(tmp_path / "stages.json"):
        assert list(local.map(g, range(10))) == list(range(10))
    with open(tmp_path / "stages.json") as f:
        spans = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "node"]
    first = [e for e in spans if e["name"] == "first"]
    second = [e for e in spans if e["name"] == "second"]
    assert len(first) == len(second) == 10

    def overlap(a, b):
        return a["args"]["input"] != b["args"]["input"] and a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]

    if stage is OneCopySleep:  # one copy of each stage: a pipeline, different inputs in different nodes at once
        assert any(overlap(a, b) for a in first for b in second)
    else:  # copies everywhere: each input whole on a worker, several inputs in copies of one node at once
        assert any(overlap(a, b) and a["args"]["worker"] != b["args"]["worker"] for a in first for b in first)


def test_leaving_a_map_early_leaves_no_backlog(local, tmp_path):
    log = tmp_path / "ran"
    g = Graph.somatize(AppendLine(str(log), seconds=0.01))
    outputs = local.map(g, range(10_000), window=6)
    assert [next(outputs) for _ in range(3)] == [0, 1, 2]
    outputs.close()
    assert local.run(Graph.somatize(AddOne()), 1) == 2
    wait_for(lambda: not any(local.snapshot().jobs), what="the cancelled jobs' outcomes")
    after = local.snapshot()
    assert not any(after.jobs) and after.inputs == 0 and after.waiting == 0
    assert len(log.read_text().split()) <= 3 + 6  # no more ran than were taken


def test_a_worker_killed_in_the_middle_of_a_map(local, tmp_path):
    g = Graph.somatize(PidAfter(0.05).named("slow"))
    got = []
    with pytest.raises(WorkerDied) as info:
        for i, pid in enumerate(local.map(g, range(200), window=4)):
            got.append(pid)
            if i == 5:
                # Every worker: the one that ran input 5 may have none of the inputs in flight (the host placed
                # them all at the other, which had room first), and then the map rightly goes on without it.
                for worker in local.pids():
                    os.kill(worker, signal.SIGKILL)
    err = info.value
    assert err.node == "slow" and err.index is not None and err.index >= 5
    assert "while running node `slow`" in str(err) or "before it ran node `slow`" in str(err)
    assert list(local.map(Graph.somatize(AddOne()), range(5))) == [1, 2, 3, 4, 5]  # the runner goes on


def test_a_map_keeps_its_graph_alive_while_other_graphs_run(local):
    import gc

    quick = Graph.somatize(AddOne())
    outputs = local.map(Graph.somatize(Sleep(0.002)), itertools.count())  # the only reference: the map's
    for i, y in enumerate(outputs):
        assert y == i
        if i == 50:
            gc.collect()
            assert local.run(quick, 1) == 2  # a run in the middle lets the pool forget what the host dropped
        if i == 120:
            break
    outputs.close()
