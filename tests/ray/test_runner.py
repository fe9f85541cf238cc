"""soma.Ray on real Ray, kept on loopback: one session for every check, then one two-machine cluster.

Ray binds the machine's own network address unless it runs where only loopback
exists, so the checks run in a fresh network namespace (`unshare -n`, then
`ip link set lo up`): nothing they start can be reached from, or reach, the
network. They run in one subprocess (tests/ray/checks.py: starting Ray takes
seconds, so they share one session), which writes what each check observed as
JSON; each test below asserts on one check's observations.

Skipped, with the reason, when ray is not installed or the machine does not
allow a network namespace (unshare needs root or unprivileged user namespaces).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import why_no_loopback_namespace

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ROOT / "tests" / "ray" / "checks.py"
RUN_S = 600  # the whole subprocess: ~3 min on a quiet machine, up to ~8 min with its 2 cores shared

# own_ray: a Ray of its own (in the subprocess), so tests/conftest.py runs it last, the session's Ray down first
pytestmark = [pytest.mark.timeout(RUN_S + 60), pytest.mark.own_ray]


def why_ray_cannot_run_here() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'soma[ray]')"
    return why_no_loopback_namespace()


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """Run every Ray check once (in a loopback-only network namespace) and return what each observed."""
    reason = why_ray_cannot_run_here()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("ray") / "observed.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    command = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, str(CHECKS),
               str(out)]
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: one kill ends Ray with it
    try:
        _, stderr = proc.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the Ray checks did not finish in {RUN_S} s; their progress:\n{_progress(stderr)}")
    if not out.exists():
        pytest.fail(f"the Ray checks wrote nothing (exit code {proc.returncode}); stderr:\n{stderr[-4000:]}")
    results = json.loads(out.read_text())
    results["_progress"] = _progress(stderr)
    return results


def _progress(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if line.startswith("[") and " s] " in line)


def check(observed, name: str):
    """What one check observed; a check that raised fails its test with the traceback."""
    result = observed.get(name)
    if result is None:
        pytest.fail(f"the Ray check `{name}` did not run; progress:\n{observed['_progress']}")
    if not result["ok"]:
        pytest.fail(f"the Ray check `{name}` raised:\n{result['traceback']}")
    return result["value"]


# -- one session ------------------------------------------------------------------------------------------

def test_ray_gives_the_executors_answers_through_run_and_map(observed):
    seen = check(observed, "same_answers")
    assert seen["run"] == seen["executor"]
    assert seen["map"] == seen["executor"]
    assert sorted(seen["map_unordered"], key=lambda out: out[1]) == sorted(seen["executor"], key=lambda o: o[1])


def test_ray_branches_of_one_wave_overlap_on_different_actors(observed):
    seen = check(observed, "wave_overlap")
    first, second = seen["branches"]
    assert first["saw_other"] and second["saw_other"]  # each waited for the other's marker: they ran at once
    assert first["pid"] != second["pid"] and seen["driver_pid"] not in (first["pid"], second["pid"])
    assert first["worker"] != second["worker"]
    assert max(first["start"], second["start"]) < min(first["end"], second["end"])  # the intervals overlap


def test_ray_one_copy_node_keeps_its_state_across_runs_and_maps(observed):
    seen = check(observed, "copies_one_keeps_state")
    counts = [count for count, _ in seen["runs"] + seen["map"] + seen["after_map"]]
    assert [count for count, _ in seen["runs"]] == [1, 2, 3]
    assert sorted(count for count, _ in seen["map"]) == [4, 5, 6, 7, 8, 9]
    assert [count for count, _ in seen["after_map"]] == [10, 11]
    assert len({pid for _, pid in seen["runs"] + seen["map"] + seen["after_map"]}) == 1 and len(counts) == 11
    # its one copy runs a map's inputs in input order, the first ones too (sent while its actor was starting)
    assert [count for count, _ in seen["fresh_map"]] == list(range(1, 41))


def test_ray_map_spreads_a_stateless_node_over_several_actors(observed):
    seen = check(observed, "map_spreads_over_actors")
    assert len(seen["pids"]) >= 2, seen
    assert seen["driver_pid"] not in seen["pids"]


def test_ray_map_sends_inputs_in_batches_each_with_its_own_outcome(observed):
    seen = check(observed, "map_batches")
    n = seen["inputs"]
    # (a) the Executor's answers, in order and as they finish
    assert seen["ordered"] == seen["untraced"] == seen["executor"]
    assert sorted(seen["unordered"]) == sorted(seen["executor"])
    # (c) batches: both nodes of the chain took fewer calls than inputs (window 4 over 2 copies: 2 per call),
    # counted in the trace (one `ray call` event per Ray call), each input carried by exactly one call per node
    assert seen["copies"] == 2
    assert all(0 < calls < n for calls in seen["calls_ordered"]), seen["calls_ordered"]
    assert all(0 < calls < 2 * n for calls in seen["calls_both"]), seen["calls_both"]
    assert seen["carried"] == [list(range(n))] * 4 and seen["batches_counted"]
    # (b) one input fails: exactly its error, with its index, after every earlier output (SPEC 7.4) ...
    for ordered in (True, False):
        failed = seen[f"failed_{ordered}"]
        assert (failed["type"], failed["node"], failed["index"]) == ("NodeError", "fails", 11), failed
        assert failed["message"] == "node `fails` failed: ValueError: bad input 11"
        if ordered:
            assert failed["before"] == seen["executor"][:11]
        else:  # as they finish: inputs after it may finish first (one per call until measured cheap)
            assert set(seen["executor"][:11]) <= set(failed["before"]) <= set(seen["executor"]) - {24}, failed
    assert seen["failed_calls"] < 2 * 12  # the two maps ran inputs 0..11 at least: in batches there too
    # ... and inside its batch the other input's value comes back beside the failure
    (ten, ten_ok, ten_value), (eleven, eleven_ok, eleven_error) = seen["failing_batch"]
    assert (ten, ten_ok, ten_value) == (10, True, 22)
    assert (eleven, eleven_ok, eleven_error["type"], eleven_error["node"]) == (11, False, "NodeError", "fails")
    # (d) an actor dies in a batch: WorkerDied naming the node, for every input of that batch; runs go on
    died = seen["died"]
    assert (died["type"], died["node"]) == ("WorkerDied", "dies") and died["index"] <= 9, died
    assert "its worker process has died" in died["message"] and died["worker"] in died["message"]
    assert died["before"] == [x + 1 for x in range(died["index"])]
    assert [index for index, _, _ in seen["dying_batch"]] == [8, 9]
    for _, ok, err in seen["dying_batch"]:
        assert not ok and (err["type"], err["node"]) == ("WorkerDied", "dies") and err["worker"] in err["message"]
    assert seen["after_run"] == 2 and seen["after_map"] == [1, 2, 3, 4, 5, 6]


def test_ray_node_error_carries_the_remote_traceback_and_cause(observed):
    seen = check(observed, "node_error")
    run = seen["run"]
    assert (run["type"], run["module"], run["node"]) == ("NodeError", "soma.errors", "boom")
    assert run["message"] == "node `boom` failed: ValueError: boom on 3"
    assert 'raise ValueError(f"boom on {x!r}")' in run["remote_traceback"]
    assert "tests/nodes.py" in run["remote_traceback"]
    assert run["cause"] == "ValueError('boom on 3')" and run["cause_chain"] == ["NodeError", "ValueError",
                                                                             "RemoteTraceback"]
    assert seen["map"]["index"] == 2 and seen["map"]["node"] == "add_one" and seen["map_before"] == [2, 3]
    assert seen["wave"]["message"] == "node `boom` failed: ValueError: boom on 1"
    assert seen["wave"]["notes"] == ["another branch of the same wave also failed: node `boom_2` failed: "
                                     "ValueError: boom on 1"]
    for name in ("upstream_of_join", "upstream_of_last_wave"):  # one failure, though both branches pass it on
        ray_error, executor_error = seen[f"{name}_ray"], seen[f"{name}_executor"]
        assert ray_error["message"] == executor_error["message"] == "node `boom` failed: ValueError: boom on 1"
        assert ray_error["type"] == executor_error["type"] == "NodeError"
        assert ray_error["notes"] == executor_error["notes"] == [], name
    unpicklable = seen["unpicklable"]
    assert unpicklable["type"] == "NodeError" and unpicklable["node"] == "returns_unpicklable"
    assert unpicklable["message"] == ("node `returns_unpicklable` failed: its output cannot be sent back to the "
                                      "driver: TypeError: Unpicklable refuses to be pickled (return plain data, "
                                      "tensors, or picklable objects)")  # (Local's words, "host" aside)
    assert seen["next_run"] == 2


def test_ray_an_input_ray_cannot_serialize_is_a_node_error_naming_the_entry_node_in_its_place(observed):
    seen = check(observed, "unsendable_input")
    why = "TypeError: Unpicklable refuses to be pickled"
    assert seen["run"]["type"] == "NodeError" and seen["run"]["node"] == "add_one"
    assert seen["run"]["message"] == f"node `add_one` failed: its input cannot be sent to a Ray actor: {why}"
    assert seen["run_wave_first"]["message"] == seen["run"]["message"]  # put in the object store: the same words
    mapped = seen["map"]
    assert (mapped["type"], mapped["node"], mapped["index"], mapped["before"]) == ("NodeError", "add_one", 2, [4, 6])
    assert mapped["message"] == seen["run"]["message"]
    (zero, zero_ok, zero_value), (one, one_ok, one_error), (two, two_ok, two_value) = seen["batch"]
    assert (zero, zero_ok, zero_value, two, two_ok, two_value) == (0, True, 4, 2, True, 8)  # the others are fine
    assert (one, one_ok, one_error["node"], one_error["message"]) == (1, False, "add_one", seen["run"]["message"])
    assert seen["load_after"] == 0  # a refused input leaves no load on the copy it was meant for
    assert seen["next_run"] == 4


def test_ray_postcondition_has_the_exact_text_where_the_node_ran_and_where_values_arrive(observed):
    seen = check(observed, "postcondition")
    meta = seen["declared_meta"]
    assert meta["type"] == "PostconditionError" and (meta["declared"], meta["actual"]) == ("meta", "cpu")
    assert meta["message"] == "node `returns_on` failed: it declared `meta` but returned a value on `cpu`"
    moved = "node `returns_moving_device` failed: it declared `cpu` but returned a value on `meta`"
    assert seen["moved_on_the_way"]["message"] == moved and seen["moved_on_the_way"]["type"] == "PostconditionError"
    assert seen["moved_to_the_driver"]["message"] == moved
    assert seen["obeying"] == "Located('meta')"


def test_ray_tensors_of_mibs_travel_both_ways(observed):
    seen = check(observed, "tensors")
    assert seen["in_bytes"] == 4 << 20 and seen["out_equal"] and seen["wave_equal"]
    assert seen["x_untouched"] == float((4 << 20) // 4 - 1)  # the caller's input is not written to
    assert seen["made_bytes"] == 6 << 20 and seen["made_all"] == seen["made_max"] == 4.0  # 3 + 1, writable here
    assert seen["strides_kept"] and seen["array_writable"]
    autograd = seen["autograd"]
    assert autograd["type"] == "NodeError" and autograd["node"] == "requires_grad_output"
    assert autograd["message"].startswith("node `requires_grad_output` failed: it returned a tensor that requires grad "
                                          "and carries an autograd graph, which cannot cross into another process")


def test_ray_an_actor_that_dies_is_worker_died_naming_the_node_and_the_next_run_works(observed):
    seen = check(observed, "actor_dies")
    err = seen["error"]
    assert err["type"] == "WorkerDied" and err["node"] == "die_on"
    assert err["worker"] and err["worker"] in err["message"] and isinstance(err["pid"], int)
    assert f"pid {err['pid']}" in err["message"] and "node `die_on`" in err["message"]
    assert "its worker process has died" in err["message"]
    assert seen["next_run"][0] == 2 and seen["next_run"][1] != err["pid"]  # a new copy, in a new process
    # Input 2 kills the copy; inputs queued on that copy fail with it (as on a Local worker that dies).
    assert seen["map_error"]["type"] == "WorkerDied" and seen["map_error"]["node"] == "die_on"
    assert seen["map_error"]["index"] in (0, 1, 2)
    assert [y for y, _ in seen["after_map"]] == [2, 3]


def test_ray_a_timeout_names_the_running_node_and_replaces_its_actor(observed):
    seen = check(observed, "timeout")
    err = seen["error"]
    assert err["type"] == "RunTimeout" and err["is_timeout_error"]
    assert err["nodes"] == ["slow_on"] and err["waiting"] == ["identity"]
    assert err["message"].startswith("run timed out after 1.0 s; still running: `slow_on` (on Ray actor ")
    assert "waiting to run: `identity`" in err["message"]
    assert seen["after"][0] == 1 and seen["after"][1] != seen["before"][1]  # the slow copy was replaced
    assert seen["map_error"]["index"] == 1 and seen["map_error"]["nodes"] == ["slow_on"]
    # a copies=1 node runs its calls in order; asked while another input's call waits for its upstream in
    # that queue, it still tells what it runs: that waiting input was waiting (its copy kept running input 1),
    # and input 1 was running there when its own time was up
    behind = seen["behind_error"]
    assert behind["type"] == "RunTimeout" and behind["nodes"] == ["sleep"], behind
    assert behind["waiting"] == ["one_copy_mark_then_sleep"]
    one = seen["one_copy_error"]
    assert one is not None and one["type"] == "RunTimeout", seen
    assert one["nodes"] == ["one_copy_mark_then_sleep"] and one["waiting"] == []
    assert seen["one_copy_after"][0] == 1 and seen["one_copy_after"][1] != seen["one_copy_before"][1]
    # timed out while its copy was starting: that copy never starts it once up (it did, Dec 7)
    starting = seen["copy_starting"]
    assert starting["error"]["type"] == "RunTimeout" and starting["error"]["waiting"] == ["slow_to_build"]
    assert starting["next"] == "next" and starting["started"] == ["next"], starting
    # inputs waiting behind one whose time ran out on a one-copy node wait, named so (the copy stopped for the
    # first answered nothing for them: "still running"; one's failed ref named nothing at all, Dec 7)
    assert seen["queued_behind"] == [[["one_copy_slow_on_zero"], []], [[], ["one_copy_slow_on_zero"]],
                                     [[], ["one_copy_slow_on_zero"]]], seen["queued_behind"]


def test_ray_actors_of_nodes_the_caller_dropped_are_stopped(observed):
    seen = check(observed, "dropped_nodes_stop_their_actors")
    assert seen["gone_after_s"] is not None, seen


def test_ray_a_gpu_index_no_machine_has_is_a_placement_error_before_anything_runs(observed):
    seen = check(observed, "placement")
    err = seen["error"]
    assert err["type"] == "PlacementError" and err["node"] == "identity"
    assert err["message"].startswith("node `identity` cannot run: it is placed on `cuda:7`, but no machine of the "
                                     "Ray cluster has 8 GPUs")
    assert seen["same_graph_unplaced"] == 2


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU: this machine has none, so the cuda:0 node on Ray "
                                            "cannot run here (the CUDA order is unit-tested in tests/ray/test_devices.py)")
def test_ray_a_cuda0_node_gets_the_gpu_ray_reserved_skipped_without_a_gpu(observed):
    seen = check(observed, "cuda0")
    assert seen["device"] == "cuda:0" and seen["tensor_device"] == "cuda:0" and seen["sum"] == 4.0
    assert len(seen["reserved"]) == 1 and seen["visible"].split(",")[0] == seen["reserved"][0]


def test_ray_errors_are_soma_classes_never_rays(observed):
    seen = check(observed, "no_ray_errors_leak")
    assert len(seen["mros"]) == 2
    for mro in seen["mros"]:
        assert mro[0].startswith("soma.errors.") and not any("ray" in cls.lower() for cls in mro), mro


def test_ray_trace_writes_node_events_with_the_actors_pids(observed):
    seen = check(observed, "traced")
    events = seen["events"]
    assert sorted((e["name"], e["input"] is None) for e in events) == [
        ("ray_node_id", False), ("ray_node_id", False), ("ray_node_id", False), ("ray_node_id", True),
        ("ray_node_id_2", True), ("ray_node_id_3", True)]
    # each event sits on the track of the process its node ran in, as the node itself saw it
    assert sorted((e["name"], e["pid"]) for e in events) == sorted(tuple(pair) for pair in seen["reported"])
    assert seen["driver_pid"] not in {e["pid"] for e in events}
    assert sorted(e["input"] for e in events if e["input"] is not None) == [0, 1, 2]
    for e in events:
        assert seen["process_names"][str(e["pid"])] == f"Ray actor {e['worker']} (node `{e['name']}`, pid {e['pid']})"
        assert e["ts"] >= 0
    assert seen["process_names"][str(seen["driver_pid"])].startswith("host (soma.Ray")


def test_ray_trace_has_one_event_per_ray_call_listing_the_inputs_it_carried(observed):
    seen = check(observed, "traced")
    calls = seen["calls"]
    assert {c["name"] for c in calls} == {"ray call"} and all(c["batch"] == len(c["inputs"]) for c in calls)
    # the run: one call per node, of its one input (None); the map of 3: fewer calls than inputs, each input once
    assert sorted((c["node"], c["inputs"]) for c in calls if c["inputs"] == [None]) == [
        ("ray_node_id", [None]), ("ray_node_id_2", [None]), ("ray_node_id_3", [None])]
    mapped = [c for c in calls if c["inputs"] != [None]]
    assert {c["node"] for c in mapped} == {"ray_node_id"} and len(mapped) < 3
    assert sorted(i for c in mapped for i in c["inputs"]) == [0, 1, 2]
    assert all(seen["enclosed"])  # each node event inside the call that carried its input, on its track
    for c in calls:
        assert seen["process_names"][str(c["pid"])].startswith(f"Ray actor {c['worker']} (node `{c['node']}`")


def test_ray_a_trace_block_has_no_spans_of_an_input_an_earlier_block_left_running(observed):
    seen = check(observed, "trace_blocks")
    assert seen["outputs"] == [True, 0, [True]]
    done = seen["released"]
    assert [e["input"] for e in seen["first"]] == [done]  # the other input had not ended yet
    assert [e["input"] for e in seen["second"]] == [None]  # the run's alone: none of the other input's
    for block in ("first", "second"):  # every span inside its own block, on the driver's clock
        assert all(0 <= e["ts"] <= e["end"] <= seen[f"{block}_us"] for e in seen[block]), (block, seen)


def test_ray_a_session_soma_started_is_shut_down_at_close_and_a_map_held_past_it_goes_quietly(observed):
    """And a map another thread iterates as the runner closes ends with soma's SomaError: it raised "is closed;
    make a new one", or Ray's raw ValueError ("owner is unknown") after Ray's auto-init started a new session
    for its next call (3 of 8), and once Ray ended the process (Dec 7)."""
    seen = check(observed, "session_shut_down")
    under_close = seen.pop("map_on_a_thread")
    assert seen == {"initialized_after_close": False, "held_map": [1, []]}
    assert under_close["type"] == "SomaError", under_close
    assert under_close["message"] == "this soma.Ray was closed while this run was in flight", under_close


def test_ray_started_by_a_first_run_on_a_thread_that_ends_goes_on(observed):
    """Ray ends a local session's head processes when the thread that started them ends (PR_SET_PDEATHSIG): a
    first run from a thread pool's thread left a dead session, and the next call waited 60 s for its GCS, then
    Ray ended the process. soma starts Ray on a thread of its own that lives until close."""
    assert check(observed, "lazy_from_a_thread") == {"first": 2, "then": 3}


# -- two machines -------------------------------------------------------------------------------------------

def test_ray_options_pin_nodes_to_two_machines_of_a_cluster(observed):
    seen = check(observed, "two_machines")
    machines = seen["machines"]
    assert set(machines) == {"host_a", "host_b"} and machines["host_a"] != machines["host_b"]
    (a, on_a, _), (b, on_b, _) = seen["pinned"]
    assert (a, on_a) == ("on_a", machines["host_a"]) and (b, on_b) == ("on_b", machines["host_b"])
    for (a, on_a, _), (b, on_b, _) in seen["pinned_map"]:
        assert (on_a, on_b) == (machines["host_a"], machines["host_b"])
    assert seen["nowhere"]["type"] == "PlacementError"
    assert seen["nowhere"]["message"].startswith("node `on_c` cannot run: no machine of the Ray cluster offers what "
                                                 "it asks for (host_c=1)")
    assert seen["session_left_running"] is True  # a session soma found is left running at close()
    assert seen["actor_a_gone_after_close_s"] is not None  # ... and the actors soma made in it are stopped


def test_ray_a_machine_that_dies_is_worker_died_naming_the_node(observed):
    seen = check(observed, "two_machines")["machine_death"]
    err = seen["error"]
    assert err is not None, seen
    assert err["type"] == "WorkerDied" and err["node"] == "sleeper" and err["worker"] in err["message"]
    assert "its node has died" in err["message"]


# -- long jobs: retries, innocents, errors in their place (tests/ray/checks_tries.py) -----------------------

def test_ray_retries_run_an_input_lost_to_a_dead_actor_again_and_say_how_many_tries(observed):
    seen = check(observed, "retries")
    assert seen["run"] == 70 and len(seen["run_pids"]) == 2 and len(set(seen["run_pids"])) == 2  # two actors
    exhausted, without = seen["exhausted"], seen["without"]
    assert exhausted["type"] == without["type"] == "WorkerDied" and exhausted["node"] == "always_die"
    assert exhausted["tries"] == 2 and exhausted["message"].endswith(
        ": 2 tries, each lost to a dead worker (retries=1)"), exhausted
    assert without["tries"] == 1 and without["message"].endswith(": run again, or pass retries=N"), without
    # a node's own exception and a timeout are never retried
    assert seen["raised"]["type"] == "NodeError" and seen["raised"]["count"] == 1
    assert seen["timed_out"]["type"] == "RunTimeout" and seen["timed_out"]["nodes"] == ["sleep_counting"]
    assert seen["timed_out"]["count"] == 1
    for ordered in (True, False):  # every output once, in order when asked; each doomed input ran again
        mapped = seen[f"map_{ordered}"]
        expected = [10 * i for i in range(30)]
        assert (mapped["outputs"] if ordered else sorted(mapped["outputs"])) == expected, mapped
        assert mapped["died"] == [3, 12, 21]
        # Twice each: the fatal run, then one that lived. A third run only when the second one's actor died
        # under another doomed input of its call (that call's values die with it: at least once, as Ray does).
        fatal = {pids[0] for pids in mapped["doomed_runs"].values()}
        for x, pids in mapped["doomed_runs"].items():
            assert len(pids) == 2 or (len(pids) == 3 and pids[1] in fatal), (x, mapped)
    assert seen["after"] == 10


def test_ray_inputs_a_dead_actor_had_not_started_go_elsewhere_with_no_error_and_no_try(observed):
    seen = check(observed, "innocents")
    for name, first, rest in (("one_copy", 0, [10 * x for x in range(1, 12)]),
                              ("chain", 100, [10 * (100 + x) for x in range(1, 8)])):
        died, *others = seen[name]
        assert died["type"] == "WorkerDied" and died["index"] == 0 and died["tries"] == 1, died
        assert others == rest, seen[name]  # every other input queued at the dead actor: its value, no error
    assert seen["one_copy_runs"] == [1] * 12  # none ran twice
    assert seen["chain_up_runs"] == [1] * 8 and seen["chain_runs"] == [1] * 8  # upstream calls were kept


def test_ray_a_batching_nodes_actor_killed_in_a_batch_fails_that_batchs_inputs_alone(observed):
    seen = check(observed, "batch_innocents")
    assert seen["failed"] == seen["first_batch"] == [0, 1], seen
    assert seen["values"] == [10 * x for x in range(8) if x not in seen["failed"]], seen


def test_ray_map_errors_yield_puts_each_failure_in_its_place(observed):
    seen = check(observed, "errors_yield")
    for ordered in (True, False):
        got = seen[f"yield_{ordered}"]
        values = [y for y in got if not isinstance(y, list)]
        failures = [y for y in got if isinstance(y, list)]
        assert sorted(values) == [0, 2, 4, 6, 8]
        assert sorted(f[1] for f in failures) == [1, 3, 5, 7, 9]
        assert all(f[0] == "NodeError" and f[2] == f"node `fail_odd` failed: ValueError: odd {f[1]}" for f in failures)
        if ordered:
            assert got[1] == ["NodeError", 1, "node `fail_odd` failed: ValueError: odd 1"] and got[2] == 2
    assert seen["unknown"] == "map's errors must be 'raise' or 'yield', got 'skip'"


def test_ray_takes_a_node_or_an_expression_where_a_graph_was_expected(observed):
    seen = check(observed, "graph_expected")
    assert seen["node"] == 2 and seen["expression"] == 4 and seen["map"] == [4, 6, 8]
    assert "refused" in seen and "Ray.run" in seen["refused"], seen


# -- futures and asyncio (tests/ray/checks_async.py) ----------------------------------------------------------

def test_ray_submit_returns_futures_that_as_completed_callbacks_and_cancel_work_with(observed):
    seen = check(observed, "futures")
    assert seen["as_completed"] == [[i, i + 1] for i in range(10)]
    assert seen["callback"] == [4, True]
    assert seen["error"] == ["NodeError", "node `boom` failed: ValueError: boom on 1"]
    assert seen["retried"] == 50
    assert seen["timeout"][0] == "RunTimeout" and "`sleep_for`" in seen["timeout"][1]
    assert seen["first_started"] and seen["cancelled"][1:] == [True] * 5  # (the running one may refuse)
    assert seen["probe"] == "probe" and seen["started"] == [0]  # the cancelled inputs never started
    assert seen["threads"] == ["ray settler"]  # one thread settles every submitted input


def test_ray_arun_and_amap_answer_as_run_and_map_and_never_block_the_loop(observed):
    seen = check(observed, "asyncio_faces")
    assert seen["arun"] == seen["run"] == 4
    assert seen["amap"] == seen["map"] == seen["amap_unordered"] == [2 * (i + 1) for i in range(20)]
    assert [y for y, _ in seen["async_source"]] == list(range(1, 11))
    assert all(taken <= y + 3 for y, taken in seen["async_source"])  # taken lazily, within the window of 3
    assert seen["arun_error"] == seen["run_error"]
    assert seen["amap_yield"] == [["NodeError", 0], ["NodeError", 1]]
    assert seen["amap_raised"][:2] == ["NodeError", 2]
    assert seen["arun_retried"] == 60 and seen["arun_timeout"][0] == "RunTimeout"
    assert seen["many"]  # 200 concurrent aruns, every answer right
    before, most = seen["threads"]
    assert most <= before + 2, seen["threads"]  # no thread per arun in flight
    assert seen["ticks_during"] >= 10, seen  # a 20 ms ticker kept ticking through a 0.6 s node


def test_ray_cancelled_inputs_never_start_even_when_rays_own_cancel_comes_too_late(observed):
    seen = check(observed, "cancel_without_ray_cancel")
    assert seen["first_started"] and seen["cancelled"] == [True] * 3
    assert seen["results"] == ["CancelledError"] * 3 and seen["probe"] == "probe"
    assert seen["started"] == [0]  # the actor skipped every input given up while it waited


def test_ray_cancelling_the_task_that_awaits_arun_cancels_its_input(observed):
    seen = check(observed, "cancelled_task")
    assert seen["results"] == ["CancelledError"] * 6 and seen["probe"] == "probe" and seen["started"] == [0]


def test_ray_cancelling_one_run_gathered_at_a_batching_node_leaves_the_others_their_outputs(observed):
    seen = check(observed, "cancel_in_a_group")
    assert seen == {"got": ["CancelledError", "out-1", "out-2", "out-3"], "blocked": "out-block", "next": "out-9"}


def test_ray_a_run_cancelled_while_its_node_runs_keeps_its_copy_busy_and_the_next_run_goes_elsewhere(observed):
    seen = check(observed, "cancel_while_running")
    assert seen == {"cancelled": "CancelledError", "after": "next", "while_slow_ran": True}, seen


def test_ray_async_with_starts_and_closes_the_runner_off_the_loop(observed):
    seen = check(observed, "async_with")
    assert seen["value"] == 2 and seen["closed"] == "this soma.Ray is closed; make a new one"
    assert seen["session_up"]  # a session soma did not start stays up


def test_ray_leaves_no_start_records_behind(observed):
    left = check(observed, "records_left")
    assert left["session"] == [] and all(names == [] for names in left.values()), left


# -- batches (tests/ray/checks_batching.py) -------------------------------------------------------------------

def test_ray_a_batching_node_gets_a_calls_inputs_as_one_forward_batch(observed):
    seen = check(observed, "batching_node")
    assert seen["run"] == [1, 8]  # a lone run: a batch of one
    assert seen["values"] == [2 * x for x in range(40) if x != 13]
    assert seen["largest_batch"] > 1
    failed = seen["failed"]  # the batch holding 13 failed, each of its inputs with its own index; no other
    assert 13 in failed and len(failed) <= 16 and failed == list(range(failed[0], failed[-1] + 1)), failed
    assert seen["failed_message"] == "node `double_batch` failed: ValueError: 13 in the batch"
    assert seen["kept"] == [2 * x for x in range(40) if x not in failed]


def test_ray_heavy_inputs_go_one_per_call_over_the_copies_and_cheap_ones_share_calls(observed):
    seen = check(observed, "heavy_inputs_spread")
    assert seen["values"] == seen["alone_values"] == [0, 1, 2, 3]
    assert seen["heavy_calls"] == [["four_copies", 1]] * 4  # one per call, not four in one actor's call
    assert seen["tiny"]
    batches = [batch for _, batch in seen["tiny_calls"]]
    assert sum(batches) == 200 and max(batches) > 1 and len(batches) < 200, batches


def test_ray_a_few_heavy_inputs_are_no_slower_spread_than_in_the_warm_actor_alone(observed):
    seen = check(observed, "heavy_inputs_spread")
    # 2.0 s of sleep either way; a copy that starts must pay for itself (issue 32 measured 1.75-3.6× before)
    assert seen["map_s"] <= 1.15 * seen["alone_s"], seen


def test_ray_six_heavy_inputs_still_spread_over_more_than_one_actor(observed):
    seen = check(observed, "heavy_inputs_spread")
    assert seen["six_values"] == list(range(6)) and seen["six_pids"] > 1, seen
