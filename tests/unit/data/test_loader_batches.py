"""The batches of an unchanged ``DataLoader(ds, batch_size=B)`` over a cached dataset: gathered by
the vectorised path (NOTE [collated batch] in shmcache/data/collate.py) and equal - values, dtypes,
shapes, container types - to what plain default_collate makes of the source's samples, for every
sample structure; misses, custom collate functions and verify= keep the item-by-item path."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, default_collate

from shmcache import ShmDatasetCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _samples import GATHERED, KINDS, Samples, sample  # noqa: E402
from _workers import assert_same  # noqa: E402

ORDER = [3, 5, 3, 0, 39, 12, 7, 7, 21, 30, 1, 2, 8, 8, 8, 19]  # repeats, any order

# the namedtuple samples are pickled on purpose (they must take the item path): the cache warns
pytestmark = pytest.mark.filterwarnings("ignore:.*stored with pickle:UserWarning")


def _batches(ds, **kw):
    """Every batch of a DataLoader over ``ds`` in ORDER, or the type of the error it raised."""
    try:
        return list(DataLoader(ds, batch_size=5, sampler=ORDER, **kw))
    except (TypeError, RuntimeError) as exc:
        return type(exc)


class _ItemByItem(Exception):
    pass


def _forbid_item_path(store, monkeypatch):
    def refuse(*a, **k):
        raise _ItemByItem("the batch was looked up item by item")
    monkeypatch.setattr(store, "lookup_batch", refuse)


@pytest.mark.parametrize("kind", KINDS)
def test_default_dataloader_batches_equal_default_collate(kind, monkeypatch):
    src = Samples(kind)
    cache = ShmDatasetCache(session="loader", name=kind, size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):  # warm
        ds[i]
    want = _batches(src)
    if kind in GATHERED:
        _forbid_item_path(cache.store, monkeypatch)  # all cached: the vectorised path, or fail
    got = _batches(ds)
    if isinstance(want, type):
        assert got is want, f"the source's batches raise {want.__name__}, the cache's gave {got}"
    else:
        assert_same(got, want)
    cache.close()


@pytest.mark.parametrize("kind", ["numpy", "nested", "strings"])
def test_misses_in_a_batch_are_computed_stored_and_collated(kind):
    """A batch mixing cached and uncached items: computed and stored in the same call (item by
    item), equal to default_collate; the next pass is all hits, gathered."""
    src = Samples(kind)
    cache = ShmDatasetCache(session="loader", name=kind, size=16)
    ds = cache.wrap(src)
    for i in range(0, len(src), 2):
        ds[i]
    before = len(cache)
    assert_same(_batches(ds), _batches(src))
    assert len(cache) == before + len({i for i in ORDER if i % 2 and i not in (0, 20, 39)})
    st = cache.stats()
    assert_same(_batches(ds), _batches(src))
    assert cache.stats()["misses"] == st["misses"]
    assert cache.stats()["hits"] - st["hits"] == len(ORDER)
    cache.close()


def test_custom_collate_fn_gets_ordinary_samples(monkeypatch):
    src = Samples("dict")
    cache = ShmDatasetCache(session="loader", name="custom", size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    got = list(DataLoader(ds, batch_size=5, sampler=ORDER, collate_fn=lambda b: b))
    assert [type(b) for b in got] == [list] * 4
    assert_same([s for b in got for s in b], [src[i] for i in ORDER])
    # a wrapper around default_collate sees the samples too, and gets the same batches
    wrapped = list(DataLoader(ds, batch_size=5, sampler=ORDER, collate_fn=lambda b: default_collate(b)))
    assert_same(wrapped, _batches(src))
    # the user's collate_fn may mutate the samples it got: the cache is not touched
    for b in DataLoader(ds, batch_size=5, sampler=ORDER, collate_fn=lambda b: b):
        for s in b:
            s["x"].zero_()
    assert_same(ds[3], src[3])
    cache.close()


def test_explicit_default_collate_and_drop_last_and_batch_sampler(monkeypatch):
    src = Samples("numpy")
    cache = ShmDatasetCache(session="loader", name="explicit", size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    want = _batches(src, drop_last=True)
    _forbid_item_path(cache.store, monkeypatch)
    assert_same(_batches(ds, drop_last=True, collate_fn=default_collate), want)
    assert len(want) == 3
    sampler = BatchSampler(ORDER, batch_size=5, drop_last=False)
    assert_same(list(DataLoader(ds, batch_sampler=sampler)), list(DataLoader(src, batch_sampler=sampler)))
    cache.close()


def test_batches_are_private_and_writable():
    """A gathered batch is the caller's: writing into it changes neither the cache nor the next
    batch (recycled buffers of large batches included)."""
    src = Samples("numpy", n=64)
    cache = ShmDatasetCache(session="loader", name="private", size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    for x, y in DataLoader(ds, batch_size=8):
        x.fill_(7)
        y.fill_(-1)
    assert_same(list(DataLoader(ds, batch_size=8)), list(DataLoader(src, batch_size=8)))
    cache.close()


def test_large_batches_from_recycled_buffers_stay_valid():
    """Batches above the recycling threshold (4 MiB a field) that the caller keeps are never
    overwritten by later batches."""

    class Big(torch.utils.data.Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            return np.full((256, 1024), i, np.uint8), i

    cache = ShmDatasetCache(session="loader", name="big", size=64)
    ds = cache.wrap(Big())
    for i in range(48):
        ds[i]
    kept = list(DataLoader(ds, batch_size=16, sampler=list(range(48)) * 3))
    for n, (x, y) in enumerate(kept):
        assert x.shape == (16, 256, 1024)
        assert torch.equal(x[:, 0, 0].long(), y), f"batch {n} was overwritten"
        assert y.tolist() == list(range(16 * (n % 3), 16 * (n % 3) + 16))
    cache.close()


def test_verify_keeps_checking_every_sample(monkeypatch):
    """verify= recomputes sampled hits, so it needs the samples: the item-by-item path."""
    src = Samples("numpy")
    cache = ShmDatasetCache(session="loader", name="verify", size=16, verify=1.0)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    calls = []
    monkeypatch.setattr(ds, "_verify", lambda i, v: calls.append(i))
    assert_same(_batches(ds), _batches(src))
    assert sorted(calls) == sorted(ORDER)
    cache.close()


def test_direct_getitems_call_returns_samples():
    src = Samples("nested")
    cache = ShmDatasetCache(session="loader", name="direct", size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    assert_same(ds.__getitems__(ORDER), [sample("nested", i) for i in ORDER])
    cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_single_hits_equal_the_source_and_are_private(kind):
    """The inlined hit path (store.lookup) and the generated decoders give the source's samples,
    as writable private copies (copy=True) or read-only views (copy=False)."""
    src = Samples(kind)
    for copy in (True, False):
        cache = ShmDatasetCache(session="loader", name=f"{kind}-{int(copy)}", size=16, copy=copy)
        ds = cache.wrap(src)
        for _ in range(2):  # a miss (computed), then hits (the first one maps the layout)
            for i in (0, 7, 39, 7):
                got = ds[i]
                assert_same(got, src[i])
                assert_same(cache.get(i), src[i])
        arrays = [v for v in (got if isinstance(got, (tuple, list)) else [got]) if isinstance(v, np.ndarray)]
        for a in arrays:
            if copy and a.size:
                a[...] = 0
            elif kind in GATHERED:  # (pickled samples come out of pickle.loads: writable)
                assert not a.flags.writeable or not a.size
        assert_same(ds[7], src[7])
        cache.close()


def _sent(ds, keys):
    """What a DataLoader worker sends for a warm batch, as the main process receives it."""
    import pickle

    from shmcache.data.collate import _Keys

    return pickle.loads(pickle.dumps(_Keys(ds, np.asarray(keys, np.int64))))


def test_a_batch_sent_as_keys_is_gathered_where_it_is_unpickled():
    src = Samples("nested")
    cache = ShmDatasetCache(session="loader", name="sent", size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    want = default_collate([src[i] for i in ORDER])
    st = cache.stats()
    assert_same(_sent(ds, ORDER), want)
    assert cache.stats()["hits"] - st["hits"] == len(ORDER)
    # cleared between the worker's look and the main process's gather: read item by item, misses
    # computed and stored again
    cache.clear()
    assert_same(_sent(ds, ORDER), want)
    assert len(cache) == len(set(ORDER))
    cache.close()


def test_a_copy_of_the_dataset_serves_its_batches():
    """The token names every copy of the dataset in this process (a deepcopy outliving the
    original included); a process holding none says so."""
    import copy
    import gc

    from shmcache.data.collate import _gather_sent
    from shmcache.errors import InvalidArgument

    src = Samples("numpy")
    cache = ShmDatasetCache(session="loader", name="copies", size=16)
    ds = cache.wrap(src)
    for i in range(len(src)):
        ds[i]
    twin = copy.deepcopy(ds)
    token = ds.token
    del ds
    gc.collect()
    assert_same(_sent(twin, ORDER), default_collate([src[i] for i in ORDER]))
    del twin
    gc.collect()
    with pytest.raises(InvalidArgument, match=f"token {token}.*keep the dataset alive"):
        _gather_sent(token, np.arange(3, dtype=np.int64).tobytes())
    cache.close()
