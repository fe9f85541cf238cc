"""A job that survives its own process: it writes shards, is killed, and finishes when run again.

    python examples/resumable_job.py OUT_DIR --die-after 3     # SIGKILLs itself after 3 shards
    python examples/resumable_job.py OUT_DIR                   # goes on from shard 3 and finishes

Each shard is one file holding 200 outputs *and* the map's `state_dict()` after
them, written atomically (a temporary file, fsync, rename). A start reads the
last shard's state and passes it as `resume=`: the map yields only what no shard
holds yet, so whatever kills the process (a preempted machine, the OOM killer,
Ctrl-C, here a SIGKILL it sends itself), every document ends up in exactly one
shard, in order. The last lines check that.

Without the shards' bookkeeping, `local.map(g, docs, checkpoint="job.ckpt")`
does the resuming alone: at least once (outputs the loop consumed after the
last write come again after a kill). docs/api.md, "Resuming".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import soma
from soma import Done, Graph, Node

DOCUMENTS = 2_000
SHARD = 200


class Featurize(Node):
    """A document's id, its number of words and a digest of its text (the work of a real job goes here)."""

    def forward(self, doc, ctx):
        text = doc["text"]
        return Done({"id": doc["id"], "words": len(text.split()), "digest": hashlib.sha1(text.encode()).hexdigest()})


def documents():
    """The job's input: a generator, as a reader of files or a database would be (`resume=` reads past what
    is done without running it; a list or range would be skipped by index)."""
    for i in range(DOCUMENTS):
        yield {"id": i, "text": " ".join(f"word{(i * 7 + k) % 101}" for k in range(i % 50 + 1))}


def last_shard(out_dir: str):
    """`(its number, its state)` of the newest shard, or `(-1, None)` when there is none yet."""
    shards = sorted(name for name in os.listdir(out_dir) if name.startswith("shard-") and name.endswith(".json"))
    if not shards:
        return -1, None
    with open(os.path.join(out_dir, shards[-1])) as f:
        return int(shards[-1][6:11]), json.load(f)["state"]


def write_shard(out_dir: str, number: int, outputs: list, state: dict) -> None:
    """The outputs and the state after them in one file, which is either whole or not there at all."""
    path = os.path.join(out_dir, f"shard-{number:05}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"outputs": outputs, "state": state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--die-after", type=int, metavar="N", help="SIGKILL this process after writing N shards")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)

    number, state = last_shard(args.out_dir)
    if state is not None:
        print(f"resuming after shard {number}: {state['next']} of {DOCUMENTS} documents done")
    g = Graph.somatize(Featurize())
    written = 0
    with soma.Local(workers=2) as local:
        outputs = local.map(g, documents(), resume=state)
        batch = []
        for features in outputs:
            batch.append(features)
            if len(batch) == SHARD:
                number += 1
                write_shard(args.out_dir, number, batch, outputs.state_dict())
                batch, written = [], written + 1
                print(f"shard {number} written")
                if written == args.die_after:
                    print("killed (SIGKILL): run it again to finish", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no finally: as the OOM killer would
        if batch:
            write_shard(args.out_dir, number + 1, batch, outputs.state_dict())

    ids = []
    for name in sorted(os.listdir(args.out_dir)):
        if name.startswith("shard-") and name.endswith(".json"):
            with open(os.path.join(args.out_dir, name)) as f:
                ids += [features["id"] for features in json.load(f)["outputs"]]
    if ids != list(range(DOCUMENTS)):
        print(f"the shards do not hold every document exactly once, in order ({len(ids)} outputs)", file=sys.stderr)
        return 1
    print(f"done: {DOCUMENTS} documents, each in exactly one shard, in order")
    return 0


if __name__ == "__main__":
    sys.exit(main())
