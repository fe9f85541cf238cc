"""A job that tests/run/test_resume.py SIGKILLs and starts again: a map over `count` inputs that survives its
own process.

    python -m tests.run.resume_job RUNNER ORDERED MODE COUNT FOLDER [RAY_ADDRESS]

RUNNER    executor | local | ray (RAY_ADDRESS: the test session's running Ray, joined as a new driver)
ORDERED   1 | 0
MODE      checkpoint   `checkpoint=FOLDER/map.ckpt`: each output the loop consumes is appended to
                       FOLDER/outputs.txt (one line, one write); at least once across kills
          exactly      every SHARD outputs, one file FOLDER/shard-NNNNN.json written atomically with those
                       outputs and `state_dict()` after them; a start resumes from the last shard: exactly once
FOLDER/pids.txt gets the host's pid and its workers' (Local) once the runner has started.
"""

from __future__ import annotations

import json
import os
import sys

import soma
from soma import Graph
from tests.nodes import Sleep

SHARD = 40
WORK_S = 0.002  # each input's time in the node: the map runs long enough to be killed at random points


def main(argv) -> int:
    runner_name, ordered, mode, count, folder = argv[:5]
    ordered, count = ordered == "1", int(count)
    runner = open_runner(runner_name, argv[5] if len(argv) > 5 else None)
    with runner:
        with open(os.path.join(folder, "pids.txt"), "w") as f:
            pids = runner.pids() if runner_name == "local" else []
            f.write(" ".join(map(str, [os.getpid(), *pids])) + "\n")
        g = Graph.somatize(Sleep(WORK_S))
        if mode == "checkpoint":
            with_checkpoint(runner, g, ordered, count, folder)
        else:
            exactly_once(runner, g, ordered, count, folder)
    return 0


def open_runner(name: str, address):
    if name == "executor":
        return soma.Executor()
    if name == "local":
        return soma.Local(workers=2).start()
    return soma.Ray(address, log_to_driver=False).start()


def with_checkpoint(runner, g, ordered: bool, count: int, folder: str) -> None:
    with open(os.path.join(folder, "outputs.txt"), "a") as out:
        for y in runner.map(g, range(count), ordered=ordered, checkpoint=os.path.join(folder, "map.ckpt"),
                            checkpoint_every=0.05):
            out.write(f"{y}\n")
            out.flush()  # (in the kernel's hands: a SIGKILL of this process does not lose it)


def exactly_once(runner, g, ordered: bool, count: int, folder: str) -> None:
    shards = sorted(name for name in os.listdir(folder) if name.startswith("shard-") and name.endswith(".json"))
    state, number = None, 0
    if shards:
        with open(os.path.join(folder, shards[-1])) as f:
            state = json.load(f)["state"]
        number = int(shards[-1][len("shard-"):-len(".json")]) + 1
    outputs = runner.map(g, range(count), ordered=ordered, resume=state)
    batch = []
    for y in outputs:
        batch.append(y)
        if len(batch) == SHARD:
            write_atomically(os.path.join(folder, f"shard-{number:05}.json"), batch, outputs.state_dict())
            batch, number = [], number + 1
    if batch:
        write_atomically(os.path.join(folder, f"shard-{number:05}.json"), batch, outputs.state_dict())


def write_atomically(path: str, outputs: list, state: dict) -> None:
    """What the loop produced and the map's state after it, in one file that is either whole or absent."""
    temporary = path + ".tmp"
    with open(temporary, "w") as f:
        json.dump({"outputs": outputs, "state": state}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
