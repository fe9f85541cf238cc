"""`soma.Local`: graphs on worker processes of this machine. Two sides, each a package:

    runner.py   Local, the public face (the caller's thread)
    host/       in the caller's process: program.py (compile), scheduler.py + flows.py + choice.py
                (what becomes of each input, which worker), receiving.py (who receives), pool.py
                (processes, sockets, leases), procs.py, leases.py
    worker/     the `soma-worker` program (`python -m soma.local.worker`): one process of the pool

How one `run(g, x)` goes, top to bottom (each module calls only the ones below it; answers
come back as return values; the worker's side is drawn in `soma.local.worker`):

    caller thread
    Local.run(g, x)            runner.py   the program of (g, placement), compiled once (host/program.py):
      │                                    pieces of the plan, each run whole on one worker;
      │                                    PlacementError here, before anything is sent
      ├─▶ Scheduler.start      scheduler   a Flow for x; flows.Walker turns the program into Jobs
      │                                    (x encoded once by soma.wire.codec: tensors into shared
      │                                    segments, handles only) ─▶ the queue
      │   _pump                            a worker for each job (choice.py: its CUDA device, the
      │                                    copies it holds, the copies allowed, fewest jobs out);
      │                                    a batching node alone keeps its inputs unencoded until
      │                                    here: those going to one worker are encoded together
      │                                    into Bundles (flows.Walker.bundle)
      ├─▶ WorkerPool.send      pool        one Task per worker, with the node code and piece specs
      │                                    it lacks ── ROUTER ── ipc ──────────▶ worker: decode, run
      │                                                                          (soma.run.interpreter:
      │                                                                          setup, forward, Done,
      │                                                                          postcondition), encode
      ├─▶ Receiving.await_item receiving   the caller receives while nobody else does (or sleeps on
      │                                    its sink while another caller or the listener thread does):
      │      pool.frame() ◀── PULL ◀── Result[outcomes, releases] ◀──────────── worker
      │      pool.handle(frame)  pool      authenticate, decode outputs (map segments), count leases
      │                                    (leases.py) → [Outcomes(slot, [Arrived job, ...])]
      │      Scheduler.handle    scheduler the postcondition on what arrived; the job's continuation
      │                                    returns the next Jobs (queued, pumped) or the flow's end:
      │                                    (index, ok, value) → the caller's sink
      ◀── the output, or the failure, raised

    map(g, xs): soma.run.mapping takes inputs lazily within the window and calls
    LocalInflight.start (many flows, one sink) and .wait (Receiving.await_item on that sink).
    A worker that dies: the listener asks pool.find_dead(), drains what it sent, and hands the
    pool's Lost to Scheduler.handle: the jobs it held fail (WorkerDied), a replacement starts.
    A timeout: Scheduler.expire reads the status pages, retires the workers running that input's
    nodes (pool.retire → Lost), and names them (RunTimeout).
    close(): every flow in flight gets SomaError; STOP to every worker; the listener closes the
    results socket itself; segments unlinked, the socket directory removed. atexit closes pools
    left open.
"""

from __future__ import annotations


def __getattr__(name: str):
    # Lazy: a worker (`python -m soma.local.worker`) imports this package and must not pay for the host's side.
    if name == "Local":
        from .runner import Local

        return Local
    raise AttributeError(f"module 'soma.local' has no attribute {name!r}")


__all__ = ["Local"]
