"""The app tests/test_serve.py starts with uvicorn: examples/serve.py's `create_app`, over a graph the test can
hold and watch.

    gate >> tokenize >> model >> record

One worker, so an input sent while another is held at `gate` waits, not started (where a cancel drops it).
`gate` (per item) writes `started.<tag>` in $SOMA_SERVE_TEST_DIR (the tag: the text's first word), waits while
the text starts with `hold` until `release.<tag>` exists there (bounded), writes `gated.<tag>`, and raises for a
text that starts with `fail`. `record` (after the batched model) writes the scores of each input it finishes to a
file of its own. `NoteListening` writes `listening.<n>` when a request's handler, its body read and its
input submitted, starts listening for the client's disconnect: the test knows then that its input is in flight.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

from soma import Done, Graph, Node

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import serve  # noqa: E402  (examples/serve.py)

HOLD_S = 60.0  # the longest a held input waits for its release (the test's own deadlines are shorter)


def _folder() -> Path:
    return Path(os.environ["SOMA_SERVE_TEST_DIR"])


class Gate(Node):
    def forward(self, text, ctx):
        tag = text.split()[0]
        (_folder() / f"started.{tag}").touch()
        if tag.startswith("fail"):
            raise ValueError(f"asked to fail by {tag!r}")
        deadline = time.monotonic() + HOLD_S
        while tag.startswith("hold") and not (_folder() / f"release.{tag}").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag} was never released")
            time.sleep(0.005)
        (_folder() / f"gated.{tag}").touch()
        return Done(text)


class Record(Node):
    def forward(self, scores, ctx):
        (_folder() / f"done.{uuid.uuid4().hex}").write_text(json.dumps(scores.tolist()))
        return Done(scores)


class NoteListening:
    """ASGI middleware: a request's receive() called again after its whole body came is the handler's
    `first_of` listening for the disconnect, which begins after its run task submitted the input."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        body_done = False

        async def noting():
            nonlocal body_done
            if body_done:
                (_folder() / f"listening.{uuid.uuid4().hex}").touch()
            message = await receive()
            body_done = body_done or (message["type"] == "http.request" and not message.get("more_body"))
            return message

        await self.app(scope, noting if scope["type"] == "http" else receive, send)


def create_app():
    graph = Graph.somatize(Gate() >> serve.Tokenize() >> serve.model_node() >> Record())
    app = serve.create_app(graph, workers=1)
    app.add_middleware(NoteListening)
    return app
