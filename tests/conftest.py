"""What the tests share: one `runner` fixture for every runner, the network Ray may use, and small helpers.

Runners
-------
A contract test (SPEC 7: the same answers, errors, `map`, `setup`, trace on every
runner) takes `runner` and is written once; it runs three times, as CPython runs
one executor suite under each executor:

    runner[executor]   soma.Executor()
    runner[local]      the module's warm soma.Local(workers=2)        (fixture `local`)
    runner[ray]        a soma.Ray on the session's Ray                 (fixture `ray_runner`)

A test of what one runner alone does takes `local` or `ray_runner` directly.

Ray stays on loopback
---------------------
Ray binds the machine's real network address unless the only interface it can
see is loopback (/work/shared/notes/ray.md), and tests must not expose it. So
when `ray` is installed, `pytest_configure` below replaces the test session with
itself inside a fresh network namespace whose only interface is `lo`:

    python -m pytest ARGS                        (or the `pytest` script)
      └─ pytest_configure: ray importable, not on loopback only yet, allowed?
           └─ exec unshare -n sh -c 'ip link set lo up && exec python -m pytest ARGS'
                └─ the same process (pid, arguments, working directory, exit status),
                   where Local's ipc:// sockets and everything else work unchanged

It happens once: the new session finds `SOMA_TESTS_IN_NETNS=1` (set for it) and
itself on loopback only. It never happens when pytest is driven in-process by
another program (`pytest.main()` from an IDE, a script, a plugin): that program
is not ours to replace. `SOMA_TESTS_NO_NETNS=1` opts out. Without it, where Ray
is missing, where `unshare -n` is refused (it needs root, or CAP_SYS_ADMIN), or
where the session was not replaced, nothing changes and `runner[ray]` (every
test on the session's Ray) is skipped with the exact reason. tests/ray/test_runner.py
runs its checks in a subprocess under `unshare -n` of its own, and says itself
why it is skipped.

In the namespace the session's Ray starts on first use (`soma.Ray("local",
num_cpus=2, include_dashboard=False, log_to_driver=False, ...)`: ray.init with
those options, a new instance of our own, never another program's cluster), and
every module's `ray_runner` is a `soma.Ray()` on it (closing one stops its
actors and leaves the session up). Ray's processes cost CPU on a 2-core machine,
so `pytest_collection_modifyitems` runs every test that needs Ray after all the
others, in three groups:

    0  no Ray
    1  the session's Ray
    2  `own_ray`: starts a Ray of its own (tests/ray/test_runner.py: its checks in a subprocess, one session
       and then two machines); the session's Ray is shut down before the first of these

Measured here (2 cores, shared): the session's Ray starts in 8-15 s, and in
18-33 s with a CI run and two CPU burners beside it, once; the namespace costs
one more interpreter start (<1 s). Every Ray the suite starts runs its workers
at nice 0 (RAY_WORKER_NICENESS below), not Ray's 15, so other programs on the
machine do not starve its actors.

Nothing left behind
-------------------
The suite cleans up after itself, as soma does: `LeftBehind` gives the session a
TMPDIR of its own (every temp folder of the session, its subprocesses, soma's
workers and Ray's processes goes there), and at the end fails the session,
naming each, when soma-* entries are left there, in /tmp (the session's Ray
folders) or in /dev/shm (segments of pools this process hosted, soma.Ray's
start-record folder).

Known bugs
----------
`@pytest.mark.xfail_on("ray", reason=...)` marks a contract test that one
runner fails today: that runner's param is xfail(strict=True), the others run as
usual, and the fix shows up as XPASS (a failure) until the mark goes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # the repository: scripts run from here import `tests....`

IN_NETNS = "SOMA_TESTS_IN_NETNS"  # set for the session that was replaced: never replace it again
NO_NETNS = "SOMA_TESTS_NO_NETNS"  # set by a person: never replace the session (Ray's tests are then skipped)
_ENTER_NETNS = 'ip link set lo up && exec "$0" "$@"'  # the command `unshare -n sh -c` runs first


# -- the network namespace ------------------------------------------------------------------------

_why_no_ray: str | None = "the session has not been configured yet"
TEST_HOST_PID = "SOMA_TEST_HOST_PID"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(why): needs a CUDA GPU; skipped, saying why, on machines without one")
    config.addinivalue_line("markers", "own_ray: starts a Ray of its own (runs last, with the session's Ray down)")
    config.addinivalue_line("markers", "xfail_on(runner, reason): a known bug of that runner: the test's "
                                       "runner[<runner>] is xfail(strict=True), so its fix is noticed")
    global _why_no_ray, _left_behind
    os.environ.setdefault(*RAY_WORKER_NICENESS)  # (before any Ray starts: this session's and its subprocesses')
    _why_no_ray = why_ray_cannot_run_here(config)
    if _why_no_ray == _REPLACING:
        _replace_session_in_a_loopback_namespace(config)
    _left_behind = LeftBehind()  # (in the session that runs the tests: the one replaced never gets here)
    # The process that runs the tests (tests/pools_at_import.py starts a pool where it is imported by any other:
    # a worker or a Ray actor started from here inherits this)
    os.environ[TEST_HOST_PID] = str(os.getpid())


_REPLACING = "replacing the session"
# Ray starts its workers at nice 15 (its `worker_niceness`), so beside a busy program at nice 0 (CI's machine is
# shared) every actor got a few % of a core: a test that takes 2 s quiet took minutes, and the soma_ray smoke ran
# past 300 s. The suite's own workers (Local's) run at nice 0; every Ray the suite starts does too.
RAY_WORKER_NICENESS = ("RAY_worker_niceness", "0")


def why_ray_cannot_run_here(config) -> str | None:
    """None when Ray may run in this session; `_REPLACING` when the session should move to a loopback-only
    network namespace first; otherwise why the tests that need a running Ray are skipped."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install 'soma[ray]')"
    if on_loopback_only():
        return None
    if os.environ.get(IN_NETNS):
        return (f"{IN_NETNS} is set, but this network namespace has more than a working `lo` "
                f"({', '.join(name for _, name in socket.if_nameindex())}): Ray would bind a real address")
    if os.environ.get(NO_NETNS):
        return (f"{NO_NETNS} is set: the session stays in this machine's network namespace, where Ray would bind "
                f"the machine's address")
    if not started_as_the_pytest_command(config):
        return ("pytest runs inside another program (pytest.main), which the session must not replace; run "
                "`python -m pytest` to give Ray a loopback-only network namespace")
    return why_no_loopback_namespace() or _REPLACING


