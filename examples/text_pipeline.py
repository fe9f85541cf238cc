"""A text pipeline of the kind soma is for: pure-Python preprocessing in a wave, then a small torch model,
over many documents with `map`.

    python examples/text_pipeline.py [DOCS] [BATCH] [WORKERS]        (defaults: 200 8 2)

    graph:  (word_piece | ngram_hash) >> encoder

* word_piece: a WordPiece tokenizer in pure Python (lower-case, split on spaces
  and punctuation, then greedy longest-match-first subwords: `trans ##port ##er`),
  truncated to 256 ids per document.
* ngram_hash: character 3-grams of each document, hashed (FNV-1a, in Python)
  into 4,096 buckets and counted.
* encoder: a small torch model with random weights (seeded, so every copy and
  every process holds the same ones; nothing is downloaded): a mean
  EmbeddingBag of the token ids and a linear map of the bucket counts, then a
  two-layer MLP, to one unit-length 32-dim vector per document.

The documents are made up here (a fixed seed): 5 topics, each with its own
words, built from shared syllables. Inputs are batches of BATCH documents;
`Local.map` runs several batches at once, both branches of a batch at once, and
the model on whichever worker is free. The example checks that Local gives the
in-process Executor's vectors, prints both rates, and how often a document's
nearest neighbour (cosine) shares its topic: the random model still keeps
similar texts near each other.

`embed_batch` is the same work as a plain function, for process pools
(`benchmarks/map.py` races `Local.map` against `ProcessPoolExecutor.map` with it).
Needs torch: without it, it says so and exits with status 2.
"""

from __future__ import annotations

import random
import re
import sys
import threading
import time

from soma import Done, Graph, Node, Opaque

NEEDS_TORCH = "examples/text_pipeline.py needs torch (its encoder is a torch model): pip install torch==2.13.0 numpy"

TOPICS = 5
MAX_TOKENS = 256
BUCKETS = 4096
NGRAM = 3
DIM = 32
SEED = 1234


# -- the documents and the vocabulary (deterministic: every process builds the same) ---------------------

SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vo", "qui", "dal", "sen", "por", "tri", "nu", "bel", "xo", "fa",
             "gri", "hel", "jun", "mar", "ost", "pla", "rud", "sil", "tor", "ul", "wen", "yar", "zed"]


