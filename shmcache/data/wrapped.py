"""The wrapped map-style dataset: ``CachedDataset``, what ``ShmDatasetCache.wrap`` returns for
one (an iterable's is ``data.stream``). Items come from the cache, computed once by any process;
a DataLoader batch is gathered already collated (shmcache.data.collate).
"""

from __future__ import annotations

import pickle
import random
import secrets
import sys
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from ..cache import codec
from ..cache.claims import Served
from ..cache.store import MISSING
from ..cache.store_protocol import Store
from ..errors import CacheMismatch, EncodeError, InvalidArgument, ItemNotCached
from .batches import as_int64, integer_array, plain_ints
from .collate import Collated, collates_by_default, gather_collated, register_live

__all__ = ["CachedDataset", "DatasetCache"]


class DatasetCache(Protocol):
    """What a wrapped dataset uses of the cache that wrapped it (a ShmDatasetCache): declared
    here, so this module does not import the one that imports it."""

    session: str
    name: str | None
    copy: bool
    verify: float
    opened: Store | None  # the store once open; None until ``open_store`` opens it

    def open_store(self) -> Store: ...

    def put_computed(self, store: Store, key: Any, value: Any, enc: codec.Encoded | None = None,
                     explicit: bool = False) -> bool: ...

    def put_encoded(self, store: Store, items: list) -> None: ...

    def encode(self, key: Any, value: Any) -> codec.Encoded: ...

    def encode_many(self, pairs: list) -> tuple[list, tuple | None]: ...

    def get_batch(self, keys: Sequence, fn: Callable | None = None, out: Any = None, *,
                  fn_many: Callable | None = None) -> Any: ...

    def say_once(self, kind: str, mark: str, text: str) -> None: ...

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


def _own_fingerprint(dataset: Any) -> str | None:
    """The digests a dataset keeps of itself and moves when it changes in place (Hugging Face's
    ``Dataset._fingerprint``: ``set_transform``, ``set_format`` and the like move it), its own and
    those of the datasets it reads (a Subset's ``dataset``, a ConcatDataset's ``datasets``: a
    random_split of a table changes with the table), or None when none keeps one."""
    found: list[str] = []
    _fingerprints(dataset, found, _FP_DEPTH, [_FP_MANY])
    return "|".join(found) if found else None


# the levels of inner datasets looked at, and the most datasets looked at in all: each epoch's
# len() asks until a change is said, and a ConcatDataset of thousands of shards is no reason to
# walk them all
_FP_DEPTH, _FP_MANY = 3, 64


def _fingerprints(dataset: Any, found: list, depth: int, budget: list) -> None:
    if budget[0] <= 0:
        return
    budget[0] -= 1
    try:
        fp = getattr(dataset, "_fingerprint", None)
        inner = getattr(dataset, "dataset", None) if depth else None
        many = getattr(dataset, "datasets", None) if depth else None
    except Exception:  # noqa: BLE001 - asked for a warning only (a __getattr__ raising KeyError): none
        return
    if isinstance(fp, str):
        found.append(fp)
    if not depth:
        return
    if isinstance(many, dict):  # (StackDataset's of named datasets)
        many = list(many.values())
    inners = [inner] if inner is not None else []
    if isinstance(many, (list, tuple)):
        inners += list(many[:_FP_MANY])
    for d in inners:
        if d is not dataset and not isinstance(d, (str, bytes, int, float)):
            _fingerprints(d, found, depth - 1, budget)


def own_getitems(dataset: Any) -> Callable | None:
    """The dataset's own ``__getitems__`` (its batch hook), or None: also where asking raises
    something else than AttributeError (a ``__getattr__`` that serves columns and raises KeyError
    for any other name) - it then reads one index at a time, as it did."""
    try:
        return getattr(dataset, "__getitems__", None)
    except Exception:  # noqa: BLE001 - no hook to be found
        return None


def compute_item(dataset, transform, index):
    sample = dataset[index]
    return transform(sample) if transform is not None else sample


def compute_sample(dataset, transform, index: int):
    """Sample ``index`` as the cache keeps it: read as torch's DataLoader reads it, through the
    dataset's own ``__getitems__`` where it has one (one index, or a batch: ``_compute_many``).
    Its rows can differ from its ``dataset[i]``: Hugging Face's numpy format gives a float64
    column as np.float64 from ``ds[i]`` and as np.float32 in a batch, its pandas format a one-row
    DataFrame against a dict. Whatever a cache keeps serves every batch, so every value it
    computes - wrap()'s probes, a single miss, a recomputation to verify - is such a row."""
    getitems = own_getitems(dataset)
    if getitems is None:
        return compute_item(dataset, transform, index)
    sample = batch_rows(dataset, getitems([index]), 1)[0]
    return transform(sample) if transform is not None else sample


