"""What `soma bench serve`'s servers and its load generator share: the requests, the per-item stages, the model.

Both workloads end in examples/serve.py's model (the same weights everywhere: seeded) on 16 token ids:
    tiny   examples/serve.py's `token_ids` (crc32 of up to 16 words): microseconds of Python
    heavy  `heavy_token_ids`: the same words through HEAVY_ROUNDS passes of a character hash, about 1 ms of
           pure Python (what a real tokenizer costs for a short text); it holds the GIL throughout
Every contender calls these very functions, so a wrong answer anywhere is a difference from `expected`.
"""

from __future__ import annotations

import math
import os
import sys
import threading

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import serve as example  # noqa: E402  (examples/serve.py: ahead of benchmarks/serve.py on sys.path)
import torch  # noqa: E402

from soma import Done, Node  # noqa: E402

WORKLOADS = ("tiny", "heavy")
HEAVY_ROUNDS = 35  # about 1 ms for a text of REQUEST_WORDS words on this machine (1.5 ms with it shared)
REQUEST_WORDS = 30
MAX_BATCH, BATCH_WAIT = 32, 0.002  # soma's Batched and Ray Serve's @serve.batch alike


def heavy_token_ids(text: str) -> torch.Tensor:
    ids = []
    for word in text.split()[:example.IDS]:
        h = 0
        for _ in range(HEAVY_ROUNDS):
            for ch in word:
                h = (h * 31 + ord(ch)) & 0xFFFFFFFF
        ids.append(h % example.VOCAB)
    return torch.tensor(ids + [0] * (example.IDS - len(ids)))


STAGES = {"tiny": example.token_ids, "heavy": heavy_token_ids}


class HeavyTokenize(Node):
    def forward(self, text, ctx):
        return Done(heavy_token_ids(text))


def stage_node(workload: str) -> Node:
    return example.Tokenize() if workload == "tiny" else HeavyTokenize()


_model = None
_model_lock = threading.Lock()


def predict(workload: str, text: str) -> list[float]:
    """One request the way most people write it first: the stage, then the model on a batch of one."""
    global _model
    with _model_lock:  # (made once per process, whichever thread comes first)
        if _model is None:
            _model = example.make_model()
    with torch.no_grad():
        return _model(STAGES[workload](text)[None])[0].tolist()


def texts(count: int, salt: int = 0) -> list[str]:
    """`count` different requests of REQUEST_WORDS words each."""
    return [" ".join(f"w{(i * 31 + j * 7 + salt) % 997}x{j}" for j in range(REQUEST_WORDS)) for i in range(count)]


def close_to(got, want) -> bool:
    """Batched and single-row matmuls may differ in the last bits: equal within float32's noise."""
    return len(got) == len(want) and all(math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-5) for a, b in zip(got, want))
