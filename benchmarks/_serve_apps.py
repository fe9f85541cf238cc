"""One server of `soma bench serve`, in a process of its own: `python _serve_apps.py CONTENDER WORKLOAD READY_FILE`.

It serves `POST /predict {"text": ...}` → `{"scores": [...]}` on 127.0.0.1 (a port of its own choosing), writes
the port to READY_FILE once it can answer, and runs until SIGTERM (then it shuts down cleanly and exits).
`ray_serve` also reads workload names on stdin: each line redeploys the model for that workload on the Ray it
has (a Ray start costs 15-60 s here: one serves both workloads) and writes READY_FILE again once it answers.

    soma          examples/serve.py's app: `await local.arun(stage >> Batched(model))`, Local(workers=2)
    inprocess     the same FastAPI app, `await loop.run_in_executor(None, predict, text)` (the default
                  thread pool: what most people write first)
    process_pool  the same app, `run_in_executor(ProcessPoolExecutor(2), predict, text)` (spawned processes,
                  one torch thread each)
    ray_serve     a Ray Serve deployment (2 replicas, one CPU each, on a local Ray of 2 CPUs) of the same stage
                  and model, the model under `@serve.batch` (same max_batch_size and wait as soma), through
                  Serve's own HTTP proxy
`predict` and the stages are benchmarks/_serve_work.py's, the model examples/serve.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import multiprocessing as mp
import os
import signal
import socket
import sys
import threading

import _serve_work as work


def fastapi_app(call_in_pool, pool_factory):
    """The app of `inprocess` and `process_pool`: validation as examples/serve.py's, the work in a pool."""
    from fastapi import FastAPI

    @contextlib.asynccontextmanager
    async def lifespan(app):
        pool = pool_factory()
        app.state.pool = pool
        yield
        if pool is not None:
            pool.shutdown(wait=True)

    app = FastAPI(lifespan=lifespan)

    @app.post("/predict")
    async def predict(body: work.example.Text):
        return {"scores": await call_in_pool(app.state.pool, body.text)}

    return app


def _one_torch_thread() -> None:
    import torch

    torch.set_num_threads(1)  # two processes on two cores (as Local's default threads= gives its workers)


def build_app(contender: str, workload: str):
    if contender == "soma":
        graph = work.example.make_graph(work.stage_node(workload), max_batch=work.MAX_BATCH,
                                        batch_wait=work.BATCH_WAIT)
        return work.example.create_app(graph, workers=2)
    task = functools.partial(work.predict, workload)
    if contender == "inprocess":
        return fastapi_app(lambda pool, text: asyncio.get_running_loop().run_in_executor(None, task, text),
                           lambda: None)
    if contender == "process_pool":
        return fastapi_app(lambda pool, text: asyncio.get_running_loop().run_in_executor(pool, task, text),
                           lambda: cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"),
                                                          initializer=_one_torch_thread))
    raise SystemExit(f"_serve_apps: no contender {contender!r}")


def serve_uvicorn(contender: str, workload: str, ready_file: str) -> None:
    import uvicorn

    # uvicorn binds (port 0: a free one) as it does for any user: a socket handed over with fd= instead
    # lacks TCP_NODELAY, and every answer then waits 40 ms for a delayed ACK (measured: p50 48 ms at 1 client)
    config = uvicorn.Config(build_app(contender, workload), host="127.0.0.1", port=0, log_level="warning",
                            timeout_graceful_shutdown=10)
    server = uvicorn.Server(config)

    def announce():  # once the lifespan's startup has finished (Local's workers up, the pool made)
        while not server.started and not server.should_exit:
            threading.Event().wait(0.01)
        _announce(ready_file, server.servers[0].sockets[0].getsockname()[1])

    threading.Thread(target=announce, daemon=True).start()
    server.run()


def _announce(ready_file: str, port: int) -> None:
    with open(ready_file + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(ready_file + ".tmp", ready_file)


def serve_ray(workload: str, ready_file: str) -> None:
    import ray
    from ray import serve

    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(here), "examples"), here,
                                                os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})

        @serve.deployment(num_replicas=2, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
        class Model:
            def __init__(self, workload: str):
                import _serve_work
                import torch

                torch.set_num_threads(1)
                self.stage = _serve_work.STAGES[workload]
                self.model = _serve_work.example.make_model()

            @serve.batch(max_batch_size=work.MAX_BATCH, batch_wait_timeout_s=work.BATCH_WAIT)
            async def run_model(self, ids_list):
                import torch

                with torch.no_grad():
                    return [row.tolist() for row in self.model(torch.stack(ids_list))]

            async def __call__(self, request):
                body = await request.json()
                return {"scores": await self.run_model(self.stage(body["text"]))}

        def switch_on_request():  # the driver's next workloads, a line each, until it closes stdin
            for line in sys.stdin:
                serve.run(Model.bind(line.strip()), name="model", route_prefix="/predict")
                _announce(ready_file, port)

        serve.run(Model.bind(workload), name="model", route_prefix="/predict")
        _announce(ready_file, port)
        threading.Thread(target=switch_on_request, daemon=True).start()
        stopping.wait()
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    contender_name, workload_name, ready = sys.argv[1:4]
    if contender_name == "ray_serve":
        serve_ray(workload_name, ready)
    else:
        serve_uvicorn(contender_name, workload_name, ready)
