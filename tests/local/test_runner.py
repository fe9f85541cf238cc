"""soma.Local with real worker processes: placement, concurrency, lifetimes. (The same answers as in-process
are the contract of every runner: tests/run/test_interpreter.py.)"""

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

import soma
from soma import Executor, Graph, NodeError, PlacementError, PostconditionError
from tests.conftest import ROOT, in_threads, shm_names
from tests.local.nodes import (
    Burn,
    Counter,
    HoldsLock,
    TouchFile,
    Tracked,
    WhereAmI,
    burn,
)
from tests.nodes import (
    AddOne,
    Boom,
    Count,
    Double,
    Identity,
    Pid,
    ReturnsMovingDevice,
    ReturnsUnpicklable,
    SeeCtx,
    Tokenize,
    Upper,
)

pytestmark = pytest.mark.timeout(120)


def test_ctx_carries_worker_and_device(local):
    g = Graph.somatize(SeeCtx().on("meta") | SeeCtx())
    first, second = local.run(g, None)
    assert (first["node"], first["device"]) == ("see_ctx", "meta")
    assert (second["node"], second["device"]) == ("see_ctx_2", None)
    assert {first["worker"], second["worker"]} == {"w0", "w1"}
    assert first["repr"] == f"Ctx(node='see_ctx', device='meta', worker={first['worker']!r})"
    assert {first["pid"], second["pid"]} == set(local.pids())


def test_branches_of_a_wave_go_to_different_workers(local):
    g = Graph.somatize(Identity() >> (WhereAmI() | WhereAmI()))
    (w1, p1, _), (w2, p2, _) = local.run(g, 0)
    assert w1 != w2 and p1 != p2 and os.getpid() not in (p1, p2)


def test_more_branches_than_workers_share_them(local):
    g = Graph.somatize(Pid() | Pid() | Pid() | Pid())
    pids = local.run(g, 0)
    assert len(pids) == 4 and set(pids) == set(local.pids())


def test_a_node_stays_on_the_worker_that_first_ran_it(local):
    counter = Counter()
    g = Graph.somatize(counter >> Identity())
    assert [local.run(g, None) for _ in range(5)] == [1, 2, 3, 4, 5]
    assert counter.calls == 0  # its state lives in the worker; the host's copy never ran
    where = Graph.somatize(Counter() | WhereAmI())
    first = local.run(where, None)
    for _ in range(5):
        assert local.run(where, None)[1] == first[1]


def test_the_same_node_in_another_graph_finds_its_state(local):
    counter = Counter()
    g1 = Graph.somatize(counter)
    g2 = Graph.somatize(Identity() >> counter)
    assert local.run(g1, None) == 1
    assert local.run(g2, None) == 2
    assert local.run(g1, None) == 3


def test_node_error_names_the_node_and_carries_the_worker_traceback(local):
    g = Graph.somatize(Identity() >> Boom())
    with pytest.raises(NodeError, match=r"^node `boom` failed: ValueError: boom on 3$") as info:
        local.run(g, 3)
    err = info.value
    assert err.node == "boom"
    assert isinstance(err.__cause__, ValueError) and str(err.__cause__) == "boom on 3"
    assert "Traceback" in err.remote_traceback and "in forward" in err.remote_traceback
    assert "raise ValueError" in err.remote_traceback
    assert type(err.__cause__.__cause__).__name__ == "RemoteTraceback"
    assert local.run(Graph.somatize(AddOne()), 1) == 2  # the pool goes on


def test_postcondition_is_checked_again_on_what_arrives(local):
    # The value says `cpu` in the worker (its check passes) and `meta` once it has crossed.
    g = Graph.somatize(ReturnsMovingDevice().named("encoder").on("cpu"))
    with pytest.raises(PostconditionError, match=r"declared `cpu` but returned a value on `meta`"):
        local.run(g, None)


def test_placement_error_before_anything_is_dispatched(local, tmp_path):
    marker = tmp_path / "ran"
    g = Graph.somatize(TouchFile(str(marker)) >> Identity().named("encoder").on("cuda:1"))
    with pytest.raises(PlacementError) as info:
        local.run(g, 0)
    msg = str(info.value)
    assert "node `encoder` is placed on `cuda:1`" in msg and "cpu, cpu" in msg
    assert info.value.node == "encoder" and info.value.devices == ("cpu", "cpu")
    assert not marker.exists()