def batch_rows(dataset: Any, got: Any, n: int) -> list:
    """``got``, what ``dataset.__getitems__`` returned for ``n`` indices, if it is a list of ``n``
    samples (torch's contract) - or a tuple of them, which torch's DataLoader collates alike - else
    InvalidArgument."""
    if type(got) is tuple:
        got = list(got)
    if not isinstance(got, list) or len(got) != n:
        raise InvalidArgument(
            f"{type(dataset).__name__}.__getitems__ of {n} indices returned "
            f"{type(got).__name__}{f' of {len(got)}' if isinstance(got, list) else ''}, not a list "
            f"of {n} samples (torch's contract): a wrapped dataset caches its samples one by "
            f"one; return one sample per index from __getitems__, and batch-level work in collate_fn")
    return got


def compute_each(compute: Callable[[Any], Any], keys: list, keep: Callable[[list], Any]) -> list:
    """``[compute(k) for k in keys]``, a batch's misses one by one. When one raises (a broken
    sample, Ctrl-C) the values computed before it are kept first (``keep(pairs)``: stored and
    counted, while their claims are still held), as one miss after another always kept them."""
    got: list = []
    try:
        for k in keys:
            got.append(compute(k))
    except BaseException:
        if got:
            keep(list(zip(keys, got)))
        raise
    return got


