"""examples/serve.py behind a real uvicorn (a subprocess on a loopback socket the test binds and hands over).

One server, tests/serve_app.py's graph (`gate >> tokenize >> model >> record`: the example's app, with a node
the test can hold and one that records what finished), and in turn: concurrent requests (every answer checked
against the model run here), a client that disconnects while its input is held (cancelled: it never reaches
`record`), bodies that are not `{"text": ...}` (422, no worker sees them), a node that raises (500 naming it),
and SIGTERM with a request in flight (it is answered; then nothing is left: no process, segment or socket dir).
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, wait_for

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
torch = pytest.importorskip("torch")

sys.path.insert(0, str(ROOT / "examples"))
import serve  # noqa: E402  (examples/serve.py)

START_S = 90.0  # uvicorn, torch and two workers starting beside a busy suite


def expected_scores(text: str) -> list[float]:
    with torch.no_grad():
        return serve.make_model()(serve.token_ids(text)[None])[0].tolist()


def close_to(got, want) -> bool:
    return len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) for a, b in zip(got, want))


class Server:
    """uvicorn running tests/serve_app.py on a socket bound here (no free-port race), its log in a file."""

    def __init__(self, folder: Path, http: str, grace_s: float = 20):
        self.folder = folder
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.tmp = folder / "tmp"  # Local's socket dir goes here (TMPDIR): it must be gone at the end
        self.tmp.mkdir()
        self.log_path = folder / "uvicorn.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SOMA_SERVE_TEST_DIR": str(folder), "TMPDIR": str(self.tmp)}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "--factory", "tests.serve_app:create_app", "--fd",
                 str(self.sock.fileno()), "--timeout-graceful-shutdown", str(grace_s), *HTTP[http]],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, pass_fds=[self.sock.fileno()])
        wait_for(lambda: "Application startup complete" in self.log() or self.proc.poll() is not None, START_S,
                 "uvicorn to start the app")
        assert self.proc.poll() is None, self.log()

    def log(self) -> str:
        return self.log_path.read_text()

    def post(self, body: bytes, timeout: float = 30.0) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", "/predict", body, {"content-type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def predict(self, text: str) -> tuple[int, dict]:
        return self.post(json.dumps({"text": text}).encode())

    def files(self, pattern: str) -> list[Path]:
        return sorted(self.folder.glob(pattern))

    def recorded(self) -> list[list[float]]:
        return [json.loads(p.read_text()) for p in self.files("done.*")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.sock.close()


# uvicorn's two HTTP implementations tell a handler of a disconnect each their own way: both are checked
# (plain `pip install uvicorn` has h11 and asyncio's loop; uvicorn[standard] httptools and uvloop)
HTTP = {"h11": ["--http", "h11", "--loop", "asyncio"], "httptools": ["--http", "httptools", "--loop", "auto"]}


@pytest.fixture(params=[
    "h11", pytest.param("httptools", marks=pytest.mark.skipif(importlib.util.find_spec("httptools") is None,
                                                              reason="httptools is not installed (uvicorn[standard])"))])
def server(tmp_path, request):
    s = Server(tmp_path, request.param)
    yield s
    s.stop()


@pytest.mark.timeout(300)
def test_the_example_app_behind_uvicorn(server):
    psutil = pytest.importorskip("psutil")
    workers = psutil.Process(server.proc.pid).children(recursive=True)
    assert len(workers) == 1, [w.cmdline() for w in workers]  # (tests/serve_app.py: one worker)

    # Concurrent requests: every answer is the model's, computed here.
    texts = [f"text{i} " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(30)) for i in range(64)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(server.predict, texts))
    for text, (status, body) in zip(texts, answers):
        assert status == 200, body
        assert close_to(body["scores"], expected_scores(text)), (text, body)

    # A client that disconnects while its input waits behind one held at `gate`: its input is cancelled.
    listened = len(server.files("listening.*"))  # (one per request so far: each was answered)
    first = {}
    holder = threading.Thread(target=lambda: first.update(got=server.predict("hold1 the worker is busy")))
    holder.start()
    wait_for(lambda: server.files("started.hold1"), 30, "the first input to reach `gate` and be held there")
    assert len(server.files("listening.*")) == listened + 1
    victim = "victim1 " + " ".join(f"gone{j}" for j in range(30))
    client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    body = json.dumps({"text": victim}).encode()
    client.sendall(b"POST /predict HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(body), body))
    wait_for(lambda: len(server.files("listening.*")) == listened + 2, 30, "the victim's input to be in flight")
    client.close()
    wait_for(lambda: "its input was cancelled" in server.log(), 30, "the server to cancel the victim's input")
    (server.folder / "release.hold1").touch()
    holder.join(30)
    assert first["got"][0] == 200 and close_to(first["got"][1]["scores"], expected_scores("hold1 the worker is busy"))
    assert server.predict("after1 the one worker's queue went past the victim")[0] == 200
    assert server.files("started.victim1") == [], "the cancelled input started"
    assert not any(close_to(scores, expected_scores(victim)) for scores in server.recorded())
    assert len(server.recorded()) == len(texts) + 2

    # Bodies that are not {"text": <non-empty string>}: 422 saying what is wrong, and no worker sees them.
    started = len(server.files("started.*"))
    for bad in (b"not json", b'{"txt": "a"}', b'{"text": 3}', b'{"text": ""}'):
        status, answer = server.post(bad)
        assert status == 422 and answer["detail"][0]["loc"][0] == "body", (bad, answer)
    assert server.predict("after the bad ones")[0] == 200
    assert len(server.files("started.*")) == started + 1  # only the good one reached `gate`

    # A node that raises: 500, and the body names the node.
    status, answer = server.predict("fail1 please")
    assert status == 500 and answer["node"] == "gate", answer
    assert "node `gate` failed" in answer["error"] and "asked to fail" in answer["error"], answer

    # SIGTERM with a request in flight: it is answered, then nothing of the server is left.
    answer = {}
    in_flight = threading.Thread(target=lambda: answer.update(got=server.predict("hold2 last one")))
    in_flight.start()
    wait_for(lambda: server.files("started.hold2"), 30, "the last request to reach `gate`")
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "Shutting down" in server.log(), 30, "uvicorn to begin shutting down")
    (server.folder / "release.hold2").touch()
    in_flight.join(30)
    assert answer["got"][0] == 200 and close_to(answer["got"][1]["scores"], expected_scores("hold2 last one"))
    # (uvicorn >= 0.29 re-raises the signal it caught once it has shut down cleanly: killed by SIGTERM, then)
    assert server.proc.wait(60) in (0, -signal.SIGTERM), server.log()
    wait_for(lambda: not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers), 30,
             "the worker processes to exit")
    assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"soma-{server.proc.pid}-")]
    assert list(server.tmp.iterdir()) == []  # Local's socket dir is gone
    assert "Application shutdown complete" in server.log()


@pytest.mark.timeout(300)
def test_a_request_still_running_when_the_shutdowns_grace_runs_out_is_a_503_saying_so(tmp_path):
    """SIGTERM, and a request held past uvicorn's grace (2 s): uvicorn cancels its handler before the app's
    shutdown closes the runner. The client gets a 503 that says the server is stopping (it got uvicorn's bare
    500, and the log a CancelledError traceback, before Dec 6); the input is cancelled; nothing is left."""
    server = Server(tmp_path, "h11", grace_s=2)
    try:
        answer = {}
        held = threading.Thread(target=lambda: answer.update(got=server.predict("hold3 never released")))
        held.start()
        wait_for(lambda: server.files("started.hold3"), 30, "the request to reach `gate`")
        server.proc.send_signal(signal.SIGTERM)
        held.join(60)
        status, body = answer["got"]
        assert status == 503 and "the server is stopping" in body["error"], (status, body, server.log())
        assert server.proc.wait(60) in (0, -signal.SIGTERM), server.log()
        assert "CancelledError" not in server.log() and "Exception in ASGI application" not in server.log(), \
            server.log()
        assert list(server.tmp.iterdir()) == []  # Local's socket dir is gone
        assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"soma-{server.proc.pid}-")]
    finally:
        server.stop()


@pytest.mark.timeout(630)
def test_soma_bench_serve_smoke_writes_the_figures_at_64_clients(tmp_path):
    """`soma bench serve --smoke`: every contender's server answers (each answer checked by the benchmark), and
    --json holds requests/s, p50 and p99 per workload and contender at 64 clients (ray_serve: skipped, why)."""
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    plotting = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    done = subprocess.run([sys.executable, "-m", "soma.cli", "bench", "serve", "--smoke", "--json", str(out),
                           *plotting], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures) == {"tiny", "heavy"}
    for workload, by_contender in figures.items():
        assert set(by_contender) == {"soma", "inprocess", "process_pool", "ray_serve"}, by_contender
        for contender in ("soma", "inprocess", "process_pool"):
            f = by_contender[contender]
            assert f["rps"] > 0 and 0 < f["p50_ms"] <= f["p99_ms"], (workload, contender, f)
        assert "--smoke runs no Ray Serve" in by_contender["ray_serve"]["skipped"]
    assert "goals at 64 clients" in done.stdout
    if plotting:
        assert png.read_bytes().startswith(b"\x89PNG")
