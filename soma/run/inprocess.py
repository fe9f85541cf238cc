"""One input run in this process, on the caller's thread (or, with a timeout, on a helper thread).

    Graph.run(x) / Expr.run(x)  ──▶ run_here(nodes, devices, plan, x, timeout)    a fresh Interpreter
    Executor._run               ──▶ run_plan(interpreter, plan, x, state, spans, timeout)
                                      no timeout: interpreter.run on this thread
                                      timeout:    on a "run" thread, joined for `timeout`; then the
                                                  RunTimeout naming the nodes running now (the run is
                                                  cancelled before its next node: a thread cannot be killed)

Below the runners on purpose: it knows plans, node objects and devices, never a Graph,
an expression or a runner, so that `Graph.run` and `Expr.run` (soma.graph, soma.node) run
in-process without importing the Executor, which imports them back (no import cycle).
"""

from __future__ import annotations

import threading

from ..errors import RunTimeout
from .arguments import checked_timeout
from .interpreter import Interpreter, RunState
from .threads import thread_modes


def run_here(nodes: dict, devices: dict, plan, x, timeout: float | None = None):
    """`plan` run on `x` over the node objects `nodes` (id → Node) placed on `devices` (id → device): its
    output, or the node's error; a RunTimeout once `timeout` seconds have passed."""
    return run_plan(Interpreter(nodes, devices), plan, x, RunState(index=None), None, checked_timeout(timeout))


def run_plan(interpreter: Interpreter, plan, x, state: RunState, spans, timeout: float | None):
    """`interpreter.run(plan, x, state, spans)` on this thread, or, with `timeout`, on a helper thread that
    is given `timeout` seconds (its node running then finishes; no further node starts)."""
    if timeout is None:
        return interpreter.run(plan, x, state, spans)
    box: dict = {}
    modes = thread_modes()

    def whole_run() -> None:
        try:
            with modes():
                box["value"] = interpreter.run(plan, x, state, spans)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=whole_run, name="run", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        state.cancelled = True
        raise RunTimeout.after(timeout, dict.fromkeys(state.running_now()), ())
    if "error" in box:
        raise box.pop("error")
    return box["value"]