def test_cpu_meta_and_unplaced_run_on_any_worker(local):
    g = Graph.somatize(WhereAmI().on("cpu") | WhereAmI().on("meta") | WhereAmI())
    assert [d for _, _, d in local.run(g, 0)] == ["cpu", "meta", None]


def test_placing_after_the_first_run_is_honoured(local):
    g = Graph.somatize(SeeCtx())
    assert local.run(g, 0)["device"] is None
    g.place("see_ctx", "meta")
    assert local.run(g, 0)["device"] == "meta"


def test_unpicklable_node_is_a_node_error_before_dispatch(local):
    with pytest.raises(NodeError, match=r"^node `holds_lock` failed: it cannot be sent to a worker: TypeError"):
        local.run(Graph.somatize(HoldsLock()), 0)


def test_unsendable_result_is_a_node_error(local):
    with pytest.raises(NodeError, match=r"^node `returns_unpicklable` failed: its output cannot be sent back"):
        local.run(Graph.somatize(ReturnsUnpicklable()), 0)
    assert local.run(Graph.somatize(AddOne()), 1) == 2


def test_node_code_that_cannot_load_in_the_worker(local, tmp_path):
    # A module the host imported but the workers cannot (its file is gone since).
    (tmp_path / "only_on_host.py").write_text(
        "from soma import Node, Done\n"
        "class HostOnly(Node):\n"
        "    def forward(self, x, ctx):\n"
        "        return Done(x)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        import only_on_host

        (tmp_path / "only_on_host.py").unlink()
        g = Graph.somatize(only_on_host.HostOnly())
        for _ in range(2):  # and again: the worker did not cache the failure as "loaded"
            with pytest.raises(NodeError, match=r"^node `host_only` failed: its code could not be loaded in worker "
                                                r"w\d: ModuleNotFoundError") as info:
                local.run(g, 1)
            assert "import" in str(info.value)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("only_on_host", None)


def test_concurrent_runs_from_four_threads(local):
    g = Graph.somatize(AddOne() >> (Double() | Identity()) >> Identity().named("join"))
    g2 = Graph.somatize(Tokenize() >> (Upper() | Count()))

    def go(i):
        return [(local.run(g, k), local.run(g2, "a b")) for k in range(40)]

    results = in_threads(go, 4, seconds=100)
    for i in range(4):
        assert results[i] == [(((k + 1) * 2, k + 1), (["A", "B"], 2)) for k in range(40)]


BURN_SCRIPT = "import sys; from tests.local.nodes import burn; burn(int(sys.argv[1]))"


def parallel_capacity(n: int) -> float:
    """How many cores two plain processes get right now: 2.0 on two free cores, 1.0 on one.

    Measured with processes that share nothing with soma, so a slow soma cannot pass for a busy machine.
    """
    def timed(k):
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", BURN_SCRIPT, str(n)], cwd=ROOT) for _ in range(k)]
        for p in procs:
            p.wait()
        return time.perf_counter() - t0

    one, two = timed(1), timed(2)
    return 2 * one / two


def test_gil_bound_wave_is_faster_than_the_executor():
    """GIL-bound branches: threads in one process take turns, two worker processes do not.

    Two branches on two workers (four on two is the benchmark's question, benchmarks/gil_wave.py).
    The machine is shared: sometimes two busy processes get one core's worth. Each round (up to 8)
    measures that before and after (parallel_capacity) and counts only when two cores were there; each
    pair (Executor, Local) runs back to back and a round's median pair ratio is its result.
    """
    n = 600_000
    g = Graph.somatize(Burn(n) | Burn(n))
    expected = (burn(n),) * 2
    verdicts = []
    with soma.Local(workers=2) as pool:
        pool.run(g, 0)  # warm: node code loaded
        stop_at = time.monotonic() + 70  # (rounds are slower under load: the test's timeout is 120 s)
        for _ in range(8):
            if time.monotonic() > stop_at:
                break
            before = parallel_capacity(2 * n)
            ratios = []
            for _ in range(5):
                t0 = time.perf_counter()
                Executor().run(g, 0)
                executor = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = pool.run(g, 0)
                ratios.append(executor / (time.perf_counter() - t0))
                assert out == expected
            ratio = sorted(ratios)[len(ratios) // 2]
            capacity = min(before, parallel_capacity(2 * n))  # a neighbour may have arrived meanwhile
            verdicts.append((round(capacity, 2), round(ratio, 2)))
            if capacity >= 1.6 and ratio > 1.3:
                return
    counted = [v for v in verdicts if v[0] >= 1.6]
    if len(counted) < 3:  # (two rounds are not enough: capacity is measured around a round, not during it; at
        # load 14 a round measured with two cores free around it ran at 0.89x, and beside another program's
        # bursts of benchmarks two such rounds ran at 0.96x and 1.24x, the next three at 1.61x)
        pytest.skip(f"two processes got two cores in fewer than three rounds of this test (capacity, ratio per "
                    f"round: {verdicts})")
    raise AssertionError(f"Local was not > 1.3x the Executor on a GIL-bound wave with two cores free "
                         f"(capacity, ratio per round: {verdicts})")


def test_nodes_defined_in_a_script_load_in_workers(tmp_path):
    script = tmp_path / "user_script.py"
    script.write_text(
        "import soma\n"
        "from soma import Node, Done, Graph\n"
        "class Shout(Node):\n"
        "    def forward(self, x, ctx):\n"
        "        return Done(x.upper() + '!')\n"
        "def exclaim(x):\n"
        "    return x + '?'\n"
        "if __name__ == '__main__':\n"
        "    g = Graph.somatize(Shout() >> soma.fn(exclaim))\n"
        "    with soma.Local(workers=1) as local:\n"
        "        print(local.run(g, 'hi'))\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "HI!?"


def test_snapshot_shows_the_workers_the_inputs_in_flight_and_the_files_from_start_to_close(tmp_path):
    from tests.conftest import segment_file, wait_for
    from tests.nodes import Fill, WaitsForFile

    go = tmp_path / "go"
    local = soma.Local(workers=1)
    assert tuple(local.snapshot()) == ([], 0, [0], 0, [[]], None, None)  # not started: nothing held
    with local:
        start = local.snapshot()
        assert start.pids == local.pids() and len(start.pids) == 1 and os.path.isdir(start.run_dir)
        g = Graph.somatize(WaitsForFile(str(go)).named("waits"))
        futures = [local.submit(g, i) for i in range(3)]
        wait_for(lambda: local.snapshot().running == [["waits"]], what="the first input to run")
        now = local.snapshot()
        assert now.inputs == 3 and now.jobs[0] >= 1 and now.jobs[0] + now.waiting == 3
        go.touch()
        assert [f.result(timeout=60) for f in futures] == [1, 2, 3]
        wait_for(lambda: tuple(local.snapshot())[1:5] == (0, [0], 0, [[]]), what="nothing in flight")
        held = local.run(Graph.somatize(Fill(1 << 20)), 2.0)  # a result in a segment the pool's worker made
        assert segment_file(held).startswith(start.shm_prefix) and segment_file(held) in shm_names(start.shm_prefix)
    end = local.snapshot()
    assert end.pids == [] == local.pids() and end.inputs == 0 and (end.shm_prefix, end.run_dir) == start[5:]
    assert not os.path.exists(end.run_dir) and not shm_names(end.shm_prefix) and float(held.sum()) == 2.0 * (1 << 20)


def test_close_leaves_no_processes_segments_or_socket_files():
    pytest.importorskip("torch")
    import torch

    before = shm_names()
    pool = soma.Local(workers=2).start()
    pids = pool.pids()
    run_dir = pool.snapshot().run_dir
    big = torch.arange(1 << 18, dtype=torch.float32)
    out = pool.run(Graph.somatize(Identity() | Double()), big)
    assert os.path.exists(run_dir)
    pool.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids):
        time.sleep(0.02)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert not [c for c in psutil.Process().children(recursive=True) if c.pid in pids]
    assert shm_names() <= before, shm_names() - before
    assert not os.path.exists(run_dir)
    assert torch.equal(out[0], big) and torch.equal(out[1], big * 2)  # results outlive the pool
    pool.close()  # twice is fine
    with pytest.raises(soma.SomaError, match="closed"):
        pool.run(Graph.somatize(Identity()), 0)


def test_context_manager_and_lazy_start():
    pool = soma.Local(workers=1)
    assert pool.pids() == []
    assert pool.run(Graph.somatize(AddOne()), 1) == 2  # starts on first run
    assert len(pool.pids()) == 1
    pool.close()
    with soma.Local(workers=1) as pool2:
        assert len(pool2.pids()) == 1


def test_bad_pool_arguments():
    for workers in (0, "2", 2.0, True):
        with pytest.raises(ValueError, match=r"at least one worker \(workers= an int >= 1\)"):
            soma.Local(workers=workers)
    for seconds in (0, -1, "5", True):
        with pytest.raises(ValueError, match="start_timeout= is the seconds start"):
            soma.Local(workers=1, start_timeout=seconds)
    with pytest.raises(soma.DeviceError, match="unknown kind `gpu`"):
        soma.Local(workers=1, devices=["gpu:0"])
    with pytest.raises(soma.DeviceError, match="cannot be pinned to `meta`"):
        soma.Local(workers=1, devices=["meta"])


def test_a_worker_pinned_to_a_cuda_device_torch_cannot_see_is_refused_at_start():
    """Pinning is checked against the machine as the pool starts (building it works anywhere): a worker pinned to
    a CUDA device torch does not see is a DeviceError naming it before any process starts (each such worker
    failed its inputs with torch's `_cuda_setDevice` AttributeError, its traceback on stderr)."""
    torch = pytest.importorskip("torch")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pool = soma.Local(workers=2, devices=["cpu", f"cuda:{count}"])
    with pytest.raises(soma.DeviceError, match=rf"^worker w1 is pinned to cuda:{count}, but torch sees {count} CUDA "
                                                r"device\(s\) on this machine: pin it to one of those, to cpu"):
        pool.start()
    assert pool.pids() == []
    pool.close()


def test_pinning_spreads_devices_over_workers():
    pool = soma.Local(workers=3, devices=["cpu", "cuda:0"])
    assert pool.worker_devices == ["cpu", "cuda:0", "cpu"]


def test_threads_per_worker_are_set_and_checked():
    pytest.importorskip("torch")
    from tests.local.nodes import Threads

    with soma.Local(workers=1, threads=3) as pool:
        assert pool.run(Graph.somatize(Threads()), 0) == ("3", 3)
    default = max(1, (os.cpu_count() or 1) // 2)
    with soma.Local(workers=2) as pool:
        assert pool.run(Graph.somatize(Threads()), 0) == (str(default), default)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"^soma.Local's threads= is the torch threads per worker, a positive "
                                             rf"int; got {bad!r}$"):
            soma.Local(workers=1, threads=bad)


def test_worker_help_says_how_the_host_starts_it():
    for argv in ([sys.executable, "-m", "soma.local.worker", "--help"],):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0
        assert "soma.Local" in out.stdout and "SOMA_SECRET" in out.stdout and "--tasks" in out.stdout


def test_worker_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != "SOMA_SECRET"}
    out = subprocess.run([sys.executable, "-m", "soma.local.worker", "--tasks", "ipc:///x", "--results", "ipc:///y",
                          "--id", "w0", "--host-pid", "1", "--prefix", "soma-1-x", "--status", "/tmp/nothing"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert out.returncode == 2 and "SOMA_SECRET" in out.stderr


class CudaReport(soma.Node):
    """Where this worker's CUDA work goes: its current device, and a tensor born on ctx.device."""

    def forward(self, x, ctx):
        import torch

        t = torch.ones(4, device=ctx.device) * (x if x is not None else 1)
        return soma.Done((torch.cuda.current_device(), str(t.device), t))


@pytest.mark.gpu("workers pinned to cuda:N, CUDA IPC both ways")
def test_needs_gpu_pinned_workers_and_cuda_ipc():
    import torch

    n = torch.cuda.device_count()
    with soma.Local(workers=n, devices="auto") as pool:
        assert pool.worker_devices == [f"cuda:{i}" for i in range(n)]
        g = Graph.somatize(CudaReport().on(f"cuda:{n - 1}"))
        current, where, t = pool.run(g, torch.full((4,), 2.0, device="cuda:0"))
        assert current == n - 1 and where == f"cuda:{n - 1}"  # pinned, not renumbered
        assert t.device == torch.device(f"cuda:{n - 1}") and float(t.sum()) == 8.0  # came back by CUDA IPC
        echoed = pool.run(Graph.somatize(Identity()), t)
        assert torch.equal(echoed.cpu(), t.cpu())
        with pytest.raises(PlacementError):
            pool.run(Graph.somatize(Identity().on(f"cuda:{n}")), 0)


def test_nodes_the_host_dropped_are_dropped_by_workers_too(local):
    import gc

    counts = []
    for _ in range(30):  # a fresh graph and node per call, as a script in a loop would do
        counts.append(local.run(Graph.somatize(Tracked()), None))
        gc.collect()
    assert max(counts[-10:]) <= 3, counts  # not 30: each worker forgot the nodes the host let go


def test_inputs_started_while_another_thread_holds_the_hosts_lock_go_once_it_lets_go(local):
    # A caller never sleeps on the host's lock to start an input: the thread holding it takes the input in
    # before it lets go. Were submit to wait for the lock, this test would hang (its timeout fails it); were
    # the holder not to take the inputs in, their results would never come.
    import gc
    import threading

    lock = local._loop.lock
    holding, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            holding.set()
            release.wait(30)
        local._loop._post(lambda: None)  # (the way every holder lets go: it takes in what was posted)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(30)
    # (each of a graph nobody else holds: its inputs keep it, and so its nodes' code, until they are sent)
    futures = [local.submit(Graph.somatize(AddOne()), i) for i in range(5)]  # returns while the lock is held
    gc.collect()
    assert not any(f.done() for f in futures)
    release.set()
    holder.join(30)
    assert [f.result(timeout=60) for f in futures] == [1, 2, 3, 4, 5]


def test_many_inputs_submitted_for_graphs_nobody_holds_all_run():
    # Inputs wait for a worker; the graph each was submitted for is dropped by its caller at once. A waiting
    # job keeps its graph: before, the node's code was gone by the time the job was sent (KeyError, "never
    # told about"), for a few in every thousand.
    with soma.Local(workers=2) as pool:
        futures = [pool.submit(Graph.somatize(AddOne()), i) for i in range(1500)]
        assert [f.result(timeout=120) for f in futures] == [i + 1 for i in range(1500)]


def test_a_map_in_a_done_callback_runs_and_the_pool_goes_on(local, tmp_path):
    # concurrent.futures runs a done-callback on the thread that sets the result: for Local's futures the
    # thread receiving the workers' results. It delivers outcomes only once it has let go of the host's lock,
    # so the callback may wait there for a whole map (it waited for ever before, then was refused).
    from tests.nodes import WaitsForFile

    gate = tmp_path / "gate"
    first = local.submit(WaitsForFile(str(gate)), 1)
    seen, called = {}, threading.Event()

    def then(done):
        try:
            seen["map"] = list(local.map(AddOne(), range(done.result(), 40)))
        finally:
            called.set()

    first.add_done_callback(then)
    gate.touch()
    assert called.wait(60)
    assert seen["map"] == list(range(3, 41))
    assert list(local.map(AddOne(), range(40))) == list(range(1, 41))  # the map's inputs were let go of


def test_a_pool_that_stops_getting_runs_stops_spinning(local):
    """After runs back to back (whose callers and workers look at their sockets before they sleep, on a machine
    with a core to spare: soma.wire.transport.Receiver.wait), an idle pool uses next to no CPU: no receiver
    keeps spinning once nothing comes."""
    g = Graph.somatize(AddOne())
    for i in range(500):
        assert local.run(g, i) == i + 1
    processes = [psutil.Process(pid) for pid in [os.getpid(), *local.pids()]]
    time.sleep(0.5)  # (a worker's last wait ends within its poll: 200 ms)
    before = [sum(p.cpu_times()[:2]) for p in processes]
    time.sleep(1.0)
    used = sum(sum(p.cpu_times()[:2]) - b for p, b in zip(processes, before))
    assert used < 0.15, f"an idle pool used {used:.2f} s of CPU in 1 s"


def test_the_first_arun_or_amap_starts_the_pool_on_a_thread_not_on_the_event_loop():
    """A pool not started yet starts as the first `arun` or `amap` begins, on a thread: its start waits for every
    worker's hello (0.1-0.2 s for two workers here, seconds with torch preloaded), and an event loop blocked
    that long stalls every other request of a server (before Dec 6 it ran on the loop's thread)."""
    import asyncio

    class Watched(soma.Local):
        def start(self):
            starts.append(threading.current_thread())
            return super().start()

    async def first(use):
        loop_thread = threading.current_thread()
        local = Watched(workers=1)  # (not started: `with` would start it here)
        try:
            if use == "arun":
                assert await local.arun(AddOne(), 1) == 2
            else:
                assert [y async for y in local.amap(AddOne(), range(3))] == [1, 2, 3]
            assert [y async for y in local.amap(AddOne(), range(3))] == [1, 2, 3]  # (started: as before)
            assert await local.arun(AddOne(), 1) == 2
        finally:
            local.close()
        return loop_thread

    for use in ("arun", "amap"):
        starts: list = []
        loop_thread = asyncio.run(first(use))
        assert starts and loop_thread not in starts, (use, starts)
