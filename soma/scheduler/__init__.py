"""The host side of `soma.Local`: starts workers, dispatches plans, gathers results.

How one `run(g, x)` flows (worker side in `soma.worker`):

    caller thread(s)                        host                                   workers
    ────────────────                        ────                                   ───────
    run(g, x) ─▶ program for (g, placement)   (dispatch.py: compiled once, cached;
                 PlacementError here, before    Remote = a piece run whole on one worker,
                 anything is sent               Spread = a wave, Chain = in order)
              ─▶ encode x once (wire.Encoder: msgpack; tensors → shared segments, handles only)
              ─▶ TASK per worker  ──── ROUTER (ipc://, 0700 dir, MAC'd) ─────▶ DEALER ─▶ run pieces
                 (branches for one worker in one message; node code only the first time)
              ─▶ wait: one waiting thread at a time leads and receives for all (leader/follower),
                 the others sleep on a condition until their task is done
                                             PULL ◀──── RESULT / HELLO ──── PUSH
                 leader: authenticate, decode outputs (map segments), settle the lease book,
                         look at worker processes every 50 ms: a dead one → WorkerDied for what
                         it held, its segments settled, a replacement started
              ◀─ postcondition checked on what arrived; the output, or the first failure in
                 branch order

    a timeout: the host reads what the late workers were running from their status pages,
    kills and replaces them, and raises RunTimeout naming those nodes.
    close(): STOP to every worker, wait, kill stragglers, unlink the pool's segments,
    remove the socket directory. atexit closes pools left open.
"""

from .local import Local

__all__ = ["Local"]
