"""A pool's lifeline (soma.wire.lifeline): what a pool whose processes were all killed at once left is removed by the
next pool, and a live pool's files never are, whatever pid namespace it runs in. Real hosts, killed for real."""

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading

import psutil
import pytest

import soma
from soma.wire import lifeline
from soma.wire.shm import SHM_DIR, pool_prefix
from tests.conftest import ROOT, shm_names, wait_for

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


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_what_a_pool_killed_with_all_its_workers_left_is_removed_by_the_next_pool(tmp_path, caplog, sig):
    # Every process of the pool at once (a container's OOM kill, `systemctl stop`, `pkill python`): nobody is left
    # to clean up. Before the lifeline its segments and socket directory stayed until a reboot.
    proc, host, workers, prefix, run_dir = _start_host(tmp_path)
    for pid in [host, *workers]:
        os.kill(pid, sig)
    proc.wait(30)
    wait_for(lambda: all(_gone(p) for p in workers), seconds=10, what="the workers to die")
    left = shm_names(prefix)
    assert any(not n.endswith(lifeline.SUFFIX) for n in left), left  # (the host's segments at least)
    assert os.path.isdir(run_dir)
    with caplog.at_level(logging.WARNING, logger="soma.shm"):
        with soma.Local(workers=1) as local:
            assert not shm_names(prefix), shm_names(prefix)
            assert not os.path.exists(run_dir)
            assert local.snapshot().shm_prefix != prefix
    said = [r.getMessage() for r in caplog.records if "earlier pool" in r.getMessage()]
    assert said and f"host pid {host}" in said[0] and "segment" in said[0], said


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


def test_sweeps_at_once_remove_each_dead_pool_once_and_never_raise(tmp_path, caplog):
    dead = [_dead_pool(tmp_path) for _ in range(3)]
    errors = []
    start = threading.Barrier(8)

    def sweep():
        start.wait()
        try:
            lifeline.sweep("soma-0-none")
        except BaseException as err:  # (sweep must never raise: it is housekeeping)
            errors.append(err)

    with caplog.at_level(logging.WARNING, logger="soma.shm"):
        threads = [threading.Thread(target=sweep) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert not errors
    assert not any(shm_names(p) for p in dead)
    removed = [r for r in caplog.records if "earlier pool" in r.getMessage()]
    assert sum(r.args[2] for r in removed) == 3, [r.getMessage() for r in removed]  # each pool's segment once


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