def why_no_loopback_namespace() -> str | None:
    """None when `unshare -n sh -c 'ip link set lo up'` works here; otherwise why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip is missing: no loopback-only network namespace for Ray"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"this machine does not allow a loopback-only network namespace (unshare -n: "
                f"{probe.stderr.strip() or probe.returncode}), and Ray must not bind its real address in tests")
    return None


def on_loopback_only() -> bool:
    """This process's network namespace has `lo` and nothing else, and `lo` is up."""
    if [name for _, name in socket.if_nameindex()] != ["lo"]:
        return False
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            with socket.create_connection(server.getsockname(), timeout=2):
                return True
    except OSError:  # lo is down (a namespace made without `ip link set lo up`)
        return False


def started_as_the_pytest_command(config) -> bool:
    """This process is `python -m pytest ...` or the `pytest` script, with the arguments pytest got: nothing
    else runs in it that replacing the process would end."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    as_module = spec is not None and spec.name in ("pytest", "pytest.__main__")
    as_script = Path(sys.argv[0]).name in ("pytest", "py.test")
    return (as_module or as_script) and list(config.invocation_params.args) == sys.argv[1:] and \
        "PYTEST_XDIST_WORKER" not in os.environ


def _replace_session_in_a_loopback_namespace(config) -> None:
    """exec the same command under `unshare -n`, with `lo` up: this process becomes the new session."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.stop_global_capturing()  # the original stdout and stderr, for the new session to inherit
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [sys.executable, *sys.orig_argv[1:]]  # the interpreter's own options too (-X, -W, ...)
    os.environ[IN_NETNS] = "1"
    os.execvp("unshare", ["unshare", "-n", "sh", "-c", _ENTER_NETNS, *argv])


