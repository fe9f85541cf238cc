"""What runs out, and who owns what: file descriptors, a fork of the host, Ctrl-C, a death in a busy map.

Each case happens for real: the host's descriptors are used up, the host forks, SIGINT goes to the
host's process group, a worker is SIGKILLed while outputs stream. Scripts run in subprocesses where
they change the process itself (its limits, a fork, its signals).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from soma import Graph, WorkerDied
from tests.conftest import ROOT
from tests.nodes import Identity, Pid

pytestmark = pytest.mark.timeout(120)


def run_script(tmp_path, body: str, timeout: float = 90) -> dict:
    """Run `body` in a fresh interpreter (the repository on its path); it prints one JSON object last."""
    script = tmp_path / "script.py"
    script.write_text("import json, os, sys\nsys.path.insert(0, sys.argv[1])\n" + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_out_of_file_descriptors_is_a_named_error_and_the_pool_recovers(tmp_path):
    seen = run_script(tmp_path, """
        import resource
        import soma
        from soma import Graph, Node, Done

        class DieOn(Node):
            def forward(self, x, ctx):
                if x == "die":
                    os._exit(3)
                return Done(x)

        g = Graph.somatize(DieOn())
        out = {}
        with soma.Local(workers=2) as local:
            out["warm"] = local.run(g, 1)
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            held = []

            def exhaust():  # (a worker's end frees descriptors of its own: take them too)
                try:
                    while True:
                        held.append(open(os.devnull))
                except OSError:
                    pass

            def attempt(x, starved=True):
                if starved:
                    exhaust()
                try:
                    return ["ok", local.run(g, x, timeout=20)]
                except Exception as err:
                    return [type(err).__name__, str(err)]

            out["exhausted"] = attempt(2)
            out["deaths"] = [attempt("die"), attempt("die")]  # both workers die; neither can be replaced
            out["none_left"] = attempt(3)
            for f in held:
                f.close()
            out["released"] = [attempt(4, starved=False), attempt(5, starved=False)]
            out["workers"] = len(local.pids())
        print(json.dumps(out))
    """)
    assert seen["warm"] == 1 and seen["exhausted"] == ["ok", 2]
    for kind, text in seen["deaths"]:
        assert kind == "WorkerDied" and "exited with code 3 while running node `die_on`" in text, text
    assert any("a new worker could not be started again: OSError: [Errno 24] Too many open files" in text
               for _, text in seen["deaths"]), seen["deaths"]
    kind, text = seen["none_left"]
    assert kind == "WorkerDied" and text.startswith("no worker can run node `die_on`: worker w"), text
    assert "could not be started again: OSError: [Errno 24] Too many open files" in text, text
    assert "(this process has run out of file descriptors: close some, or raise the limit with `ulimit -n`" in text
    assert seen["released"] == [["ok", 4], ["ok", 5]] and seen["workers"] == 2


def test_a_forked_child_cannot_use_or_destroy_its_parents_pool(tmp_path):
    pytest.importorskip("torch")
    seen = run_script(tmp_path, """
        import torch
        import soma
        from soma import Graph, SomaError
        from tests.nodes import Identity, PlusOne

        out = {}
        local = soma.Local(workers=2).start()
        run_dir = local.snapshot().run_dir
        held = local.run(Graph.somatize(PlusOne()), torch.zeros(1 << 16))
        child = os.fork()
        if child == 0:  # a child that uses the pool, closes it, and exits normally (atexit runs)
            try:
                local.run(Graph.somatize(Identity()), 1)
                code = 10
            except SomaError as err:
                code = 0 if str(err).startswith(f"this soma.Local belongs to process {os.getppid()}; this is "
                                                f"process {os.getpid()}") else 11
            local.close()
            sys.exit(code)
        _, status = os.waitpid(child, 0)
        out["child"] = os.waitstatus_to_exitcode(status)
        out["run_dir"] = os.path.isdir(run_dir)
        out["tensor"] = float(local.run(Graph.somatize(PlusOne()), torch.ones(1 << 16)).sum())
        out["held"] = float(held.sum())
        pids = local.pids()
        os.kill(pids[0], 9)
        try:
            local.run(Graph.somatize(Identity()), 2)
        except soma.WorkerDied:
            pass
        out["after_death"] = [local.run(Graph.somatize(Identity()), 3) for _ in range(4)]
        out["workers"] = len(local.pids())
        local.close()
        print(json.dumps(out))
    """)
    assert seen["child"] == 0, seen
    assert seen["run_dir"] and seen["tensor"] == 2.0 * (1 << 16) and seen["held"] == float(1 << 16)
    assert seen["after_death"] == [3, 3, 3, 3] and seen["workers"] == 2


def test_ctrl_c_at_the_terminal_is_the_hosts_alone(tmp_path):
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        sys.path.insert(0, sys.argv[1])
        import soma
        from soma import Graph
        from tests.nodes import Pid

        local = soma.Local(workers=2).start()
        facts = [*local.pids(), *(os.getsid(p) for p in local.pids()), os.getsid(0)]
        try:  # the line is printed inside the try: the test's SIGINT may land as soon as it is read
            print("pids", *facts, flush=True)
            time.sleep(60)  # an idle prompt, holding the pool
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print("after", *local.pids(), flush=True)
        print("ran", sorted({local.run(Graph.somatize(Pid()), None) for _ in range(20)}), flush=True)
        local.close()
    """))
    proc = subprocess.Popen([sys.executable, str(script), str(ROOT)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a terminal gives a program
    try:
        first = proc.stdout.readline().split()
        assert first[0] == "pids", first
        pids, sids, host_sid = [int(p) for p in first[1:3]], [int(s) for s in first[3:5]], int(first[5])
        assert host_sid not in sids  # the workers are in sessions of their own: no terminal signal reaches them
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: SIGINT to the foreground process group
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    lines = rest.splitlines()
    assert lines[0] == "interrupted"
    assert [int(p) for p in lines[1].split()[1:]] == pids  # nobody died, nobody was replaced
    assert proc.returncode == 0


@pytest.mark.parametrize("errors", ["yield", "raise"])
@pytest.mark.parametrize("ordered", [False, True])
def test_a_death_in_a_busy_map_is_noticed_at_once(local, ordered, errors):
    stop = []

    def inputs():
        started = time.monotonic()
        for i in range(2_000_000):  # bounded in count and time
            if stop or time.monotonic() - started > 30:
                return
            yield i

    victim = local.pids()[0]
    killed_at = noticed = failed = None
    outputs = local.map(Graph.somatize(Pid()), inputs(), ordered=ordered, errors=errors)
    try:
        for k, out in enumerate(outputs):
            now = time.monotonic()
            if k == 2000:
                os.kill(victim, signal.SIGKILL)
                killed_at = now
            if killed_at is not None and noticed is None and victim not in local.pids():
                noticed = now - killed_at
                stop.append(True)
            if isinstance(out, WorkerDied):
                failed = now - killed_at
                assert out.pid == victim
    except WorkerDied as err:  # errors="raise": the input the worker was running, in its turn
        failed = time.monotonic() - killed_at
        assert err.pid == victim
        noticed = noticed if noticed is not None else failed
    assert noticed is not None, "the dead worker was never noticed while outputs streamed"
    assert noticed < 3.0, f"noticed {noticed:.2f} s after the kill"
    assert failed is None or failed < 3.0, f"its input's WorkerDied came {failed:.2f} s after the kill"
    assert len(local.run(Graph.somatize(Identity() | Identity()), 1)) == 2  # healed


@pytest.mark.parametrize("call", ["run", "map"])
def test_ctrl_c_during_a_run_or_map_stops_it_with_a_short_traceback_and_leaves_nothing(tmp_path, call):
    script = tmp_path / "host.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, signal, threading
        sys.path.insert(0, sys.argv[1])
        import soma
        from soma import Graph
        from tests.nodes import Sleep

        local = soma.Local(workers=2).start()
        print(local.snapshot().run_dir, local.snapshot().shm_prefix, *local.pids(), flush=True)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        if {call!r} == "run":
            local.run(Graph.somatize(Sleep(30)), 1)
        else:
            for y in local.map(Graph.somatize(Sleep(0.2)), range(1000)):
                pass
    """))
    proc = subprocess.run([sys.executable, str(script), str(ROOT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and proc.stderr.rstrip().endswith("KeyboardInterrupt"), proc.stderr
    frames = [line for line in proc.stderr.splitlines() if line.startswith('  File "')]
    assert frames[0].startswith(f'  File "{script}"'), proc.stderr
    assert len([f for f in frames if "/soma/" in f]) <= 1, proc.stderr  # one frame of soma at most: its entry
    run_dir, prefix, *pids = proc.stdout.split()
    assert not os.path.exists(run_dir)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


class Filled(__import__("soma").Node):
    """Returns a numpy array of `mib` MiB, every byte `x` (made in the worker: a segment it owns)."""

    def __init__(self, mib):
        self.mib = mib

    def forward(self, x, ctx):
        import numpy

        return __import__("soma").Done(numpy.full(self.mib << 20, x, dtype=numpy.uint8))


def _pool_bytes(local) -> int:
    """Bytes of /dev/shm this pool's segments take."""
    prefix = local.snapshot().shm_prefix
    return sum(os.stat(os.path.join("/dev/shm", n)).st_size for n in os.listdir("/dev/shm") if n.startswith(prefix))


def test_an_idle_pool_gives_back_the_memory_of_results_its_caller_dropped(local):
    from soma.wire.shm import IDLE_KEEP

    g = Graph.somatize(Filled(200))
    held = [local.run(g, 1), local.run(g, 2)]
    assert [int(a[0]) for a in held] == [1, 2] and _pool_bytes(local) >= 400 << 20
    del held  # the caller lets go: the worker may keep them for reuse while busy, not while idle
    deadline = time.monotonic() + 30
    while _pool_bytes(local) > 2 * IDLE_KEEP and time.monotonic() < deadline:
        time.sleep(0.05)  # a condition, with a deadline
    assert _pool_bytes(local) <= 2 * IDLE_KEEP, _pool_bytes(local)
    again = local.run(g, 3)  # and the pool still makes big values
    assert int(again[-1]) == 3 and again.nbytes == 200 << 20


def test_a_map_of_large_arrays_takes_a_few_ahead_of_a_slow_caller_not_what_dev_shm_holds(local):
    """A large array's way is mostly the host copying it: measured as latency, a node of microseconds looked
    deep, and the default window took 137 arrays of 20 MiB (2.7 GB of /dev/shm) ahead of a caller taking 20 ms
    each, at half the pace of `window=4` (measures.DEPTH_SHM)."""
    np = pytest.importorskip("numpy")
    arrays = [np.full((20 << 20) // 8, float(i)) for i in range(4)]
    taken = 0

    def source():
        nonlocal taken
        for i in range(60):
            taken += 1
            yield arrays[i % 4]

    ahead = 0
    for k, y in enumerate(local.map(Graph.somatize(Identity()), source())):
        assert y.nbytes == 20 << 20 and y[0] == k % 4 and y[-1] == k % 4
        ahead = max(ahead, taken - k - 1)
        del y
        time.sleep(0.01)  # the caller's own work
    assert ahead <= 2 * 2 * 2 + 4, ahead  # twice the parallelism (two workers, two jobs each), and what arrived


def test_results_held_up_to_the_kernels_cap_on_mappings_fail_saying_so_and_the_pool_goes_on(tmp_path):
    """Each array of 32 KiB or more a kept result brings holds one mapping in the host; at the kernel's cap
    (vm.max_map_count) the next one failed "Cannot allocate memory", hours into a job, with most memory free.
    Here the host's mappings are used up for real (non-mergeable anonymous pages) but for a margin."""
    seen = run_script(tmp_path, """
        import ctypes
        import numpy as np
        import soma
        from soma import Graph, Node, Done

        class Make(Node):
            def forward(self, i, ctx):
                return Done(np.full(5000, i))  # 40,000 bytes: through a segment of its own

        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        with open("/proc/sys/vm/max_map_count") as f:
            cap = int(f.read())
        out = {}
        g = Graph.somatize(Make())
        with soma.Local(workers=1) as local:
            assert int(local.run(g, 7)[0]) == 7
            with open("/proc/self/maps") as f:
                now = len(f.readlines())
            for k in range(cap - now - 300):  # (read-only and writable in turn: neighbours never merge)
                if libc.mmap(None, 4096, 1 if k % 2 else 3, 0x22, -1, 0) in (None, ctypes.c_void_p(-1).value):
                    break
            kept = []
            try:
                for i in range(1000):
                    kept.append(local.run(g, i))
                out["error"] = None
            except Exception as err:
                out["error"] = [type(err).__name__, str(err)]
            out["kept"] = len(kept)
            out["intact"] = all(int(a[0]) == i and int(a[-1]) == i for i, a in enumerate(kept))
            del kept[:200]
            out["after"] = int(local.run(g, 5)[0])
        print(json.dumps(out))
    """)
    assert seen["error"] is not None and 0 < seen["kept"] < 1000 and seen["intact"], seen
    kind, text = seen["error"]
    assert kind == "NodeError" and "Cannot allocate memory" in text, text
    assert "may have reached its cap of" in text and "vm.max_map_count" in text and "a.copy()" in text, text
    assert seen["after"] == 5
