"""tensor: what moving a tensor between processes costs, next to what copying its bytes costs.

    python benchmarks/tensor.py [--quick] [--smoke] [--json out.json]   (or: soma bench tensor)

float32 tensors of 4 KiB, 1 MiB, 6 MB (a 1080x1920x3 image's bytes), 16 MiB and 256 MiB, on warm pools of 2 workers
(each call keeps one worker busy; 2 is the pool one would start on this machine).
Contenders, alternated round by round in this one process:

    local/heap    soma.Local: the node makes it with torch.empty + fill and returns it
    local/numpy   soma.Local: the same bytes as a numpy array (numpy.empty + fill), the tensor's twin:
                  a tensor must cross at least as fast as an array of its bytes (ratio `vs local/numpy`)
    local/ctx     soma.Local: the node makes it with ctx.empty + fill (the worker's arena)
    procpool      ProcessPoolExecutor(spawn); with torch imported, tensors travel through
                  torch's shared memory (torch registers its reductions with that pickler)
    torch_queue   a torch.multiprocessing process and its Queue: the shared-memory reference
    ray           Ray tasks (only with --ray, on a fresh local instance)
    host/heap     this process making the same tensor on its own heap (torch.empty + fill)
    memcpy        dst.copy_(src) of the same bytes, both buffers pre-faulted: the physical floor
    clone         src.clone(): a copy into fresh memory (allocation and page faults included)

Four questions:

* return: made in the producing process and received here. `beyond creation` is
  the caller's wall time minus the time the producer took to create and fill the
  tensor, measured inside that very call. GB/s = bytes / beyond creation.
* made: the same, end to end; set against host/heap (making it here).
* send: a fresh heap tensor of this process sent into a worker, which returns a
  small value (its last element); the time until that value is back.
* echo: a tensor already in shared memory (received from that contender's worker)
  sent to a node that returns it: should cost the same at 1 MiB and 256 MiB.

Every answer is checked, off the clock: each call fills its tensor with a value
no other call used, the caller checks every element it receives (and, for send,
that the tensor it sent is still intact), and keeps the last 3 results of each
contender (`_harness.Held`), checking them again when it lets go of them. A
result overwritten while held, or handed to the wrong caller, fails the run with
a message naming the contender.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp

import _harness as h
from _work import (
    Echo,
    Last,
    MakeTimed,
    MakeTimedBy,
    echo,
    import_torch,
    last,
    make_array_timed,
    make_tensor,
    make_timed,
    queue_server,
)

import soma
from soma import Graph

NAME = "tensor"
WORKERS = 2
SIZES = {"4KiB": 4 << 10, "1MiB": 1 << 20, "6MB": 1080 * 1920 * 3, "16MiB": 16 << 20, "256MiB": 256 << 20}
TRANSPORTS = ["local/heap", "local/numpy", "local/ctx", "procpool", "torch_queue", "ray"]
HOLD = 3  # results of each contender the caller keeps across repetitions, each checked again when let go of


class Contenders:
    """The pools every question uses, started and warmed once."""

    def __init__(self, workers: int, args):
        import torch

        self.torch = torch
        # Every pool starts at once (each child imports torch for a second or more), then each is
        # waited for: every child has torch before anything is timed.
        self.procpool = cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
        warm = [self.procpool.submit(import_torch, 0.5) for _ in range(workers)]
        tmp = torch.multiprocessing.get_context("spawn")
        self.commands, self.results = tmp.Queue(), tmp.Queue()
        self.queue_proc = tmp.Process(target=queue_server, args=(self.commands, self.results), daemon=True)
        self.queue_proc.start()
        self.local = soma.Local(workers=workers).start()  # workers import torch at the first tensor (the warm-up)
        h.expect_filled("torch_queue", self.ask_queue("make", (1024, 1.0))[0], 1.0, 1024, "warm-up")
        cf.wait(warm)
        self.ray = h.local_ray(args)
        if self.ray is not None:
            self.ray_make = self.ray.remote(make_timed)
            self.ray_last = self.ray.remote(last)

    def ask_queue(self, kind: str, arg):
        self.commands.put((kind, arg))
        return self.results.get()

    def close(self) -> None:
        self.commands.put(None)
        self.procpool.shutdown(wait=False)  # they stop side by side too
        self.local.close()
        self.procpool.shutdown(wait=True)
        self.queue_proc.join(10)
        if self.ray is not None:
            self.ray.shutdown()


# -- return and made --------------------------------------------------------------------------------

def returning(c: Contenders, numel: int, held: h.Held) -> dict:
    """Callables returning `(wall seconds, creation seconds in the producer)`; every tensor checked, off the clock."""
    torch = c.torch
    heap, arena = Graph.somatize(MakeTimed(numel)), Graph.somatize(MakeTimed(numel, through_ctx=True))
    array = Graph.somatize(MakeTimedBy(make_array_timed, (numel,), "float32"))
    src = torch.ones(numel)
    dst = torch.empty(numel).fill_(0.0)  # pre-faulted

    def received(name, call):
        fill = h.next_fill()
        wall, (t, created) = h.timed(call, fill)
        if not isinstance(t, torch.Tensor):
            t = torch.from_numpy(t)  # (an array, checked through a tensor over its very memory)
        held.filled(name, t, fill, numel, "just received")
        return wall, created

    def reference(name, call, fill=1.0):
        wall, t = h.timed(call)
        h.expect_filled(name, t, fill, numel)
        return wall, 0.0

    calls = {
        "local/heap": lambda: received("local/heap", lambda f: c.local.run(heap, f)),
        "local/numpy": lambda: received("local/numpy", lambda f: c.local.run(array, f)),
        "local/ctx": lambda: received("local/ctx", lambda f: c.local.run(arena, f)),
        "procpool": lambda: received("procpool", lambda f: c.procpool.submit(make_timed, numel, None, f).result()),
        "torch_queue": lambda: received("torch_queue", lambda f: c.ask_queue("make", (numel, f))),
        "host/heap": lambda: reference("host/heap", lambda: make_tensor(numel)),
        "memcpy": lambda: reference("memcpy", lambda: dst.copy_(src)),
        "clone": lambda: reference("clone", src.clone),
    }
    if c.ray is not None:
        calls["ray"] = lambda: received("ray", lambda f: c.ray.get(c.ray_make.remote(numel, None, f)))
    return calls


def measure_return(suite: h.Suite, c: Contenders, size: str, nbytes: int) -> None:
    held = h.Held(HOLD)
    samples = h.alternate(returning(c, nbytes // 4, held), repeat=suite.repeat(full=7, quick=3, smoke=1),
                          self_timed=True)
    held.check_all()
    walls = {name: [wall for wall, _ in values] for name, values in samples.items()}
    beyond = {name: [wall - made for wall, made in values] for name, values in samples.items()}
    params = {"size": size, "bytes": nbytes}
    for name, values in samples.items():
        if name in TRANSPORTS:
            p = {**params, "what": "return_beyond_creation"}
            suite.add(name, p, h.ms(beyond[name]), "ms")
            suite.add(name, p, [nbytes / 1e9 / max(b, 1e-9) for b in beyond[name]], "GB/s")
            suite.add_ratio(name, p, beyond[name], walls["memcpy"], vs="memcpy")
            suite.add(name, {**params, "what": "creation_in_producer"}, h.ms(made for _, made in values), "ms")
        suite.add(name, {**params, "what": "made_and_returned" if name in TRANSPORTS else "reference"},
                  h.ms(walls[name]), "ms")
    suite.add("memcpy", {**params, "what": "reference"}, [nbytes / 1e9 / w for w in walls["memcpy"]], "GB/s")
    for name in ("local/heap", "local/numpy"):
        suite.add_ratio(name, {**params, "what": "return_beyond_creation"}, beyond[name], beyond["procpool"],
                        vs="procpool")
    suite.add_ratio("local/heap", {**params, "what": "return_beyond_creation"}, beyond["local/heap"],
                    beyond["local/numpy"], vs="local/numpy")
    suite.add_ratio("local/ctx", {**params, "what": "made_and_returned"}, walls["local/ctx"], walls["host/heap"],
                    vs="host/heap")


# -- send -------------------------------------------------------------------------------------------

def sending(c: Contenders, numel: int, held: h.Held) -> dict:
    """Callables returning the seconds from sending a fresh heap tensor to having its small answer.

    The answer (the tensor's last element, as the worker read it) must be the
    tensor's fill; the tensor sent must be intact after the call, and stay so
    while the caller holds it.
    """
    g = Graph.somatize(Last())

    def sent(name, call):
        fill = h.next_fill()
        t = make_tensor(numel, fill=fill)  # fresh every time, made before the clock starts
        wall, answer = h.timed(call, t)
        h.expect(name, answer, fill, "the last element of the tensor sent, read by the worker")
        held.filled(name, t, fill, numel, "just received")
        return wall

    calls = {
        "local": lambda: sent("local", lambda t: c.local.run(g, t)),
        "procpool": lambda: sent("procpool", lambda t: c.procpool.submit(last, t).result()),
        "torch_queue": lambda: sent("torch_queue", lambda t: c.ask_queue("last", t)),
    }
    if c.ray is not None:
        calls["ray"] = lambda: sent("ray", lambda t: c.ray.get(c.ray_last.remote(t)))
    return calls


def measure_send(suite: h.Suite, c: Contenders, size: str, nbytes: int) -> None:
    held = h.Held(HOLD)
    samples = h.alternate(sending(c, nbytes // 4, held), repeat=suite.repeat(full=7, quick=3, smoke=1),
                          self_timed=True)
    held.check_all()
    params = {"size": size, "bytes": nbytes, "what": "send"}
    for name, values in samples.items():
        suite.add(name, params, h.ms(values), "ms")
        suite.add(name, params, [nbytes / 1e9 / v for v in values], "GB/s")
        if name != "procpool":
            suite.add_ratio(name, params, values, samples["procpool"], vs="procpool")


# -- echo ---------------------------------------------------------------------------------------------

def measure_echo(suite: h.Suite, c: Contenders, sizes: dict) -> None:
    """Every size and contender in one alternation, so the size ratios are paired round by round.

    Each echo is checked (every element, off the clock), and so is every tensor
    echoed, at the end: the caller held it the whole time.
    """
    g = Graph.somatize(Echo())
    calls, originals = {}, []

    def echoed(name, call, t, fill, numel):
        wall, back = h.timed(call, t)
        h.expect_filled(name, back, fill, numel, "echoed")
        return wall

    for size, nbytes in sizes.items():
        numel = nbytes // 4
        fills = {name: h.next_fill() for name in ("local", "procpool", "torch_queue")}
        received = {  # a tensor each contender's own worker made: it lives in that contender's shared memory
            "local": c.local.run(Graph.somatize(MakeTimed(numel, through_ctx=True)), fills["local"])[0],
            "procpool": c.procpool.submit(make_tensor, numel, None, fills["procpool"]).result(),
            "torch_queue": c.ask_queue("make", (numel, fills["torch_queue"]))[0],
        }
        for name, t in received.items():
            h.expect_filled(name, t, fills[name], numel, f"made for the {size} echo")
            originals.append((name, t, fills[name], numel))
        back = c.local.run(g, received["local"])
        if nbytes >= soma.wire.codec.INLINE_LIMIT:  # below it tensors travel inline, as copies
            assert back.untyped_storage().data_ptr() == received["local"].untyped_storage().data_ptr()
        del back
        calls[f"local/{size}"] = lambda t=received["local"], f=fills["local"], n=numel: echoed(
            "local", lambda x: c.local.run(g, x), t, f, n)
        calls[f"procpool/{size}"] = lambda t=received["procpool"], f=fills["procpool"], n=numel: echoed(
            "procpool", lambda x: c.procpool.submit(echo, x).result(), t, f, n)
        calls[f"torch_queue/{size}"] = lambda t=received["torch_queue"], f=fills["torch_queue"], n=numel: echoed(
            "torch_queue", lambda x: c.ask_queue("echo", x), t, f, n)
    samples = h.alternate(calls, repeat=suite.repeat(full=9, quick=5, smoke=1), self_timed=True)
    for name, t, fill, numel in originals:
        h.expect_filled(name, t, fill, numel, "held through every echo")
    smallest = "1MiB" if "1MiB" in sizes else next(iter(sizes))
    for name, values in samples.items():
        contender, _, size = name.partition("/")
        params = {"size": size, "bytes": sizes[size], "what": "echo_shared"}
        suite.add(contender, params, h.ms(values), "ms")
        if size != smallest:
            suite.add_ratio(contender, params, values, samples[f"{contender}/{smallest}"], vs=smallest)


def main(argv=None) -> list[dict]:
    args = h.parse_args(argv, __doc__)
    suite = h.Suite(NAME, args)
    import torch

    torch.set_num_threads(1)  # like each worker (1 core each of 2): copies compare like with like
    sizes = {k: v for k, v in SIZES.items() if not args.smoke or v <= 1 << 20}
    print(f"{NAME}: {h.versions()}; mode {suite.mode}; sizes {', '.join(sizes)}")
    c = Contenders(workers=1 if args.smoke else WORKERS, args=args)  # smoke: fewer children importing torch
    try:
        for size, nbytes in sizes.items():
            measure_return(suite, c, size, nbytes)
            measure_send(suite, c, size, nbytes)
            print(f"  {size} done", flush=True)
        measure_echo(suite, c, sizes)
    finally:
        c.close()
    return suite.finish(lambda: print_summary(suite, sizes))


def ratio_cell(record) -> str:
    """A per-round ratio: its median, and its range in brackets."""
    if record is None:
        return "—"
    return f"{h.fmt(record.median)}× ({h.fmt(min(record.values))}-{h.fmt(max(record.values))})"


def print_summary(suite: h.Suite, sizes: dict) -> None:
    transports = [t for t in TRANSPORTS if suite.find(t)]

    def find(name, unit, what, size, **more):
        return suite.find(name, unit, what=what, size=size, **more)

    rows = []
    for size in sizes:
        row = [size]
        for name in transports:
            beyond = find(name, "ms", "return_beyond_creation", size)
            memcpys = find(name, "x", "return_beyond_creation", size, vs="memcpy")
            gbs = find(name, "GB/s", "return_beyond_creation", size)
            row.append(f"{h.cell(beyond)} ({h.fmt(memcpys.median)} memcpy, {h.fmt(gbs.median)} GB/s)")
        row += [h.cell(find(n, "ms", "reference", size)) for n in ("memcpy", "clone")]
        rows.append(row)
    h.print_table(f"{NAME}: returned to the host, median ms beyond creation (in memcpys of the same bytes; GB/s)",
                  ["size"] + transports + ["memcpy", "clone"], rows)

    rows = []
    for size in sizes:
        row = [size, h.cell(find("local/heap", "ms", "return_beyond_creation", size)),
               h.cell(find("local/numpy", "ms", "return_beyond_creation", size))]
        row.append(ratio_cell(find("local/heap", "x", "return_beyond_creation", size, vs="local/numpy")))
        row += [ratio_cell(find(n, "x", "return_beyond_creation", size, vs="procpool"))
                for n in ("local/heap", "local/numpy")]
        rows.append(row)
    h.print_table(f"{NAME}: a heap-born tensor and its numpy twin (the same bytes) returned, median ms beyond creation; "
                  f"ratios per round (target: tensor / array <= 1)",
                  ["size", "tensor", "array", "tensor / array", "tensor / procpool", "array / procpool"], rows)

    rows = []
    for size in sizes:
        row = [size, h.cell(find("host/heap", "ms", "reference", size))]
        row.append(h.cell(find("local/ctx", "ms", "made_and_returned", size),
                          find("local/ctx", "x", "made_and_returned", size, vs="host/heap")))
        row += [h.cell(find(n, "ms", "made_and_returned", size)) for n in transports if n != "local/ctx"]
        rows.append(row)
    h.print_table(f"{NAME}: made and returned, median ms end to end (local/ctx: ratio to host/heap)",
                  ["size", "host/heap (made here)", "local/ctx"] + [n for n in transports if n != "local/ctx"], rows)

    senders = [n for n in ("local", "procpool", "torch_queue", "ray") if suite.find(n, what="send")]
    rows = [[size] + [h.cell(find(n, "ms", "send", size), find(n, "x", "send", size, vs="procpool"))
                      for n in senders] for size in sizes]
    h.print_table(f"{NAME}: a fresh heap tensor sent into a worker, median ms until its small answer is back "
                  f"(ratio to procpool)", ["size"] + senders, rows)

    echoers = [n for n in ("local", "procpool", "torch_queue") if suite.find(n, what="echo_shared")]
    rows = [[size] + [h.cell(find(n, "ms", "echo_shared", size), suite.find(n, "x", what="echo_shared", size=size))
                      for n in echoers] for size in sizes]
    h.print_table(f"{NAME}: echo of a tensor already in shared memory, median ms (ratio to the smallest echo)",
                  ["size"] + echoers, rows)


if __name__ == "__main__":
    h.cli(main)
