"""gpu: on a CUDA machine, a CUDA tensor back from a pinned worker against torch.multiprocessing, and a model map.

    python benchmarks/gpu.py [--json out.json] [--quick]       (benchmarks/gpu.sh runs it, with pytest -m gpu)

Without a CUDA device it says so and exits 0 (every figure needs one). Figures, each
checked value by value, medians of alternating rounds:

* the machine: nvidia-smi's view, torch's CUDA version, the device's name and memory;
* a 256 MiB float32 CUDA tensor made in a `cuda:0`-pinned worker and returned to the host
  (CUDA IPC), against torch.multiprocessing with the same tensor through a Queue from a
  spawned process; each round checks the received values;
* 4,096 per-item inputs through a small model (an MLP, random weights) on `cuda:0`:
  `Local(workers=4, devices=["cuda:0"])` with a per-item node and with a batching node
  (`forward_batch`, max_batch 64), against the in-process Executor (batching node) and
  `DataLoader(num_workers=4)` feeding the model in the host, in batches of 64; items/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import soma  # noqa: E402
from soma import Done, Graph, Node  # noqa: E402

MIB256 = (256 << 20) // 4


class MakeOnDevice(Node):
    """A 256 MiB float32 tensor on this node's device, filled with its input (made and returned)."""

    def forward(self, x, ctx):
        import torch

        return Done(torch.full((MIB256,), float(x), device=ctx.device))


class PerItem(Node):
    """The model on one input at a time."""

    def setup(self, ctx):
        self.model = make_model(ctx.device)

    def forward(self, x, ctx):
        import torch

        with torch.no_grad():
            return Done(self.model(x.to(ctx.device).unsqueeze(0))[0].cpu())


class Batched(Node):
    """The same model on the inputs at it at once."""

    max_batch = 64

    def setup(self, ctx):
        self.model = make_model(ctx.device)

    def forward_batch(self, xs, ctx):
        import torch

        with torch.no_grad():
            return Done(list(self.model(torch.stack(xs).to(ctx.device)).cpu()))


def make_model(device):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 16)).to(device).eval()


def _producer(queue, values):
    import torch

    for v in values:
        queue.put(torch.full((MIB256,), float(v), device="cuda:0"))
    queue.get()  # (the consumer's "done": the producer must outlive its CUDA IPC handles)


def facts() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": torch.cuda.device_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(name=p.name, memory_gib=round(p.total_memory / (1 << 30), 1), capability=f"{p.major}.{p.minor}")
    try:
        out["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                            "--format=csv,noheader"], capture_output=True, text=True,
                                           timeout=20).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        out["nvidia_smi"] = f"not run: {err}"
    return out


def cuda_round_trip(rounds: int) -> dict:
    """Seconds to receive a 256 MiB CUDA tensor made in another process: soma.Local vs torch.multiprocessing."""
    import torch
    import torch.multiprocessing as mp

    soma_s, tmp_s = [], []
    with soma.Local(workers=1, devices=["cuda:0"]) as pool:
        g = Graph.somatize(MakeOnDevice().on("cuda:0"))
        pool.run(g, -1)  # warm: code loaded, CUDA context made
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_producer, args=(queue, list(range(rounds + 1))))
        proc.start()
        queue.get()  # its warm-up tensor (CUDA context made there too)
        for r in range(rounds):
            start = time.perf_counter()
            t = pool.run(g, r)
            torch.cuda.synchronize()
            soma_s.append(time.perf_counter() - start)
            assert t.device.type == "cuda" and float(t[0]) == r and float(t[-1]) == r, "soma: wrong values"
            start = time.perf_counter()
            u = queue.get()
            torch.cuda.synchronize()
            tmp_s.append(time.perf_counter() - start)
            assert float(u[0]) == r + 1 and float(u[-1]) == r + 1, "torch.multiprocessing: wrong values"
            del t, u
        queue.put("done")
        proc.join(30)
    return {"soma_ms": 1e3 * statistics.median(soma_s), "torch_mp_ms": 1e3 * statistics.median(tmp_s),
            "ratio": statistics.median(soma_s) / statistics.median(tmp_s), "rounds": rounds}


def model_map(n: int) -> dict:
    import torch

    xs = [torch.randn(256, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    with torch.no_grad():
        expected = make_model("cpu")(torch.stack(xs))
    out = {}

    def check(name, got):
        got = torch.stack([t.cpu() for t in got])
        assert torch.allclose(got, expected, atol=1e-3), f"{name}: wrong outputs"

    with soma.Local(workers=4, devices=["cuda:0"]) as pool:
        for name, node in (("local_per_item", PerItem()), ("local_batched", Batched())):
            g = Graph.somatize(node.on("cuda:0"))
            list(pool.map(g, xs[:256]))  # warm: setup on every worker
            start = time.perf_counter()
            got = list(pool.map(g, xs))
            out[name] = n / (time.perf_counter() - start)
            check(name, got)
    with soma.Executor() as ex:
        g = Graph.somatize(Batched().on("cuda:0"))
        list(ex.map(g, xs[:256]))
        start = time.perf_counter()
        got = list(ex.map(g, xs))
        out["executor_batched"] = n / (time.perf_counter() - start)
        check("executor_batched", got)
    loader = torch.utils.data.DataLoader(xs, batch_size=64, num_workers=4)
    model = make_model("cuda:0")
    got = []
    start = time.perf_counter()
    with torch.no_grad():
        for batch in loader:
            got.extend(model(batch.to("cuda:0")).cpu())
    out["dataloader"] = n / (time.perf_counter() - start)
    check("dataloader", got)
    out["batched_over_per_item"] = out["local_batched"] / out["local_per_item"]
    out["local_batched_over_dataloader"] = out["local_batched"] / out["dataloader"]
    return {"items_per_s": out, "inputs": n}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="FILE", nargs="?", const="-",
                        help="write the figures to FILE (no FILE: to stdout, the rest to stderr)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and inputs")
    parser.add_argument("--smoke", action="store_true", help="(the same as --quick here)")
    args = parser.parse_args(argv)
    out = sys.stdout
    if args.json == "-":  # (for machines: stdout is the JSON alone)
        sys.stdout = sys.stderr
    try:
        import torch
    except ImportError:
        print("gpu: skipped: torch is not installed here")
        return 0
    if not torch.cuda.is_available():
        print("gpu: skipped: this machine has no CUDA device (torch.cuda.is_available() is False); every figure "
              "of this benchmark needs one")
        if args.json:
            _write(args.json, [{"benchmark": "gpu", "skipped": "no CUDA device"}], out)
        return 0
    quick = args.quick or args.smoke
    record = {"benchmark": "gpu", "machine": facts()}
    print("machine:", json.dumps(record["machine"]))
    record["cuda_256mib_back"] = cuda_round_trip(3 if quick else 7)
    print("256 MiB CUDA tensor back from a worker:", json.dumps(record["cuda_256mib_back"]))
    record["model_map"] = model_map(1024 if quick else 4096)
    print("model map:", json.dumps(record["model_map"]))
    if args.json:
        _write(args.json, [record], out)
    return 0


def _write(path: str, records: list, stdout) -> None:
    if path == "-":
        json.dump(records, stdout, indent=1)
        stdout.write("\n")
        return
    with open(path, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
