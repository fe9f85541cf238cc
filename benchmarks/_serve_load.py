"""The load generator of `soma bench serve`, in a process of its own: one JSON line in, one out, per load.

    {"port": 8000, "workload": "heavy", "clients": 64, "requests": 640, "salt": 3}
        →  {"rps": ..., "p50_ms": ..., "p99_ms": ..., "cpu_ms_per_request": ..., "requests": 640}

`clients` asyncio clients, each on its own HTTP/1.1 keep-alive connection (written by hand on asyncio's streams:
a request is one write, an answer one read of its head and its Content-Length), take the next request as soon
as their answer came, until `requests` were sent (after one untimed request per client: connections open,
the server warm). Every answer is checked against `predict` run here, off the clock: a status other than 200,
or scores not the model's, ends the benchmark naming the contender (`WrongValue` in the driver).

Why by hand and not a library: a client must cost far less CPU than the server it loads, on the same two
cores (its cost per request is reported: `cpu_ms_per_request`). A shared httpx client costs 5-10 ms of CPU a
request and becomes the bottleneck; wrk costs less still but checks no answer and needs a Lua script for
bodies that differ. uvloop when installed (it comes with uvicorn[standard]).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

import _serve_work as work


async def read_answer(reader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 answer: a Content-Length body (uvicorn's), or a chunked one (Ray Serve's)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            return status, await reader.readexactly(int(value))
        if name == b"transfer-encoding" and value.strip().lower() == b"chunked":
            chunks = []
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                chunks.append((await reader.readexactly(size + 2))[:-2])  # (each chunk ends in CRLF)
            await reader.readuntil(b"\r\n")  # (the empty trailer)
            return status, b"".join(chunks)
    raise RuntimeError(f"an answer with neither Content-Length nor chunks: {head[:300]!r}")


def request_bytes(text: str) -> bytes:
    body = json.dumps({"text": text}).encode()
    return (b"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def load(port: int, workload: str, clients: int, requests: int, salt: int) -> dict:
    texts = work.texts(requests + clients, salt)
    bodies = [request_bytes(t) for t in texts]
    latencies: list = []
    answers: dict = {}
    warm = asyncio.Queue()
    for i in range(clients):  # one untimed request per client first (connections open, the server warm)
        warm.put_nowait(i)
    order = asyncio.Queue()
    for i in range(clients, clients + requests):
        order.put_nowait(i)
    # The warm-up and the timed part share the connections: one per client, kept alive.
    conns = [asyncio.open_connection("127.0.0.1", port) for _ in range(clients)]
    streams = await asyncio.gather(*conns)

    async def client(reader, writer, timed: bool, queue):
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            start = time.perf_counter()
            writer.write(bodies[i])
            answers[i] = await read_answer(reader)
            if timed:
                latencies.append(time.perf_counter() - start)

    await asyncio.gather(*(client(r, w, False, warm) for r, w in streams))
    cpu0, start = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client(r, w, True, order) for r, w in streams))
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    for _, w in streams:
        w.close()
    for i, text in enumerate(texts):  # off the clock: every answer, warm-up included
        status, body = answers[i]
        if status != 200:
            return {"wrong": f"request {i} answered {status}: {body[:300]!r}"}
        got = json.loads(body)["scores"]
        want = _expected.get((workload, text))
        if want is None:
            want = _expected[workload, text] = work.predict(workload, text)
        if not work.close_to(got, want):
            return {"wrong": f"request {i} ({text[:40]!r}...) answered {got}, the model says {want}"}
    latencies.sort()
    return {"rps": requests / elapsed, "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "cpu_ms_per_request": 1e3 * cpu / requests, "requests": requests}


_expected: dict = {}  # (workload, text) → the model's scores: every contender gets the same requests


def main() -> None:
    try:
        from uvloop import run
    except ImportError:
        run = asyncio.run
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            answer = run(load(ask["port"], ask["workload"], ask["clients"], ask["requests"], ask["salt"]))
        except (OSError, asyncio.IncompleteReadError, RuntimeError) as err:
            answer = {"wrong": f"the connection failed: {type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
