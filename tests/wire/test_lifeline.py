"""A pool's lifeline (soma.wire.lifeline): what a pool whose processes were all killed at once left is removed by the
next pool, and a live pool's files never are, whatever pid namespace it runs in. Real hosts, killed for real."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

import soma
from soma.wire import lifeline
from soma.wire.shm import SHM_DIR, pool_prefix
from tests.conftest import ROOT, shm_names

pytestmark = pytest.mark.timeout(120)

# A host with a pool whose host and workers made segments (a 1 MiB array each way), that says where its files are,
# then waits for a line on stdin; "again" runs once more and checks the values it held all along.
_HOST = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import soma
    from tests.nodes import AddOne
    local = soma.Local(workers=2).start()
    x = np.arange(1 << 17, dtype=np.float64)
    held = [local.run(AddOne(), x + i) for i in range(4)]
    snap = local.snapshot()
    print(os.getpid(), " ".join(map(str, local.pids())), snap.shm_prefix, snap.run_dir, flush=True)
    if sys.stdin.readline().strip() == "again":
        assert all((y == x + i + 1).all() for i, y in enumerate(held)), "a held result changed"
        assert (local.run(AddOne(), x) == x + 1).all()
        local.close()
        print("ok", flush=True)
""")


def _start_host(tmp_path, *launcher):
    script = tmp_path / "host.py"
    script.write_text(_HOST)
    proc = subprocess.Popen([*launcher, sys.executable, str(script), str(ROOT)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()
    host, *rest = line.split()
    *workers, prefix, run_dir = rest
    return proc, int(host), [int(w) for w in workers], prefix, run_dir


def _gone(pid):
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# Run where /dev/shm is a tmpfs of this test's own (the small_shm fixture): another program on this machine starting
# a pool meanwhile would sweep the killed pool first (as it should), and the test could not see what was left.
_KILLED = """
import logging, os, signal, subprocess, sys, tempfile, time
import soma
from soma.wire import lifeline

host_py = os.path.join(tempfile.mkdtemp(prefix="host-"), "host.py")
with open(host_py, "w") as f:
    f.write(HOST)
proc = subprocess.Popen([sys.executable, host_py, os.getcwd()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        text=True)
host, *rest = proc.stdout.readline().split()
*workers, prefix, run_dir = rest
for pid in [int(host), *map(int, workers)]:  # every process of the pool at once
    os.kill(pid, SIG)
proc.wait(30)

def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False

deadline = time.monotonic() + 30
while any(alive(int(w)) for w in workers) and time.monotonic() < deadline:
    time.sleep(0.01)
left = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
assert any(not n.endswith(lifeline.SUFFIX) for n in left), left  # (the host's segments at least)
assert os.path.isdir(run_dir)
said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("soma.shm").addHandler(handler)
with soma.Local(workers=1) as local:
    local.start()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], os.listdir("/dev/shm")
    assert not os.path.exists(run_dir)
print("HOST", host)
print("SAID", said)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_what_a_pool_killed_with_all_its_workers_left_is_removed_by_the_next_pool(small_shm, sig):
    # Every process of the pool at once (a container's OOM kill, `systemctl stop`, `pkill python`): nobody is left
    # to clean up. Before the lifeline its segments and socket directory stayed until a reboot.
    done = small_shm(f"HOST = {_HOST!r}\nSIG = {int(sig)}\n" + _KILLED)
    host = done.stdout.split("HOST ")[1].split()[0]
    said = done.stdout.split("SAID ")[1]
    assert "earlier pool(s) left when all their processes were killed at once" in said, done.stdout
    assert f"(host pid {host})" in said and "segment(s)" in said, done.stdout


_NEW_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc"]


@pytest.mark.parametrize("launcher", [[], _NEW_PID_NAMESPACE], ids=["same-pid-namespace", "other-pid-namespace"])
def test_a_live_pool_of_another_process_is_never_swept(tmp_path, launcher):
    # In another pid namespace its name's pid is not its pid here (the reason a pid cannot say that a pool is
    # dead): its lock still can.
    if launcher:
        probe = subprocess.run([*launcher, "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot make a pid namespace here: {probe.stderr.decode().strip()}")
    proc, named_pid, _, prefix, run_dir = _start_host(tmp_path, *launcher)
    try:
        if launcher:
            real = [p for p in psutil.Process(proc.pid).children(recursive=True) if "host.py" in " ".join(p.cmdline())]
            assert real and named_pid != real[0].pid
        before = shm_names(prefix)
        with soma.Local(workers=1) as local:
            local.start()
        assert shm_names(prefix) >= before and os.path.isdir(run_dir)
        out, err = proc.communicate("again\n", timeout=60)
        assert proc.returncode == 0 and out.strip() == "ok", err
    finally:
        proc.kill()
        proc.wait(30)


def _dead_pool(tmp_path, content=None) -> str:
    """A pool's files as a pool whose processes all died leaves them: a segment, a socket directory, an unheld
    lifeline."""
    prefix = pool_prefix(os.getpid(), os.urandom(4).hex())
    run_dir = tmp_path / f"soma-{os.urandom(4).hex()}"
    run_dir.mkdir()
    with open(os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-1"), "wb") as f:
        f.write(b"x" * 4096)
    with open(lifeline.path_of(prefix), "w") as f:
        f.write(json.dumps(content if content is not None else {"run_dir": str(run_dir)}))
    return prefix


_SWEEPS_AT_ONCE = """
import json, logging, os, threading
from soma.wire import lifeline
from soma.wire.shm import SHM_DIR, pool_prefix

dead = []
for _ in range(3):  # a pool's files as a pool whose processes all died leaves them: a segment, an unheld lifeline
    prefix = pool_prefix(os.getpid(), os.urandom(4).hex())
    with open(os.path.join(SHM_DIR, f"{prefix}-{os.getpid()}-1"), "wb") as f:
        f.write(b"x" * 4096)
    with open(lifeline.path_of(prefix), "w") as f:
        f.write(json.dumps({}))
    dead.append(prefix)
counted, errors = [], []
handler = logging.Handler()
handler.emit = lambda record: counted.append(record.args[2])  # (the segments one sweep removed)
logging.getLogger("soma.shm").addHandler(handler)
start = threading.Barrier(8)

def sweep():
    start.wait()
    try:
        lifeline.sweep("soma-0-none")
    except BaseException as err:  # (sweep must never raise: it is housekeeping)
        errors.append(err)

threads = [threading.Thread(target=sweep) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(30)
assert not errors, errors
assert not os.listdir(SHM_DIR), os.listdir(SHM_DIR)
assert sum(counted) == 3, counted  # each pool's segment removed, and said, once
print("SWEPT ONCE")
"""


def test_sweeps_at_once_remove_each_dead_pool_once_and_never_raise(small_shm):
    assert "SWEPT ONCE" in small_shm(_SWEEPS_AT_ONCE).stdout


def test_a_lifeline_never_points_a_sweep_outside_the_pool(tmp_path):
    # A lifeline is a file of this user's: a sweep removes only a soma socket directory and the pool's own
    # segments, whatever it names.
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "data").write_text("keep me")
    prefix = _dead_pool(tmp_path, {"run_dir": str(victim), "spill_dir": str(victim)})
    lifeline.sweep("soma-0-none")
    assert (victim / "data").read_text() == "keep me"
    assert not shm_names(prefix)


def test_a_closed_pool_leaves_no_lifeline(tmp_path):
    with soma.Local(workers=1) as local:
        local.start()
        prefix = local.snapshot().shm_prefix
        assert os.path.exists(lifeline.path_of(prefix))
    assert not shm_names(prefix)
