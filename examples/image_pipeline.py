"""An image pipeline of the kind soma is for: JPEG decoding and numpy augmentation, then a small torch CNN, per image.

    python examples/image_pipeline.py [IMAGES] [WORKERS]        (defaults: 64 2)

    graph:  decode >> augment >> classify

* decode: PIL decodes one JPEG (made at start with Pillow, 640x480, nothing is
  downloaded) into an HxWx3 uint8 numpy array.
* augment: in numpy, a 224x224 crop at a position drawn from the image's own
  seed, a horizontal flip for half of them, then float32 CHW normalised with
  ImageNet's mean and deviation.
* classify: a small CNN with random weights (seeded: every process holds the
  same), 10 logits per image.

`Local.map` runs each image whole on one worker (the arrays between the nodes
never leave it). The same work as plain functions (`decode_augment`, `classify`,
`process`) is what `benchmarks/map.py` races against
`torch.utils.data.DataLoader(num_workers=2)` (decode and augment in its workers,
the CNN in the caller, as one writes it) and `ProcessPoolExecutor.map`.
Pillow is an extra of the examples and benchmarks, not of soma: `pip install -e '.[bench]'`.
"""

from __future__ import annotations

import io
import sys
import threading

from soma import Done, Graph, Node

NEEDS = ("examples/image_pipeline.py needs Pillow and torch: pip install torch==2.13.0 numpy && pip install -e '.[bench]' "
         "(soma's bench extra is Pillow)")
SIZE = (640, 480)  # width, height of the JPEGs
CROP = 224
SEED = 1234
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def make_jpegs(count: int, seed: int = SEED) -> list[bytes]:
    """`count` JPEGs (quality 90) of smooth random colour fields with a few shapes: compressible like photos."""
    import numpy
    from PIL import Image, ImageDraw

    rng = numpy.random.default_rng(seed)
    out = []
    for _ in range(count):
        w, h = SIZE
        small = rng.integers(0, 256, (h // 32, w // 32, 3), dtype=numpy.uint8)
        image = Image.fromarray(small).resize(SIZE, Image.BILINEAR)
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            x, y = int(rng.integers(0, w - 80)), int(rng.integers(0, h - 80))
            draw.ellipse((x, y, x + int(rng.integers(20, 80)), y + int(rng.integers(20, 80))),
                         fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


# -- the three stages, as plain functions (the nodes and the peers use the same) -----------------------

def decode(jpeg: bytes):
    import numpy
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as image:
        return numpy.asarray(image.convert("RGB"))


def augment(pixels, seed: int):
    """A crop and maybe a flip drawn from `seed`, then float32 CHW, normalised."""
    import numpy

    rng = numpy.random.default_rng(seed)
    h, w, _ = pixels.shape
    top, left = int(rng.integers(0, h - CROP + 1)), int(rng.integers(0, w - CROP + 1))
    crop = pixels[top:top + CROP, left:left + CROP]
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    scaled = crop.astype(numpy.float32) * numpy.float32(1 / 255)
    scaled -= numpy.array(MEAN, numpy.float32)
    scaled /= numpy.array(STD, numpy.float32)
    return numpy.ascontiguousarray(scaled.transpose(2, 0, 1))


def build_model():
    """A small CNN with seeded random weights (drawn from its own generator: threads build it at once)."""
    import torch
    from torch import nn

    model = nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=2, padding=2), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    ).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for param in model.parameters():
            bound = 1 / max(1, param[0].numel()) ** 0.5
            param.copy_((torch.rand(param.shape, generator=gen) * 2 - 1) * bound)
    return model


def classify(model, chw):
    """10 logits for one CHW float32 image (a numpy array or a tensor)."""
    import torch

    x = torch.as_tensor(chw).unsqueeze(0)
    with torch.no_grad():
        return model(x)[0]


# -- as soma nodes ----------------------------------------------------------------------------------

class Decode(Node):
    def forward(self, item, ctx):
        index, jpeg = item
        return Done((index, decode(jpeg)))


class Augment(Node):
    def forward(self, item, ctx):
        index, pixels = item
        return Done(augment(pixels, SEED + index))


class Classify(Node):
    def setup(self, ctx):
        import torch

        self.model = build_model()
        self.torch = torch

    def forward(self, chw, ctx):
        return Done(classify(self.model, chw))


def graph() -> Graph:
    return Graph.somatize(Decode() >> Augment() >> Classify())


def inputs(jpegs: list[bytes]) -> list[tuple[int, bytes]]:
    return list(enumerate(jpegs))


# -- the same work for the peers ---------------------------------------------------------------------

_MODEL = None
_MODEL_LOCK = threading.Lock()


def decode_augment(item):
    """What a DataLoader's dataset does per item (in its workers)."""
    index, jpeg = item
    return augment(decode(jpeg), SEED + index)


def process(item):
    """The whole pipeline for one image in this process (ProcessPoolExecutor.map), torch at one thread."""
    global _MODEL
    with _MODEL_LOCK:
        if _MODEL is None:
            import torch

            torch.set_num_threads(1)
            _MODEL = build_model()
    return classify(_MODEL, decode_augment(item))


class Images:
    """A map-style dataset of (index, jpeg) items for torch's DataLoader: an item is the augmented CHW array."""

    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return decode_augment(self.items[i])


def data_loader(items, workers: int, **options):
    import torch.utils.data

    return torch.utils.data.DataLoader(Images(items), batch_size=None, num_workers=workers, **options)


def same_logits(got, expected, atol: float = 1e-4) -> bool:
    import torch

    return len(got) == len(expected) and all(torch.allclose(g, e, atol=atol) for g, e in zip(got, expected))


def main(count: int = 64, workers: int = 2) -> int:
    try:
        import PIL  # noqa: F401
        import torch
    except ImportError:
        print(NEEDS, file=sys.stderr)
        return 2
    from text_pipeline import race  # (beside this file)

    torch.set_num_threads(1)
    jpegs = make_jpegs(count)
    items = inputs(jpegs)
    g = graph()
    print(f"graph:   {g}")
    print(f"input:   {count} JPEGs of {SIZE[0]}x{SIZE[1]} ({sum(map(len, jpegs)) / count / 1024:.0f} KiB each)\n")
    expected, got, in_process, pooled = race(g, items, workers)
    if not same_logits(got, expected):
        print("Local.map and Executor.map disagree", file=sys.stderr)
        return 1
    print(f"Executor.map (one process):  {count / in_process:7.1f} images/s")
    print(f"Local.map    ({workers} workers):   {count / pooled:7.1f} images/s   ({in_process / pooled:.2f}x; "
          f"one timing each: `soma bench map` measures it against DataLoader and ProcessPoolExecutor)")
    print(f"\nsame logits from both: yes ({count} x 10)")
    return 0


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:3]]
    sys.exit(main(*args))
