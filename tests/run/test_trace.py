"""`runner.trace(path)`: Chrome trace-event JSON a person opens in Perfetto, on every runner."""

import json
import os
import threading
import time

import pytest

import soma
from soma import Graph, NodeError, SomaError
from tests.conftest import wait_for
from tests.nodes import AddOne, Boom, Double, Identity, MarkThenSleep, Rendezvous

pytestmark = pytest.mark.timeout(120)


def load(path):
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    nodes = [e for e in events if e.get("cat") == "node"]
    meta = [e for e in events if e["ph"] == "M"]
    return doc, events, nodes, meta


def worker_pids(runner, meta):
    """The processes where a runner's nodes run: the pool's workers, the actors (the tracks Ray's trace names
    so), or this one (the Executor)."""
    if isinstance(runner, soma.Local):
        return set(runner.pids())
    if isinstance(runner, soma.Ray):
        actors = {e["pid"] for e in meta if e["name"] == "process_name" and e["args"]["name"].startswith("Ray actor ")}
        return actors - {os.getpid()}
    return {os.getpid()}


def test_every_node_execution_of_run_and_map_is_one_complete_event(runner, tmp_path):
    g = Graph.somatize(AddOne() >> (Double() | Identity()) >> Identity().named("join"))
    path = tmp_path / "run.json"
    before = time.monotonic_ns()
    with runner.trace(path):
        runner.run(g, 1)
        assert list(runner.map(g, range(5))) == [((i + 1) * 2, i + 1) for i in range(5)]
    took_us = (time.monotonic_ns() - before) / 1000
    doc, events, nodes, meta = load(path)
    for node in ("add_one", "double", "identity", "join"):
        per_input = sorted((e["args"]["input"] is None, e["args"]["input"] or 0) for e in nodes if e["name"] == node)
        assert per_input == [(False, i) for i in range(5)] + [(True, 0)], node  # once per input, and the run
    for e in nodes:
        assert e["ph"] == "X" and e["dur"] > 0 and e["pid"] in worker_pids(runner, meta)
        assert 0 <= e["ts"] and e["ts"] + e["dur"] <= took_us
        assert set(e["args"]) == {"node", "device", "worker", "input", "outcome"}
        assert e["args"]["outcome"] == "ok" and e["args"]["node"] == e["name"]
    names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert names[os.getpid()].startswith("host")
    if isinstance(runner, soma.Local):
        for pid in {e["pid"] for e in nodes}:
            assert names[pid] == f"worker {next(e['args']['worker'] for e in nodes if e['pid'] == pid)} (pid {pid})"
        assert {e["name"] for e in events if e.get("cat") == "host"} >= {"run", "encode input", "decode output"}
    assert {(e["pid"], e["tid"]) for e in nodes} <= {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    assert doc["otherData"]["clock"] == "CLOCK_MONOTONIC"


def test_a_wave_on_two_workers_shows_two_overlapping_tracks(local, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    g = Graph.somatize(Rendezvous(a, b) | Rendezvous(b, a))  # each waits for the other: they overlap for sure
    path = tmp_path / "wave.json"
    with local.trace(path):
        local.run(g, 0)
    _, _, nodes, _ = load(path)
    a, b = sorted(nodes, key=lambda e: e["ts"])
    assert a["pid"] != b["pid"] and a["args"]["worker"] != b["args"]["worker"]
    assert b["ts"] < a["ts"] + a["dur"]  # they ran at the same time, in two processes


def test_a_failing_run_is_recorded_with_its_error(runner, tmp_path):
    path = tmp_path / "fail.json"
    with runner.trace(path):
        with pytest.raises(NodeError):
            runner.run(Graph.somatize(Identity() >> Boom()), 1)
    _, _, nodes, _ = load(path)
    assert [(e["name"], e["args"]["outcome"]) for e in sorted(nodes, key=lambda e: e["ts"])] == [
        ("identity", "ok"), ("boom", "ValueError")]


def test_nothing_is_recorded_outside_a_block(runner, tmp_path):
    g = Graph.somatize(AddOne())
    runner.run(g, 1)
    list(runner.map(g, range(3)))
    path = tmp_path / "one.json"
    with runner.trace(path):
        runner.run(g, 2)
    written = path.read_text()
    runner.run(g, 3)
    list(runner.map(g, range(3)))
    _, _, nodes, _ = load(path)
    assert len(nodes) == 1 and runner._trace is None
    assert path.read_text() == written  # the file was not touched after the block


def test_a_block_that_ends_while_other_threads_run_still_writes_valid_json(runner, tmp_path):
    marker = str(tmp_path / "running")
    g = Graph.somatize(MarkThenSleep(marker, 0.3))
    path = tmp_path / "busy.json"
    threads = [threading.Thread(target=lambda: list(runner.map(g, range(3)))) for _ in range(2)]
    with runner.trace(path):
        for t in threads:
            t.start()
        wait_for(lambda: os.path.exists(marker), what="a node running when the block ends")
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    doc, _, nodes, _ = load(path)
    assert isinstance(doc["traceEvents"], list)
    assert all(e["dur"] >= 0 for e in nodes)


def test_one_trace_at_a_time(runner, tmp_path):
    with runner.trace(tmp_path / "a.json"):
        with pytest.raises(SomaError, match="already tracing into"):
            with runner.trace(tmp_path / "b.json"):
                pass
    assert (tmp_path / "a.json").exists() and not (tmp_path / "b.json").exists()


class SlowSetup(soma.Node):
    """A setup that takes 0.3 s (a model loading), then a quick forward."""

    def setup(self, ctx):
        time.sleep(0.3)

    def forward(self, x, ctx):
        return soma.Done(x)


def test_setup_is_a_span_of_its_own_and_the_first_forward_does_not_include_it(runner, tmp_path):
    path = tmp_path / "setup.json"
    with runner.trace(path):
        runner.run(Graph.somatize(SlowSetup()), 1)
        runner.run(Graph.somatize(SlowSetup()), 2)  # (a new node: its own setup again)
    doc, events, nodes, meta = load(path)
    setups = [e for e in events if e.get("cat") == "setup"]
    assert [e["name"] for e in setups] == ["setup slow_setup"] * 2
    assert all(e["dur"] >= 300_000 for e in setups)
    for forward in nodes:
        setup = next(e for e in setups if e["tid"] == forward["tid"] and e["pid"] == forward["pid"]
                     and e["ts"] <= forward["ts"])
        assert setup["ts"] + setup["dur"] <= forward["ts"] + 1  # the forward starts after its setup ends
        assert forward["dur"] < 300_000


def test_a_workers_loading_of_node_code_and_its_start_are_spans_and_threads_are_named_by_role(tmp_path):
    path = tmp_path / "start.json"
    pool = soma.Local(workers=2)
    with pool.trace(path):  # started inside the block: its workers' starts are in it
        pool.run(Graph.somatize(AddOne() | Double()), 1)
    pool.close()
    doc, events, nodes, meta = load(path)
    starts = sorted(e["name"] for e in events if e.get("cat") == "start")
    assert starts == ["start worker w0", "start worker w1"]
    loads = [e for e in events if e.get("cat") == "load"]
    assert sorted(e["name"] for e in loads) == ["load add_one", "load double"]
    threads = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {"w0 lane 0", "w1 lane 0"} <= threads
    assert not any("thread " in name for name in threads), threads  # named by what they do, not by their tid


def test_a_trace_path_that_cannot_be_written_is_refused_as_the_block_opens(runner, tmp_path):
    """A trace's file is written when its block ends: a missing or unwritable folder, or a folder for a path, is
    a SomaError as the block opens, not after it ran with everything it recorded lost (a raw FileNotFoundError
    or IsADirectoryError at its end)."""
    for path, why in ((tmp_path / "missing" / "t.json", "its folder .*missing does not exist"),
                      (tmp_path, "is a folder: name a file in it"), ("", "names no file")):
        with pytest.raises(SomaError, match=f"^trace\\(.*\\): {why}"):
            with runner.trace(path):
                pytest.fail("the block ran")
    with runner.trace(tmp_path / "t.json"):  # (and the runner traces on)
        runner.run(Graph.somatize(AddOne()), 1)
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
