"""shm: soma.Local where /dev/shm is small (a container's 64 MiB), against itself with ample room, DataLoader and ProcessPoolExecutor.

    python benchmarks/shm.py [--quick] [--smoke] [--json out.json]   (or: soma bench shm)

Two child processes hold the warm pools (2 workers each): one in a private mount
namespace whose /dev/shm is a 64 MiB tmpfs (`unshare -m`; it needs root, as CI
has, and the benchmark says so and stops where it cannot be made), one with this
machine's /dev/shm. This process alternates the contenders round by round,
asking the child that holds each to run it once; the child times it, checks
every value, and answers. Contenders:

    local_64       soma.Local(workers=2), /dev/shm 64 MiB
    local_ample    soma.Local(workers=2), this machine's /dev/shm
    dataloader_64  torch.utils.data.DataLoader(num_workers=2, batch_size=None), 64 MiB
    procpool_64    ProcessPoolExecutor(2, spawn).map, 64 MiB
    ideal_64       images only: the pipeline in one process, image after image on one core (torch on one
                   thread, as each worker's), its time halved: what 2 cores give at all, the ceiling

* images: examples/image_pipeline.py (decode, augment, CNN; DataLoader: decode
  and augment in its workers, the CNN in the caller), every contender's logits
  checked against the Executor's. images/s. Goal: local_64 >= 0.8x local_ample,
  and ahead of dataloader_64 and procpool_64 (where those are not at the ceiling: local_64 / ideal_64 says
  how much room there is at all; on a quiet machine every contender is near it).
* big: a map of 20 MiB outputs (`filled((i, 20))`: a float64 array, every
  element i), each checked whole and dropped as it comes, as a consumer does.
  MiB/s. At 64 MiB three such outputs fill /dev/shm: soma's waits for room,
  takes back what its pools keep, and spills what cannot fit to a file on disk.
  A contender that fails (DataLoader's workers pass tensors through /dev/shm:
  when it is full a worker's tensor is lost, and the loader, given a timeout
  here, raises) is reported as failed, with its error, also when that happens
  in a later round only (soma failing in any round fails the benchmark).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

import _harness as h

NAME = "shm"
WORKERS = 2
SMALL_MIB = 64
BIG_MIB = 20
REPLY = "@@shm "  # leads the child's answers on its stdout (anything else there is someone's print)
# A DataLoader worker that cannot put a tensor in a full /dev/shm loses it (its queue's feeder thread prints the
# error) and the loader waits forever for it by default: with a timeout it raises instead.
DATALOADER_TIMEOUT_S = 20
HAVE_PILLOW = importlib.util.find_spec("PIL") is not None  # (the image pipeline makes and decodes JPEGs)
CONTENDERS = {"local_64": "small", "local_ample": "ample", "dataloader_64": "small", "procpool_64": "small",
              "ideal_64": "small"}
IMAGES_ONLY = {"ideal_64"}  # (the big map's ceiling is no pipeline's: it is not measured)


# -- the children: warm pools, one call at a time ------------------------------------------------------------

class Child:
    """What one child holds and runs: `run(case, contender)` → seconds (every value checked off the clock)."""

    def __init__(self, where: str, mode: str):
        import concurrent.futures as cf
        import multiprocessing as mp

        import soma

        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
        import image_pipeline

        self.ip = image_pipeline
        self.counts = {"images": {"full": 96, "quick": 48, "smoke": 4}[mode],
                       "big": {"full": 30, "quick": 16, "smoke": 4}[mode]}
        self.local = soma.Local(workers=WORKERS).start()
        if HAVE_PILLOW:
            self.items = image_pipeline.inputs(image_pipeline.make_jpegs(self.counts["images"]))
            self.graph = image_pipeline.graph()
            self.expected = list(soma.Executor().map(self.graph, self.items))
        self.big = [(i, BIG_MIB) for i in range(self.counts["big"])]
        self.loaders: dict = {}
        self.procpool = None
        if where == "small":
            import torch

            torch.set_num_threads(1)
            self.model = image_pipeline.build_model()
            self.procpool = cf.ProcessPoolExecutor(WORKERS, mp_context=mp.get_context("spawn"))

    def loader(self, case: str):
        if case not in self.loaders:
            from _work import FilledSet

            if case == "images":
                self.loaders[case] = self.ip.data_loader(self.items, WORKERS, persistent_workers=True)
            else:
                import torch.utils.data

                self.loaders[case] = torch.utils.data.DataLoader(
                    FilledSet(self.counts["big"], BIG_MIB), batch_size=None, num_workers=WORKERS,
                    persistent_workers=True, timeout=DATALOADER_TIMEOUT_S)
        return self.loaders[case]

    def run(self, case: str, contender: str) -> float:
        import numpy
        from _work import Filled, filled

        from soma import Graph

        kind = contender.split("_")[0]
        start = time.perf_counter()
        if case == "images":
            if kind == "local":
                out = list(self.local.map(self.graph, self.items))
            elif kind == "dataloader":
                out = [self.ip.classify(self.model, chw) for chw in self.loader(case)]
            elif kind == "ideal":  # the pipeline in this process, one image after another, on one core:
                out = [self.ip.process(item) for item in self.items]  # halved below, the 2 cores' ceiling
            else:
                out = list(self.procpool.map(self.ip.process, self.items))
            seconds = time.perf_counter() - start
            if kind == "ideal":
                seconds /= WORKERS
            if not self.ip.same_logits(out, self.expected):
                raise h.WrongValue(f"{contender} returned logits that differ from the Executor's (images)")
            return seconds
        if kind == "local":
            outputs = self.local.map(Graph.somatize(Filled()), self.big)
        elif kind == "dataloader":
            outputs = (numpy.asarray(t) for t in self.loader(case))
        else:
            outputs = self.procpool.map(filled, self.big)
        count = 0
        for i, a in enumerate(outputs):  # each checked whole, then dropped (checks on the clock: the same for all)
            if a.nbytes != BIG_MIB << 20 or not (a == i).all():
                raise h.WrongValue(f"{contender} returned a wrong array for input {i} (big)")
            count += 1
            del a
        seconds = time.perf_counter() - start
        if count != len(self.big):
            raise h.WrongValue(f"{contender} returned {count} arrays, expected {len(self.big)} (big)")
        return seconds

    def close(self) -> None:
        self.loaders.clear()
        self.local.close()
        if self.procpool is not None:
            self.procpool.shutdown(wait=True)


def child_main(where: str, mode: str) -> None:
    child = Child(where, mode)
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("stop"):
            break
        try:
            answer = {"seconds": child.run(ask["case"], ask["contender"])}
        except h.WrongValue as wrong:
            answer = {"wrong": str(wrong)}
        except Exception as err:  # a contender that fails (DataLoader out of /dev/shm): reported, not fatal
            child.loaders.pop(ask["case"], None)  # (its workers are gone: a fresh one if it is asked again)
            answer = {"error": f"{type(err).__name__}: {err}".splitlines()[0][:300],
                      "traceback": traceback.format_exc()[-2000:]}
        print(REPLY + json.dumps(answer), flush=True)
    child.close()


# -- this process: the children, alternated ---------------------------------------------------------------

def why_no_small_shm() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is missing"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"exit {probe.returncode}")


class Remote:
    """A child process holding pools, asked to run one contender at a time."""

    def __init__(self, where: str, mode: str):
        argv = [sys.executable, os.path.abspath(__file__), "--child", where, mode]
        if where == "small":
            quoted = " ".join(f"'{a}'" for a in argv)
            argv = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size={SMALL_MIB}m tmpfs /dev/shm && exec {quoted}"]
        self.where = where
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.answer()  # ready

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"the {self.where} child ended (exit {self.proc.wait()}): see its stderr above")

    def ask(self, case: str, contender: str) -> dict:
        self.proc.stdin.write(json.dumps({"case": case, "contender": contender}) + "\n")
        self.proc.stdin.flush()
        got = self.answer()
        if "wrong" in got:
            raise h.WrongValue(got["wrong"])
        return got

    def close(self) -> None:
        try:
            self.proc.stdin.write(json.dumps({"stop": True}) + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=120)


def measure(suite: h.Suite, children: dict, case: str, unit: str, per_call: float, failed: dict) -> None:
    contenders = {}
    for name, where in CONTENDERS.items():
        if name in IMAGES_ONLY and case != "images":
            continue
        got = children[where].ask(case, name)  # a warm-up round, which also finds who cannot run it at all
        if "error" in got:
            failed[(case, name)] = got["error"]
            print(f"  {case}: {name} failed: {got['error']}", flush=True)
            continue
        contenders[name] = lambda name=name, where=where: _seconds(children[where], name, case, failed)
    samples = h.alternate(contenders, repeat=suite.repeat(full=5, quick=3), warmup=0, self_timed=True)
    for name in [name for name in samples if (case, name) in failed]:
        del samples[name]  # (a peer that failed in a later round is reported as failed, as one that failed at once)
    params = {"case": case, "workers": WORKERS, "shm_mib": SMALL_MIB}
    for name, seconds in samples.items():
        suite.add(name, params, [per_call / s for s in seconds], unit)
    for name in samples:
        if name != "local_64":
            suite.add_ratio("local_64", params, samples[name], samples["local_64"], vs=name)


def _seconds(child, name: str, case: str, failed: dict) -> float | None:
    """One round of `name`: its seconds. soma failing in a later round fails the benchmark; a peer failing then
    (the DataLoader's workers lose a tensor to a full /dev/shm in some rounds and not others: CI, Dec 5) is
    reported as failed, as one that failed in its first round, and not run again (None for its rounds)."""
    if (case, name) in failed:
        return None
    got = child.ask(case, name)
    if "error" not in got:
        return got["seconds"]
    if name.startswith("local"):
        raise RuntimeError(f"{name} failed in a later round ({case}): {got['error']}\n{got.get('traceback', '')}")
    failed[(case, name)] = f"{got['error']} (in a later round: its first ones ran)"
    print(f"  {case}: {name} failed in a later round: {got['error']}", flush=True)
    return None


def main(argv) -> None:
    if argv[:1] == ["--child"]:
        return child_main(argv[1], argv[2])
    suite = h.Suite(NAME, h.parse_args(argv, __doc__))
    why = why_no_small_shm()
    if why is not None:
        print(f"shm skipped: a 64 MiB /dev/shm needs a private mount namespace (unshare -m, root): {why}")
        return
    children = {}
    failed: dict = {}
    try:
        for where in ("small", "ample"):
            children[where] = Remote(where, suite.mode)
        counts = {"full": (96, 30), "quick": (48, 16), "smoke": (4, 4)}[suite.mode]
        if HAVE_PILLOW:
            measure(suite, children, "images", "images/s", counts[0], failed)
            print("  images done", flush=True)
        else:
            print("images skipped: Pillow is not installed (pip install pillow: an extra of the benchmarks)")
        measure(suite, children, "big", "MiB/s", counts[1] * BIG_MIB, failed)
        print("  big done", flush=True)
    finally:
        for child in children.values():
            child.close()

    def summary():
        for (case, name), error in failed.items():
            print(f"{case}: {name} at {SMALL_MIB} MiB failed: {error}")

    suite.finish(summary)


if __name__ == "__main__":
    h.cli(main)