def topic_words(seed: int = SEED) -> list[list[str]]:
    """Each topic's 120 words: 2-4 syllables each; topics share syllables, not words."""
    rng = random.Random(seed)
    return [["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(120)]
            for _ in range(TOPICS)]


def make_documents(count: int, seed: int = SEED) -> list[tuple[int, str]]:
    """`(topic, text)` pairs: 150-300 words, 80 % from the topic's own words, with punctuation."""
    words = topic_words(seed)
    common = [w for topic in words for w in topic[:10]]  # every topic's commonest words appear everywhere
    rng = random.Random(seed + 1)
    docs = []
    for i in range(count):
        topic = i % TOPICS
        out = []
        for _ in range(rng.randint(150, 300)):
            out.append(rng.choice(words[topic]) if rng.random() < 0.8 else rng.choice(common))
            if rng.random() < 0.08:
                out[-1] += rng.choice([",", ".", ";", "!"])
        out[0] = out[0].capitalize()
        docs.append((topic, " ".join(out)))
    return docs


def build_vocab(seed: int = SEED) -> dict[str, int]:
    """WordPiece vocabulary: special tokens, punctuation, every syllable as a start and as `##`
    continuation, and the 300 most frequent whole words (the rest split into subwords)."""
    words = topic_words(seed)
    pieces = ["[PAD]", "[UNK]", ",", ".", ";", "!"]
    pieces += SYLLABLES + ["##" + s for s in SYLLABLES]
    pieces += sorted({w for topic in words for w in topic[:60]})
    return {piece: i for i, piece in enumerate(pieces)}


# -- the three stages, as plain objects (the nodes and `embed_batch` both use them) ---------------------

SPLIT = re.compile(r"\w+|[^\w\s]")


class WordPieceTokenizer:
    """Greedy longest-match-first WordPiece, as BERT's tokenizer does it, in pure Python."""

    def __init__(self, vocab: dict[str, int], max_chars: int = 100):
        self.vocab = vocab
        self.unk = vocab["[UNK]"]
        self.max_chars = max_chars

    def word_ids(self, word: str) -> list[int]:
        if len(word) > self.max_chars:
            return [self.unk]
        ids, start = [], 0
        while start < len(word):
            end, found = len(word), None
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                found = self.vocab.get(piece)
                if found is not None:
                    break
                end -= 1
            if found is None:
                return [self.unk]
            ids.append(found)
            start = end
        return ids

    def __call__(self, text: str) -> list[int]:
        ids = []
        for word in SPLIT.findall(text.lower()):
            ids.extend(self.word_ids(word))
            if len(ids) >= MAX_TOKENS:
                break
        return ids[:MAX_TOKENS]


def ngram_counts(text: str) -> dict[int, int]:
    """Character 3-grams hashed (32-bit FNV-1a over their code points) into BUCKETS, counted."""
    text = text.lower()
    counts: dict[int, int] = {}
    for i in range(len(text) - NGRAM + 1):
        h = 2166136261
        for ch in text[i:i + NGRAM]:
            h = ((h ^ ord(ch)) * 16777619) & 0xFFFFFFFF
        bucket = h % BUCKETS
        counts[bucket] = counts.get(bucket, 0) + 1
    return counts


def build_model():
    """The encoder: seeded random weights, the same in every process and thread.

    Drawn from a generator of its own, not torch's global one, which another
    thread building its model at the same moment would draw from too.
    """
    import torch
    from torch import nn

    class Encoder(nn.Module):
        def __init__(self, vocab_size: int):
            super().__init__()
            self.tokens = nn.EmbeddingBag(vocab_size, 64, mode="mean")
            self.ngrams = nn.Linear(BUCKETS, 64)
            self.mlp = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, DIM))

        def forward(self, ids, offsets, counts):
            h = torch.cat([self.tokens(ids, offsets), self.ngrams(counts)], dim=1)
            return nn.functional.normalize(self.mlp(h), dim=1)

    model = Encoder(len(build_vocab())).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param in model.parameters():
            bound = 1 / param.shape[-1] ** 0.5  # like nn.Linear's default: uniform within 1/sqrt(fan_in)
            param.copy_((torch.rand(param.shape, generator=gen) * 2 - 1) * bound)
    return model


def encode(model, ids_batch: list[list[int]], counts_batch: list[dict[int, int]]):
    """One [batch, DIM] float32 tensor of unit vectors."""
    import torch

    offsets, flat = [], []
    for ids in ids_batch:
        offsets.append(len(flat))
        flat.extend(ids or [0])
    counts = torch.zeros(len(counts_batch), BUCKETS)
    for row, doc in enumerate(counts_batch):
        if doc:
            counts[row, list(doc)] = torch.tensor(list(doc.values()), dtype=torch.float32)
    counts = torch.log1p(counts)
    with torch.no_grad():
        return model(torch.tensor(flat), torch.tensor(offsets), counts)


# -- as soma nodes ----------------------------------------------------------------------------------------

class WordPiece(Node):
    def setup(self, ctx):
        self.tokenize = WordPieceTokenizer(build_vocab())

    def forward(self, docs, ctx):
        return Done([self.tokenize(text) for text in docs])


class NgramHash(Node):
    def forward(self, docs, ctx):
        return Done([ngram_counts(text) for text in docs])


class TextEncoder(Node):
    def setup(self, ctx):
        self.model = build_model()

    def forward(self, branches, ctx):
        ids_batch, counts_batch = branches
        return Done(Opaque(encode(self.model, ids_batch, counts_batch)))


def graph() -> Graph:
    return Graph.somatize((WordPiece() | NgramHash()) >> TextEncoder().named("encoder"))


# -- the same work as one plain function (for process pools) ----------------------------------------------

_STAGES = None
_STAGES_LOCK = threading.Lock()


