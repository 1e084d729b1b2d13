"""Toy datasets of many sample structures, for checking the DataLoader's batches against plain
``default_collate``: importable by DataLoader workers under fork and spawn (found through
``sys.path``, which spawn children inherit). Not a test module."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
import torch
from torch.utils.data import Dataset

Point = namedtuple("Point", ["x", "y"])


def sample(kind: str, i: int):
    """Sample ``i`` of structure ``kind``: deterministic, different for every ``i``."""
    rng = np.random.default_rng(i)
    img = rng.integers(0, 256, (4, 3), dtype=np.uint8)
    if kind == "numpy":
        return img, i
    if kind == "tensor":
        return torch.from_numpy(rng.standard_normal((3, 2)).astype(np.float32))
    if kind == "scalars":
        return i, i / 3, i % 2 == 0, np.float32(i / 7), np.int16(-i)
    if kind == "strings":
        return img, f"item-{i:03d}", bytes([i % 256]) * 3
    if kind == "strings_var":  # str fields of varying length: one layout per length
        return img, "x" * (i % 4)
    if kind == "dict":
        return {"x": torch.from_numpy(img), "y": i, "name": f"n{i:02d}"}
    if kind == "nested":
        pair = np.arange(i % 3 + 2, dtype=np.int16)[:2]
        return {"a": (torch.full((2,), i, dtype=torch.bfloat16), [i, f"s{i:02d}", pair]),
                "b": {"c": img.astype(np.float64), "d": (f"t{i:02d}",)}}
    if kind == "list":
        return [img, float(i), torch.tensor(i, dtype=torch.int32)]
    if kind == "str_only":
        return f"only-{i:02d}"
    if kind == "int_only":
        return i * 1000
    if kind == "empty":
        return np.zeros((0, 3), np.float32), (), {}
    if kind == "namedtuple":
        return Point(img, i)
    if kind == "none":
        return img, None
    if kind == "ragged":
        return np.arange(i % 3 + 1)
    raise ValueError(kind)


KINDS = ["numpy", "tensor", "scalars", "strings", "strings_var", "dict", "nested", "list", "str_only", "int_only",
         "empty", "namedtuple", "none", "ragged"]
# structures default_collate turns into a stacked batch the vectorised path reproduces
GATHERED = ["numpy", "tensor", "scalars", "strings", "dict", "nested", "list", "str_only",
            "int_only", "empty"]


class Samples(Dataset):
    def __init__(self, kind: str, n: int = 40):
        self.kind, self.n = kind, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return sample(self.kind, int(i))
