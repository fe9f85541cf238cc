"""Worker processes: how the host starts them, how it tells how they ended, and when a slot starts the next."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

from ...errors import SomaError
from ...wire import nodecode
from ...wire.protocol import SECRET_ENV, SYS_PATH_ENV
from ...wire.status import StatusPage


class WorkerProcess:
    """One incarnation of a worker slot: its process, its readiness, what it has been sent."""

    def __init__(self, slot: int, proc: subprocess.Popen, status_path: str, sys_path: list):
        self.slot = slot
        self.id = f"w{slot}"
        self.proc = proc
        self.pid = proc.pid
        self.spawned_ns = time.monotonic_ns()  # (a trace shows its start: from here to its hello)
        self.identity = f"{self.id}.{self.pid}".encode()  # its socket's identity (see soma.local.worker)
        self.status_path = status_path
        self.ready = False  # it said hello
        self._checked = 0.0
        self.retired = False  # its death has been handled
        self.leaving = False  # it said it leaves (over max_memory): it takes nothing more, its replacement will
        self.loaded: set[int] = set()  # node keys whose code it has been sent
        self.pieces: set[int] = set()  # piece ids whose spec it has been sent
        self.forget: list[int] = []  # keys of nodes gone on the host, to tell it with its next task
        self.sys_path = sys_path  # the host's sys.path as this worker searches it (host_sys_path: path_news)
        self._status = None

    def path_news(self, roots=()) -> list | None:
        """The host's sys.path, then the folders of `roots` it lacks, when that changed since this worker was
        given it (at its start, or with code since); None when it did not.

        Called only with node code on its way (a run that sends none compares nothing): a notebook that
        appends a folder after the pool started, then imports a node from it, sends the node with the new path,
        and the worker searches it before it loads the code, as a worker started now would. Compared as the
        worker searches it (relative entries made absolute): after an os.chdir, '' names another folder.
        `roots`: where the modules of the nodes sent are imported from (codefiles.SentFiles), last: a module
        imported through '' before an os.chdir is still found (the host has it, the workers import it)."""
        now = host_sys_path()
        now += [root for root in roots if root not in now]
        return None if now == self.sys_path else now

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


def host_sys_path() -> list[str]:
    """The host's sys.path as a worker must search it: relative entries ('' is the working directory) made
    absolute, since a worker's working directory is the host's as of its start only; entries that are not str
    left out, as the host's imports skip them."""
    cwd = os.getcwd()
    return [os.path.join(cwd, p) if p else cwd for p in sys.path if isinstance(p, str)]


# What the worker's interpreter runs first. Not `-m soma.local.worker`: `-m` puts the working directory first on
# sys.path before any of soma runs, so a user's argparse.py (or json.py ...) there was imported instead of the
# standard library's and every worker died before its hello; and soma itself was found only where the worker's
# default path had it. So: drop the working directory ('' on every version, for -c; `-P`, which 3.11+ has and
# 3.10 does not, would also show in the worker's sys.flags and pass on to its own children), adopt the host's
# sys.path (JSON: any path, ':' in it included, survives; os.pathsep does not), and only then import soma.
BOOTSTRAP = ("import sys; sys.path[:] = [p for p in sys.path if p]; import json, os; "
             f"sys.path[:] = json.loads(os.environ.pop({SYS_PATH_ENV!r})); "
             "from soma.local.worker.main import main; sys.exit(main())")


def refuse_if_loading_code() -> None:
    """A pool is not started by the top-level code of a module a node's code imports (multiprocessing refuses
    the same as its children import `__main__`): its workers would import it, and start pools, process after
    process (a tester's script without `if __name__ == "__main__":`, imported for its node class)."""
    if nodecode.loading():
        raise SomaError("soma.Local cannot start workers here: this process is loading a node's code (a worker or "
                        "Ray actor importing the node's module), and that module's top-level code starts a pool, "
                        "which each of its workers would import and start again, process after process. Put "
                        "what must run once (making a pool, running it) under `if __name__ == \"__main__\":`")


def spawn(slot: int, device: str, *, endpoints: tuple, run_dir: str, secret: bytes, prefix: str,
          threads: int, arena: int, preload_torch: bool, max_memory: int | None = None) -> WorkerProcess:
    """Start the `soma-worker` program for a slot: the host's interpreter with its flags, sys.path and working
    directory."""
    status_path = os.path.join(run_dir, f"status-w{slot}-{os.urandom(4).hex()}")
    # The host's interpreter flags too (-O, -W error, -X dev, -b, -E ...), as multiprocessing passes them to
    # its children: a node must meet the same asserts, warning filters and checks on Local as on the Executor.
    argv = [
        sys.executable, *subprocess._args_from_interpreter_flags(), "-c", BOOTSTRAP,
        "--tasks", endpoints[0], "--results", endpoints[1],
        "--id", f"w{slot}", "--device", device, "--threads", str(threads),
        "--host-pid", str(os.getpid()), "--prefix", prefix, "--arena", str(arena),
        "--status", status_path, "--max-memory", str(max_memory or 0),
    ]
    if preload_torch:
        argv.append("--preload-torch")
    env = dict(os.environ)
    env[SECRET_ENV] = secret.hex()  # readable only by this user, in /proc/<pid>/environ (0400)
    path = host_sys_path()
    env[SYS_PATH_ENV] = json.dumps(path)
    # Its share of the cores: two processes each using every core run 1.5-3x slower here.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    # A session of its own: the terminal's Ctrl-C (SIGINT to the foreground process group) is the host's to
    # handle, not every worker's (they would die, be replaced, and run every setup again).
    proc = subprocess.Popen(argv, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL, close_fds=True,
                            start_new_session=True)
    return WorkerProcess(slot, proc, status_path, path)


