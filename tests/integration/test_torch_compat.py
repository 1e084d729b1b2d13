"""A wrapped dataset stands in for its dataset (issue 30): a selection of torch.utils.data's own
DataLoader behaviours (after PyTorch's test/test_dataloader.py), each run over the dataset and over
``cache.wrap(dataset)``, asserting the same batches - containers and their types, dtypes, values -
and the same errors. Small datasets and few workers: each case is quick.

What a wrapped dataset does differently on purpose (README, "What a wrapped dataset does
differently") is not here: datasets that depend on the reading worker, on ``worker_init_fn`` or on
randomness.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import tempfile

import numpy as np
import pytest
import torch
from _workers import assert_same
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
    default_collate,
)

from shmcache import ShmDatasetCache

Batch = collections.namedtuple("Batch", ["data", "label", "tensor"])
Data = collections.namedtuple("Data", ["positive", "negative"])


class Counting(Dataset):
    """torch's CountingDataset, with a dict, a str and an array beside the int."""

    def __init__(self, n=20):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "x": torch.full((3,), float(i)), "name": f"item{i}", "a": np.arange(i, i + 2, dtype=np.int16)}


class NamedTuples(Dataset):
    """torch's NamedTupleDataset without its random tensor (a cache would freeze one draw)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return Batch(data=Data(positive=i, negative=-i), label=str(i), tensor=torch.arange(i, i + 2))


class ListIndexed(Dataset):
    """A dataset whose __getitem__ takes a list of indices (batch_size=None, a list sampler)."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        if isinstance(i, list):
            return [10 * j for j in i]
        return 10 * i


class WithGetitems(Dataset):
    """torch's __getitems__ contract: a list of samples, one per index."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.tensor([i, 2 * i]), i % 3

    def __getitems__(self, indices):
        return [self[i] for i in indices]


class Raises(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        if i == 7:
            raise KeyError(f"no sample {i}")
        return torch.tensor(i)


def _both(src, epochs=1, make=None, **loader_kw):
    """The batches of ``epochs`` epochs over ``src`` and over its wrapper, twice: the first
    epoch over the wrapper computes (misses), a second wrapper of the same cache hits.
    ``make(ds)``: more DataLoader arguments, made afresh for each run (a seeded sampler)."""

    def run(ds):
        loader = DataLoader(ds, **loader_kw, **(make(ds) if make else {}))
        return [list(loader) for _ in range(epochs)]

    want = run(src)
    with ShmDatasetCache(session="compat", size=16) as cache:
        got = run(cache.wrap(src))
        again = run(cache.wrap(src))  # warm: every batch from the cache
    assert_same(got, want)
    assert_same(again, want)
    return want


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"batch_size": 4},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": None},
        {"batch_size": 4, "collate_fn": lambda batch: batch},  # a custom collate_fn: the samples
        {"batch_size": 4, "collate_fn": default_collate},
    ],
    ids=["default", "batch4", "drop_last", "batch_none", "custom_collate", "default_collate"],
)
def test_batching(kw):
    _both(Counting(), **kw)


@pytest.mark.parametrize(
    "make",
    [
        lambda ds: {"shuffle": True, "batch_size": 4, "generator": torch.Generator().manual_seed(3)},
        lambda ds: {"sampler": SequentialSampler(ds), "batch_size": 5},
        lambda ds: {
            "sampler": RandomSampler(ds, replacement=True, num_samples=7, generator=torch.Generator().manual_seed(1)),
            "batch_size": 2,
        },
        lambda ds: {
            "sampler": SubsetRandomSampler([1, 4, 9, 16], generator=torch.Generator().manual_seed(2)),
            "batch_size": 3,
        },
        lambda ds: {
            "sampler": WeightedRandomSampler([0.1] * 10 + [1.0] * 10, 9, generator=torch.Generator().manual_seed(4)),
            "batch_size": 3,
        },
        lambda ds: {"batch_sampler": BatchSampler(SequentialSampler(ds), 6, drop_last=False)},
        lambda ds: {"batch_sampler": [[3, 1], [0, 19, 2]]},
    ],
    ids=["shuffle", "sequential", "replacement", "subset", "weighted", "batch_sampler", "list_batch_sampler"],
)
def test_samplers(make):
    _both(Counting(), make=make)


def test_batch_size_none_with_a_sampler_of_lists_gives_what_the_dataset_gives():
    want = _both(ListIndexed(), batch_size=None, sampler=[[0, 1], [2, 3], [9]])
    assert want == [[[0, 10], [20, 30], [90]]]


def test_getitems_datasets():
    _both(WithGetitems(), batch_size=5)
    _both(WithGetitems(), batch_size=5, collate_fn=lambda batch: batch)


@pytest.mark.parametrize("kw", [{"batch_size": 3}, {"batch_size": None}], ids=["batch3", "batch_none"])
def test_namedtuples(kw):
    batches = _both(NamedTuples(), **kw)[0]
    assert all(isinstance(b, Batch) and isinstance(b.data, Data) for b in batches)


def test_workers_and_persistent_workers():
    ctx = multiprocessing.get_context("fork")
    _both(Counting(), batch_size=4, num_workers=2, multiprocessing_context=ctx)
    _both(NamedTuples(), epochs=2, batch_size=3, num_workers=2, persistent_workers=True, multiprocessing_context=ctx)


def _namedtuples_as_they_are(batch):
    """A collate_fn that runs in the worker: the samples it decoded are this process's Batch."""
    assert all(type(s) is Batch and type(s.data) is Data for s in batch), [type(s) for s in batch]
    return batch