# -- the order: every test that needs Ray after the others -----------------------------------------------

@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture parameters
def pytest_collection_modifyitems(config, items):
    no_gpu = not cuda_available()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is not None and no_gpu:
            why = marker.args[0] if marker.args else "it runs on a GPU"
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {why}"))
        known_bug = item.get_closest_marker("xfail_on")
        callspec = getattr(item, "callspec", None)
        if known_bug is not None and callspec is not None and callspec.params.get("runner") == known_bug.args[0]:
            item.add_marker(pytest.mark.xfail(strict=True, reason=known_bug.kwargs["reason"]))
        if ray_group(item) == 1 and _why_no_ray is not None:
            item.add_marker(pytest.mark.skip(reason=f"needs Ray here: {_why_no_ray}"))
    items.sort(key=ray_group)  # stable: within a group, the order pytest chose


def ray_group(item) -> int:
    """0: no Ray; 1: the session's Ray; 2: a Ray of its own (see the module docstring)."""
    if item.get_closest_marker("own_ray"):
        return 2
    callspec = getattr(item, "callspec", None)
    if callspec is not None and callspec.params.get("runner") == "ray":
        return 1
    return 1 if {"ray_runner", "ray_session"} & set(item.fixturenames) else 0


def pytest_runtest_setup(item):
    if item.get_closest_marker("own_ray"):
        _session_ray.close()  # two Rays at once would share two cores; every test that uses it has run


# -- runners -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["executor", "local", "ray"])
def runner(request):
    """Every runner in turn: a contract test written once runs on each (see the module docstring)."""
    if request.param == "executor":
        import soma

        return soma.Executor()
    return request.getfixturevalue("local" if request.param == "local" else "ray_runner")


@pytest.fixture
def small_shm(tmp_path):
    """`small_shm(body, mib=64)`: run Python source `body` where /dev/shm is `mib` MiB, in a private mount
    namespace; skipped, saying why, where one cannot be made (tests/small_shm.py)."""
    from tests.small_shm import run_in_small_shm, why_no_small_shm

    why = why_no_small_shm()
    if why is not None:
        pytest.skip(why)
    return functools.partial(run_in_small_shm, tmp_path=tmp_path)


@pytest.fixture(scope="module")
def local():
    """One warm pool of two workers shared by a test module (it heals after faults)."""
    import soma

    pool = soma.Local(workers=2)
    pool.start()
    yield pool
    pool.close()


# Ray gives its raylet 30 s to register with the GCS (ray/_private/node.py; not configurable). With two CPU
# burners beside the suite on 2 cores it missed that once, so a start that timed out so is tried once more.
START_ATTEMPTS = 2
RAY_START_TIMED_OUT = "timed out during startup"


