"""The `soma-worker` program: one process of a `soma.Local` pool.

How messages flow through a worker (host on the left, see `soma.scheduler`):

    host ROUTER ──TASK/FREE/STOP──▶ DEALER ──────┐
                                                  │  one thread leads: it polls the DEALER,
                                                  │  takes one message, hands the lead on,
                                                  ▼  then runs what it took (leader/follower:
                                         ┌─ thread ─┐   no queue between receiving and running)
                                         │ TASK: load node code once (cloudpickle), decode the
                                         │ input (tensors map shared segments), run each branch
                                         │ whole (soma.execute.Runner; branches of one task run
                                         │ on threads), check postconditions, encode outputs
                                         │ (tensors as segment handles), drop the input
                                         └──────────┘
    host PULL  ◀──HELLO/RESULT── PUSH (one lock: any thread may send)

    watchdog thread: every 0.5 s, if the host (our parent) is gone, unlink the
    pool's segments and exit.

The host starts it as `python -m soma.worker` (the same program as the
`soma-worker` console script) with its own `sys.path`, working directory and the
pool's secret in the environment; `--help` lists the arguments.
"""

from .main import main

__all__ = ["main"]
