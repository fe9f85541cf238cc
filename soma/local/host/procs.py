"""Worker processes: how the host starts them, and how it tells how they ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from ...wire.protocol import SECRET_ENV
from ...wire.status import StatusPage


class WorkerProcess:
    """One incarnation of a worker slot: its process, its readiness, what it has been sent."""

    def __init__(self, slot: int, proc: subprocess.Popen, status_path: str):
        self.slot = slot
        self.id = f"w{slot}"
        self.proc = proc
        self.pid = proc.pid
        self.spawned_ns = time.monotonic_ns()  # (a trace shows its start: from here to its hello)
        self.identity = f"{self.id}.{self.pid}".encode()  # its socket's identity (see soma.local.worker)
        self.status_path = status_path
        self.ready = threading.Event()  # set by its HELLO
        self._checked = 0.0
        self.retired = False  # its death has been handled
        self.leaving = False  # it said it leaves (over max_memory): it takes nothing more, its replacement will
        self.loaded: set[int] = set()  # node keys whose code it has been sent
        self.pieces: set[int] = set()  # piece ids whose spec it has been sent
        self.forget: list[int] = []  # keys of nodes gone on the host, to tell it with its next task
        self._status = None

    def alive(self, recheck_s: float = 0.0) -> bool:
        """Whether the process runs; with `recheck_s`, a positive answer that young is trusted."""
        now = time.monotonic()
        if recheck_s and now - self._checked < recheck_s:
            return True
        if self.proc.poll() is None:
            self._checked = now
            return True
        return False

    def how_it_ended(self, hint: bool = True) -> str:
        """"was killed by signal 9 (SIGKILL...)", "exited with code 3"; `hint`: what a SIGKILL usually means."""
        code = self.proc.poll()
        if code is None:
            return "is still running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            why = (": what the kernel's out-of-memory killer sends; soma.Local(max_memory=...) replaces a worker "
                   "before it grows that far") if hint and -code == signal.SIGKILL else ""
            return f"was killed by signal {-code} ({name}{why})"
        return f"exited with code {code}"

    def running(self) -> list[tuple[int, str]] | None:
        """`(job id, node id)` its status page says it is (or was, when it died) running; None when the page
        cannot be read (no file descriptor left, say): then nobody knows what it had started."""
        try:
            if self._status is None:
                self._status = StatusPage(self.status_path, create=False)
            return self._status.read()
        except (OSError, ValueError):
            return None

    def kill(self) -> None:
        if self.alive():
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def close(self) -> None:
        if self._status is not None:
            self._status.close()
            self._status = None
        try:
            os.unlink(self.status_path)
        except FileNotFoundError:
            pass


def spawn(slot: int, device: str, *, endpoints: tuple, run_dir: str, secret: bytes, prefix: str,
          threads: int, arena: int, preload_torch: bool, max_memory: int | None = None) -> WorkerProcess:
    """Start `python -m soma.local.worker` for a slot: the host's interpreter, sys.path and working directory."""
    status_path = os.path.join(run_dir, f"status-w{slot}-{os.urandom(4).hex()}")
    argv = [
        sys.executable, "-m", "soma.local.worker",
        "--tasks", endpoints[0], "--results", endpoints[1],
        "--id", f"w{slot}", "--device", device, "--threads", str(threads),
        "--host-pid", str(os.getpid()), "--prefix", prefix, "--arena", str(arena),
        "--status", status_path, "--max-memory", str(max_memory or 0),
    ]
    if preload_torch:
        argv.append("--preload-torch")
    env = dict(os.environ)
    env[SECRET_ENV] = secret.hex()  # readable only by this user, in /proc/<pid>/environ (0400)
    env["SOMA_SYS_PATH"] = os.pathsep.join(p if p else os.getcwd() for p in sys.path)
    # Its share of the cores: two processes each using every core run 1.5-3x slower here.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # A session of its own: the terminal's Ctrl-C (SIGINT to the foreground process group) is the host's to
    # handle, not every worker's (they would die, be replaced, and run every setup again).
    proc = subprocess.Popen(argv, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)
    return WorkerProcess(slot, proc, status_path)