def test_namedtuples_decoded_in_a_spawned_worker_are_the_datasets_class():
    """A spawned worker never encoded a Batch itself: the wrapped dataset brings the classes it
    decodes by (NOTE [record format])."""
    src = NamedTuples()
    with ShmDatasetCache(session="compat", size=16) as cache:
        ds = cache.wrap(src)
        for i in range(len(ds)):
            ds[i]  # warm: the worker only decodes
        loader = DataLoader(
            ds,
            batch_size=4,
            num_workers=1,
            collate_fn=_namedtuples_as_they_are,
            multiprocessing_context=multiprocessing.get_context("spawn"),
        )
        assert_same([s for b in loader for s in b], [src[i] for i in range(len(src))])
        del loader


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pin_memory pins only where an accelerator is")
def test_pin_memory():
    batches = _both(Counting(), batch_size=4, pin_memory=True)
    assert all(b["x"].is_pinned() for b in batches[0])
    _both(
        NamedTuples(),
        batch_size=4,
        pin_memory=True,
        num_workers=2,
        multiprocessing_context=multiprocessing.get_context("fork"),
    )


def _first_error(loader):
    """How many batches ``loader`` yields before it raises, and what it raises (type, message);
    the iterator, its workers included, ends with this call."""
    n, raised = 0, (None, None)
    try:
        for _ in loader:
            n += 1
    except Exception as exc:  # noqa: BLE001 - what the test compares
        raised = type(exc), str(exc)
    gc.collect()  # the exception's traceback held the iterator in a cycle: its workers stop now
    return n, *raised


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_errors_raise_where_the_dataloader_reads_with_their_type(workers, tmp_path, monkeypatch):
    """(With workers, torch itself takes 5 s per loader to stop them after the error: slow.)"""
    kw = {"batch_size": 2, "num_workers": workers}
    if workers:
        kw["multiprocessing_context"] = multiprocessing.get_context("fork")
        # torch terminates the workers still sending a batch when the loader stops at the error,
        # and each leaves the temporary folder its tensors' descriptors went through (pymp-*,
        # multiprocessing's resource sharer): in the test's folder, which the forked workers inherit
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    src = Raises()
    want = _first_error(DataLoader(src, **kw))
    assert want[:2] == (3, KeyError)  # items 0..5, then the batch of 6 and 7
    with ShmDatasetCache(session="compat", size=16) as cache:
        got = _first_error(DataLoader(cache.wrap(src), **kw))
    assert got[:2] == want[:2] and "no sample 7" in got[2]
