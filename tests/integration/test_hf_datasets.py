"""A client nobody here wrote (issue 31): Hugging Face ``datasets`` tables read through a DataLoader
with and without the cache - every value, container and dtype the same, in the python, numpy and
torch formats, cold and warm, with 0 and 2 workers; and the python format's rows stored at about
their numbers' own size (lists of numbers, NOTE [record format])."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

datasets = pytest.importorskip("datasets", reason="Hugging Face datasets: pip install '.[test]' installs it")

from shmcache import ShmDatasetCache  # noqa: E402

ROWS = 96


@pytest.fixture(scope="module")
def table():
    rng = np.random.default_rng(3)
    return datasets.Dataset.from_dict({
        "label": rng.integers(0, 10, ROWS).tolist(),
        "img": rng.integers(0, 256, (ROWS, 32, 32, 3), dtype=np.uint8).tolist(),
        "text": [f"row {i}" for i in range(ROWS)],
    })


def _same(a, b) -> bool:
    """Equal values of the same types all the way down (a tensor's dtype and shape too)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return a == b


def _samples(batch: list) -> list:
    """The python format's batches as their samples: default_collate would turn a 32x32x3 list of
    ints into 3,072 tensors per batch, each its own file descriptor across a worker's queue (torch
    runs out of them, with or without the cache)."""
    return batch


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", ["python", "numpy", "torch"])
def test_a_wrapped_hf_dataset_gives_the_same_batches_cold_and_warm(table, fmt, workers):
    hf = table if fmt == "python" else table.with_format(fmt)
    collate = _samples if fmt == "python" else None
    loader = lambda ds: DataLoader(ds, batch_size=16, num_workers=workers, collate_fn=collate)  # noqa: E731
    want = list(loader(hf))
    cache = ShmDatasetCache(session="hf", name=f"{fmt}-{workers}", size=64)
    try:
        ds = cache.wrap(hf)
        assert _same(ds[5], hf[5])  # one sample, as the dataset gives it
        for epoch in ("cold", "warm"):
            got = list(loader(ds))
            assert len(got) == len(want)
            for g, w in zip(got, want):
                assert _same(g, w), (fmt, workers, epoch)
        st = cache.stats()
        assert st["items_mem"] == ROWS
        assert st["computed"] <= ROWS + 4  # each row once, and wrap()'s probes
        if fmt == "python":  # lists of pixel ints at about their own size, not a node per number
            assert st["bytes_mem"] / ROWS <= 1.5 * (32 * 32 * 3 + 64)
    finally:
        cache.store.destroy()
        cache.close()
