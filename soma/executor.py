"""`Executor`: runs a graph in this process.

A sequence runs in order on the caller's thread; a wave runs each branch whole on
a thread of its own (torch's current device is thread-local, so a branch never
hops threads). See `soma.execute` for the interpreter itself.
"""

from __future__ import annotations

import threading

from .errors import RunTimeout
from .execute import RunState, Runner


class Executor:
    """The in-process runner: `Executor().run(g, x)`."""

    def run(self, g, x, *, timeout: float | None = None):
        """Run graph `g` on input `x` and return its output.

        With `timeout`, the run happens on a helper thread and `RunTimeout` names
        the nodes still running when it expires. Threads cannot be killed: a
        node already running finishes, and no further node of that run starts.
        """
        runner = Runner(g._catalog, g.devices())
        plan = g.plan()
        state = RunState()
        if timeout is None:
            return runner.run(plan, x, state)
        box: dict = {}

        def whole_run() -> None:
            try:
                box["value"] = runner.run(plan, x, state)
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=whole_run, name="soma-run", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            state.cancelled = True
            nodes = state.running_now()
            raise RunTimeout(
                f"run timed out after {timeout} s; still running: {', '.join(f'`{n}`' for n in nodes) or 'none'}",
                nodes=nodes,
            )
        if "error" in box:
            raise box.pop("error")
        return box["value"]
