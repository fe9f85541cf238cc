"""`soma.Local`: graphs on worker processes of this machine. Two sides, each a package:

    runner.py   Local, the public face (the caller's thread); inflight.py, its in-flight set for map
    host/       in the caller's process. One owner of the host's state: core.py, a pure state machine
                (events in, actions out: no locks, no sockets, no threads; with core_workers.py, workers
                coming and going, and core_chunks.py, a map's chunks: chunks.py), with its books in
                dispatch.py (lines, the choice of a worker), measures.py (what outcomes taught) and flows.py
                (an input's walk); loop.py, the only code that locks and the only code that touches the sockets
                and the core (callers that wait receive for each other; loop_workers.py: workers spawned, ended,
                found dead; loop_maps.py: what a map asks and tells); pool.py (processes, sockets, leases),
                sending.py (encoding), outcomes.py (decoding, checking), listener.py, program.py (compile),
                procs.py, leases.py
    worker/     the `soma-worker` program (`python -m soma.local.worker`): one process of the pool

How one `run(g, x)` goes (calls go down, answers come back as return values; the worker's side is drawn in
`soma.local.worker`):

    caller thread
    Local.run(g, x)             runner.py  the program of (g, placement), compiled once (host/program.py):
      │                                    pieces of the plan, each run whole on one worker;
      │                                    PlacementError here, before anything is sent
      ├─▶ HostLoop.run_one       loop      start_one: a Flow for x, posted to the loop's inbox; whoever holds the
      │                                    lock (this thread, if it is free) hands it to the core:
      │     HostCore.start       core      flows.Walker makes the Jobs; dispatch.pump picks a worker for
      │                                    each (by the depths measures.py learnt) → Send(slot, jobs)
      │     the loop carries out Send: sending.encode (x encoded once, tensors into shared segments,
      │     handles only; a batching node alone's inputs into one bundle) → pool.send: one Task
      │                                        ── ROUTER ── ipc ──▶ worker: decode, run, encode
      │     meanwhile the caller takes in what else is queued and looks at the workers (off the way back)
      │   then await_item        loop      the caller receives while nobody else does (or sleeps on its
      │                                    sink while another caller or the listener does), looking at the
      │                                    socket before it blocks while outcomes come quickly (the spin:
      │                                    wire/transport.py):
      │     pool.receiver ◀── PULL ◀── Result[outcomes, releases] ◀──────────── worker
      │     pool.handle(frame)   pool      authenticate, decode outputs (map segments), count leases
      │     HostCore.outcomes    core      the postcondition on what arrived (outcomes.py); the job's
      │                                    continuation: the next jobs, or the input's outcome → Deliver
      │     the lock let go, then each Deliver put in its sink (so a future's callback holds no lock)
      ◀── the output, or the failure, raised

    map(g, xs): soma.run.mapping takes inputs lazily within the window and calls LocalInflight.start (inflight.py)
    (many flows, one sink) and .wait (HostLoop.await_item on that sink).
    A worker that dies: whoever holds the lock finds it (pool.find_dead, every PUMP_S), receives what it
    sent first, ends it (pool.end), and tells the core (`lost`): the jobs it ran fail (WorkerDied) or run
    again (retries), the ones it had not started go elsewhere; a replacement starts (`spawned`).
    A timeout: HostLoop.expire reads the status pages of the workers holding the input's jobs; the core
    ends the input and retires the workers running its nodes (Retire → pool.end → lost), naming them.
    close(): every flow in flight gets SomaError; STOP to every worker; the listener closes the results
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
