"""``CachedIterableDataset``, what ``ShmDatasetCache.wrap`` returns for an iterable dataset: the
first full pass of each stream records, later passes replay - in the recorded order, or, with
``wrap(reshuffle=True)``, in an order drawn from the epoch - and a source whose order follows
its epoch (``set_epoch``) is never replayed in another epoch's order without a word.

NOTE [stream records]
    A stream is a rank and a DataLoader worker (``0.1of2``; ``0.main`` without workers). A pass
    records item i under ``<keys>:i``, where ``<keys>`` is the stream, or the stream in the
    pass's epoch (``0.main@3``) for a source with ``set_epoch``: a put keeps what is there, so
    two epochs' passes under one set of keys would mix their positions. After a whole pass, and
    only then, the stream's marker ``__stream__:<stream>`` is put: ``(items, epoch, keys, whole)``
    (epoch -1: not known; ``whole``: every item of the pass is stored). It is never replaced (a
    put keeps it): no marker is put for a pass a ``clear()`` ran into (its item 0 gone at its end,
    or re-recorded after a clear met mid-replay), so the next pass records whole. A replay reads
    the marker's keys: in the recorded epoch (or with no epoch known) in order, filling a missing
    item from the source at the same position; in another epoch of a source with ``set_epoch``
    (or with reshuffle=True), in an order drawn from the epoch if reshuffle, else in the recorded
    order - and where the recording is not whole, that epoch is the source's own pass, nothing
    stored (its positions are not the recorded epoch's). A bare count (an older marker) is items
    under the stream's keys in an unknown epoch, not whole.
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..base import settings
from ..cache.store import MISSING
from ..cache.store_protocol import Store
from ..errors import InvalidArgument
from .wrapped import DatasetCache

__all__ = ["CachedIterableDataset", "check_reshuffle", "read_head"]

_NO_EPOCH = -1  # in the epoch tensor and a stream's marker: none was set, none is known


def check_reshuffle(reshuffle: Any, iterable: bool) -> bool | None:
    """``wrap(reshuffle=)`` checked: None, True or False, for an iterable dataset only."""
    if reshuffle is None:
        return None
    if not isinstance(reshuffle, bool):
        raise InvalidArgument(f"reshuffle must be True or False (or None, the default), got {reshuffle!r:.80}")
    if not iterable:
        raise InvalidArgument("reshuffle= is for an iterable dataset (a stream); a map-style dataset is shuffled "
                              "by the DataLoader's sampler: DataLoader(ds, shuffle=True) reshuffles each epoch")
    return reshuffle


class CachedIterableDataset(IterableDataset):
    """An iterable dataset: the first full pass records, later passes replay from the cache.

    Each stream (rank x DataLoader worker) records its own sequence under its own keys, with a
    completion marker written only after a full pass (NOTE [stream records]); a pass that was cut
    short, or finds an item missing, reads the source again and fills the gaps.

    DataLoader workers: each worker gets its own copy of the dataset and records what *its* copy
    yields, under its own keys (``RANK.<worker id>of<num_workers>``). An unsharded stream is thus
    read, yielded and stored once per worker (what PyTorch does with any IterableDataset), so
    shard it in the source's ``__iter__`` with ``torch.utils.data.get_worker_info()`` (for example
    ``itertools.islice(items, info.id, None, info.num_workers)``); a different ``num_workers`` (or
    world size) records anew.

    Epochs: the epoch of a pass is the source's own (a public int ``epoch``, as Hugging Face's
    ``IterableDataset`` has), else the one ``set_epoch`` last gave the wrapper. A source whose
    order may follow its epoch (it has ``set_epoch``), replayed in a later epoch:
    - ``reshuffle=True``: each epoch in an order of its own, drawn from the epoch (the same epoch
      the same order), each item once;
    - ``reshuffle=False``: the recorded order, quietly;
    - ``None`` (the default): the recorded order, said once per job.
    Where the cache lacks items of the recorded pass (too large, or the cache full), such an
    epoch is read from the source in its own order, not filled in: the recorded positions are
    another epoch's.
    """

    def __init__(self, cache: DatasetCache, dataset: Iterable, transform: Callable | None,
                 one_shot: bool = False, pending: tuple[int, list, Any, int | None] | None = None,
                 reshuffle: bool | None = None):
        self.cache = cache
        self.dataset = dataset
        self.transform = transform
        self.reshuffle = reshuffle
        self._one_shot = one_shot  # a plain iterator: one pass of the source, ever
        self._pending = pending  # pid, the items wrap() read, their iterator, the epoch they were read in
        # set_epoch's epoch, in shared memory: a persistent DataLoader worker, started before the
        # next set_epoch, holds a copy of this object made then, and reads the epoch from here
        self._epoch = torch.full((), _NO_EPOCH, dtype=torch.int64)
        try:
            self._epoch.share_memory_()
        except RuntimeError:  # /dev/shm full: the cache serves the source then, and so must wrap()
            pass  # (a persistent worker then keeps the epoch it started with)
        # the epoch wrap() read those items in: a first pass in another epoch opens its own
        self._pending_epoch = pending[3] if pending is not None else None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pending"] = None  # the items wrap() read belong to this process's first pass
        return state

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next passes are (what HF's Trainer and a training loop call before each
        epoch), passed on to the source's own ``set_epoch``: a first pass reads the source in
        that epoch's order; with ``reshuffle=True``, a replay's order is drawn from it."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or not 0 <= epoch < 1 << 62:
            raise InvalidArgument(f"set_epoch() takes the epoch as an int >= 0, got {epoch!r:.80}")
        self._epoch.fill_(int(epoch))
        theirs = _source_set_epoch(self.dataset)
        if theirs is not None:
            theirs(int(epoch))

    def _epoch_now(self) -> int | None:
        """This pass's epoch: the source's own when it tells it (it decides its order), else
        set_epoch's; None when neither is known."""
        theirs = _source_epoch(self.dataset)
        if theirs is not None:
            return theirs
        own = int(self._epoch)
        return own if own != _NO_EPOCH else None

    def _source(self):
        """The source for a recording pass: the items wrap() read, then the rest of their
        iterator (first pass in this process), else a fresh iterator of the dataset."""
        pending, self._pending = self._pending, None
        # not in a DataLoader worker, even a forked one that inherited it: a worker opens its own
        # iterator (a source that shards by get_worker_info() must see the worker)
        if pending is not None and pending[0] == os.getpid() and get_worker_info() is None and not self._moved_since(
                self._pending_epoch):
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

    def _moved_since(self, epoch: int | None) -> bool:
        """Whether the source's order may differ from the one it had in ``epoch``: it has
        set_epoch and the epoch moved (a run resumed at epoch 3 after wrap() read epoch 0's items)."""
        return self._epoch_now() != epoch and _source_set_epoch(self.dataset) is not None

    def _stream(self) -> str:
        info = get_worker_info()
        worker = f"{info.id}of{info.num_workers}" if info is not None else "main"
        return f"{settings.get(settings.ENV_RANK, '0')}.{worker}"

    def __iter__(self):
        store = self.cache.open_store()
        stream = self._stream()
        marker = f"__stream__:{stream}"
        epoch = self._epoch_now()
        if self.reshuffle and epoch is None:  # said at the first pass, not after a whole epoch
            raise InvalidArgument(
                f"wrap(reshuffle=True) of {type(self.dataset).__name__} needs the epoch of each pass, "
                f"and neither the wrapped dataset nor its source was given one: call "
                f"ds.set_epoch(epoch) on the wrapped dataset before each epoch")
        recorded = _recorded(store.lookup(marker, count=False), stream)
        if recorded is None:
            yield from self._record(store, self._keys_of(stream, epoch), marker, epoch, skip=0)
            return
        self._pending = None
        total, at, keys, whole = recorded
        # another epoch than the recorded one (or one not known then), of a source whose order may
        # follow its epoch, or that the user asked to be reshuffled
        if epoch is not None and epoch != at and (self.reshuffle or _source_set_epoch(self.dataset) is not None):
            yield from self._replay_moved(store, stream, keys, marker, epoch, total, at, whole)
            return
        for i in range(total):
            value = store.lookup(f"{keys}:{i}", self.cache.copy)
            if value is MISSING:  # its lookup counted its miss
                yield from self._record(store, keys, marker, epoch, skip=i, counted=True)
                return
            yield value

    def _keys_of(self, stream: str, epoch: int | None) -> str:
        """Where a recording pass in ``epoch`` puts its items: under the stream's name, or, for a
        source whose order may follow its epoch, the stream's in that epoch (``0.main@3``). A pass
        cut short leaves its epoch's positions behind, and a put keeps what is there: a whole pass
        in another epoch under the same keys recorded two epochs' positions, an item twice and
        another lost in every replay."""
        if epoch is None or _source_set_epoch(self.dataset) is None:
            return stream
        return f"{stream}@{epoch}"

    def _replay_moved(self, store: Store, stream: str, recorded: str, marker: str, epoch: int, total: int,
                      at: int | None, whole: bool):
        """A replay in epoch ``epoch`` of a pass recorded in epoch ``at`` of a source whose order
        may follow its epoch: the recorded items in an order drawn from the epoch (reshuffle),
        else in the recorded order. A recorded pass the cache does not hold whole is this epoch's
        source read in its own order (its positions are the recorded epoch's), nothing stored.
        ``whole``: the recording pass stored every item (its marker says so), so only a clear()
        since can have taken one, and the replay meets it; else each is looked for first."""
        def key(i) -> str:
            return f"{recorded}:{i}"

        if not whole and not all(store.contains(key(i)) for i in range(total)):
            if self.reshuffle and _source_set_epoch(self.dataset) is None:  # its own order: one for all epochs
                self.cache.say_once("replayed", "not reshuffled", (
                    f"cache {self.cache.session}/{self.cache.name}: wrap(reshuffle=True): epoch {epoch} of the "
                    f"stream {type(self.dataset).__name__} is read from the source in its own order, the same "
                    f"each epoch, as the cache lacks items of it (too large for the cache, or the cache was "
                    f"full): give the cache a size= that holds the whole stream, or shuffle after the cache "
                    f"(warned once per job)"))
            yield from self._read_through(store)
            return
        if self.reshuffle:
            order = np.random.default_rng([epoch, zlib.crc32(stream.encode())]).permutation(total)
        else:
            order = range(total)
            if self.reshuffle is None:
                # one mark for every stream of the cache: a mark per stream (worker, rank) had
                # each overwrite the others' in the one root word, and say it again every epoch
                self.cache.say_once("replayed", "recorded order", (
                    f"cache {self.cache.session}/{self.cache.name}: epoch {epoch} of the stream "
                    f"{type(self.dataset).__name__} is replayed in the order the cache recorded in "
                    f"{'epoch ' + str(at) if at is not None else 'its first pass'}; if the source "
                    f"reorders each epoch (set_epoch: a shuffled Hugging Face stream), wrap it with "
                    f"reshuffle=True to replay each epoch in an order drawn from the epoch, or "
                    f"reshuffle=False to keep the recorded order without this warning (warned once per job)"))
        for n, i in enumerate(order):
            value = store.lookup(key(i), self.cache.copy)
            if value is MISSING:  # cleared since the check above: the rest as the source gives it
                # (its positions are this epoch's, not those this pass yielded: items n.. of this
                # epoch may repeat some of those and miss others - the rest of them went with the
                # clear - so it is said; the pass keeps its length, as ranks of a job must)
                self.cache.say_once("replayed", "cleared", (
                    f"cache {self.cache.session}/{self.cache.name} was cleared during epoch {epoch} of the "
                    f"stream {type(self.dataset).__name__}, replayed in an order other than the source's: "
                    f"the rest of this epoch is read from the source, and may repeat items the epoch gave "
                    f"already and miss others (warned once per job)"))
                # no marker after it: the clear took the recorded pass's, and the next pass records whole
                yield from self._record(store, self._keys_of(stream, epoch), marker, epoch, skip=n, counted=True,
                                        mark=False)
                return
            yield value

    def _read_through(self, store: Store):
        """A pass of the source as it is now, each item computed and counted, none stored."""
        for sample in self._source():
            store.count_computed()
            store.count_misses()
            yield self.transform(sample) if self.transform is not None else sample

    def _record(self, store: Store, keys: str, marker: str, epoch: int | None, skip: int,
                counted: bool = False, mark: bool = True):
        """Record the stream under ``keys`` (``_keys_of``) from item ``skip`` on (``counted``: item
        ``skip``'s miss was counted by the replay's lookup that found it missing), then (``mark``)
        the marker: the pass's length, its ``epoch``, its keys, and whether every item it put is
        stored (the items before ``skip`` were found)."""
        count, whole = 0, True
        first = skip > 0  # item 0 is in the cache: found by this pass's replay, or stored below
        for i, sample in enumerate(self._source()):
            count = i + 1
            if i < skip:
                continue  # already yielded from the cache in this pass
            value = self.transform(sample) if self.transform is not None else sample
            store.count_computed()
            if not (counted and i == skip):
                store.count_misses()  # not in the cache: computed, as a warm-up's items count
            stored = self.cache.put_computed(store, f"{keys}:{i}", value)
            first, whole = first or (i == 0 and stored), whole and stored
            yield value
        # a clear() (another process's too) during the pass took what was stored before it, the marker
        # of the pass it replayed included: item 0, stored or found, says whether one came. No marker
        # then: one would name items that are gone, and a replay in another epoch never fills them in
        # (it reads the source, each epoch from then on); the next pass records whole
        if mark and not (first and not store.contains(f"{keys}:0")):  # only after a full pass
            store.put(marker, (count, _NO_EPOCH if epoch is None else epoch, keys, whole))


