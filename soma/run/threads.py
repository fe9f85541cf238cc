"""Threads that run parts of one input: a wave's branches, a batch's inputs, and what they inherit.

    on_threads(calls)          each call on a thread of its own (in-process: new ones, none left behind;
                               in a worker: this thread and kept ones); every failure waits for its siblings
    kept_threads()             a worker's reusable threads (a thread start per branch costs as much as a node)
    thread_modes()             torch's grad and inference mode, carried to those threads
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading


def on_threads(calls: list, kept: "KeptThreads | None" = None) -> list:
    """Run each zero-argument call on a thread of its own; wait for all of them.

    Returns one `(True, value)` or `(False, exception)` per call, in order: a failure
    waits for its siblings. Threads inherit torch's grad and inference mode from this
    one. In-process every call gets a new thread and no thread is left behind; with
    `kept` (in a worker) this thread runs the first call and kept threads the others (this
    thread too, any of them no kept thread has started by then).
    """
    results: list = [None] * len(calls)
    inherit = thread_modes()

    def one(i: int) -> None:
        try:
            with inherit():
                results[i] = (True, calls[i]())
        except BaseException as exc:  # every failure waits for the siblings
            results[i] = (False, exc)

    if kept is not None:
        kept.run([lambda i=i: one(i) for i in range(len(calls))])
    else:
        threads = [threading.Thread(target=one, args=(i,), name=f"branch {i + 1}", daemon=True)
                   for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    # A copy, and `results` emptied: a failure's traceback holds `one`'s frame, which holds `results` (a cycle
    # that kept the input and the other branches' outputs until the garbage collector ran).
    out = list(results)
    results.clear()
    return out


class KeptThreads:
    """Threads a worker keeps for waves' branches: starting two threads per input cost ~180 µs here.

    `run(calls)` runs the first call on this thread and hands each other to an idle kept
    thread (a new one when none is idle, so nested waves never wait for a thread), and
    returns when all are done. A call runs whole on the one thread that claims it first:
    this thread, done with its own, runs those no kept thread has started yet. Waking a
    kept thread and handing it the GIL cost 0.3-1.7 ms here while the other core was busy
    (3-5 % of a 30 ms input with one wave), and pure-Python branches serialize on the GIL
    anyway; a call that blocks releases the GIL, and every call still unclaimed then has
    its own thread ready to start it, so calls that need each other still run at once.
    """

    def __init__(self):
        self._idle: list = []
        self._lock = threading.Lock()
        self._made = 0  # threads made so far (they are named "branch 1", "branch 2", ...)

    @property
    def made(self) -> int:
        """How many kept threads exist (they are never ended: a worker's or an actor's for its life)."""
        return self._made

    def run(self, calls: list) -> None:
        handed = []
        for call in calls[1:]:
            with self._lock:
                inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                inbox = queue.SimpleQueue()
                self._made += 1
                threading.Thread(target=self._serve, args=(inbox,), name=f"branch {self._made}", daemon=True).start()
            branch = _Branch(call, inbox)
            inbox.put(branch)
            handed.append(branch)
        calls[0]()
        for branch in handed:
            if branch.claim.acquire(False):  # no kept thread has started it: it runs here, now
                self._give_back(branch)  # (its thread skips it when it wakes: the next wave may use it)
                branch.call()
                branch.done.set()
        for branch in handed:
            branch.done.wait()

    def _serve(self, inbox) -> None:
        while True:
            branch = inbox.get()
            if not branch.claim.acquire(False):  # the thread that handed it over ran it
                self._give_back(branch)
                continue
            try:
                branch.call()  # (it catches what its branch raises)
            finally:
                self._give_back(branch)  # idle before done: the next wave finds this thread
                branch.done.set()

    def _give_back(self, branch) -> None:
        """The thread `branch` was handed to is idle again (once: by itself, or by whoever ran its call)."""
        with self._lock:
            if not branch.given_back:
                branch.given_back = True
                self._idle.append(branch.inbox)


class _Branch:
    """One call handed to a kept thread: `claim` is taken by whichever thread runs it; `done` is set after.
    `inbox` is the thread's; it goes back to the idle ones once (`given_back`), by whoever is first."""

    __slots__ = ("call", "inbox", "claim", "done", "given_back")

    def __init__(self, call, inbox):
        self.call = call
        self.inbox = inbox
        self.claim = threading.Lock()
        self.done = threading.Event()
        self.given_back = False


_kept: "KeptThreads | None" = None
_kept_lock = threading.Lock()


def kept_threads() -> KeptThreads:
    """This process's kept branch threads (a worker's or an actor's: they live as long as it does)."""
    global _kept
    if _kept is None:
        with _kept_lock:
            if _kept is None:
                _kept = KeptThreads()
    return _kept


def thread_modes():
    """What a branch thread must inherit from the thread that started the wave.

    torch keeps grad and inference mode per thread: without this, `with torch.no_grad(): g.run(x)`
    would still build autograd graphs inside every wave. So are autocast (`with torch.autocast("cpu",
    dtype=torch.bfloat16)`) and `torch.set_default_device`: an Executor's map and a wave's branches ran in
    float32, on the CPU, where its `run` gave bfloat16 on the device set (SPEC 7.4: the same answers).
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "is_inference_mode_enabled"):  # absent, or still importing
        return contextlib.nullcontext
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    casts = [(kind, torch.get_autocast_dtype(kind)) for kind in _AUTOCAST if torch.is_autocast_enabled(kind)]
    # (a default device is a mode on torch's function-mode stack: asked only when that is not empty, 4 µs)
    device = torch.get_default_device() if torch._C._len_torch_function_stack() else None
    if device is not None and device.type == "cpu":
        device = None

    @contextlib.contextmanager
    def inherit():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            if not casts and device is None:
                yield
                return
            with contextlib.ExitStack() as modes:
                for kind, dtype in casts:
                    modes.enter_context(torch.autocast(kind, dtype=dtype))
                if device is not None:
                    modes.enter_context(torch.device(device))
                yield

    return inherit


_AUTOCAST = ("cpu", "cuda")  # the device types whose autocast a thread inherits
