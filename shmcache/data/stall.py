"""Which cache a training loop's waits count for, and ``timed(loader)``: a loop over any iterable
of batches with each wait counted (NOTE [stall counts]).

What is measured where:

- ``PrefetchRing``: the consumer's wait for a filled slot (``_RingIterator.__next__``), counted
  for the ring's cache (``from_cache``'s, else the cache of the wrapped dataset its source reads).
- ``sink_loop``: each ``next()`` on ``batches`` when it is a DataLoader (or anything with a
  ``.dataset`` chain) over a wrapped dataset; a ``PrefetchRing`` or a ``timed`` given to it
  counts itself.
- A plain ``for batch in loader`` over a DataLoader: wrap it, ``for batch in timed(loader)``.
  shmcache does not patch torch's DataLoader iterator: with workers, the main process's wait
  happens inside torch (its result queue), where no shmcache code runs, and with 0 workers the
  time inside ``__getitems__`` leaves out the sampler, collate and ``pin_memory``. ``timed``
  measures what the training loop sees: from asking the iterator for the next batch to having
  it, whatever the number of workers. A loop that is not wrapped is not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..cache import stall as counts

__all__ = ["timed", "Timed", "counts_for", "measured"]


def _cache_of(obj: Any) -> Any:
    """The ShmDatasetCache behind ``obj``: itself, a wrapped dataset's, or through ``.dataset``
    (a DataLoader, a Subset), a few links deep; None when there is none."""
    from .dataset import ShmDatasetCache
    from .stream import CachedIterableDataset
    from .wrapped import CachedDataset

    for _ in range(4):
        if obj is None:
            return None
        if isinstance(obj, ShmDatasetCache):
            return obj
        if isinstance(obj, (CachedDataset, CachedIterableDataset)):
            return obj.cache
        obj = getattr(obj, "dataset", None)
    return None


def counts_for(obj: Any) -> counts.StallCounts | None:
    """The stall counts a loop over ``obj`` counts into (None: no cache behind it, or an
    uncached one); a failure to find them is no reason to fail the loop."""
    try:
        cache = _cache_of(obj)
        return None if cache is None else counts.counts_for_store(cache.store)
    except Exception:  # noqa: BLE001 - a closed cache, an odd object: no counts, the loop goes on
        return None


def measured(obj: Any) -> bool:
    """Whether iterating ``obj`` counts its own waits (a Timed, a PrefetchRing: each says so with
    ``counts_own_waits``, so this module needs neither's module)."""
    return getattr(type(obj), "counts_own_waits", False) is True


class Timed:
    """``batches`` iterated with each wait for a batch counted (``timed``); re-iterable when
    ``batches`` is, with its length."""

    counts_own_waits = True  # a loop over it counts no waits of its own (measured)

    def __init__(self, batches: Iterable[Any], stall_counts: counts.StallCounts | None):
        self.batches = batches
        self.counts = stall_counts

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.batches)
        if self.counts is None:
            yield from iterator
            return
        one = counts.Pass(self.counts)
        try:
            while True:
                asked = one.ask()
                try:
                    batch = next(iterator)
                except BaseException:
                    one.got(asked, batch=False)
                    raise
                one.got(asked)
                yield batch
        except StopIteration:
            return
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()


def timed(batches: Iterable[Any], cache: Any = None) -> Timed:
    """``for batch in shmcache.timed(loader)``: the same batches, with the time the loop waits for
    each counted for this rank in ``cache``'s stall counts (``stats()["ranks"]``, ``shmcache
    top``); ``cache`` defaults to the cache of the wrapped dataset ``batches`` reads (a DataLoader's
    ``.dataset``). Nothing is counted when there is none."""
    return Timed(batches, counts_for(batches if cache is None else cache))