def embed_batch(docs: list[str]):
    """Tokenize, hash and encode one batch in this process: what one writes for ProcessPoolExecutor.map.

    Built once per process on the first call, like a node's setup, and with
    torch at one thread, as soma's workers get on 2 cores with 2 workers.
    """
    global _STAGES
    with _STAGES_LOCK:
        if _STAGES is None:
            import torch

            torch.set_num_threads(1)
            _STAGES = WordPieceTokenizer(build_vocab()), build_model()
    tokenize, model = _STAGES
    return encode(model, [tokenize(text) for text in docs], [ngram_counts(text) for text in docs])


def embed_batches(batches: list[list[str]]) -> list:
    """`embed_batch` over several batches in one call: the benchmark's measure of what the cores can do at
    all (each process its half of the batches, nothing shared, no scheduling on the way)."""
    return [embed_batch(docs) for docs in batches]


def batches(docs: list[tuple[int, str]], size: int) -> list[list[str]]:
    texts = [text for _, text in docs]
    return [texts[i:i + size] for i in range(0, len(texts), size)]


def same_vectors(got, expected, atol: float = 1e-5) -> bool:
    """Every batch's vectors equal the reference's (a worker's torch may sum in another order: a tolerance)."""
    import torch

    return len(got) == len(expected) and all(
        g.shape == e.shape and torch.allclose(g, e, atol=atol) for g, e in zip(got, expected))


def topic_agreement(vectors, topics: list[int]) -> float:
    """How often a document's nearest other document (cosine) has its topic."""
    sims = vectors @ vectors.T
    sims.fill_diagonal_(-2.0)
    nearest = sims.argmax(dim=1).tolist()
    return sum(topics[i] == topics[j] for i, j in enumerate(nearest)) / len(topics)


def race(g, inputs: list, workers: int) -> tuple:
    """`(Executor's outputs, Local's outputs, Executor's seconds, Local's seconds)` of one map of `inputs`
    each (Local warmed first: code sent, setup run, torch imported in the workers). One timing each:
    `soma bench map` measures properly."""
    import soma

    start = time.perf_counter()
    expected = list(soma.Executor().map(g, inputs))
    in_process = time.perf_counter() - start
    with soma.Local(workers=workers) as local:
        list(local.map(g, inputs[:2 * workers]))
        start = time.perf_counter()
        got = list(local.map(g, inputs))
        pooled = time.perf_counter() - start
    return expected, got, in_process, pooled


def main(count: int = 200, batch: int = 8, workers: int = 2) -> int:
    try:
        import torch
    except ImportError:
        print(NEEDS_TORCH, file=sys.stderr)
        return 2

    docs = make_documents(count)
    inputs = batches(docs, batch)
    g = graph()
    words = sum(len(text.split()) for _, text in docs)
    print(f"graph:   {g}")
    print(f"input:   {count} documents ({words:,} words, {TOPICS} topics) in {len(inputs)} batches of {batch}\n")

    expected, got, in_process, pooled = race(g, inputs, workers)
    if not same_vectors(got, expected):
        print("Local.map and Executor.map disagree", file=sys.stderr)
        return 1
    vectors = torch.cat(got)
    norms = vectors.norm(dim=1)
    if vectors.shape != (count, DIM) or not torch.allclose(norms, torch.ones(count), atol=1e-4):
        print(f"expected {count} unit vectors of {DIM}, got {tuple(vectors.shape)}", file=sys.stderr)
        return 1
    print(f"Executor.map (one process):     {count / in_process:7.0f} docs/s")
    print(f"Local.map    ({workers} workers):      {count / pooled:7.0f} docs/s   ({in_process / pooled:.2f}x; "
          f"one timing each: `soma bench map` measures it properly)")
    print(f"\nsame vectors from both: yes ({count} x {DIM}, unit length)")
    agreement = topic_agreement(vectors, [topic for topic, _ in docs])
    print(f"a document's nearest neighbour shares its topic: {agreement:.0%} of the time "
          f"(chance: {1 / TOPICS:.0%}), with random weights")
    return 0


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:4]]
    sys.exit(main(*args))
