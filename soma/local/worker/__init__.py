"""The `soma-worker` program: one process of a `soma.Local` pool.

How messages flow through a worker (the host is drawn in `soma.local`):

    host ROUTER ──Task/Free/Cancel/GiveBack/Stop──▶ DEALER
                                             │ one serving thread receives (soma.wire.protocol.parse);
                                             │ after answering it looks for the next Task before it
                                             │ blocks while Tasks come quickly (the spin: transport.py)
                                             ▼
                     accept(Task) (worker.py): register the node code and piece specs it carries
                                   (library.py: code unpickled on first use, a piece's Interpreter built
                                   once); append each JobSpec (one input), Bundle (inputs of a batching
                                   node alone, encoded as one list) or Chunk (consecutive inputs of another
                                   piece, one list: chunks.py) to its piece's Lane (lanes.py: a lane keeps
                                   arrival order)
                                             │ the receiving thread runs the first runnable lane
                                             │ itself (no hand-off for a short job); other runnable
                                             │ lanes go to other serving threads at once; a follower
                                             ▼ takes over receiving if a job runs longer than 2 ms
                     run_lane (worker.py): each turn in order (lanes.take_turn: one job, or a batching
                                   node's queued jobs and Bundles up to max_batch inputs) ─▶ the core,
                                   running.JobRunner: a lone job (outcome_of) of a GIL-bound piece waits its
                                   turn (turns.py); run_job, or run_turn → batches.run_batch (one forward_batch):
                                   decode the input (values.py → soma.wire.codec: map shared segments by name)
                                   Interpreter.run(plan) (soma.run.interpreter: setup once per copy, forward,
                                                     Done, postcondition; one input per node at once; a
                                                     one-node piece's untraced input: Interpreter.each)
                                   encode the output (tensors become segment handles; one number: no Encoder)
                                   a Chunk is a turn of its own: its inputs one by one, answered in
                                   ChunkParts (what is done goes when it has waited 40 ms behind a long
                                   input, and at once on a Cancel or GiveBack naming the chunk)
                     outbox.py: Result[outcomes, releases]; outcomes of short jobs travel together
                                   (Grouped: and what is done goes before a turn that may be long: a batch)
    host PULL ◀──Hello/Result── PUSH (one lock: any thread may send)

    status page: which job and node each thread runs, for the host to read if we die.
    watchdog thread: every 0.5 s, if the host (our parent) is gone, unlink the pool's
    segments, remove its socket directory, and exit.
    segments.py: this worker's shared-memory store; free segments beyond a few are given
    back after it has been idle a while.

The host starts it with its own interpreter and flags as `python -c BOOTSTRAP`
(host/procs.py: the host's `sys.path` set before anything is imported, then
`main`: the same program as `python -m soma.local.worker` and the `soma-worker`
console script), in its working directory, with the pool's secret in the
environment; `--help` lists the arguments.
"""

from .main import main

__all__ = ["main"]
