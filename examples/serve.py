"""A FastAPI app on uvicorn with a soma graph behind its endpoint: tokenize in Python, then a batched torch model.

    pip install torch==2.13.0 numpy 'soma[serve]'   (the extra: fastapi, uvicorn; the model: torch)
    python examples/serve.py [PORT]    (127.0.0.1; then:
        curl -H 'content-type: application/json' -d '{"text": "a few words"}' 127.0.0.1:PORT/predict)

    POST /predict {"text": "..."}  →  {"scores": [4 floats]}

How a request flows:

    uvicorn (event loop) ── handler: await local.arun(graph, text) ──▶ soma.Local's host
                                                                          │ (inputs to the workers)
        worker 1, worker 2:   tokenize ──▶ model (soma.torch.Batched)
                              each input whole on one worker; the inputs a worker has at once
                              run together and meet at `model` in one call (up to max_batch)

Each request is one coroutine and one input in flight, never a thread: 64 clients are 64
inputs, spread over both workers and met in batches at `model`.

What a user meets:
- The runner lives as long as the app: opened in the lifespan's startup, closed at its
  shutdown. uvicorn, on SIGTERM or Ctrl-C, stops accepting, lets the requests in flight
  finish (at most `GRACE` seconds, then cancels them), and then runs the shutdown, which
  closes the runner: no worker process, shared-memory segment or socket file is left.
- A client that disconnects cancels its input. uvicorn does not cancel a handler whose
  client went away; it answers the handler's next `receive()` with `http.disconnect`. So
  the handler waits on that and on the run together (`first_of`) and cancels the run if
  the client goes first; cancelling `arun` cancels its input (SPEC 7.6: one not started yet
  never starts, on the host or in a worker's queue; one running finishes where it runs and
  its result is dropped).
- A body that is not `{"text": <non-empty string>}` is a 422 from FastAPI's validation,
  with what was wrong; it never reaches the runner.
- A node that raises is a 500 whose body names the node (`soma.NodeError.node`) and says
  what failed; a worker that died, a run past TIMEOUT, or a request still running when the
  shutdown's grace ran out (uvicorn cancels its handler: its input is cancelled) is a 503
  that says which (the client may try again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import zlib

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

import soma
from soma import Done, Graph, Node
from soma.errors import NodeError, SomaError

IDS, VOCAB, CLASSES = 16, 4096, 4
GRACE = 10.0  # seconds uvicorn lets requests in flight finish at shutdown before it cancels them
TIMEOUT = 30.0  # seconds for one input, whatever happens to it
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: shown on its stderr


def token_ids(text: str) -> torch.Tensor:
    """The first 16 words hashed into a vocabulary of 4,096 (padded with 0): a stand-in for a tokenizer.

    crc32, not `hash()`: Python salts `hash` per process, and the workers must agree."""
    ids = [zlib.crc32(word.encode()) % VOCAB for word in text.split()[:IDS]]
    return torch.tensor(ids + [0] * (IDS - len(ids)))


class Tokenize(Node):
    def forward(self, text, ctx):
        return Done(token_ids(text))


def make_model() -> torch.nn.Module:
    """A small classifier, the same weights in every process and thread: drawn from a generator of its own
    (seeding torch's global one would race with any other thread drawing from it meanwhile)."""
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Flatten(), torch.nn.Linear(IDS * 16, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
    weights = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=weights) * (0.5 if p.dim() == 2 and p.shape[0] == VOCAB else 0.05))
    return model.eval()


def model_node(max_batch: int = 32, batch_wait: float = 0.002) -> soma.torch.Batched:
    """The model as a batching node `model`: the inputs at it at once, up to `max_batch`, in one call."""
    return soma.torch.Batched(make_model(), name="model", max_batch=max_batch, batch_wait=batch_wait)


def make_graph(stage: Node | None = None, max_batch: int = 32, batch_wait: float = 0.002) -> Graph:
    """`stage >> model`: a per-item Python stage (default `Tokenize`), then the model on batches."""
    return Graph.somatize((stage if stage is not None else Tokenize()) >> model_node(max_batch, batch_wait))


class Text(BaseModel):
    text: str = Field(min_length=1, max_length=10_000)


async def first_of(run: asyncio.Task, request: Request) -> bool:
    """Wait for the run, unless the client disconnects first: then cancel it (and so its input); False."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass  # (the body was read already: the next message is the disconnect, or the response's end)

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([run, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:  # (also when this handler is cancelled: uvicorn past its grace at shutdown)
        watch.cancel()
        answered = run.done()
        if not answered:
            run.cancel()
            await asyncio.wait([run])  # (the task's end is its input's cancellation: submit's future cancelled)
            log.info("a request ended before its answer (its client went away, or the server is stopping): "
                     "its input was cancelled")
    return answered


def create_app(graph: Graph | None = None, workers: int = 2) -> FastAPI:
    """The app: `POST /predict` runs `graph` (default `make_graph()`) on a `soma.Local(workers)` of its own."""
    graph = graph if graph is not None else make_graph()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Started off the loop, closed the same way; the workers import torch at once, not at the first request.
        async with soma.Local(workers=workers, preload_torch=True) as local:
            app.state.local = local
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/predict")
    async def predict(body: Text, request: Request):
        run = asyncio.ensure_future(request.app.state.local.arun(graph, body.text, timeout=TIMEOUT))
        try:
            answered = await first_of(run, request)
        except asyncio.CancelledError:  # uvicorn stopping past its grace cancels the handlers (then closes the
            # runner): the client is told so, not left a bare 500 and the log a traceback per request
            return JSONResponse({"error": "the server is stopping and did not finish this request in its grace "
                                          "period: try again"}, status_code=503)
        if not answered:  # nobody to answer: a status for the access log only
            return JSONResponse({"error": "the client closed the connection first"}, status_code=499)
        try:
            scores = run.result()
        except NodeError as err:
            return JSONResponse({"error": str(err), "node": err.node}, status_code=500)
        except SomaError as err:  # WorkerDied, RunTimeout, or the runner closed under it (shutdown past its grace)
            return JSONResponse({"error": str(err)}, status_code=503)
        return {"scores": scores.tolist()}

    return app


def main(port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(create_app(), host="127.0.0.1", port=port, timeout_graceful_shutdown=GRACE)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
