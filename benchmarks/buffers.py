"""buffers: what moving numpy arrays, bytes and plain data between processes costs (issue 18).

    python benchmarks/buffers.py [--quick] [--smoke] [--json out.json]   (or: soma bench buffers)

Warm pools of 2 workers, contenders alternated round by round in this one process:

    local/numpy    soma.Local: the node makes an ndarray on its heap (numpy.empty + fill) and returns it
    local/ctx      the same born through ctx.empty_array (the worker's arena)
    local/tensor   the same image as a uint8 torch tensor (torch.full)
    procpool       ProcessPoolExecutor(2, spawn) running the same function

Questions (each value made in the producing process with a fill no other call used;
"beyond creation" is the caller's wall time minus the producer's own time to make it,
measured inside that very call):

* image: a 1080x1920x3 uint8 image (6 MB) returned. Target: local/numpy <= 1.5x local/tensor.
* array: a 256 MiB float32 array returned. Target: local <= 0.5x procpool, beyond creation.
* bytes: 1 GiB of `bytes` returned. Target: local <= 0.5x procpool, and peak memory no higher.
* dict: a dict of a million small items (`{"k<i>": i}`), returned, and sent in (the node returns its
  length and the sum of its values). Target: local <= 1.0x procpool both ways, peak memory no higher.

Peak memory is the machine's (MemTotal - MemAvailable, sampled every 5 ms during the
call, over what it was just before): shared memory counts once, wherever it is mapped.
Every answer is checked off the clock: every element of an array, every byte (a count),
every value of a dict; the caller holds its last results (`_harness.Held`) and checks
them again when it lets go.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import threading
import time

import _harness as h
from _work import (
    IMAGE,
    MakeTimedBy,
    SizeOf,
    import_torch,
    make_array_timed,
    make_bytes_timed,
    make_dict_timed,
    make_image_tensor_timed,
    size_of,
)

import soma
from soma import Graph

NAME = "buffers"
WORKERS = 2


def available_kib() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """The machine's peak memory use during a block, over what it was at its start (MiB)."""

    def __enter__(self):
        self.base = self.low = available_kib()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.low = min(self.low, available_kib())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.low = min(self.low, available_kib())
        self.mib = (self.base - self.low) / 1024


def timed_call(call, fill):
    """`(wall seconds, value, producer's seconds, peak MiB)` of one call returning `(value, made seconds)`."""
    with PeakMemory() as peak:
        start = time.perf_counter()
        value, made = call(fill)
        wall = time.perf_counter() - start
    return wall, value, made, peak.mib


def check_array(name, a, fill, shape, what):
    import numpy

    if type(a).__name__ not in ("ndarray", "Tensor") or tuple(a.shape) != tuple(shape):
        raise h.WrongValue(f"{name} returned {type(a).__name__} of shape {tuple(getattr(a, 'shape', ()))} ({what})")
    a = a.numpy() if type(a).__name__ == "Tensor" else a
    lo, hi = numpy.min(a), numpy.max(a)
    if lo != fill or hi != fill:
        raise h.WrongValue(f"{name} returned values from {lo} to {hi}, expected {fill} everywhere ({what})")


def check_bytes(name, b, fill, nbytes, what):
    if type(b) is not bytes or len(b) != nbytes or b.count(bytes([fill])) != nbytes:
        raise h.WrongValue(f"{name} returned {type(b).__name__} of {len(b)} bytes, not {nbytes} bytes of {fill} "
                           f"({what})")


def check_dict(name, d, tag, count, what):
    if type(d) is not dict or len(d) != count or d.get("k0") != tag or sum(d.values()) != count * (count - 1) // 2 + tag * count:
        raise h.WrongValue(f"{name} returned a wrong dict of {len(d)} items ({what})")


class Contenders:
    def __init__(self, workers: int):
        self.procpool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
        warm = [self.procpool.submit(import_torch, 0.5) for _ in range(workers)]
        self.local = soma.Local(workers=workers).start()
        cf.wait(warm)

    def close(self):
        self.procpool.shutdown(wait=False)
        self.local.close()
        self.procpool.shutdown(wait=True)


