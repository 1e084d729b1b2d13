"""The workloads: deterministic, seeded map-style datasets that every system reads the same way.

Each item is ``(image, label)``: ``image`` a ``uint8`` HWC numpy array, ``label`` an ``int``. Items
are a pure function of ``(seed, index)``, so a reader process can rebuild the source from its small
pickle and get the same bytes as the process that filled a cache.

- ``cifar``: 32×32×3 random pixels (3 KiB), 50,000 items (``--quick``: 5,000).
- ``imagenet``: 224×224×3 random pixels (147 KiB), 2,000 items (``--quick``: 300).
- ``photos``: crops of two real JPEG photographs (``examples/data``), decoded with PIL, cropped at a
  seeded random box and resized to 224×224 on every access: the decode-heavy case a cache removes.
  2,000 items (``--quick``: 300).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["Workload", "SyntheticImages", "PhotoCrops", "WORKLOADS", "make_workload"]

DATA_DIR = Path(__file__).resolve().parents[2] / "examples" / "data"
PHOTOS = ("china.jpg", "flower.jpg")
LABEL_BYTES = 8  # an int label counts as one int64 in a collated batch


class SyntheticImages:
    """Random ``uint8`` images of one shape; item i is generated from ``(seed, i)`` on every access."""

    def __init__(self, n_items: int, shape: tuple[int, int, int], seed: int = 0, n_classes: int = 10):
        self.n_items, self.shape, self.seed, self.n_classes = n_items, tuple(shape), seed, n_classes

    def __len__(self) -> int:
        return self.n_items

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if not 0 <= i < self.n_items:
            raise IndexError(f"index {i} out of range for {self.n_items} items")
        rng = np.random.default_rng((self.seed, int(i)))
        return rng.integers(0, 256, self.shape, dtype=np.uint8), int(rng.integers(self.n_classes))

    def __repr__(self) -> str:
        return f"SyntheticImages(n_items={self.n_items}, shape={self.shape}, seed={self.seed})"


class PhotoCrops:
    """Seeded random crops of real photos, JPEG-decoded, cropped and resized on every access."""

    def __init__(self, n_items: int, size: int = 224, seed: int = 0, data_dir: Path = DATA_DIR):
        self.n_items, self.size, self.seed = n_items, size, seed
        self.jpegs = [(data_dir / name).read_bytes() for name in PHOTOS]
        self.shape = (size, size, 3)

    def __len__(self) -> int:
        return self.n_items

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        from PIL import Image  # imported here: only this workload needs Pillow

        if not 0 <= i < self.n_items:
            raise IndexError(f"index {i} out of range for {self.n_items} items")
        rng = np.random.default_rng((self.seed, int(i)))
        label = int(rng.integers(len(self.jpegs)))
        with Image.open(io.BytesIO(self.jpegs[label])) as im:
            im = im.convert("RGB")
            box = self._crop_box(rng, *im.size)
            im = im.resize((self.size, self.size), Image.BILINEAR, box=box)
        return np.asarray(im, dtype=np.uint8).copy(), label

    @staticmethod
    def _crop_box(rng: np.random.Generator, w: int, h: int) -> tuple[int, int, int, int]:
        side = int(rng.integers(min(w, h) // 3, min(w, h) + 1))
        x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        return (x, y, x + side, y + side)

    def __repr__(self) -> str:
        return f"PhotoCrops(n_items={self.n_items}, size={self.size}, seed={self.seed})"


@dataclass(frozen=True)
class Workload:
    name: str
    n_items: int
    shape: tuple[int, int, int]
    seed: int
    description: str

    @property
    def image_bytes(self) -> int:
        return int(np.prod(self.shape))

    @property
    def item_bytes(self) -> int:
        """Payload bytes of one item: the image plus its label as an int64."""
        return self.image_bytes + LABEL_BYTES

    @property
    def payload_bytes(self) -> int:
        return self.item_bytes * self.n_items

    def source(self):
        if self.name == "photos":
            return PhotoCrops(self.n_items, self.shape[0], self.seed)
        return SyntheticImages(self.n_items, self.shape, self.seed)


# name: (items, items with --quick, shape, description)
WORKLOADS = {
    "cifar": (50_000, 5_000, (32, 32, 3), "random uint8 32×32×3 + int label"),
    "imagenet": (2_000, 300, (224, 224, 3), "random uint8 224×224×3 + int label"),
    "photos": (2_000, 300, (224, 224, 3), "JPEG decode + seeded crop + resize to 224×224 (PIL)"),
}


def make_workload(name: str, n_items: int | None = None, quick: bool = False, seed: int = 0) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    full, small, shape, description = WORKLOADS[name]
    return Workload(name, n_items or (small if quick else full), shape, seed, description)
