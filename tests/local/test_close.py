"""close() from another thread while runs and maps are in flight: raced many times, in a subprocess,
so that an abort or a hang is a failed test and not a dead test run."""

import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(240)


RACE = textwrap.dedent("""
    import os, sys, threading, time
    sys.path.insert(0, sys.argv[1])
    import soma, torch
    from soma import Graph, SomaError
    from tests.nodes import Fill, MarkThenSleep, Sleep

    tries = int(sys.argv[2])
    for i in range(tries):
        local = soma.Local(workers=2).start()
        run_dir, prefix, pids = local._pool.run_dir, local._pool.prefix, local.pids()
        held = local.run(Graph.somatize(Fill(1 << 20)), 3.0)  # a result the caller holds, in shared memory
        marker = os.path.join(run_dir, f"running-{i}")
        errors = {}

        def one_run():
            try:
                local.run(Graph.somatize(MarkThenSleep(marker, 10)), 0)
            except BaseException as exc:
                errors["run"] = exc

        def one_map():
            try:
                for _ in local.map(Graph.somatize(Sleep(0.05)), range(1000)):
                    pass
            except BaseException as exc:
                errors["map"] = exc

        threads = [threading.Thread(target=one_run), threading.Thread(target=one_map)]
        for t in threads:
            t.start()
        if i % 3 == 0:
            deadline = time.monotonic() + 10
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.005)
        elif i % 3 == 1:
            time.sleep(0.3)
        # i % 3 == 2: at once, before the run may even have been sent
        started = time.monotonic()
        local.close()
        took = time.monotonic() - started
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "a caller still waits after close()"
        assert took < 5, f"close() took {took:.1f} s"
        for what in ("run", "map"):
            err = errors.get(what)
            assert isinstance(err, SomaError), (what, repr(err))
            assert "was closed while this run was in flight" in str(err), (what, str(err))
        assert not os.path.exists(run_dir), "the socket directory is left"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], "segments are left"
        for pid in pids:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert float(held.sum()) == 3.0 * (1 << 20), "a held result changed"
    print("ok", tries)
""")


def test_close_while_runs_and_maps_are_in_flight(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "race.py"
    script.write_text(RACE)
    proc = subprocess.run([sys.executable, str(script), str(ROOT), "9"], capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "ok 9" in proc.stdout