def returned(suite, c, question: str, contenders: dict, check, repeat: int, keep: int = 3, ratios=()) -> dict:
    """Alternate `contenders` (name → call(fill) returning (value, made seconds)); every value checked and held;
    `ratios`: (name, against) pairs, beyond creation, per round."""
    held = h.Held(keep)

    def one(name, call):
        def go():
            fill = int(h.next_fill()) % 200 + 1
            wall, value, made, peak = timed_call(call, fill)
            check(name, value, fill, "just received")
            held.add(name, lambda: check(name, value, fill, "held across later ones"))
            return wall, made, peak
        return go

    samples = h.alternate({name: one(name, call) for name, call in contenders.items()}, repeat=repeat,
                          self_timed=True)
    held.check_all()
    for name, values in samples.items():
        params = {"question": question}
        suite.add(name, {**params, "what": "wall"}, h.ms(w for w, _, _ in values), "ms")
        suite.add(name, {**params, "what": "beyond_creation"}, h.ms(w - m for w, m, _ in values), "ms")
        suite.add(name, {**params, "what": "peak_memory"}, [p for _, _, p in values], "MiB")
    beyond = {name: [w - m for w, m, _ in values] for name, values in samples.items()}
    for name, vs in ratios:
        suite.add_ratio(name, {"question": question, "what": "beyond_creation"}, beyond[name], beyond[vs], vs=vs)
    return beyond


def image(suite, c, repeat, shape=IMAGE):
    g_np = Graph.somatize(MakeTimedBy(make_array_timed, shape, "uint8"))
    g_ctx = Graph.somatize(MakeTimedBy(make_array_timed, shape, "uint8", through_ctx=True))
    g_t = Graph.somatize(MakeTimedBy(make_image_tensor_timed, shape))
    returned(suite, c, "image", {
        "local/numpy": lambda f: c.local.run(g_np, f),
        "local/ctx": lambda f: c.local.run(g_ctx, f),
        "local/tensor": lambda f: c.local.run(g_t, f),
        "procpool": lambda f: c.procpool.submit(make_array_timed, shape, "uint8", f).result(),
    }, lambda name, a, fill, what: check_array(name, a, fill, shape, what), repeat,
        ratios=[("local/numpy", "local/tensor"), ("local/numpy", "procpool")])


