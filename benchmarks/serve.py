"""serve: soma behind FastAPI on uvicorn, against the same app in-process, on a process pool, and Ray Serve.

    python benchmarks/serve.py [--quick] [--smoke] [--json out.json] [--plot serve.png]   (or: soma bench serve)

Each contender is a real HTTP server on 127.0.0.1 in a process of its own (benchmarks/_serve_apps.py says
what each runs): `soma` (examples/serve.py's app, Local(workers=2)), `inprocess` (the same FastAPI app, the
work on the event loop's default thread pool), `process_pool` (the same app, ProcessPoolExecutor(2)) and
`ray_serve` (a deployment of 2 replicas on a local Ray of 2 CPUs, `@serve.batch` with soma's max_batch and
wait, through Serve's HTTP proxy; skipped, with the reason, without `ray[serve]`, in --smoke, or where no
loopback-only network namespace can be made: the benchmark re-runs itself in one, as soma_ray does). The same
model, weights and per-item stage everywhere (benchmarks/_serve_work.py), two workloads:

    tiny   hash ~30 words into 16 ids (microseconds of Python), a small MLP
    heavy  a per-item stage of about 1 ms of pure Python (a tokenizer's cost for a short text), the same MLP

The load is benchmarks/_serve_load.py, its own process: 1, 16 and 64 asyncio clients, one keep-alive
connection each, the same requests for every contender, every answer checked against the model run there
(a wrong one ends the run: FAILED naming the contender). The three uvicorn servers run side by side and take
turns, round by round (benchmarks/README.md: alternation); Ray Serve, whose idle processes would tax the
others, runs alone after them (one Ray for both workloads). Figures: requests/s, p50 and p99 latency (the median over rounds of each);
`--json` writes those at 64 clients as {"tiny": {"soma": {"rps", "p50_ms", "p99_ms"}, ...}, "heavy": ...}.
Goals at 64 clients (issue 35): heavy soma >= 1.5x inprocess and >= 1.0x process_pool with a p99 no worse;
tiny soma >= 1.0x inprocess; both >= 4x Ray Serve with at most a third of its p99.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import _harness as h

NAME = "serve"
HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("tiny", "heavy")
UVICORN_CONTENDERS = ("soma", "inprocess", "process_pool")
CONTENDERS = UVICORN_CONTENDERS + ("ray_serve",)
LEVELS = (1, 16, 64)
START_S = 240.0  # a server's start, at worst (Ray Serve beside other programs on two shared cores)


def requests_per_level(mode: str) -> dict:
    return {"full": {1: 300, 16: 1500, 64: 1500}, "quick": {1: 60, 16: 320, 64: 640},
            "smoke": {1: 4, 16: 32, 64: 64}}[mode]


class Server:
    """A contender's server process; `port` once it answers; `stop()` sends SIGTERM and waits (then kills)."""

    def __init__(self, contender: str, workload: str, folder: str):
        self.contender = contender
        self.ready = os.path.join(folder, f"{contender}-{workload}.port")
        self.log_path = os.path.join(folder, f"{contender}-{workload}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_serve_apps.py"), contender, workload,
                                      self.ready], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                     text=True)
        self.port = None

    def switch(self, workload: str) -> int:
        """ray_serve: the same server, the model redeployed for `workload` (benchmarks/_serve_apps.py)."""
        os.remove(self.ready)
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self.wait_ready()

    def wait_ready(self) -> int:
        deadline = time.monotonic() + START_S
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {self.contender} server did not start (exit {self.proc.poll()}):\n"
                                   f"{self.tail()}")
            time.sleep(0.05)
        with open(self.ready) as f:
            self.port = int(f.read())
        return self.port

    def tail(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def stop(self) -> None:
        self.terminate()
        self.wait_stopped()

    def terminate(self) -> None:
        """SIGTERM, not waited for: servers stopped together shut down at once, not one after another."""
        self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self) -> None:
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            print(f"{NAME}: the {self.contender} server ignored SIGTERM for 60 s: killed")
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class LoadGenerator:
    """benchmarks/_serve_load.py, one process for the whole run (it keeps the expected answers)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_serve_load.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def load(self, contender: str, port: int, workload: str, clients: int, requests: int, salt: int) -> dict:
        self.proc.stdin.write(json.dumps({"port": port, "workload": workload, "clients": clients,
                                          "requests": requests, "salt": salt}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the load generator exited")
        answer = json.loads(line)
        if "wrong" in answer:
            raise h.WrongValue(f"{contender} ({workload}, {clients} clients): {answer['wrong']}")
        return answer

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def why_no_ray_serve(args) -> str | None:
    """None when the ray_serve contender can run here, else the reason it is skipped."""
    if args.smoke:
        return "--smoke runs no Ray Serve (its start alone takes 15-60 s here)"
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        return "ray[serve] is not installed (pip install 'soma[ray]' 'ray[serve]')"
    if importlib.util.find_spec("starlette") is None:
        return "ray[serve] is incomplete (starlette is missing)"
    # Its own imports, tried in a child (a second or two): a plain `ray` beside a partial Serve (grpc missing,
    # say) passes the looks above and failed the whole module once the uvicorn contenders had been measured.
    tried = subprocess.run([sys.executable, "-c", "import ray.serve"], capture_output=True, text=True, timeout=120)
    if tried.returncode != 0:
        last = (tried.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        return f"ray.serve does not import here: {last}"
    if not os.environ.get(h.IN_NAMESPACE):
        return "no loopback-only network namespace (unshare -n refused): Ray would bind this machine's address"
    return None


def measure(loadgen, servers: dict, workload: str, sizes: dict, rounds: int, samples: dict) -> None:
    """Every level, `rounds` rounds, the servers taking turns (one later each round); samples[c][level]."""
    names = list(servers)
    for port_of in servers.values():  # untimed: workers import torch, pools fill, Serve's replicas warm up
        loadgen.load(port_of.contender, port_of.port, workload, 16, 64, salt=999)
    for level in LEVELS:
        for round_no in range(rounds):
            shift = round_no % len(names)
            for name in names[shift:] + names[:shift]:
                got = loadgen.load(name, servers[name].port, workload, level, sizes[level], salt=level * 10 + round_no)
                samples.setdefault(name, {}).setdefault(level, []).append(got)
                print(f"  {workload:5} {level:2} clients  {name:12} {got['rps']:7,.0f} requests/s  "
                      f"p50 {got['p50_ms']:7.1f} ms  p99 {got['p99_ms']:7.1f} ms  "
                      f"(load generator {got['cpu_ms_per_request']:.2f} ms CPU a request)", flush=True)


def run_servers(suite, contenders, workload: str, folder: str, loadgen, sizes, rounds, samples) -> None:
    servers = {c: Server(c, workload, folder) for c in contenders}  # (started together: their starts overlap)
    try:
        for server in servers.values():
            server.wait_ready()
        suite.done(f"starting {', '.join(contenders)} ({workload})")
        measure(loadgen, servers, workload, sizes, rounds, samples[workload])
        suite.done(f"measuring them ({workload})")
    finally:
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.wait_stopped()
    suite.done(f"stopping them ({workload})")


def run_ray_serve(suite, folder: str, loadgen, sizes, rounds, samples) -> None:
    """One Ray Serve for both workloads, the model redeployed between them."""
    server = Server("ray_serve", WORKLOADS[0], folder)
    try:
        for workload in WORKLOADS:
            if workload == WORKLOADS[0]:
                server.wait_ready()
            else:
                server.switch(workload)
            suite.done(f"{'starting' if workload == WORKLOADS[0] else 'redeploying'} ray_serve ({workload})")
            measure(loadgen, {"ray_serve": server}, workload, sizes, rounds, samples[workload])
            suite.done(f"measuring ray_serve ({workload})")
    finally:
        server.stop()


def summarize(samples: dict) -> dict:
    """contender → level → {"rps", "p50_ms", "p99_ms"}: the median over rounds of each figure."""
    return {c: {level: {k: statistics.median(s[k] for s in runs) for k in ("rps", "p50_ms", "p99_ms")}
                for level, runs in by_level.items()} for c, by_level in samples.items()}


def print_summary(figures: dict, ray_skipped: str | None) -> None:
    for workload, by_contender in figures.items():
        rows = []
        for level in LEVELS:
            soma = by_contender.get("soma", {}).get(level)
            for c in CONTENDERS:
                f = by_contender.get(c, {}).get(level)
                if f is None:
                    continue
                ratio = "" if c == "soma" or soma is None else f"{soma['rps'] / f['rps']:.2f}x"
                rows.append([str(level), c, f["rps"], f["p50_ms"], f["p99_ms"], ratio])
        h.print_table(f"{workload}: requests/s and latency (median over rounds)",
                      ["clients", "contender", "requests/s", "p50 ms", "p99 ms", "soma's requests/s is"], rows)
    if ray_skipped:
        print(f"\nray_serve skipped: {ray_skipped}")
    print("\ngoals at 64 clients (issue 35):")
    for line in goal_lines(figures):
        print("  " + line)


def goal_lines(figures: dict) -> list[str]:
    lines = []

    def check(workload, other, min_ratio, p99_at_most=None):
        soma, them = figures[workload].get("soma", {}).get(64), figures[workload].get(other, {}).get(64)
        if soma is None or them is None:
            return
        ratio = soma["rps"] / them["rps"]
        text = f"{workload}: soma {ratio:.2f}x {other}'s requests/s (goal >= {min_ratio}x)"
        ok = ratio >= min_ratio
        if p99_at_most is not None:
            p99 = soma["p99_ms"] / them["p99_ms"]
            text += f", p99 {p99:.2f}x theirs (goal <= {p99_at_most:.2f}x)"
            ok = ok and p99 <= p99_at_most
        lines.append(("met     " if ok else "NOT MET ") + text)

    check("heavy", "inprocess", 1.5, 1.0)
    check("heavy", "process_pool", 1.0, 1.0)
    check("tiny", "inprocess", 1.0)
    for workload in WORKLOADS:
        check(workload, "ray_serve", 4.0, 1 / 3)
    return lines


def plot(figures: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(figures), figsize=(5.5 * len(figures), 7), squeeze=False)
    styles = {"soma": ("C0", "o"), "inprocess": ("C1", "s"), "process_pool": ("C2", "^"), "ray_serve": ("C3", "D")}
    for col, (workload, by_contender) in enumerate(figures.items()):
        for c, by_level in by_contender.items():
            levels = sorted(by_level)
            color, marker = styles[c]
            axes[0][col].plot(levels, [by_level[n]["rps"] for n in levels], marker=marker, color=color, label=c)
            axes[1][col].plot(levels, [by_level[n]["p99_ms"] for n in levels], marker=marker, color=color, label=c)
        axes[0][col].set_title(f"{workload}: requests/s (higher is better)")
        axes[1][col].set_title(f"{workload}: p99 latency, ms (lower is better)")
        for row in (0, 1):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(LEVELS), [str(n) for n in LEVELS])
            ax.set_xlabel("concurrent clients")
            ax.grid(True, alpha=0.3)
        axes[1][col].set_yscale("log")
        axes[0][col].set_ylim(bottom=0)
        axes[0][col].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"\nwrote the plot to {path}")


def main(argv) -> None:
    args = h.parse_args(argv, __doc__, plot=True)
    if not args.smoke and importlib.util.find_spec("ray.serve") is not None:
        h.rerun_on_loopback(NAME, os.path.abspath(__file__), argv)
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise SystemExit(f"{NAME}: needs fastapi and uvicorn (pip install 'soma[serve]')")
    suite = h.Suite(NAME, args)  # (its mode and the machine's share; the records are the figures below)
    machine = h.MachineShare()  # (for the plot's title: a figure taken beside other programs says so)
    ray_skipped = why_no_ray_serve(args)
    if ray_skipped is None:
        os.environ.setdefault(*h.RAY_WORKER_NICENESS)  # (its server's Ray: replicas at nice 0, as the others)
    sizes, rounds = requests_per_level(suite.mode), suite.repeat(3, quick=1)
    print(f"{NAME} ({suite.mode}): {h.versions()}; requests per level {sizes}, {rounds} round(s); "
          f"ray_serve: {'skipped: ' + ray_skipped if ray_skipped else 'on loopback only'}", flush=True)
    samples: dict = {workload: {} for workload in WORKLOADS}
    loadgen = LoadGenerator()
    try:
        with tempfile.TemporaryDirectory(prefix="soma-bench-serve-") as folder:
            for workload in WORKLOADS:
                run_servers(suite, UVICORN_CONTENDERS, workload, folder, loadgen, sizes, rounds, samples)
            if ray_skipped is None:
                run_ray_serve(suite, folder, loadgen, sizes, rounds, samples)
    finally:
        loadgen.close()
    figures = {workload: summarize(by_contender) for workload, by_contender in samples.items()}
    for workload, by_contender in figures.items():
        for c, by_level in by_contender.items():
            for level, f in by_level.items():
                for key, unit in (("rps", "requests/s"), ("p50_ms", "ms p50"), ("p99_ms", "ms p99")):
                    suite.add(c, {"workload": workload, "clients": level}, [s[key] for s in
                                                                             samples[workload][c][level]], unit)
    json_path, suite.args.json = args.json, None  # (--json is the figures at 64 clients, not the records)
    suite.finish(lambda: print_summary(figures, ray_skipped))
    if json_path:
        out = {workload: {c: by_contender[c][64] for c in by_contender} for workload, by_contender in figures.items()}
        for workload in out:
            out[workload].setdefault("ray_serve", {"skipped": ray_skipped or "not measured"})
        h.write_json(json_path, out, "the figures at 64 clients")
    if getattr(args, "plot", None):
        others, _ = machine.others()
        plot(figures, args.plot, f"soma bench serve ({suite.mode}), {h.versions()}; other programs used "
                                 f"{others:.0f}% of a core meanwhile")


if __name__ == "__main__":
    h.cli(main)