def _recorded(marker: Any, stream: str) -> tuple[int, int | None, str, bool] | None:
    """``(items, epoch, keys, whole)`` of ``stream``'s marker: the epoch None where it was not
    known; the keys the stream's own, and ``whole`` False (not known), where the marker was
    written before markers named them (a bare count, or fewer fields); a later version's fields
    past these four are not read. None for no marker, or one of no shape known here: the stream is
    then recorded again, and replayed by whoever can read its marker."""
    if marker is MISSING:
        return None
    if isinstance(marker, int) and not isinstance(marker, bool):
        marker = (marker, _NO_EPOCH)
    if not isinstance(marker, tuple) or len(marker) < 2:
        return None
    total, at, keys, whole = (*marker, stream, False)[:4] if len(marker) == 2 else (*marker, False)[:4]
    if not (_count(total) and (at == _NO_EPOCH or _count(at)) and isinstance(keys, str)):
        return None
    return total, (None if at == _NO_EPOCH else at), keys, whole is True


def _count(value: Any) -> bool:
    """A plain int >= 0 (a marker's field)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_head(dataset: Iterable, n: int) -> tuple[list, Any, int | None]:
    """An unnamed wrap's first ``n`` items of ``dataset`` (what names its cache), the iterator
    they came from, and the epoch they were read in. A source whose order follows its epoch is
    read in epoch 0, its epoch then put back: the name must not depend on where a run starts (a
    run resumed at epoch 2 must find the cache its epoch-0 warm-up made)."""
    theirs, at = _source_set_epoch(dataset), _source_epoch(dataset)
    if theirs is None or not at:  # no epoch to move, or epoch 0 (or one not known) already
        it = iter(dataset)
        return list(itertools.islice(it, n)), it, at
    theirs(0)
    try:
        it = iter(dataset)
        return list(itertools.islice(it, n)), it, 0
    finally:
        theirs(at)


def _source_epoch(dataset: Any) -> int | None:
    """The source's own epoch, where it tells it: a public ``epoch`` that is an int >= 0 (HF's
    stream's, a numpy int, a 0-d integer tensor); None where it has none of those."""
    try:
        theirs = getattr(dataset, "epoch", None)
    except Exception:  # noqa: BLE001 - a dataset's __getattr__ may raise anything: no epoch of its own
        return None
    if (isinstance(theirs, torch.Tensor) and theirs.numel() == 1 and not theirs.is_floating_point()
            and not theirs.is_complex() and theirs.dtype != torch.bool):
        theirs = int(theirs)  # an epoch shared with persistent workers, as HF's stream keeps its own
    if isinstance(theirs, (int, np.integer)) and not isinstance(theirs, bool) and theirs >= 0:
        return int(theirs)
    return None


def _source_set_epoch(dataset: Any) -> Callable | None:
    """The source's own ``set_epoch``, where it has one: its order may follow its epoch."""
    try:
        theirs = getattr(dataset, "set_epoch", None)
    except Exception:  # noqa: BLE001 - a dataset's __getattr__ may raise anything: none
        return None
    return theirs if callable(theirs) else None
