"""pin_memory=True over a cached dataset: warm batches sent by workers as keys are gathered in the
DataLoader's pin-memory thread (NOTE [collated batch] in shmcache/data/collate.py), then pinned.

Skipped without CUDA (capability probe). On a GPU machine: ``pytest tests/gpu -m gpu -q``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from shmcache import ShmDatasetCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from _samples import Samples  # noqa: E402
from _workers import assert_same  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (capability probe)"),
]

ORDER = [3, 5, 3, 0, 39, 12, 7, 7, 21, 30, 1, 2, 8, 8, 8, 19, 25, 26]


@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_equal_default_collate(workers):
    src = Samples("dict")
    cache = ShmDatasetCache(session="loader", size=16)
    ds = cache.wrap(src)
    for i in range(0, len(src), 2):
        ds[i]
    want = list(DataLoader(src, batch_size=4, sampler=ORDER))
    loader = DataLoader(ds, batch_size=4, sampler=ORDER, num_workers=workers, pin_memory=True,
                        persistent_workers=workers > 0)
    for _ in range(2):  # half warm, then warm
        got = list(loader)
        assert all(b["x"].is_pinned() and b["y"].is_pinned() for b in got)
        assert_same([{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in b.items()} for b in got], want)
    del loader
    cache.close()
