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
    `kept` (in a worker) this thread runs the first call and kept threads the others.
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
        return results
    threads = [threading.Thread(target=one, args=(i,), name=f"branch {i + 1}", daemon=True)
               for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class KeptThreads:
    """Threads a worker keeps for waves' branches: starting two threads per input cost ~180 µs here.

    `run(calls)` runs the first call on this thread and each other on an idle kept
    thread (a new one when none is idle, so nested waves never wait for a thread),
    and returns when all are done. A kept thread is a branch's own for the call.
    """

    def __init__(self):
        self._idle: list = []
        self._lock = threading.Lock()
        self._made = 0  # threads made so far (they are named "branch 1", "branch 2", ...)

    def run(self, calls: list) -> None:
        left = [len(calls) - 1]
        all_done = threading.Event()
        if not left[0]:
            all_done.set()

        def finished():
            with self._lock:
                left[0] -= 1
                if not left[0]:
                    all_done.set()

        for call in calls[1:]:
            with self._lock:
                inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                inbox = queue.SimpleQueue()
                self._made += 1
                threading.Thread(target=self._serve, args=(inbox,), name=f"branch {self._made}", daemon=True).start()
            inbox.put((call, finished))
        calls[0]()
        all_done.wait()

    def _serve(self, inbox) -> None:
        while True:
            call, finished = inbox.get()
            try:
                call()  # (it catches what its branch raises)
            finally:
                with self._lock:
                    self._idle.append(inbox)
                finished()


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
    would still build autograd graphs inside every wave.
    """
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "is_inference_mode_enabled"):  # absent, or still importing
        return contextlib.nullcontext
    grad = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()

    @contextlib.contextmanager
    def inherit():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            yield

    return inherit