class SessionRay:
    """The session's Ray: started on first use, by a soma.Ray that owns it; `close()` shuts it down."""

    def __init__(self):
        self.owner = None  # the soma.Ray that started the session
        self.folder = None  # Ray's temp dir for this session (short: Ray's socket paths must fit)
        self.start_s = None  # how long the start took
        self.failed = None  # why it did not start: the next test that needs it fails at once, saying so
        self.made: list[str] = []  # every folder it made (LeftBehind looks for them at the end)

    def start(self):
        if self.owner is None:
            if _why_no_ray is not None:
                pytest.skip(f"needs Ray here: {_why_no_ray}")
            if self.failed is not None:
                pytest.fail(f"the session's Ray did not start: {self.failed!r}")
            import soma

            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            started = time.monotonic()
            for attempt in range(1, START_ATTEMPTS + 1):
                self.folder = tempfile.mkdtemp(prefix="soma-ray-", dir="/tmp")  # (not in TMPDIR: Ray's paths are short)
                self.made.append(self.folder)
                try:
                    # address="local": always a new instance of our own, never another program's cluster here
                    self.owner = soma.Ray("local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                                          _temp_dir=self.folder).start()
                    break
                except Exception as err:
                    import ray

                    ray.shutdown()  # what ray.init had started before it gave up
                    self.close()
                    if attempt == START_ATTEMPTS or RAY_START_TIMED_OUT not in str(err):
                        self.failed = err
                        raise
            self.start_s = time.monotonic() - started
        return self.owner

    def close(self) -> None:
        owner, self.owner = self.owner, None
        if owner is not None:
            owner.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


_session_ray = SessionRay()


@pytest.fixture(scope="session")
def ray_session():
    """The session's Ray (started on first use, shut down after the last test that uses it)."""
    yield _session_ray
    _session_ray.close()


@pytest.fixture(scope="module")
def ray_runner(ray_session):
    """A soma.Ray of the module's own on the session's Ray: closing it stops its actors, the session stays."""
    import soma

    ray_session.start()
    cluster = soma.Ray().start()
    yield cluster
    cluster.close()


# -- what the suite leaves behind -----------------------------------------------------------------------------

class LeftBehind:
    """The suite cleans up after itself, as soma does: what it leaves in /tmp and /dev/shm fails the session.

    Other programs use this machine's /tmp at the same time (other test sessions, soma's or not), so
    what is this session's must be told apart: for the session's duration TMPDIR (and `tempfile.tempdir`)
    is a folder of its own, `soma-tests-*`, which every temp file of the session, its subprocesses, soma's
    worker processes and Ray's processes goes into. At the end:

        /tmp/soma-tests-*/soma*             a soma run dir, a test's folder, ...: left by the suite or soma
        /tmp/soma-ray-* of SessionRay       the session's Ray's own folder, not removed at its close
        /dev/shm/soma-<this pid>-*          a segment of a pool this process hosted
        /dev/shm/soma_ray_<uid>             soma.Ray's start records' folder, made during the session and
                                            left (another Ray program on this machine at the same time
                                            may have made it: the message says so)

    Anything found fails the session, naming each; the folder of its own is removed either way (pytest's
    tmp_path folders stay where pytest keeps them: PYTEST_DEBUG_TEMPROOT is the machine's temp dir).
    """

    def __init__(self):
        import multiprocessing.util

        # multiprocessing's own temp folder (its fd passing's socket, say) made now, outside the session's: it
        # removes it at exit, after the session's folder is gone (made inside, its removal printed a traceback).
        multiprocessing.util.get_temp_dir()
        self.root = tempfile.gettempdir()
        self.folder = tempfile.mkdtemp(prefix="soma-tests-", dir=self.root)
        self.saved = {name: os.environ.get(name) for name in ("TMPDIR", "PYTEST_DEBUG_TEMPROOT")}
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", self.root)
        os.environ["TMPDIR"] = tempfile.tempdir = self.folder
        self.shm_before = self._shm()

    @staticmethod
    def _shm() -> set:
        return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()

    def found(self) -> list[str]:
        """What the session left, a line each."""
        left = [os.path.join(self.folder, name) for name in sorted(os.listdir(self.folder)) if name.startswith("soma")]
        left += [folder for folder in _session_ray.made if os.path.exists(folder)]
        new = self._shm() - self.shm_before
        left += [f"/dev/shm/{name}" for name in sorted(new) if name.startswith(f"soma-{os.getpid()}-")]
        records = f"soma_ray_{os.getuid()}"
        if records in new:
            left.append(f"/dev/shm/{records} (soma.Ray's start records: made during the session and left; another "
                        f"Ray program on this machine at the same time would have made it too)")
        return left

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        tempfile.tempdir = None


_left_behind: LeftBehind | None = None


@pytest.hookimpl(trylast=True)  # after pytest has torn the session's fixtures down
def pytest_sessionfinish(session, exitstatus):
    if _left_behind is None:
        return
    _session_ray.close()  # (normally closed already, by the last test that needed it)
    left = _left_behind.found()
    _left_behind.close()
    if left:
        reporter = session.config.pluginmanager.getplugin("terminalreporter")
        text = "the suite left these behind (a suite cleans up after itself, as soma does):\n  " + "\n  ".join(left)
        if reporter is not None:
            reporter.write_line("")
            reporter.write_sep("=", "left behind", red=True, bold=True)
            reporter.write_line(text)
        else:
            print(text, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config):
    if _why_no_ray is None:
        return "Ray: in a loopback-only network namespace (tests that need it run last)"
    return f"Ray: its tests are skipped: {_why_no_ray}"


def pytest_terminal_summary(terminalreporter):
    if _session_ray.start_s is not None:
        terminalreporter.write_line(f"the session's Ray started in {_session_ray.start_s:.1f} s")


# -- helpers -------------------------------------------------------------------------------------------

def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def shm_names(prefix: str | None = None) -> set:
    """The shared-memory files whose names start with `prefix`; by default those of the pools this process
    hosts (`soma-<this pid>-...`, their workers' too), never another program's on this shared machine."""
    prefix = f"soma-{os.getpid()}-" if prefix is None else prefix
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def segment_file(value) -> str | None:
    """The /dev/shm file a tensor's or an array's first byte is a mapping of in this process (its name, as
    `shm_names` gives it), or None: read from /proc/self/maps, not from soma's books."""
    address = value.data_ptr() if hasattr(value, "data_ptr") else value.__array_interface__["data"][0]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= address < hi:
                path = fields[5].strip().removesuffix(" (deleted)") if len(fields) > 5 else ""
                return path[len("/dev/shm/"):] if path.startswith("/dev/shm/") else None
    return None


def in_threads(func, count: int, seconds: float = 60.0) -> list:
    """`[func(0), ..., func(count - 1)]`, each called on a thread of its own, all at once.

    Fails if a thread is still running after `seconds` (naming how many), and raises
    the first exception a thread raised: never a silent pass over a hung or failed thread.
    """
    results: list = [None] * count
    errors: list = []

    def call(k):
        try:
            results[k] = func(k)
        except BaseException as exc:  # re-raised below, in the test's own thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(k,), daemon=True) for k in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = sum(thread.is_alive() for thread in threads)
    assert not hung, f"{hung} of {count} threads still running after {seconds} s"
    if errors:
        raise errors[0]
    return results


def outputs_until_error(outputs) -> tuple[list, BaseException | None]:
    """What an iterator of outputs (a map) yielded before it raised, and what it raised (None if nothing)."""
    got = []
    try:
        for y in outputs:
            got.append(y)
    except Exception as err:
        return got, err
    return got, None


def process_gone(pid: int) -> bool:
    """Process `pid` has exited (or is a zombie nobody has reaped yet)."""
    import psutil

    try:
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(condition, seconds: float = 10.0, what: str = "condition") -> None:
    """Poll `condition()` until it holds; fail naming `what` after `seconds` (never sleep-and-hope)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def module_at(tmp_path, name: str, source: str, **version):
    """`(write, module)`: module `name` of `source` formatted with `version`, importable while the block runs;
    `write(reload=True, **version)` edits it on disk (a second later, whatever the file system's clock grain)
    and reloads it (as `importlib.reload`: a new class; IPython's %autoreload patches the old one in place)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source.format(**version))
    stamp = [os.stat(path).st_mtime_ns]

    def write(reload=True, **again):
        path.write_text(source.format(**again))
        stamp[0] += 1_000_000_000
        os.utime(path, ns=(stamp[0], stamp[0]))
        return importlib.reload(sys.modules[name]) if reload else sys.modules[name]

    sys.path.insert(0, str(tmp_path))
    try:
        yield write, importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
