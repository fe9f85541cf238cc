"""`soma-worker` / `python -m soma.local.worker` (soma.Local starts it as host/procs.py's BOOTSTRAP): parse what the
host passed, then serve."""

from __future__ import annotations

import argparse
import os
import sys

DESCRIPTION = """\
A worker process of a soma.Local pool. You do not start this yourself: soma.Local
starts one per worker with the host's interpreter and its flags (-O, -W, -X ...),
as `python -c "<adopt SOMA_SYS_PATH>; soma.local.worker.main.main()" ...` (the same
program as `python -m soma.local.worker` and the `soma-worker` console script, with
nothing imported from the working directory before the host's sys.path is set),
never forked from the host. The host passes:

  * its sys.path in SOMA_SYS_PATH (a JSON list) and its working directory as ours,
    so nodes defined in the user's modules, scripts and notebooks load here; the
    sys.path again, with node code, when it changed since (Task.sys_path);
  * the pool's secret (hex) in SOMA_SECRET: every message either way carries a
    keyed MAC, and messages that fail it are dropped unread;
  * the endpoints of its sockets (ipc:// in a private 0700 directory), this
    worker's id, the device it pins (cuda:N becomes the current CUDA device, no
    CUDA_VISIBLE_DEVICES renumbering; cpu never touches CUDA), and the
    shared-memory arena size;
  * its threads: the intra-op threads torch and BLAS may use here
    (soma.Local(threads=N); by default cores // workers, at least 1, so a full
    pool does not oversubscribe the machine), set as OMP_NUM_THREADS,
    MKL_NUM_THREADS and torch.set_num_threads.

The worker exits when the host says STOP, and by itself within a second when
the host process is gone.
"""


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="soma-worker", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tasks", required=True, help="endpoint of the host's ROUTER (tasks come from it)")
    parser.add_argument("--results", required=True, help="endpoint of the host's PULL (results go to it)")
    parser.add_argument("--id", required=True, help="this worker's id, e.g. w0 (ctx.worker)")
    parser.add_argument("--device", default="cpu", help="the device this worker is pinned to: cpu or cuda:N")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and BLAS intra-op threads: soma.Local(threads=N), by default cores // workers")
    parser.add_argument("--status", required=True, help="file of the page where this worker shows what it runs")
    parser.add_argument("--host-pid", type=int, required=True, help="the host's pid: exit when it is gone")
    parser.add_argument("--prefix", required=True, help="the pool's shared-memory segment prefix")
    parser.add_argument("--arena", type=int, default=256 << 20, help="bytes of free segments kept for reuse")
    parser.add_argument("--max-memory", type=int, default=0,
                        help="soma.Local(max_memory=...): after a job, a worker whose own memory (resident, less "
                             "libraries and shared memory) is above this many bytes runs nothing more and exits, "
                             "so the host replaces it; 0: no cap")
    parser.add_argument("--preload-torch", action="store_true",
                        help="import torch right after saying hello, in the background (the host uses it)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ...wire.protocol import (  # (after --help: that needs none of the protocol's imports)
        SECRET_ENV,
        SYS_PATH_ENV,
    )

    secret_hex = os.environ.pop(SECRET_ENV, "")
    if not secret_hex:
        print(f"soma-worker: {SECRET_ENV} is not set; soma.Local starts workers, see --help", file=sys.stderr)
        return 2
    host_path = os.environ.pop(SYS_PATH_ENV, None)  # (still there when started as `soma-worker`, not by spawn)
    if host_path:
        import json

        sys.path[:] = json.loads(host_path)
    from .worker import Worker

    worker = Worker(args, bytes.fromhex(secret_hex))
    return worker.serve()
