"""The DataLoader's collated batch: ``DataLoader(ds, batch_size=B)`` over a ``CachedDataset`` gets
its batches from the vectorised gather, exactly as ``default_collate`` would make them (NOTE
[collated batch]); a DataLoader worker sends a warm batch as its keys.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from ..base import trees
from ..cache import codec
from ..cache.store_protocol import Store
from ..errors import InvalidArgument
from .tensors import column_tensor, torch_dtype
from .torch_private import FETCH_CODE, default_collate_fn_map

__all__ = ["gather_collated", "collates_by_default", "Collated", "register_live"]

# NOTE [collated batch]
#     ``DataLoader(ds, batch_size=B)`` calls ``ds.__getitems__(indices)`` and hands what it returns
#     to its ``collate_fn`` (torch_private.FETCH_CODE: torch's map-style fetcher). Samples one by
#     one, stacked again by default_collate, cost 5-10x the vectorised gather. So when the caller is
#     torch's fetcher and its collate_fn is default_collate itself, __getitems__ gathers the batch
#     already collated and returns it as a list of n references to one ``Collated`` marker;
#     default_collate looks only at ``type(batch[0])``, finds ``Collated`` in its
#     ``default_collate_fn_map`` (registered below: a type of our own, so nobody else's collation
#     changes) and returns the batch. ``gather_collated`` builds exactly what default_collate would
#     (dtypes, shapes, dict/list/tuple types), and refuses (None: item by item) what it cannot.
#     Any other caller - a custom collate_fn, a wrapper around default_collate, a direct call, a
#     torch whose fetcher looks different - gets the plain list of samples, as before.
#
#     In a DataLoader worker the collated batch would cross the worker's queue pickled: tensors
#     moved to a new shared-memory segment, sent by file descriptor, mapped again by the main
#     process - more work than the gather itself, for data that is in shared memory already. So a
#     worker that finds every key of a batch in memory with one layout (store.all_in_memory)
#     returns a ``_Keys`` batch instead: it pickles as the dataset's token and the keys, and
#     unpickling it in the main process (or its pin-memory thread) gathers the batch there, from
#     the CachedDataset registered under that token (``_LIVE``). If the cache lost items meanwhile
#     (clear()), the main process reads them item by item, computing misses. A worker's own
#     misses, cold epochs and every other sample type are computed in the worker as before.


def gather_collated(store: Store, keys: np.ndarray, sent_from: Any = None) -> Any:
    """The batch of int ``keys`` exactly as ``default_collate`` makes it from the samples
    (NOTE [collated batch]), gathered by the vectorised path; None when the batch is not all
    cached in memory with one layout, or holds a field default_collate would not stack the
    same way (None, pickled objects, dtypes torch lacks): the caller then goes item by item.
    ``sent_from``: the CachedDataset asking, in a DataLoader worker (see the code)."""
    layout = store.batch_layout(keys)
    if layout is None:
        return None
    spec, leaves = layout[:2]
    dtypes = [_collated_dtype(leaf) for leaf in leaves]
    if None in dtypes:
        return None
    if sent_from is not None:
        # in a DataLoader worker: a warm batch crosses the queue as its keys, and the main
        # process gathers it from the cache itself (NOTE [collated batch])
        return _Keys(sent_from, keys) if store.all_in_memory(keys) else None
    got = store.gather_ints(keys)
    if got is None:
        return None
    columns = [c if d is str else column_tensor(c, leaf) for c, leaf, d in zip(got[2], leaves, dtypes)]
    return trees.rebuild(spec, iter(columns), collated=True)


def _collated_dtype(leaf: codec.Leaf) -> Any:
    """The torch dtype default_collate gives a column of ``leaf`` (str for str/bytes: a list of
    them), or None where its result would differ from a stacked column (None, pickled objects) or
    torch has no such dtype (default_collate raises there: the item-by-item path lets it)."""
    tag = leaf.tag
    if tag in ("s", "y"):
        return str
    if tag == "e":  # tensors; other registered types (PIL images) are not stacked by default_collate
        return getattr(torch, leaf.meta.split(":", 1)[0], None) if leaf.ext == "torch" else None
    if tag not in ("i", "f", "b", "a"):
        return None
    return torch_dtype(leaf.dtype)


class Collated:
    """Every element of a batch that __getitems__ returned already collated (default_collate
    returns its ``batch``: registered below)."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch


def _collate_gathered(batch: list, *, collate_fn_map: dict | None = None) -> Any:
    return batch[0].batch


default_collate_fn_map[Collated] = _collate_gathered

# token -> the CachedDatasets of this process that carry it (copies of one dataset, same cache)
_LIVE: dict[str, weakref.WeakSet] = {}


def register_live(ds: Any) -> None:
    """Serve ``ds`` (a CachedDataset) under its token to the batches its workers send as keys."""
    _LIVE.setdefault(ds.token, weakref.WeakSet()).add(ds)


class _Keys:
    """A warm batch in a worker: pickled as its keys, gathered where it is unpickled."""

    __slots__ = ("ds", "keys")

    def __init__(self, ds: Any, keys: np.ndarray):
        self.ds, self.keys = ds, keys

    def __reduce__(self):
        return _gather_sent, (self.ds.token, self.keys.tobytes())


def _gather_sent(token: str, raw: bytes) -> Any:
    """Unpickling a ``_Keys`` batch: gather it here (NOTE [collated batch])."""
    ds = next(iter(_LIVE.get(token, ())), None)
    if ds is None:  # the DataLoader holds its dataset: only a process that is not its parent gets here
        raise InvalidArgument(f"a DataLoader batch arrived for a CachedDataset (token {token}) "
                              f"that this process no longer holds; keep the dataset alive while "
                              f"its DataLoader runs")
    keys = np.frombuffer(raw, np.int64)
    store = ds.cache.open_store()
    batch = gather_collated(store, keys)
    if batch is None:  # cleared since the worker looked: item by item, computing misses
        batch = default_collate(ds.samples(keys))
    return batch


def collates_by_default(frame: Any) -> bool:
    """True if ``frame`` (__getitems__'s caller) is torch's map-style fetcher collating with
    default_collate (NOTE [collated batch])."""
    if frame.f_code is not FETCH_CODE:
        return False
    fetcher = frame.f_locals.get("self")
    return getattr(fetcher, "collate_fn", None) is default_collate