def array(suite, c, repeat, mib: int):
    shape = (mib * h.MiB // 4,)
    g = Graph.somatize(MakeTimedBy(make_array_timed, shape, "float32"))
    g_ctx = Graph.somatize(MakeTimedBy(make_array_timed, shape, "float32", through_ctx=True))
    returned(suite, c, "array", {
        "local/numpy": lambda f: c.local.run(g, f),
        "local/ctx": lambda f: c.local.run(g_ctx, f),
        "procpool": lambda f: c.procpool.submit(make_array_timed, shape, "float32", f).result(),
    }, lambda name, a, fill, what: check_array(name, a, float(fill), shape, what), repeat,
        ratios=[("local/numpy", "procpool"), ("local/ctx", "procpool")])


def against_procpool(suite, c, question: str, make, args: tuple, check, repeat: int) -> None:
    """`make(*args, fill)` in a Local worker (a node) and in a ProcessPoolExecutor child, returned; the last
    result of each held."""
    g = Graph.somatize(MakeTimedBy(make, *args))
    returned(suite, c, question, {"local": lambda f: c.local.run(g, f),
                                  "procpool": lambda f: c.procpool.submit(make, *args, f).result()},
             check, repeat, keep=1, ratios=[("local", "procpool")])


def raw_bytes(suite, c, repeat, nbytes: int):
    against_procpool(suite, c, "bytes", make_bytes_timed, (nbytes,),
                     lambda name, b, fill, what: check_bytes(name, b, fill, nbytes, what), repeat)


def dicts(suite, c, repeat, count: int):
    against_procpool(suite, c, "dict_back", make_dict_timed, (count,),
                     lambda name, d, tag, what: check_dict(name, d, tag, count, what), repeat)
    sizer = Graph.somatize(SizeOf())
    sent = {}

    def sending(name, call):
        def go():
            tag = int(h.next_fill())
            d, _ = make_dict_timed(count, tag)
            with PeakMemory() as peak:
                wall, answer = h.timed(call, d)
            h.expect(name, answer, size_of(d), "the length and sum of the dict sent")
            return wall, peak.mib
        return go

    samples = h.alternate({"local": sending("local", lambda d: c.local.run(sizer, d)),
                           "procpool": sending("procpool", lambda d: c.procpool.submit(size_of, d).result())},
                          repeat=repeat, self_timed=True)
    for name, values in samples.items():
        suite.add(name, {"question": "dict_in", "what": "wall"}, h.ms(w for w, _ in values), "ms")
        suite.add(name, {"question": "dict_in", "what": "peak_memory"}, [p for _, p in values], "MiB")
        sent[name] = [w for w, _ in values]
    suite.add_ratio("local", {"question": "dict_in", "what": "wall"}, sent["local"], sent["procpool"], vs="procpool")


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    import numpy  # noqa: F401
    import torch

    torch.set_num_threads(1)
    print(f"{NAME}: {h.versions()}, numpy {numpy.__version__}; mode {suite.mode}")
    c = Contenders(1 if args.smoke else WORKERS)
    repeat = suite.repeat(full=7, quick=3, smoke=1)
    try:
        image(suite, c, repeat, (108, 192, 3) if args.smoke else IMAGE)
        print("  image done", flush=True)
        array(suite, c, repeat, 8 if args.smoke else 256)
        print("  array done", flush=True)
        raw_bytes(suite, c, suite.repeat(full=3, quick=2, smoke=1), (8 if args.smoke else 1024) * h.MiB)
        print("  bytes done", flush=True)
        dicts(suite, c, suite.repeat(full=5, quick=3, smoke=1), 10_000 if args.smoke else 1_000_000)
        print("  dict done", flush=True)
    finally:
        c.close()
    return suite.finish(lambda: print_summary(suite))


TARGETS = {("image", "local/numpy", "local/tensor"): "≤ 1.5×", ("array", "local/numpy", "procpool"): "≤ 0.5×",
           ("bytes", "local", "procpool"): "≤ 0.5×", ("dict_back", "local", "procpool"): "≤ 1.0×",
           ("dict_in", "local", "procpool"): "≤ 1.0×"}


def print_summary(suite: h.Suite) -> None:
    rows = []
    for (question, name, vs), target in TARGETS.items():
        what = "wall" if question == "dict_in" else "beyond_creation"
        ratio = suite.find(name, "x", question=question, vs=vs)
        rows.append([question, name, h.cell(suite.find(name, "ms", question=question, what=what)), vs,
                     h.cell(suite.find(vs, "ms", question=question, what=what)),
                     f"{h.fmt(ratio.median)}× ({h.fmt(min(ratio.values))}-{h.fmt(max(ratio.values))})", target,
                     h.cell(suite.find(name, "MiB", question=question, what="peak_memory")),
                     h.cell(suite.find(vs, "MiB", question=question, what="peak_memory"))])
    h.print_table(f"{NAME}: median ms {'(beyond creation; dict_in: wall)'}, ratio per round (min-max), peak MiB of "
                  f"the machine", ["question", "contender", "ms", "against", "its ms", "ratio", "target",
                                   "peak MiB", "its peak MiB"], rows)
    others = [[q, n, h.cell(suite.find(n, "ms", question=q, what="beyond_creation")),
               h.cell(suite.find(n, "ms", question=q, what="wall"))]
              for q, n in (("image", "local/ctx"), ("image", "procpool"), ("array", "local/ctx"))]
    h.print_table(f"{NAME}: the other contenders, median ms", ["question", "contender", "beyond creation", "wall"],
                  others)


if __name__ == "__main__":
    h.cli(main)
