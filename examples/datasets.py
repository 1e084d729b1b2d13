"""Two small real datasets for the examples, tests and benchmarks (data in examples/data/).

* :class:`PhotoCrops` - decode-heavy: every item decodes a JPEG, crops a seeded window and resizes
  it, the per-sample work a cache removes. Deterministic: item ``i`` is always the same image.
* :class:`Digits` - 1,797 real 8x8 handwritten digits with labels, for training end to end.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

DATA = Path(__file__).resolve().parent / "data"
PHOTOS = ("china.jpg", "flower.jpg")


class PhotoCrops(Dataset):
    """``n`` crops of the two photos as uint8 HxWx3 arrays of ``size`` pixels, label = photo index."""

    def __init__(self, n: int = 2000, size: int = 64):
        from PIL import Image  # only the decode-heavy example needs Pillow

        self._image = Image
        self.n, self.size = n, size
        self.jpegs = [(DATA / name).read_bytes() for name in PHOTOS]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        rng = np.random.default_rng(i)
        label = i % len(self.jpegs)
        img = self._image.open(io.BytesIO(self.jpegs[label]))
        img = img.convert("RGB")  # the decode: every access, as a real pipeline would
        w, h = img.size
        side = int(rng.integers(min(w, h) // 3, min(w, h)))
        x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        crop = img.crop((x, y, x + side, y + side)).resize((self.size, self.size), self._image.BILINEAR)
        return np.array(crop, dtype=np.uint8), label  # a writable array (np.asarray of PIL: read-only)


class Digits(Dataset):
    """The handwritten digits: ``(float32 tensor 1x8x8 scaled to [0, 1], int label)``."""

    def __init__(self):
        with gzip.open(DATA / "digits.csv.gz", "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.float32)
        self.x = torch.from_numpy(table[:, :64].reshape(-1, 1, 8, 8) / 16.0)
        self.y = table[:, 64].astype(np.int64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])