def add_note(exc: BaseException, note: str) -> None:
    """Say on a dataset's exception where shmcache met it (which sample, which stage); its type
    and traceback stay the dataset's. Python 3.10 has no notes: the exception goes on unchanged."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)


def _int_index(i: Any) -> int | None:
    """``i`` as an int if it is one of the integer indices a cache key can be (numpy and one-element
    torch integers, as cache.get takes them); None for any other index (a list, a slice, a str)."""
    if isinstance(i, bool):
        return None
    if isinstance(i, (int, np.integer)):
        return int(i)
    if isinstance(i, torch.Tensor) and i.numel() == 1 and i.dim() == 0 and not (
            i.dtype == torch.bool or i.is_floating_point() or i.is_complex()):
        return int(i)
    if isinstance(i, np.ndarray) and i.ndim == 0 and i.dtype.kind in "iu":
        return int(i)
    return None


def _batch_index(i: Any) -> bool:
    """A list of indices, or a 1-d array or tensor of them: a whole batch in one call."""
    return isinstance(i, list) or (isinstance(i, np.ndarray) and i.ndim == 1) or (
        isinstance(i, torch.Tensor) and i.dim() == 1)


class CachedDataset(Dataset):
    """A map-style dataset whose items come from the cache (computed once, by any process)."""

    def __init__(self, cache: DatasetCache, dataset: Any, transform: Callable | None):
        self.cache = cache
        self.dataset = dataset
        self.transform = transform
        self._len = len(dataset)
        self._len_said = False  # a length changed since wrap() was said (once)
        self._own_fp = _own_fingerprint(dataset)
        self._change_said = False  # a change in place since wrap() was said (once)
        # what a non-int index means, by its type: "dataset" (its own meaning: passed through,
        # uncached) or "cache" (the dataset refused it: a batch gathered from the cache)
        self._index_kinds: dict[type, str] = {}
        # names this dataset to the main process when a worker sends a batch as its keys (NOTE
        # [collated batch]); copies pickled to workers keep it
        self.token = secrets.token_hex(8)
        register_live(self)

    def __len__(self) -> int:
        # the DataLoader's samplers ask each epoch: one len() of the source notices it grew
        if not self._len_said:
            self._check_len()
        if self._own_fp is not None and not self._change_said:
            self._check_changed()
        return self._len

    def _check_changed(self) -> None:
        now = _own_fingerprint(self.dataset)
        if now is None or now == self._own_fp:  # (None: it cannot say now, nothing to compare)
            return
        # a fingerprint moves for what changes nothing, too (HF's formatted_as(): a format set and
        # set back): said only where a probe sample (as wrap() reads them) differs from the cache's
        self._own_fp = now
        if self._probes_unchanged():
            return
        self._change_said = True
        warnings.warn(
            f"{type(self.dataset).__name__} (or a dataset it reads) changed in place since it was wrapped "
            f"(its own fingerprint moved and item 0, n/2 or n-1 differs: set_transform, set_format, ...): the "
            f"wrapped dataset still serves what cache {self.cache.session}/{self.cache.name} holds of it as "
            f"it was; wrap it again (cache.wrap(dataset)) after it changes - its new version gets a cache of "
            f"its own", UserWarning, stacklevel=3)

    def _probes_unchanged(self) -> bool:
        """Items 0, n/2 and n-1 (wrap()'s probes) computed now equal the cache's copies: False where
        one differs, cannot be computed, or none is cached to compare with."""
        n, compared = self._len, 0
        try:
            for i in sorted({0, n // 2, n - 1}) if n else ():
                held = self.cache.store.lookup(i, True, count=False)
                if held is MISSING:
                    continue
                if not same_sample(held, compute_sample(self.dataset, self.transform, i)):
                    return False
                compared += 1
        except Exception:  # noqa: BLE001 - it cannot say: said changed, as its fingerprint is
            return False
        return compared > 0

    def _check_len(self) -> None:
        try:
            now = len(self.dataset)
        except Exception:  # noqa: BLE001 - a source that cannot say: nothing to compare
            return
        if now != self._len:
            self._len_said = True
            warnings.warn(
                f"{type(self.dataset).__name__} has {now} items now, {self._len} when it was wrapped: "
                f"the wrapped dataset serves {self._len} (the cache is named after the dataset as it "
                f"was); wrap it again (cache.wrap(dataset)) after it changes", UserWarning, stacklevel=3)

    def _index(self, i: Any) -> int:
        j = _int_index(i)
        if j is None:
            raise TypeError(f"dataset indices must be integers, not {type(i).__name__}")
        i = j
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
        try:
            return compute_sample(self.dataset, self.transform, int(i))
        except Exception as exc:
            add_note(exc, f"(shmcache: raised by {self._stage(i, read=True)}, computed on a cache miss)")
            raise

    def _stage(self, i: Any, read: bool = False) -> str:
        """Where sample ``i`` was computed, for a note on what it raised: ``read``, by
        compute_sample (through the dataset's own __getitems__ where it has one)."""
        what = "its transform on " if self.transform is not None else ""
        name = type(self.dataset).__name__
        # as compute_sample reads it: a hook set to None (torch's fetcher checks its truth) is none
        batched = read and own_getitems(self.dataset) is not None
        how = f"{name}.__getitems__([{i!r}])" if batched else f"{name}[{i!r}]"
        return f"{what}{how} wrapped in cache {self.cache.session}/{self.cache.name}"

    def _compute_many(self, keys: list[int], keep: Callable[[list], Any] | None = None) -> list:
        """The samples of ``keys`` computed from the source: by its own ``__getitems__`` where it
        has one (torch's contract: a list of samples, in order), else one by one - then, when one
        raises, ``keep(pairs)`` is given those computed before it (``compute_each``)."""
        getitems = own_getitems(self.dataset)
        if getitems is None or len(keys) < 2:
            if keep is not None:
                return compute_each(self._compute, keys, keep)
            return [self._compute(k) for k in keys]
        try:
            got = getitems(keys)
        except Exception as exc:
            add_note(exc, f"(shmcache: raised by {type(self.dataset).__name__}.__getitems__({keys!r}) "
                          f"wrapped in cache {self.cache.session}/{self.cache.name}, on cache misses)")
            raise
        got = batch_rows(self.dataset, got, len(keys))
        return got if self.transform is None else [self.transform(x) for x in got]

    def _store_computed(self, store: Store, i: int, value: Any) -> None:
        try:
            self.cache.put_computed(store, i, value)
        except EncodeError as exc:
            raise EncodeError(f"sample {i} of {type(self.dataset).__name__}: {exc}") from None

    def __getitem__(self, i):
        if type(i) is not int or not 0 <= i < self._len:  # a plain index needs no more checks
            if _int_index(i) is None:
                return self._other_index(i)
            i = self._index(i)
        cache = self.cache
        store = cache.opened  # an attribute, not a call: every warm item comes here
        if store is None:
            store = cache.open_store()
        value = store.lookup(i, cache.copy)
        if value is MISSING:  # computed once, whoever else misses it now (NOTE [claims])
            value = store.fill(i, self._compute, partial(self._store_computed, store), cache.copy)
        elif cache.verify and _VERIFY_RNG.random() < cache.verify:
            self._verify(i, value)
        return value

    def _other_index(self, i: Any) -> Any:
        """``ds[i]`` for an index that is not one int: what the dataset makes of it (passed
        through, uncached), so the wrapper never answers with another container than its
        dataset. A batch of indices that the dataset refuses (it takes ints only) is the
        DataLoader's ``sampler=BatchSampler(...), batch_size=None`` pattern: that one is gathered
        from the cache, collated (the DataLoader then does no collation). Decided at the first
        such index of each type, then kept (workers inherit what the main process found)."""
        kind = self._index_kinds.get(type(i))
        if kind == "cache":
            return self.get_batch(i)
        if kind is None and _batch_index(i) and not isinstance(self.dataset, NoSource):
            try:
                value = compute_item(self.dataset, self.transform, i)
            except Exception:  # noqa: BLE001 - it takes no batch: the cache's batch path does
                self._index_kinds[type(i)] = "cache"
                return self.get_batch(i)
            self._index_kinds[type(i)] = "dataset"
            return value
        if isinstance(self.dataset, NoSource):
            if _batch_index(i):
                return self.get_batch(i)
            raise TypeError(f"dataset indices must be integers, not {type(i).__name__}")
        try:
            return compute_item(self.dataset, self.transform, i)
        except Exception as exc:
            add_note(exc, f"(shmcache: raised by {self._stage(i)}: an index that is not an int is "
                          f"passed to the dataset, uncached)")
            raise

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
        store = cache.open_store()
        if not cache.verify and collates_by_default(sys._getframe(1)):
            batch = gather_collated(store, idx, self if get_worker_info() is not None else None)
            if batch is not None:
                return [Collated(batch)] * len(idx)
        return self.samples(idx)

    def samples(self, keys: np.ndarray) -> list:
        """The samples of ``keys`` from one batch lookup (verified if asked); misses computed and stored."""
        cache = self.cache
        store = cache.open_store()
        idx = keys.tolist()
        values, missing = store.lookup_batch(idx, cache.copy)
        if cache.verify:
            hits = set(range(len(idx))) - set(missing)
            for j in hits:
                if _VERIFY_RNG.random() < cache.verify:
                    self._verify(idx[j], values[j])
        if missing:
            got = self.fill_misses(store, [idx[j] for j in missing])[0]
            for j, value in zip(missing, got):
                values[j] = value
        return values

    def fill_misses(self, store: Store, keys: list, *, as_misses: bool = False) -> tuple[list, int]:
        """The values of ``keys``, all missed: those this process claims computed in one
        ``_compute_many`` (the dataset's ``__getitems__`` when it has one) and stored a chunk at
        a time, the rest waited for (NOTE [claims]); and how many this process computed.
        ``as_misses``: count those as misses too (a warm-up's, which looked nothing up) - also
        the ones kept when a sample raises (Ctrl-C), which no return value reports."""
        computed = 0

        def keep(pairs: list) -> None:
            keep_computed(self._store_many, store, pairs)
            if as_misses:
                store.count_misses(len(pairs))

        def compute_many(ks: list) -> list:
            nonlocal computed
            got = self._compute_many(ks, keep)
            made = sum(type(v) is not Served for v in got)
            if as_misses:
                store.count_misses(made)
            computed += made
            return got

        values = store.fill_batch(keys, compute_many, partial(self._store_many, store), self.cache.copy)
        return values, computed

    def _store_many(self, store: Store, pairs: list) -> None:
        """Store computed samples; one that cannot be encoded raises after the others are
        stored (it loses only itself, as when they were stored one miss at a time)."""
        items, failed = self.cache.encode_many(pairs)
        self.cache.put_encoded(store, items)
        if failed is not None:
            raise EncodeError(f"sample {failed[0]} of {type(self.dataset).__name__}: {failed[1]}") from None

    def get_batch(self, indices: Sequence, fn: Callable | None = None, out: Any = None) -> Any:
        """A collated batch (the vectorised path), misses computed from the dataset (or ``fn``).

        Same signature as ``ShmDatasetCache.get_batch``, so a wrapped dataset can feed
        ``PrefetchRing.from_cache(ds, key_batches)`` directly.
        """
        # fn_many only where the source computes a batch in one call: one by one, the cache's
        # get_batch keeps what was computed before a sample raises
        many = None if fn or own_getitems(self.dataset) is None else self._compute_many
        return self.cache.get_batch(self._indices(indices), fn=fn or self._compute, out=out, fn_many=many)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()  # the cache pickles by name (ShmDatasetCache.__getstate__)
        # the namedtuple classes this process decodes by go along: a spawned worker decodes
        # records as the same classes (NOTE [record format]); those pickle cannot find stay
        state["_namedtuples"] = [tp for tp in codec.registered_namedtuples() if _picklable(tp)]
        return state

    def __setstate__(self, state: dict) -> None:
        for tp in state.pop("_namedtuples", ()):
            codec.register_namedtuple(tp)
        self.__dict__.update(state)
        register_live(self)  # a worker's copy, or a copy made in this process: either serves the token


def keep_computed(store_many: Callable[[Store, list], Any], store: Store, pairs: list) -> None:
    """``compute_each``'s keep: store the (key, value) pairs computed before a raise, counted."""
    store_many(store, pairs)
    store.count_computed(len(pairs))


def _picklable(tp: type) -> bool:
    try:
        pickle.dumps(tp)
    except Exception:  # noqa: BLE001 - a class pickle cannot find by its name
        return False
    return True
