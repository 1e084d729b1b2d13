"""The wrapped datasets: ``CachedDataset`` (map-style) and ``CachedIterableDataset``, what
``ShmDatasetCache.wrap`` returns. Items come from the cache, computed once by any process; a
DataLoader batch of a CachedDataset is gathered already collated (shmcache.data.collate).
"""

from __future__ import annotations

import itertools
import os
import random
import secrets
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from ..base import settings
from ..cache import codec
from ..cache.store import MISSING, CacheStore
from ..errors import CacheMismatch, EncodeError, InvalidArgument, ItemNotCached
from .batches import as_int64, integer_array, plain_ints
from .collate import _Collated, collates_by_default, gather_collated, register_live

if TYPE_CHECKING:
    from .dataset import ShmDatasetCache

__all__ = ["CachedDataset", "CachedIterableDataset"]

_VERIFY_RNG = random.Random()  # its own: verify= must not shift the user's seeded random streams


def same_sample(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two samples (or their encodings), through the codec."""
    ea = a if isinstance(a, codec.Encoded) else codec.encode(a)
    eb = b if isinstance(b, codec.Encoded) else codec.encode(b)
    if ea.layout != eb.layout or ea.scalars != eb.scalars:
        return False
    return all(memoryview(x).cast("B") == memoryview(y).cast("B")
               for (_, x), (_, y) in zip(ea.pieces, eb.pieces))


class NoSource:
    """What ``wrap(None)`` wraps: a dataset of a known length whose items are only in the cache."""

    def __init__(self, session: str, name: str, length: int):
        self.session, self.name, self.length = session, name, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        raise ItemNotCached(
            f"item {i!r} is not in cache {self.session}/{self.name}, and the cache has no source "
            f"(wrap(None)) to compute it from; import the whole snapshot into it (if the import said "
            f"items did not fit, give the cache a larger size= or spilling=True), or wrap the dataset "
            f"itself so that missing items are computed")


def compute_item(dataset, transform, index):
    sample = dataset[index]
    return transform(sample) if transform is not None else sample


class CachedDataset(Dataset):
    """A map-style dataset whose items come from the cache (computed once, by any process)."""

    def __init__(self, cache: ShmDatasetCache, dataset: Any, transform: Callable | None):
        self.cache = cache
        self.dataset = dataset
        self.transform = transform
        self._len = len(dataset)
        # names this dataset to the main process when a worker sends a batch as its keys (NOTE
        # [collated batch]); copies pickled to workers keep it
        self._token = secrets.token_hex(8)
        register_live(self)

    def __len__(self) -> int:
        return self._len

    def _index(self, i: Any) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            if isinstance(i, torch.Tensor) and i.numel() == 1 and not (
                    i.dtype == torch.bool or i.is_floating_point() or i.is_complex()):
                i = int(i)
            elif isinstance(i, np.ndarray) and i.ndim == 0 and i.dtype.kind in "iu":  # as cache.get takes it
                i = int(i)
            else:
                raise TypeError(f"dataset indices must be integers, not {type(i).__name__}")
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for a dataset of {self._len} items")
        return i

    def _indices(self, indices: Any) -> np.ndarray:
        """A batch of indices as int64, negatives wrapped and bounds checked in one numpy pass
        (the batch path must not pay a Python call per index)."""
        if type(indices) is list:  # a sampler's list of ints: fromiter is 3x faster than asarray
            arr = plain_ints(indices)
        else:
            arr = integer_array(indices, "dataset indices", TypeError)
        if arr is None:  # a list: fine if numpy makes it an integer array, else one by one
            arr = np.asarray(indices)
            if arr.dtype.kind not in "iu" or arr.ndim != 1:
                return np.fromiter((self._index(i) for i in indices), np.int64)
        arr = as_int64(arr, lambda i: IndexError(f"index {i} out of range for a dataset of {self._len} items"))
        if not arr.size or (arr.min() >= 0 and arr.max() < self._len):  # the common case: 2 reductions
            return arr
        arr = np.where(arr < 0, arr + self._len, arr)
        bad = (arr < 0) | (arr >= self._len)
        if bad.any():
            raise IndexError(f"index {int(np.asarray(indices)[bad][0])} out of range for a dataset "
                             f"of {self._len} items")
        return arr

    def _compute(self, i: int) -> Any:
        return compute_item(self.dataset, self.transform, int(i))

    def _store_computed(self, store: CacheStore, i: int, value: Any) -> None:
        try:
            self.cache._put(store, i, value)
        except EncodeError as exc:
            raise EncodeError(f"sample {i} of {type(self.dataset).__name__}: {exc}") from None

    def __getitem__(self, i):
        if type(i) is not int or not 0 <= i < self._len:  # a plain index needs no more checks
            if isinstance(i, list) or (isinstance(i, np.ndarray) and i.ndim) or (
                    isinstance(i, torch.Tensor) and i.dim() == 1):
                # DataLoader(ds, sampler=BatchSampler(...), batch_size=None): a whole batch per
                # call, collated by the vectorised path (the DataLoader then does no collation)
                return self.get_batch(i)
            i = self._index(i)
        cache = self.cache
        store = cache._store if cache._store is not None else cache._ensure_open()
        value = store.lookup(i, cache.copy)
        if value is MISSING:
            value = self._compute(i)
            self._store_computed(store, i, value)
        elif cache.verify and _VERIFY_RNG.random() < cache.verify:
            self._verify(i, value)
        return value

    def _verify(self, i: int, cached: Any) -> None:
        if not same_sample(cached, self._compute(i)):
            raise CacheMismatch(
                f"sample {i} of {type(self.dataset).__name__} differs from its cached copy in "
                f"{self.cache.session}/{self.cache.name}: the dataset changed since it was cached, "
                f"or it is not deterministic; drop the stale cache (cache.clear()), and keep random "
                f"augmentation outside the cache"
            )

    def __getitems__(self, indices: Sequence) -> list:
        """The DataLoader's batch hook: the batch gathered by the vectorised path when the
        DataLoader collates with default_collate (NOTE [collated batch]); else the samples from
        one batch lookup. Misses are computed and stored."""
        idx = self._indices(indices)
        cache = self.cache
        store = cache._ensure_open()
        if not cache.verify and collates_by_default(sys._getframe(1)):
            batch = gather_collated(store, idx, self if get_worker_info() is not None else None)
            if batch is not None:
                return [_Collated(batch)] * len(idx)
        return self._samples(idx)

    def _samples(self, keys: np.ndarray) -> list:
        """The samples of ``keys`` from one batch lookup (verified if asked); misses computed and stored."""
        cache = self.cache
        store = cache._ensure_open()
        idx = keys.tolist()
        values, missing = store.lookup_batch(idx, cache.copy)
        if cache.verify:
            hits = set(range(len(idx))) - set(missing)
            for j in hits:
                if _VERIFY_RNG.random() < cache.verify:
                    self._verify(idx[j], values[j])
        for j in missing:
            values[j] = self._compute(idx[j])
            self._store_computed(store, idx[j], values[j])
        return values

    def get_batch(self, indices: Sequence, fn: Callable | None = None, out: Any = None) -> Any:
        """A collated batch (the vectorised path), misses computed from the dataset (or ``fn``).

        Same signature as ``ShmDatasetCache.get_batch``, so a wrapped dataset can feed
        ``PrefetchRing.from_cache(ds, key_batches)`` directly.
        """
        return self.cache.get_batch(self._indices(indices), fn=fn or self._compute, out=out)

    def __getstate__(self) -> dict:
        return self.__dict__.copy()  # the cache pickles by name (ShmDatasetCache.__getstate__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        register_live(self)  # a worker's copy, or a copy made in this process: either serves the token


class CachedIterableDataset(IterableDataset):
    """An iterable dataset: the first full pass records, later passes replay from the cache.

    Each stream (rank x DataLoader worker) records its own sequence under its own keys, with a
    completion marker written only after a full pass; a pass that was cut short, or finds an item
    missing, reads the source again and fills the gaps.

    DataLoader workers: each worker gets its own copy of the dataset and records what *its* copy
    yields, under its own keys (``RANK.<worker id>of<num_workers>``). An unsharded stream is thus
    read, yielded and stored once per worker (what PyTorch does with any IterableDataset), so
    shard it in the source's ``__iter__`` with ``torch.utils.data.get_worker_info()`` (for example
    ``itertools.islice(items, info.id, None, info.num_workers)``); a different ``num_workers`` (or
    world size) records anew.
    """

    def __init__(self, cache: ShmDatasetCache, dataset: Iterable, transform: Callable | None,
                 one_shot: bool = False):
        self.cache = cache
        self.dataset = dataset
        self.transform = transform
        self._one_shot = one_shot  # a plain iterator: one pass of the source, ever
        self._pending: tuple[int, list, Any] | None = None  # pid, items wrap() read, their iterator

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pending"] = None  # the items wrap() read belong to this process's first pass
        return state

    def _source(self):
        """The source for a recording pass: the items wrap() read, then the rest of their
        iterator (first pass in this process), else a fresh iterator of the dataset."""
        pending, self._pending = self._pending, None
        # not in a DataLoader worker, even a forked one that inherited it: a worker opens its own
        # iterator (a source that shards by get_worker_info() must see the worker)
        if pending is not None and pending[0] == os.getpid() and get_worker_info() is None:
            return itertools.chain(pending[1], pending[2])
        if self._one_shot:
            if getattr(self, "_consumed", False):
                raise InvalidArgument(
                    f"the one-shot iterator ({type(self.dataset).__name__}) wrapped as "
                    f"{self.cache.session}/{self.cache.name} was read once already, and the cache "
                    f"does not hold all of it (the first pass stopped early, or the cache was "
                    f"full), so it cannot be replayed; wrap a re-iterable dataset (an "
                    f"IterableDataset or a container), or finish the first pass")
            self._consumed = True
        return iter(self.dataset)

    def _stream(self) -> str:
        info = get_worker_info()
        worker = f"{info.id}of{info.num_workers}" if info is not None else "main"
        return f"{settings.get(settings.ENV_RANK, '0')}.{worker}"

    def __iter__(self):
        store = self.cache._ensure_open()
        stream = self._stream()
        marker = f"__stream__:{stream}"
        total = store.lookup(marker, count=False)
        if total is not MISSING:
            self._pending = None
            for i in range(total):
                value = store.lookup(f"{stream}:{i}", self.cache.copy)
                if value is MISSING:
                    yield from self._record(store, stream, marker, skip=i)
                    return
                yield value
            return
        yield from self._record(store, stream, marker, skip=0)

    def _record(self, store: CacheStore, stream: str, marker: str, skip: int):
        count = 0
        for i, sample in enumerate(self._source()):
            count = i + 1
            if i < skip:
                continue  # already yielded from the cache in this pass
            value = self.transform(sample) if self.transform is not None else sample
            self.cache._put(store, f"{stream}:{i}", value)
            yield value
        store.put(marker, count)  # only after a full pass