START_FAILURES = 3  # a slot whose workers die this many times in a row before saying hello is down (why_down)
RESTART_FIRST_S = 0.1  # such a slot starts its next worker after this long, doubled after each death in a row
RESTART_MAX_S = 3.2  # ... up to this: the slot keeps trying, so the pool runs again once the cause is gone


class Restarts:
    """When each slot starts its next worker, and what to say while it has none (bookkeeping: no processes).

    A worker that dies after its hello is replaced at once. One that dies before it (an
    interpreter that cannot start, a `kill -9` of each new one) is started again after a
    wait that doubles from RESTART_FIRST_S to RESTART_MAX_S, for as long as the pool is
    open; after START_FAILURES such deaths in a row the slot is down (`why_down`) until
    one says hello. A start the machine refuses (no file descriptor, no memory) is tried
    again after RESTART_FIRST_S, or at once when a run wants the slot.
    """

    def __init__(self):
        self.failures = Counter()  # slot → how many of its workers in a row died before saying hello
        self.ended: dict = {}  # slot → how the last of those ended ("was killed by signal 9 (SIGKILL)")
        self.at: dict = {}  # slot → when its next worker is started (a slot without one)
        self.refused: dict = {}  # slot → the OSError its last start met

    def hello(self, slot: int) -> None:
        self.failures[slot] = 0

    def died(self, slot: int, said_hello: bool, how: str) -> None:
        """The worker of `slot` ended (`how`, in words that follow "worker w0"): when its next one starts."""
        if said_hello:
            self.failures[slot] = 0
        else:
            self.failures[slot] += 1
            self.ended[slot] = how
        failures = self.failures[slot]
        self.at[slot] = time.monotonic() + (min(RESTART_MAX_S, RESTART_FIRST_S * 2 ** (failures - 1))
                                            if failures else 0.0)

    def due(self, slot: int | None = None, wanted: bool = False) -> list[int]:
        """The slots (of `slot` alone, if given) whose next worker is to start now (`wanted`: a run wants it, so
        one the machine refused is tried at once)."""
        now = time.monotonic()
        return [s for s in ([slot] if slot is not None else list(self.at))
                if s in self.at and (self.at[s] <= now or (wanted and s in self.refused))]

    def started(self, slot: int) -> None:
        self.refused.pop(slot, None)
        self.at.pop(slot, None)

    def could_not_start(self, slot: int, err: OSError) -> bool:
        """The machine refused to start the next worker of `slot`; whether this is the first refusal in a row."""
        first = slot not in self.refused
        self.refused[slot] = err
        self.at[slot] = time.monotonic() + RESTART_FIRST_S
        return first

    def gave_up(self, slot: int) -> bool:
        """Whether the slot's workers died before saying hello START_FAILURES times in a row (or more)."""
        return self.failures[slot] >= START_FAILURES

    def why_down(self, slot: int, has_worker: bool) -> str | None:
        """Why the slot cannot take jobs now, in words that follow "worker w1"; None when it can, or when its
        next worker is on its way (`has_worker`) and has not been given up on."""
        err = self.refused.get(slot)
        if err is not None:
            hint = ""
            if getattr(err, "errno", None) == errno.EMFILE:
                hint = (" (this process has run out of file descriptors: close some, or raise the limit with "
                        "`ulimit -n`; the pool starts it again as soon as it can)")
            return f"could not be started again: {type(err).__name__}: {err}{hint}"
        if self.gave_up(slot) and not has_worker:
            return self.what_was_seen(slot)
        return None

    def what_was_seen(self, slot: int) -> str:
        """What was seen of a slot whose workers keep dying before they say hello, and what happens next."""
        ended = self.ended.get(slot, "died")
        # Its stderr is the host's (inherited), and soma does not read it: say where to look, not what it said.
        seen = ("something outside soma kills it as it starts (`kill -9`, or the kernel's out-of-memory killer)"
                if "signal" in ended else "anything it printed is on this process's stderr")
        when = self.at.get(slot)
        again = "" if when is None else (f"; the pool starts it again in {max(0.0, when - time.monotonic()):.1f} s, "
                                         f"and runs there once one says hello")
        return f"{ended} before it was ready, {self.failures[slot]} times in a row: {seen}{again}"
