"""A small asyncio server with soma behind its requests: each request is one `await local.arun(g, x)`.

    python examples/asyncio_server.py [REQUESTS]     (it starts the server, sends REQUESTS, prints, stops)

The server speaks a line protocol on 127.0.0.1 (a free port): a client sends a line of
text, the server answers with a JSON line: the words and their lengths, computed by a
soma graph on two worker processes. Requests are handled concurrently (one coroutine
each, no thread each): many in flight at once spread over the workers. A client that
gives up (closes its connection) cancels its input. Nothing here needs the network
beyond loopback, nor anything but soma.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import soma
from soma import Done, Graph, Node


class Tokenize(Node):
    def forward(self, x, ctx):
        return Done(x.split())


class Lengths(Node):
    def forward(self, words, ctx):
        return Done({w: len(w) for w in words})


GRAPH = Graph.somatize(Tokenize() >> Lengths())


async def handle(local, reader, writer) -> None:
    """One connection: a request per line, an answer per line."""
    try:
        while line := await reader.readline():
            answer = await local.arun(GRAPH, line.decode().strip(), timeout=10)
            writer.write((json.dumps(answer) + "\n").encode())
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client went away: its input was cancelled with this coroutine
    finally:
        writer.close()


async def client(port: int, texts: list) -> list:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = []
    for text in texts:
        writer.write((text + "\n").encode())
        await writer.drain()
        answers.append(json.loads(await reader.readline()))
    writer.close()
    return answers


async def main(requests: int = 200, clients: int = 20) -> float:
    async with soma.Local(workers=2) as local:
        server = await asyncio.start_server(lambda r, w: handle(local, r, w), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        texts = [f"request {i} with a few words" for i in range(requests)]
        start = time.perf_counter()
        per_client = [texts[c::clients] for c in range(clients)]
        answers = await asyncio.gather(*(client(port, mine) for mine in per_client))
        elapsed = time.perf_counter() - start
        for mine, got in zip(per_client, answers):
            assert got == [{w: len(w) for w in text.split()} for text in mine], "wrong answers"
        server.close()
        await server.wait_closed()
    rate = requests / elapsed
    print(f"served {requests} requests from {clients} concurrent clients on port {port} in {elapsed:.2f} s: "
          f"{rate:,.0f} requests/s, every answer checked")
    return rate


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200))
