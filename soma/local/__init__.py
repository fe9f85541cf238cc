"""The host side of `soma.Local`: compiles programs, decides which worker runs what, gathers results.

How one `run(g, x)` flows (the worker's side is drawn in `soma.local.worker`):

    caller thread                       host (this package)                           a worker
    ─────────────                       ───────────────────                           ────────
    Local.run(g, x)          local.py   the program of (g, placement), compiled once (program.py):
      │                                 pieces of the plan, each run whole on one worker;
      │                                 PlacementError here, before anything is sent
      ├─▶ Scheduler.start  scheduler.py a Flow for x; flows.py walks the program: each Piece it
      │                                 reaches becomes a Job (x encoded once by soma.wire.codec:
      │                                 tensors into shared segments, handles only)
      │   pump: a worker for each job   (its CUDA device; the copies of the piece's nodes it
      │                                 holds; the copies their classes allow; fewest jobs out)
      ├─▶ WorkerPool.send     pool.py   one Task per worker, with the node code and piece specs
      │                                 it lacks ── ROUTER ── ipc ──────────────────────▶ DEALER
      │                                                                      a lane per piece, its
      │                                                                      jobs in order: decode,
      │                                                                      run (soma.run.interpreter),
      │                                                                      encode, flush
      │   await_item: the caller       ◀── PULL ◀── Result [outcomes, releases] ◀──────── PUSH
      │   receives its own outcome while nobody else does (a waiting caller, or the
      │   listener thread when no caller waits, receives for the others)
      │   pool: authenticate, decode outputs (map segments), count leases (leases.py)
      │   Scheduler.on_outcomes: the postcondition on what arrived, then the job's continuation:
      │   the next piece (another Job), a wave's join, or the flow's end: (index, ok, value) → sink
      ◀── sink.get(): the output, or the failure, raised

    map(g, xs) is the same with many flows in one sink (soma.run.mapping takes the inputs lazily).
    A worker that dies: the listener drains what it sent, fails the jobs it held (WorkerDied),
    settles its segments and starts a replacement. A timeout: Scheduler.expire reads the status
    pages, replaces the workers running that input's nodes, and names them (RunTimeout).
    close(): every flow in flight gets SomaError; STOP to every worker; the listener closes its
    socket itself; segments unlinked, the socket directory removed. atexit closes pools left open.
"""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy: a worker (`python -m soma.local.worker`) imports this package and must not pay for the host's side.
    if name == "Local":
        from .runner import Local

        return Local
    raise AttributeError(f"module 'soma.local' has no attribute {name!r}")


__all__ = ["Local"]
